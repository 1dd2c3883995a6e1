"""GSM8K verifier: is the final number of a completion equal to the reference number?

Extraction (completion):
  1. The GSM8K marker ``####`` declares the answer. The *last* marker that is not a markdown heading
     decides: its answer is the first number after it (up to the next marker). Such a marker followed
     by no number means the declared answer is not a number (``72 ... #### seventy-two``): 0.0; so does
     one whose number is an operand (``#### 3/4``, ``#### 2^{10}``, ``#### \\frac{3}{4}``, ``#### 12:30``:
     not 3, 2 or 12).
     "Directly followed" allows spaces, one ``$`` and an answer phrase: ``#### 72``, ``#### $72``,
     ``#### Answer: 72``, ``#### The final answer is 72``.
     A markdown heading is a ``####`` that starts a line, is not directly followed by a number, and has
     more text on the lines below (``#### Step 2: add tax\n30 + 12 = 42``); it is not an answer marker.
  2. Otherwise (no marker, or only headings), the last closed ``\\boxed{...}`` decides (the "put your final
     answer within \\boxed{}" convention; llamarl.rewards.math.last_boxed), so a check written after the
     box (``\\boxed{72}. Check: 72 - 70 = 2``) does not replace it. Like the reference, it must hold one
     number (``\\boxed{\\$18}``, ``\\boxed{x = 5}``); a box with several (``\\boxed{\\frac{3}{4}}``,
     ``\\boxed{5\\sqrt{2}}``) declares no plain number: 0.0. A box without any (``\\boxed{x}, and x = 5``)
     leaves the answer to step 3.
  3. Otherwise the answer is the *last* number anywhere in the completion (the usual fallback), unless it
     is an operand (``the answer is 3/4`` declares no 4).

Reference: the text after the last ``####`` when present (a full GSM8K solution may be passed), else
the whole string. It must hold exactly one number, which is the reference value; a reference with
several (``10-15``, ``3/4``, ``12:30``, ``5 or 6``, ``1e+21``) is not a plain GSM8K answer and scores
every completion 0.0 rather than being cut to its first number (which would reward wrong answers).

A "number" is an optionally signed decimal: ``1,234,567.5`` (comma thousands groups; ``1,2345`` is two
numbers), ``-3``, ``.5``, ``0.50``, ``-$5``. Currency signs, percent signs and trailing units are not part
of the match, so they are ignored (``$1,200`` -> 1200, ``18 eggs`` -> 18, ``12%`` -> 12). A ``-`` right
after a word character or a closing bracket is an operator, not a sign (``10-4`` holds 10 and 4).
LaTeX spellings are normalised first, on both sides: ``1{,}000`` -> ``1,000``; a thin space ``\\,`` (or
``\\!``) between digits is a thousands separator like a comma (``1\\,000`` -> ``1,000``); an escaped dollar
``\\$`` is a dollar sign (``-\\$5`` -> -5). A minus sign may be written ``-``, ``−`` (U+2212), ``–`` (en dash)
or ``－`` (fullwidth).
Values compare exactly as ``decimal.Decimal`` (``72.00 == 72``; ``720 != 72``; ``7.2 != 72``). No
fractions or scientific notation: GSM8K answers are plain decimals.

Invariant: ``gsm8k_reward`` returns exactly 1.0 or 0.0 and never raises, for any pair of strings (a chat
completion or a numeric answer is read as llamarl.rewards.inputs says; other types raise TypeError). The
regexes have no nested unbounded quantifiers and the marker scan visits each character a bounded number of
times, so the cost stays linear in the input length.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from llamarl.rewards.inputs import answer_text, completion_text
from llamarl.rewards.math import last_boxed

# sign: only where it cannot be a binary minus/plus (not after a word char, digit, ')' or ']').
_NUMBER_RE = re.compile(
    r"(?:(?P<sign>(?<![\w)\]])[-\u2212\u2013\uff0d+])\$?)?"
    r"(?<![\d.])"
    r"(?P<body>\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
)
MARKER = "####"
# what may stand between a marker and its number: spaces, an answer phrase ("Answer:", "The final answer is"), a $
# (the phrase and what follows it stay on the marker's line: "#### Final Answer\n12 + 30 = 42" is a heading)
_LEAD_RE = re.compile(r"\s*(?:(?:the[ \t]+)?(?:final[ \t]+)?answer(?:[ \t]+is)?[ \t]*[:=]?[ \t]*\$?[ \t]*|\$?\s*)",
                      re.IGNORECASE)
_MINUS = ("-", "\u2212", "\u2013", "\uff0d")
# a number is an operand, not an answer, with one of these right after it or right before it
# (a "*" only between operands: "**18**" and "*18*." are markdown emphasis)
_OPERATOR_AFTER_RE = re.compile(r"\s*(?:[/^:*\u00d7\u00f7\u00b7]\s*(?:[\d{\\]|\.\d)"
                                r"|\\(?:frac|dfrac|tfrac|sqrt|cdot|times|div)(?![a-zA-Z])|\}\s*\{)")
_OPERATOR_BEFORE_RE = re.compile(r"(?:(?<=[\d)\]}])\s*\*|[/^\u00d7\u00f7\u00b7]"
                                 r"|\\(?:frac|dfrac|tfrac|sqrt|cdot|times|div))\s*\{?\s*\$?$")
# what a box's unit adds: \text{ ft}^2, m^2 (an exponent after a unit or a letter is not a second number)
_BOX_UNIT_RE = re.compile(r"\\(?:text|mathrm|textrm|mbox)\s*\{[^{}\d]*\}(?:\s*\^\s*(?:\{[^{}]*\}|\d))?"
                          r"|(?<=[A-Za-z])\s*\^\s*(?:\{[^{}]*\}|\d+)")
_THIN_SPACE_RE = re.compile(r",\\!|(?<=\d)\\[,!](?=\d)")  # "1,\!000", "1\,000" -> thousands comma


def _clean(text: str) -> str:
    """LaTeX number spellings as plain text: ``1{,}000``/``1\\,000`` -> ``1,000``, ``\\$`` -> ``$``."""
    if "\\" not in text and "{,}" not in text:
        return text
    text = text.replace("{,}", ",").replace("\\$", "$")
    return _THIN_SPACE_RE.sub(",", text)


def _to_decimal(match: re.Match) -> Decimal | None:
    body = match.group("body").replace(",", "")
    try:
        value = Decimal(body)
    except InvalidOperation:
        return None
    return -value if match.group("sign") in _MINUS else value


def numbers(text: str) -> list[Decimal]:
    """All numbers in ``text``, in order, under the conventions of the module docstring."""
    out = []
    for m in _NUMBER_RE.finditer(_clean(text)):
        v = _to_decimal(m)
        if v is not None:
            out.append(v)
    return out


def _number_right_after(text: str, pos: int) -> re.Match | None:
    """The number that directly follows ``text[pos:]`` (spaces, an answer phrase and one ``$``), else None."""
    return _NUMBER_RE.match(text, _LEAD_RE.match(text, pos).end())


def _plain(text: str, m: re.Match) -> Decimal | None:
    """The value of the number ``m`` unless it is an operand of a fraction, power, root, ratio or product."""
    if _OPERATOR_AFTER_RE.match(text, m.end()) or _OPERATOR_BEFORE_RE.search(text, max(0, m.start() - 12), m.start()):
        return None
    return _to_decimal(m)


def _is_heading(text: str, pos: int, last_content: int) -> bool:
    """Is the marker at ``pos`` (no number right after it) a markdown heading? See module docstring."""
    line_start = text.rfind("\n", 0, pos) + 1
    prefix = text[line_start:pos].lstrip(" \t")
    if len(prefix) > 2 or prefix.strip("#"):  # text before it on its line ("#####"/"######" are headings)
        return False  # (so a line holds at most one heading: the scan stays linear)
    line_end = text.find("\n", pos)
    return line_end != -1 and line_end < last_content  # more text on the lines below


def _deciding_marker(text: str) -> tuple[int, int, re.Match | None] | None:
    """The marker that declares the answer (the last one that is not a heading): (start, end) of its
    answer span and the number written right after it (or None); None when there is no such marker."""
    last_content = len(text.rstrip())
    end = len(text)  # the current marker's answer runs up to the next marker
    pos = text.rfind(MARKER)
    while pos != -1:
        after = pos + len(MARKER)
        direct = _number_right_after(text, after)
        if direct is not None or not _is_heading(text, pos, last_content):
            return after, max(after, end), direct
        end = pos
        pos = text.rfind(MARKER, 0, pos)
    return None


def extract_predicted_number(completion: str) -> Decimal | None:
    """The number a completion declares as its answer (``#### N``, else the last box, else the last number)."""
    text = _clean(completion)
    marker = _deciding_marker(text)
    if marker is None:
        boxed = last_boxed(text)
        found = numbers(_BOX_UNIT_RE.sub(" ", boxed)) if boxed is not None else []
        if found:
            return found[0] if len(found) == 1 else None
        last = None
        for last in _NUMBER_RE.finditer(text):
            pass
        return _plain(text, last) if last is not None else None
    start, end, direct = marker
    if direct is None:
        direct = _NUMBER_RE.search(text, start, end)
    return _plain(text, direct) if direct is not None else None


def marked_number(completion: str) -> Decimal | None:
    """The number written right after the marker that declares the answer (``#### 42``, ``#### $-5``), or
    None: the form the "gsm8k" format reward (llamarl.rewards.format) asks for."""
    text = _clean(completion)
    marker = _deciding_marker(text)
    return None if marker is None or marker[2] is None else _plain(text, marker[2])


def extract_reference_number(answer: str) -> Decimal | None:
    """The reference value: the one number after the last ``####`` (or in the whole string); None when
    there is no number or more than one."""
    answer = _clean(answer)
    tail = answer.rsplit(MARKER, 1)[1] if MARKER in answer else answer
    found = numbers(tail)
    return found[0] if len(found) == 1 else None


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 iff the completion's final number equals the reference answer's number, else 0.0."""
    completion, answer = completion_text(completion, "gsm8k_reward"), answer_text(answer, "gsm8k_reward")
    try:
        ref = extract_reference_number(answer)
        pred = extract_predicted_number(completion)
    except Exception:  # defensive: the regex path has no known failure, but a reward must not raise
        return 0.0
    if ref is None or pred is None:
        return 0.0
    return 1.0 if pred == ref else 0.0
