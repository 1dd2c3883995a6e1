"""Exact-match verifier for the built-in synthetic task (``llamarl.data.ArithmeticTask``).

The completion is cut at its first newline (or its end), stripped of surrounding whitespace, and must
equal the stripped reference answer character for character: ``"579\\n..."`` matches ``"579"``,
``" 579 "`` matches, ``"5790"``, ``"57"``, ``"579.0"`` and ``"+579"`` do not. There is no partial
credit: the tiny character-level model either produces the answer or it does not.

Invariant: returns exactly 1.0 or 0.0 and never raises for strings (a chat completion or a numeric answer is
read as llamarl.rewards.inputs says; other types raise TypeError).
"""

from __future__ import annotations

from llamarl.rewards.inputs import answer_text, completion_text


def first_line(completion: str) -> str:
    """The completion up to (not including) its first newline, stripped."""
    return completion.split("\n", 1)[0].strip()


def exact_reward(completion: str, answer: str) -> float:
    """1.0 iff the first line of ``completion``, stripped, equals ``answer`` stripped."""
    completion, answer = completion_text(completion, "exact_reward"), answer_text(answer, "exact_reward")
    expected = answer.strip()
    return 1.0 if expected and first_line(completion) == expected else 0.0
