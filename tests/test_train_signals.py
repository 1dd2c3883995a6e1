"""Signals: Ctrl-C (SIGINT to the process group) and SIGTERM stop ``python -m llamarl.train`` cleanly at any
moment (while the module imports, while the run starts, mid-run): the exit status says which (130, 143), the
last line says where the run stands, no traceback, every process of the run ends, and the run resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from llamarl.config_cli import load_config
from llamarl.train import main, train
from test_train_loop import SMOKE, _start, _wait_for, read_metrics

# python -m llamarl.train whose import of llamarl.rewards (inside llamarl/train.py's own imports) takes 3 s
SLOW_IMPORT = """
import importlib.abc, runpy, sys, time

class SlowImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "llamarl.rewards":
            print("importing llamarl.rewards", flush=True)
            time.sleep(3)
        return None

sys.meta_path.insert(0, SlowImport())
runpy.run_module("llamarl.train", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("sig, status, what", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_while_the_module_imports_is_a_clean_stop(tmp_path, sig, status, what):
    """The signal lands inside an import of llamarl/train.py (made slow here, as on a loaded machine): it is
    acted on once the imports are done (before: a KeyboardInterrupt traceback from inside the import, or death
    by SIGTERM)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_IMPORT, *SMOKE, "--out", str(tmp_path / "r")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "importing llamarl.rewards\n"
    time.sleep(0.5)
    (os.killpg if sig == signal.SIGINT else os.kill)(proc.pid, sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == status, output
    assert output.splitlines()[-1] == f"llamarl.train: {what}; the run had not started; nothing was written", output
    assert "Traceback" not in output and not (tmp_path / "r").exists()


@pytest.mark.parametrize("sig, status, what", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_a_signal_in_the_first_second_is_a_clean_stop(tmp_path, sig, status, what):
    """Ctrl-C or SIGTERM while the run still reads its config and imports torch: the message and status of a
    clean stop (before: a KeyboardInterrupt traceback from inside torch, or death by SIGTERM, which left the
    fork server's directory in TMPDIR; an interrupt swallowed inside numpy's import let the run go on to a
    RecursionError). Under load the signal may come later, in the warm start: the same clean stop."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, LLAMARL_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.train", *SMOKE, "--out", str(tmp_path / "r")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(1.0)
    (os.killpg if sig == signal.SIGINT else os.kill)(proc.pid, sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == status, output
    assert output.splitlines()[-1].startswith(f"llamarl.train: {what}; ") and "Traceback" not in output, output
    deadline = time.monotonic() + 30
    while any(p.name.startswith("pymp-") for p in tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)  # the fork server ends with its owner
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("pymp-")]


@pytest.mark.parametrize("sig, to_group, status, ignore_sigint",
                         [(signal.SIGINT, True, 130, False), (signal.SIGTERM, False, 143, False),
                          (signal.SIGTERM, False, 143, True)],
                         ids=["ctrl-c", "sigterm", "sigterm-background-job"])
def test_an_interrupted_run_stops_cleanly_and_resumes(tmp_path, sig, to_group, status, ignore_sigint):
    """Ctrl-C (SIGINT to the whole process group) and SIGTERM to the controller alone both stop the run:
    the exit status says which, every executor and worker process is gone, and it resumes. SIGTERM also
    stops a run started with SIGINT ignored (a script's background job)."""
    out = tmp_path / "run"
    proc = _start(SMOKE + ["--out", str(out), "--max-steps", "100000", "--set", "run.checkpoint_every=2"], tmp_path,
                  ignore_sigint)
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and len(read_metrics(out)[0]) >= 3, 180, proc)
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == status, output
    assert ("terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted") in output
    deadline = time.monotonic() + 30
    while True:  # the session's other processes (executors, reward workers, the segment reaper) end too
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes of the run are still alive"
        time.sleep(0.2)
    target = len(read_metrics(out)[0]) + 2
    train(load_config(["--resume", str(out), "--max-steps", str(target)]))
    assert [r["step"] for r in read_metrics(out)[0]] == list(range(1, target + 1))  # one history, no repeats


def test_a_run_stopped_before_its_first_checkpoint_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    proc = _start(SMOKE + ["--out", str(out), "--max-steps", "100000", "--set", "run.checkpoint_every=0"], tmp_path)
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and len(read_metrics(out)[0]) >= 2, 180, proc)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "wrote no checkpoint yet, so there is nothing to resume" in output, output
    assert main(SMOKE + ["--out", str(out)]) == 2  # and the directory is refused with the same reason
    assert "holds a run that wrote no checkpoint" in capsys.readouterr().err
