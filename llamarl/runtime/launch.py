"""Starting executors: the ``Runtime`` the controller holds, for local spawn and for torchrun.

Two ways to get processes, one way to use them::

    async def main(rt: Runtime):
        trainer, = rt.spawn_role("trainer", "llamarl.executors.trainer:TrainerExecutor", init_kwargs=...)
        gens = rt.spawn_role("generator", "llamarl.executors.generator:GeneratorExecutor", init_kwargs=...)
        ...                                   # await trainer.acall(...), etc.
    result = run(layout, main)                # what train.py does

* Local (default): the controller is this process; ``spawn_role`` starts each group of the layout with
  ``ExecutorGroup.spawn`` (CPU ranks forked from a preloaded fork server, CUDA ranks spawned: never a
  plain fork of the controller; ``starting.py``).
* torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set): every process runs the same
  script. ``run`` on global rank 0 becomes the controller: it opens a TCP listener (random authkey; its
  handshakes run one per connection, so a stray client cannot stop the ranks: ``admission.py``)
  and publishes ``host:port:authkey`` under ``llamarl/controller`` in the ``TCPStore`` at
  MASTER_ADDR:MASTER_PORT (hosted by rank 0, or by the torchrun agent when
  ``TORCHELASTIC_USE_AGENT_STORE=True``). Every other rank reads its role from the same ``Layout``,
  connects back, says hello (global rank, layout, a free port for its group's rendezvous) and waits;
  ``spawn_role`` then sends each waiting rank its bootstrap, exactly what a local rank receives. ``run``
  on those ranks serves commands until the controller closes them and then exits the process, so code
  after ``run`` executes on the controller only. A layout that disagrees with WORLD_SIZE, or with
  another rank's layout, is rejected before any executor starts.
* Shared rank 0: WORLD_SIZE may also be the executor count alone (``--nproc-per-node 4`` for a 2-rank
  trainer and 2 generator ranks). Torchrun rank r then serves layout rank r + 1, and rank 0, besides
  being the controller, starts layout rank 1 as a child process (multiprocessing "spawn") that joins
  exactly like a torchrun rank and exits with it (``layout_rank``).

Faults: ``Runtime.supervise`` runs the controller coroutine against every group's ``failed`` future; the
first dead executor cancels the coroutine (or the coroutine fails with that death, seen through a call),
the other groups are shut down at once and ``ExecutorDied`` (naming the group, rank and exit status) is
raised, so the entry point can exit non-zero with that message.
Nothing outlives the Runtime: ``shutdown`` runs on context exit, in ``run``'s ``finally`` and at exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import queue
import secrets
import socket
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable, TypeVar

from llamarl._procs import exit_when_parent_dies, ignore_sigint
from llamarl.runtime import server
from llamarl.runtime.admission import Door, knock
from llamarl.runtime.executor import ExecutorGroup, FailureCallback, RankLink
from llamarl.runtime.futures import retrieve
from llamarl.runtime.net import free_port, routable_address
from llamarl.runtime.placement import CONTROLLER, GroupPlacement, Layout, LayoutError
from llamarl.runtime.rpc import BOOTSTRAP_ID, CLOSE, Bootstrap, Call, ExecutorDied, send

T = TypeVar("T")
STORE_KEY = "llamarl/controller"


@dataclass(frozen=True)
class TorchrunEnv:
    """The variables torchrun sets for every rank."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def detect(cls, environ: dict[str, str] | None = None) -> TorchrunEnv | None:
        """The torchrun environment of this process, or None when not launched by torchrun."""
        env = os.environ if environ is None else environ
        keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if not all(k in env for k in keys):
            return None
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        except ValueError as exc:
            raise RuntimeError(f"malformed torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_PORT must be "
                               f"integers): {exc}") from None


def controller_shares_rank0(layout: Layout, tr: TorchrunEnv) -> bool:
    """Whether torchrun started only the executors (rank 0 also hosts the controller) rather than one
    process more for the controller; any other WORLD_SIZE is a LayoutError."""
    if tr.world_size == layout.world_size:
        return False
    if tr.world_size == layout.world_size - 1:
        return True
    raise LayoutError(f"layout {layout.spec} has {layout.world_size - 1} executor ranks: start torchrun with "
                      f"WORLD_SIZE={layout.world_size - 1} (rank 0 also hosts the controller) or "
                      f"{layout.world_size} (one more process for the controller), not {tr.world_size}")


def layout_rank(layout: Layout, tr: TorchrunEnv) -> int:
    """The layout's global rank that torchrun rank ``tr.rank`` serves (0: the controller)."""
    return tr.rank + 1 if controller_shares_rank0(layout, tr) and tr.rank > 0 else tr.rank


@dataclass(frozen=True)
class Hello:
    """First message of a torchrun executor rank to the controller."""

    global_rank: int
    local_rank: int
    layout: str
    hostname: str
    rendezvous_port: int
    num_cuda_devices: int
    cuda_uuids: tuple[str, ...] = ()  # the visible GPUs' UUIDs, in index order ("" where torch gives none)


class Runtime:
    """Owns every executor group of a run; the controller's single handle to processes.

    ``Runtime(layout)`` in this process spawns locally; ``Runtime(layout, torchrun=env)`` (what ``run``
    does on global rank 0 under torchrun) attaches to the ranks torchrun started.
    """

    def __init__(self, layout: Layout | None = None, *, torchrun: TorchrunEnv | None = None,
                 env: dict[str, str] | None = None, dist_timeout_s: float = 600.0,
                 start_timeout_s: float = 600.0, on_failure: FailureCallback | None = None,
                 command_timeout_s: float = 0.0):
        self.layout = layout
        self.env = dict(env or {})
        self.dist_timeout_s, self.start_timeout_s = dist_timeout_s, start_timeout_s
        self.command_timeout_s = command_timeout_s  # every group's (ExecutorGroup: hang detection)
        self.groups: dict[str, ExecutorGroup] = {}
        self.failed: Future = Future()  # raises the first ExecutorDied of any group
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._torchrun = torchrun
        self._waiting: dict[int, tuple[Connection, Hello, str]] = {}
        self._door: Door | None = None
        self._store = None
        self._child = None  # the process serving layout rank 1 when torchrun's rank 0 is shared
        if torchrun is not None:
            if layout is None:
                raise LayoutError("a torchrun Runtime needs the Layout that assigns roles to ranks")
            self._attach(torchrun)

    # ---------------------------------------------------------------- groups
    def spawn(self, name: str, target: str, world_size: int = 1, **kwargs: Any) -> ExecutorGroup:
        """Start an ad-hoc local group (see ``ExecutorGroup.spawn``); not available under torchrun."""
        if self._torchrun is not None:
            raise LayoutError(f"under torchrun only the layout's groups exist ({self._group_names()}); "
                              f"use spawn_role/spawn_group instead of spawn('{name}')")
        self._check_new(name)
        kwargs.setdefault("env", self.env)
        kwargs.setdefault("dist_timeout_s", self.dist_timeout_s)
        kwargs.setdefault("start_timeout_s", self.start_timeout_s)
        kwargs.setdefault("command_timeout_s", self.command_timeout_s)
        group = ExecutorGroup.spawn(name, target, world_size, on_failure=self._record_failure, **kwargs)
        self.groups[name] = group
        return group

    def spawn_role(self, role: str, target: str, *, init_kwargs: dict | None = None,
                   env: dict[str, str] | None = None, wait: bool = True) -> list[ExecutorGroup]:
        """Start every group of ``role`` in the layout (all replicas at once); returns them in order.

        With ``wait=False`` it returns at once, so several roles can start in parallel; then call
        ``wait_ready()`` before using them.
        """
        placements = self._require_layout().groups_of(role)
        started = [self._start_group(p, target, init_kwargs, env) for p in placements]
        if wait:
            self.wait_ready(started)
        return started

    def wait_ready(self, groups: list[ExecutorGroup] | None = None) -> None:
        """Wait until ``groups`` (default: all) have constructed their executors; on any error stop them
        all and raise it."""
        groups = list(self.groups.values()) if groups is None else groups
        with _all_or_none(groups):
            for group in groups:
                group.wait_ready(self.start_timeout_s)

    async def await_ready(self, groups: list[ExecutorGroup] | None = None) -> None:
        """``wait_ready`` from the controller's event loop, which keeps running while the ranks start: a
        Ctrl-C stops the run at once instead of after the slowest rank's start (seconds on a GPU)."""
        groups = list(self.groups.values()) if groups is None else groups
        with _all_or_none(groups):
            for group in groups:
                await group.await_ready(self.start_timeout_s)

    def spawn_group(self, name: str, target: str, *, init_kwargs: dict | None = None,
                    env: dict[str, str] | None = None) -> ExecutorGroup:
        """Start the layout's group ``name`` (e.g. "generator.1")."""
        group = self._start_group(self._require_layout().group(name), target, init_kwargs, env)
        self.wait_ready([group])
        return group

    def _start_group(self, p: GroupPlacement, target: str, init_kwargs: dict | None,
                     env: dict[str, str] | None) -> ExecutorGroup:
        self._check_new(p.name)
        layout = self._require_layout()
        merged_env = {**self.env, **(env or {})}
        if self._torchrun is None:
            devices = self._local_devices(p)
            group = ExecutorGroup.spawn(p.name, target, p.world_size, init_kwargs=init_kwargs, env=merged_env,
                                        backend=group_backend(p, devices), devices=devices, role=p.role,
                                        global_ranks=p.global_ranks,
                                        dist_timeout_s=self.dist_timeout_s, on_failure=self._record_failure,
                                        wait_ready=False, command_timeout_s=self.command_timeout_s)
        else:
            links, boots = [], []
            with self._lock:
                members = [self._waiting.pop(r) for r in p.global_ranks]
            master_addr, master_port = members[0][2], members[0][1].rendezvous_port
            cudas = [layout.cuda_device(hello.global_rank, hello.num_cuda_devices, hello.local_rank)
                     for _, hello, _ in members]
            devices = ["cpu" if cuda is None else f"cuda:{cuda}" for cuda in cudas]
            uuids = [hello.cuda_uuids[cuda] if cuda is not None and cuda < len(hello.cuda_uuids) else ""
                     for cuda, (_, hello, _) in zip(cudas, members)]
            backend = group_backend(p, devices, hosts=[hello.hostname for _, hello, _ in members], uuids=uuids)
            for rank, (conn, hello, _) in enumerate(members):
                links.append(RankLink(conn))
                boots.append(Bootstrap(group=p.name, role=p.role, target=target, init_kwargs=dict(init_kwargs or {}),
                                       rank=rank, world_size=p.world_size, global_rank=hello.global_rank,
                                       master_addr=master_addr, master_port=master_port, backend=backend,
                                       device=devices[rank],
                                       dist_timeout_s=self.dist_timeout_s, env=merged_env,
                                       command_timeout_s=self.command_timeout_s))
            group = ExecutorGroup(p.name, links, role=p.role, on_failure=self._record_failure,
                                  command_timeout_s=self.command_timeout_s)
            try:
                group._bootstrap(boots)
            except BaseException:
                group.shutdown(timeout=2.0)
                raise
        self.groups[p.name] = group
        return group

    def _local_devices(self, p: GroupPlacement) -> list[str]:
        if not p.on_accelerator:
            return ["cpu"] * p.world_size
        import torch

        n = torch.cuda.device_count()
        layout = self._require_layout()
        return [f"cuda:{layout.cuda_device(r, n)}" for r in p.global_ranks]

    def _check_new(self, name: str) -> None:
        if name in self.groups:
            raise ValueError(f"an executor group named '{name}' already exists in this runtime")

    def _require_layout(self) -> Layout:
        if self.layout is None:
            raise LayoutError("this Runtime has no Layout; pass Runtime(layout) to use spawn_role/spawn_group")
        return self.layout

    def _group_names(self) -> str:
        return ", ".join(g.name for g in self._require_layout().groups)

    # ---------------------------------------------------------------- failures
    def _record_failure(self, group: ExecutorGroup, death: ExecutorDied) -> None:
        try:
            self.failed.set_exception(death)
        except Exception:  # noqa: BLE001 - only the first failure is recorded
            return
        if self._on_failure is not None:
            self._on_failure(group, death)

    async def supervise(self, main: Awaitable[T]) -> T:
        """Await ``main``; if an executor dies first, cancel it, stop every group and raise ExecutorDied."""
        loop = asyncio.get_running_loop()
        died: asyncio.Future = loop.create_future()

        def forward(f: Future) -> None:
            if f.exception() is not None:
                try:
                    loop.call_soon_threadsafe(lambda: died.done() or died.set_exception(f.exception()))
                except RuntimeError:
                    pass  # the loop has finished: nobody is supervising any more

        self.failed.add_done_callback(forward)
        task = asyncio.ensure_future(main)
        try:
            await asyncio.wait({task, died}, return_when=asyncio.FIRST_COMPLETED)
            if died.done() and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if died.done() or _ended_by_death(task):
                # The controller may have failed too, typically with the same death seen through a call
                # (both can be done by now, in either order): the death is what we report; mark the task's
                # error as retrieved so asyncio does not print "Task exception was never retrieved" for it.
                retrieve(task)
                self.shutdown(timeout=2.0)  # in-flight commands of the others are abandoned, not awaited
                raise died.exception() if died.done() else task.exception()
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            retrieve(task)  # e.g. it failed while this coroutine was being cancelled (Ctrl-C)
            if not died.done():
                died.cancel()
            retrieve(died)  # a death that arrived while we were already unwinding for another reason

    # ---------------------------------------------------------------- shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every group (in parallel), release the listener; idempotent."""
        groups = list(self.groups.values())
        threads = [threading.Thread(target=g.shutdown, args=(timeout,)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._lock:
            waiting = list(self._waiting.values())
            self._waiting.clear()
        for conn, _, _ in waiting:  # torchrun ranks never given a role: tell them to exit cleanly
            try:
                send(conn, Call(BOOTSTRAP_ID, CLOSE, (), {}))
            except OSError:
                pass
            conn.close()
        if self._door is not None:
            self._door.close()
            self._door = None
        if self._child is not None:  # layout rank 1 under a shared rank 0: it exits once its link closed
            self._child.join(timeout)
            if self._child.is_alive():
                self._child.terminate()
                self._child.join(5.0)
            self._child = None
        if not self.failed.done():
            self.failed.set_result(None)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- torchrun attach (rank 0)
    def _attach(self, tr: TorchrunEnv) -> None:
        layout = self._require_layout()
        shared = controller_shares_rank0(layout, tr)
        if tr.rank != 0:
            raise LayoutError(f"the controller runs on global rank 0, not rank {tr.rank}")
        authkey = secrets.token_bytes(32)
        arrivals: queue.SimpleQueue = queue.SimpleQueue()
        self._door = Door(authkey, arrivals)
        host = routable_address(tr.master_addr)
        port = self._door.port
        self._store = _store(tr, self.start_timeout_s, host=os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "")
                             .lower() != "true")
        self._store.set(STORE_KEY, f"{host}:{port}:{authkey.hex()}")
        if shared:  # layout rank 1 runs in a child of this process, which joins like a torchrun rank
            import multiprocessing as mp

            self._child = mp.get_context("spawn").Process(
                target=_serve_layout_rank, args=(layout, tr, 1, self.start_timeout_s), name="llamarl-rank1",
                daemon=False)
            self._child.start()
        expected = set(range(1, layout.world_size))
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.start_timeout_s)
        try:
            while expected - set(self._waiting):
                left = (deadline - datetime.datetime.now()).total_seconds()
                try:
                    item = arrivals.get(timeout=max(0.01, left))
                except queue.Empty:
                    missing = sorted(expected - set(self._waiting))
                    raise TimeoutError(f"torchrun ranks {missing} did not connect to the controller within "
                                       f"{self.start_timeout_s} s") from None
                if isinstance(item, Exception):
                    raise RuntimeError(f"accepting torchrun executor ranks failed: {item}") from item
                conn, hello, peer = item
                if (not isinstance(hello, Hello) or hello.global_rank not in expected
                        or hello.global_rank in self._waiting):
                    conn.close()
                    raise RuntimeError(f"unexpected hello from {peer}: {hello!r}")
                if hello.layout != layout.spec:
                    conn.close()
                    raise LayoutError(f"rank {hello.global_rank} runs layout {hello.layout} but the controller "
                                      f"runs {layout.spec}; start every rank with the same --layout")
                self._waiting[hello.global_rank] = (conn, hello, peer)
        except BaseException:
            self.shutdown()
            raise


def _ended_by_death(task: asyncio.Future) -> bool:
    """True if the controller task failed with an executor death (seen through a call before ``failed``)."""
    return task.done() and not task.cancelled() and isinstance(task.exception(), ExecutorDied)


def _store(tr: TorchrunEnv, timeout_s: float, *, host: bool = False):
    """The job's TCPStore at MASTER_ADDR:MASTER_PORT; ``host``: this process serves it (the controller,
    unless the torchrun agent does)."""
    from torch.distributed import TCPStore

    return TCPStore(tr.master_addr, tr.master_port, world_size=None, is_master=host,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _serve_layout_rank(layout: Layout, tr: TorchrunEnv, global_rank: int, timeout_s: float) -> None:
    """Entry point of the child that serves layout rank ``global_rank`` for a shared torchrun rank 0; it
    exits by itself if rank 0 (its parent, the controller) dies, even before its connection is up."""
    exit_when_parent_dies(server.hard_exit)
    sys.exit(serve_torchrun(layout, tr, timeout_s=timeout_s, global_rank=global_rank))


def serve_torchrun(layout: Layout, tr: TorchrunEnv, *, timeout_s: float = 600.0,
                   global_rank: int | None = None) -> int:
    """Executor side under torchrun: connect to the controller, get a bootstrap, serve; returns exit code.
    ``global_rank``: the layout rank served (default ``layout_rank(layout, tr)``)."""
    global_rank = layout_rank(layout, tr) if global_rank is None else global_rank
    assignment = layout.assignment(global_rank)
    if assignment.role == CONTROLLER:
        raise LayoutError("global rank 0 is the controller; call run() rather than serve_torchrun()")
    # as a locally spawned rank: Ctrl-C (to the whole job) is the controller's to handle; it then closes
    # this rank between commands, instead of the interrupt landing in the middle of one (a checkpoint write)
    ignore_sigint()
    store = _store(tr, timeout_s)
    store.wait([STORE_KEY], datetime.timedelta(seconds=timeout_s))
    host, port, key = store.get(STORE_KEY).decode().rsplit(":", 2)
    conn = knock(host, int(port), bytes.fromhex(key))
    uuids = visible_gpu_uuids()
    send(conn, Hello(global_rank, tr.local_rank, layout.spec, socket.gethostname(), free_port(), len(uuids), uuids))
    del store
    return server.serve(conn)


@contextlib.contextmanager
def _all_or_none(groups: list[ExecutorGroup]):
    """Stop every group of ``groups`` when the block raises (or is cancelled), then re-raise."""
    try:
        yield
    except BaseException:
        for group in groups:
            group.shutdown(timeout=2.0)
        raise


def run(layout: Layout, main: Callable[[Runtime], Awaitable[T]], *, env: dict[str, str] | None = None,
        dist_timeout_s: float = 600.0, start_timeout_s: float = 600.0, torchrun: bool | None = None,
        command_timeout_s: float = 0.0) -> T:
    """Run the controller ``main(runtime)`` (async) with executors placed by ``layout``; return its result.

    ``command_timeout_s`` > 0 makes a command that runs longer fail the run as ``ExecutorHung`` (with the
    hung ranks' Python stacks on stderr). ``torchrun=None`` detects torchrun from the environment. Under
    torchrun, ranks other than 0 serve and then exit the process (``SystemExit``) with 0 after a clean
    close, 1 otherwise.
    """
    tr = TorchrunEnv.detect() if torchrun in (None, True) else None
    if torchrun is True and tr is None:
        raise RuntimeError("torchrun=True but RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are not set")
    if tr is not None and tr.rank != 0:
        sys.exit(serve_torchrun(layout, tr, timeout_s=start_timeout_s))
    with Runtime(layout, torchrun=tr, env=env, dist_timeout_s=dist_timeout_s,
                 start_timeout_s=start_timeout_s, command_timeout_s=command_timeout_s) as rt:
        return asyncio.run(rt.supervise(main(rt)))


def visible_gpu_uuids() -> tuple[str, ...]:
    """This process's visible GPUs' UUIDs in index order ("" where torch does not give one); () without CUDA."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return tuple(str(getattr(torch.cuda.get_device_properties(i), "uuid", "") or "") for i in range(count))


def group_backend(p: GroupPlacement, devices: list[str], hosts: list[str] | None = None,
                  uuids: list[str] | None = None) -> str:
    """The group's backend for the devices its ranks landed on (on ``hosts``, by name; None: all on this one).
    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"); such a group (a sharded
    trainer or a TP generator on a machine with fewer GPUs than ranks) runs its collectives over gloo instead,
    which stages CUDA tensors through host memory: slower, and said so on stderr, but the same program and
    numerics. A GPU is named by its UUID when every rank of the group reported one (``uuids``, torchrun
    ranks): ranks that each see one GPU through their own CUDA_VISIBLE_DEVICES all say ``cuda:0``, yet use
    different GPUs. Otherwise by (host, ``cuda:i``): ``cuda:0`` on two hosts is two GPUs."""
    if uuids is not None and all(uuids):
        gpus: list = list(uuids)
    else:
        gpus = list(zip(hosts, devices)) if hosts is not None else devices
    if p.backend != "nccl" or len(set(gpus)) == len(gpus):
        return p.backend
    print(f"[llamarl] executor group '{p.name}': {len(devices)} ranks on {len(set(gpus))} GPU(s) "
          f"({', '.join(devices)}); NCCL needs one GPU per rank, so this group's collectives use gloo "
          "(host-staged)", file=sys.stderr, flush=True)
    return "gloo"
