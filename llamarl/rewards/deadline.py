"""Run a Python callable under a wall-clock budget, in any thread (not only the main one).

Why not signals: ``signal.alarm`` (what math-verify uses) only works in the main thread of the main
interpreter, and a reward may be scored from an executor thread. Instead a watchdog thread injects an
exception into the calling thread with ``PyThreadState_SetAsyncExc`` once the budget is spent, and
re-injects it every ``_REPEAT_S`` until the call returns (so a library's ``except BaseException`` that
swallows an injection and carries on is struck again).

Each call raises its own subclass of ``DeadlineExceeded`` (a ``BaseException``, so library code that
catches ``Exception`` cannot swallow it), so nested deadlines never catch each other's exception.

Invariants:
  * ``call_with_deadline`` returns ``fn()``'s value or raises ``DeadlineExceeded``/``fn``'s exception;
    no injected exception ever escapes after it returns (a pending injection is cleared under the
    same lock that stops the watchdog).
  * Limits: an async exception is only delivered between Python bytecodes. A single long C call (a
    huge big-integer power, a blocking syscall), or code that catches every exception in an endless
    loop, cannot be stopped from inside the process; callers must screen such inputs out beforehand,
    and the reward worker pool's per-sample process kill is the hard bound behind it.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable, TypeVar

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
    """Return ``fn()``, or raise ``DeadlineExceeded`` once it has run for more than ``timeout_s``."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    exc_type = type("DeadlineExceeded", (DeadlineExceeded,), {"timeout_s": timeout_s})
    target = threading.get_ident()
    lock = threading.Lock()
    finished = threading.Event()
    state = {"done": False}

    def watchdog() -> None:
        if finished.wait(timeout_s):
            return
        while True:
            with lock:
                if state["done"]:
                    return
                _inject(target, exc_type)
            if finished.wait(_REPEAT_S):
                return

    dog = threading.Thread(target=watchdog, name="reward-deadline", daemon=True)
    dog.start()
    try:
        try:
            return fn()
        finally:
            with lock:
                state["done"] = True
                _inject(target, None)
            finished.set()
    except exc_type:
        raise DeadlineExceeded(f"call exceeded its {timeout_s:g}s budget") from None
