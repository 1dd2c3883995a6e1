"""Verifiable rewards: built-in verifiers, reward specs, and a process pool that scores with timeouts.

    from llamarl.rewards import gsm8k_reward, math_reward, exact_reward, load_reward, RewardPool
    gsm8k_reward("... #### 72", "72") == 1.0          # final number, exact decimal equality
    math_reward("... \\boxed{\\frac{1}{2}}", "0.5") == 1.0 # last box, math-verify equivalence
    code_reward("```python\\ndef f(x): return 2 * x\\n```", '{"tests": ["assert f(2) == 4"]}') == 1.0
    fn = load_reward("math" | "gsm8k" | "exact" | "pkg.module:function" | "file.py:function")
    with RewardPool("math", num_workers=4, timeout_s=5.0) as pool:
        results = pool.score([(sample_id, completion, answer), ...])  # -> list[RewardResult]
    with RewardPool(["gsm8k", "format_gsm8k"], weights=[1.0, 0.2]) as pool:  # several terms (terms.py)
        r = pool.score([...])[0]; r.reward, r.terms, r.verifier           # 1.0 * r_0 + 0.2 * r_1, (r_0, r_1), r_0

Every reward function maps (completion: str, answer: str) to a float; the built-ins return exactly 1.0
or 0.0 and never raise (``code`` raises for a sample without tests: a data problem). Modules: gsm8k, math,
exact, code (verifiers), format (format rewards), deadline (thread-safe time budgets), registry (spec ->
function), terms (several functions as one reward), workers (RewardPool).
"""

from llamarl.rewards.code import code_reward
from llamarl.rewards.deadline import DeadlineExceeded, call_with_deadline
from llamarl.rewards.exact import exact_reward
from llamarl.rewards.format import FORMAT_STYLES, FormattedReward, format_reward
from llamarl.rewards.gsm8k import gsm8k_reward
from llamarl.rewards.math import math_reward
from llamarl.rewards.registry import BUILTIN_REWARDS, RewardFn, RewardSpecError, load_reward
from llamarl.rewards.workers import RewardPool, RewardPoolError, RewardResult, RewardStats

__all__ = [
    "BUILTIN_REWARDS",
    "FORMAT_STYLES",
    "DeadlineExceeded",
    "FormattedReward",
    "RewardFn",
    "RewardPool",
    "RewardPoolError",
    "RewardResult",
    "RewardSpecError",
    "RewardStats",
    "call_with_deadline",
    "code_reward",
    "exact_reward",
    "format_reward",
    "gsm8k_reward",
    "load_reward",
    "math_reward",
]
