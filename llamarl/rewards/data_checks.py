"""A reward checked against a dataset before any model loads, the same way by ``llamarl.train`` and
``llamarl.eval``: a user function's required keyword arguments must be fields of every sample (else every
sample's reward fails), the gsm8k verifier needs references that are one number (else it scores every
completion of them 0), and the code verifier needs tests it can read (else every completion's reward fails)."""

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


def code_tests_unreadable(samples: Sequence[Sample]) -> tuple[str | None, bool]:
    """(None, False), or why some samples have no tests the code verifier can read (every completion of them is
    a failed reward: a zero and a counter), and whether that is all of them (nothing could ever be learned)."""
    from llamarl.rewards.code import parse_tests

    bad = []
    for s in samples:
        try:
            parse_tests(s.answer, s.reward_info())
        except Exception as exc:  # malformed JSON, no tests, bad limits: what the verifier would raise per sample
            bad.append((s, exc))
    if not bad:
        return None, False
    sample, exc = bad[0]
    return (f"{len(bad)} of {len(samples)} samples have no tests the code verifier can read (e.g. sample "
            f"{sample.id!r}: {exc}); give each a JSON answer {{\"tests\": [...]}} or {{\"inputs\": [...], \"outputs\": "
            "[...]}, or the dataset fields test_list / tests / input_output", len(bad) == len(samples))


def verifier_data_problems(verifier: str, samples: Sequence[Sample]) -> tuple[str | None, str | None]:
    """(error, warning) about ``samples`` for the reward ``verifier``: gsm8k references that are not one number
    (a warning: they score 0), samples without tests the code verifier can read (a warning, or an error when no
    sample has any); (None, None) for other rewards."""
    if verifier == "gsm8k":
        return None, gsm8k_unreadable(samples)
    if verifier == "code":
        problem, every = code_tests_unreadable(samples)
        return (problem, None) if every else (None, problem)
    return None, None
