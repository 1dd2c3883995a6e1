"""Run a Python callable under a wall-clock budget, in any thread (not only the main one).

Why not signals: ``signal.alarm`` (what math-verify uses) only works in the main thread of the main
interpreter, and a reward may be scored from an executor thread. Instead a watchdog thread injects an
exception into the calling thread with ``PyThreadState_SetAsyncExc`` once the budget is spent, and
re-injects it every ``_REPEAT_S`` until the call returns (so a library's ``except BaseException`` that
swallows an injection and carries on is struck again).

One watchdog thread per process watches every call in flight (started by the first call, again in a forked
child): a call registers (thread, budget, exception class), runs, and deregisters; it never starts a
thread itself, so a call nested in another's ``fn`` starts none inside it either. Each call injects an
exception class of its own (a ``BaseException``, so library code that catches ``Exception`` cannot swallow
it, and not a ``DeadlineExceeded``, so code that handles an inner call's timeout cannot either), so nested
deadlines never catch each other's strike, and raises ``DeadlineExceeded`` to its caller.

Invariants:
  * ``call_with_deadline`` returns ``fn()``'s value or raises ``DeadlineExceeded``/``fn``'s exception;
    no injected exception ever escapes after it returns (a pending injection is cleared under the
    lock the watchdog strikes under, and a strike delivered while deregistering is caught there: its own
    dropped, an outer call's carried on once deregistered), and none lands outside ``fn``: the watchdog
    strikes only while ``fn``'s frame is on the calling thread's stack, no thread is being started (a
    strike then could land in the new thread, whose state still carries its creator's id: it dies before
    saying it started, and ``start()`` in ``fn`` waits forever) and the thread is not importing (a strike
    inside importlib can leave a module lock held: every later import of that module would hang).
  * Nested calls on one thread: each keeps its own budget; an outer strike unwinds the inner call (its
    class is not the inner's) and is raised by the outer one. An inner call that ends clears the strike
    pending on its thread, which may be an outer call's: it strikes an outer call past its budget again.
  * Limits: a ``fn`` that starts threads can still hang its call: the check for a thread being started and
    the strike are two steps, and a thread started between them can get the strike before it boots (CPython
    gives it its own id without the GIL, so the undo misses it); it dies, and ``start()`` waits for it in a
    lock no strike can interrupt (seen under a stress of 3 threads starting threads under 1 ms budgets; the
    watchdog strikes on for every other call). An async exception is only delivered between Python
    bytecodes. A single long C call (a huge big-integer power, a blocking syscall), or code that catches
    every exception in an endless loop, cannot be stopped from inside the process; callers must screen such
    inputs out beforehand, and the reward worker pool's per-sample process kill is the hard bound behind it.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_REPEAT_S = 0.02
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
_set_async_exc.restype = ctypes.c_int


class DeadlineExceeded(BaseException):
    """Raised by ``call_with_deadline`` when its call ran past its budget."""


class _Strike(BaseException):
    """What the watchdog injects: each call its own subclass, which only that call turns into
    ``DeadlineExceeded``. Not a ``DeadlineExceeded``: code that handles an inner call's timeout with
    ``except DeadlineExceeded`` does not swallow an outer call's strike."""


class _Call:
    """One call in flight: ``due`` is when the watchdog strikes next (monotonic seconds)."""

    __slots__ = ("target", "exc_type", "due", "frame", "expired")

    def __init__(self, exc_type: type[BaseException], timeout_s: float):
        self.target = threading.get_ident()
        self.exc_type = exc_type
        self.due = time.monotonic() + timeout_s
        self.frame: Any = None  # set by _run: strikes only while it is on the target's stack
        self.expired = False  # past its budget: struck (or to be struck) until it ends


class _Watchdog:
    """The process's watchdog: the calls in flight, and the lock every registration, strike and disarm
    takes (so a strike is never set after its call deregistered)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.calls: set[_Call] = set()
        self.pid = -1  # the process whose thread runs _watch

    def register(self, call: _Call) -> None:
        with self.lock:
            if self.pid != os.getpid():  # before the first call's fn runs: never a thread started inside one
                self.pid = os.getpid()
                threading.Thread(target=self._watch, name="reward-deadline", daemon=True).start()
            self.calls.add(call)
            self.wake.notify()

    def _watch(self) -> None:
        with self.lock:
            while True:
                now = time.monotonic()
                for call in list(self.calls):
                    if call.due <= now:
                        call.expired = True
                        state = _state(call.target, call.frame)
                        if state == "over":  # an outer strike skipped its disarm (landed before its try)
                            self.calls.discard(call)
                            continue
                        if state == "strike" and not _threads_starting():
                            _inject(call.target, call.exc_type)
                        call.due = now + _REPEAT_S
                due = min((c.due for c in self.calls), default=math.inf)
                self.wake.wait(None if math.isinf(due) else max(due - time.monotonic(), 0.0))

    def disarm(self, call: _Call) -> None:
        """Deregister ``call`` and drop a strike pending on its thread. A strike delivered meanwhile is caught
        and the disarming repeated: ``call``'s own is dropped (the caller raises DeadlineExceeded anyway), an
        outer call's is raised once ``call`` is deregistered. Dropping the pending strike may drop an outer
        call's: an outer call already past its budget is struck again at once (else inner calls that end
        more often than every ``_REPEAT_S`` would keep it running for ever)."""
        outer: BaseException | None = None
        while True:
            try:
                with self.lock:
                    self.calls.discard(call)
                    _inject(call.target, None)
                    if outer is None:
                        for other in self.calls:
                            if (other.target == call.target and other.expired and
                                    _state(other.target, other.frame) == "strike"):
                                _inject(other.target, other.exc_type)
                                break
                break
            except BaseException as exc:  # noqa: BLE001 - a strike; sorted below
                if not isinstance(exc, call.exc_type) and outer is None:
                    outer = exc
        if outer is not None:
            raise outer


_watchdog = _Watchdog()


def _reset_after_fork() -> None:
    global _watchdog  # the parent's lock may have been held by its watchdog at the fork; its thread is gone
    _watchdog = _Watchdog()


os.register_at_fork(after_in_child=_reset_after_fork)


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
    lands in the caller's code after an earlier strike unwound ``fn``; one that races past the check into
    the ``finally`` is caught there."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    exc_type = type("DeadlineStrike", (_Strike,), {"timeout_s": timeout_s})
    call = _Call(exc_type, timeout_s)
    watchdog = _watchdog
    try:
        try:
            watchdog.register(call)
            return _run(fn, call)
        finally:
            watchdog.disarm(call)
    except exc_type:
        raise DeadlineExceeded(f"call exceeded its {timeout_s:g}s budget") from None


def _run(fn: Callable[[], T], call: _Call) -> T:
    """``fn()``, in a frame of its own that marks "inside the deadline" for the watchdog."""
    call.frame = sys._getframe()
    return fn()


_STALE_S = 1.0  # a thread in threading._limbo this long is not starting: its start() was struck before it began
_limbo_seen: "weakref.WeakKeyDictionary[threading.Thread, float]" = weakref.WeakKeyDictionary()


def _threads_starting() -> bool:
    """Whether a thread is being started (between ``Thread.start`` and its bootstrap). Until it boots, its
    thread state carries its creator's id (CPython), so a strike aimed at the creator could land in it: the
    new thread would die before saying it started, and ``start()`` in ``fn`` would wait forever. An entry of
    ``threading._limbo`` older than ``_STALE_S`` does not count: a strike that raced into ``start()`` before
    the thread began leaves it there for good (``start`` only cleans up after an ``Exception``), as does a new
    thread killed by a strike that raced this check (CPython gives it its own id without the GIL, so our undo
    can miss it), and such an entry must not keep every deadline of the process from striking again.
    (Called by the watchdog, under its lock.)"""
    now, starting = time.monotonic(), False
    for thread in list(getattr(threading, "_limbo", {})):
        if now - _limbo_seen.setdefault(thread, now) < _STALE_S:
            starting = True
    return starting


def _state(thread_id: int, frame: Any) -> str:
    """Where a call stands: "strike" (``frame``, its ``_run``, is on the thread's stack), "wait" (not running yet,
    or importing above ``frame``: a strike inside importlib can leave a module lock held, the exception landing
    between its acquire and its release, and every later import of that module, in any thread, then waits for
    ever, as seen with sympy's lazy imports in math-verify; the strike waits for the import to end) or "over"
    (``frame`` has returned: a call whose deregistration a strike skipped)."""
    if frame is None:
        return "wait"
    f, importing = sys._current_frames().get(thread_id), False
    while f is not None:
        if f is frame:
            return "wait" if importing else "strike"
        importing = importing or f.f_code.co_filename.startswith("<frozen importlib")
        f = f.f_back
    return "over"
