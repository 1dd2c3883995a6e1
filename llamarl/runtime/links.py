"""The controller's end of each executor rank: its connection and process, and how they are stopped.

``RankLink`` is what an ``ExecutorGroup`` holds per rank (``executor.py``): the connection, the local
process (None for a torchrun rank on another host), the calls sent to that rank and not yet answered,
in the order they were sent (dict insertion order; a rank answers in that order, ``rpc.py``), and the
``FrameReader`` the monitor reads replies with (``frames.py``).
Starting: ``check_spawn_args`` refuses bad arguments before any process starts; ``child_environment``
puts variables in a spawned child's environment from its first instruction. Stopping: ``kill_all`` stops
local processes (SIGTERM, a grace period, SIGKILL, reap); ``disconnect`` makes a remote rank exit by
dropping its connection.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Sequence

from llamarl.runtime.frames import FrameReader


@dataclass
class RankLink:
    """The controller's end of one rank: its connection and, for local ranks, its process."""

    conn: Connection
    process: BaseProcess | None = None
    pending: dict[int, tuple[str, Future]] = field(default_factory=dict)  # call id -> (method, future), sent order
    open: bool = True
    busy_since: float | None = None  # monotonic time the rank could start its oldest pending command
    # held around every join/poll of ``process``: a forked rank's exit status is read once from the fork server's
    # pipe, so two threads reaping it at once leave one of them an EOF, recorded as exit code 255
    reap_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # the monitor reads replies through it: whole messages only, so a rank stalled mid-reply never blocks it
    reader: FrameReader = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.reader = FrameReader(self.conn)

    def close(self) -> None:
        """Close the connection and the reader's descriptor (the peer reads end of file once both are)."""
        self.reader.close()
        self.conn.close()

    def join(self, timeout: float | None) -> int | None:
        """Wait up to ``timeout`` s for the local process to end; its exit code (None: running, or remote)."""
        if self.process is None:
            return None
        with self.reap_lock:
            self.process.join(timeout=timeout)
            return self.process.exitcode

    def running(self) -> bool:
        if self.process is None:
            return False
        with self.reap_lock:
            return self.process.exitcode is None and self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


def check_spawn_args(name, target, world_size, init_kwargs, env, backend, devices) -> None:
    """Refuse bad ``ExecutorGroup.spawn`` arguments with messages that name the group, before any process starts."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"executor group name must be a non-empty string, got {name!r}")
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"executor group '{name}': target must be 'package.module:ClassName', got {target!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"executor group '{name}': world_size must be an integer >= 1, got {world_size!r}")
    if init_kwargs is not None and not isinstance(init_kwargs, dict):
        raise TypeError(f"executor group '{name}': init_kwargs must be a dict, got {type(init_kwargs).__name__}")
    if env is not None and not isinstance(env, dict):
        raise TypeError(f"executor group '{name}': env must be a dict of strings, got {type(env).__name__}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"executor group '{name}': backend must be 'gloo' or 'nccl', got {backend!r}")
    if devices is not None and len(devices) != world_size:
        raise ValueError(f"executor group '{name}': got {len(devices)} devices for {world_size} ranks")
    try:  # fail before starting any process
        pickle.dumps(init_kwargs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"init_kwargs/env of executor group '{name}' cannot be pickled: {exc}") from exc


_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def child_environment(env: dict[str, str]):
    """Temporarily add ``env`` to ``os.environ`` (a spawned child inherits it at exec time).

    Passing it this way, rather than setting it inside the child, makes it visible even to modules the
    child imports before our code runs (multiprocessing re-imports the parent's ``__main__`` module, which
    may import torch, and OpenMP reads ``OMP_NUM_THREADS`` when torch loads)."""
    with _ENVIRON_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def shutdown_socket(conn: Connection) -> None:
    """Shut the socket of ``conn`` down: wakes a thread blocked reading or sending on it, and the peer reads
    end of file (closing alone does neither while another thread is in a call on it)."""
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
    except OSError:
        pass  # not a socket, or already gone


def disconnect(link: RankLink) -> None:
    """Shut a remote rank's socket down, then close it: closing alone neither wakes a send blocked on it
    (a hung peer stopped reading) nor sends the peer its end of file while that send is in flight."""
    shutdown_socket(link.conn)
    link.close()


def kill_all(links: Sequence[RankLink], grace_s: float = 2.0) -> None:
    """SIGTERM every live local process, wait ``grace_s``, SIGKILL what is left, reap all."""
    live = [lk for lk in links if lk.running()]
    for lk in live:
        lk.process.terminate()
    deadline = time.monotonic() + grace_s
    for lk in live:
        lk.join(timeout=max(0.0, deadline - time.monotonic()))
    for lk in live:
        if lk.running():
            lk.process.kill()
            lk.join(timeout=5.0)
