"""Gradient-norm clipping for the trainer's parameters, plain (one rank, DDP) or FSDP-sharded (DTensor).

Kept apart from ``llamarl.parallel.fsdp`` so a single-rank trainer does not import torch.distributed.fsdp and
torch.distributed.tensor (about 1.5 s per process on a 2-core CPU) to clip its gradients.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for plain or FSDP (DTensor) gradients; returns the global L2 norm.

    The norm is that of the whole, unsharded gradient: each rank takes the norm of its shards and the
    squares are summed over the mesh (a collective: call it on every rank), so every rank gets the same
    norm and scales its shards by the same factor min(1, max_norm / (norm + 1e-6)). ``max_norm`` 0 or
    inf only measures. A non-finite norm is returned as is (the caller decides to skip the step).
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before that module is imported
    if dtensor is not None and isinstance(norm, dtensor.DTensor):
        norm = norm.full_tensor()
    if 0 < max_norm < float("inf") and bool(torch.isfinite(norm)):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
