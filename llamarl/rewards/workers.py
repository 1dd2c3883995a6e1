"""RewardPool: score (completion, answer) pairs in worker processes, with a per-sample timeout.

    with RewardPool("math", num_workers=4, timeout_s=5.0) as pool:
        results = pool.score([(sample_id, completion, answer), ...])   # blocking, input order; an item
                                                                         # may add an info dict (call_reward)
        future = pool.submit(sample_id, completion, answer)              # concurrent.futures.Future
        results = await pool.score_async(items)                          # asyncio

Processes and messages:
  * each worker is a "spawn"ed process (never fork: the parent may run torch/NCCL threads) that
    receives the reward *spec string* and calls ``load_reward`` itself, so user functions need not be
    picklable. It runs the function in its main thread and answers over its own duplex pipe:
        parent -> worker: (task_id, completion, answer, info, verifier_only) | None (exit)
        worker -> parent: ("ready", pid) | ("load_error", text) | ("result", task_id, reward, error, s, terms)
  * one dispatcher thread in the parent owns all workers: it hands a queued task to an idle ready
    worker, then waits (``multiprocessing.connection.wait``) on the pipes, the process sentinels and a
    wake-up pipe, with a timeout equal to the nearest task deadline.

Failure handling (a bad reward function costs one sample, never the run):
  * the function raises            -> reward 0.0, error "sample <id>: <Type>: <msg> (at file:line)";
  * it returns a non-number/NaN    -> reward 0.0, error naming the value;
  * it runs past ``timeout_s``     -> reward 0.0, error "sample <id>: timeout after Xs"; the stuck worker
                                      is killed (SIGKILL) and a fresh one is spawned;
  * the worker process dies        -> reward 0.0, error with its exit code; it is replaced.
  ``stats`` counts errors, timeouts, deaths and spawned workers. Workers that cannot even start (the
  spec fails to load in the child) three times in a row make the pool *broken*: queued samples and new
  submissions fail with a ``RewardPoolError`` carrying the child's message (retrying cannot help).

Invariants: every submitted future is resolved exactly once (a result, or an error when the pool is
closed or broken); ``close()`` returns only after every worker process has been joined (no children
left behind). No multiprocessing Queue/Lock is used; the "spawn" start method itself starts
multiprocessing's resource-tracker helper (one per parent process), which exits once the parent and
every worker, which all hold its pipe, have exited.

A parent that dies without closing the pool (SIGKILL, SIGTERM, a crash) leaves no worker behind either:
each worker runs a watchdog thread that waits on its parent's liveness (``parent_process().sentinel``,
plus a ``getppid`` check) and ends the worker with ``os._exit(1)`` as soon as the parent is gone, even
while the main thread is stuck inside a hanging reward function. Ctrl-C belongs to the parent: a worker
is started with SIGINT blocked (so a Ctrl-C while it is still importing modules cannot interrupt it with
a KeyboardInterrupt traceback) and sets SIGINT to ignored before unblocking it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.spawn as mp_spawn
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

from llamarl._procs import exit_when_parent_dies, ignore_sigint, sigint_blocked
from llamarl.rewards.registry import warm_up
from llamarl.rewards.terms import RewardTerms, describe_exception

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_START_FAILURES = 3
_MAX_LOGGED_ERRORS = 20


@dataclass(frozen=True)
class RewardResult:
    """The outcome of scoring one sample; ``error`` is None when the function returned normally. ``terms``:
    the rewards of the reward's functions, the verifier first (llamarl.rewards.terms; () after an error)."""

    sample_id: Hashable
    reward: float
    error: str | None
    elapsed_s: float
    terms: tuple[float, ...] = ()

    @property
    def verifier(self) -> float:
        """The verifier's own reward (what decides correctness); 0.0 after an error."""
        return self.terms[0] if self.terms else self.reward


@dataclass(frozen=True)
class RewardStats:
    """Counters since the pool started (a snapshot; ``RewardPool.stats`` returns a fresh one)."""

    submitted: int = 0
    completed: int = 0  # results delivered, whatever their outcome
    errors: int = 0  # exceptions, bad return values, dead workers (timeouts are counted apart)
    timeouts: int = 0
    worker_deaths: int = 0
    workers_started: int = 0


class RewardPoolError(RuntimeError):
    """The pool cannot score: it was closed, or its workers cannot load the reward spec."""


# ------------------------------------------------------------------------------------ worker side
def _worker_main(conn: mpc.Connection, specs: tuple[str, ...], weights: tuple[float, ...], format_weight: float,
                 format_style: str | None) -> None:
    os.setsid()  # its own process group: stopping it kills whatever the reward function forked too
    ignore_sigint()  # started with SIGINT blocked (sigint_blocked); Ctrl-C is the parent's to handle
    # with its process group: what the reward function started goes too (it leads the group, since setsid)
    exit_when_parent_dies(name="llamarl-reward-parent-watch", on_exit=lambda _: os.killpg(0, signal.SIGKILL))
    try:
        terms = RewardTerms(specs, weights, format_weight=format_weight, format_style=format_style)
        for spec in specs:
            warm_up(spec)
    except BaseException as e:
        try:
            conn.send(("load_error", describe_exception(e)))
        except (BrokenPipeError, OSError):
            pass  # the parent is gone: nobody to tell
        return
    try:
        conn.send(("ready", os.getpid()))
    except (BrokenPipeError, OSError):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, completion, answer, info, verifier_only = msg
        start = time.perf_counter()
        reward, parts, error = terms.score(completion, answer, info, verifier_only=verifier_only)
        try:
            conn.send(("result", task_id, reward, error, time.perf_counter() - start, parts))
        except (BrokenPipeError, OSError):
            return


# ------------------------------------------------------------------------------------ parent side
@dataclass
class _Task:
    task_id: int
    sample_id: Hashable
    completion: str
    answer: str
    info: Mapping[str, Any] | None
    future: Future
    verifier_only: bool = False


class _Worker:
    """One worker process, its pipe, and the task it is running (if any)."""

    def __init__(self, ctx: Any, args: tuple, index: int, start_timeout_s: float) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, *args), daemon=True, name=f"{_WORKER_NAME}{index}"
        )
        # the child inherits the mask (no KeyboardInterrupt while it imports); it skips the owner's __main__
        with sigint_blocked():  # (_preparation_without_main)
            self.process.start()
        child_conn.close()
        self.conn = parent_conn
        self.ready = False
        self.load_error: str | None = None
        self.task: _Task | None = None
        self.sent_at = 0.0
        self.deadline = math.inf
        self.start_deadline = time.monotonic() + start_timeout_s

    def stop(self, *, graceful: bool) -> None:
        if graceful and self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=2.0)
        self._kill_group()  # the worker and anything its reward function forked (they share its session)
        self.process.join(timeout=2.0)
        self.conn.close()
        if self.process.exitcode is None:  # unkillable (e.g. stuck in the kernel): report, don't hide it
            logger.error("reward worker pid %s did not exit after SIGKILL", self.process.pid)
        else:
            self.process.close()


    def _kill_group(self) -> None:
        pid = self.process.pid
        try:
            os.killpg(pid, signal.SIGKILL)  # the worker is its session's (and group's) leader: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass
        if self.process.is_alive():  # killed before its setsid ran: still in our group
            self.process.kill()


_WORKER_NAME = "llamarl-reward-"


def _preparation_without_main(get_preparation_data):
    """``multiprocessing.spawn.get_preparation_data`` that leaves the owner's ``__main__`` out for reward
    workers. Spawn children normally import the parent's main module (``python -m llamarl.train`` → torch,
    ~2 s and ~250 MB per worker, at every restart after a timeout); workers load the reward by its spec,
    never from ``__main__``, so they need none of it. Chosen by the process's name, so the user's
    ``__main__`` is never touched (editing its ``__file__`` from the pool's thread raced with their code)."""
    def prepare(name: str) -> dict:
        data = get_preparation_data(name)
        if name.startswith(_WORKER_NAME):
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    prepare.llamarl_wrapped = True
    return prepare


if not getattr(mp_spawn.get_preparation_data, "llamarl_wrapped", False):
    mp_spawn.get_preparation_data = _preparation_without_main(mp_spawn.get_preparation_data)


class RewardPool:
    """Worker processes scoring samples with the reward named by ``spec`` (see module docstring), or by
    several specs, the verifier first, whose rewards add up with ``weights`` (llamarl.rewards.terms)."""

    def __init__(
        self,
        spec: str | Sequence[str],
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        weights: Sequence[float] | None = None,
        format_weight: float = 0.0,
        format_style: str | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        # fail fast, here; and the sample info entries the functions take, the only ones sent to a worker
        terms = RewardTerms(spec, weights, format_weight=format_weight, format_style=format_style)
        self._info_params = terms.info
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        self._start_timeout_s = float(start_timeout_s)
        self._worker_args = (terms.specs, terms.weights, float(format_weight), format_style)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._queue: deque[_Task] = deque()
        self._next_task_id = 0
        self._closed = False
        self._broken: str | None = None
        self._stats = RewardStats()
        self._start_failures = 0
        self._logged_errors = 0
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self._wake_pending = False
        self._workers: list[_Worker] = []
        self._spawned = 0
        for _ in range(num_workers):
            self._spawn_worker()
        self._thread = threading.Thread(target=self._dispatch_loop, name="llamarl-reward-pool", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- public API
    def submit(self, sample_id: Hashable, completion: str, answer: str,
               info: Mapping[str, Any] | None = None, *, verifier_only: bool = False) -> Future:
        """Queue one sample; the future resolves to its ``RewardResult``. ``info``: what else is known of the
        sample, passed to a reward function that asks for it by name (llamarl.rewards.registry.call_reward);
        only the entries it takes cross to the worker. ``verifier_only``: score with the first function alone
        (its own reward, unweighted: whether the answer is correct, whatever the other terms would say)."""
        if not isinstance(completion, str) or not isinstance(answer, str):
            raise TypeError(
                f"sample {sample_id!r}: completion and answer must be str, got "
                f"{type(completion).__name__} and {type(answer).__name__}"
            )
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RewardPoolError("RewardPool is closed; create a new one to score more samples")
            if self._broken is not None:
                raise RewardPoolError(self._broken)
            self._queue.append(_Task(self._next_task_id, sample_id, completion, answer,
                                     self._info_params.select(info), future, verifier_only))
            self._next_task_id += 1
            self._bump(submitted=1)
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            self._wake()
        return future

    def score(self, items: Sequence[tuple], *, verifier_only: bool = False) -> list[RewardResult]:
        """Score ``(sample_id, completion, answer[, info])`` items; results come back in input order."""
        futures = [self.submit(*self._unpack(item, i), verifier_only=verifier_only) for i, item in enumerate(items)]
        return [f.result() for f in futures]

    async def score_async(self, items: Sequence[tuple], *, verifier_only: bool = False) -> list[RewardResult]:
        """``score`` for asyncio code: awaits the results without blocking the event loop."""
        futures = [self.submit(*self._unpack(item, i), verifier_only=verifier_only) for i, item in enumerate(items)]
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    @property
    def stats(self) -> RewardStats:
        with self._lock:
            return self._stats

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (changes when a worker is replaced)."""
        with self._lock:
            return [w.process.pid for w in self._workers]

    def close(self) -> None:
        """Stop the workers and fail samples not yet scored; joins every child process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RewardPool({self.spec!r}, num_workers={self.num_workers}, timeout_s={self.timeout_s:g})"

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _unpack(item: Any, index: int) -> tuple:
        if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
            raise TypeError(f"item {index} must be a (sample_id, completion, answer[, info]) tuple, got "
                            f"{item!r:.200}")
        return tuple(item)

    def _bump(self, **deltas: int) -> None:  # caller holds self._lock
        s = self._stats
        self._stats = RewardStats(**{k: getattr(s, k) + deltas.get(k, 0) for k in s.__dataclass_fields__})

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"w")
        except (BrokenPipeError, OSError):  # dispatcher already gone: nothing left to wake
            pass

    def _spawn_worker(self) -> None:
        self._workers.append(_Worker(self._ctx, self._worker_args, self._spawned, self._start_timeout_s))
        self._spawned += 1
        with self._lock:
            self._bump(workers_started=1)

    def _finish(self, task: _Task, reward: float, error: str | None, elapsed_s: float, terms: tuple = (),
                **counters: int) -> None:
        if error is not None:
            error = f"sample {task.sample_id!r}: {error}"
            with self._lock:
                log = self._logged_errors < _MAX_LOGGED_ERRORS
                self._logged_errors += 1
            if log:
                logger.warning("reward %r failed: %s", self.spec, error)
                if self._logged_errors == _MAX_LOGGED_ERRORS:
                    logger.warning("further reward failures are only counted in RewardPool.stats")
        with self._lock:
            self._bump(completed=1, **counters)
        if not task.future.done():
            task.future.set_result(RewardResult(task.sample_id, reward, error, elapsed_s, tuple(terms)))

    # ---------------------------------------------------------------- dispatcher thread
    def _dispatch_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        break
                self._assign_tasks()
                waitables: list[Any] = [self._wake_r]
                for w in self._workers:
                    waitables += [w.conn, w.process.sentinel]
                now = time.monotonic()
                deadlines = [w.deadline if w.ready else w.start_deadline for w in self._workers]
                timeout = max(0.0, min(deadlines, default=math.inf) - now)
                ready = set(mpc.wait(waitables, None if math.isinf(timeout) else timeout))
                if self._wake_r in ready:
                    # Drain first, then clear: a submit that lands in between saw the flag still set
                    # and sent no byte, but its task is already queued and the next _assign_tasks
                    # (top of the loop, before waiting again) takes it. Clearing before draining would
                    # lose such wake-ups: the flag would stay set with no byte left, and later submits
                    # would sleep.
                    while self._wake_r.poll():
                        self._wake_r.recv_bytes()
                    with self._lock:
                        self._wake_pending = False
                for w in list(self._workers):
                    self._service(w, ready)
        except BaseException as e:  # a bug here must not leave callers waiting forever
            logger.exception("reward pool dispatcher crashed")
            with self._lock:
                self._broken = f"reward pool dispatcher crashed: {type(e).__name__}: {e}"
        finally:
            self._shutdown()

    def _assign_tasks(self) -> None:
        """Give each idle worker the next queued task that can be sent to it (a task that cannot is finished
        with an error, and the worker takes the next one: none may be left queued with a worker idle)."""
        for w in self._workers:
            while w.ready and w.task is None:
                with self._lock:
                    task = self._queue.popleft() if self._queue else None
                if task is None:
                    return
                # (a task put back after a failed send is running already)
                if not task.future.running() and not task.future.set_running_or_notify_cancel():
                    continue  # cancelled by the caller while queued
                try:
                    w.conn.send((task.task_id, task.completion, task.answer, task.info, task.verifier_only))
                except (BrokenPipeError, OSError):
                    with self._lock:
                        self._queue.appendleft(task)  # the worker is gone; _service replaces it
                    break
                except Exception as e:  # the message does not pickle (an info value): the sample fails, not the pool
                    self._finish(task, 0.0, f"cannot send the sample to a reward worker: {type(e).__name__}: {e}",
                                 0.0, errors=1)
                    continue
                w.task, w.sent_at, w.deadline = task, time.monotonic(), time.monotonic() + self.timeout_s

    def _service(self, w: _Worker, ready: set) -> None:
        if w.conn in ready or w.process.sentinel in ready:
            try:
                while w.conn.poll():
                    self._on_message(w, w.conn.recv())
            except (EOFError, OSError):
                pass
            if not w.process.is_alive():
                self._on_death(w)
                return
        now = time.monotonic()
        if w.task is not None and now >= w.deadline:
            task, w.task = w.task, None
            self._replace(w)
            self._finish(task, 0.0, f"timeout after {self.timeout_s:g}s", now - w.sent_at, timeouts=1)
        elif not w.ready and now >= w.start_deadline:
            w.load_error = f"worker did not start within {self._start_timeout_s:g}s"
            self._replace(w, start_failed=True)

    def _on_message(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
            self._start_failures = 0
        elif kind == "load_error":
            w.load_error = msg[1]
        elif kind == "result":
            _, task_id, reward, error, elapsed, terms = msg
            task = w.task
            if task is None or task.task_id != task_id:
                return  # a late answer for a task already timed out; cannot happen after a kill
            w.task, w.deadline = None, math.inf
            self._finish(task, reward, error, elapsed, terms, errors=int(error is not None))

    def _on_death(self, w: _Worker) -> None:
        code = w.process.exitcode
        if w.task is not None:
            task, w.task = w.task, None
            self._replace(w)
            with self._lock:
                self._bump(worker_deaths=1)
            elapsed = time.monotonic() - w.sent_at
            self._finish(task, 0.0, f"reward worker died (exit code {code}) while scoring it", elapsed, errors=1)
        elif not w.ready:
            w.load_error = w.load_error or (
                f"worker exited with code {code} before it was ready (its stderr says why; a script that "
                "creates a RewardPool must do so under `if __name__ == '__main__':`, as 'spawn' re-imports it)"
            )
            self._replace(w, start_failed=True)
        else:
            with self._lock:
                self._bump(worker_deaths=1)
            self._replace(w)

    def _replace(self, w: _Worker, *, start_failed: bool = False) -> None:
        w.stop(graceful=False)
        self._workers.remove(w)
        if start_failed:
            self._start_failures += 1
            if self._start_failures >= MAX_CONSECUTIVE_START_FAILURES:
                self._break(
                    f"reward workers for spec {self.spec!r} failed to start {self._start_failures} times in a "
                    f"row; last error: {w.load_error}"
                )
                return
        with self._lock:
            closed = self._closed
        if not closed:
            self._spawn_worker()

    def _break(self, reason: str) -> None:
        with self._lock:
            self._broken = reason
            pending = list(self._queue)
            self._queue.clear()
        for task in pending:  # (a task put back after a failed send is already running)
            if not task.future.done() and (task.future.running() or task.future.set_running_or_notify_cancel()):
                task.future.set_exception(RewardPoolError(reason))

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
        reason = self._broken or "RewardPool was closed before this sample was scored"
        for task in pending + [w.task for w in self._workers if w.task is not None]:
            if not task.future.done() and (task.future.running() or task.future.set_running_or_notify_cancel()):
                task.future.set_exception(RewardPoolError(f"sample {task.sample_id!r}: {reason}"))
        for w in self._workers:
            w.stop(graceful=w.task is None)  # a busy worker may be stuck: do not wait for it
        self._workers.clear()
        self._wake_r.close()
        self._wake_w.close()
