"""Futures of commands sent to executor ranks: one future per rank, combined for the caller.

``gather_ranks`` makes one future of a group call's per-rank futures: the list of results by rank, or the
lowest rank's error (naming the other failed ranks), a rank's own error before a ``ShutDown`` (a rank
stopped by the shutdown another rank's failure caused is not the cause); ``first_result`` unwraps a one-rank
call; ``settle`` completes a future that may already be done (cancelled by its caller, or failed by a death
first); ``retrieve`` marks a done future's error as seen; ``awaitable`` hands a command's future to asyncio.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Sequence

from llamarl.runtime.rpc import ExecutorDied, ExecutorError, is_shut_down


def settle(fut: Future, *, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``fut`` unless it is already done (e.g. cancelled by its caller)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def retrieve(fut: Any) -> None:
    """Mark the exception of a done, non-cancelled (asyncio) future or task as retrieved, so asyncio logs no
    "exception was never retrieved" for an error the caller reports otherwise (or another error instead)."""
    if fut.done() and not fut.cancelled():
        fut.exception()


def gather_ranks(futures: Sequence[Future], group: str = "", method: str = "") -> Future:
    """One future for the list of results; fails with the lowest-rank error, naming the other failures."""
    out: Future = Future()
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [(i, f.exception()) for i, f in enumerate(futures) if f.cancelled() or f.exception()]
        if not errors:
            settle(out, result=[f.result() for f in futures])
            return
        errors.sort(key=lambda e: is_shut_down(e[1]))  # stable: by rank among each kind
        first = errors[0][1]
        if len(errors) > 1 and isinstance(first, ExecutorError) and not isinstance(first, ExecutorDied):
            others = [i for i, _ in errors[1:]]
            first = ExecutorError(first.group, first.rank, first.method, first.exc_type, first.remote_message,
                                  first.remote_traceback, note=f"(ranks {others} of the call failed too)")
        settle(out, exc=first)

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(done)
    return out


def first_result(fut: Future) -> Future:
    out: Future = Future()

    def done(f: Future) -> None:
        if f.exception() is not None:
            settle(out, exc=f.exception())
        else:
            settle(out, result=f.result()[0])

    fut.add_done_callback(done)
    return out


def awaitable(fut: Future) -> asyncio.Future:
    """``fut`` as an asyncio future of the running loop. If a shutdown abandons the call, or its group's death
    or hang fails it (a call queued behind the one that died), its error counts as retrieved: the controller
    that would await it was typically cancelled by the failure that stopped the run (which ``supervise``
    reports), and asyncio would log "Future exception was never retrieved" after that real error. An awaiter
    still gets the error."""
    afut = asyncio.wrap_future(fut)
    loop = afut.get_loop()

    def mark_abandoned(f: Future) -> None:  # runs after wrap_future's own callback: queued behind it
        if not f.cancelled() and (is_shut_down(f.exception()) or isinstance(f.exception(), ExecutorDied)):
            try:
                loop.call_soon_threadsafe(retrieve, afut)
            except RuntimeError:
                pass  # the loop has closed: the asyncio future never got the error

    fut.add_done_callback(mark_abandoned)
    return afut
