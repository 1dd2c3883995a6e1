"""The RL learning-rate schedule: warm-up, then constant, cosine or linear decay over the run's RL steps.

``lr_at(step, cfg, total_steps)`` is a pure function of the step, so a resumed run continues the curve
where it stopped (the trainer is told the step by the controller, llamarl.executors.trainer).
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, cfg: dict, total_steps: int | None) -> float:
    """The learning rate of RL step ``step`` (0-based). With W = lr_warmup_steps, S = total_steps,
    r = min_lr_ratio and t = clamp((step − W) / max(1, S − W), 0, 1):

        step < W:   lr · (step + 1) / W                     (linear warm-up; the first step is not 0)
        constant:   lr
        cosine:     lr · (r + (1 − r) · (1 + cos π t) / 2)
        linear:     lr · (r + (1 − r) · (1 − t))

    Decay needs S (``run.max_steps``); without it the rate stays at lr after the warm-up."""
    if cfg["lr_schedule"] not in SCHEDULES:  # (the config checks it; a direct caller may not have)
        raise ValueError(f"lr_at: lr_schedule must be one of {SCHEDULES}, got {cfg['lr_schedule']!r}")
    lr, warmup = cfg["lr"], cfg["lr_warmup_steps"]
    if step < warmup:
        return lr * (step + 1) / warmup
    if cfg["lr_schedule"] == "constant" or not total_steps:
        return lr
    t = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - warmup)))
    r = cfg["min_lr_ratio"]
    decay = (1.0 + math.cos(math.pi * t)) / 2.0 if cfg["lr_schedule"] == "cosine" else 1.0 - t
    return lr * (r + (1.0 - r) * decay)
