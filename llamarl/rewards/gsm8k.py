"""GSM8K verifier: is the final number of a completion equal to the reference number?

Extraction (completion):
  1. If the completion contains the GSM8K marker ``####``, the answer is the first number after the
     *last* marker. A marker followed by no number means the declared answer is not a number: 0.0.
  2. Otherwise the answer is the *last* number anywhere in the completion (the usual fallback).

Reference: the text after the last ``####`` when present (a full GSM8K solution may be passed), else
the whole string; its first number is the reference value.

A "number" is an optionally signed decimal: ``1,234,567.5`` (comma thousands groups; ``1,2345`` is two
numbers), ``-3``, ``.5``, ``0.50``, ``-$5``. Currency signs, percent signs and trailing units are not part
of the match, so they are ignored (``$1,200`` -> 1200, ``18 eggs`` -> 18, ``12%`` -> 12). A ``-`` right
after a word character or a closing bracket is an operator, not a sign (``10-4`` holds 10 and 4).
Values compare exactly as ``decimal.Decimal`` (``72.00 == 72``; ``720 != 72``; ``7.2 != 72``). No
fractions or scientific notation: GSM8K answers are plain decimals.

Invariant: ``gsm8k_reward`` returns exactly 1.0 or 0.0 and never raises, for any pair of strings (and
for non-strings, which score 0.0). The regexes have no nested unbounded quantifiers, so their cost
stays linear in the input length whatever the input.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# sign: only where it cannot be a binary minus/plus (not after a word char, digit, ')' or ']').
_NUMBER_RE = re.compile(
    r"(?:(?P<sign>(?<![\w)\]])[-\u2212+])\$?)?"
    r"(?<![\d.])"
    r"(?P<body>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
MARKER = "####"


def _to_decimal(match: re.Match) -> Decimal | None:
    body = match.group("body").replace(",", "")
    try:
        value = Decimal(body)
    except InvalidOperation:
        return None
    return -value if match.group("sign") in ("-", "\u2212") else value


def numbers(text: str) -> list[Decimal]:
    """All numbers in ``text``, in order, under the conventions of the module docstring."""
    out = []
    for m in _NUMBER_RE.finditer(text):
        v = _to_decimal(m)
        if v is not None:
            out.append(v)
    return out


def extract_predicted_number(completion: str) -> Decimal | None:
    """The number a completion declares as its answer (``#### N`` first, else the last number)."""
    if MARKER in completion:
        found = numbers(completion.rsplit(MARKER, 1)[1])
        return found[0] if found else None
    found = numbers(completion)
    return found[-1] if found else None


def extract_reference_number(answer: str) -> Decimal | None:
    """The reference value: the first number after the last ``####`` (or of the whole string)."""
    tail = answer.rsplit(MARKER, 1)[1] if MARKER in answer else answer
    found = numbers(tail)
    return found[0] if found else None


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 iff the completion's final number equals the reference answer's number, else 0.0."""
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    try:
        ref = extract_reference_number(answer)
        pred = extract_predicted_number(completion)
    except Exception:  # defensive: the regex path has no known failure, but a reward must not raise
        return 0.0
    if ref is None or pred is None:
        return 0.0
    return 1.0 if pred == ref else 0.0
