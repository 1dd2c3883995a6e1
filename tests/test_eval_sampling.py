"""Sampled held-out evaluation (run.eval_samples, run.eval_temperature; veRL's val_kwargs): the settings are
checked up front, and a run reports mean@k as its accuracy with pass@k beside it (the controller's arithmetic
is checked against a hand count in test_controller_timeline.py)."""

import json
import re

import pytest

from llamarl.config import ConfigError, RunConfig
from llamarl.runlog import summary_table
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


def test_a_run_with_sampled_evaluations_reports_mean_and_pass_at_k(tmp_path, monkeypatch):
    """k = 12 completions per problem, more than the smoke run's 8-row batches (the generator's capacity must
    fit them). The verifier is a file that records what it scored: mean@12 and pass@12 of both evaluations are
    recounted from its record (before RL: the first 96 held-out scorings, after: the last 96)."""
    record = tmp_path / "scored.tsv"
    (tmp_path / "rw.py").write_text(
        "import os\n"
        "def score(completion, answer, sample_id):\n"
        "    right = float(len(completion) % 2 == 1)\n"
        "    with open(os.environ['SCORED'], 'a') as f:\n"
        "        f.write(f'{sample_id}\\t{right}\\n')\n"
        "    return right\n")
    monkeypatch.setenv("SCORED", str(record))
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--max-steps", "2", "--reward", f"{tmp_path / 'rw.py'}:score",
                 "--set", "run.eval_samples=12", "--set", "run.eval_temperature=1.0", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"] == "mean@12, temperature 1"
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("event") == "eval"]
    scored = [line.split("\t") for line in record.read_text().splitlines()]
    held = [(sid, float(right)) for sid, right in scored if sid.startswith("arith-heldout-")]
    assert len(held) == 2 * 8 * 12 and len(evals) == 2
    for e, part in zip(evals, (held[:96], held[96:])):
        by_problem: dict[str, list[float]] = {}
        for sid, right in part:
            by_problem.setdefault(sid.rsplit("#", 1)[0], []).append(right)
        assert len(by_problem) == 8 and all(len(v) == 12 for v in by_problem.values())
        assert e["accuracy"] == pytest.approx(sum(r for _, r in part) / 96)
        assert e["pass@12"] == pytest.approx(sum(max(v) for v in by_problem.values()) / 8)
        assert 0 < e["accuracy"] < 1  # the count is not trivial
    assert summary["accuracy_after"] == evals[-1]["accuracy"] and summary["pass@12_after"] == evals[-1]["pass@12"]
    assert summary["pass@12_before"] == evals[0]["pass@12"]
    table = summary_table(summary)  # what the run prints at its end
    assert re.search(r"held-out evaluation\s+mean@12, temperature 1\n", table)
    assert re.search(rf"pass@12 after RL\s+{summary['pass@12_after']:.3f}\n", table)
