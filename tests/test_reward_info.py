"""Reward functions that ask for more than (completion, answer): keyword parameters named after the
sample's prompt, id and dataset fields (veRL's extra_info, TRL's dataset columns), in process, in the
worker pool and in a training run, with a missing field refused before the run starts."""

from __future__ import annotations

import json
import textwrap
import threading

import pytest

from llamarl.rewards import FormattedReward, RewardPool
from llamarl.rewards.registry import InfoParams, call_reward, info_params
from llamarl.train import main

INFO = {"prompt": "1+1=", "sample_id": "s0", "target": "2", "level": 3}


def test_only_the_named_keywords_are_passed():
    def plain(completion, answer):
        return 1.0

    def named(completion, answer, target, level=0):
        return (target, level)

    def keyword_only(c, a, *, sample_id):
        return sample_id

    def everything(completion, answer, **info):
        return info

    def clash(response, reference, **info):  # TRL-style names; a record field "response" must not collide
        return (response, info)

    assert info_params(plain).select(INFO) is None  # nothing crosses to a worker for it
    assert info_params(named) == InfoParams(False, frozenset({"target", "level"}), frozenset({"target"}),
                                            frozenset({"completion", "answer"}))
    assert call_reward(plain, "2", "2", INFO) == 1.0
    assert call_reward(named, "2", "2", INFO) == ("2", 3)
    assert call_reward(keyword_only, "2", "2", INFO) == "s0"
    assert call_reward(everything, "2", "2", INFO) == INFO
    assert call_reward(clash, "2", "2", {**INFO, "response": "from the record"}) == ("2", INFO)
    formatted = FormattedReward(lambda c, a, target: float(c == target), "exact", 0.5)
    assert info_params(formatted).required == {"target"} and call_reward(formatted, "2", "3", INFO) == 1.0
    with pytest.raises(TypeError, match="target"):
        call_reward(named, "2", "2", {"prompt": "x"})


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text(textwrap.dedent("""
        import time

        def by_target(completion, answer, target, prompt):
            # right when the completion is the record's target and the prompt is the sample's own
            if prompt == "slow=":
                time.sleep(0.5)
            return float(completion.strip() == target and prompt.endswith("="))
    """))
    return f"{path}:by_target"


def test_the_worker_pool_passes_the_info(reward_file):
    with RewardPool(reward_file, num_workers=1, timeout_s=10.0) as pool:
        results = pool.score([("a", "7", "x", {"target": "7", "prompt": "3+4="}),
                              ("b", "7", "x", {"target": "8", "prompt": "3+5="}),
                              ("c", "7", "x"),  # no info: the function misses its arguments
                              # only what it takes crosses to the worker: an unpicklable field it ignores is fine
                              ("f", "7", "x", {"target": "7", "prompt": "3+4=", "unused": threading.Lock()})])
        # a value that cannot cross to a worker costs its sample, and the worker takes the next one (queued
        # behind it while the worker was busy: it waited forever for a wake-up)
        futures = [pool.submit(*item) for item in (
            ("s", "7", "x", {"target": "7", "prompt": "slow="}),
            ("d", "7", "x", {"target": threading.Lock(), "prompt": "3+4="}),  # a value it takes
            ("e", "7", "x", {"target": "7", "prompt": "3+4="}))]
        unsendable = [f.result(timeout=30) for f in futures]  # a TimeoutError, not a hung suite, if one is lost
    assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert "missing 2 required positional arguments" in results[2].error
    assert [r.reward for r in unsendable] == [1.0, 0.0, 1.0]
    assert "cannot send the sample to a reward worker" in unsendable[1].error


def test_a_run_scores_with_dataset_fields(tmp_path, reward_file, capsys):
    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i), "target": str(2 * i)} for i in range(30)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--preset", "smoke", "--dataset", str(path), "--reward", reward_file, "--max-steps", "2"]
    assert main(args + ["--out", str(tmp_path / "run"), "--set", "run.log_samples=8"]) == 0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reward_error"] is None for s in samples)
    assert all(s["reward"] == float(s["completion"].strip() == s["answer"]) for s in samples)
    no_target = tmp_path / "no_target.jsonl"
    no_target.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "target" or i})
                                 + "\n" for i, r in enumerate(rows)))
    assert main(args[:3] + [str(no_target)] + args[4:] + ["--out", str(tmp_path / "bad")]) == 2
    assert "reward.reward: " in (err := capsys.readouterr().err) and "needs the keyword argument(s) ['target']" in err
