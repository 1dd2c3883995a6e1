"""Run a Python callable under a wall-clock budget, in any thread (not only the main one).

Why not signals: ``signal.alarm`` (what math-verify uses) only works in the main thread of the main
interpreter, and a reward may be scored from an executor thread. Instead a watchdog thread injects an
exception into the calling thread with ``PyThreadState_SetAsyncExc`` once the budget is spent, and
re-injects it every ``_REPEAT_S`` until the call returns (so a library's ``except BaseException`` that
swallows an injection and carries on is struck again).

Each call injects its own subclass of ``DeadlineExceeded`` (a ``BaseException``, so library code that
catches ``Exception`` cannot swallow it), so nested deadlines never catch each other's exception, and
re-raises a plain ``DeadlineExceeded`` to its caller.

Invariants:
  * ``call_with_deadline`` returns ``fn()``'s value or raises ``DeadlineExceeded``/``fn``'s exception;
    no injected exception ever escapes after it returns (a pending injection is cleared under the
    same lock that stops the watchdog), and none lands outside ``fn``: the watchdog strikes only while
    ``fn``'s frame is on the calling thread's stack and no thread is being started (a strike then could
    land in the new thread, whose state still carries its creator's id: it dies before saying it started,
    and ``start()`` in ``fn`` waits forever; a strike after ``fn`` was unwound, before the watchdog is
    stopped, would escape into the caller and keep the watchdog striking).
  * Limits: nested deadlines can still hang: an outer strike may land in the thread an inner call is
    starting for its watchdog (seen with many tight nested calls; the reward pool's per-sample kill bounds
    it). An async exception is only delivered between Python bytecodes. A single long C call (a
    huge big-integer power, a blocking syscall), or code that catches every exception in an endless
    loop, cannot be stopped from inside the process; callers must screen such inputs out beforehand,
    and the reward worker pool's per-sample process kill is the hard bound behind it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_REPEAT_S = 0.02
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
_set_async_exc.restype = ctypes.c_int


class DeadlineExceeded(BaseException):
    """Raised inside a call that ran past its ``call_with_deadline`` budget."""


def _inject(thread_id: int, exc_type: type[BaseException] | None) -> None:
    # CPython API: exc NULL clears a pending async exception. The class object stays alive because the
    # caller holds a reference to it for the whole call.
    n = _set_async_exc(thread_id, None if exc_type is None else id(exc_type))
    if n > 1:  # documented recovery: more than one thread state was touched, undo it
        _set_async_exc(thread_id, None)


def call_with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """Return ``fn()``, or raise ``DeadlineExceeded`` once it has run for more than ``timeout_s``.

    The watchdog strikes only while ``fn`` runs: while this call's ``_run`` frame is on the calling
    thread's stack (checked from the watchdog, under the GIL, before each strike). So a strike never
    lands in ``Thread.start`` or in the caller's code after an earlier strike unwound ``fn``; one that
    races past the check into the ``finally`` is caught there and the disarming repeated."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    exc_type = type("DeadlineExceeded", (DeadlineExceeded,), {"timeout_s": timeout_s})
    target = threading.get_ident()
    lock = threading.Lock()
    finished = threading.Event()
    state: dict = {"frame": None, "done": False}

    def watchdog() -> None:
        if finished.wait(timeout_s):
            return
        while True:
            with lock:
                if state["done"]:
                    return
                if _on_stack(target, state["frame"]) and not _threads_starting():
                    _inject(target, exc_type)
            if finished.wait(_REPEAT_S):
                return

    try:
        try:
            dog = threading.Thread(target=watchdog, name="reward-deadline", daemon=True)
            dog.start()
            return _run(fn, state)
        finally:
            _disarm(lock, state, target, finished, exc_type)
    except exc_type:
        raise DeadlineExceeded(f"call exceeded its {timeout_s:g}s budget") from None


def _run(fn: Callable[[], T], state: dict) -> T:
    """``fn()``, in a frame of its own that marks "inside the deadline" for the watchdog."""
    state["frame"] = sys._getframe()
    return fn()


def _threads_starting() -> bool:
    """Whether a thread is being started (between ``Thread.start`` and its bootstrap). Until it boots, its
    thread state carries its creator's id (CPython), so a strike aimed at the creator could land in it: the
    new thread would die before saying it started, and ``start()`` in ``fn`` would wait forever."""
    return bool(getattr(threading, "_limbo", None))


def _on_stack(thread_id: int, frame: Any) -> bool:
    f = sys._current_frames().get(thread_id) if frame is not None else None
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def _disarm(lock: threading.Lock, state: dict, target: int, finished: threading.Event,
            exc_type: type[BaseException]) -> None:
    """Stop the watchdog and drop a pending strike. After ``done`` is set (one bytecode) the watchdog
    starts no new strike, so at most one already in flight can still be delivered: it is caught here and
    the disarming repeated; once the lock is ours, a strike set but not delivered is cleared."""
    while True:
        try:
            state["done"] = True
            with lock:
                _inject(target, None)
            finished.set()
            return
        except exc_type:
            continue
