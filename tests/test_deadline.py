"""``call_with_deadline`` (llamarl.rewards.deadline): a reward call that runs past its budget is stopped by
an exception injected into its own thread, whichever thread it runs in, nested or not, under contention, with
threads of its own, across imports and forks; nothing is left behind after the call."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llamarl.rewards import DeadlineExceeded, call_with_deadline


def _busy():
    while True:
        pass


def test_deadline_returns_value_and_propagates_exceptions():
    assert call_with_deadline(lambda: 41 + 1, 5.0) == 42
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, 5.0)
    with pytest.raises(ValueError, match="positive"):
        call_with_deadline(lambda: 1, 0.0)


def test_deadline_interrupts_main_and_other_threads():
    with pytest.raises(DeadlineExceeded):
        call_with_deadline(_busy, 0.1)
    caught = []

    def in_thread():
        try:
            call_with_deadline(_busy, 0.1)
        except DeadlineExceeded:
            caught.append(True)

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(timeout=60)
    assert caught == [True]


def test_deadline_reinjects_after_a_swallowed_exception():
    def swallow_once():
        try:
            _busy()
        except BaseException:  # e.g. a library's blanket handler
            pass
        _busy()  # still running: the watchdog must strike again

    with pytest.raises(DeadlineExceeded):
        call_with_deadline(swallow_once, 0.1)


def test_no_stray_exception_after_a_finished_call():
    for _ in range(50):  # calls that finish right at their budget must not leak the injection later
        try:
            call_with_deadline(lambda: time.sleep(0.002), 0.002)
        except DeadlineExceeded:
            pass
    end = time.monotonic() + 0.2
    while time.monotonic() < end:  # an injected exception would surface in this loop
        pass


STRIKE_STRESS = """
import sys, threading
from llamarl.rewards.deadline import call_with_deadline, DeadlineExceeded
stop = False
def churn():
    while not stop:
        sum(range(200))
for _ in range(3):
    threading.Thread(target=churn, daemon=True).start()
sys.setswitchinterval(1e-5)  # GIL hand-offs every few bytecodes: strikes land anywhere they are allowed to
for i in range(3000):
    try:
        call_with_deadline(lambda: None, 1e-5)
    except DeadlineExceeded:
        pass
    if i % 10 == 0:  # and calls that do overrun: struck, unwound, then the watchdog must fall silent
        try:
            call_with_deadline(lambda: sum(range(10**5)), 1e-4)
        except DeadlineExceeded:
            pass
stop = True
print("ok")
"""


def _assert_script_prints_ok(script: str) -> None:
    """Run ``script`` in a subprocess (a hang is then a failure rather than a stuck suite); it must print ok."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_strikes_never_land_outside_the_call_under_contention():
    """Budgets shorter than starting the watchdog thread, under GIL contention: a strike used to land in
    ``Thread.start``, or a second strike before the ``finally`` had stopped the watchdog, which then
    struck the caller forever (stray exceptions, a hang in a later ``Thread.start``; seen in the suite
    and in CI). Run in a subprocess, so a hang is a failure rather than a stuck suite."""
    _assert_script_prints_ok(STRIKE_STRESS)


def test_nested_deadlines_keep_their_own_budgets():
    def inner():
        with pytest.raises(DeadlineExceeded):
            call_with_deadline(_busy, 0.05)
        return "inner timed out, outer still fine"

    assert call_with_deadline(inner, 30.0) == "inner timed out, outer still fine"


def _assert_each_call_is_stopped(fn, calls: int) -> None:
    """``calls`` times: ``call_with_deadline(fn, 0.01)`` raises DeadlineExceeded within 30 s. Each call runs on a
    daemon thread, so a hang fails the test rather than the session."""
    for _ in range(calls):
        done, out = threading.Event(), {}

        def run():
            try:
                call_with_deadline(fn, 0.01)
            except DeadlineExceeded:
                out["raised"] = True
            done.set()

        threading.Thread(target=run, daemon=True).start()
        assert done.wait(30) and out.get("raised")


def test_an_outer_deadline_stops_a_loop_of_inner_deadlines():
    """A reward that tries candidates, each under its own short budget, inside an overall one: the outer call
    must end at its budget. Before, each inner call started a watchdog thread inside the outer ``fn`` (an outer
    strike landed in it, and the call hung from the first try), an inner call that ended cleared the outer's
    pending strike, and ``except DeadlineExceeded`` around the inner calls swallowed the outer's strike."""
    def spin(n):
        total = 0
        for i in range(n):
            total += i
        return total

    def try_candidates():
        while True:
            try:
                call_with_deadline(lambda: spin(20000), 0.001)
            except DeadlineExceeded:
                pass

    _assert_each_call_is_stopped(try_candidates, calls=30)


IMPORT_STRESS = """
import importlib, sys, threading
from llamarl.rewards.deadline import call_with_deadline, DeadlineExceeded
sys.setswitchinterval(1e-5)
def imports():
    while True:
        for name in ("json", "email.utils", "xml.dom", "http.client", "decimal"):
            importlib.import_module(name)
def worker():
    for _ in range(100):
        try:
            call_with_deadline(imports, 0.002)
        except DeadlineExceeded:
            pass
threads = [threading.Thread(target=worker, daemon=True) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join(90)
print("ok" if not any(t.is_alive() for t in threads) else "hung")
"""


def test_strikes_wait_for_an_import_to_end():
    """A strike inside importlib could leave a module lock held, and every later import of that module (in
    any thread) waited for ever: math_reward hung in sympy's lazy imports from worker threads."""
    _assert_script_prints_ok(IMPORT_STRESS)


NESTED_LEAK = """
import time
from llamarl.rewards import deadline
from llamarl.rewards.deadline import call_with_deadline, DeadlineExceeded
def try_candidates():
    while True:
        try:
            call_with_deadline(lambda: sum(range(20000)), 0.001)
        except DeadlineExceeded:
            pass
for _ in range(1500):
    try:
        call_with_deadline(try_candidates, 0.01)
    except DeadlineExceeded:
        pass
time.sleep(0.2)
print("ok" if not deadline._watchdog.calls else f"{len(deadline._watchdog.calls)} calls still registered")
"""


@pytest.mark.slow
def test_nested_calls_leave_nothing_registered():
    """An outer strike delivered in an inner call's ``finally`` before its disarm skipped the deregistration:
    the inner call stayed with the watchdog for ever (its closure alive, a stack walk every 20 ms; 8 of them
    after 2000 outer calls). The watchdog drops a call whose frame has returned."""
    _assert_script_prints_ok(NESTED_LEAK)


def test_a_thread_left_in_limbo_does_not_stop_every_deadline():
    """A strike that races into ``Thread.start`` (or kills the new thread before it boots) leaves that thread in
    ``threading._limbo`` for good; the watchdog took it for a thread being started and never struck again, in
    any call of the process. An entry older than a second no longer counts."""
    leaked = threading.Thread(target=lambda: None)
    with threading._active_limbo_lock:
        threading._limbo[leaked] = leaked  # what such a strike leaves behind
    try:
        _assert_each_call_is_stopped(_busy, calls=1)  # (on a daemon thread: a deadline that never strikes fails)
    finally:
        with threading._active_limbo_lock:
            threading._limbo.pop(leaked, None)


def test_a_forked_child_has_a_watchdog_of_its_own():
    """The watchdog thread does not survive a fork: the child starts its own (and a lock its parent's watchdog
    held at the fork is not inherited held)."""
    call_with_deadline(lambda: None, 5.0)  # the parent's watchdog runs
    pid = os.fork()
    if pid == 0:  # the child: a stuck call must still be stopped
        code = 1
        try:
            call_with_deadline(_busy, 0.05)
        except DeadlineExceeded:
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's deadline never struck")


def test_a_deadline_stops_a_function_that_starts_threads():
    """A strike while ``fn`` started a thread landed in the new thread (CPython gives it its creator's id until it
    boots): it died before saying it started, and ``start()`` in ``fn`` waited forever (from the first call)."""
    def starts_threads():
        while True:
            t = threading.Thread(target=lambda: None)
            t.start()
            t.join()

    _assert_each_call_is_stopped(starts_threads, calls=20)
