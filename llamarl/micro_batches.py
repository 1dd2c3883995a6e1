"""Micro-batches: which of a rank's rows go through one forward/backward together, each cut to the
columns it needs.

A collated batch (llamarl.rollouts) is padded to its longest row. A micro-batch of short rows cut from it
would still run every padded column, so ``take_rows`` keeps only the columns up to the last trained
position of its rows (the row's *extent*: 1 + the last column whose mask is set, 0 for a row without one):

    flat layout      targets, mask, behavior_logprobs, old_logprobs [rows, W];  input_ids [rows, W + 1]
    shared prompts   the same per-token tensors [rows, W]; prompt_ids keeps the columns of the rows' prompts

with W the rows' largest extent (at least 1; with shared prompts at least 2 where the batch has 2 columns:
that layout's forward skips its completion pass for one column, and FSDP ranks must all run the same
passes). Exact: every kept position sees the same tokens at the same positions
(causal attention, rows right-padded from position 0 or, for shared prompts, completions after their
prompt), and the dropped positions carry no trained token, so the loss and its gradient are those of the
untrimmed rows up to floating-point reassociation.

``plan`` decides the micro-batches of a list of rows:

* ``by_length``: rows are ordered by extent, longest first, so each micro-batch holds rows of similar
  length and trims well. With shared prompts two orders compete: whole prompt groups by their longest row
  (a prompt runs once, its rows' lengths mix), or all rows by extent (lengths match, a prompt runs in every
  micro-batch holding one of its rows); the second is cut so that no micro-batch runs more positions than
  the first order's largest (mixing prompts must not raise the peak memory a ``micro_batch_size`` was
  chosen for), and the order whose micro-batches run fewer positions in all wins. The micro-batches then
  run largest first, so a step that does not fit in memory fails on its first forward. The loss is a sum
  over rows weighted by each micro-batch's share of the batch's denominator (llamarl.executors.trainer),
  so the order changes only the summation order.
* ``token_budget`` > 0 (veRL's use_dynamic_bsz with ppo_max_token_len_per_gpu): consecutive rows of that
  order share a micro-batch while its padded positions (``positions``) stay within the budget, at least one
  row each; the row count ``rows_per`` is then not used. 0: micro-batches of at most ``rows_per`` rows.

``positions(batch, rows)`` is the cost model: rows × (W + 1) positions for the flat layout, G × P + rows × W
with shared prompts (G prompts of P columns; the completion pass runs W − 1 of each row's W).
"""

from __future__ import annotations

from typing import Sequence

import torch

PROMPT_KEYS = ("prompt_ids", "prompt_start")  # per prompt, not per row
TOTAL_KEYS = ("total_tokens", "total_sequences", "total_rows")  # whole-batch counts, not rows


def extents(batch: dict[str, torch.Tensor]) -> list[int]:
    """Per row: 1 + the last column whose mask is set (0 for a row without a trained token)."""
    mask = batch["mask"]
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return torch.where(mask > 0, cols, 0).amax(dim=1).tolist() if mask.shape[1] else [0] * mask.shape[0]


def take_rows(batch: dict[str, torch.Tensor], rows: Sequence[int] | torch.Tensor, *, trim: bool = True,
              ext: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The rows ``rows`` (in that order) of a collated batch of either layout, without the ``TOTAL_KEYS``
    counts; with ``trim``, cut to the columns they need (module docstring; at least ``_min_width``, so a
    micro-batch without a trained token still runs the same forward passes as the others). ``ext``: the
    batch's ``extents``, if already known.
    A shared-prompt part keeps only the prompts its rows use (renumbered in order) and drops prompt
    columns that are padding in all of them."""
    index = torch.as_tensor(rows, dtype=torch.long, device=batch["mask"].device)
    part = {k: v.index_select(0, index) for k, v in batch.items() if k not in PROMPT_KEYS and k not in TOTAL_KEYS}
    if trim:
        ext = extents(batch) if ext is None else ext
        width = max([_min_width(batch)] + [ext[r] for r in (rows.tolist() if torch.is_tensor(rows) else rows)])
        for k, v in part.items():
            if k == "input_ids":
                part[k] = v[:, :width + 1]
            elif v.dim() >= 2:
                part[k] = v[:, :width]
    if "prompt_ids" not in batch:
        return part
    used, part["group"] = torch.unique(part["group"], return_inverse=True)
    start = batch["prompt_start"][used]
    first = int(start.min()) if len(used) else 0
    part["prompt_ids"] = batch["prompt_ids"][used, first:]
    part["prompt_start"] = start - first
    return part


def _min_width(batch: dict[str, torch.Tensor]) -> int:
    """The fewest columns a part keeps: one, or with shared prompts two where the batch has them, so that
    every part's forward makes the same passes (shared_prefix_hidden_states skips its completion pass for
    one column; FSDP ranks must run the same all-gathers)."""
    return min(2, batch["targets"].shape[1]) if "prompt_ids" in batch else 1


def idle_part(batch: dict[str, torch.Tensor], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """One of ``rows`` (with shared prompts, one with the shortest prompt) cut to its fewest columns, with no
    trained token: the cheapest forward/backward a rank can run when a collective needs it to take part
    (FSDP ranks that planned fewer micro-batches than others)."""
    row = rows[0]
    if "prompt_ids" in batch:  # the prompt that starts last is the shortest
        start, group = batch["prompt_start"].tolist(), batch["group"].tolist()
        row = max(rows, key=lambda r: start[group[r]])
    part = take_rows(batch, [row], ext=[0] * batch["mask"].shape[0])
    part["mask"] = torch.zeros_like(part["mask"])
    return part


class _Rows:
    """The per-row facts ``plan`` and ``positions`` read, as Python lists (one host copy each)."""

    def __init__(self, batch: dict[str, torch.Tensor], ext: Sequence[int] | None = None):
        self.ext = extents(batch) if ext is None else ext
        self.shared = "prompt_ids" in batch
        self.min_width = _min_width(batch)
        if self.shared:
            self.group = batch["group"].tolist()
            self.start = batch["prompt_start"].tolist()
            self.width = batch["prompt_ids"].shape[1]

    def positions(self, rows: Sequence[int]) -> int:
        width = max([self.min_width] + [self.ext[r] for r in rows])
        if not self.shared:
            return len(rows) * (width + 1)
        groups = {self.group[r] for r in rows}
        return self.cost(len(rows), width, len(groups), min(self.start[g] for g in groups))

    def cost(self, rows: int, width: int, groups: int, first: int) -> int:
        """``positions`` of ``rows`` rows up to column ``width`` with ``groups`` prompts from column ``first``."""
        return rows * (width + 1) if not self.shared else groups * (self.width - first) + rows * width


def positions(batch: dict[str, torch.Tensor], rows: Sequence[int], ext: Sequence[int] | None = None) -> int:
    """Padded positions the forward of ``take_rows(batch, rows)`` runs (module docstring); ``ext``: the
    batch's ``extents``, if already known (or others, to count parts cut elsewhere)."""
    return _Rows(batch, ext).positions(rows)


def part_positions(part: dict[str, torch.Tensor]) -> int:
    """The padded positions a part's forward runs, read off its tensors (``positions`` of its rows when it
    came from ``take_rows``): its input tokens, or its prompts' columns plus its completions'."""
    if "prompt_ids" in part:
        return part["prompt_ids"].numel() + part["targets"].numel()
    return part["input_ids"].numel()


def plan(batch: dict[str, torch.Tensor], rows: Sequence[int], *, rows_per: int, token_budget: int = 0,
         by_length: bool = True, ext: Sequence[int] | None = None) -> list[list[int]]:
    """The micro-batches of ``rows`` (row indices of ``batch``), each a list of rows (module docstring).
    ``ext``: the batch's ``extents``, if already known."""
    if rows_per < 1 or token_budget < 0:
        raise ValueError(f"need rows_per >= 1 and token_budget >= 0, got {rows_per} and {token_budget}")
    facts = _Rows(batch, ext)
    order = list(rows)
    if not by_length:
        return _split(facts, order, rows_per, token_budget)
    by_extent = sorted(order, key=lambda r: -facts.ext[r])  # stable: equal extents keep the batch order
    if not facts.shared:
        parts = _split(facts, by_extent, rows_per, token_budget)
    else:
        group, longest, first = facts.group, {}, {}
        for i, r in enumerate(order):
            longest[group[r]] = max(longest.get(group[r], 0), facts.ext[r])
            first.setdefault(group[r], i)
        by_group = _split(facts, sorted(order, key=lambda r: (-longest[group[r]], first[group[r]], -facts.ext[r])),
                          rows_per, token_budget)
        peak = token_budget or max(facts.positions(p) for p in by_group)
        by_row = _split(facts, by_extent, rows_per, peak, max_rows=None if token_budget else rows_per)
        parts = min([by_group, by_row], key=lambda c: sum(facts.positions(p) for p in c))  # a tie: by group
    return sorted(parts, key=facts.positions, reverse=True)  # stable


def _split(facts: _Rows, order: list[int], rows_per: int, token_budget: int,
           max_rows: int | None = None) -> list[list[int]]:
    """Consecutive rows of ``order``: ``rows_per`` each, or greedily while a micro-batch stays within
    ``token_budget`` positions (and ``max_rows`` rows, if given; at least one row each)."""
    if not token_budget:
        return [order[i:i + rows_per] for i in range(0, len(order), rows_per)]
    parts: list[list[int]] = []
    width = first = 0
    groups: set[int] = set()
    for r in order:
        g = facts.group[r] if facts.shared else 0
        w = max(width, facts.ext[r])
        f = min(first, facts.start[g]) if facts.shared else 0
        n = len(groups) + (g not in groups)
        if parts and (max_rows is None or len(parts[-1]) < max_rows) \
                and facts.cost(len(parts[-1]) + 1, w, n, f) <= token_budget:
            parts[-1].append(r)
            width, first = w, f
            groups.add(g)
        else:
            parts.append([r])
            width, groups = max(facts.min_width, facts.ext[r]), {g}
            first = facts.start[g] if facts.shared else 0
    return parts
