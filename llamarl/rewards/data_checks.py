"""A reward checked against a dataset before any model loads, the same way by ``llamarl.train`` and
``llamarl.eval``: a user function's required keyword arguments must be fields of every sample (else every
sample's reward fails), and the gsm8k verifier needs references that are one number (else it scores every
completion of them 0)."""

from __future__ import annotations

from typing import Sequence

from llamarl.data.datasets import Sample
from llamarl.rewards.registry import info_params, load_reward


def common_fields(samples: Sequence[Sample]) -> frozenset[str]:
    """What a reward function may ask for by name from every one of ``samples`` (``Sample.reward_info``)."""
    return frozenset.intersection(*(frozenset(s.reward_info()) for s in (samples or [Sample("", "", "")])))


def missing_fields(spec: str, fields: frozenset[str]) -> str | None:
    """None, or why ``spec`` (a user function) cannot be scored on samples that all have ``fields``."""
    missing = sorted(info_params(load_reward(spec)).required - fields)
    if not missing:
        return None
    return (f"{spec} needs the keyword argument(s) {missing}, which not every sample has (all have: "
            f"{sorted(fields)}); give them defaults or add those fields to every record of the dataset")


def gsm8k_unreadable(samples: Sequence[Sample]) -> str | None:
    """None, or a warning that some references are not one number (the gsm8k verifier scores them 0)."""
    from llamarl.rewards.gsm8k import extract_reference_number

    bad = [s for s in samples if extract_reference_number(s.answer) is None]
    if not bad:
        return None
    return (f"{len(bad)} of {len(samples)} answers are not one number (e.g. {bad[0].answer!r:.60}), so the gsm8k "
            "verifier scores every completion of them 0; use a reward that reads them (math, exact, module:function) "
            "or fix the answers")
