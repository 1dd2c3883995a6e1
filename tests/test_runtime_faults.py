"""llamarl.runtime under faults in the control plane itself: messages one side cannot unpickle, a failing
monitor, and the order in which a death and the calls it abandons are reported.

The executors here live in a module written to a temporary directory that both the controller and the
ranks can import (a spawned rank inherits the controller's ``sys.path``); a second module is importable
on the controller only, added to its ``sys.path`` after the ranks have started.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import sys
import textwrap
import time

import pytest

from llamarl.runtime import ExecutorDied, ExecutorError, ExecutorGroup, Runtime

TOY = "llamarl.runtime.testing:ToyExecutor"

FAULTY = textwrap.dedent("""
    class ParseError(Exception):
        # pickle rebuilds an exception as cls(*self.args) = cls(message): this __init__ needs two arguments
        def __init__(self, line, reason):
            super().__init__(f"line {line}: {reason}")

    class Faulty:
        def __init__(self, *, rank_info):
            self.seen = []

        def bad_reply(self):
            return {"ok": 3, "failures": [ParseError(7, "unbalanced brace")]}

        def take(self, item):
            self.seen.append(item)
            return len(self.seen)
""")

CONTROLLER_ONLY = textwrap.dedent("""
    class OnlyHere:
        def __init__(self, x):
            self.x = x
""")


class Unloadable:
    """Pickles fine and fails to unpickle anywhere: it is rebuilt as int("not a number")."""

    def __reduce__(self):
        return (int, ("not a number",))


def children_of(group: str) -> list:
    """This process's live children that are ranks of executor group ``group``."""
    return [p for p in mp.active_children() if p.name.startswith(f"llamarl-{group}-")]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    shared = tmp_path_factory.mktemp("shared")
    (shared / "faulty_executor.py").write_text(FAULTY)
    sys.path.insert(0, str(shared))  # the controller unpickles the executor's classes too
    g = ExecutorGroup.spawn("faulty", "faulty_executor:Faulty", world_size=1, start_timeout_s=120,
                            env={"OMP_NUM_THREADS": "1"})
    only = tmp_path_factory.mktemp("controller_only")
    (only / "controller_only.py").write_text(CONTROLLER_ONLY)
    sys.path.insert(0, str(only))  # after the spawn: the rank's sys.path lacks it
    yield g
    g.shutdown(timeout=5)
    sys.path.remove(str(only))
    sys.path.remove(str(shared))


def test_a_reply_the_controller_cannot_unpickle_fails_that_call_only(faulty):
    with pytest.raises(ExecutorError) as info:
        faulty.call("bad_reply").result(timeout=10)
    err = info.value
    assert (err.group, err.rank, err.method) == ("faulty", 0, "bad_reply") and not isinstance(err, ExecutorDied)
    assert "could not be unpickled" in str(err) and "ParseError.__init__()" in str(err)
    assert faulty.alive and faulty._monitor.is_alive()
    assert faulty.call("take", "after").result(timeout=10) == [1]  # the group still serves


def test_arguments_a_rank_cannot_unpickle_fail_that_call_only(faulty):
    import controller_only

    before = faulty.call("take", "before")  # queued ahead: answered first, in order
    bad = faulty.call("take", controller_only.OnlyHere(1))
    after = faulty.call("take", "after")
    n = before.result(timeout=10)[0]
    with pytest.raises(ExecutorError) as info:
        bad.result(timeout=10)
    err = info.value
    assert (err.group, err.rank, err.method, err.exc_type) == ("faulty", 0, "take", "ModuleNotFoundError")
    assert "arguments could not be unpickled" in str(err) and "controller_only" in err.remote_traceback
    assert after.result(timeout=10) == [n + 1]  # the bad call never ran; the rank serves on
    assert faulty.alive and not faulty.failed.done()


def test_a_bootstrap_the_rank_cannot_unpickle_reports_the_real_error():
    with pytest.raises(ExecutorError) as info:
        ExecutorGroup.spawn("unloadable", TOY, world_size=1, init_kwargs={"tag": Unloadable()}, start_timeout_s=120,
                            env={"OMP_NUM_THREADS": "1"})
    err = info.value
    assert not isinstance(err, ExecutorDied) and err.method == "__init__" and err.exc_type == "ValueError"
    assert "bootstrap could not be unpickled" in str(err) and "not a number" in str(err)
    assert children_of("unloadable") == []


def test_an_unexpected_error_in_the_monitor_fails_the_group_instead_of_ending_supervision():
    g = ExecutorGroup.spawn("doomed", TOY, world_size=1, start_timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    pid = g.pids[0]

    def broken(*args):
        raise RuntimeError("injected monitor bug")

    g._resolve = broken  # the monitor thread resolves every reply through this
    try:
        with pytest.raises(ExecutorDied, match="monitor .*injected monitor bug"):
            g.call("echo").result(timeout=10)
        with pytest.raises(ExecutorDied):
            g.failed.result(timeout=5)
        with pytest.raises(ExecutorDied):
            g.call("echo").result(timeout=5)
        # the monitor thread kills and reaps the rank; a join from here races its waitpid (the loser reads
        # ECHILD as "no exit code yet"), so wait for the exit code the reaping thread records
        deadline = time.monotonic() + 20
        while g._links[0].process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g._links[0].process.exitcode is not None, f"rank pid {pid} still runs"
    finally:
        g.shutdown(timeout=5)
    assert children_of("doomed") == []


def test_a_death_is_reported_to_the_group_watchers_before_its_pending_calls_fail():
    # supervise() stops every group at once when the death arrives first; when the failed call woke the
    # controller first, it used to skip that and leave the survivors to a 10 s shutdown.
    seen = []
    g = ExecutorGroup.spawn("exits", TOY, world_size=1, start_timeout_s=120, env={"OMP_NUM_THREADS": "1"},
                            on_failure=lambda grp, err: seen.append(pending.done()))
    try:
        pending = g.call("exit_hard", 5)
        with pytest.raises(ExecutorDied, match="exit code 5"):
            pending.result(timeout=10)
        assert seen == [False]
    finally:
        g.shutdown(timeout=5)


def test_a_shutdown_right_after_a_death_asks_no_dying_rank_to_close():
    """A caller that hears of the death through its call and shuts the group down at once (a ``with``
    block's exit) must not send ``__close__`` to ranks the failure is killing: none would answer, and the
    shutdown waited its whole timeout (10 s by default) for them."""
    from llamarl.runtime.rpc import CLOSE

    g = ExecutorGroup.spawn("dies", TOY, world_size=2, start_timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    sent = []
    real_send = g._send
    g._send = lambda link, message: (sent.append(message.method), real_send(link, message))[1]
    g.call_rank(1, "sleep", 30)
    with pytest.raises(ExecutorDied, match="exit code 5"):
        g.call_rank(0, "exit_hard", 5).result(timeout=30)
    g.shutdown(timeout=30)
    assert CLOSE not in sent, sent
    assert all(lk.process is None or not lk.process.is_alive() for lk in g._links)


def test_supervise_stops_the_other_groups_when_the_controller_fails_with_the_death_first():
    stopped = []

    class Survivor:  # stands in for a healthy group with a command in flight
        def shutdown(self, timeout):
            stopped.append(timeout)

    rt = Runtime()
    rt.groups["trainer"] = Survivor()

    async def controller():  # the death reached the controller through its call; rt.failed is not set yet
        raise ExecutorDied("generator", 0, 5, "exit_hard")

    with pytest.raises(ExecutorDied, match="exit code 5"):
        asyncio.run(rt.supervise(controller()))
    assert stopped == [2.0]
    rt.groups.clear()
    rt.shutdown()


def test_calls_abandoned_by_a_shutdown_fail_as_shut_down_and_are_not_logged():
    g = ExecutorGroup.spawn("survivor", TOY, world_size=1, start_timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    messages: list[str] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: messages.append(ctx["message"]))
        busy = g.acall("sleep", 60)
        g.acall("echo")  # queued behind it and never awaited, like a controller's step it abandons
        await asyncio.sleep(0.2)
        g.shutdown(timeout=0.5)  # as supervise() does when another group died
        for _ in range(5):
            await asyncio.sleep(0)
        assert busy.done()
        err = busy.exception()
        assert isinstance(err, ExecutorError) and not isinstance(err, ExecutorDied), err
        assert err.exc_type == "ShutDown" and "shut down" in str(err)

    asyncio.run(main())
    gc.collect()
    assert messages == []
    assert children_of("survivor") == []


def test_calls_queued_behind_a_death_are_not_logged_again():
    """A rank dies while a second command waits behind the running one (async mode queues step s+1's
    train_step): the death is reported once, by the awaited call; asyncio logged the queued call's
    ExecutorDied again as "Future exception was never retrieved"."""
    g = ExecutorGroup.spawn("doomed", TOY, world_size=1, start_timeout_s=120, env={"OMP_NUM_THREADS": "1"})
    messages: list[str] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: messages.append(ctx["message"]))
        running = g.acall("exit_hard", 3)
        g.acall("echo", "next step")  # queued behind it, never awaited
        with pytest.raises(ExecutorDied, match="exit code 3"):
            await running
        for _ in range(5):
            await asyncio.sleep(0)

    try:
        asyncio.run(main())
        gc.collect()
        assert messages == []
    finally:
        g.shutdown(timeout=2.0)


def test_a_group_call_reports_a_ranks_own_error_before_a_shut_down():
    """Rank 1 raised; rank 0 was then stopped by the shutdown that failure caused: the call's error is rank
    1's, with its traceback, not rank 0's ShutDown (which callers count as retrieved and never log)."""
    from concurrent.futures import Future

    from llamarl.runtime.futures import gather_ranks
    from llamarl.runtime.rpc import SHUT_DOWN

    shut, real = Future(), Future()
    call = gather_ranks([shut, real], "g", "step")
    real.set_exception(ExecutorError("g", 1, "step", "ValueError", "bad batch", "Traceback: ..."))
    shut.set_exception(ExecutorError("g", 0, "step", SHUT_DOWN, "the group was shut down"))
    err = call.exception(timeout=1)
    assert err.rank == 1 and err.exc_type == "ValueError" and "ranks [0]" in str(err)

