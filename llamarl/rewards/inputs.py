"""What the built-in verifiers accept besides two strings, read the same way by each of them.

A verifier scores a (completion, answer) pair of strings and never raises for strings (a wrong or unreadable
answer scores 0.0). Two other forms are common in user code and mean something definite:

  * a chat completion, TRL's conversational format (a list of messages ``{"role": ..., "content": ...}``):
    the text is the last message's content (its text parts joined, for content given as OpenAI's parts);
  * a numeric reference answer (int, float, ``Decimal``, ``Fraction``; not bool): its decimal text
    (72 and 72.0 -> "72", 0.5 -> "0.5", 1e-05 -> "0.00001", Decimal("72.00") -> "72.00", Fraction(1, 2) -> "1/2").

Anything else raises ``TypeError`` naming the verifier: inside a RewardPool that is a failed reward (counted,
kept out of the group's advantages), where a silent 0.0 would have been a wrong answer on every sample.
"""

from __future__ import annotations

import math
import numbers
from decimal import Decimal
from fractions import Fraction
from typing import Any

from llamarl._text import decimal_text


def completion_text(completion: Any, verifier: str) -> str:
    """The completion as text: a string, or the content of a chat completion's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and all(isinstance(m, dict) for m in completion):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)  # OpenAI's content parts, text only
    raise TypeError(f"{verifier}: the completion must be a string or a list of chat messages with string "
                    f"'content', got {type(completion).__name__}: {completion!r:.80}")


def answer_text(answer: Any, verifier: str) -> str:
    """The reference answer as text: a string, or a finite number's decimal text."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, bool) or not isinstance(answer, numbers.Number):
        raise TypeError(f"{verifier}: the answer must be a string or a number, got {type(answer).__name__}: "
                        f"{answer!r:.80}")
    if isinstance(answer, Fraction):
        return str(answer)
    if isinstance(answer, numbers.Integral):
        return str(int(answer))
    if isinstance(answer, Decimal):
        if not answer.is_finite():
            raise TypeError(f"{verifier}: the answer must be a finite number, got {answer!r}")
        return format(answer, "f")
    if not isinstance(answer, numbers.Real):
        raise TypeError(f"{verifier}: the answer must be a string or a real number, got {type(answer).__name__}")
    if not math.isfinite(float(answer)):
        raise TypeError(f"{verifier}: the answer must be a finite number, got {answer!r}")
    return decimal_text(answer)  # 72.0 (a JSON or pandas column of floats) is "72"; np.float32(72.1) is "72.1"
