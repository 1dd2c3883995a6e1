"""Format rewards: does a completion state its answer in the form the verifier expects?

Styles (``format_reward(completion, style)`` returns 1.0 or 0.0, never raises for a string or chat completion):
  * ``"gsm8k"``: the marker that declares the answer (the last ``####`` that is not a markdown heading, as
    ``gsm8k_reward`` reads it) is followed (after spaces and an optional ``$``) by a number;
  * ``"math"``:  the completion holds a closed, non-empty ``\\boxed{...}`` (see ``math.last_boxed``);
  * ``"exact"``: the first line, stripped, is one signed integer or decimal (the synthetic task's answer);
  * ``"code"``:  the completion holds a closed fenced block tagged python/py/python3 or untagged, not empty.

``FORMAT_REWARDS["format_<style>"]`` is the check as a reward function ``(completion, answer) -> float`` (the
built-in rewards ``format_gsm8k``, ``format_math``, ``format_exact``: extra reward terms, TRL's format reward).

``FormattedReward`` mixes a correctness reward r in {0, 1} with the format bonus f in {0, 1} as the
convex combination ``(1 - w) * r + w * f``, 0 <= w <= 1, so a reward stays in [0, 1]; for 0 < w < 1 it
equals 1.0 only for a correct answer in the right format (w = 0: exactly the correctness reward; w = 1:
the format reward alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from llamarl.rewards.code import closed_python_block
from llamarl.rewards.exact import first_line
from llamarl.rewards.gsm8k import marked_number
from llamarl.rewards.inputs import completion_text
from llamarl.rewards.math import last_boxed

_NUMBER_LINE_RE = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _gsm8k_format(completion: str) -> bool:
    return marked_number(completion) is not None


def _math_format(completion: str) -> bool:
    boxed = last_boxed(completion)
    return boxed is not None and boxed.strip() != ""


def _exact_format(completion: str) -> bool:
    return _NUMBER_LINE_RE.fullmatch(first_line(completion)) is not None


FORMAT_STYLES: dict[str, Callable[[str], bool]] = {
    "gsm8k": _gsm8k_format,
    "math": _math_format,
    "exact": _exact_format,
    "code": closed_python_block,
}


def _check_style(style: str) -> Callable[[str], bool]:
    try:
        return FORMAT_STYLES[style]
    except (KeyError, TypeError):
        raise ValueError(f"unknown format style {style!r}; choose one of {sorted(FORMAT_STYLES)}") from None


def format_reward(completion: str, style: str) -> float:
    """1.0 iff ``completion`` states an answer in the format of ``style`` (module docstring)."""
    check = _check_style(style)
    completion = completion_text(completion, "format_reward")
    try:
        return 1.0 if check(completion) else 0.0
    except Exception:  # defensive: the checks are plain regex/brace scans
        return 0.0


@dataclass(frozen=True)
class FormattedReward:
    """``(1 - weight) * reward_fn(c, a) + weight * format_reward(c, style)``."""

    reward_fn: Callable[[str, str], float]
    style: str
    weight: float

    def __post_init__(self) -> None:
        _check_style(self.style)
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"format_weight must lie in [0, 1], got {self.weight!r}")

    def __call__(self, completion: str, answer: str, **info) -> float:
        correct = float(self.reward_fn(completion, answer, **info))
        return (1.0 - self.weight) * correct + self.weight * format_reward(completion, self.style)


def _format_term(style: str) -> Callable[[str, str], float]:
    def reward(completion: str, answer: str) -> float:
        return format_reward(completion, style)

    reward.__name__ = reward.__qualname__ = f"format_{style}"
    reward.__doc__ = f"format_reward(completion, {style!r}): 1.0 iff the answer is stated as {style} expects"
    return reward


# the format checks as reward functions (completion, answer) -> float, the built-in rewards format_<style>:
# an extra reward term (llamarl.rewards.terms) rewarding the form of an answer apart from its correctness
FORMAT_REWARDS: dict[str, Callable[[str, str], float]] = {f"format_{style}": _format_term(style)
                                                          for style in FORMAT_STYLES}
