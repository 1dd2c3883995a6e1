"""llamarl.runtime with real processes: commands, ordering, remote errors, deaths, shutdown and process
hygiene (placement and the torchrun path: test_runtime_placement.py).

Every group here runs ``llamarl.runtime.testing:ToyExecutor``. Process start-up (importing torch in each
child) dominates the run time, so one two-rank group is shared by the tests that leave it healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from dist_harness import finish_quietly
from llamarl.runtime import ExecutorDied, ExecutorError, ExecutorGroup, Layout, Runtime
from llamarl.runtime.rpc import describe_exit

TOY = "llamarl.runtime.testing:ToyExecutor"
REPO = Path(__file__).resolve().parents[1]


def _pid_exists(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by an init that never reaps) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _wait_gone(pids, timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _pid_exists(p)]
        if alive:
            time.sleep(0.1)
    return alive


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    marker = tmp_path_factory.mktemp("close") / "closed"
    g = ExecutorGroup.spawn("toy", TOY, world_size=2, init_kwargs={"tag": "t"},
                            env={"LLAMARL_TOY_ENV": "set-before-torch", "LLAMARL_TOY_CLOSE_MARKER": str(marker),
                                 "OMP_NUM_THREADS": "1"},
                            start_timeout_s=120, dist_timeout_s=60)
    g.close_marker = marker
    yield g
    g.shutdown()


# ------------------------------------------------------------------------------------------ one group
def test_results_come_back_per_rank(group):
    out = group.call("echo", 1, "two", k=[3]).result(timeout=30)
    assert out == [{"tag": "t", "rank": r, "args": (1, "two"), "kwargs": {"k": [3]}} for r in range(2)]
    assert group.call_rank(1, "echo", "x").result(timeout=30)["rank"] == 1
    a, b = torch.randn(3, 5), torch.randn(7, dtype=torch.float64)
    scaled = group.call_each("scale", [(a, 2.0), (b, -0.5)]).result(timeout=30)
    assert torch.equal(scaled[0], a * 2.0) and torch.equal(scaled[1], b * -0.5)


def test_each_group_has_its_own_process_group(group):
    infos = group.call("info_dict").result(timeout=30)
    for rank, info in enumerate(infos):
        assert (info["rank"], info["dist_rank"], info["dist_world_size"], info["backend"]) == (rank, rank, 2, "gloo")
        assert info["env"]["LLAMARL_TOY_ENV"] == "set-before-torch"
        assert info["threads"] == 1  # OMP_NUM_THREADS was there when torch loaded
        assert "LLAMARL_TOY_ENV" not in os.environ  # the controller's environment is unchanged
        assert info["pid"] == group.pids[rank] != os.getpid()
    # rank r contributes values * (r + 1): the sum over 2 ranks is values * 3
    assert group.call("all_reduce", [1.0, -2.5]).result(timeout=30) == [[3.0, -7.5], [3.0, -7.5]]


def test_remote_exception_carries_traceback_and_method(group):
    with pytest.raises(ExecutorError) as info:
        group.call_rank(1, "fail", "bad input").result(timeout=30)
    err = info.value
    assert (err.group, err.rank, err.method) == ("toy", 1, "fail")
    assert err.exc_type == "llamarl.runtime.testing.ToyError"
    assert "bad input on rank 1" in str(err) and "fail()" in str(err)
    assert "testing.py" in err.remote_traceback and "raise ToyError" in err.remote_traceback
    assert not isinstance(err, ExecutorDied)
    # a group call reports the lowest failing rank and names the other failures
    with pytest.raises(ExecutorError, match=r"rank 0: fail\(\).*ranks \[1\] of the call failed too"):
        group.call("fail").result(timeout=30)
    with pytest.raises(ExecutorError, match="boom on rank 1") as info:
        group.call("fail_on_rank", 1).result(timeout=30)
    assert info.value.rank == 1
    assert group.call("echo").result(timeout=30)[0]["rank"] == 0  # the group is still healthy


def test_bad_commands_are_reported(group):
    with pytest.raises(ExecutorError, match="has no command 'nope'.*all_reduce, append"):
        group.call_rank(0, "nope").result(timeout=30)
    with pytest.raises(ExecutorError, match="could not be pickled"):
        group.call_rank(0, "unpicklable").result(timeout=30)
    with pytest.raises(ValueError, match="public method"):
        group.call("_private")
    with pytest.raises(TypeError, match="cannot be pickled"):
        group.call("echo", lambda: None)
    with pytest.raises(IndexError, match="ranks 0..1"):
        group.call_rank(2, "echo")
    with pytest.raises(ValueError, match="one per rank"):
        group.call_each("echo", [(1,)])
    # an exception whose str() fails, and sys.exit() in a command (a non-daemon thread alive): that call fails,
    # the rank serves on
    with pytest.raises(ExecutorError, match=r"raise_unprintable\(\) raised .*<str\(\) of the exception failed"):
        group.call_rank(0, "raise_unprintable").result(timeout=30)
    with pytest.raises(ExecutorError, match=r"exit_command\(\) raised SystemExit: 3"):
        group.call_rank(1, "exit_command", 3).result(timeout=30)
    assert group.call("echo").result(timeout=30)[1]["rank"] == 1


def test_calls_run_in_the_same_order_on_every_rank(group):
    before = group.call_rank(0, "items").result(timeout=30)
    futures: list = []

    def submit(thread: int) -> None:
        for i in range(10):
            futures.append(group.call("append", (thread, i)))

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futures:
        f.result(timeout=60)
    items = group.call("items").result(timeout=30)
    assert items[0] == items[1]  # the group-wide order is the same on both ranks
    new = [tuple(x) for x in items[0][len(before):]]
    assert sorted(new) == [(t, i) for t in range(4) for i in range(10)]
    for t in range(4):  # and each submitting thread's calls kept their order
        assert [i for th, i in new if th == t] == list(range(10))


def test_acall_from_asyncio(group):
    async def main():
        a, b = await asyncio.gather(group.acall("echo", "a"), group.acall_rank(1, "sleep", 0.05))
        return a, b, await group.acall_each("echo", [("x",), ("y",)])

    a, b, c = asyncio.run(main())
    assert [x["args"] for x in a] == [("a",), ("a",)] and b == 1
    assert [x["args"] for x in c] == [("x",), ("y",)]


def test_shutdown_closes_executors_and_leaves_no_process(group):
    pids = group.pids
    group.shutdown()
    assert group.failed.result(timeout=1) is None
    for rank in range(2):
        assert Path(f"{group.close_marker}.toy.{rank}").read_text() == "closed"  # close() ran
    assert _wait_gone(pids, timeout=1.0) == []
    assert not any(p.pid in pids for p in mp.active_children())
    with pytest.raises(ExecutorError, match="shut down"):
        group.call("echo").result(timeout=5)


# ------------------------------------------------------------------------------------------ failures
def test_killed_rank_fails_pending_and_later_calls():
    seen = []
    g = ExecutorGroup.spawn("victim", TOY, world_size=2, start_timeout_s=120, dist_timeout_s=60,
                            on_failure=lambda grp, err: seen.append((grp.name, err.rank, err.exitcode)))
    try:
        pending = g.call("sleep", 60)
        os.kill(g.pids[1], signal.SIGKILL)
        with pytest.raises(ExecutorDied) as info:
            pending.result(timeout=15)
        err = info.value
        assert (err.group, err.rank, err.exitcode, err.method) == ("victim", 1, -signal.SIGKILL, "sleep")
        assert "executor 'victim' rank 1 died (killed by SIGKILL) while running sleep()" in str(err)
        with pytest.raises(ExecutorDied):
            g.failed.result(timeout=5)
        assert seen == [("victim", 1, -signal.SIGKILL)]
        with pytest.raises(ExecutorDied, match="rank 1 died"):
            g.call("echo").result(timeout=5)
        assert _wait_gone(g.pids) == []  # the surviving rank was stopped too
    finally:
        g.shutdown()
    assert not mp.active_children()


def test_a_rank_failing_before_the_rendezvous_fails_the_start_at_once_with_its_error():
    """Rank 1 cannot use its device, so it fails before joining the process group, where rank 0 waits: the
    start must fail with rank 1's error, not wait out start_timeout_s and report rank 0 as stuck."""
    with pytest.raises(ExecutorError) as info:
        ExecutorGroup.spawn("half", TOY, world_size=2, devices=["cpu", "cuda:99"], start_timeout_s=300,
                            dist_timeout_s=600)
    assert (info.value.rank, info.value.method) == (1, "__init__")
    deadline = time.monotonic() + 30
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mp.active_children()


def test_constructor_error_surfaces_at_spawn():
    with pytest.raises(ExecutorError) as info:
        ExecutorGroup.spawn("broken", TOY, world_size=1, init_kwargs={"fail_in_init": True}, start_timeout_s=120)
    assert info.value.method == "__init__" and "constructor of toy asked to fail" in str(info.value)
    assert "Traceback" in info.value.remote_traceback
    with pytest.raises(TypeError, match="init_kwargs/env of executor group 'opaque' cannot be pickled"):
        ExecutorGroup.spawn("opaque", TOY, world_size=1, init_kwargs={"tag": lambda: None}, start_timeout_s=120)
    assert not mp.active_children()


def test_runtime_supervise_stops_everything_when_an_executor_exits():
    layout = Layout.parse("trainer=1,generator=1x1,reward=0")
    with Runtime(layout, start_timeout_s=120, dist_timeout_s=60) as rt:
        trainer, = rt.spawn_role("trainer", TOY, init_kwargs={"tag": "trainer"}, wait=False)
        generator, = rt.spawn_role("generator", TOY, init_kwargs={"tag": "generator"}, wait=False)
        rt.wait_ready()  # both roles started in parallel
        assert rt.spawn_role("reward", TOY) == []  # reward=0: no reward group
        pids = trainer.pids + generator.pids
        assert trainer.call_rank(0, "info_dict").result(timeout=30)["global_rank"] == 1

        async def controller():
            assert (await generator.acall("echo"))[0]["tag"] == "generator"
            generator.call("exit_hard", 3)
            await trainer.acall("sleep", 60)  # cancelled when the generator dies
            return "finished"

        with pytest.raises(ExecutorDied) as info:
            asyncio.run(rt.supervise(controller()))
        assert (info.value.group, info.value.rank, info.value.exitcode) == ("generator", 0, 3)
        assert "exit code 3" in str(info.value)
        assert _wait_gone(pids) == []
    assert not mp.active_children()


def test_no_orphans_when_the_controller_raises_or_is_killed(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from llamarl.runtime import ExecutorGroup
        g = ExecutorGroup.spawn("orphan", "llamarl.runtime.testing:ToyExecutor", 1, start_timeout_s=120)
        print("PIDS", g.pids[0], flush=True)
        if sys.argv[1] == "raise":
            raise RuntimeError("controller bug")
        time.sleep(600)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = {mode: subprocess.Popen([sys.executable, "-c", script, mode], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for mode in ("raise", "sleep")}
    children = {}
    try:
        for mode, proc in procs.items():
            line = proc.stdout.readline()
            assert line.startswith("PIDS"), proc.stderr.read() if proc.poll() is not None else line
            children[mode] = int(line.split()[1])
        os.kill(procs["sleep"].pid, signal.SIGKILL)  # the executor notices EOF on its control pipe
        assert procs["raise"].wait(timeout=60) != 0
        assert "controller bug" in procs["raise"].stderr.read()
        procs["sleep"].wait(timeout=30)
        assert _wait_gone(children.values(), timeout=20) == []
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------ process hygiene
def test_exit_descriptions():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(None) == "connection lost"
    err = ExecutorDied("g", 2, -15, "step")
    assert str(err) == "executor 'g' rank 2 died (killed by SIGTERM) while running step()"
    import pickle

    again = pickle.loads(pickle.dumps(err))
    assert (type(again), str(again), again.exitcode) == (ExecutorDied, str(err), -15)


def test_supervise_reports_the_death_without_an_unretrieved_task_error():
    # Regression: when the controller coroutine failed (typically with the same death, seen through a
    # call) in the same instant as the executor died, supervise raised the death and left the task's own
    # exception unretrieved: asyncio then printed "Task exception was never retrieved" at exit.
    import gc

    rt = Runtime()
    death = ExecutorDied("trainer", 0, -signal.SIGKILL, "save_checkpoint")
    messages: list[str] = []

    async def controller():
        rt._record_failure(None, death)  # the monitor thread notices the death...
        raise ExecutorDied("trainer", 0, -signal.SIGKILL, "save_checkpoint")  # ...and the call fails with it

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: messages.append(ctx["message"]))
        with pytest.raises(ExecutorDied) as info:
            await rt.supervise(controller())
        assert info.value is death
        info.value.__traceback__ = None  # drop the frames that still reference the finished task

    asyncio.run(main())
    del rt, death
    gc.collect()
    assert messages == []


STUCK_EXECUTOR = textwrap.dedent("""
    import os, time

    class Stuck:
        def __init__(self, *, rank_info):
            open(os.environ["LLAMARL_TEST_MARKER"], "w").close()  # "I am in my constructor now"
            time.sleep(600)
""")

CONTROLLER = textwrap.dedent("""
    import os, signal, sys, time

    if __name__ == "__mp_main__" and sys.argv[1] == "ctrl-c":
        # a rank re-importing this module ('spawn' does, before the rank's code runs): a Ctrl-C arrives
        # while it is still importing
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # give a handler the chance to run here, as it would for a real Ctrl-C

    if __name__ == "__main__":
        from llamarl.runtime import ExecutorGroup

        if sys.argv[1] == "ctrl-c":
            with ExecutorGroup.spawn("sigint", "llamarl.runtime.testing:ToyExecutor", 1, start_timeout_s=120,
                                     env={"OMP_NUM_THREADS": "1"}) as g:
                print("MASK", int(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])), flush=True)
                masks = []  # a thread being created blocks every signal for a moment (glibc): take the least
                for _ in range(20):
                    status = dict(line.split(":", 1) for line in open(f"/proc/{g.pids[0]}/status").read().splitlines())
                    masks.append((bin(int(status["SigBlk"], 16)).count("1"), int(status["SigBlk"], 16),
                                  int(status["SigIgn"], 16)))
                    time.sleep(0.01)
                print("RANK", *min(masks)[1:], flush=True)
                print("ECHO", g.call("echo", 1).result(timeout=60)[0]["args"], flush=True)
            sys.exit(0)
        if sys.argv[1] == "await":  # a controller awaiting its executors' start from its event loop
            import asyncio
            from llamarl.runtime import Layout, Runtime

            async def main(rt):
                groups = rt.spawn_role("generator", "stuck_executor:Stuck", env={"OMP_NUM_THREADS": "1"}, wait=False)
                print("PIDS", groups[0].pids[0], flush=True)
                await rt.await_ready(groups)

            with Runtime(Layout.parse("trainer=1,generator=1x1,reward=0"), start_timeout_s=600) as rt:
                try:
                    asyncio.run(main(rt))
                except KeyboardInterrupt:
                    print("INTERRUPTED", flush=True)
            sys.exit(0)
        g = ExecutorGroup.spawn("stuck", "stuck_executor:Stuck", 1, wait_ready=False, env={"OMP_NUM_THREADS": "1"})
        print("PIDS", g.pids[0], flush=True)
        time.sleep(600)
""")


def _controller(tmp_path, mode: str) -> subprocess.Popen:
    (tmp_path / "stuck_executor.py").write_text(STUCK_EXECUTOR)
    (tmp_path / "controller.py").write_text(CONTROLLER)
    env = dict(os.environ, PYTHONPATH=str(REPO), LLAMARL_TEST_MARKER=str(tmp_path / "in_ctor"))
    return subprocess.Popen([sys.executable, str(tmp_path / "controller.py"), mode], env=env, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def _rank_in_its_constructor(tmp_path, mode: str):
    """The ``mode`` controller, once its stuck rank is inside its constructor: (controller, rank pid)."""
    proc = _controller(tmp_path, mode)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read() if proc.poll() is not None else line
        deadline = time.monotonic() + 120  # liveness bound: the rank imports torch first
        while not (tmp_path / "in_ctor").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        assert (tmp_path / "in_ctor").exists(), "the rank never reached its constructor"
        yield proc, int(line.split()[1])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_rank_stuck_while_starting_dies_with_a_killed_controller(tmp_path):
    # Regression: a rank noticed a lost controller only through its command connection, which nothing
    # reads while it bootstraps (torch import, rendezvous, the executor's constructor): a controller
    # killed then left the rank running until its constructor returned.
    with _rank_in_its_constructor(tmp_path, "stuck") as (proc, rank):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert _wait_gone([rank], timeout=20) == []  # liveness, not timing: the watch reacts within ~1 s


def test_a_ctrl_c_while_ranks_start_stops_an_awaiting_controller_at_once(tmp_path):
    # Regression: the controller waited for its executors' start with a blocking call inside its event loop,
    # so asyncio's Ctrl-C (a cancel of the main task) waited for the slowest rank's start (seconds on a GPU)
    with _rank_in_its_constructor(tmp_path, "await") as (proc, rank):
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # the rank sleeps 600 s in its constructor
        assert proc.returncode == 0 and "INTERRUPTED" in out, err
        assert _wait_gone([rank], timeout=20) == []


def test_a_ctrl_c_while_a_rank_imports_is_discarded_there(tmp_path):
    # Regression: ranks set SIGINT to ignored only once their code ran, after 'spawn' re-imported the
    # controller's __main__ (which may import torch: a second or two); a Ctrl-C in that window printed a
    # KeyboardInterrupt traceback from the rank and killed it.
    lines = finish_quietly(_controller(tmp_path, "ctrl-c"))
    assert lines["MASK"] == "0"  # the controller's own mask is restored after the spawn
    blocked, ignored = map(int, lines["RANK"].split())
    bit = 1 << (signal.SIGINT - 1)
    assert ignored & bit and not blocked & bit  # the rank ignores SIGINT, no longer blocked
    assert lines["ECHO"] == "(1,)"


CTRL_C_IN_START = textwrap.dedent("""
    import multiprocessing.process, os, signal
    from llamarl.runtime import ExecutorGroup

    real_start = multiprocessing.process.BaseProcess.start

    def start_then_ctrl_c(self):  # a Ctrl-C that lands while the rank's process starts (SIGINT is blocked)
        real_start(self)
        print("RANK", self.pid, flush=True)
        os.kill(os.getpid(), signal.SIGINT)

    multiprocessing.process.BaseProcess.start = start_then_ctrl_c
    if __name__ == "__main__":  # the KeyboardInterrupt ends the interpreter, which then joins live children
        ExecutorGroup.spawn("cc", "llamarl.runtime.testing:ToyExecutor", 1, start_timeout_s=120)
""")


def test_a_ctrl_c_while_a_rank_process_starts_stops_that_rank_too(tmp_path):
    # Regression: the Ctrl-C, pending while SIGINT was blocked around process.start(), fired before the started
    # rank was recorded, so the cleanup missed it, and the controller then hung at exit joining it.
    (tmp_path / "controller.py").write_text(CTRL_C_IN_START)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "controller.py")], cwd=str(tmp_path), text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=120)  # liveness bound: the old code never exits
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and err.rstrip().endswith("KeyboardInterrupt"), err
    assert _wait_gone([int(out.split()[1])], timeout=20) == []
