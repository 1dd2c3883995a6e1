"""How local executor ranks start (llamarl.runtime.starting): CPU ranks fork from the preloaded fork server
and still get the controller's environment and output as they are at the rank's start, its thread
setting and a name; LLAMARL_START_METHOD=spawn spawns them; CUDA ranks are always spawned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamarl.runtime import ExecutorGroup
from llamarl.runtime.starting import start_method

REPO = Path(__file__).resolve().parents[1]
TOY = "llamarl.runtime.testing:ToyExecutor"
KEYS = ["LLAMARL_GONE", "LLAMARL_LATE", "LLAMARL_TOY_ENV", "OMP_NUM_THREADS"]

# The controller changes its environment and redirects its output after the fork server started: the
# ranks must see the controller as it is when they start, not as it was when the server started.
CONTROLLER = textwrap.dedent("""
    import json, os, sys
    from llamarl.runtime import ExecutorGroup, starting

    if __name__ == "__main__":
        os.environ["LLAMARL_GONE"] = "set when the server started"
        starting.warm()
        del os.environ["LLAMARL_GONE"]
        os.environ["LLAMARL_LATE"] = "set after"
        log = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        result = os.dup(1)
        os.dup2(log, 1)
        os.dup2(log, 2)
        with ExecutorGroup.spawn("start", "llamarl.runtime.testing:ToyExecutor", 2, start_timeout_s=120,
                                 env={"LLAMARL_TOY_ENV": "group", "OMP_NUM_THREADS": "1"}) as g:
            ranks = g.call("info_dict", json.loads(sys.argv[1])).result(timeout=60)
            g.call("write", "hello").result(timeout=60)
        os.write(result, (json.dumps({"controller": os.getpid(), "ranks": ranks}) + "\\n").encode())
""")


def _run_controller(tmp_path: Path, **env: str) -> tuple[dict, str]:
    (tmp_path / "controller.py").write_text(CONTROLLER)
    log = tmp_path / "output.log"
    proc = subprocess.run([sys.executable, str(tmp_path / "controller.py"), json.dumps(KEYS), str(log)],
                          env=dict(os.environ, PYTHONPATH=str(REPO), **env), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + log.read_text()
    return json.loads(proc.stdout), log.read_text()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_start_with_the_controllers_environment_and_output_as_they_are_then(tmp_path, method):
    result, output = _run_controller(tmp_path, LLAMARL_START_METHOD=method)
    ranks = result["ranks"]
    forked = [r["ppid"] != result["controller"] for r in ranks]
    assert forked == [method == "forkserver"] * 2  # a forked rank's parent is the fork server
    if method == "forkserver":
        assert ranks[0]["ppid"] == ranks[1]["ppid"]  # one server for every rank
    for rank, r in enumerate(ranks):
        assert r["comm"] == f"start-{rank}"  # what ps and top show
        assert r["env"] == {"LLAMARL_GONE": None, "LLAMARL_LATE": "set after", "LLAMARL_TOY_ENV": "group",
                            "OMP_NUM_THREADS": "1"}
        assert r["threads"] == 1  # torch was loaded before the rank's OMP_NUM_THREADS existed: applied anyway
        assert f"stdout of rank {rank}: hello" in output and f"stderr of rank {rank}: hello" in output


def test_cpu_ranks_fork_and_cuda_ranks_spawn_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("LLAMARL_START_METHOD", raising=False)
    assert start_method(["cpu", "cpu"]) == "forkserver"
    assert start_method(["cuda:0"]) == start_method(["cpu", "cuda:1"]) == "spawn"
    monkeypatch.setenv("LLAMARL_START_METHOD", "spawn")
    assert start_method(["cpu"]) == "spawn"
    monkeypatch.setenv("LLAMARL_START_METHOD", "forkserver")
    assert start_method(["cuda:0"]) == "forkserver"
    monkeypatch.setenv("LLAMARL_START_METHOD", "fork")
    with pytest.raises(ValueError, match=r"LLAMARL_START_METHOD='fork': use 'spawn'.*'forkserver'"):
        start_method(["cpu"])


def test_a_forked_rank_writes_to_the_output_captured_now(capfd, monkeypatch):
    """In this process the fork server may have started during an earlier test, under that test's output
    capture: a rank forked now still writes where this test captures."""
    monkeypatch.delenv("LLAMARL_START_METHOD", raising=False)
    with ExecutorGroup.spawn("captured", TOY, 1, start_timeout_s=120) as g:
        assert g.call_rank(0, "info_dict").result(timeout=60)["ppid"] != os.getpid()
        g.call("write", "captured").result(timeout=60)
    out, err = capfd.readouterr()
    assert "stdout of rank 0: captured" in out and "stderr of rank 0: captured" in err


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_cuda_rank_starts_either_way(monkeypatch, method):
    """CUDA ranks are spawned by default; LLAMARL_START_METHOD=forkserver forks them from the server, which
    must never have initialised the driver (a forked process cannot use an inherited CUDA state)."""
    monkeypatch.setenv("LLAMARL_START_METHOD", method)
    with ExecutorGroup.spawn(f"cuda-{method}", TOY, 1, devices=["cuda:0"], start_timeout_s=300) as g:
        assert g.call_rank(0, "device_sum", 1000).result(timeout=120) == 1000.0
        assert (g.call_rank(0, "info_dict").result(timeout=60)["ppid"] != os.getpid()) == (method == "forkserver")


FORK_SERVER_KILLED = """
import asyncio, os, signal
from multiprocessing import forkserver
from llamarl.runtime import ExecutorDied, Runtime

async def controller(rt):
    g = rt.spawn("trainer", "llamarl.runtime.testing:ToyExecutor")
    await g.acall("echo", 1)
    os.kill(forkserver._forkserver._forkserver_pid, signal.SIGKILL)
    await g.acall("sleep", 30)

with Runtime() as rt:
    try:
        asyncio.run(rt.supervise(controller(rt)))
    except ExecutorDied as e:
        print(e)
"""


def test_a_killed_fork_server_is_named_as_the_cause(monkeypatch):
    """The fork server killed (OOM killer, a stray kill): its ranks exit with it, and the run named a rank with
    multiprocessing's placeholder status 255 instead of the server's death."""
    monkeypatch.delenv("LLAMARL_START_METHOD", raising=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", FORK_SERVER_KILLED], capture_output=True, text=True, env=env,
                         timeout=240)
    assert "executor 'trainer' rank 0 died (exit status unknown: the fork server (pid" in out.stdout, (out.stdout,
                                                                                                   out.stderr[-2000:])
