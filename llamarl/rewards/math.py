"""MATH verifier: is the last ``\\boxed{...}`` of a completion mathematically equal to the reference?

Extraction:
  * completion: the argument of the *last* ``\\boxed`` (or ``\\fbox``) command, with nested braces
    (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); ``\\boxed 5`` (one bare math-like token: a number,
    a command or a single letter) is accepted too. A mention of the word followed by neither (``I used
    \\boxed as asked``) is not a box and is skipped. If the last box is not closed (a truncated
    completion), there is no answer: 0.0. No box at all: 0.0.
  * reference: the last box when the answer holds one (a full MATH solution may be passed), else the
    whole string with surrounding ``$``/``\\(``/``\\[`` delimiters removed.

Equivalence, cheapest first:
  1. the two strings are equal after removing spacing and sizing noise (whitespace and the LaTeX spaces
     ``\\,`` ``\\;`` ``\\:`` ``\\ `` ``~``, ``\\left``, ``\\right``, ``\\!``, ``\\dfrac``/``\\tfrac`` -> ``\\frac``,
     a trailing period); a space between two digits is kept (``1 2`` and ``1\\;2`` are not ``12``) unless it
     is one space before a group of exactly three digits (``1 000`` = ``1\\,000`` = ``1000``);
  2. math-verify (Hugging Face; sympy underneath): each side is parsed from LaTeX to sympy and compared
     numerically and symbolically, which covers equal fractions (2/4 = 1/2 = 0.5), radicals (sqrt 8 =
     2 sqrt 2), intervals, sets, percentages (50% = 50 = 0.5, as math-verify grades them), units and
     degree signs (``^\\circ``, and ``°`` or ``\\degree``, which are spelled ``^{\\circ}`` first),
     ``x = 5`` against ``5``, and LaTeX spelling variants.

Bounding the cost (the verifier must never hang a run, in any thread):
  * math-verify's own ``signal.alarm`` timeouts are switched off (they only work in the main thread) and
    the whole parse+compare runs under ``call_with_deadline`` (``timeout_s``, default 2 s) instead;
  * answers longer than ``MAX_ANSWER_CHARS`` skip step 2;
  * LaTeX that latex2sympy evaluates while parsing (``\\binom``/``\\Gamma``/``\\gamma(..)`` of big
    arguments, the index of ``\\sqrt[n]{..}``, the values substituted at an evaluation bar ``f|_{x=a}``,
    ``\\det``/``\\gcd``/``\\lcm``, matrix constructors like ``\\operatorname{zeros}``) is screened out
    before parsing; only those arguments are screened, so ``\\binom{6}{3}\\cdot 2`` still parses;
  * parsed expressions whose evaluation needs huge integers (``9^{9^{9}}``, ``100000!``) or expansion of
    high symbolic powers are rejected before sympy touches them: big-integer arithmetic runs inside
    one C call that no in-process timer can interrupt (see ``deadline.py``). A non-integer exponent
    (``x^{0.5}``, ``2^{\\pi}``) is bounded by its numeric value; sums, products, integrals and limits
    with a numeric bound or limit point beyond ``MAX_RANGE_BOUND`` (``\\prod_{i=1}^{10^{9}} 9``), or whose
    value would need too many digits, are rejected too (such answers score 0.0; infinite and symbolic
    bounds are kept).

Invariant: ``math_reward`` returns exactly 1.0 or 0.0 and never raises, for any pair of strings (a chat
completion or a numeric answer is read as llamarl.rewards.inputs says; other types raise TypeError).
"""

from __future__ import annotations

import logging
import math
import re
from functools import lru_cache
from typing import Any

from llamarl.rewards.deadline import DeadlineExceeded, call_with_deadline
from llamarl.rewards.inputs import answer_text, completion_text

MAX_ANSWER_CHARS = 1000
MAX_RESULT_DIGITS = 20_000  # rejects a numeric subexpression that may need more decimal digits
MAX_SYMBOLIC_EXPONENT = 100  # rejects (expr with symbols)^N for a rational or integer-valued |N| above this
MAX_SYMBOL_EXPONENT = 10_000  # the same for a plain symbol (x^N is never expanded into terms)
MAX_COMBINATORIAL_ARG = 5_000  # rejects n!, binomial(n, k), gamma(n) ... for n above this
MAX_RANGE_BOUND = 1_000  # rejects sums/products/integrals/limits with a numeric bound or point above this
DEFAULT_TIMEOUT_S = 2.0

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_TOKEN_RE = re.compile(r"[^\s$]+")
_SPACES_RE = re.compile(r"\s*")
# a bare box argument looks like math: a number, a command, or a single letter ("5", "-3", "\\pi", "x^2")
_MATH_TOKEN_RE = re.compile(r"[-+]?(?:\d|\.\d|\\[A-Za-z]|[A-Za-z](?![A-Za-z]))")


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
    """Argument of the last ``\\boxed``/``\\fbox`` in ``text``; None if there is none or it is unclosed.

    A mention of the command followed by neither a brace group nor a math-like bare token (``I used
    \\boxed as asked``) is prose, not a box: it is skipped and the box before it counts.
    """
    for match in reversed(list(_BOX_RE.finditer(text))):
        start = _SPACES_RE.match(text, match.end()).end()
        if text.startswith("{", start):
            return _braced(text, start)
        # "\boxed 5", "\boxed5": one bare token up to whitespace or '$' (no slicing here: the scan stays linear);
        # TeX would box only the first character of "\boxed12", but a model writing it means 12
        if _MATH_TOKEN_RE.match(text, start) and not _BOX_RE.match(text, start):
            return _BARE_TOKEN_RE.match(text, start).group(0).rstrip(".,;:?")  # "\boxed 5, so" -> 5 (5! stays)
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


_NOISE_RE = re.compile(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\!|\\displaystyle")
_SPACING_RE = re.compile(r"\\[,;: ]|~")  # LaTeX spaces: a space like any other (``1\;2`` is not ``12``)
# whitespace between two digits: a thousands separator before exactly three digits ("1 000"), else it
# separates two numbers ("1 2" is not "12") and is kept as one space
_DIGIT_GAP_RE = re.compile(r"(?<=\d)\s+(?=\d)")
_THREE_DIGITS_RE = re.compile(r"\d{3}(?!\d)")


def _digit_gap(match: re.Match) -> str:
    thousands = match.group(0) == " " and _THREE_DIGITS_RE.match(match.string, match.end())
    return "" if thousands else "\0"  # placeholder for a kept space (all whitespace goes next)


def normalize_latex(s: str) -> str:
    """Spacing/sizing-insensitive form used for the cheap string comparison (step 1)."""
    s = _SPACING_RE.sub(" ", _NOISE_RE.sub("", s))
    s = _DIGIT_GAP_RE.sub(_digit_gap, s)
    s = re.sub(r"\s+", "", s).replace("\0", " ")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


# ------------------------------------------------------------------------------------ safety screen
@lru_cache(maxsize=1)
def _sympy_guards() -> tuple[Any, tuple[type, ...], tuple[type, ...]]:
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
    ranged = (sympy.Sum, sympy.Product, sympy.Integral, sympy.Limit)
    return sympy, combinatorial, ranged


def _ranges(node: Any) -> list[tuple[Any, list[Any]]]:
    """(variable, bounds) of a Sum/Product/Integral (its limits) or a Limit (its point)."""
    sympy, _, _ = _sympy_guards()
    if isinstance(node, sympy.Limit):
        return [(node.args[1], [node.args[2]])]
    return [(lim[0], list(lim[1:])) for lim in node.limits]


def _is_infinite_atom(e: Any) -> bool:
    return bool(e.is_Atom and e.is_infinite)


def _magnitude(e: Any, env: dict | None = None) -> float:
    """Upper bound on ``|e|``: numeric for a symbol-free ``e`` whose exact value is affordable, else
    ``10**_digits`` (symbols bound in ``env`` count with their digits, free ones as 1 digit)."""
    if e.free_symbols:
        d = _digits(e, env)
        return 10.0**d if d < 300 else math.inf
    if _is_infinite_atom(e) or _digits(e) > MAX_RESULT_DIGITS:
        return math.inf
    try:
        m = abs(complex(e.evalf(15)))
    except Exception:  # not a number (nan, zoo, an unevaluated object)
        return math.inf
    return m if math.isfinite(m) else math.inf


def _digits(e: Any, env: dict | None = None) -> float:
    """Upper bound on the decimal digits needed to write the numeric subexpression ``e`` exactly.

    Symbols count as 1 digit, except the variables of enclosing sums/products/integrals/limits, which
    ``env`` maps to the digits of their bounds (``9^{i}`` summed to ``i = 1000`` needs ~1000 digits).
    """
    sympy, combinatorial, ranged = _sympy_guards()
    env = env or {}
    if isinstance(e, sympy.Integer):
        return max(1.0, int(e.p).bit_length() * math.log10(2))
    if isinstance(e, sympy.Rational):
        return max(int(e.p).bit_length(), int(e.q).bit_length()) * math.log10(2) + 1
    if isinstance(e, sympy.Symbol):
        return env.get(e, 1.0)
    if isinstance(e, sympy.Float) or e.is_NumberSymbol or e.is_Atom:
        return 20.0
    if isinstance(e, sympy.Pow):
        if e.exp.is_Rational:
            if _digits(e.exp) > 9:  # numerator or denominator >= 1e9: hopeless
                return math.inf
            return _digits(e.base, env) * max(1.0, abs(float(e.exp)))  # digits(b^n) <= n digits(b)
        exponent = _magnitude(e.exp, env)  # pi, 0.5, sqrt(2), an unevaluated 10^{10}, i ...
        if exponent > 1e9:
            return math.inf
        return _digits(e.base, env) * max(1.0, exponent)
    if isinstance(e, combinatorial):
        arg_digits = max((_digits(a, env) for a in e.args), default=1.0)
        if arg_digits > math.log10(MAX_COMBINATORIAL_ARG):
            return math.inf
        n = 10.0**arg_digits
        return n * math.log10(n) + 1
    if isinstance(e, ranged):  # the body at the extreme value of each variable, times the term count
        inner = dict(env)
        count = 1.0
        for var, bounds in reversed(_ranges(e)):  # outermost first: inner bounds may use its variable
            finite = [_magnitude(b, inner) for b in bounds if not _is_infinite_atom(b)]
            if any(m == math.inf for m in finite):
                return math.inf
            inner[var] = max([1.0] + [math.log10(m + 1) for m in finite])
            if len(finite) == 2:
                count *= sum(finite) + 1
        body = _digits(e.args[0], inner)
        if isinstance(e, sympy.Product):
            return body * count
        return body + math.log10(count) + 1
    if isinstance(e, sympy.Mul):
        return sum(_digits(a, env) for a in e.args)
    return max((_digits(a, env) for a in e.args), default=1.0) + 1  # Add, functions, containers


def is_safe_to_evaluate(expr: Any) -> bool:
    """False when comparing ``expr`` might need huge integers or a huge symbolic expansion."""
    sympy, combinatorial, ranged = _sympy_guards()
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
            elif node.exp.is_Rational:  # (x+1)^N is expanded: bound N
                if abs(node.exp) > (MAX_SYMBOL_EXPONENT if node.base.is_Symbol else MAX_SYMBOLIC_EXPONENT):
                    return False
            elif not node.exp.free_symbols:  # x^pi, x^{0.5}: only a huge or integer-valued one is bad
                exponent = _magnitude(node.exp)
                if exponent > 1e9 or (exponent > MAX_SYMBOLIC_EXPONENT and exponent == int(exponent)):
                    return False
        elif isinstance(node, combinatorial):
            for arg in node.args:
                if not arg.free_symbols and _digits(arg) > math.log10(MAX_COMBINATORIAL_ARG):
                    return False
        elif isinstance(node, ranged):
            for _, bounds in _ranges(node):
                for b in bounds:
                    if not b.free_symbols and not _is_infinite_atom(b) and _magnitude(b) > MAX_RANGE_BOUND:
                        return False
            if _digits(node) > MAX_RESULT_DIGITS:
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
_EAGER_COMBINATORIAL_RE = re.compile(
    r"\\(?:(?P<binom>[dt]?binom)|(?P<choose>choose)|Gamma|gamma)(?![A-Za-z])"
)
_GROWTH_RE = re.compile(r"[\^!*]|\\cdot|\\times|\d*\.?\d+[eE]")
_EAGER_MATRIX_RE = re.compile(
    r"\\operatorname\s*\{?\s*(?:eye|zeros|ones|diag|rank|trace|tr|rref|nullspace|norm|eig\w*|"
    r"diagonalize|svd|SVD|hstack|vstack|orth\w*)(?![A-Za-z])"
)
# more arguments latex2sympy evaluates while parsing (one big-integer power in C, which no deadline stops):
# the index of a root, the values substituted at an evaluation bar, and determinants, gcd, lcm
_ROOT_INDEX_RE = re.compile(r"\\sqrt\s*(?=\[)")
_EVALUATION_BAR_RE = re.compile(r"\|\s*_\s*")
_EAGER_FUNCTION_RE = re.compile(r"\\(?:det|gcd|lcm)(?![A-Za-z])|\\operatorname\s*\{\s*(?:det|gcd|lcm)\s*\}")
_SKIP_RE = re.compile(r"(?:\s|\\[,;:! ]|[\^_](?:\{[^{}]*\}|\\?[A-Za-z0-9]))*")  # spaces, ^{2}, _1 ...
# what may follow \Gamma/\gamma when it is not applied to anything (\gamma is then Euler's constant)
_NOT_APPLIED_RE = re.compile(
    r"$|[-+=,;)\]}|&<>/*!]"
    r"|\\(?:cdot|times|div|pm|mp|right|le|leq|ge|geq|ne|neq|approx|quad|qquad)(?![A-Za-z])"
)
_CLOSERS = {"{": "}", "(": ")", "[": "]"}


def _group(latex: str, start: int) -> tuple[str, int] | None:
    """Content and end of the ``{...}``/``(...)``/``[...]`` group opening at ``latex[start]``."""
    opener = latex[start : start + 1]
    if opener == "{":
        content = _braced(latex, start)
        return None if content is None else (content, start + len(content) + 2)
    closer = _CLOSERS.get(opener)
    if closer is None:
        return None
    depth = 0
    for i in range(start, len(latex)):
        depth += {opener: 1, closer: -1}.get(latex[i], 0)
        if depth == 0:
            return latex[start + 1 : i], i + 1
    return None


def _eager_arguments(latex: str, match: re.Match) -> list[str] | None:
    """The arguments of an eager command (``\\binom{a}{b}`` -> [a, b]; ``\\Gamma(x)`` -> [x]; a bare
    ``\\gamma`` -> []), or None when they cannot be told apart (``{n \\choose k}``, ``\\binom 52``)."""
    if match.group("choose"):
        return None
    pos = _SKIP_RE.match(latex, match.end()).end()
    if latex.startswith("\\left", pos):
        pos += len("\\left")
    if match.group("binom"):
        args = []
        for _ in range(2):
            while latex[pos : pos + 1].isspace():
                pos += 1
            found = _group(latex, pos) if latex[pos : pos + 1] == "{" else None
            if found is None:
                return None
            args.append(found[0])
            pos = found[1]
        return args
    found = _group(latex, pos)
    if found is not None:
        return [found[0]]
    return [] if _NOT_APPLIED_RE.match(latex, pos) else None


# what a screened argument may hold: plain arithmetic of numbers and symbols, with no command that could
# evaluate to something big (\lcm, \operatorname{...}, \prod, \exp ... are refused)
_ARG_COMMAND_RE = re.compile(
    r"\\(?:[dt]?frac|sqrt|left|right|pi|infty|[lr]floor|[lr]ceil|[,;:! ]|var(?:epsilon|phi|theta)|"
    r"alpha|beta|delta|epsilon|zeta|eta|theta|iota|kappa|lambda|mu|nu|xi|rho|sigma|tau|upsilon|phi|chi|"
    r"psi|omega)(?![A-Za-z])"
)
_ARG_CHARS_RE = re.compile(r"[\w\s+\-/.,()\[\]{}|']*", re.ASCII)


def _small_argument(arg: str) -> bool:
    """True for an argument that surely evaluates to a number at most ``MAX_COMBINATORIAL_ARG``: plain
    arithmetic without powers or products, whose integers sum to at most that."""
    if _GROWTH_RE.search(arg) or not _ARG_CHARS_RE.fullmatch(_ARG_COMMAND_RE.sub(" ", arg)):
        return False
    runs = re.findall(r"\d+", arg)
    limit = MAX_COMBINATORIAL_ARG
    return all(len(d) <= len(str(limit)) for d in runs) and sum(int(d) for d in runs) <= limit


def is_safe_to_parse(latex: str) -> bool:
    """False for LaTeX whose mere parsing could take unbounded time or memory (see the regexes).

    Only the arguments of ``\\binom``/``\\Gamma``/``\\gamma``, root indices, substituted values and what
    follows ``\\det``/``\\gcd``/``\\lcm`` are screened (``_small_argument``), so ``\\binom{6}{3}\\cdot 2``
    and ``\\cos^2\\gamma`` parse; where the arguments cannot be delimited, everything after the command
    (all of the string for ``\\choose``) is screened instead.
    """
    if _EAGER_MATRIX_RE.search(latex):
        return False
    for match in _ROOT_INDEX_RE.finditer(latex):
        index = _group(latex, match.end())
        if index is None or not _small_argument(index[0]):
            return False
    for match in _EVALUATION_BAR_RE.finditer(latex):  # f|_{x=a, y=b}: a and b are substituted
        found = _group(latex, match.end()) if latex[match.end():match.end() + 1] == "{" else None
        values = found[0] if found is not None else latex[match.end():]
        if not _small_argument(values.replace("=", " ")):
            return False
    if any(not _small_argument(latex[m.end():]) for m in _EAGER_FUNCTION_RE.finditer(latex)):
        return False  # their arguments, up to the end (\det's matrix is refused: answers rarely hold one)
    for match in _EAGER_COMBINATORIAL_RE.finditer(latex):
        args = _eager_arguments(latex, match)
        if args is None:  # screen the rest of the string (all of it for the infix \choose)
            args = [latex[: match.start()] * bool(match.group("choose")) + " " + latex[match.end() :]]
        if not all(_small_argument(a) for a in args):
            return False
    return True


_DEGREE_RE = re.compile(r"\u00b0|\\degree(?![A-Za-z])")  # "30°", "30\degree": 30^{\circ} for latex2sympy


def _parse_boxed(content: str) -> list:
    parse, _, config = _math_verify()
    if not is_safe_to_parse(content):
        return []
    content = _DEGREE_RE.sub(lambda _: "^{\\circ}", content)
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
    completion, answer = completion_text(completion, "math_reward"), answer_text(answer, "math_reward")
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
