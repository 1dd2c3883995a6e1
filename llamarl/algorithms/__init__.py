"""RL algorithms: group-relative advantages and the AIPO loss (eager PyTorch specification).

The fused, memory-bounded version of the loss that starts from the last hidden states lives in
``llamarl_kernels.fused_aipo_loss`` and computes the same objective.
"""

from llamarl.algorithms.advantages import group_advantages
from llamarl.algorithms.aipo import aipo_loss, token_logprobs
from llamarl.algorithms.lr_schedule import lr_at

__all__ = ["aipo_loss", "group_advantages", "lr_at", "token_logprobs"]
