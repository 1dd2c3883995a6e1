"""Sampled held-out evaluation (run.eval_samples, run.eval_temperature; veRL's val_kwargs): the settings are
checked up front, and a run reports mean@k as its accuracy with pass@k beside it (the controller's arithmetic
is checked against a hand count in test_controller_timeline.py)."""

import json

import pytest

from llamarl.config import ConfigError, RunConfig
from llamarl.train import main


def test_eval_sampling_settings_are_checked():
    with pytest.raises(ConfigError, match="run.eval_samples: more than one greedy completion per problem"):
        RunConfig(eval_samples=4)
    with pytest.raises(ConfigError, match=r"run.eval_temperature: must be 0 \(greedy\) or at least 0.0001"):
        RunConfig(eval_temperature=1e-6)
    with pytest.raises(ConfigError, match="run.eval_samples: must be > 0"):
        RunConfig(eval_samples=0, eval_temperature=1.0)
    with pytest.raises(ConfigError, match="run.eval_temperature: must be >= 0"):
        RunConfig(eval_temperature=-1.0)
    assert RunConfig(eval_samples=4, eval_temperature=0.6).eval_samples == 4


def test_a_run_with_sampled_evaluations_reports_mean_and_pass_at_k(tmp_path):
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--max-steps", "2", "--set", "run.eval_samples=3", "--set",
                 "run.eval_temperature=1.0", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"] == "mean@3, temperature 1"
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("event") == "eval"]
    assert len(evals) == 2  # before and after
    for e in evals:  # 8 held-out problems x 3 completions
        assert (e["accuracy"] * 24) == pytest.approx(round(e["accuracy"] * 24))
        assert (e["pass@3"] * 8) == pytest.approx(round(e["pass@3"] * 8)) and e["pass@3"] >= e["accuracy"] - 1e-12
    assert summary["accuracy_after"] == evals[-1]["accuracy"] and summary["pass@3_after"] == evals[-1]["pass@3"]
    assert summary["pass@3_before"] == evals[0]["pass@3"]
