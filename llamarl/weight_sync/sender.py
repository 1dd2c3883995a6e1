"""Trainer side of the same-host transports: write shards straight into the generator buckets.

Transports behind one interface (``sync(shards, version) -> SyncStats``), all driven by the same plan:

    storage of the buckets   how a trainer rank writes them                    class
    "shm"  (CPU, same host)  maps the generator's segments; native thread pool WeightSender
                             doing strided memcpy straight into the slot
    "cuda" (GPU, same host)  opens each bucket's CUDA IPC handle once;         WeightSender
                             cudaMemcpy2DAsync on several streams
                             (cuda_engine="memcpy") or one SM copy kernel
                             launch ("kernel"), peer-to-peer over NVLink when
                             the buckets sit on another GPU
    "local" (other hosts)    torch.distributed send/recv (gloo / NCCL)         dist.DistSender / DistInbox

One sync of trainer rank t (``WeightSender.sync``):
    1. sources = shards in plan order (quantized on the trainer if the generator is int8/fp8)
    2. per generator replica: slot = claim(v) (rank 0) or wait_claim(v) (ranks > 0)
    3. one indexed copy over every op of ``plan.ops(t, g)`` for every generator rank g: source buffer
       table = the shards, destination table = every bucket of every rank, shifted to its replica's slot
    4. (cuda) wait for the copy streams; then finish(v) per replica - the last writer publishes.
A sync that fails once it holds slots (a copy error, a CUDA error surfacing at the stream sync) gives its
unfinished writes up (``abandon``: the slot becomes FREE, never READY), so readers keep the last complete
version (with 1 slot: wait for the next) and the next sync is not stuck behind a version nobody will
finish. With several trainer ranks ``abandon`` must wait until every other live writer has finished that
version or given it up (several ranks failing one sync: the last to give up frees it); until then the failed
rank retries it at the start of its next sync (``RECOVER_TIMEOUT_S``). A rank whose wait for writer 0's claim
timed out gives that version up at its next sync too, if writer 0 claimed it after all.
No gather: each byte goes from the trainer rank that holds it straight into each replica's bucket. Only
quantize-on-sync stages q/scale in trainer buffers, and not on its direct kernel path (quantize_on_sync.py).
"""

from __future__ import annotations

import operator
import os
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from llamarl import _native
from llamarl.weight_sync.buckets import AttachedBuckets, BucketHandle, describe_mismatch
from llamarl.weight_sync.planner import SyncPlan
from llamarl.weight_sync.quantize_on_sync import TrainerSources
from llamarl.weight_sync.versioning import VersionControl, give_up, recover

# How long a trainer rank whose previous sync failed waits, at its next sync, for the other trainer ranks
# to finish that version so it can be abandoned. Finite even with timeout=inf: the others only copy, and
# if one of them failed the same version it never finishes (see _recover).
RECOVER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SyncStats:
    """What one sync did on one trainer rank."""

    version: int
    bytes: int  # bytes this rank wrote (all destination ranks)
    seconds: float  # wall time of sync(), waits included
    wait_seconds: float  # time spent waiting for slots / claims
    copy_seconds: float  # quantize + copy (+ stream sync on CUDA)
    slots: dict[int, int] = field(default_factory=dict)  # replica -> slot written
    published: bool = False  # this rank's finish completed the version on every replica

    @property
    def gbps(self) -> float:
        return self.bytes / self.copy_seconds / 1e9 if self.copy_seconds > 0 else float("inf")


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class WeightSender:
    """Trainer rank ``rank``'s writer into every generator rank's buckets (shm or CUDA IPC)."""

    def __init__(self, plan: SyncPlan, rank: int, targets: Sequence[BucketHandle], *,
                 device: torch.device | str | None = None, num_threads: int | None = None, num_streams: int = 4,
                 cuda_engine: str = "memcpy", quantizer: str = "auto", timeout: float = 60.0):
        plan.trainer._check_rank(rank)
        if cuda_engine not in _native.CUDA_ENGINES:
            raise ValueError(f"cuda_engine must be one of {_native.CUDA_ENGINES}, got {cuda_engine!r}")
        self.plan, self.rank, self.timeout = plan, rank, float(timeout)
        self.num_threads = num_threads or default_threads()
        self.num_streams, self.cuda_engine = num_streams, cuda_engine
        gen = plan.generator
        by_rank = {}
        for h in targets:
            if not isinstance(h, BucketHandle):
                raise TypeError(f"targets must be BucketHandles from GeneratorBuckets.handle(), got {type(h).__name__}")
            if h.rank in by_rank:
                raise ValueError(f"two targets for generator rank {h.rank}")
            by_rank[h.rank] = h
        if sorted(by_rank) != list(range(gen.world_size)):
            raise ValueError(f"targets must cover generator ranks 0..{gen.world_size - 1} "
                             f"(tp_size={gen.tp_size} x replicas={gen.replicas}), got {sorted(by_rank)}")
        storages = {h.storage for h in by_rank.values()}
        if len(storages) != 1:
            raise ValueError(f"all targets must use one storage, got {sorted(storages)}")
        self.storage = storages.pop()
        if self.storage == "cuda":
            self.device = torch.device(device if device is not None else "cuda")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
            if device is not None and torch.device(device).type != "cpu":
                raise ValueError(f"shared-memory targets are written from host tensors, got device={device}")
        for g, h in by_rank.items():
            err = describe_mismatch(plan.buckets[g], h.table, h.fingerprint, f"generator rank {g}")
            if err:
                raise ValueError(err)
        self.sources = TrainerSources(plan, rank, self.device, quantizer)

        # One control block per replica, shared by its TP ranks.
        self.controls: list[VersionControl] = []
        for r in range(gen.replicas):
            handles = {by_rank[r * gen.tp_size + p].control for p in range(gen.tp_size)}
            if len(handles) != 1:
                raise ValueError(f"the TP ranks of generator replica {r} have different control blocks: create ranks "
                                 "1.. with control=<TP leader>.control_handle")
            ctl = VersionControl.attach(handles.pop())
            if ctl.handle.n_writers != plan.trainer.world_size:
                raise ValueError(f"generator replica {r} expects {ctl.handle.n_writers} writers but the trainer layout "
                                 f"has {plan.trainer.world_size} ranks")
            ctl.register_writer(rank)
            self.controls.append(ctl)
        self.targets = [AttachedBuckets.attach(by_rank[g], self.controls[gen.replica(g)])
                        for g in range(gen.world_size)]

        # Direct quantize-on-sync: quantized pieces whose destination holds whole rows are written by
        # the kernel straight into the bucket; their copy ops are dropped from the schedule.
        direct_ok = plan.generator.quant is not None and self.sources.quantizer == "kernel"
        self._direct: list[tuple] = []
        staged: set[str] = set()

        # The merged schedule: dst_buf indexes the concatenation of every rank's buckets.
        ops, base_ptr, slot_nbytes, replica_of = [], [], [], []
        direct_bytes = 0
        for g, tgt in enumerate(self.targets):
            o, keep = plan.ops(rank, g), np.ones(len(plan.ops(rank, g)), dtype=bool)
            pieces = plan.pieces(rank, g)
            same_device = self.storage == "shm" or tgt.device == self.device
            for i, pc in enumerate(pieces):
                tensor = plan.tensors[pc.tensor]
                whole_rows = pc.col0 == 0 and pc.col1 == tensor.cols
                if tensor.kind != "qweight" or not (direct_ok and same_device and whole_rows):
                    continue
                j = next(j for j, p2 in enumerate(pieces) if p2.tensor == pc.tensor + 1 and p2.row0 == pc.row0)
                keep[i] = keep[j] = False
                layout = plan.buckets[g]
                q_place, s_place = layout.placements[pc.tensor], layout.placements[pc.tensor + 1]
                r0_q = plan.generator.region(tensor, g)[0]
                r0_s = plan.generator.region(plan.tensors[pc.tensor + 1], g)[0]
                local = pc.row0 - plan.trainer.rows(plan.spec_by_name[tensor.param], rank)[0]
                q_off = q_place.offset + (pc.row0 - r0_q) * tensor.cols * tensor.element_size
                s_off = s_place.offset + (pc.row0 - r0_s) * 4
                self._direct.append((tensor.param, g, local, pc.rows, tensor.cols, tensor.dtype,
                                     q_place.bucket, q_off, s_place.bucket, s_off))
                direct_bytes += pc.rows * (tensor.cols * tensor.element_size + 4)
            for i, pc in enumerate(pieces):
                if keep[i] and plan.tensors[pc.tensor].kind != "param":
                    staged.add(plan.tensors[pc.tensor].param)
            o = o[keep].copy()
            o[:, 1] += len(base_ptr)
            ops.append(o)
            base_ptr += tgt._ptrs
            slot_nbytes += list(tgt.handle.slot_nbytes)
            replica_of += [gen.replica(g)] * len(tgt._ptrs)
        self._skip = frozenset(s.name for s in plan.specs if plan.generator.quantizes(s)) - staged
        self._ops = np.ascontiguousarray(np.concatenate(ops)) if ops else np.zeros((0, 8), np.int64)
        self._base = np.asarray(base_ptr, dtype=np.uint64)
        self._slot_nbytes = np.asarray(slot_nbytes, dtype=np.int64)
        self._replica_of = np.asarray(replica_of, dtype=np.int64)
        self.bytes_per_sync = int((self._ops[:, 4] * self._ops[:, 5]).sum()) + direct_bytes
        self._param_names = [sp.name for sp in plan.specs]
        self._cacheable = not staged  # staged quantization makes fresh source tensors every sync
        self._cache: tuple | None = None
        self._unfinished: dict[int, int] = {}  # replica -> version this rank failed to write, not yet abandoned
        self._closed = False

    def _source_table(self, shards: Mapping[str, torch.Tensor]) -> _native.BufferTable:
        """The source buffer table; re-checked only when the shard tensors or their addresses changed.

        The common case - the same parameter tensors updated in place every step - costs one identity
        and one address comparison per tensor instead of the full shape/dtype/device checks.
        """
        if self._cache is not None and len(shards) == len(self._param_names):
            objs, ptrs, table = self._cache
            try:
                now = [shards[n] for n in self._param_names]
            except KeyError:
                now = None
            if now is not None and all(map(operator.is_, now, objs)) and [t.data_ptr() for t in now] == ptrs:
                return table
        table = _native.BufferTable.of(self.sources.assemble(shards, skip=self._skip))
        if self._cacheable:
            objs = [shards[n] for n in self._param_names]
            self._cache = (objs, [t.data_ptr() for t in objs], table)
        return table

    def sync(self, shards: Mapping[str, torch.Tensor], version: int) -> SyncStats:
        """Write this rank's part of policy ``version`` into every generator replica."""
        if self._closed:
            raise RuntimeError("this WeightSender was closed")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise TypeError(f"version must be a non-negative int (the policy version), got {version!r}")
        t0 = time.perf_counter()
        if self._unfinished:
            self._recover()
        tr = time.perf_counter()
        src = self._source_table(shards)
        t1 = time.perf_counter()
        slots: dict[int, int] = {}
        finished: set[int] = set()
        try:
            for r, ctl in enumerate(self.controls):
                slots[r] = (ctl.claim(version, self.timeout) if self.rank == 0
                            else ctl.wait_claim(self.rank, version, self.timeout))
            t2 = time.perf_counter()
            published = self._write(shards, src, slots, version, finished)
        except BaseException:
            self._abandon({r: version for r in slots if r not in finished})
            for r in range(len(self.controls)):  # not claimed by this rank (its wait timed out): writer 0 may
                if r not in slots:  # still claim and half-write it; the next sync's _recover gives it up then
                    self._unfinished.setdefault(r, version)
            raise
        t4 = time.perf_counter()
        return SyncStats(version=version, bytes=self.bytes_per_sync, seconds=t4 - t0,
                         wait_seconds=(tr - t0) + (t2 - t1), copy_seconds=(t1 - tr) + (t4 - t2), slots=slots,
                         published=all(published))

    def _write(self, shards: Mapping[str, torch.Tensor], src: _native.BufferTable, slots: dict[int, int],
               version: int, finished: set[int]) -> list[bool]:
        """Copy this rank's bytes into the claimed ``slots`` and finish each replica (added to ``finished``)."""
        slot_of = np.asarray([slots[r] for r in range(len(self.controls))], dtype=np.int64)
        dst_ptrs = self._base + (slot_of[self._replica_of] * self._slot_nbytes).astype(np.uint64)
        dst = _native.BufferTable(dst_ptrs, self._slot_nbytes)
        for param, g, lo, rows, cols, qdtype, qb, qoff, sb, soff in self._direct:
            flat = self.targets[g].flat
            base_q = slots[self.plan.generator.replica(g)] * self.targets[g].handle.slot_nbytes[qb] + qoff
            base_s = slots[self.plan.generator.replica(g)] * self.targets[g].handle.slot_nbytes[sb] + soff
            q_view = flat(qb)[base_q:base_q + rows * cols].view(qdtype).view(rows, cols)
            s_view = flat(sb)[base_s:base_s + rows * 4].view(torch.float32)
            w = self.sources.copy_rows(param, shards[param])[lo:lo + rows]
            self.sources.quantize_into(w, q_view, s_view)  # on the current stream, before the copies
        _native.copy_indexed(dst, src, self._ops, device=self.device, num_threads=self.num_threads,
                             num_streams=self.num_streams, engine=self.cuda_engine)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        published = []
        for r, ctl in enumerate(self.controls):
            published.append(ctl.finish(self.rank, slots[r], version))
            finished.add(r)
        return published

    def _abandon(self, unfinished: dict[int, int]) -> None:
        """After a sync failed holding slots (replica -> version): give the unfinished writes up, so a later
        sync is not stuck behind a version nobody will finish; the slot becomes FREE, never READY. A replica
        whose other writers are still on the version cannot be abandoned yet: ``_recover`` retries it."""
        for r, version in unfinished.items():
            give_up(self.controls[r], version, self._unfinished, r, self.rank)

    def _recover(self) -> None:
        """Before a sync: abandon what this rank's failed sync left claimed, once the other writers finished it."""
        timeout = min(self.timeout, RECOVER_TIMEOUT_S)
        recover(self._unfinished, self.controls.__getitem__, self.rank, timeout, lambda detail: (
            f"trainer rank {self.rank}: an earlier sync of this rank failed, and the version it left unfinished "
            f"cannot be abandoned because other trainer ranks (alive) have not finished writing it within "
            f"{timeout:g} s ({detail})"))

    def close(self) -> None:
        """Deregister as a writer and unmap the buckets (the generator keeps the published versions)."""
        if self._closed:
            return
        self._closed = True
        for ctl in self.controls:
            try:
                ctl.deregister(writer=True, rank=self.rank)
            finally:
                ctl.close()
        for t in self.targets:
            t.close()

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
