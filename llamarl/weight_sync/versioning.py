"""Policy versions: a generator never computes with a partially written version.

Every sync carries a policy version (a strictly increasing int). The generator buckets hold ``nslots``
complete copies of the weights ("slots"); one control block per generator replica, shared by its TP
ranks (readers) and by the trainer ranks (writers), records which slot holds which version. The state
machine and its atomics live in csrc/sync_ctl.{h,cpp}; this module is its Python face.

Protocol
    reader (generator, at a batch boundary)     writer 0 (trainer rank 0)          writers 1..R_t-1
    slot, v = acquire()  newest READY slot      slot = claim(v): pick a slot that   slot = wait_claim(v)
      ... forward passes on slot ...              is not the newest; wait until
    release()                                     no reader holds it (DRAINING ->
                                                  WRITING); announce (v, slot)
                                                copy own shard bytes into slot     copy own shard bytes
                                                finish(v)                          finish(v)
                                                the last finish publishes: slot READY, newest = slot
TP ranks of one replica acquire together: the TP leader takes the newest version v and tells its peers,
which ``acquire(version=v)``; v cannot be overwritten while any of them holds it.

Memory cost and behaviour by ``nslots``:
    1  pause at a batch boundary. No extra memory. The writer waits until the generator releases the
       slot (its current batch ends); new acquires wait until the write is published. The generator
       stalls for one sync (~ bytes / copy bandwidth), the trainer for up to one generation batch.
    2  double buffering. 2x the generator weight memory (2x 16 GB for Llama-8B bf16 per generator rank).
       The trainer writes the idle slot while the generator keeps computing on the other; neither waits
       as long as the generator releases each slot before the trainer's next-but-one sync.
Slots > 2 only help when readers hold old versions for long.

Failure handling: every wait takes a timeout (inf: no limit, as the trainer's sender uses) and checks
that the peers it waits for are alive (pids registered in the control block; same-host only). A writer
that dies mid-write leaves its slot WRITING, never READY: readers keep the last complete version and
``wait_version`` raises ``PeerDied`` naming the writer; ``abandon()`` frees the slot for a restarted
trainer. A write that fails gives its claim up (``abandon(writer)``): the version is dropped once every live
writer has finished it or given it up, whichever of them comes last. Claimed versions strictly increase,
abandoned ones included (a retry syncs the next version): so a version number names one claim, and a
preempted abandoner cannot free a later claim of the same number. A reader that dies while holding a slot
pins it: the writer that needs that slot raises
``PeerDied`` naming the reader (the generator replica has to be recreated). Across hosts (dist.py) the
same protocol runs locally on the generator host, with the generator's DistInboxes as the writers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from llamarl import _native
from llamarl.weight_sync import cleanup

SyncTimeout, PeerDied = _native.sync_errors()

STATE_NAMES = {0: "FREE", 1: "READY", 2: "DRAINING", 3: "WRITING"}


@dataclass(frozen=True)
class ControlHandle:
    """Picklable address of a control block: a shared-memory segment name (or a private block)."""

    name: str | None  # None: private to the creating process
    nbytes: int
    nslots: int
    n_writers: int
    n_readers: int
    owner_pid: int


def try_abandon(ctl: "VersionControl", version: int, writer: int) -> bool:
    """``writer`` gives up the claim of ``version`` that its failed write left in ``ctl`` (the slot becomes FREE,
    never READY); True when done or when it is no longer there (another failed writer gave it up already: it
    can never be published without this one), False while another writer (alive) is still writing it: it
    finishes it or gives it up too, and then either of them frees it. ``PeerDied`` raises."""
    try:
        ctl.abandon(writer, version)
    except RuntimeError as exc:
        if isinstance(exc, PeerDied):
            raise
        return False  # "cannot abandon version v: writer rank k (pid p) is alive and still writing it"
    return True


def give_up(ctl: "VersionControl", version: int, pending: dict[int, int], replica: int, writer: int) -> None:
    """After ``writer``'s write of ``version`` failed (best effort: the caller re-raises its own error), abandon
    its claim now, or record it in ``pending[replica]`` for ``recover`` when another writer is still on it."""
    try:
        if not try_abandon(ctl, version, writer):
            pending[replica] = version
    except Exception:  # noqa: BLE001 - best effort; the original error is what the caller needs
        pending[replica] = version


def recover(pending: dict[int, int], control: Callable[[int], "VersionControl"], writer: int, timeout: float,
            failure: Callable[[str], str]) -> None:
    """Before ``writer``'s next write: abandon every version in ``pending`` (replica -> version) once the other
    writers have finished or given it up, waiting up to ``timeout`` s; then ``SyncTimeout(failure(detail))``,
    detail the replicas' control blocks. ``pending`` is emptied as they are given up."""
    deadline, nap = time.monotonic() + timeout, 1e-4
    while pending:
        for r, version in list(pending.items()):
            if try_abandon(control(r), version, writer):
                del pending[r]
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise SyncTimeout(failure("; ".join(f"replica {r}: {control(r).snapshot()}" for r in pending)))
        time.sleep(nap)
        nap = min(nap * 2, 0.05)


class VersionControl:
    """A version control block: owned (``create``) or attached (``attach``)."""

    def __init__(self, mem, handle: ControlHandle, owner: bool):
        self._mem = mem
        self.handle = handle
        self.owner = owner
        self._closed = False

    @classmethod
    def create(cls, nslots: int, n_writers: int, n_readers: int = 1, *, shared: bool = True) -> "VersionControl":
        """A fresh block; ``shared=False`` keeps it in private memory (one process, e.g. a dist receiver)."""
        n = _native.native().CTL_NBYTES
        max_slots, max_peers = _native.native().CTL_MAX_SLOTS, _native.native().CTL_MAX_PEERS
        if not 1 <= nslots <= max_slots:
            raise ValueError(f"nslots must be in [1, {max_slots}], got {nslots}")
        if not (1 <= n_writers <= max_peers and 1 <= n_readers <= max_peers):
            raise ValueError(f"n_writers and n_readers must be in [1, {max_peers}], got {n_writers}, {n_readers}")
        if shared:
            # Registered before it exists: a kill between creating and registering would leak the
            # segment; unlinking a name that was never created is harmless (see cleanup.register).
            name = cleanup.unique_name("ctl")
            cleanup.register(name)
            try:
                mem = _native.shm_create(name, n)
                _native.native().ctl_init(mem, nslots, n_writers, n_readers)
            except BaseException:
                cleanup.release(name)
                raise
        else:
            name = None
            raw = np.zeros(n + 128, dtype=np.uint8)
            off = (-raw.ctypes.data) % 128
            mem = raw[off:off + n]
            _native.native().ctl_init(mem, nslots, n_writers, n_readers)
        return cls(mem, ControlHandle(name, n, nslots, n_writers, n_readers, os.getpid()), owner=True)

    @classmethod
    def attach(cls, handle: ControlHandle) -> "VersionControl":
        if handle.name is None:
            raise ValueError("this control block is private to process "
                             f"{handle.owner_pid}; create it with shared=True to use it from other processes")
        mem = _native.shm_attach(handle.name, handle.nbytes)
        return cls(mem, handle, owner=False)

    # ---- registration ------------------------------------------------------------------------------
    def register_writer(self, rank: int) -> None:
        _native.native().ctl_register(self._live(), True, rank, os.getpid())

    def register_reader(self, rank: int) -> None:
        _native.native().ctl_register(self._live(), False, rank, os.getpid())

    def deregister(self, *, writer: bool, rank: int) -> None:
        _native.native().ctl_register(self._live(), writer, rank, 0)

    # ---- readers -----------------------------------------------------------------------------------
    def acquire(self, version: int | None = None, timeout: float = 60.0) -> tuple[int, int]:
        """Hold the newest complete version (or exactly ``version``): returns (slot, version)."""
        want = -1 if version is None else int(version)
        return tuple(_native.native().ctl_acquire(self._live(), want, float(timeout)))

    def release(self, slot: int) -> None:
        _native.native().ctl_release(self._live(), slot)

    def wait_version(self, version: int, timeout: float = 60.0) -> None:
        """Block until ``version`` (or a newer one) is published."""
        _native.native().ctl_wait_version(self._live(), int(version), float(timeout))

    # ---- writers -----------------------------------------------------------------------------------
    def claim(self, version: int, timeout: float = 60.0) -> int:
        """Writer 0: take a slot for ``version`` (waits for its readers to leave); returns the slot."""
        return _native.native().ctl_claim(self._live(), int(version), float(timeout))

    def wait_claim(self, writer: int, version: int, timeout: float = 60.0) -> int:
        """Writers 1..n-1: the slot writer 0 claimed for ``version``."""
        return _native.native().ctl_wait_claim(self._live(), writer, int(version), float(timeout))

    def finish(self, writer: int, slot: int, version: int) -> bool:
        """This writer's bytes of ``version`` are in place; True if that completed and published it."""
        return bool(_native.native().ctl_finish(self._live(), writer, slot, int(version)))

    def abandon(self, writer: int | None = None, version: int | None = None) -> None:
        """Drop the unfinished write of ``version`` (None: whichever is in flight; nothing if another version is)
        once no live writer is still on it; its slot becomes FREE. ``writer``: that writer gives it up first (it
        will never finish it); None: a restarted trainer clearing what dead writers left. Raises naming a writer
        that is alive and still writing."""
        _native.native().ctl_abandon(self._live(), -1 if writer is None else int(writer),
                                     -1 if version is None else int(version))

    # ---- inspection / lifetime ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        d = dict(_native.native().ctl_snapshot(self._live()))
        d["slots"] = [dict(state=STATE_NAMES.get(s, s), version=v, readers=r) for s, v, r in d["slots"]]
        return d

    @property
    def latest_version(self) -> int:
        return int(_native.native().ctl_snapshot(self._live())["latest_version"])

    def close(self) -> None:
        """Owner: unlink the segment name. Everyone: drop this object's mapping reference."""
        if self._closed:
            return
        self._closed = True
        if self.owner and self.handle.name is not None:
            cleanup.release(self.handle.name)
        self._mem = None

    def _live(self):
        if self._mem is None:
            raise RuntimeError("this VersionControl was closed")
        return self._mem
