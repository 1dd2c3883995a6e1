"""metrics.jsonl stays one clean history: whole lines only, and a resumed run continues it without the
steps the interrupted run logged after its checkpoint."""

from __future__ import annotations

import errno
import json
import math
import os

import pytest

import llamarl.runlog as runlog_module
from llamarl.runlog import RunLog


def _row(step: int) -> dict:
    return {"step": step, "reward_mean": 0.5, "staleness": 0, "sync_s": 0.0}


def _lines(out, name: str = "metrics.jsonl") -> list[dict]:
    text = (out / name).read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_a_resumed_log_drops_what_came_after_the_checkpoint_and_a_torn_line(tmp_path):
    log = RunLog(tmp_path, 10, progress=False)
    log.eval(0, {"accuracy": 0.1})
    for step in range(1, 7):
        log.step(_row(step))
        if step % 2 == 0:
            log.eval(step, {"accuracy": step / 10})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "reward_me')  # the crash came mid-write
    # resumed from the step-4 checkpoint: it redoes the evaluation at step 4 and steps 5, 6, ...
    log = RunLog(tmp_path, 10, initial_step=4, progress=False)
    log.eval(4, {"accuracy": 0.4})
    log.step(_row(5))
    log.close()
    got = [(r["step"], r.get("event")) for r in _lines(tmp_path)]
    assert got == [(0, "eval"), (1, None), (2, None), (2, "eval"), (3, None), (4, None), (4, "eval"), (5, None)]


def test_a_resumed_log_keeps_non_finite_values_and_drops_a_row_without_its_newline(tmp_path):
    """metrics.jsonl spells a NaN reward_mean (every verifier failed) "nan": it comes back as the float, so the
    plot and summary of the resumed run still work; a last row whose JSON is whole but whose newline was never
    written is torn too (the next row would share its line)."""
    rows = [dict(_row(1), reward_mean="nan", grad_norm="inf"), _row(2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps(_row(3)))
    log = RunLog(tmp_path, 5, initial_step=3, progress=False)
    first = log.rows[0]
    assert math.isnan(first["reward_mean"]) and first["grad_norm"] == math.inf
    log.plot(tmp_path / "plot.png")
    log.step(_row(4))
    log.close()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 4]


def test_samples_jsonl_is_resumed_like_metrics(tmp_path):
    log = RunLog(tmp_path, 10, progress=False)
    for step in range(1, 7):
        log.samples([{"step": step, "completion": f"c{step}.{i}", "reward": float("nan")} for i in range(2)])
    log.close()
    log = RunLog(tmp_path, 10, initial_step=4, progress=False)
    log.samples([{"step": 5, "completion": "again", "reward": 1.0}])
    log.close()
    rows = _lines(tmp_path, "samples.jsonl")
    assert [(r["step"], r["completion"]) for r in rows] == [
        (1, "c1.0"), (1, "c1.1"), (2, "c2.0"), (2, "c2.1"), (3, "c3.0"), (3, "c3.1"), (4, "c4.0"), (4, "c4.1"),
        (5, "again")]
    assert rows[0]["reward"] == "nan"  # non-finite numbers are written as strings: the file stays JSON


def test_a_failed_write_leaves_no_partial_line(tmp_path, monkeypatch):
    log = RunLog(tmp_path, 10, progress=False)
    log.step(_row(1))
    real_write = runlog_module.os.write

    def disk_full(fd, data):  # writes part of the line, then the disk is full
        real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runlog_module.os, "write", disk_full)
    with pytest.raises(OSError, match="No space left"):
        log.step(_row(2))
    monkeypatch.setattr(runlog_module.os, "write", real_write)
    log.step(_row(3))  # space again: the log goes on, whole lines only
    log.close()
    assert [r["step"] for r in _lines(tmp_path)] == [1, 3]


def test_claiming_a_run_dir_locks_it_and_cuts_a_resumed_segment_back(tmp_path):
    """One holder at a time (the lock is per open file, so a second claim from this process is refused
    too); a resume from step 2 of a directory that reached step 4 leaves checkpoints, logs, summary and
    config describing steps 1-2 only, and says what it discarded."""
    from llamarl.checkpoint import list_checkpoints, save_checkpoint
    from llamarl.config import ConfigError

    out = tmp_path / "run"
    log = RunLog(out, 4, progress=False)
    log.eval(0, {"accuracy": 0.1})
    for step in range(1, 5):
        log.step(_row(step))
        log.samples([{"step": step, "completion": "x"}])
        save_checkpoint(out, step, policy_state=None, policy_version=step, keep=5)
    log.eval(4, {"accuracy": 0.2})
    log.close()
    (out / "summary.json").write_text('{"steps": 4}')
    (out / "config.yaml").write_text("first: segment\n")

    lock = runlog_module.claim_run_dir(out, "first: segment\n")
    with pytest.raises(ConfigError, match=rf"^run.out: {out} is in use by another llamarl run \(pid {os.getpid()}\); "
                                          "wait for it to end or pick another --out$"):
        runlog_module.claim_run_dir(out, "second: run\n", resume_step=2)
    assert [s for s, _ in list_checkpoints(out)] == [1, 2, 3, 4] and len(_lines(out)) == 6  # untouched
    lock.release()

    warned = []
    lock = runlog_module.claim_run_dir(out, "second: segment\n", resume_step=2, warn=warned.append)
    lock.release()
    assert [s for s, _ in list_checkpoints(out)] == [1, 2]
    assert [(r.get("event"), r["step"]) for r in _lines(out)] == [("eval", 0), (None, 1), (None, 2)]
    assert [r["step"] for r in _lines(out, "samples.jsonl")] == [1, 2]
    assert not (out / "summary.json").exists() and (out / "summary.prev.json").read_text() == '{"steps": 4}'
    assert (out / "config.yaml").read_text() == "second: segment\n"
    assert (out / "config.prev.yaml").read_text() == "first: segment\n"
    assert len(warned) == 1 and "step_000003, step_000004" in warned[0], warned
    assert int((out / ".lock").read_text()) == os.getpid()


def test_a_file_system_without_flock_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    """Some Lustre and FUSE mounts refuse flock (ENOSYS, EOPNOTSUPP, ENOLCK): the run still starts, says that
    a second run would not be refused, and writes its pid; any other error is still a ConfigError."""
    import errno
    import fcntl

    from llamarl.config import ConfigError

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    warned = []
    lock = runlog_module.claim_run_dir(tmp_path / "run", "a: 1\n", warn=warned.append)
    lock.release()
    assert not lock.locked and len(warned) == 1 and "cannot lock files" in warned[0]
    assert int((tmp_path / "run" / ".lock").read_text()) == os.getpid()

    def broken(fd, op):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(ConfigError, match="run.out: cannot write the run directory"):
        runlog_module.claim_run_dir(tmp_path / "other", "a: 1\n")


def test_the_eval_curve_keeps_one_measure_when_a_resume_drops_the_verifier():
    """A run that evaluated with a verifier and a reward model, resumed with reward.reward=none: the plot's
    line is the reward model's score throughout (the earlier evaluations' too), never a mix of accuracy and
    score; a run whose every evaluation has an accuracy plots the accuracy."""
    from llamarl.runlog import eval_curve

    mixed = [{"step": 0, "accuracy": 0.0, "model_score": 0.25}, {"step": 2, "model_score": 0.5}]
    assert eval_curve(mixed) == ("held-out reward model score", [0.25, 0.5])
    label, values = eval_curve([{"step": 0, "accuracy": 0.5}, {"step": 2, "model_score": 0.75}])
    assert label == "held-out reward model score" and math.isnan(values[0]) and values[1] == 0.75
    assert eval_curve([{"accuracy": 0.5, "model_score": 3.0}, {"accuracy": 0.75}]) == ("held-out accuracy",
                                                                                      [0.5, 0.75])


def test_an_evaluation_that_measured_nothing_says_so():
    """reward.reward=none and a reward model that could score no held-out completion: no accuracy, no score;
    the line says what happened instead of ending after 'eval @ step N:'."""
    from llamarl.runlog import RunLog

    log = RunLog(None, 4, progress=False)
    lines = []
    log.bar.write = lambda text, **kwargs: lines.append(text)
    log.eval(2, {"policy_version": 2})
    log.eval(4, {"policy_version": 4, "model_score": 0.5})
    assert lines == ["eval @ step 2: nothing measured (the reward model could score no completion)",
                     "eval @ step 4: model_score 0.500"]
