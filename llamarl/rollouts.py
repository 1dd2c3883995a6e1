"""Rollouts: what a generator produced for one prompt, and how a group of them becomes a training batch.

A rollout is one completion y of a prompt x, sampled by the generator under its policy μ, with, per
generated token t: the token id y_t, log μ(y_t | x, y_<t) (the engine's convention: log_softmax of the
temperature-scaled logits, fp32) and the policy version of the weights that produced it.

Collation (``collate``) lays a list of rollouts out for the trainer, right-padded:

    input_ids [B, L]       x ‖ y ‖ pad,  L = max_b (|x_b| + |y_b|)
    targets   [B, L-1]     input_ids[:, 1:]              (position j predicts token j+1)
    mask      [B, L-1]     1 where targets[:, j] is a generated token y_t, else 0
    behavior  [B, L-1]     log μ(y_t) at those positions, 0 elsewhere
    advantages [B]         one advantage per sequence (broadcast over its tokens by the loss)

Right padding keeps every row's positions at 0..|x|+|y|-1, exactly the positions the generator used
(it left-pads but numbers positions from each row's first real token), so π and μ see the same context.

Shared-prompt layout (``share_prompts=True``, for llamarl.models.shared_prefix): each distinct prompt of
the batch once, and the completions against it, so the trainer runs a prompt once for its n samples:

    prompt_ids   [G, P]    the G prompts present, left-padded (prompt g at slots [start_g, P))
    prompt_start [G]       start_g
    group        [B]       the prompt row of each sample
    targets      [B, C]    y ‖ pad,  C = max_b |y_b|   (position c predicts y_c; the model feeds y_<C-1)
    mask, behavior, advantages   as above, over the C completion positions

Both layouts have ``targets`` [rows, positions], ``mask``, ``behavior_logprobs`` and ``advantages``;
llamarl.micro_batches cuts either into micro-batches. A batch without any completion token (every completion
truncated away, below) is laid out flat, whatever ``share_prompts`` says: it trains nothing either way.

Zero-advantage rows (``drop_zero_advantage=True``): a sample with A = 0 adds exactly nothing to the
policy-gradient term  −Σ_t m_t·w_t·A·log π_t / Σ_t m_t  (every factor of its gradient is multiplied by
A = 0), so the trainer need not run it; with the group-mean baseline that is every sample of a group
whose rewards are all equal, often a large share of a batch. The kept rows carry the whole batch's token
count as ``total_tokens``, its number of non-empty completions as ``total_sequences`` and its number of
completions as ``total_rows`` (the loss's denominator under token, sequence and constant normalisation),
so the gradient equals the full batch's. It is
exact for the policy-gradient loss without KL and entropy terms (those do not vanish at A = 0); the
caller decides when it applies. When the batch size is a multiple of ``row_multiple`` (the caller's
duty), at least ``row_multiple`` rows are kept (zero-advantage ones in batch order, those with completion
tokens first: a batch with a trained token keeps one, so the optimizer steps exactly when it would on the full
batch) and the number kept is a multiple of it, so a sharded trainer can split them evenly.

Truncated completions (``without_truncated``, TRL's ``mask_truncated_completions``): a completion cut by the
length limit (finish_reason "length") has no final answer, so its reward says little about its tokens. Its
reward still counts in its group's baseline (the advantages are computed first), then it is trained as an
empty completion with advantage 0: none of its tokens is in the loss or in ``total_tokens`` /
``total_sequences``, it still counts in ``total_rows`` (Dr. GRPO's constant: completions x length limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch


@dataclass
class Rollout:
    sample_id: str
    group: int  # index of its prompt within the step's batch: rollouts of one group share a baseline
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    answer: str
    finish_reason: str
    text: str = ""
    reward: float = 0.0
    reward_error: str | None = None
    reward_terms: tuple[float, ...] = ()  # the reward's functions' own rewards, the verifier first (() on error)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"rollout {self.sample_id}: {n} completion tokens but {len(self.logprobs)} log-probs and "
                f"{len(self.versions)} versions; the generator must return one of each per token"
            )

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else -1


@dataclass
class RolloutBatch:
    """The rollouts of one training step: ``prompts`` groups of ``n`` samples, prompt-major."""

    rollouts: list[Rollout]
    n: int
    generate_s: float = 0.0
    score_s: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        return min(r.min_version for r in self.rollouts)

    @property
    def generated(self) -> list[Rollout]:
        """Every rollout generated for the step: ``meta["drawn"]`` when dynamic sampling dropped some, else
        ``rollouts``."""
        return self.meta.get("drawn") or self.rollouts

    @property
    def num_tokens(self) -> int:
        """Tokens the generators sampled for the step (dropped groups included)."""
        return sum(len(r.completion_ids) for r in self.generated)

    def rewards(self) -> torch.Tensor:
        """The rewards as the verifiers gave them (float64: rounding them to float32 would make a group that
        ``is_flat`` counts as informative, e.g. 0.1 + 0.2 against 0.3, have all-zero advantages; collate
        rounds the advantages for the trainer)."""
        return torch.tensor([r.reward for r in self.rollouts], dtype=torch.float64)

    def stats(self, term_names: Sequence[str] = ()) -> dict[str, float]:
        """What a step's rollouts look like, as veRL and TRL log it. Rewards count only the samples whose
        verifier answered (failures take no part in the advantages either; NaN when none did):
        ``reward_mean``, ``reward_std`` (population), and with two or more ``term_names`` (a reward made of
        several functions, llamarl.rewards.terms) ``reward/<name>``, each term's mean; ``zero_std_frac``:
        the share of prompt groups whose scored samples all earned the same reward (fewer than two scored
        included), which therefore teach nothing. Lengths, over every sample generated (``generated``):
        ``completion_len_mean``, ``completion_len_max``, and ``length_capped_frac``, the share cut by the token
        budget (finish reason "length")."""
        scored = [r.reward for r in self.rollouts if r.reward_error is None]
        mean = math.fsum(scored) / len(scored) if scored else math.nan
        groups = [self.rollouts[i:i + self.n] for i in range(0, len(self.rollouts), self.n)]
        flat = sum(is_flat(g) for g in groups)
        generated = self.generated
        lengths = [len(r.completion_ids) for r in generated]
        terms = [r.reward_terms for r in self.rollouts if r.reward_error is None]
        per_term = {f"reward/{name}": math.fsum(t[i] for t in terms) / len(terms) if terms else math.nan
                    for i, name in enumerate(term_names)} if len(term_names) > 1 else {}
        return {"reward_mean": mean, **per_term,
                "reward_std": (math.sqrt(math.fsum((x - mean) ** 2 for x in scored) / len(scored)) if scored
                               else math.nan),
                "zero_std_frac": flat / len(groups),
                "completion_len_mean": sum(lengths) / len(lengths), "completion_len_max": max(lengths),
                "length_capped_frac": sum(r.finish_reason == "length" for r in generated) / len(generated)}


def is_flat(group: Sequence[Rollout]) -> bool:
    """Whether a prompt group teaches nothing: its scored samples all earned the same reward (fewer than two
    scored included), so every advantage is 0."""
    return len({r.reward for r in group if r.reward_error is None}) <= 1


def choose_groups(groups: Sequence[Sequence[Rollout]], size: int) -> list[int]:
    """Dynamic sampling's choice among the prompt groups drawn for a step (indices, in draw order): the first
    ``size`` groups that are not flat, filled up when there are fewer with flat ones, those with the most
    scored samples first (a group whose verifier failed on every sample is worth least). Returned in draw
    order, so the fillers fall where they were drawn, not all into the last mini-batch."""
    informative = [i for i, g in enumerate(groups) if not is_flat(g)][:size]
    flat = sorted((i for i, g in enumerate(groups) if is_flat(g)),
                  key=lambda i: -sum(r.reward_error is None for r in groups[i]))  # stable: draw order within ties
    return sorted(informative + flat[:size - len(informative)])


def without_truncated(rollouts: Sequence[Rollout], advantages: torch.Tensor) -> tuple[list[Rollout], torch.Tensor]:
    """The rollouts with each length-capped completion emptied and its advantage zeroed (module docstring)."""
    cut = [r.finish_reason == "length" for r in rollouts]
    out = [replace(r, completion_ids=[], logprobs=[], versions=[]) if c else r for r, c in zip(rollouts, cut)]
    return out, torch.where(torch.tensor(cut, dtype=torch.bool), torch.zeros_like(advantages), advantages)


def collate(rollouts: Sequence[Rollout], advantages: torch.Tensor, pad_id: int, *,
            drop_zero_advantage: bool = False, row_multiple: int = 1,
            share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """Tensors for the trainer (see the module docstring for the layout and the row dropping)."""
    if len(rollouts) == 0:
        raise ValueError("collate got no rollouts")
    if advantages.shape != (len(rollouts),):
        raise ValueError(f"advantages must have shape [{len(rollouts)}], got {tuple(advantages.shape)}")
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
    for r in rollouts:
        if not r.prompt_ids:
            raise ValueError(f"rollout {r.sample_id} has an empty prompt: nothing to condition on")
    totals = {"total_tokens": torch.tensor(float(sum(len(r.completion_ids) for r in rollouts))),
              "total_sequences": torch.tensor(float(sum(1 for r in rollouts if r.completion_ids))),
              "total_rows": torch.tensor(float(len(rollouts)))}
    if drop_zero_advantage:
        keep = [i for i in range(len(rollouts)) if advantages[i] != 0]
        # fillers with tokens first: a batch that trains a token must still train one (an AdamW step, if a
        # zero-gradient one) when every advantage is zero, or dropping rows would change the update
        zeros = sorted((i for i in range(len(rollouts)) if advantages[i] == 0),
                       key=lambda i: not rollouts[i].completion_ids)
        want = min(len(rollouts), max(row_multiple, -(-len(keep) // row_multiple) * row_multiple))
        keep = sorted(keep + zeros[: want - len(keep)])
        rollouts, advantages = [rollouts[i] for i in keep], advantages[keep]
    if share_prompts and any(r.completion_ids for r in rollouts):  # (no completion at all: the flat layout,
        return {**_collate_shared(rollouts, advantages, pad_id), **totals}  # trained as no update)
    length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    if length < 2:
        raise ValueError("every rollout is shorter than two tokens: nothing to predict")
    input_ids = torch.full((len(rollouts), length), pad_id, dtype=torch.long)
    for i, r in enumerate(rollouts):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        input_ids[i, :p] = torch.tensor(r.prompt_ids, dtype=torch.long)
        if c:
            input_ids[i, p : p + c] = torch.tensor(r.completion_ids, dtype=torch.long)
    # position p-1 predicts the first generated token
    mask, behavior = _completion_rows(rollouts, length - 1, [len(r.prompt_ids) - 1 for r in rollouts])
    return {
        "input_ids": input_ids,
        "targets": input_ids[:, 1:].clone(),
        "mask": mask,
        "behavior_logprobs": behavior,
        "advantages": advantages.to(torch.float32).clone(),
        **totals,  # of the whole batch, dropped rows included
    }


def _collate_shared(rollouts: Sequence[Rollout], advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """The shared-prompt layout (module docstring); rows keep their order, prompts their first-seen order."""
    index: dict[int, int] = {}
    prompts: list[list[int]] = []
    for r in rollouts:
        if r.group not in index:
            index[r.group] = len(prompts)
            prompts.append(r.prompt_ids)
        elif prompts[index[r.group]] != r.prompt_ids:
            raise ValueError(f"rollout {r.sample_id}: group {r.group} holds two different prompts; the samples "
                             "of one group must share their prompt (or collate with share_prompts=False)")
    width = max(len(r.completion_ids) for r in rollouts)
    if width < 1:
        raise ValueError("every rollout has an empty completion: nothing to train on")
    P, B = max(len(p) for p in prompts), len(rollouts)
    prompt_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    for g, p in enumerate(prompts):
        prompt_ids[g, P - len(p):] = torch.tensor(p, dtype=torch.long)
    targets = torch.full((B, width), pad_id, dtype=torch.long)
    for i, r in enumerate(rollouts):
        if r.completion_ids:
            targets[i, :len(r.completion_ids)] = torch.tensor(r.completion_ids, dtype=torch.long)
    mask, behavior = _completion_rows(rollouts, width, [0] * B)
    return {
        "prompt_ids": prompt_ids,
        "prompt_start": torch.tensor([P - len(p) for p in prompts], dtype=torch.long),
        "group": torch.tensor([index[r.group] for r in rollouts], dtype=torch.long),
        "targets": targets,
        "mask": mask,
        "behavior_logprobs": behavior,
        "advantages": advantages.to(torch.float32).clone(),
    }


def _completion_rows(rollouts: Sequence[Rollout], width: int, first: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """mask and behavior log-probs [B, width]: row i marks its completion's tokens from column first[i]."""
    mask = torch.zeros(len(rollouts), width)
    behavior = torch.zeros(len(rollouts), width)
    for i, (r, f) in enumerate(zip(rollouts, first)):
        c = len(r.completion_ids)
        if c:
            mask[i, f : f + c] = 1.0
            behavior[i, f : f + c] = torch.tensor(r.logprobs, dtype=torch.float32)
    return mask, behavior
