"""Group-relative advantages: one scalar per sampled completion, from the rewards of its group.

Layout: ``rewards`` is ``[B]`` laid out prompt-major — the ``n = group_size`` completions of prompt 0
first, then the ``n`` of prompt 1, and so on, so ``rewards.view(B // n, n)`` puts one group per row.
For a group with rewards ``r_1 .. r_n`` (mean ``r̄``):

    method="mean"  (AIPO / LlamaRL baseline)   A_i = r_i − r̄
    method="grpo"  (DeepSeekMath GRPO)         A_i = (r_i − r̄) / (s + eps),
                                               s = sqrt(Σ_j (r_j − r̄)² / (n − 1))   (Bessel-corrected)
    method="rloo"  (REINFORCE leave-one-out)   A_i = r_i − (Σ_{j≠i} r_j) / (n − 1) = n/(n − 1) · (r_i − r̄)
    method="reinforce_baseline"                A_i = (r_i − r̄) / (σ + eps),
           (REINFORCE++-baseline: OpenRLHF's   σ = sqrt(Σ_b Σ_j (r_j − r̄_b)² / (K − 1)) over the K valid
            reinforce_baseline, veRL's         samples of the batch: the group baseline scaled by the
            reinforce_plus_plus_baseline)      batch's spread, not each group's (a near-flat group stays small)

Failed samples (``valid[i] = False``: the verifier raised or timed out, so r_i = 0 means nothing) take
no part: each group's statistics run over its k valid members (n → k above), and a failed sample's
advantage is 0. A group with k < 2 valid members gets zeros (no baseline without the sample itself).
Without this, one verifier crash in a group of correct answers would read as a wrong answer and push the
others up.

The batch of "reinforce_baseline" is the ``rewards`` passed in (a training step's samples). Its centred
rewards already have batch mean 0 (each group's sum to 0), so the whitening those frameworks apply is the
division alone; they whiten per token, which weighs a sample by its length, and here it is per sample.

Invariants: every method gives advantages that sum to zero over each group's valid members (so a group
whose valid completions all earn the same reward contributes no gradient), and the result has the
shape and device of ``rewards`` and its dtype if floating (float32 for integer/bool rewards). Every
method but "mean" needs ``n ≥ 2``; "mean" with ``n = 1`` is defined and gives zeros. Arithmetic runs in
float64 and is cast back; for fp32 rewards of moderate range the float64 sums are exact, so then the values
do not depend on the order of the sums.
"""

from __future__ import annotations

import operator

import torch

METHODS = ("mean", "grpo", "rloo", "reinforce_baseline")


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    method: str = "mean",
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages ``[B]`` for prompt-major ``rewards [B]`` in consecutive groups of ``group_size``;
    ``valid [B]`` (bool, default all true) marks the samples whose reward counts (module docstring).

    Integer or boolean rewards are accepted and give float32 advantages; floating rewards keep
    their dtype. Raises ``ValueError`` on a bad shape, group size, method, eps or non-finite reward.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"group_advantages: rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(
            f"group_advantages: rewards must be 1-D [B] (prompt-major groups), got shape "
            f"{tuple(rewards.shape)}; flatten [prompts, n] with rewards.reshape(-1)"
        )
    try:  # operator.index: ints, numpy ints; not bools, floats
        size = -1 if isinstance(group_size, bool) else operator.index(group_size)
    except TypeError:
        size = -1
    if size < 1:
        raise ValueError(f"group_advantages: group_size must be a positive int, got {group_size!r}")
    group_size = size
    if method not in METHODS:
        raise ValueError(f"group_advantages: method must be one of {METHODS}, got {method!r}")
    if not (eps > 0.0):  # also rejects NaN
        raise ValueError(f"group_advantages: eps must be > 0 (keeps grpo finite on constant groups), got {eps!r}")
    batch = rewards.numel()
    if batch == 0 or batch % group_size != 0:
        raise ValueError(
            f"group_advantages: rewards has {batch} entries, which is not a positive multiple of "
            f"group_size={group_size}; pass all n completions of every prompt"
        )
    if method != "mean" and group_size < 2:
        raise ValueError(f"group_advantages: method={method!r} needs group_size >= 2, got {group_size}")

    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(torch.float64).view(batch // group_size, group_size)
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else _valid_mask(valid, rewards).view_as(r)
    if not bool((torch.isfinite(r) | ~ok).all()):
        bad = (~torch.isfinite(r) & ok).flatten().nonzero()[0].item()
        raise ValueError(f"group_advantages: rewards[{bad}] is {rewards[bad].item()}; rewards must be finite")
    k = ok.sum(dim=1, keepdim=True).to(torch.float64)  # valid members per group
    r = torch.where(ok, r, 0.0)  # a failed sample's reward (finite or not) is not read
    mean = r.sum(dim=1, keepdim=True) / k.clamp(min=1)
    # a flat group is exactly zero: its rounded mean (six 0.1s do not sum to 0.6) would leave ±1e-17 residues,
    # which grpo's division blows up and which keep the trainer from skipping rows that carry no gradient
    flat = torch.where(ok, r, -torch.inf).amax(1, keepdim=True) == torch.where(ok, r, torch.inf).amin(1, keepdim=True)
    centered = torch.where(ok & ~flat, r - mean, 0.0)
    if method == "mean":
        adv = centered
    elif method == "grpo":
        std = (centered.pow(2).sum(dim=1, keepdim=True) / (k - 1).clamp(min=1)).sqrt()
        adv = torch.where(k >= 2, centered / (std + eps), 0.0)
    elif method == "rloo":  # r_i minus the mean of the other k - 1 valid rewards
        adv = torch.where(k >= 2, centered * (k / (k - 1).clamp(min=1)), 0.0)
    else:  # reinforce_baseline: the group baseline over the batch's spread
        total = k.sum()
        std = (centered.pow(2).sum() / (total - 1).clamp(min=1)).sqrt()
        adv = torch.where(total >= 2, centered / (std + eps), 0.0)
    return adv.reshape(batch).to(out_dtype)


def _valid_mask(valid: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != rewards.shape:
        raise ValueError(f"group_advantages: valid must be a bool tensor of shape {tuple(rewards.shape)}, got "
                         f"{valid.dtype if isinstance(valid, torch.Tensor) else type(valid).__name__} "
                         f"{tuple(getattr(valid, 'shape', ()))}")
    return valid.to(rewards.device)
