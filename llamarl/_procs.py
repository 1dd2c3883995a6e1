"""Child-process hygiene shared by executor ranks (llamarl.runtime) and reward workers (llamarl.rewards).

* ``sigint_blocked()``: the parent blocks SIGINT around ``process.start()``, so the child starts with it
  blocked; the child sets SIGINT to ignored, then unblocks it (``ignore_sigint()``). Ctrl-C belongs to the
  controller, and one that arrives while the child is still importing modules is discarded there instead
  of interrupting it with a KeyboardInterrupt traceback.
* ``exit_when_parent_dies()``: a daemon thread ends the child once its parent is gone, however the parent
  died (SIGKILL included) and whatever the main thread is stuck in (an import, a rendezvous, a hanging
  user function): nobody would read its results any more.
* ``set_process_name()``: what ``ps`` and ``top`` show for the process (an executor rank's role and rank).

Imports nothing heavy (reward workers start fast).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker
from multiprocessing.connection import wait
from typing import Callable

PARENT_POLL_S = 1.0  # how often the parent watch also compares getppid() with the parent's pid


@contextlib.contextmanager
def sigint_blocked():
    """Block SIGINT in the calling thread while the body runs (a process started meanwhile inherits the
    mask); the previous mask is restored however the body ends. A Ctrl-C that arrives meanwhile is not
    lost: another thread takes it, or it stays pending here until the mask is restored."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # Starting a process with "spawn" first makes sure multiprocessing's resource tracker runs, and
    # launching the tracker *unblocks* SIGINT in the calling thread: launch it now, before blocking.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_sigint() -> None:
    """In a child started under ``sigint_blocked``: ignore SIGINT, then unblock it (a pending Ctrl-C from
    the start-up is discarded, not raised)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def exit_when_parent_dies(on_exit: Callable[[int], None] | None = None, poll_s: float = PARENT_POLL_S,
                          name: str = "llamarl-parent-watch") -> None:
    """Start a daemon thread that ends this process with exit code 1 once its parent process is gone.

    The parent's end is noticed at once through ``multiprocessing.parent_process().sentinel`` (a pipe the
    parent holds open until it exits) and, as a fallback (no sentinel, or a copy of the parent's end held
    by someone else), within ``poll_s`` by ``os.getppid()`` changing: the OS parent is the parent itself
    for a spawned child, or the fork server it started (which exits with it) for a forked one.
    ``on_exit(1)`` (e.g. a flush-then-``os._exit``) runs in its own thread, with ``os._exit(1)`` 2 s later
    should it block; without it the process ends at once.
    """
    parent = mp.parent_process()
    sentinel = getattr(parent, "sentinel", None) if parent is not None else None
    parent_pid = os.getppid()

    def watch() -> None:
        while os.getppid() == parent_pid:
            if sentinel is None:
                time.sleep(poll_s)
                continue
            try:
                if wait([sentinel], timeout=poll_s):
                    break
            except (OSError, ValueError):  # the sentinel was closed under us: fall back to polling
                time.sleep(poll_s)
        if on_exit is not None:
            threading.Thread(target=on_exit, args=(1,), daemon=True).start()
            time.sleep(2.0)
        os._exit(1)

    threading.Thread(target=watch, name=name, daemon=True).start()


def set_process_name(name: str) -> None:
    """Name this process for ``ps``, ``top`` and /proc/PID/comm (e.g. "generator-0"; at most 15 bytes are
    kept). A forked executor rank would otherwise show its fork server's name; Linux only, a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def describe_exit(exitcode: int | None) -> str:
    """Human wording of a process exit status: 'exit code 3', 'killed by SIGKILL', 'connection lost'."""
    if exitcode is None:
        return "connection lost"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
