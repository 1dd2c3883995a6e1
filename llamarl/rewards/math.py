"""MATH verifier: is the last ``\\boxed{...}`` of a completion mathematically equal to the reference?

Extraction:
  * completion: the argument of the *last* ``\\boxed`` (or ``\\fbox``) command, with nested braces
    (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); ``\\boxed 5`` (one bare token) is accepted too. If the
    last box is not closed (a truncated completion), there is no answer: 0.0. No box at all: 0.0.
  * reference: the last box when the answer holds one (a full MATH solution may be passed), else the
    whole string with surrounding ``$``/``\\(``/``\\[`` delimiters removed.

Equivalence, cheapest first:
  1. the two strings are equal after removing spacing and sizing noise (whitespace, ``\\left``,
     ``\\right``, ``\\!``, ``\\,`` ..., ``\\dfrac``/``\\tfrac`` -> ``\\frac``, a trailing period);
  2. math-verify (Hugging Face; sympy underneath): each side is parsed from LaTeX to sympy and compared
     numerically and symbolically, which covers equal fractions (2/4 = 1/2 = 0.5), radicals (sqrt 8 =
     2 sqrt 2), intervals, sets, percentages (50% = 50 = 0.5, as math-verify grades them), units and
     degree signs, ``x = 5`` against ``5``, and LaTeX spelling variants.

Bounding the cost (the verifier must never hang a run, in any thread):
  * math-verify's own ``signal.alarm`` timeouts are switched off (they only work in the main thread) and
    the whole parse+compare runs under ``call_with_deadline`` (``timeout_s``, default 2 s) instead;
  * answers longer than ``MAX_ANSWER_CHARS`` skip step 2;
  * LaTeX that latex2sympy evaluates while parsing (``\\binom`` of big numbers, ``\\Gamma``, matrix
    constructors like ``\\operatorname{zeros}``) is screened out before parsing;
  * parsed expressions whose evaluation needs huge integers (``9^{9^{9}}``, ``100000!``) or expansion of
    high symbolic powers are rejected before sympy touches them: big-integer arithmetic runs inside
    one C call that no in-process timer can interrupt (see ``deadline.py``).

Invariant: ``math_reward`` returns exactly 1.0 or 0.0 and never raises, for any pair of strings.
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from typing import Any

from llamarl.rewards.deadline import DeadlineExceeded, call_with_deadline

MAX_ANSWER_CHARS = 1000
MAX_RESULT_DIGITS = 20_000  # rejects a numeric subexpression that may need more decimal digits
MAX_SYMBOLIC_EXPONENT = 100  # rejects (expr with symbols)^N for |N| above this
MAX_COMBINATORIAL_ARG = 5_000  # rejects n!, binomial(n, k), gamma(n) ... for n above this
DEFAULT_TIMEOUT_S = 2.0

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


# ------------------------------------------------------------------------------------ extraction
def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == '{'``; None when it never closes."""
    depth = 0
    i = start
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":  # an escaped character (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Argument of the last ``\\boxed``/``\\fbox`` in ``text``; None if there is none or it is unclosed."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    end = matches[-1].end()
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        return _braced(text, end + len(rest) - len(stripped))
    if rest[:1].isspace() and stripped:  # "\boxed 5": one bare token up to whitespace or '$'
        token = re.match(r"[^\s$]+", stripped)
        return token.group(0) if token else None
    return None


def _strip_delimiters(answer: str) -> str:
    s = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left) : len(s) - len(right)].strip()
    return s


def reference_answer(answer: str) -> str:
    """The reference expression: the last box of a full solution, else the delimiter-free string."""
    if _BOX_RE.search(answer):
        boxed = last_boxed(answer)
        if boxed is not None:
            return boxed.strip()
    return _strip_delimiters(answer)


_NOISE_RE = re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\[!,;: ]|\\displaystyle|\s+")


def normalize_latex(s: str) -> str:
    """Spacing/sizing-insensitive form used for the cheap string comparison (step 1)."""
    s = _NOISE_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


# ------------------------------------------------------------------------------------ safety screen
@lru_cache(maxsize=1)
def _sympy_guards() -> tuple[Any, tuple[type, ...]]:
    import sympy
    from sympy.functions.combinatorial.factorials import (
        FallingFactorial,
        RisingFactorial,
        binomial,
        factorial,
        factorial2,
        subfactorial,
    )

    combinatorial = (factorial, factorial2, subfactorial, binomial, RisingFactorial, FallingFactorial,
                     sympy.gamma)
    return sympy, combinatorial


def _digits(e: Any) -> float:
    """Upper bound on the decimal digits needed to write the numeric subexpression ``e`` exactly."""
    sympy, combinatorial = _sympy_guards()
    if isinstance(e, sympy.Integer):
        return max(1.0, int(e.p).bit_length() * math.log10(2))
    if isinstance(e, sympy.Rational):
        return max(int(e.p).bit_length(), int(e.q).bit_length()) * math.log10(2) + 1
    if isinstance(e, sympy.Float) or e.is_NumberSymbol or e.is_Atom:
        return 20.0
    if isinstance(e, sympy.Pow):
        exp_digits = _digits(e.exp)
        if exp_digits > 9:  # |exponent| >= 1e9: hopeless
            return math.inf
        return _digits(e.base) * 10.0**exp_digits
    if isinstance(e, combinatorial):
        arg_digits = max((_digits(a) for a in e.args), default=1.0)
        if arg_digits > math.log10(MAX_COMBINATORIAL_ARG):
            return math.inf
        n = 10.0**arg_digits
        return n * math.log10(n) + 1
    if isinstance(e, sympy.Mul):
        return sum(_digits(a) for a in e.args)
    return max((_digits(a) for a in e.args), default=1.0) + 1  # Add, functions, containers


def is_safe_to_evaluate(expr: Any) -> bool:
    """False when comparing ``expr`` might need huge integers or a huge symbolic expansion."""
    sympy, combinatorial = _sympy_guards()
    if isinstance(expr, str):
        return True
    if isinstance(expr, sympy.MatrixBase) and not isinstance(expr, sympy.Basic):
        return all(is_safe_to_evaluate(x) for x in expr)
    if not isinstance(expr, sympy.Basic):
        return False
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            if not node.free_symbols:
                if _digits(node) > MAX_RESULT_DIGITS:
                    return False
            elif node.exp.is_Rational:
                if abs(node.exp) > MAX_SYMBOLIC_EXPONENT:
                    return False
            elif not node.exp.free_symbols and _digits(node.exp) > math.log10(MAX_SYMBOLIC_EXPONENT):
                return False
        elif isinstance(node, combinatorial):
            for arg in node.args:
                if not arg.free_symbols and _digits(arg) > math.log10(MAX_COMBINATORIAL_ARG):
                    return False
    return True


# ------------------------------------------------------------------------------------ math-verify
class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its own timeout is off; ours (``call_with_deadline``) is on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Any, Any, Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
    return parse, verify, (LatexExtractionConfig(), ExprExtractionConfig())


# LaTeX that latex2sympy evaluates eagerly while parsing, before any screen of the parsed tree can run:
# binomials and Gamma (huge integers), and matrix constructors/decompositions (huge memory, cubic time).
_EAGER_COMBINATORIAL_RE = re.compile(r"\\(?:[dt]?binom|choose|Gamma|gamma)(?![A-Za-z])")
_GROWTH_RE = re.compile(r"[\^!*]|\\cdot|\\times|\d*\.?\d+[eE]")
_EAGER_MATRIX_RE = re.compile(
    r"\\operatorname\s*\{?\s*(?:eye|zeros|ones|diag|rank|trace|tr|rref|nullspace|norm|eig\w*|"
    r"diagonalize|svd|SVD|hstack|vstack|orth\w*)(?![A-Za-z])"
)


def is_safe_to_parse(latex: str) -> bool:
    """False for LaTeX whose mere parsing could take unbounded time or memory (see the regexes)."""
    if _EAGER_MATRIX_RE.search(latex):
        return False
    if _EAGER_COMBINATORIAL_RE.search(latex):
        if _GROWTH_RE.search(latex):
            return False
        limit = MAX_COMBINATORIAL_ARG
        if any(len(d) > len(str(limit)) or int(d) > limit for d in re.findall(r"\d+", latex)):
            return False
    return True


def _parse_boxed(content: str) -> list:
    parse, _, config = _math_verify()
    if not is_safe_to_parse(content):
        return []
    parsed = parse("\\boxed{" + content + "}", extraction_config=config, parsing_timeout=None)
    return [p for p in parsed if is_safe_to_evaluate(p)]


def _equivalent(gold: str, pred: str) -> bool:
    _, verify, _ = _math_verify()
    gold_parsed = _parse_boxed(gold)
    pred_parsed = _parse_boxed(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def warm_up() -> None:
    """Import math-verify/sympy and run one comparison, so the first real sample is not slowed by it."""
    math_reward("\\boxed{\\frac{1}{2}}", "0.5")


def math_reward(completion: str, answer: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 iff the last box of ``completion`` is equivalent to ``answer`` (see module docstring)."""
    if not isinstance(completion, str) or not isinstance(answer, str):
        return 0.0
    try:
        pred = last_boxed(completion)
        gold = reference_answer(answer)
        if pred is None or not pred.strip() or not gold:
            return 0.0
        pred = pred.strip()
        if normalize_latex(pred) == normalize_latex(gold):
            return 1.0
        if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
            return 0.0
        _math_verify()  # the one-time import must not eat the comparison's budget
        return 1.0 if call_with_deadline(lambda: _equivalent(gold, pred), timeout_s) else 0.0
    except DeadlineExceeded:
        return 0.0
    except Exception:  # a parser bug on odd input must cost this sample its reward, not the run
        return 0.0
