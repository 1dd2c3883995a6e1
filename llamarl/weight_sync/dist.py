"""The torch.distributed transport (gloo on CPU, NCCL on GPU) for ranks on different hosts.

Same plan, split in two halves at a wire buffer. For each pair (trainer rank t, generator rank g) the
ops of ``plan.ops(t, g)`` are laid end to end in a dense message of ``sum(rows * row_bytes)`` bytes:

    pack   (trainer t)  op i: shard bytes (strided)  -> wire[cursor_i : cursor_i + rows*row_bytes]
    unpack (generator g) op i: wire[cursor_i : ...]   -> bucket slot bytes (strided)

both run by the native engine. Per sync, t sends g a header ``int64[3] = (MAGIC, version, nbytes)`` and
then the message (omitted when empty), on tag ``1 + t * G + g`` (G = generator world size), so pairs
never cross even when one process hosts several logical ranks (gloo honours tags; with NCCL keep one
logical rank per process). Both sides derive the message layout from the same cached plan; the header's
byte count catches a mismatched plan.

The generator writes received weights with the same version protocol as the same-host transports: the
``DistInbox`` of each TP rank is a *writer* of its replica's control block (TP rank 0 claims the slot),
so readers never see a partial version. Memory: each side keeps one staging buffer per peer, i.e. about
one extra copy of the bytes it sends (trainer) or receives (generator). Every wait is bounded; a peer
that died or a timeout raises a RuntimeError/TimeoutError naming the peer (the process group should then
be torn down: a timed-out receive is still posted).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from llamarl import _native
from llamarl.weight_sync.buckets import GeneratorBuckets
from llamarl.weight_sync.planner import SyncPlan
from llamarl.weight_sync.quantize_on_sync import TrainerSources
from llamarl.weight_sync.sender import SyncStats, default_threads
from llamarl.weight_sync.versioning import give_up, recover

MAGIC = 0x4C52_5753  # "LRWS"


@dataclass(frozen=True)
class DistTopology:
    """Global ranks (in ``group``, default WORLD) of each logical trainer and generator rank."""

    trainer_ranks: tuple[int, ...]
    generator_ranks: tuple[int, ...]
    group: Any = field(default=None, compare=False)

    def tag(self, t: int, g: int) -> int:
        return 1 + t * len(self.generator_ranks) + g

    def check(self, plan: SyncPlan) -> None:
        if len(self.trainer_ranks) != plan.trainer.world_size:
            raise ValueError(f"DistTopology lists {len(self.trainer_ranks)} trainer ranks, the plan has "
                             f"{plan.trainer.world_size}")
        if len(self.generator_ranks) != plan.generator.world_size:
            raise ValueError(f"DistTopology lists {len(self.generator_ranks)} generator ranks, the plan has "
                             f"{plan.generator.world_size}")
        both = set(self.trainer_ranks) & set(self.generator_ranks)
        if both:
            raise ValueError(f"global ranks {sorted(both)} host both a trainer and a generator rank: a process cannot "
                             "send to itself; use the shared-memory transport for co-located ranks")


def _wait(work, timeout: float, what: str) -> None:
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo: peer closed the connection / timed out
        raise RuntimeError(f"{what} failed: {e}. The peer process probably died; tear down the process group "
                           "and restart it (the generator keeps its last complete version)") from e
    if ok is False:
        raise TimeoutError(f"{what} did not complete within {timeout} s")


def _pack_ops(ops: np.ndarray, wire_index: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(pack ops shard->wire, unpack ops wire->bucket, nbytes) for one (t, g) schedule."""
    sizes = ops[:, 4] * ops[:, 5]
    cursor = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(ops) else np.zeros(0, np.int64)
    pack = np.stack([ops[:, 0], np.full(len(ops), wire_index), ops[:, 2], cursor, ops[:, 4], ops[:, 5], ops[:, 6],
                     ops[:, 5]], axis=1) if len(ops) else np.zeros((0, 8), np.int64)
    unpack = np.stack([np.full(len(ops), wire_index), ops[:, 1], cursor, ops[:, 3], ops[:, 4], ops[:, 5], ops[:, 5],
                       ops[:, 7]], axis=1) if len(ops) else np.zeros((0, 8), np.int64)
    return np.ascontiguousarray(pack, np.int64), np.ascontiguousarray(unpack, np.int64), int(sizes.sum())


class DistSender:
    """Trainer rank ``rank``: sends its part of every version to every generator rank."""

    def __init__(self, plan: SyncPlan, rank: int, topology: DistTopology, *, device: torch.device | str = "cpu",
                 quantizer: str = "auto", timeout: float = 60.0, num_threads: int | None = None):
        topology.check(plan)
        self.plan, self.rank, self.topology, self.timeout = plan, rank, topology, float(timeout)
        self.device = torch.device(device)
        self.num_threads = num_threads or default_threads()
        self.sources = TrainerSources(plan, rank, self.device, quantizer)
        packs, self.nbytes = [], []
        for g in range(plan.generator.world_size):
            pack, _, n = _pack_ops(plan.ops(rank, g), g)
            packs.append(pack)
            self.nbytes.append(n)
        self._pack = np.ascontiguousarray(np.concatenate(packs))
        self.staging = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in self.nbytes]
        self._wire = _native.BufferTable.of(self.staging)
        self._pending: tuple | None = None

    def start(self, shards: Mapping[str, torch.Tensor], version: int) -> None:
        """Pack and post the sends of ``version`` (returns before they complete; see ``wait``)."""
        if self._pending is not None:
            self.wait()
        t0 = time.perf_counter()
        src = _native.BufferTable.of(self.sources.assemble(shards))
        _native.copy_indexed(self._wire, src, self._pack, device=self.device, num_threads=self.num_threads)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        works, headers = [], []
        for g, dst in enumerate(self.topology.generator_ranks):
            tag = self.topology.tag(self.rank, g)
            header = torch.tensor([MAGIC, version, self.nbytes[g]], dtype=torch.int64, device=self.device)
            headers.append(header)
            works.append((g, dist.isend(header, dst, group=self.topology.group, tag=tag)))
            if self.nbytes[g]:
                works.append((g, dist.isend(self.staging[g], dst, group=self.topology.group, tag=tag)))
        self._pending = (version, works, headers, t0)

    def wait(self) -> SyncStats:
        """Wait until every posted send of the last ``start`` completed."""
        if self._pending is None:
            raise RuntimeError("wait() without a started sync")
        version, works, _headers, t0 = self._pending
        self._pending = None
        for g, w in works:
            _wait(w, self.timeout, f"trainer rank {self.rank}: sending version {version} to generator rank {g} "
                                   f"(global rank {self.topology.generator_ranks[g]})")
        dt = time.perf_counter() - t0
        return SyncStats(version=version, bytes=sum(self.nbytes), seconds=dt, wait_seconds=0.0, copy_seconds=dt,
                         published=False)

    def sync(self, shards: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        self.start(shards, version)
        return self.wait()


class DistInbox:
    """Generator rank side: receives each version from every trainer rank and publishes it locally."""

    def __init__(self, plan: SyncPlan, buckets: GeneratorBuckets, topology: DistTopology, *,
                 timeout: float = 60.0, num_threads: int | None = None):
        topology.check(plan)
        if buckets.plan is not plan and buckets.layout.fingerprint() != plan.buckets[buckets.rank].fingerprint():
            raise ValueError("the buckets were created for a different plan")
        self.plan, self.buckets, self.topology, self.timeout = plan, buckets, topology, float(timeout)
        self.rank = buckets.rank
        self.writer = plan.generator.tp_rank(self.rank)
        self.control = buckets.control
        if self.control.handle.n_writers != plan.generator.tp_size:
            raise ValueError(f"buckets of generator rank {self.rank} expect {self.control.handle.n_writers} writers; a "
                             f"DistInbox needs a control block with n_writers = tp_size = {plan.generator.tp_size} "
                             "(create the buckets with storage='local')")
        self.num_threads = num_threads or default_threads()
        unpacks, self.nbytes = [], []
        for t in range(plan.trainer.world_size):
            _, unpack, n = _pack_ops(plan.ops(t, self.rank), t)
            unpacks.append(unpack)
            self.nbytes.append(n)
        self._unpack = np.ascontiguousarray(np.concatenate(unpacks))
        self.staging = [torch.empty(n, dtype=torch.uint8, device=buckets.device) for n in self.nbytes]
        self._wire = _native.BufferTable.of(self.staging)
        self.control.register_writer(self.writer)
        self.replica = plan.generator.replica(self.rank)
        self._unfinished: dict[int, int] = {}  # {replica: a version this inbox claimed but could not write}

    def receive(self, timeout: float | None = None) -> int:
        """Receive the next version from all trainer ranks, write it into a free slot, publish it. A write that
        fails after the claim gives the claim up (now, or at the next receive once the replica's other TP
        inboxes are done with it), so the inbox is not stuck behind a version it will never finish."""
        timeout = self.timeout if timeout is None else float(timeout)
        recover(self._unfinished, lambda _: self.control, self.writer, timeout, lambda detail: (
            f"generator rank {self.rank}: an earlier receive failed, and the version it left unfinished cannot be "
            f"abandoned: the replica's other TP inboxes (alive) have not finished writing it within {timeout:g} s "
            f"({detail})"))
        group, dev = self.topology.group, self.buckets.device
        headers, works = [], []
        for t, src in enumerate(self.topology.trainer_ranks):
            h = torch.zeros(3, dtype=torch.int64, device=dev)
            headers.append(h)
            works.append(dist.irecv(h, src, group=group, tag=self.topology.tag(t, self.rank)))
        for t, w in enumerate(works):
            _wait(w, timeout, f"generator rank {self.rank}: receiving the header of the next version from trainer "
                              f"rank {t} (global rank {self.topology.trainer_ranks[t]})")
        versions = set()
        for t, h in enumerate(headers):
            magic, version, n = (int(x) for x in h.tolist())
            if magic != MAGIC or n != self.nbytes[t]:
                raise ValueError(f"generator rank {self.rank}: trainer rank {t} sends {n} bytes (magic {magic:#x}) but "
                                 f"this side's plan expects {self.nbytes[t]}: trainer and generator were built with "
                                 "different specs or layouts")
            versions.add(version)
        if len(versions) != 1:
            raise ValueError(f"generator rank {self.rank}: trainer ranks sent different versions {sorted(versions)}; "
                             "every trainer rank must sync the same version")
        version = versions.pop()
        works = [(t, dist.irecv(self.staging[t], src, group=group, tag=self.topology.tag(t, self.rank)))
                 for t, src in enumerate(self.topology.trainer_ranks) if self.nbytes[t]]
        for t, w in works:
            _wait(w, timeout, f"generator rank {self.rank}: receiving version {version} from trainer rank {t}")
        slot = (self.control.claim(version, timeout) if self.writer == 0
                else self.control.wait_claim(self.writer, version, timeout))
        try:
            _native.copy_indexed(self.buckets.slot_buffers(slot), self._wire, self._unpack, device=dev,
                                 num_threads=self.num_threads)
            if dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()
            self.control.finish(self.writer, slot, version)
        except BaseException:
            give_up(self.control, version, self._unfinished, self.replica, self.writer)  # (retried next time)
            raise
        return version

    def close(self) -> None:
        self.control.deregister(writer=True, rank=self.writer)

