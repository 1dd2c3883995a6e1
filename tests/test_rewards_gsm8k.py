"""GSM8K verifier: hand-checked tables (positive and adversarial negative cases), the number grammar,
the format reward, and fuzzing (any string pair scores 0.0 or 1.0 without raising)."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamarl.rewards import format_reward, gsm8k_reward
from llamarl.rewards.gsm8k import extract_predicted_number, numbers

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# (completion, reference answer, expected reward) -- each checked by hand against the module docstring.
CASES = [
    # --- correct ---
    ("The answer is #### 72", "72", 1.0),
    ("She sold 24 in May, 72 in total.\n#### 72", GSM8K_SOLUTION, 1.0),  # full solution as reference
    ("####72", "72", 1.0),  # no space after the marker
    ("#### 1,000", "1000", 1.0),  # thousands separators, either side
    ("#### 1000", "1,000", 1.0),
    ("The result is 1,234,567", "1234567", 1.0),
    ("Total: 3,000,000.", "3000000", 1.0),  # sentence period is not a decimal point
    ("So she earns $18 every day.", "18", 1.0),  # currency sign, last-number fallback
    ("The total is 18 dollars.", "18", 1.0),  # trailing unit
    ("#### 18 eggs", "18", 1.0),
    ("#### $1,234.50", "1234.5", 1.0),  # decimals compare as numbers
    ("#### 72.00", "72", 1.0),
    ("#### 0.5", ".5", 1.0),
    ("I think it is 12%", "12", 1.0),  # percent sign ignored
    ("#### -5", "-5", 1.0),  # negative answers
    ("The temperature dropped to \u22125 degrees", "-5", 1.0),  # unicode minus
    ("x = -3", "-3", 1.0),
    ("#### +5", "5", 1.0),
    ("#### -$5", "-5", 1.0),
    ("-- 5 --", "5", 1.0),  # a dash followed by a space is not a sign
    ("It takes 3 hours. 3 + 2 = 5 bolts in total", "5", 1.0),  # last number
    ("12 apples - 4 apples = 8 apples", "8", 1.0),
    ("Answer: 10-4=6", "6", 1.0),  # '-' after a digit is subtraction, not a sign
    ("#### 5\n\nCheck: 1 2 3 4 7 8", "5", 1.0),  # the marker beats later numbers
    ("First #### 3, then a correction #### 4", "4", 1.0),  # the last marker counts
    ("\\boxed{42}", "42", 1.0),
    ("#### 5", "  5\n", 1.0),  # whitespace around the reference
    ("The answer is 8.", "8", 1.0),
    # --- wrong ---
    ("#### 720", "72", 0.0),  # shares digits
    ("#### 7.2", "72", 0.0),
    ("#### 27", "72", 0.0),
    ("#### 7", "72", 0.0),
    ("#### 0.72", "72", 0.0),
    ("#### -72", "72", 0.0),  # sign matters
    ("#### 1,000", "100", 0.0),
    ("#### 12,34", "1234", 0.0),  # not a thousands grouping: the numbers 12 and 34
    ("The answer is 72 but I computed 73", "72", 0.0),  # last number is 73
    ("10-4=6 ... wait, let me subtract 10-4", "6", 0.0),  # last number is 4
    ("#### 72\n#### 73", "72", 0.0),  # last marker
    ("I wrote 72 earlier. #### seventy-two", "72", 0.0),  # marker present, no number after it
    ("####", "72", 0.0),
    ("No numbers here", "72", 0.0),
    ("", "72", 0.0),
    ("#### 72", "seventy-two", 0.0),  # a reference without a number cannot be matched
    ("#### 72", "", 0.0),
    ("#### 72", "Because ... #### 27", 0.0),  # full-solution reference with another answer
    ("The answer is 3/4", "0.75", 0.0),  # no fractions: the last number is 4
    ("#### 5e3", "5000", 0.0),  # no scientific notation: 5
    ("#### 72", "720", 0.0),
    # --- markdown "####" headings are not answer markers ---
    ("#### Step 1: Cost\n10 * 3 = 30\n#### Step 2: Add tax\n30 + 12 = 42\nThe answer is 42.", "42", 1.0),
    ("#### Final Answer\nShe has 12 + 30 = 42 apples.", "42", 1.0),
    ("#### Step 2\nThe answer is 7", "2", 0.0),  # the heading's number is not the answer
    ("#### Step 2\nThe answer is 7", "7", 1.0),
    ("##### Step 2\nSo 9", "9", 1.0),  # deeper headings too
    ("So 42.\n\n#### Check\nWe used 6 boxes of 7", "7", 1.0),  # only headings: the last number
    ("#### 42\n\n#### Check\nWe used 6 boxes of 7", "42", 1.0),  # an answer marker before a heading
    ("I computed 72.\n#### seventy-two", "72", 0.0),  # a last-line marker is a declaration, not a heading
    ("#### Answer: 42 (6 * 7)", "42", 1.0),
    # --- an answer phrase after the marker: an answer, even with text below it; a box without a marker ---
    ("#### Answer: 72\n\nNatalia sold 72 clips over the 2 months.", "72", 1.0),
    ("#### The answer is 72\nThat is 24 more than in May.", "72", 1.0),
    ("#### The final answer is $72\nCheck: 24 + 48", "72", 1.0),
    ("#### Final Answer\n12 + 30 = 42", "42", 1.0),  # the phrase alone on its line: still a heading
    ("The answer is \\boxed{72}. (Check: 72 - 70 = 2)", "72", 1.0),  # the box beats the last number
    ("\\boxed{72}\nVerification: 8 x 9 = 72, and 72 / 8 = 9", "72", 1.0),
    ("\\boxed{72}, so #### 73", "73", 1.0),  # the marker beats the box
    ("\\boxed{x}, and x = 5", "5", 1.0),  # a box without a number: the last number
    ("\\boxed{72", "72", 1.0),  # an unclosed box is no box: the last number
    # --- dashes as minus signs ---
    ("#### \u201372", "-72", 1.0),  # en dash
    ("#### \uff0d72", "-72", 1.0),  # fullwidth hyphen-minus
    ("pages 10\u201315", "15", 1.0),  # an en dash after a digit is a range, not a sign
    # --- a reference that is not one number rewards nothing (it used to be cut to its first number) ---
    ("#### 1", "1e+21", 0.0),
    ("#### 3", "3/4", 0.0),
    ("#### 12", "12:30", 0.0),
    ("#### 10", "10-15", 0.0),
    ("#### 5", "5 or 6", 0.0),
    ("#### 2", "2 1/2", 0.0),
    # --- LaTeX number spellings ---
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("#### 1{,}000", "1000", 1.0),
    ("The total is $1\\,000$.", "1000", 1.0),
    ("#### 12\\,345\\,678", "12345678", 1.0),
    ("#### -\\$5", "-5", 1.0),
    ("$\\boxed{-\\$5}$", "-5", 1.0),
    ("#### 1000", "#### 1{,}000", 1.0),  # the reference is normalised too
    ("#### 1\\,2", "12", 0.0),  # a thin space is a thousands separator, like a comma
    # --- a number that is an operand is no answer (they were cut to their first, or last, number) ---
    ("\\boxed{\\frac{3}{4}}", "3", 0.0),
    ("Each gets $\\boxed{\\dfrac{5}{2}}$ pizzas.", "5", 0.0),
    ("\\boxed{3/4}", "3", 0.0),
    ("\\boxed{2^{10}}", "2", 0.0),
    ("\\boxed{5\\sqrt{2}}", "5", 0.0),
    ("\\boxed{12 - 4 = 8}", "12", 0.0),  # a box holds one number, like the reference
    ("#### 3/4", "3", 0.0),
    ("#### 3/4", "4", 0.0),
    ("#### 2^{10}", "2", 0.0),
    ("#### 12:30", "12", 0.0),
    ("#### The answer is \\frac{3}{4}", "3", 0.0),
    ("#### 4 \\times 6", "4", 0.0),
    ("The answer is 3/4", "4", 0.0),
    ("#### 30 / person", "30", 1.0),  # a slash before a word is no fraction
    ("#### 72. That is 70 + 2", "72", 1.0),
    ("\\boxed{\\$18.00}", "18", 1.0),
    # --- markdown emphasis is no product, a unit's exponent no second number ---
    ("The answer is **18**.", "18", 1.0),
    ("#### **18**", "18", 1.0),
    ("**Final Answer:** **18**", "18", 1.0),
    ("So she has *18* eggs left.", "18", 1.0),
    ("She has *18*.", "18", 1.0),
    ("The final answer is: **$18**", "18", 1.0),
    ("#### 3 * 6", "3", 0.0),
    ("\\boxed{18 \\text{ ft}^2}", "18", 1.0),
    ("$\\boxed{18 \\, \\text{cm}^2}$", "18", 1.0),
    ("\\boxed{18 m^2}", "18", 1.0),
    ("\\boxed{2^{10}}", "1024", 0.0),
]


def test_case_table_is_large_and_balanced():
    assert len(CASES) >= 40
    assert sum(e == 1.0 for *_, e in CASES) >= 15 and sum(e == 0.0 for *_, e in CASES) >= 15


@pytest.mark.parametrize("completion,answer,expected", CASES)
def test_gsm8k_reward_table(completion, answer, expected):
    assert gsm8k_reward(completion, answer) == expected


@pytest.mark.parametrize(
    "text,expected",
    [
        ("10-4", ["10", "4"]),
        ("x=-5", ["-5"]),
        ("1,234,567.5 and 12,34", ["1234567.5", "12", "34"]),
        ("1,2345", ["1", "2345"]),  # not a thousands grouping
        ("$1,200.50", ["1200.50"]),
        (".5 0.50 5.", ["0.5", "0.50", "5"]),
        ("v1.2.3", ["1.2"]),
        ("(\u22127)", ["-7"]),
        ("a-$5 and -$5", ["5", "-5"]),
        ("no digits", []),
    ],
)
def test_number_grammar(text, expected):
    assert numbers(text) == [Decimal(x) for x in expected]


def test_marker_without_number_declares_no_answer():
    assert extract_predicted_number("I computed 72. #### ?") is None
    assert extract_predicted_number("I computed 72.") == Decimal(72)
    assert extract_predicted_number("I computed 72.\n#### ?") is None
    assert extract_predicted_number("#### Result\nI computed 72.") == Decimal(72)  # a heading


# expressions, built in the child process: 200k headings, long '#' runs, many markers, thin spaces, a gap
_PATHOLOGICAL = [
    "'#### a\\n' * 200_000 + '5'",
    "'#' * 1_000_000 + '\\nfoo 5'",
    "'#### ' * 250_000 + '5'",
    "'\\\\,' * 500_000 + '5'",
    "'1' + ' ' * 500_000 + 'x 5'",
]


def test_pathological_inputs_stay_linear():
    """A quadratic scan would take hours on these; the child is killed instead of the suite hanging."""
    inputs = ", ".join(_PATHOLOGICAL)
    code = f"from llamarl.rewards import gsm8k_reward\nprint([gsm8k_reward(c, '5') for c in [{inputs}]])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str([1.0] * len(_PATHOLOGICAL))


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("reasoning...\n#### 72", 1.0),
        ("#### $1,000", 1.0),
        ("#### -3", 1.0),
        ("#### .5", 1.0),
        ("the answer is 72", 0.0),  # right number, wrong format
        ("#### seventy-two", 0.0),
        ("#### 7\n#### ?", 0.0),  # the last marker decides
        ("#### 42\n#### Check\n40 + 2 = 42", 1.0),  # ... unless it is a heading, as for the reward
        ("#### Steps\n40 + 2 = 42", 0.0),  # only a heading: no declared answer
        ("#### -$5", 1.0),
        ("#### Answer: 72\nbecause 24 + 48", 1.0),  # an answer phrase after the marker
        ("\\boxed{72}", 0.0),  # a box is not the GSM8K format
        ("#### 1{,}000", 1.0),
        ("", 0.0),
    ],
)
def test_gsm8k_format_reward(completion, expected):
    assert format_reward(completion, "gsm8k") == expected


@settings(max_examples=300, deadline=None)
@given(st.text(), st.text())
def test_fuzz_any_strings_never_raise(completion, answer):
    assert gsm8k_reward(completion, answer) in (0.0, 1.0)
    assert format_reward(completion, "gsm8k") in (0.0, 1.0)


_NUMBERISH = st.text(alphabet="0123456789,.-+$#% \n\u2212ex", max_size=40)


@settings(max_examples=300, deadline=None)
@given(_NUMBERISH, _NUMBERISH)
def test_fuzz_number_like_strings_never_raise(completion, answer):
    assert gsm8k_reward(completion, answer) in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12), st.integers(-10**12, 10**12), st.sampled_from(["{:,}", "{}", "${:,}"]))
def test_property_formatted_integers(x, y, fmt):
    text = fmt.format(x) if x >= 0 or not fmt.startswith("$") else "-$" + "{:,}".format(-x)
    assert gsm8k_reward(f"Work... #### {text} units", str(x)) == 1.0
    assert gsm8k_reward(f"Work... #### {text}", str(y)) == (1.0 if x == y else 0.0)
