"""Who owns a run directory and what it holds while runs come and go: one live run per directory (a second
one is refused before it writes anything), and a resume from an older checkpoint leaves logs, checkpoints,
config and summary describing one history even when the resumed run fails."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from llamarl._fs import write_text_atomic
from llamarl.presets import PRESETS
from llamarl.train import main
from test_train_loop import SMOKE, _start, _wait_for, read_metrics


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def test_a_resume_of_a_live_run_is_refused_before_it_writes_anything(tmp_path, capsys):
    """Run 1 is alive and checkpointing; ``--resume`` of its directory exits 2 naming run 1's pid, and run 1's
    metrics.jsonl (same file, not a replacement), config.yaml and checkpoints are left alone."""
    out = tmp_path / "run"
    proc = _start(SMOKE + ["--out", str(out), "--max-steps", "100000", "--set", "run.checkpoint_every=2",
                           "--set", "run.keep_checkpoints=1000"], tmp_path)
    try:
        _wait_for(lambda: bool(_checkpoints(out)), 180, proc)
        inode, config = (out / "metrics.jsonl").stat().st_ino, (out / "config.yaml").read_bytes()
        first = _checkpoints(out)[0]
        reached = int(first[5:])
        # (a small --max-steps: were it not refused, this run would end by itself)
        assert main(["--resume", str(out / "checkpoints" / first), "--max-steps", str(reached + 2)]) == 2
        err = capsys.readouterr().err
        assert f"run.out: {out} is in use by another llamarl run (pid {proc.pid})" in err, err
        assert "wait for it to end or pick another --out" in err
        assert proc.poll() is None
        assert (out / "metrics.jsonl").stat().st_ino == inode and (out / "config.yaml").read_bytes() == config
        _wait_for(lambda: len(_checkpoints(out)) >= 3, 180, proc)  # run 1 goes on, its checkpoints stay
        assert first in _checkpoints(out)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    steps = [r["step"] for r in read_metrics(out)[0]]
    assert steps == list(range(1, len(steps) + 1))  # run 1's history, whole


_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_a_locked_run_directory_refuses_a_fresh_run_and_the_lock_dies_with_its_holder(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(SMOKE + ["--out", str(out), "--max-steps", "2"]) == 2
        err = capsys.readouterr().err
        assert f"run.out: {out} is in use by another llamarl run (pid {holder.pid})" in err, err
        assert sorted(os.listdir(out)) == [".lock"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder died without unlocking (SIGKILL): no stale lock, the run starts
    assert main(SMOKE + ["--out", str(out), "--max-steps", "2"]) == 0
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2]
    assert int((out / ".lock").read_text()) != holder.pid  # the run wrote its own pid


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside_at_start(tmp_path, capsys):
    """Resume from step 2 of a run that reached step 4, and fail at step 3: the logs and the checkpoints
    both end at step 2 (a later ``--resume`` continues from there, with one history; the newer checkpoint is
    set aside until the run's first commit deletes it), the failed segment's
    config.yaml keeps the earlier one as config.prev.yaml, and the earlier summary and plot are renamed
    away instead of describing a history they do not match."""
    out = tmp_path / "run"
    assert main(SMOKE + ["--out", str(out), "--max-steps", "4", "--set", "run.checkpoint_every=2"]) == 0
    assert _checkpoints(out) == ["step_000002", "step_000004"]
    summary = (out / "summary.json").read_text()
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def f(completion, answer):\n    raise RuntimeError('broken verifier')\n")
    capsys.readouterr()
    assert main(["--resume", str(out / "checkpoints" / "step_000002"), "--max-steps", "8",
                 "--reward", f"{bad}:f", "--set", "reward.max_failed_steps=1"]) == 1
    err = capsys.readouterr().err
    assert "step_000004" in err and "set aside" in err, err
    assert _checkpoints(out) == ["step_000002"]
    assert (out / "checkpoints" / "abandoned-step_000004").is_dir()
    assert (out / "checkpoints" / "latest").read_text() == "step_000002\n"
    steps, evals = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2]
    assert not (out / "summary.json").exists() and not (out / "plot.png").exists()
    assert (out / "summary.prev.json").read_text() == summary and (out / "plot.prev.png").is_file()
    assert "bad_reward.py:f" in (out / "config.yaml").read_text()
    assert "reward: exact" in (out / "config.prev.yaml").read_text()

    assert main(["--resume", str(out), "--max-steps", "5", "--reward", "exact"]) == 0
    assert "resuming from" in (err := capsys.readouterr().err) and "step 2," in err, err
    steps, evals = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert json.loads((out / "summary.json").read_text())["steps"] == 5
    assert not (out / "checkpoints" / "abandoned-step_000004").exists()  # its first commit deleted it


def test_write_text_atomic_leaves_the_old_file_and_no_temp_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    write_text_atomic(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "half \ud800 written")  # fails part-way, like a full disk
    assert path.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["config.yaml"]
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")), real(fd)))
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and sorted(os.listdir(tmp_path)) == ["config.yaml"]
    # the data before the rename (the temp file), the directory entry after it
    assert len(synced) == 2 and synced[0] != str(path) and synced[1] == os.path.realpath(tmp_path), synced


def test_runs_started_in_the_same_second_without_out_get_their_own_directories(tmp_path, monkeypatch):
    """The default ``runs/<timestamp>`` is created exclusively: a seed sweep started at once no longer has all
    but one of its runs refused as 'in use by another llamarl run'."""
    from llamarl import training

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(training.time, "strftime", lambda fmt: "20261201-120000")
    outs = [training.default_out() for _ in range(3)]
    assert [p.name for p in outs] == ["20261201-120000", "20261201-120000-2", "20261201-120000-3"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in outs)


def test_a_checkpoint_copied_out_of_its_run_is_resumed_into_a_new_directory(tmp_path, capsys):
    """A checkpoint directory outside a run's checkpoints/ (copied, shared): without --out the continued run
    was written into the checkpoint itself (config, logs, checkpoints/), and a later --resume of it started
    from it again; now that is refused, naming --out, and the checkpoint is left as it was. Resumed with --out, it
    continues with the run's own settings, which the checkpoint carries (before: the default preset's, which
    named another dataset; with --preset smoke, silently the preset's learning rate and temperature)."""
    import shutil

    from llamarl.config_cli import load_config
    from llamarl.config_values import ConfigError

    out = tmp_path / "run"
    settings = ["--set", "trainer.lr=1e-3", "--set", "generator.temperature=0.7"]
    assert main(SMOKE + settings + ["--out", str(out), "--max-steps", "1"]) == 0
    copied = tmp_path / "my_ckpt"
    shutil.copytree(out / "checkpoints" / "step_000001", copied)
    before = sorted(p.name for p in copied.rglob("*"))
    capsys.readouterr()
    assert main(["--resume", str(copied), "--max-steps", "2"]) == 2
    assert "run.out: --resume" in capsys.readouterr().err
    assert sorted(p.name for p in copied.rglob("*")) == before
    with pytest.raises(ConfigError, match="outside its run directory"):
        load_config(["--resume", str(copied), "--max-steps", "2", "--out", str(copied)])
    cfg = load_config(["--resume", str(copied), "--max-steps", "2", "--out", str(tmp_path / "next")])
    assert (cfg.trainer.lr, cfg.generator.temperature, cfg.data.dataset) == (1e-3, 0.7, PRESETS["smoke"].data.dataset)
    shutil.copytree(out / "checkpoints", tmp_path / "backup" / "checkpoints")  # only the checkpoints/ of the run
    again = load_config(["--resume", str(tmp_path / "backup"), "--max-steps", "2", "--out", str(tmp_path / "b2")])
    assert again.trainer == cfg.trainer and again.generator == cfg.generator and again.data == cfg.data
    assert main(["--resume", str(copied), "--max-steps", "2", "--out", str(tmp_path / "next")]) == 0
    assert (tmp_path / "next" / "config.start.yaml").read_bytes() == (out / "config.start.yaml").read_bytes()


def test_a_resume_keeps_the_kl_reference_the_run_started_from(tmp_path, capsys):
    """With trainer.kl_coef > 0 a resume rebuilt its KL reference from the resumed command's settings: one that
    changed the reward (part of the warm start's cache key) trained a new warm start and used it as the
    reference. The reference now comes from config.start.yaml (kept through resumes, into a new --out too)."""
    out = tmp_path / "run"
    reward = tmp_path / "alt_reward.py"
    reward.write_text("def f(completion, answer):\n    return float(completion.strip() == answer.strip())\n")
    kl = ["--set", "trainer.kl_coef=0.1"]
    assert main(SMOKE + kl + ["--out", str(out), "--max-steps", "1"]) == 0
    started = (out / "config.start.yaml").read_text()
    capsys.readouterr()
    assert main(["--resume", str(out), "--max-steps", "2", "--reward", f"{reward}:f"] + kl) == 0
    err = capsys.readouterr().err
    assert "warm start: cached at" in err and "supervised steps" not in err, err  # the original warm start
    assert (out / "config.start.yaml").read_text() == started and f"{reward}:f" in (out / "config.yaml").read_text()
    other = tmp_path / "next"
    assert main(["--resume", str(out), "--max-steps", "3", "--out", str(other)] + kl) == 0
    assert (other / "config.start.yaml").read_text() == started
    # the new directory carries the run's history: its logs and summary cover the whole run (the summary's
    # accuracy before RL was the resumed step's evaluation, and its steps the last segment's)
    steps, evals = read_metrics(other)
    assert [r["step"] for r in steps] == [1, 2, 3] and evals[0]["step"] == 0
    summary = json.loads((other / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["accuracy_before"] == evals[0]["accuracy"]
    assert read_metrics(out)[0] == steps[:2]  # the source run is left as it was
