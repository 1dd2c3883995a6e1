"""Generator weights in flat per-dtype buckets; parameters are views into them.

Layout of one generator rank (from ``SyncPlan.buckets[rank]``): one bucket per dtype, i.e. one
allocation - one POSIX shared-memory segment (``storage="shm"``), one ``cudaMalloc`` with one CUDA IPC
handle (``storage="cuda"``), or one plain tensor (``storage="local"``, written in-process by a DistInbox)
- never one handle per tensor. A bucket holds ``nslots`` slots back to back::

    bucket b:  | slot 0: tensor, pad to 256 B, tensor, ... pad to 4 KiB | slot 1: same layout | ...
    tensor view = bucket[s * slot_nbytes + offset : + nbytes].view(dtype).view(local_shape)

The slot in use for a policy version is chosen by the replica's version control block (versioning.py);
``load_into(module, slot)`` makes the module's parameters *be* those views (``param.data = view``), so a
sync into that slot changes the model in place.

``GeneratorBuckets`` is the owner (created by the generator rank; frees/unlinks on ``close`` and at
exit, see cleanup.py). ``BucketHandle`` is what the owner hands to trainer ranks: segment names or IPC
handles, sizes, the tensor table and a fingerprint of the layout (so a trainer with different specs or
layouts fails with the first mismatching tensor named), and the control block's handle - all small,
picklable, no tensors. ``AttachedBuckets`` is a trainer rank's mapping of one generator rank's buckets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Union

import torch

from llamarl import _native
from llamarl.weight_sync import cleanup
from llamarl.weight_sync.planner import BucketLayout, SyncPlan
from llamarl.weight_sync.versioning import ControlHandle, VersionControl

STORAGES = ("shm", "cuda", "local")

# CUDA buckets by IPC handle, so a peer in the owner's own process can use them (CUDA refuses to open
# an IPC handle in the process that exported it).
_LOCAL_CUDA: dict[bytes, object] = {}


@dataclass(frozen=True)
class BucketHandle:
    """Picklable address of one generator rank's buckets (no tensors inside)."""

    storage: str  # "shm" | "cuda"
    rank: int  # generator rank
    segments: tuple[Union[str, bytes], ...]  # shm names or 64-byte CUDA IPC handles, one per bucket
    nbytes: tuple[int, ...]  # bytes per bucket (all slots)
    slot_nbytes: tuple[int, ...]
    nslots: int
    device: int | None
    owner_pid: int
    table: tuple[tuple[str, tuple[int, ...], str], ...]
    fingerprint: str
    control: ControlHandle


def describe_mismatch(expected: BucketLayout, got_table, got_fingerprint: str, what: str) -> str | None:
    """None if the layouts agree, else a message naming the first differing tensor."""
    if expected.fingerprint() == got_fingerprint:
        return None
    mine = {n: (s, d) for n, s, d in expected.table()}
    theirs = {n: (tuple(s), d) for n, s, d in got_table}
    for n in mine:
        if n not in theirs:
            return f"{what}: the generator has no tensor {n!r} that this side's plan expects"
        if mine[n] != theirs[n]:
            return (f"{what}: tensor {n!r} is {theirs[n][1]} {list(theirs[n][0])} on the generator but "
                    f"{mine[n][1]} {list(mine[n][0])} in this side's plan (mismatched shapes/dtypes)")
    extra = sorted(set(theirs) - set(mine))
    if extra:
        return f"{what}: the generator holds tensors this side's plan does not know: {extra[:5]}"
    return f"{what}: same tensors but a different bucket layout (different llamarl versions?)"


class GeneratorBuckets:
    """The flat buckets of one generator rank, owned by that rank's process."""

    def __init__(self, plan: SyncPlan, rank: int, storage: str, device: torch.device, nslots: int,
                 mems: list, control: VersionControl, owns_control: bool = True):
        self.plan = plan
        self.rank = rank
        self.storage = storage
        self.device = device
        self.nslots = nslots
        self.layout = plan.buckets[rank]
        self.control = control
        self._owns_control = owns_control  # created here, not a TP leader's block handed in
        self._mems = mems
        self._flat = [_native.as_tensor(m) if storage != "local" else m for m in mems]
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._closed = False

    @classmethod
    def create(cls, plan: SyncPlan, rank: int, *, storage: str = "shm", device: torch.device | str | None = None,
               slots: int = 2, control: ControlHandle | VersionControl | None = None) -> "GeneratorBuckets":
        """Allocate the buckets of generator ``rank`` (zero-filled) and its replica's control block.

        ``control``: the TP leader's (tp rank 0) ``control_handle`` for the other TP ranks of a replica;
        None creates a new block (only the leader may). Writers are the trainer ranks for shm/cuda, the
        TP ranks' DistInboxes for local storage.
        """
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        gen = plan.generator
        gen.tp_rank(rank)  # range check
        layout = plan.buckets[rank]
        if storage == "cuda":
            device = torch.device(device if device is not None else "cuda")
            if device.type != "cuda":
                raise ValueError(f"storage='cuda' needs a cuda device, got {device}")
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
        elif storage == "shm":
            if device is not None and torch.device(device).type != "cpu":
                raise ValueError(f"storage='shm' buckets live in host memory, got device={device}; use storage='cuda'")
            device = torch.device("cpu")
        else:
            device = torch.device(device if device is not None else "cpu")
        if control is None:
            if gen.tp_rank(rank) != 0:
                raise ValueError(f"generator rank {rank} is TP rank {gen.tp_rank(rank)} of replica "
                                 f"{gen.replica(rank)}: pass its TP leader's buckets.control_handle as control=")
            n_writers = plan.trainer.world_size if storage != "local" else gen.tp_size
            ctl = VersionControl.create(slots, n_writers, gen.tp_size, shared=storage != "local" or gen.tp_size > 1)
        elif isinstance(control, VersionControl):
            ctl = control
        else:
            ctl = VersionControl.attach(control)
        if ctl.handle.nslots != slots:
            raise ValueError(f"control block has {ctl.handle.nslots} slots but slots={slots} was asked for")
        mems: list = []
        pending: str | None = None  # a registered shm name not yet in mems
        try:
            for b, slot_nbytes in enumerate(layout.slot_nbytes):
                nbytes = slots * slot_nbytes
                if storage == "shm":
                    # Register the name before creating the segment, so that no instant exists where the
                    # segment exists but nothing would unlink it if this process were killed (unlinking
                    # a name that was never created is harmless: see cleanup.register).
                    pending = cleanup.unique_name(f"g{rank}b{b}")
                    cleanup.register(pending)
                    mem = _native.shm_create(pending, nbytes)
                elif storage == "cuda":
                    mem = _native.cuda_bucket(nbytes, device.index)
                    mem.zero()
                else:
                    mem = torch.zeros(nbytes, dtype=torch.uint8, device=device)
                mems.append(mem)
                pending = None
        except BaseException:
            if pending is not None:
                cleanup.release(pending)
            for m in mems:
                if storage == "shm":
                    cleanup.release(m.name)
            if control is None:
                ctl.close()
            raise
        return cls(plan, rank, storage, device, slots, mems, ctl, owns_control=control is None)

    # ---- addressing -------------------------------------------------------------------------------
    @property
    def control_handle(self) -> ControlHandle:
        """The replica's control block, for the other TP ranks' ``create(..., control=...)``."""
        return self.control.handle

    def handle(self) -> BucketHandle:
        """What trainer ranks need to write into these buckets (picklable)."""
        if self.storage == "local":
            raise ValueError("local buckets are written in-process (DistInbox) and have no handle; use "
                             "storage='shm' or 'cuda' to let other processes write them")
        if self.storage == "shm":
            segments = tuple(m.name for m in self._mems)
        else:
            segments = tuple(bytes(m.ipc_handle()) for m in self._mems)
            for h, m in zip(segments, self._mems):
                _LOCAL_CUDA[h] = m
        return BucketHandle(
            storage=self.storage, rank=self.rank, segments=segments,
            nbytes=tuple(int(t.numel()) for t in self._flat), slot_nbytes=self.layout.slot_nbytes,
            nslots=self.nslots, device=self.device.index if self.device.type == "cuda" else None,
            owner_pid=os.getpid(), table=self.layout.table(), fingerprint=self.layout.fingerprint(),
            control=self.control.handle,
        )

    def slot_buffers(self, slot: int) -> _native.BufferTable:
        """Addresses and sizes of every bucket's ``slot`` (the dst table of a copy schedule)."""
        self._check_slot(slot)
        return _native.BufferTable([t.data_ptr() + slot * n for t, n in zip(self._flat, self.layout.slot_nbytes)],
                                   list(self.layout.slot_nbytes))

    def tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """name -> view of that tensor in ``slot`` (local shapes; quantized ones as q and ``<name>_scale``)."""
        self._check_slot(slot)
        if slot not in self._views:
            views = {}
            for p in self.layout.placements:
                start = slot * self.layout.slot_nbytes[p.bucket] + p.offset
                raw = self._flat[p.bucket][start:start + p.nbytes]
                views[p.name] = raw.view(p.dtype).view(p.shape)
            self._views[slot] = views
        return self._views[slot]

    def load_into(self, module: torch.nn.Module, slot: int, *, strict: bool = True) -> None:
        """Make the module's parameters/buffers views into ``slot`` (``param.data = view``).

        strict: every bucket tensor must exist in the module with the same shape and dtype, and every
        module parameter must come from the buckets.
        """
        load_views(module, self.tensors(slot), strict=strict, where=f"generator rank {self.rank} slot {slot}")

    def _check_slot(self, slot: int) -> None:
        if self._closed:
            raise RuntimeError(f"the buckets of generator rank {self.rank} were closed")
        if not 0 <= slot < self.nslots:
            raise ValueError(f"slot {slot} is not in [0, {self.nslots})")

    def close(self) -> None:
        """Unlink shared-memory names and the owned control block; memory is freed once no view is left."""
        if self._closed:
            return
        self._closed = True
        for m in self._mems:
            if self.storage == "shm":
                cleanup.release(m.name)
        for h in [h for h, m in _LOCAL_CUDA.items() if any(m is x for x in self._mems)]:
            del _LOCAL_CUDA[h]
        if self.control.owner and self._owns_control:  # (a TP peer given its leader's block leaves it alone)
            self.control.close()
        self._views.clear()
        self._flat = []
        self._mems = []


def load_views(module: torch.nn.Module, views: dict[str, torch.Tensor], *, strict: bool, where: str,
               names: Mapping[str, str] | None = None, check_only: bool = False) -> None:
    """Rebind module tensors to ``views`` by name (shapes, dtypes and devices must match); with
    ``check_only``, only raise if they would not match.

    The module's parameters then live in other storage, so ``module.weights_key`` is set to an identity of
    it (the lowest view address): CUDA-graph decoders keep one graph per key, since a captured graph reads
    the addresses it was captured with (llamarl.generation.cuda_graphs).

    ``names`` maps a bucket tensor's name to the module's where they differ: a quantized generator keeps
    ``<module>.qweight`` / ``<module>.scale`` buffers (llamarl.models.quantize) for the sync's
    ``<module>.weight`` / ``<module>.weight_scale``.
    """
    if names:
        views = {names.get(n, n): v for n, v in views.items()}
    named = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    missing = [n for n in views if n not in named]
    if strict:
        not_synced = [n for n, _ in module.named_parameters() if n not in views]
        if missing or not_synced:
            raise ValueError(f"cannot load {where} into {type(module).__name__}: bucket tensors missing from the "
                             f"module {missing[:5]}, module parameters not in the buckets {not_synced[:5]}")
    for n, v in views.items():
        if n not in named:
            continue
        t = named[n]
        if tuple(t.shape) != tuple(v.shape) or t.dtype != v.dtype or t.device != v.device:
            raise ValueError(f"cannot load {where}: module tensor {n!r} is {t.dtype} {list(t.shape)} on {t.device} but "
                             f"the bucket holds {v.dtype} {list(v.shape)} on {v.device}")
    if check_only:
        return
    for n, v in views.items():
        if n in named:
            named[n].data = v
    if views:
        module.weights_key = ("views", min(v.data_ptr() for v in views.values()))


class AttachedBuckets:
    """A trainer rank's mapping of one generator rank's buckets and control block."""

    def __init__(self, handle: BucketHandle, mems: list, control: VersionControl):
        self.handle = handle
        self._mems = mems
        self.control = control
        self._ptrs = [self._ptr(m) for m in mems]
        self._flat: dict[int, torch.Tensor] = {}
        self.device = torch.device("cuda", handle.device) if handle.storage == "cuda" else torch.device("cpu")

    def flat(self, b: int) -> torch.Tensor:
        """Bucket ``b`` (all slots) as a flat uint8 tensor over the mapping (for kernels writing into it)."""
        if b not in self._flat:
            self._flat[b] = _native.as_tensor(self._mems[b])
        return self._flat[b]

    @staticmethod
    def _ptr(m) -> int:
        return int(m.address) if hasattr(m, "address") else int(m.ptr)

    @classmethod
    def attach(cls, handle: BucketHandle, control: VersionControl | None = None) -> "AttachedBuckets":
        if not isinstance(handle, BucketHandle):
            raise TypeError(f"expected a BucketHandle from GeneratorBuckets.handle(), got {type(handle).__name__}")
        mems: list = []
        if handle.storage == "shm":
            for name, n in zip(handle.segments, handle.nbytes):
                mems.append(_native.shm_attach(name, n))
        elif handle.storage == "cuda":
            for h, n in zip(handle.segments, handle.nbytes):
                local = _LOCAL_CUDA.get(h) if handle.owner_pid == os.getpid() else None
                mems.append(local if local is not None else _native.cuda_ipc_open(h, n, handle.device))
        else:
            raise ValueError(f"cannot attach buckets with storage {handle.storage!r}")
        ctl = control if control is not None else VersionControl.attach(handle.control)
        return cls(handle, mems, ctl)

    def slot_buffers(self, slot: int) -> _native.BufferTable:
        if not 0 <= slot < self.handle.nslots:
            raise ValueError(f"slot {slot} is not in [0, {self.handle.nslots})")
        return _native.BufferTable([p + slot * n for p, n in zip(self._ptrs, self.handle.slot_nbytes)],
                                   list(self.handle.slot_nbytes))

    def close(self) -> None:
        """Drop the mappings (munmap / cudaIpcCloseMemHandle happen when the objects are freed)."""
        self._mems = []
        self._ptrs = []
        self._flat = {}
