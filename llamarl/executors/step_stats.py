"""How a trainer step's statistics are combined: over micro-batches (token-weighted means), over the updates
of one step (mini-batches x epochs), and over trainer ranks (llamarl.executors.trainer).

Every metric of one micro-batch's loss comes with its share of the update's trained tokens; a mean metric
is Σ share · value, a count (``SUM_METRICS``) adds up, a maximum (``MAX_METRICS``) takes the max. Shares
are global (of the whole batch, not of one rank's rows), so the per-rank results add up to the result of
one process over all micro-batches.
"""

from __future__ import annotations

import math

SUM_METRICS = ("tokens", "train_positions")  # train_positions: padded positions the update forwards ran
MAX_METRICS = ("ratio_max",)


def combine_micro_batches(parts: list[tuple[float, dict]]) -> dict:
    """Token-weighted means of per-micro-batch metrics (sums for counts, max for maxima)."""
    out: dict[str, float] = {}
    for share, m in parts:
        for k, v in m.items():
            v = float(v)
            if k in SUM_METRICS:
                out[k] = out.get(k, 0.0) + v
            elif k in MAX_METRICS:
                out[k] = max(out.get(k, -math.inf), v)
            else:
                out[k] = out.get(k, 0.0) + share * v
    return out


def combine_updates(results: list[dict], epochs: int = 1) -> dict:
    """One step's stats from those of its updates (``epochs`` passes over the same mini-batches): whether any
    was applied and how many (``updates``), how many had no trained token (``empty_updates``: every completion
    truncated away), the mean loss and gradient norm of the others (an empty update makes no update, so it does not
    pull the mean towards 0; 0 when every update was empty), the last learning rate, the total time, and the
    loss metrics combined as ``combine_micro_batches`` does, each update weighted by its share of the trained
    tokens; ``tokens`` counts the step's trained tokens once (one epoch's updates), ``train_positions`` every
    pass's work."""
    tokens = sum(r.get("tokens", 0.0) for r in results)
    own = ("applied", "empty", "loss", "grad_norm", "lr", "train_s")
    metrics = combine_micro_batches([(r.get("tokens", 0.0) / max(tokens, 1.0),
                                      {k: v for k, v in r.items() if k not in own}) for r in results])
    if "tokens" in metrics:
        metrics["tokens"] = sum(r.get("tokens", 0.0) for r in results[:len(results) // epochs])
    made = [r for r in results if not r.get("empty", False)] or [{"loss": 0.0, "grad_norm": 0.0}]
    return {"applied": any(r["applied"] for r in results), "updates": sum(r["applied"] for r in results),
            "empty_updates": sum(r.get("empty", False) for r in results),
            "loss": math.fsum(r["loss"] for r in made) / len(made),
            "grad_norm": math.fsum(r["grad_norm"] for r in made) / len(made),
            "lr": results[-1]["lr"], "train_s": math.fsum(r["train_s"] for r in results), **metrics}


def merge_ranks(per_rank: list[dict]) -> dict:
    """Combine every rank's ``combine_micro_batches`` output: the shares are global, so weighted means and
    counts add up over ranks and maxima take the max (the result of ``combine_micro_batches`` over all
    micro-batches)."""
    out: dict[str, float] = {}
    for m in per_rank:
        for k, v in m.items():
            if k in MAX_METRICS:
                out[k] = max(out.get(k, -math.inf), v)
            else:
                out[k] = out.get(k, 0.0) + v
    return out
