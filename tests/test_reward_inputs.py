"""The built-in verifiers on inputs other than two strings (llamarl.rewards.inputs): a chat completion is read
as its last message, a numeric answer as its decimal text, so a right answer scores 1.0 (it scored 0.0,
silently: a dataset of numeric answers trained on all-zero rewards); any other type raises TypeError, which a
RewardPool counts as a failed reward instead of a wrong answer."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest

from llamarl.rewards import format_reward, load_reward
from llamarl.rewards.code import code_reward
from llamarl.rewards.exact import exact_reward
from llamarl.rewards.gsm8k import gsm8k_reward
from llamarl.rewards.math import math_reward

CHAT = [{"role": "user", "content": "6 x 12?"}, {"role": "assistant", "content": "#### 72"}]


@pytest.mark.parametrize("verifier, completion", [(gsm8k_reward, "so #### 72"), (math_reward, "\\boxed{72}"),
                                                  (exact_reward, "72\n"), (load_reward("gsm8k"), "#### 72")])
def test_a_numeric_answer_is_its_decimal_text(verifier, completion):
    for answer in (72, 72.0, "72"):
        assert verifier(completion, answer) == 1.0, answer
    assert verifier(completion, 73) == 0.0
    # a Decimal keeps its digits: equal for the value comparisons, not for exact's character match
    assert verifier(completion, Decimal("72.00")) == (0.0 if verifier is exact_reward else 1.0)


def test_numbers_read_as_their_shortest_decimal():
    import numpy as np

    assert gsm8k_reward("#### 0.5", 0.5) == gsm8k_reward("#### 0.00001", 1e-05) == 1.0
    # a numpy float32 (a pandas float32 column) reads as its own digits, not the float64 widening 72.0999984741211;
    # a big float positionally, without binary noise (not 99999999999999991611392)
    assert gsm8k_reward("#### 72.1", np.float32(72.1)) == exact_reward("72.1", np.float32(72.1)) == 1.0
    assert gsm8k_reward("#### 100000000000000000000000", 1e23) == 1.0
    assert math_reward("\\boxed{\\frac{1}{2}}", Fraction(1, 2)) == 1.0
    assert gsm8k_reward("#### 0.1", 0.1 + 0.2 - 0.2) == 0.0  # 0.10000000000000003: not 0.1


def test_a_chat_completion_is_its_last_messages_content():
    assert gsm8k_reward(CHAT, "72") == exact_reward([{"role": "assistant", "content": "72"}], "72") == 1.0
    assert math_reward([{"role": "assistant", "content": "\\boxed{72}"}], 72) == 1.0
    assert format_reward(CHAT, "gsm8k") == 1.0
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "so "}, {"type": "text", "text": "#### 72"}]}]
    assert gsm8k_reward(parts, "72") == 1.0
    with pytest.raises(TypeError, match="list of chat messages"):
        gsm8k_reward([{"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}], "72")
    assert code_reward([{"role": "assistant", "content": "```python\nprint(input())\n```"}],
                       '{"inputs": ["x"], "outputs": ["x"]}') == 1.0


@pytest.mark.parametrize("completion, answer", [(None, "72"), (b"72", "72"), (["72"], "72"), ("#### 72", None),
                                                ("#### 72", True), ("#### 72", ["72"]), ("#### 72", float("nan")),
                                                ([{"role": "assistant"}], "72")])
def test_other_types_raise_naming_the_verifier(completion, answer):
    with pytest.raises(TypeError, match="^gsm8k_reward: the (completion|answer) must be"):
        gsm8k_reward(completion, answer)
