"""Small file-system helpers shared across llamarl (no torch): atomic text files, an exclusive lock file, and
a check that a directory takes files (``unwritable``: asked before long work, not after it).

``write_text_atomic``: the new text goes into a temporary file in the same directory (named with the pid,
the thread and a random token, so concurrent writers never share one), which is fsynced, renamed over the
target with ``os.replace`` (atomic) and the directory fsynced; a reader sees the old file or the new one,
never a partial write, and after a crash the file is the old or the new one. A failed write (a full disk)
removes its temporary file and leaves the old file as it was.

``LockFile``: an exclusive, non-blocking ``fcntl.flock`` on a file that holds the owner's pid. The lock
belongs to the open file description: it is released by ``release()`` or by the owner's death (a crash or
SIGKILL leaves no stale lock; the file itself stays, with the last owner's pid). The descriptor is not
inherited by child processes (O_CLOEXEC, and they are spawned, not forked), so only the owner holds it.
On a file system without flock (some Lustre and FUSE mounts: ENOSYS, EOPNOTSUPP, ENOLCK) the file is
still written but nothing is locked: ``locked`` is False and the caller says so.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import tempfile
import threading
from pathlib import Path


def write_text_atomic(path: Path, text: str, *, tmp_name: str | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically and durably (see the module docstring); ``tmp_name``
    names the temporary file instead (unique per writer: e.g. one a cleaner of dead writers' files knows)."""
    path = Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.{os.getpid()}-{threading.get_ident()}-"
                                     f"{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def unwritable(directory: Path) -> str | None:
    """None if ``directory`` can be created and a file written in it, else why not (the OS's reason)."""
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".llamarl-write-test-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the renames and creations in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}  # flock unsupported here


class LockHeld(RuntimeError):
    """Another process holds the lock on ``path``; ``pid`` is the pid it wrote there (None if unreadable)."""

    def __init__(self, path: Path, pid: int | None):
        super().__init__(f"{path} is locked by {'pid ' + str(pid) if pid is not None else 'another process'}")
        self.path, self.pid = path, pid


class LockFile:
    """Hold an exclusive lock on ``path`` (created, with its parent directories, if missing) until
    ``release()`` or this process ends; the file then holds this process's pid. Raises ``LockHeld`` at once
    (never waits) if another process holds it, and OSError if the file cannot be created."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self.locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid: int | None = int(os.pread(fd, 32, 0).decode().strip())
            except ValueError:  # the owner is between truncating and writing its pid
                pid = None
            os.close(fd)
            raise LockHeld(self.path, pid) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            self.locked = False  # the file system cannot lock: the caller warns
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlock (closing the descriptor releases the flock); a second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> LockFile:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
