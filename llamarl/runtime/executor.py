"""Controller-side handles to executor groups: commands as futures, failure detection, clean shutdown.

An ``ExecutorGroup`` is R ranks running the same executor class (see ``server.py``). Commands::

    group.call("step", batch)          -> Future[list]   every rank runs step(batch); results by rank
    group.call_rank(0, "state_dict")   -> Future          one rank
    group.call_each("score", [(a,), (b,)]) -> Future[list] rank r runs score(*per_rank[r])
    await group.acall("step", batch)   # the same, awaitable from asyncio (also acall_rank / acall_each)

Ordering invariant: calls are sent under one lock per group, so every rank of a group sees the group's
calls in the same order (collectives inside commands cannot cross) and runs them one at a time in that
order. Different groups run concurrently.

Failures: a command that raises fails its future with ``ExecutorError`` (group, rank, method, remote
traceback); for a group call the lowest failing rank is reported and the others are listed. A rank whose
process exits or whose connection drops is noticed by the group's monitor thread (it waits on process
sentinels and connections, so detection is immediate, not polled); then ``group.failed`` raises
``ExecutorDied``, ``on_failure`` callbacks run (on the monitor thread: keep them short and thread-safe;
use ``loop.call_soon_threadsafe`` to reach asyncio), every pending and later call of the group fails with
``ExecutorDied``, and the group's surviving ranks are terminated (a group with a dead member cannot run
collectives). A watcher of ``failed`` (``Runtime.supervise``) learns of a death no later than the caller.
A message one side cannot unpickle (an argument class unknown to the rank, a result the controller cannot
rebuild) fails only that call, saying so; the group serves on. If the monitor itself fails, the group is
failed (``MonitorFailed``) rather than left unwatched.

Hangs: with ``command_timeout_s`` > 0, a rank whose current command has run longer than that (counted from
when the rank could start it) is taken for hung: it prints its Python stacks at the limit (``server.py``),
a few seconds later the monitor kills the group's local ranks (SIGSTOPped ones too), disconnects remote
ones (which then exit) and fails the group with ``ExecutorHung`` (an ``ExecutorDied``), like a death.
The monitor only ever handles whole replies (``frames.py``), so a rank stalled halfway through sending one
is hung like any other, and never holds the monitor (nor the detection of the other ranks' deaths).

Ctrl-C is the controller's alone: ranks are started with SIGINT blocked and ignore it (``server.py``).
A locally spawned rank also exits by itself when the controller process dies, however it dies, even
mid-bootstrap (``server.py``).

Shutdown (``shutdown()``, context exit, or the atexit hook for groups still alive at interpreter exit):
queued commands finish, each rank gets ``__close__`` (its ``close()`` runs), processes are joined with a
timeout, then terminated, then killed; no child process outlives the group. Calls it abandons fail with an
``ExecutorError`` of type ``ShutDown``, which the ``acall`` futures count as retrieved (asyncio logs no
"exception was never retrieved" for a call the stopped controller no longer awaits).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import multiprocessing as mp
import pickle
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from multiprocessing.connection import wait
from typing import Any, Callable, Iterable, Sequence

from llamarl._procs import sigint_blocked
from llamarl.runtime import server, starting
from llamarl.runtime.futures import awaitable, first_result, gather_ranks, settle
from llamarl.runtime.links import RankLink, check_spawn_args, child_environment, disconnect, kill_all
from llamarl.runtime.net import free_port
from llamarl.runtime.rpc import (
    BOOTSTRAP_ID,
    CLOSE,
    SHUT_DOWN,
    UNREADABLE_ID,
    Bootstrap,
    Call,
    ExecutorDied,
    ExecutorError,
    ExecutorHung,
    MonitorFailed,
    RemoteFailure,
    Reply,
    describe_exit,
    is_shut_down,
    shut_down_error,
)

HANG_GRACE_S = 3.0  # after the command timeout, before the kill: time for the ranks' own stack dumps
MAX_COMMAND_TIMEOUT_S = 1e6  # ~11 days; longer limits overflow the waits' millisecond counts (use 0: none)
FailureCallback = Callable[["ExecutorGroup", ExecutorDied], None]
_LIVE_GROUPS: "weakref.WeakSet[ExecutorGroup]" = weakref.WeakSet()


class ExecutorGroup:
    """Handle to one group of executor ranks. Build with ``spawn`` (local) or via ``Runtime``."""

    def __init__(self, name: str, links: Sequence[RankLink], *, role: str = "",
                 on_failure: FailureCallback | None = None, command_timeout_s: float = 0.0):
        if command_timeout_s == float("inf"):
            command_timeout_s = 0.0  # no limit
        if not 0 <= command_timeout_s <= MAX_COMMAND_TIMEOUT_S:
            raise ValueError(f"command_timeout_s must be in [0, {MAX_COMMAND_TIMEOUT_S:g}] seconds (0 or inf: no "
                             f"limit), got {command_timeout_s!r}")
        self.name, self.role = name, role or name
        self.command_timeout_s = float(command_timeout_s)
        self._links = list(links)
        self._lock = threading.RLock()  # the group's state: pending calls, death, closing
        # held across a whole submission (ids, then sends in id order): every rank gets the calls in one order.
        # Separate from _lock, so a send blocked on a rank that stopped reading never stalls the monitor.
        self._send_lock = threading.Lock()
        self._ids = itertools.count(BOOTSTRAP_ID + 1)
        self._closing = False
        self._closed = False
        self._start_failed = False
        self._death: ExecutorDied | None = None
        self._callbacks: list[FailureCallback] = [on_failure] if on_failure else []
        self.failed: Future = Future()  # raises ExecutorDied when a rank dies; result None after shutdown
        self._ready: Future | None = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)  # wakes the monitor: shutdown, or a newly busy rank
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"llamarl-monitor-{name}", daemon=True)
        self._monitor.start()
        _LIVE_GROUPS.add(self)

    # ---------------------------------------------------------------- construction
    @classmethod
    def spawn(cls, name: str, target: str, world_size: int = 1, *, init_kwargs: dict | None = None,
              env: dict[str, str] | None = None, backend: str = "gloo", devices: Sequence[str] | None = None,
              role: str = "", global_ranks: Sequence[int] | None = None, dist_timeout_s: float = 600.0,
              start_timeout_s: float = 600.0, on_failure: FailureCallback | None = None,
              wait_ready: bool = True, command_timeout_s: float = 0.0) -> ExecutorGroup:
        """Start ``world_size`` local processes running ``target`` ("pkg.module:Class"): forked from the
        preloaded fork server when every rank works on the CPU, spawned otherwise (``starting.py``).

        Each rank joins this group's own process group (``backend`` over 127.0.0.1 and a free port) and
        constructs ``Class(**init_kwargs, rank_info=RankInfo)``. ``devices`` (one per rank, default "cpu")
        says where each rank should work; ``global_ranks`` (default 0..R-1) are the ranks a ``Layout``
        gave them; ``env`` is in the child's environment from its start (e.g. ``OMP_NUM_THREADS``). With
        ``wait_ready`` (default) this returns once every rank is constructed, raising ``ExecutorError``
        (with the remote traceback) if a constructor failed; otherwise call ``wait_ready()`` later.
        ``command_timeout_s`` > 0 treats a command running longer as a hang (module docstring).
        """
        check_spawn_args(name, target, world_size, init_kwargs, env, backend, devices)
        devices = list(devices) if devices is not None else ["cpu"] * world_size
        global_ranks = list(global_ranks) if global_ranks is not None else list(range(world_size))
        if len(global_ranks) != world_size:
            raise ValueError(f"executor group '{name}': got {len(global_ranks)} global ranks for {world_size} ranks")
        method = starting.start_method(devices)
        ctx = starting.context(method, target.partition(":")[0])
        port = free_port("127.0.0.1")
        links: list[RankLink] = []
        boots: list[Bootstrap] = []
        child_env = {str(k): str(v) for k, v in (env or {}).items()}
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                # The child starts with the environment (a forked one installs what it is sent) and, when
                # spawned, with SIGINT blocked (it sets SIGINT to ignored and unblocks it first thing,
                # server.child_main): a Ctrl-C while it is still importing modules is discarded there
                # instead of printing a KeyboardInterrupt traceback.
                with child_environment(child_env), sigint_blocked():
                    process = ctx.Process(target=server.child_main,
                                          args=(child_conn, starting.for_child(method)),
                                          name=f"llamarl-{name}-{rank}", daemon=False)
                    process.start()
                    # recorded before SIGINT is unblocked: a Ctrl-C that was pending fires at the block's end,
                    # and the cleanup below must know this rank to kill it (else exit hangs joining it)
                    links.append(RankLink(parent_conn, process))
                child_conn.close()  # keep only the child's copy, so its death reads as EOF here
                boots.append(Bootstrap(group=name, role=role or name, target=target,
                                       init_kwargs=dict(init_kwargs or {}), rank=rank, world_size=world_size,
                                       global_rank=global_ranks[rank], master_addr="127.0.0.1",
                                       master_port=port, backend=backend, device=devices[rank],
                                       dist_timeout_s=dist_timeout_s, env=child_env,
                                       command_timeout_s=command_timeout_s))
        except BaseException:
            kill_all(links)
            raise
        group = cls(name, links, role=role, on_failure=on_failure, command_timeout_s=command_timeout_s)
        try:
            group._bootstrap(boots)
        except BaseException:
            group.shutdown(timeout=2.0)
            raise
        if wait_ready:
            try:
                group.wait_ready(start_timeout_s)
            except BaseException:  # (wait_ready shuts the group down on its own errors; not on a Ctrl-C)
                group.shutdown(timeout=2.0)
                raise
        return group

    def _bootstrap(self, boots: Sequence[Bootstrap]) -> None:
        """Send each rank its bootstrap (call id 0); ``wait_ready`` waits for the answers."""
        try:
            blobs = [pickle.dumps(Call(BOOTSTRAP_ID, "__bootstrap__", (boot,), {}), protocol=pickle.HIGHEST_PROTOCOL)
                     for boot in boots]
        except Exception as exc:
            raise TypeError(f"init_kwargs/env of executor group '{self.name}' cannot be pickled: {exc}") from exc
        futures, sends = [], []
        with self._send_lock:
            with self._lock:
                for rank, link in enumerate(self._links):
                    fut: Future = Future()
                    futures.append(fut)
                    if self._death is not None:  # a rank died before we got here
                        fut.set_exception(self._died_for("__init__"))
                        continue
                    link.pending[BOOTSTRAP_ID] = ("__init__", fut)
                    sends.append((link, blobs[rank]))
            for link, blob in sends:
                self._send_bytes(link, blob)
        # ready when every rank is; failed at the first rank that fails (the others may be stuck in the
        # rendezvous with it, so waiting for all of them would hide its error behind the start timeout)
        self._ready = ready = Future()
        everyone = gather_ranks(futures)
        everyone.add_done_callback(lambda f: settle(ready, exc=f.exception()) if f.exception() is not None
                                   else settle(ready, result=f.result()))
        for fut in futures:
            fut.add_done_callback(lambda f: settle(ready, exc=f.exception()) if not f.cancelled()
                                  and f.exception() is not None and not is_shut_down(f.exception()) else None)

    def wait_ready(self, timeout: float | None = 600.0) -> list[int]:
        """Block until every rank constructed its executor; returns the ranks' pids.

        On a constructor error, a death or a timeout the group is shut down and the error raised.
        """
        assert self._ready is not None, "wait_ready() on a group that was not bootstrapped"
        wait_futures([self._ready], timeout=timeout)
        return self._ready_pids(timeout)

    async def await_ready(self, timeout: float | None = 600.0) -> list[int]:
        """``wait_ready`` for asyncio: the event loop runs while the ranks start (so a Ctrl-C, which cancels
        the controller's task, ends the wait at once; the group is left to its caller)."""
        assert self._ready is not None, "await_ready() on a group that was not bootstrapped"
        await asyncio.wait([awaitable(self._ready)], timeout=timeout)
        return self._ready_pids(timeout)

    def _ready_pids(self, timeout: float | None) -> list[int]:
        if not self._ready.done():
            missing = [r for r, link in enumerate(self._links) if BOOTSTRAP_ID in link.pending]
            self.shutdown(timeout=2.0)
            raise TimeoutError(f"executor group '{self.name}': ranks {missing} did not start within {timeout} s "
                               f"(process group rendezvous or the executor constructor is stuck)")
        try:
            return self._ready.result()
        except BaseException:
            self.shutdown(timeout=2.0)
            raise

    # ---------------------------------------------------------------- commands
    @property
    def world_size(self) -> int:
        return len(self._links)

    @property
    def pids(self) -> list[int | None]:
        """Process ids of local ranks (None for remote torchrun ranks)."""
        return [link.pid for link in self._links]

    @property
    def alive(self) -> bool:
        return not (self._closed or self._closing or self._death is not None)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Run ``method(*args, **kwargs)`` on every rank; the future gives the list of results by rank."""
        return self._submit(method, [(args, kwargs)] * self.world_size, range(self.world_size))

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Future:
        """Run ``method`` on one rank; the future gives its result."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise IndexError(f"executor group '{self.name}' has ranks 0..{self.world_size - 1}, got rank {rank!r}")
        return first_result(self._submit(method, [(args, kwargs)], [rank]))

    def call_each(self, method: str, per_rank_args: Sequence[Sequence[Any]], **kwargs: Any) -> Future:
        """Rank r runs ``method(*per_rank_args[r], **kwargs)``; the future gives the results by rank."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"call_each('{method}') on group '{self.name}': got {len(per_rank_args)} argument "
                             f"tuples for {self.world_size} ranks; pass exactly one per rank")
        return self._submit(method, [(tuple(a), kwargs) for a in per_rank_args], range(self.world_size))

    def acall(self, method: str, *args: Any, **kwargs: Any) -> asyncio.Future:
        return awaitable(self.call(method, *args, **kwargs))

    def acall_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> asyncio.Future:
        return awaitable(self.call_rank(rank, method, *args, **kwargs))

    def acall_each(self, method: str, per_rank_args: Sequence[Sequence[Any]], **kwargs: Any) -> asyncio.Future:
        return awaitable(self.call_each(method, per_rank_args, **kwargs))

    def add_failure_callback(self, callback: FailureCallback) -> None:
        """Call ``callback(group, ExecutorDied)`` once if a rank of this group dies (now, if it already has)."""
        with self._lock:
            if self._death is None:
                self._callbacks.append(callback)
                return
        callback(self, self._death)

    def _submit(self, method: str, calls: Sequence[tuple[tuple, dict]], ranks: Iterable[int]) -> Future:
        if not isinstance(method, str) or not method or method.startswith("_"):
            raise ValueError(f"command name must be a public method name, got {method!r}")
        ranks = list(ranks)
        blobs: dict[int, bytes] = {}
        with self._send_lock:
            call_id = next(self._ids)
            for i, (args, kwargs) in enumerate(calls):
                if i and calls[i - 1] is calls[i]:
                    blobs[i] = blobs[i - 1]  # broadcast: pickle once
                    continue
                try:
                    blobs[i] = pickle.dumps(Call(call_id, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    raise TypeError(f"arguments of {method}() for executor group '{self.name}' cannot be "
                                    f"pickled: {exc}") from exc
            futures, sends, started = [], [], False
            with self._lock:
                for i, rank in enumerate(ranks):
                    fut: Future = Future()
                    futures.append(fut)
                    link = self._links[rank]
                    if self._death is not None:
                        fut.set_exception(self._died_for(method))
                    elif self._closed or self._closing:
                        fut.set_exception(ExecutorError(self.name, rank, method, SHUT_DOWN,
                                                        "the executor group was shut down"))
                    else:
                        if not link.pending:
                            link.busy_since, started = time.monotonic(), True
                        link.pending[call_id] = (method, fut)
                        sends.append((link, blobs[i]))
            if started and self.command_timeout_s > 0:
                self._wake_monitor()
            for link, blob in sends:  # a failed send leaves the call pending: the monitor fails it on the loss
                self._send_bytes(link, blob)
        return gather_ranks(futures, self.name, method)

    def _wake_monitor(self) -> None:
        try:
            self._wake_w.send_bytes(b"x")
        except OSError:
            pass  # shut down already

    def _send(self, link: RankLink, message: Any) -> None:
        self._send_bytes(link, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _send_bytes(self, link: RankLink, blob: bytes) -> None:
        try:
            link.conn.send_bytes(blob)
        except (OSError, EOFError, ValueError, TypeError):  # TypeError: the connection was closed mid-send
            pass  # the rank is gone; the monitor fails its pending calls with ExecutorDied

    # ---------------------------------------------------------------- monitoring
    def _monitor_loop(self) -> None:
        try:
            while self._monitor_step():
                pass
        except BaseException as exc:  # noqa: BLE001 - a monitor that ended silently would leave the group unwatched
            self._monitor_failed(exc)

    def _monitor_step(self) -> bool:
        """Wait for replies, deaths, a wake-up or the next hang deadline, and handle them; False once closed."""
        with self._lock:
            if self._closed:
                return False
            links = [link for link in self._links if link.open]
        waitables: list[Any] = [self._wake_r]
        for link in links:
            waitables.append(link.conn)
            if link.process is not None:
                waitables.append(link.process.sentinel)
        ready = set(wait(waitables, timeout=self._until_hang(self._oldest_busy())))
        if self._wake_r in ready:
            if self._closed:
                return False
            while self._wake_r.poll():
                self._wake_r.recv_bytes()  # a rank became busy: its deadline enters the next wait
        for rank, link in enumerate(self._links):
            if not link.open:
                continue
            lost = False
            if link.conn in ready:
                lost = self._drain(rank, link)
            if link.process is not None and link.process.sentinel in ready:
                self._drain(rank, link)
                lost = True
            if lost:
                self._on_lost(rank, link)
        self._check_hung()
        return True

    def _monitor_failed(self, exc: BaseException) -> None:
        """The monitor loop raised: fail the group like a death (``MonitorFailed``, unless it already failed)."""
        if self._closed:
            return  # shut down meanwhile (its connections may have been closed under the wait): nothing to watch
        print(f"llamarl.runtime: the monitor thread of executor group '{self.name}' failed; stopping the group\n"
              + "".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
        with self._lock:
            first = self._death is None
            if first:
                self._death = MonitorFailed(self.name, repr(exc))
        self._fail_group(report=first)

    def _oldest_busy(self) -> tuple[float, int] | None:
        """(busy_since, rank) of the open rank busiest for longest (a bootstrap has its own timeout); None
        if no limit applies now: none set, none busy, or the group closing or failed. Read without the lock."""
        if self.command_timeout_s <= 0 or self._closing or self._closed or self._death is not None:
            return None
        busy = [(lk.busy_since, r) for r, lk in enumerate(self._links)
                if lk.open and lk.busy_since is not None and BOOTSTRAP_ID not in lk.pending]
        return min(busy) if busy else None

    def _until_hang(self, oldest: tuple[float, int] | None) -> float | None:
        """Seconds until the ``oldest`` busy rank is taken for hung (None: never, as things stand)."""
        if oldest is None:
            return None
        return max(0.0, oldest[0] + self.command_timeout_s + HANG_GRACE_S - time.monotonic())

    def _check_hung(self) -> None:
        oldest = self._oldest_busy()
        if self._until_hang(oldest) != 0.0:
            return
        # Read without the lock, and kill before taking it: a send blocked on a stopped rank's full pipe may
        # hold it (the kill breaks that pipe). Only this thread removes pending entries.
        since, rank = oldest
        method = next(iter(list(self._links[rank].pending.values())), ("?", None))[0]
        hung = ExecutorHung(self.name, rank, method, time.monotonic() - since, self.command_timeout_s)
        kill_all(self._links, grace_s=1.0)
        with self._lock:
            if self._closing or self._closed or self._death is not None:
                return
            self._death = hung
        self._fail_group()

    def _drain(self, rank: int, link: RankLink) -> bool:
        """Handle every reply complete on ``link`` (never waiting for the rest of one: a rank stalled mid-reply
        must not stall the monitor, ``frames.py``); returns True if the connection has closed."""
        blobs, closed = link.reader.read()
        for blob in blobs:
            try:
                reply = pickle.loads(blob)
            except Exception as exc:  # noqa: BLE001 - e.g. a result whose class cannot be rebuilt here
                self._unreadable_reply(rank, link, exc)
                continue
            self._resolve(rank, link, reply)
        return closed

    def _take(self, link: RankLink, call_id: int) -> tuple[int, str, Future | None]:
        """Remove the pending call ``call_id`` (``UNREADABLE_ID``: the oldest; replies come in call order)."""
        with self._lock:
            if call_id == UNREADABLE_ID:
                call_id = next(iter(link.pending), UNREADABLE_ID)
            method, fut = link.pending.pop(call_id, ("?", None))
            link.busy_since = time.monotonic() if link.pending else None  # the next command starts now
        return call_id, method, fut

    def _resolve(self, rank: int, link: RankLink, reply: Reply) -> None:
        call_id, method, fut = self._take(link, reply.call_id)
        if fut is None:
            return
        if reply.ok:
            settle(fut, result=reply.payload)
        else:
            if call_id == BOOTSTRAP_ID:
                self._start_failed = True  # that rank now exits on purpose; wait_ready shuts the group down
            failure: RemoteFailure = reply.payload
            settle(fut, exc=ExecutorError(self.name, rank, method, failure.exc_type, failure.message,
                                          failure.traceback))

    def _unreadable_reply(self, rank: int, link: RankLink, exc: Exception) -> None:
        """Fail the call whose reply could not be unpickled here (the oldest pending); the rank serves on."""
        call_id, method, fut = self._take(link, UNREADABLE_ID)
        if fut is None:
            return
        if call_id == BOOTSTRAP_ID:
            self._start_failed = True
        settle(fut, exc=ExecutorError(self.name, rank, method, type(exc).__name__, (
            f"its reply could not be unpickled by the controller: {exc} (return plain data, or objects the controller "
            f"can import and rebuild; e.g. an exception whose __init__ takes more than its message needs __reduce__)")))

    def _on_lost(self, rank: int, link: RankLink) -> None:
        link.open = False
        exitcode = None
        if link.process is not None:
            exitcode = link.join(timeout=2.0)
        cause = starting.lost_rank_cause(link.process, exitcode)  # (may wait for the fork server: not under the lock)
        with self._lock:
            expected = self._closing or self._closed or self._start_failed or self._death is not None
            if expected:  # an exit we asked for, or a group that already failed: settle this rank's calls
                leftovers = list(link.pending.values())
                link.pending.clear()
            else:
                pending_method = next(iter(link.pending.values()), ("", None))[0]
                self._death = ExecutorDied(self.name, rank, exitcode, pending_method, cause)
        if expected:
            for method, fut in leftovers:
                if self._death is not None:  # the group failed: its calls fail with that death
                    exc: ExecutorError = self._died_for(method)
                elif self._closing or self._closed:  # stopped by a shutdown (e.g. after another group died)
                    exc = shut_down_error(self.name, rank, method, f" (rank {rank}: {describe_exit(exitcode)})")
                else:  # its constructor failed
                    exc = ExecutorDied(self.name, rank, exitcode, method)
                settle(fut, exc=exc)
            return
        self._fail_group()

    def _fail_group(self, report: bool = True) -> None:
        """After ``self._death`` was set: report it (``failed``, callbacks), fail every pending call, stop every
        rank. Reported first, so a watcher of ``failed`` never hears of the death after the caller does."""
        failure = self._death
        settle(self.failed, exc=failure)
        for callback in list(self._callbacks) if report else ():
            try:
                callback(self, failure)
            except Exception as exc:  # noqa: BLE001 - a callback bug must not kill the monitor silently
                print(f"llamarl.runtime: on_failure callback for '{self.name}' raised {exc!r}", file=sys.stderr)
        with self._lock:
            leftovers = [entry for lk in self._links for entry in lk.pending.values()]
            for lk in self._links:
                lk.pending.clear()
        for method, fut in leftovers:
            settle(fut, exc=self._died_for(method))
        kill_all(self._links, grace_s=1.0)  # the survivors, and the lost rank if it only dropped its connection
        for lk in self._links:
            lk.open = False
            if lk.process is None:  # a remote (torchrun) rank exits when its controller connection drops
                disconnect(lk)

    def _died_for(self, method: str) -> ExecutorDied:
        d = self._death
        assert d is not None
        if type(d) is ExecutorDied:
            return ExecutorDied(d.group, d.rank, d.exitcode, method, d.cause)
        rebuild, args = d.__reduce__()  # a hang or a failed monitor: every call fails with what stopped the group
        return rebuild(*args)

    # ---------------------------------------------------------------- shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish queued commands, close every rank, and make sure every process has exited.

        Ranks get ``timeout`` seconds in total to answer ``__close__`` and exit; stragglers are sent
        SIGTERM, then SIGKILL. Idempotent; safe to call from any thread but the monitor's callbacks.
        """
        # behind the calls already sent; a send blocked on a rank that stopped reading must not block this
        sending = self._send_lock.acquire(timeout=timeout)
        try:
            with self._lock:
                if self._closed or self._closing:
                    return
                self._closing = True
                closes, sends = [], []
                for link in self._links:
                    if link.open and self._death is None:  # a failed group's ranks are being killed: none answers
                        fut: Future = Future()
                        call_id = next(self._ids)
                        link.pending[call_id] = (CLOSE, fut)
                        sends.append((link, Call(call_id, CLOSE, (), {})))
                        closes.append(fut)
            for link, message in sends if sending else ():
                self._send(link, message)
        finally:
            if sending:
                self._send_lock.release()
        deadline = time.monotonic() + timeout
        wait_futures(closes, timeout=timeout)
        for link in self._links:
            link.join(timeout=max(0.0, deadline - time.monotonic()))
        kill_all(self._links, grace_s=2.0)
        with self._lock:
            self._closed = True
        self._wake_monitor()
        if threading.current_thread() is not self._monitor:
            self._monitor.join(timeout=5.0)
        with self._lock:
            leftovers = [(m, f) for lk in self._links for m, f in lk.pending.values()]
            for lk in self._links:
                lk.pending.clear()
        for method, fut in leftovers:
            settle(fut, exc=shut_down_error(self.name, -1, method))
        for link in self._links:
            link.open = False
            link.close()
        self._wake_r.close()
        self._wake_w.close()
        settle(self.failed, result=None)
        _LIVE_GROUPS.discard(self)

    def __enter__(self) -> ExecutorGroup:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "dead" if self._death else "closed" if self._closed else "alive"
        return f"ExecutorGroup({self.name!r}, world_size={self.world_size}, {state})"


@atexit.register
def _shutdown_live_groups() -> None:
    for group in list(_LIVE_GROUPS):
        try:
            group.shutdown(timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            kill_all(group._links, grace_s=1.0)
