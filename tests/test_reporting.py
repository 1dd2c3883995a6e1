"""Experiment trackers (``run.report_to``): the config check, and TensorBoard/W&B receiving exactly what
metrics.jsonl records, a resumed run included."""

from __future__ import annotations

import json
import math

import pytest

from llamarl.config import ConfigError
from llamarl.config_cli import load_config
from llamarl.reporting import TensorBoardReporter, check_available, numbers, parse_report_to
from llamarl.runlog import RunLog


def test_report_to_parsing_and_the_up_front_check(monkeypatch):
    assert parse_report_to("none") == [] and parse_report_to("") == []
    assert parse_report_to("tensorboard, wandb,tensorboard") == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) \['mlflow'\]"):
        parse_report_to("tensorboard,mlflow")
    with pytest.raises(ConfigError, match="run.report_to: unknown tracker"):
        load_config(["--preset", "smoke", "--set", "run.report_to=mlflow"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "wandb" else object())
    assert check_available(["tensorboard"]) is None
    assert 'pip install "llamarl[wandb]"' in check_available(["tensorboard", "wandb"])
    with pytest.raises(ConfigError, match=r"run.report_to: needs wandb, not installed here"):
        load_config(["--preset", "smoke", "--set", "run.report_to=wandb"])


def test_numbers_keeps_numeric_fields_only():
    assert numbers({"step": 3, "event": "eval", "loss": 0.5, "applied": True, "mode": "async", "x": None,
                    "tokens": 7}) == {"loss": 0.5, "applied": 1.0, "tokens": 7.0}


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard's UI shows: its data provider over the plugin event multiplexer (which, unlike the older
    EventAccumulator, ignores a directory's first START event when it purges)."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    runs = data_provider.MultiplexerDataProvider(mux, str(logdir)).read_scalars(
        context.RequestContext(), experiment_id="", plugin_name="scalars", downsample=10_000)
    (tags,) = runs.values()
    return {tag: [(p.step, p.value) for p in points] for tag, points in tags.items()}


def test_tensorboard_mirrors_the_log_and_a_resume_purges_redone_steps(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = {"run": {"seed": 0}}
    log = RunLog(tmp_path, 10, progress=False, reporters=[rep := TensorBoardReporter(tmp_path, cfg)])
    log.eval(0, {"accuracy": 0.25})
    for step in range(1, 6):
        log.step({"step": step, "reward_mean": step / 10, "applied": step != 3, "loss": float("nan"),
                  "staleness": 0, "sync_s": 0.0})
        log.samples([{"step": step, "sample_id": f"p#{step}", "completion": "a|b\nc", "reward": 1.0}])
    log.close()
    rep.close()
    # resumed from the step-3 checkpoint: steps 4 and 5 are redone, with other values
    log = RunLog(tmp_path, 10, initial_step=3, progress=False,
                 reporters=[rep := TensorBoardReporter(tmp_path, cfg, initial_step=3)])
    for step in (4, 5, 6):
        log.step({"step": step, "reward_mean": 1 + step, "applied": True, "loss": 0.0, "staleness": 1, "sync_s": 0.0})
    log.close()
    rep.close()
    got = _scalars(tmp_path / "tensorboard")
    assert got["train/reward_mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3)),
                                       (4, 5.0), (5, 6.0), (6, 7.0)]
    assert [v for _, v in got["train/applied"]] == [1, 1, 0, 1, 1, 1]
    assert got["eval/accuracy"] == [(0, 0.25)]
    assert math.isnan(got["train/loss"][0][1])
    # the same rows, in the same order, as metrics.jsonl holds
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval" not in x]
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(s, pytest.approx(v)) for s, v in got["train/reward_mean"]]


def test_a_resume_purges_a_directory_written_before_fresh_runs_marked_their_start(tmp_path):
    """An earlier llamarl's fresh run wrote no START event, so the resume's own START is the directory's first,
    which TensorBoard's UI ignores: the resume adds a second one."""
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    old = SummaryWriter(log_dir=str(tmp_path / "tensorboard"))  # as the earlier reporter's fresh run
    for step in range(1, 5):
        old.add_scalar("train/reward_mean", 100.0 + step, step)
    old.close()
    rep = TensorBoardReporter(tmp_path, {}, initial_step=2)
    for step in (3, 4, 5):
        rep.step({"step": step, "reward_mean": float(step)})
    rep.close()
    assert _scalars(tmp_path / "tensorboard")["train/reward_mean"] == [(1, 101.0), (2, 102.0), (3, 3.0), (4, 4.0),
                                                                        (5, 5.0)]


def test_wandb_offline_receives_steps_evals_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from llamarl.reporting import WandbReporter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rep = WandbReporter(tmp_path, {"run": {"wandb_project": "llamarl-test"}})
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    assert rep.run.id == run_id and rep.run.project == "llamarl-test"
    log = RunLog(tmp_path, 10, progress=False, reporters=[rep])
    log.step({"step": 1, "reward_mean": 0.5, "applied": True, "staleness": 0, "sync_s": 0.0})
    log.eval(1, {"accuracy": 0.75})
    log.step({"step": 2, "reward_mean": 0.25, "applied": False, "staleness": 1, "sync_s": 0.0})  # commits step 1
    rep.summary({"accuracy_after": 0.75, "mode": "async", "nested": {"x": 1}})
    s = rep.run.summary
    assert (s["train/reward_mean"], s["eval/accuracy"], s["accuracy_after"], s["mode"]) == (0.5, 0.75, 0.75, "async")
    assert "nested" not in s.keys()
    log.close()
    rep.close()
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}")), "no offline run directory"


def test_a_run_resumed_into_a_new_directory_mirrors_its_whole_history(tmp_path):
    """The new directory's logs carry the run's history (runlog.carry_history); its TensorBoard mirror starts
    empty, so the carried rows, evaluations and samples are sent to it first: it shows the whole run."""
    pytest.importorskip("tensorboard")
    from llamarl.train import main

    common = ["--set", "run.report_to=tensorboard", "--set", "run.checkpoint_every=2", "--set", "run.eval_every=2"]
    assert main(["--preset", "smoke", "--max-steps", "4", "--out", str(tmp_path / "A"), *common]) == 0
    assert main(["--resume", str(tmp_path / "A" / "checkpoints" / "step_000002"), "--max-steps", "5",
                 "--out", str(tmp_path / "B"), *common]) == 0
    rows = [json.loads(line) for line in (tmp_path / "B" / "metrics.jsonl").read_text().splitlines()]
    got = _scalars(tmp_path / "B" / "tensorboard")
    assert [s for s, _ in got["train/reward_mean"]] == [r["step"] for r in rows if "event" not in r] == [1, 2, 3, 4, 5]
    assert [s for s, _ in got["eval/accuracy"]] == [r["step"] for r in rows if "event" in r]
    assert [v for _, v in got["train/reward_mean"]] == [pytest.approx(r["reward_mean"]) for r in rows
                                                        if "event" not in r]
