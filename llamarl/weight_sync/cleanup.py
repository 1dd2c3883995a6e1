"""Names and lifetime of the shared-memory segments this process owns.

Ownership rule: the process that creates a segment (a generator rank: its buckets and its replica's
control block) is its only owner and the only one that unlinks it; peers (trainer ranks) attach by name
and merely unmap. Unlinking removes the name from /dev/shm; mappings stay valid until dropped.

Every owned name is unlinked on each of these paths:
* ``close()`` of the owning object (normal shutdown);
* an ``atexit`` hook (a normal interpreter exit that forgot to close);
* a *reaper*: a tiny separate Python process (started once, lazily, per owner process) that is told
  each name over a pipe and unlinks whatever is still registered when the pipe reaches EOF - which the
  kernel guarantees when the owner dies, however it dies (exception, SIGTERM, SIGKILL, OOM killer).
  The reaper runs in its own session, so a Ctrl-C to the job's process group cannot kill it first.
  Caveat: a child created with plain ``fork`` (not spawn) inherits the pipe and delays the reaper until it
  exits too. Such a child owns nothing (``os.register_at_fork``): its exit never unlinks the parent's names.
* a *sweep* when a process first registers a segment: names of this PID namespace whose owner process
  no longer exists are unlinked (what is left when the owner and its reaper were killed together, e.g.
  ``pkill -9 python``). A live or reused PID keeps its segments (conservative: a leak, never a removal
  of a segment in use); other PID namespaces sharing /dev/shm (``--ipc=host`` containers) are not
  touched, since their PIDs mean nothing here.

Names are unique per run: ``/llamarl-<pid namespace>-<pid>-<counter>-<random hex>-<tag>``.
"""

from __future__ import annotations

import atexit
import itertools
import os
import secrets
import subprocess
import sys
import threading

from llamarl import _native

_REAPER = r"""
import sys
try:
    from _posixshmem import shm_unlink
except ImportError:
    import os
    def shm_unlink(name):
        os.unlink("/dev/shm" + name)
names = set()
for line in sys.stdin:
    op, name = line[:1], line[1:].rstrip("\n")
    if op == "+":
        names.add(name)
    elif op == "-":
        names.discard(name)
for name in names:
    try:
        shm_unlink(name)
    except OSError:
        pass
"""

_lock = threading.Lock()
_owned: set[str] = set()
_reaper: subprocess.Popen | None = None
_counter = itertools.count()
_swept = False
SHM_DIR = "/dev/shm"


def _pid_namespace() -> str:
    """This process's PID namespace (the inode of /proc/self/ns/pid), or "x" where it cannot be read."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "x"


def unique_name(tag: str) -> str:
    """A fresh segment name: PID namespace + pid + counter + random, so concurrent runs and restarts never
    collide, and a later run can tell whether the owner is gone (``sweep_stale``)."""
    safe = "".join(c if c.isalnum() else "_" for c in tag)[:40]
    return f"/llamarl-{_pid_namespace()}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}-{safe}"


def sweep_stale() -> list[str]:
    """Unlink the segments of this PID namespace whose owner process is gone; returns their names.
    Without a readable namespace id (or /dev/shm) nothing is swept."""
    ns = _pid_namespace()
    if ns == "x":
        return []
    prefix = f"llamarl-{ns}-"
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return []
    swept = []
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _native.pid_alive(int(pid)):
            if _native.shm_unlink("/" + entry):
                swept.append("/" + entry)
    return swept


def _tell_reaper(line: str) -> None:
    global _reaper
    if _reaper is None or _reaper.poll() is not None:
        _reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, text=True,
        )
        for name in _owned:  # a restarted reaper must learn every live name
            _reaper.stdin.write(f"+{name}\n")
    _reaper.stdin.write(line + "\n")
    _reaper.stdin.flush()


def register(name: str) -> None:
    """Record a segment this process owns; it will be unlinked however the process ends.

    Call it *before* creating the segment (with a fresh ``unique_name``): then no moment exists at which
    the segment exists but is unknown to the reaper. Every unlink path tolerates a name that was never
    created (``release`` and the atexit hook via ``_native.shm_unlink``, which returns False on ENOENT;
    the reaper ignores ``OSError``), so a creation that fails or never happens costs nothing; call
    ``release(name)`` then to forget it. The first call in a process also runs ``sweep_stale``."""
    global _swept
    with _lock:
        if not _swept:
            _swept = True
            try:
                sweep_stale()
            except Exception:  # noqa: BLE001 - housekeeping of other runs' leftovers must not stop this one
                pass
        _owned.add(name)
        _tell_reaper("+" + name)


def release(name: str) -> None:
    """Unlink an owned segment now (idempotent) and forget it."""
    with _lock:
        if name in _owned:
            _owned.discard(name)
            if _reaper is not None and _reaper.poll() is None:
                try:
                    _reaper.stdin.write(f"-{name}\n")
                    _reaper.stdin.flush()
                except OSError:
                    pass
    _native.shm_unlink(name)


def owned() -> frozenset[str]:
    """Names this process currently owns (for tests and diagnostics)."""
    with _lock:
        return frozenset(_owned)


def reaper_pid() -> int | None:
    return None if _reaper is None else _reaper.pid


def _forget_in_child() -> None:
    """After os.fork: the child owns no segment (the parent still uses them), so its exit unlinks nothing."""
    global _lock, _reaper
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _owned.clear()
    _reaper = None


os.register_at_fork(after_in_child=_forget_in_child)


@atexit.register
def _unlink_all() -> None:
    for name in list(_owned):
        try:
            release(name)
        except Exception:  # noqa: BLE001 - exit path: unlink what we can
            pass
    if _reaper is not None and _reaper.stdin is not None:
        try:
            _reaper.stdin.close()
        except OSError:
            pass
