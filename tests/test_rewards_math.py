"""MATH verifier: hand-checked tables (equivalences, adversarial negatives, inputs that would make sympy
hang), the box extractor, the safety screens, the thread-safe deadline, and fuzzing (any string pair scores
0.0 or 1.0 without raising)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamarl.rewards import DeadlineExceeded, call_with_deadline, format_reward, math_reward
from llamarl.rewards import math as math_mod
from llamarl.rewards.math import is_safe_to_evaluate, is_safe_to_parse, last_boxed, reference_answer

# (completion, reference answer, expected reward) -- each checked by hand. The last block holds inputs
# whose naive evaluation needs astronomically large integers or matrices; they must score 0.0 promptly.
CASES = [
    (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", r"\frac12", 1.0),
    (r"\boxed{\dfrac{3}{6}}", "1/2", 1.0),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{1}{2}\sqrt{3}", 1.0),
    (r"$$\boxed{3\sqrt{2}}$$", r"\sqrt{18}", 1.0),
    (r"\boxed{(1, 2]}", r"(1,2]", 1.0),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3)", 1.0),
    (r"\boxed{x \in (-\infty, 3)}", r"(-\infty,3)", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{50}", r"50\%", 1.0),
    (r"\boxed{0.25}", r"25\%", 1.0),
    (r"\boxed{10\text{ cm}}", "10", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\$5}", "5", 1.0),
    (r"\boxed{5,000}", "5000", 1.0),
    (r"\boxed{x=5}", "5", 1.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    (r"\boxed{\text{Monday}}", r"\text{Monday}", 1.0),
    (r"\boxed{(x+1)^2}", r"x^2+2x+1", 1.0),
    (r"\boxed{2^{10}}", "1024", 1.0),
    (r"\boxed{\binom{10}{3}}", "120", 1.0),
    (r"\boxed{2i+3}", "3+2i", 1.0),
    (r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0),
    (r"\boxed{2x+1}", "y=2x+1", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
    (r"First guess: \boxed{3}. Checking again, the answer is \boxed{4}.", "4", 1.0),
    (r"I will write the result as \boxed{} at the end. Computing: 3+4=7, so \boxed{7}", "7", 1.0),
    (r"The area is $\boxed{12}$.", r"Using the formula, the area is $\boxed{12}$ square units.", 1.0),
    (r"\boxed 5", "5", 1.0),
    (r"\fbox{6}", "6", 1.0),
    (r"\boxed{[1, 2]}", r"(1,2]", 0.0),
    (r"\boxed{33}", "3", 0.0),
    (r"\boxed{13}", "31", 0.0),
    (r"\boxed{0.866}", r"\frac{\sqrt3}{2}", 0.0),
    (r"\boxed{-\frac{1}{2}}", r"\frac{1}{2}", 0.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"It is \boxed{4}... no wait, it is \boxed{5}", "4", 0.0),
    ("The answer is 4", "4", 0.0),
    (r"\boxed{4} and finally \boxed{4", "4", 0.0),
    (r"\boxed{}", "4", 0.0),
    (r"\boxed{  }", "4", 0.0),
    (r"\boxed{\begin{pmatrix}1\\3\end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 0.0),
    (r"\boxed{x^2+1}", "x^2-1", 0.0),
    (r"\boxed{10\text{ cm}}", "100", 0.0),
    (r"\boxed{\text{Tuesday}}", r"\text{Monday}", 0.0),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}", 0.0),
    (r"\boxed{2}", "", 0.0),
    (r"\boxed{9^{9^{9}}}", "1", 0.0),
    (r"\boxed{1}", r"9^{9^{9}}", 0.0),
    (r"\boxed{100000!}", "1", 0.0),
    (r"\boxed{\binom{10000000}{5000000}}", "1", 0.0),
    (r"\boxed{\operatorname{zeros}(100000,100000)}", "0", 0.0),
    (r"\boxed{(x+1)^{1000}}", "1", 0.0),
    (r"\boxed{10^{100000}}", "1", 0.0),
    (r"\boxed{9^{9^{9}}}", r"9^{9^{9}}", 1.0),  # identical strings need no evaluation
]


def test_case_table_is_large_and_balanced():
    assert len(CASES) >= 40
    assert sum(e == 1.0 for *_, e in CASES) >= 15 and sum(e == 0.0 for *_, e in CASES) >= 15


@pytest.mark.parametrize("completion,answer,expected", CASES)
def test_math_reward_table(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_same_verdicts_from_worker_threads():
    """math-verify's own timeouts use signal.alarm (main thread only); ours must work in any thread."""
    subset = CASES[::3]
    with ThreadPoolExecutor(max_workers=3) as ex:
        got = list(ex.map(lambda c: math_reward(c[0], c[1]), subset))
    assert got == [e for *_, e in subset]


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"a \boxed{1} b \boxed{2} c", "2"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the group
        (r"\boxed{a}{b}", "a"),
        (r"\boxed {x+1}", "x+1"),
        (r"\boxed 5$", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{1} \boxed{2", None),  # last box unclosed
        (r"\boxedx{3}", None),  # a different command
        (r"\boxed", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "answer,expected",
    [("$\\frac12$", "\\frac12"), ("\\(x+1\\)", "x+1"), (" 5 ", "5"), ("so $\\boxed{3}$.", "3"), ("$$7$$", "7")],
)
def test_reference_answer(answer, expected):
    assert reference_answer(answer) == expected


@pytest.mark.parametrize(
    "latex,safe",
    [
        (r"\binom{10}{3}", True),
        (r"\binom{10000000}{5000000}", False),
        (r"\binom{10^{7}}{2}", False),
        (r"\Gamma(5)", True),
        (r"\Gamma(10000000)", False),
        (r"\operatorname{zeros}(100000, 100000)", False),
        (r"\operatorname{eye}(9)", False),
        (r"9^{9^{9}}", True),  # parsed unevaluated; the tree screen catches it
    ],
)
def test_parse_screen(latex, safe):
    assert is_safe_to_parse(latex) == safe


def test_evaluation_screen():
    import sympy

    x = sympy.Symbol("x")
    nine = sympy.Integer(9)
    assert is_safe_to_evaluate(sympy.Pow(2, 10, evaluate=False))
    assert not is_safe_to_evaluate(sympy.Pow(nine, sympy.Pow(nine, nine, evaluate=False), evaluate=False))
    assert not is_safe_to_evaluate(sympy.Pow(10, 100000, evaluate=False))
    assert is_safe_to_evaluate((x + 1) ** 100)
    assert not is_safe_to_evaluate(sympy.Pow(x + 1, 1000, evaluate=False))
    assert not is_safe_to_evaluate(sympy.factorial(sympy.Integer(100000), evaluate=False))
    assert is_safe_to_evaluate(sympy.binomial(sympy.Symbol("n"), 2))
    assert is_safe_to_evaluate("some string")


def test_slow_comparison_scores_zero_in_any_thread(monkeypatch):
    """A comparison that runs past the budget returns 0.0 (here: a busy loop standing in for sympy)."""

    def busy(gold, pred):
        while True:
            pass

    monkeypatch.setattr(math_mod, "_equivalent", busy)
    assert math_reward(r"\boxed{1}", "2", timeout_s=0.2) == 0.0
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward(r"\boxed{1}", "2", timeout_s=0.2)))
    t.start()
    t.join(timeout=60)  # liveness only: a broken deadline would never return
    assert not t.is_alive() and out == [0.0]


def _busy():
    while True:
        pass


def test_deadline_returns_value_and_propagates_exceptions():
    assert call_with_deadline(lambda: 41 + 1, 5.0) == 42
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 5.0)
    with pytest.raises(ValueError, match="positive"):
        call_with_deadline(lambda: 1, 0.0)


def test_deadline_interrupts_main_and_other_threads():
    with pytest.raises(DeadlineExceeded):
        call_with_deadline(_busy, 0.1)
    caught = []

    def in_thread():
        try:
            call_with_deadline(_busy, 0.1)
        except DeadlineExceeded:
            caught.append(True)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(timeout=60)
    assert caught == [True]


def test_deadline_reinjects_after_a_swallowed_exception():
    def swallow_once():
        try:
            _busy()
        except BaseException:  # e.g. a library's blanket handler
            pass
        _busy()  # still running: the watchdog must strike again

    with pytest.raises(DeadlineExceeded):
        call_with_deadline(swallow_once, 0.1)


def test_no_stray_exception_after_a_finished_call():
    for _ in range(50):  # calls that finish right at their budget must not leak the injection later
        try:
            call_with_deadline(lambda: time.sleep(0.002), 0.002)
        except DeadlineExceeded:
            pass
    end = time.monotonic() + 0.2
    while time.monotonic() < end:  # an injected exception would surface in this loop
        pass


def test_nested_deadlines_keep_their_own_budgets():
    def inner():
        with pytest.raises(DeadlineExceeded):
            call_with_deadline(_busy, 0.05)
        return "inner timed out, outer still fine"

    assert call_with_deadline(inner, 30.0) == "inner timed out, outer still fine"


@pytest.mark.parametrize(
    "completion,expected",
    [(r"so \boxed{12}", 1.0), (r"\boxed{\frac{1}{2}}", 1.0), ("12", 0.0), (r"\boxed{}", 0.0), (r"\boxed{12", 0.0)],
)
def test_math_format_reward(completion, expected):
    assert format_reward(completion, "math") == expected


_LATEXISH = st.text(alphabet="0123456789+-*/^_{}()[]\\,.=!% abcxyz$", max_size=60)
_COMMANDS = st.sampled_from(["\\boxed{", "\\frac{", "\\sqrt{", "\\binom{", "\\left(", "\\right)", "}", "{", "^{"])


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80), st.text(max_size=40))
def test_fuzz_random_text_never_raises(completion, answer):
    assert math_reward(completion, answer) in (0.0, 1.0)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(_COMMANDS, _LATEXISH), max_size=8), _LATEXISH)
def test_fuzz_boxed_latex_never_raises(parts, answer):
    completion = "\\boxed{" + "".join(parts) + "}"
    assert math_reward(completion, answer) in (0.0, 1.0)
    assert format_reward(completion, "math") in (0.0, 1.0)
