"""How a local executor rank's process starts: forked from a preloaded server (CPU ranks) or spawned.

A spawned rank is a fresh interpreter that spends seconds of CPU before it does anything: importing
torch alone takes 2.5-3.5 s on a 2-core CPU, and every run starts a generator and a trainer at least
(the test suite starts hundreds). Ranks that work on the CPU therefore fork from multiprocessing's fork
server, a process that imported torch and the executor modules once (``PRELOAD`` plus what ``warm``
adds) and never used a CUDA device: such a rank is running its own code within milliseconds, with those
modules loaded. The server is per controller process and shared by every group it starts; it exits
with the controller. A forked rank's OS parent is the server: it exits when the controller does (the
parent watch of ``llamarl._procs``) and also when the server does.

Ranks on a CUDA device are spawned by default. Forking them from the server is allowed by CUDA (the server
never initialises the driver, which a forked process must not inherit) but not yet measured on a GPU;
``LLAMARL_START_METHOD=forkserver`` forks every rank, ``=spawn`` spawns every rank (e.g. to rule the
server out when debugging).

Environment: a spawned rank inherits the controller's environment as it is at the rank's start (with the
group's ``env`` added, ``links.child_environment``); a forked one would inherit the server's, frozen when
the server started. So a forked rank is sent the controller's current environment with the group's
variables, and its current stdout and stderr, and installs them first thing (``ForkedStart``,
``install``). Modules the server preloaded read their import-time variables when it started; of those,
``OMP_NUM_THREADS`` (read by OpenMP when torch loads) is applied again with ``torch.set_num_threads``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing import forkserver, reduction
from typing import Iterable, Sequence

from llamarl._procs import sigint_blocked

# torch._dynamo: constructing any torch.optim optimizer imports it (2-4 s on a 2-core CPU)
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "llamarl.runtime.server")
_lock = threading.Lock()
_extra: list[str] = []


def start_method(devices: Sequence[str]) -> str:
    """"forkserver" for a group whose ranks all work on the CPU (where the platform has it), else "spawn";
    ``LLAMARL_START_METHOD`` set to either one applies it to every group."""
    forced = forced_method()
    if forced == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    if forced == "forkserver":
        return "forkserver"
    return "forkserver" if all(str(d).startswith("cpu") for d in devices) else "spawn"


def forced_method() -> str:
    """``LLAMARL_START_METHOD`` ("" when unset); ValueError naming the choices for any other value
    (``llamarl.config_env`` turns it into a configuration error before anything starts)."""
    forced = os.environ.get("LLAMARL_START_METHOD", "")
    if forced not in ("", "spawn", "forkserver"):
        raise ValueError(f"LLAMARL_START_METHOD={forced!r}: use 'spawn' (every rank a fresh interpreter), "
                         "'forkserver' (every rank forked from the preloaded server) or leave it unset (CPU ranks "
                         "forked, CUDA ranks spawned)")
    return forced


def warm(modules: Iterable[str] = ()) -> None:
    """Have the fork server import ``modules`` too, and start it now in the background, so its imports
    overlap the controller's own start-up instead of delaying the first rank. Without effect once the
    server runs (modules it lacks are then imported by each rank), and when ranks are always spawned."""
    if start_method(["cpu"]) == "forkserver":
        _ensure_running(modules)


def server_exited() -> int | None:
    """The fork server's pid if it has exited (every rank it forked then exits too, and multiprocessing reports
    their status as 255: it cannot wait for processes that are not its children), else None. Read from /proc,
    without reaping it (multiprocessing's ``ensure_running`` does, to start a new one)."""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return pid  # gone (reaped), or no /proc to tell: only called after a forked rank was lost
    return pid if state in ("Z", "X") else None


def lost_rank_cause(process, exitcode: int | None) -> str:
    """For a rank forked by the fork server whose status reads 255 (multiprocessing's placeholder when the
    server cannot report it) while the server itself has exited: the server's death as the cause ("" else)."""
    if exitcode != 255 or getattr(process, "_start_method", None) != "forkserver":
        return ""
    for _ in range(50):  # its ranks can notice its death (their parent watch) before it has finished exiting
        pid = server_exited()
        if pid is not None:
            break
        time.sleep(0.02)
    else:
        return ""
    return (f"exit status unknown: the fork server (pid {pid}) that started the CPU ranks has exited, and every rank "
            "it forked exits with it")


def context(method: str, target_module: str) -> mp.context.BaseContext:
    """The multiprocessing context for ``method``; for "forkserver" the server is started (preloading
    ``target_module`` as well) if it is not running yet."""
    if method == "forkserver":
        _ensure_running([target_module])
    return mp.get_context(method)


def _ensure_running(modules: Iterable[str]) -> None:
    """Add ``modules`` to the server's preload list, then start the server if it is not running."""
    with _lock:
        _extra.extend(m for m in modules if m not in _extra and m not in PRELOAD)
        # the preload list is read when the server starts; it is a process-wide setting of multiprocessing
        forkserver.set_forkserver_preload([*PRELOAD, *_extra])
        # Started with SIGINT blocked, the server keeps that mask for life and every rank it forks
        # inherits it: a Ctrl-C while a rank still re-imports the controller's __main__ (multiprocessing's
        # preparation, before the rank's code runs) stays pending until the rank ignores SIGINT
        # (server.child_main), as for a spawned rank, instead of raising KeyboardInterrupt there.
        with sigint_blocked():
            forkserver.ensure_running()


class ForkedStart:
    """What a forked rank takes over from the controller as the controller is at the rank's start: the
    environment and the stdout/stderr descriptors. A spawned rank inherits both at exec; a forked one
    would otherwise have the server's, fixed when the server started (a test's output capture, a log
    file the controller has since redirected to). Other process attributes (umask, resource limits) are
    the server's, i.e. the controller's when the server started."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)

    def __reduce__(self):
        # pickled while the rank is being started: DupFd hands the descriptors to the new process
        fds = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return _received, (self.environ, *fds)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _received(environ: dict[str, str], stdout, stderr) -> tuple[dict[str, str], list[int | None]]:
    return environ, [None if d is None else d.detach() for d in (stdout, stderr)]


def for_child(method: str) -> ForkedStart | None:
    """The extra argument of a rank started with ``method``: a ``ForkedStart`` for a forked rank (create it
    inside ``child_environment``, so the group's variables are in it), None for a spawned one."""
    return ForkedStart() if method == "forkserver" else None


def install(received: tuple[dict[str, str], list[int | None]] | None) -> None:
    """In a forked rank, first thing: take over the controller's stdout/stderr, make ``os.environ`` exactly
    the controller's, and apply an ``OMP_NUM_THREADS`` that differs from the one torch loaded under.
    ``received`` is the unpickled ``ForkedStart`` (None, for a spawned rank: nothing to do)."""
    if received is None:
        return
    environ, fds = received
    for target, fd in zip((1, 2), fds):
        if fd is not None:
            os.dup2(fd, target)
            os.close(fd)
    loaded_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(environ)
    threads = environ.get("OMP_NUM_THREADS")
    if threads != loaded_threads and threads and "torch" in sys.modules:
        try:
            count = int(threads)
        except ValueError:
            return  # OpenMP ignores a malformed value too
        if count > 0:
            sys.modules["torch"].set_num_threads(count)
