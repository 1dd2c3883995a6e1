"""A reward made of several functions (TRL's reward_funcs / reward_weights): the weighted sum and each term
in process, in the worker pool and in a training run; correctness read from the verifier alone; a failing
term costs its sample and is named; the configuration refuses what cannot work before a run starts."""

from __future__ import annotations

import json
import math
import textwrap

import pytest

from llamarl.config import ConfigError, RewardConfig
from llamarl.config_cli import load_config
from llamarl.rewards import RewardPool, format_reward, gsm8k_reward, load_reward
from llamarl.rewards.terms import RewardTerms, check_weights, term_names


@pytest.fixture
def terms_file(tmp_path):
    path = tmp_path / "terms.py"
    path.write_text(textwrap.dedent("""
        def brevity(completion, answer):
            return -0.01 * len(completion)

        def by_level(completion, answer, level):
            return float(level)

        def needs_target(completion, answer, target):
            return float(completion.strip() == target)

        def broken(completion, answer):
            raise KeyError("no such thing")

        def not_a_number(completion, answer):
            return "high"
    """))
    return path


def test_the_reward_is_the_weighted_sum_of_its_terms(terms_file):
    specs = ["gsm8k", "format_gsm8k", f"{terms_file}:brevity"]
    terms = RewardTerms(specs, [1.0, 0.5, 2.0])
    for completion, answer in [("so #### 42", "42"), ("#### 41", "42"), ("42", "42"), ("", "7")]:
        total, parts, error = terms.score(completion, answer)
        want = (gsm8k_reward(completion, answer), format_reward(completion, "gsm8k"), -0.01 * len(completion))
        assert error is None and parts == want
        assert total == pytest.approx(1.0 * want[0] + 0.5 * want[1] + 2.0 * want[2], abs=1e-12)
    assert terms.names == ["gsm8k", "format_gsm8k", "brevity"]
    # no weights: 1.0 each
    assert RewardTerms(specs[:2]).score("#### 42", "42")[0] == 2.0


def test_a_failing_term_fails_the_sample_and_is_named(terms_file):
    total, parts, error = RewardTerms(["exact", f"{terms_file}:broken"]).score("1", "1")
    assert (total, parts) == (0.0, ()) and error.startswith("reward term 'broken': KeyError: 'no such thing' (at ")
    huge = RewardTerms(["exact", "format_exact"], [1e308, 1e308]).score("1", "1")  # finite terms, overflowing sum
    assert huge[:2] == (0.0, ()) and huge[2].startswith("the weighted sum of the reward terms")
    total, parts, error = RewardTerms(["exact", f"{terms_file}:not_a_number"]).score("1", "1")
    assert (total, parts) == (0.0, ()) and error.startswith("reward term 'not_a_number': reward function returned 'high'")
    # one function: the error reads as it always did
    assert RewardTerms(f"{terms_file}:broken").score("1", "1")[2].startswith("KeyError")


def test_term_names_and_weights():
    assert term_names(["gsm8k", "a/b.py:score", "pkg.mod:Cls.score", "gsm8k"]) == ["gsm8k", "score", "score_2",
                                                                                  "gsm8k_2"]
    assert check_weights((), 3) == (1.0, 1.0, 1.0) and check_weights([1, 0.5], 2) == (1.0, 0.5)
    with pytest.raises(ValueError, match="2 reward weights for 3 reward functions"):
        check_weights([1, 2], 3)
    with pytest.raises(ValueError, match="finite"):
        check_weights([1, math.inf], 2)


def test_format_rewards_are_built_in_reward_functions():
    for style in ("gsm8k", "math", "exact"):
        fn = load_reward(f"format_{style}")
        for text in ("#### 42", "\\boxed{3}", "17", "", "words"):
            assert fn(text, "ignored") == format_reward(text, style)


def test_the_pool_scores_every_term_sends_what_any_term_asks_for(terms_file):
    specs = ["exact", f"{terms_file}:by_level", f"{terms_file}:needs_target"]
    info = {"level": 3, "target": "5", "unused": object()}  # not picklable: must not cross to a worker
    with RewardPool(specs, num_workers=1, weights=[1.0, 0.1, 2.0]) as pool:
        right, wrong = pool.score([("a", "5", "5", info), ("b", "4", "5", info)])
    assert right.terms == (1.0, 3.0, 1.0) and right.reward == pytest.approx(1.0 + 0.3 + 2.0)
    assert wrong.terms == (0.0, 3.0, 0.0) and wrong.reward == pytest.approx(0.3) and wrong.verifier == 0.0
    assert right.error is None and right.verifier == 1.0
    with RewardPool(["exact", f"{terms_file}:broken"], num_workers=1, weights=[3.0, 1.0]) as pool:
        failed, = pool.score([("c", "5", "5")])
        # correctness alone: the verifier's own reward, unweighted, whatever the other terms do
        right, wrong = pool.score([("d", "5", "5"), ("e", "4", "5")], verifier_only=True)
    assert failed.reward == 0.0 and failed.terms == () and "reward term 'broken': KeyError" in failed.error
    assert failed.verifier == 0.0
    assert (right.reward, right.terms, right.error, wrong.reward, wrong.terms) == (1.0, (1.0,), None, 0.0, (0.0,))


def test_the_configuration_of_the_terms(tmp_path, terms_file):
    assert RewardConfig(extra=("format_exact",)).specs == ("exact", "format_exact")
    for text in ("[format_exact, 'format_math']", "format_exact, format_math"):  # YAML list or commas
        assert load_config(["--set", f"reward.extra={text}"]).reward.extra == ("format_exact", "format_math")
    for kwargs, pattern in [
        (dict(extra=("nope",)), r"reward.extra\[0\]: must be one of exact, gsm8k, math, code, format_exact"),
        (dict(extra=("format_exact",), weights=(1.0,)), r"reward.weights: needs one weight per reward function"),
        (dict(weights=(math.nan,)), r"reward.weights: must be finite"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            RewardConfig(**kwargs)
    with pytest.raises(ConfigError, match=r"reward.extra\[1\]: reward spec .*missing.py:f.* does not exist"):
        load_config(["--set", f"reward.extra=[format_exact, {tmp_path / 'missing.py'}:f]"])
    # a relative file spec is saved absolute, as reward.reward's is
    cfg = load_config(["--set", f"reward.extra=[{terms_file}:brevity]"])
    assert cfg.with_absolute_paths().reward.extra == (f"{terms_file.resolve()}:brevity",)


def test_a_term_needing_a_field_the_dataset_lacks_is_refused_before_the_run(tmp_path, terms_file, monkeypatch,
                                                                           capsys):
    from llamarl.train import main

    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    rc = main(["--preset", "smoke", "--dataset", str(data), "--set", f"reward.extra=[{terms_file}:needs_target]",
               "--out", str(tmp_path / "run")])
    assert rc == 2 and "reward.extra[0]: " in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_training_run_logs_each_term_and_trains_on_their_sum(tmp_path, monkeypatch):
    from llamarl.train import train

    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(["--preset", "smoke", "--set", "warm_start.steps=3", "--set", "reward.extra=[format_exact]",
                       "--set", "reward.weights=[1.0, 0.25]", "--set", "run.log_samples=8",
                       "--out", str(tmp_path / "run")])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == cfg.run.max_steps
    for r in steps:
        assert r["reward_mean"] == pytest.approx(r["reward/exact"] + 0.25 * r["reward/format_exact"])
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        t = s["reward_terms"]
        assert t == {"exact": load_reward("exact")(s["completion"], s["answer"]),
                     "format_exact": format_reward(s["completion"], "exact")}
        assert s["reward"] == pytest.approx(t["exact"] + 0.25 * t["format_exact"])


def test_overlong_penalty_is_dapos_soft_punishment():
    from llamarl.rewards.terms import overlong_penalty

    # budget 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at the budget
    assert [overlong_penalty(n, 10, 4) for n in range(0, 11)] == [0.0] * 7 + [-0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(9, 10, 4, penalty=2.0) == -1.5 and overlong_penalty(10, 10, 0) == 0.0
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer: must be below generator.max_new_tokens=4"):
        load_config(["--preset", "smoke", "--set", "reward.overlong_buffer=4"])
    with pytest.raises(ConfigError, match=r"reward.overlong_penalty: must be >= 0"):
        RewardConfig(overlong_penalty=-1.0)


def test_the_format_mix_applies_to_the_verifier_alone():
    """reward.format_weight mixes the format bonus into the verifier; an extra term scores as it does alone."""
    from llamarl.rewards.terms import RewardTerms

    terms = RewardTerms(["gsm8k", "exact"], format_weight=0.5, format_style="gsm8k")
    total, parts = terms.score("7", "7")[:2]
    assert parts[1] == 1.0 and parts[0] == 0.5 * 1.0 + 0.5 * format_reward("7", "gsm8k")
