"""The DDMA planner: a static, validated schedule of 2-D copies from trainer shards to generator buckets.

Given the parameter specs and the two layouts, ``plan_sync`` computes once (and caches):

* ``buckets[g]``: where each tensor of generator rank g lives: one flat bucket per dtype, tensors at
  256-byte aligned offsets, one *slot* of ``slot_nbytes`` per bucket (the buckets hold ``nslots`` slots
  back to back, see versioning.py; offsets here are relative to the slot).
* ``ops(t, g)``: the indexed copy schedule ``[n, 8]`` (``src_buf, dst_buf, src_offset, dst_offset, rows,
  row_bytes, src_stride, dst_stride``; bytes) that moves trainer rank t's part of every tensor to
  generator rank g. ``src_buf`` is the tensor's index in ``plan.tensors`` (the trainer passes its local
  tensors in that order), ``dst_buf`` the bucket index of rank g.

Geometry of one tensor [rows, cols] (element size e): trainer rank t copies rows [a, b) and its local
tensor starts at row h (h = a when sharded or quantized on the trainer, 0 when replicated); generator
rank g holds the rectangle [r0, r1) x [c0, c1), stored densely. The intersection rows
[max(a, r0), min(b, r1)) give one op:

    src_offset = ((max(a, r0) - h) * cols + c0) * e      src_stride = cols * e
    dst_offset = offset + (max(a, r0) - r0) * (c1 - c0) * e   dst_stride = row_bytes = (c1 - c0) * e

Ops whose rows are contiguous on both sides (c0 = 0, c1 = cols) are folded into a single row. No op
ever needs a gather: every byte goes straight from the trainer rank that holds it to the generator rank
that needs it, and a generator replica receives each byte exactly once.

Refusal (before any geometry): a generator ``tp_size`` that does not divide the number of ``tp_unit``s of
a parameter (the attention or key/value heads of a Llama; ``GeneratorLayout.check_specs``) would put part
of a head on each of two ranks; ``plan_sync`` raises ValueError naming the head counts and the valid sizes.

Validation (run once per plan, independent of how the ops were derived): for every generator rank, the
destination byte intervals of all ops from all trainer ranks are sorted and must be pairwise disjoint,
lie inside the tensors' regions, and add up to the tensors' total size - so every destination byte is
written exactly once; and every op must read inside its source tensor.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from llamarl.weight_sync.layout import GeneratorLayout, ParamSpec, SyncTensor, TrainerLayout, sync_tensors

ALIGN = 256  # byte alignment of every tensor inside a bucket
SLOT_ALIGN = 4096  # slots start on page boundaries


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class Placement:
    """One tensor inside generator rank g's buckets."""

    name: str
    bucket: int
    offset: int  # bytes from the start of the slot
    shape: tuple[int, ...]  # local (sharded) shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BucketLayout:
    """The flat per-dtype buckets of one generator rank (identical for every replica of a TP rank)."""

    dtypes: tuple[torch.dtype, ...]  # bucket i holds tensors of dtypes[i]
    slot_nbytes: tuple[int, ...]  # bytes of one slot of bucket i (page aligned)
    placements: tuple[Placement, ...]  # in plan.tensors order

    def table(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """(name, local shape, dtype) of every tensor: what a peer compares to find a mismatch."""
        return tuple((p.name, p.shape, str(p.dtype).replace("torch.", "")) for p in self.placements)

    def fingerprint(self) -> str:
        h = hashlib.sha256(repr((self.table(), self.slot_nbytes, [p.offset for p in self.placements])).encode())
        return h.hexdigest()[:16]


def _bucket_layout(tensors: Sequence[SyncTensor], generator: GeneratorLayout, rank: int) -> BucketLayout:
    dtypes: list[torch.dtype] = []
    cursor: list[int] = []
    placements = []
    for t in tensors:
        if t.dtype not in dtypes:
            dtypes.append(t.dtype)
            cursor.append(0)
        b = dtypes.index(t.dtype)
        shape = generator.local_shape(t, rank)
        p = Placement(t.name, b, cursor[b], shape, t.dtype)
        cursor[b] = _round_up(cursor[b] + p.nbytes, ALIGN)
        placements.append(p)
    slot = tuple(max(SLOT_ALIGN, _round_up(c, SLOT_ALIGN)) for c in cursor)
    return BucketLayout(tuple(dtypes), slot, tuple(placements))


@dataclass(frozen=True)
class Piece:
    """One rectangle moved from trainer rank ``src`` to generator rank ``dst``: rows [row0, row0+rows),
    cols [col0, col1) of tensor ``tensor`` (an index into plan.tensors)."""

    tensor: int
    src: int
    dst: int
    row0: int
    rows: int
    col0: int
    col1: int


class SyncPlan:
    """A validated copy schedule for (specs, trainer layout, generator layout); build with ``plan_sync``."""

    def __init__(self, specs: Sequence[ParamSpec], trainer: TrainerLayout, generator: GeneratorLayout):
        self.specs = tuple(specs)
        self.trainer = trainer
        self.generator = generator
        self.tensors = sync_tensors(self.specs, generator)
        self.spec_by_name = {s.name: s for s in self.specs}
        by_tp = [_bucket_layout(self.tensors, generator, p) for p in range(generator.tp_size)]
        self.buckets = tuple(by_tp[generator.tp_rank(g)] for g in range(generator.world_size))
        self._pieces: dict[tuple[int, int], tuple[Piece, ...]] = {}
        self._ops: dict[tuple[int, int], np.ndarray] = {}
        for t in range(trainer.world_size):
            for g in range(generator.world_size):
                pieces = tuple(self._make_pieces(t, g))
                self._pieces[(t, g)] = pieces
                self._ops[(t, g)] = self._make_ops(t, g, pieces)
        self.validate()

    # ---- geometry -------------------------------------------------------------------------------
    def source_row0(self, tensor: SyncTensor, t: int) -> int:
        """First row of the trainer rank's local source tensor (quantized halves cover copy rows only)."""
        spec = self.spec_by_name[tensor.param]
        if tensor.kind == "param":
            return self.trainer.held_rows(spec, t)[0]
        return self.trainer.rows(spec, t)[0]

    def source_shape(self, tensor: SyncTensor, t: int) -> tuple[int, ...]:
        """Shape of trainer rank t's local source tensor for ``tensor``."""
        spec = self.spec_by_name[tensor.param]
        if tensor.kind == "param":
            return self.trainer.local_shape(spec, t)
        a, b = self.trainer.rows(spec, t)
        return (b - a, *tensor.shape[1:])

    def _make_pieces(self, t: int, g: int):
        for i, tensor in enumerate(self.tensors):
            a, b = self.trainer.rows(self.spec_by_name[tensor.param], t)
            r0, r1, c0, c1 = self.generator.region(tensor, g)
            lo, hi = max(a, r0), min(b, r1)
            if hi > lo and c1 > c0:
                yield Piece(i, t, g, lo, hi - lo, c0, c1)

    def _make_ops(self, t: int, g: int, pieces: Sequence[Piece]) -> np.ndarray:
        rows = []
        layout = self.buckets[g]
        for pc in pieces:
            tensor = self.tensors[pc.tensor]
            e, cols = tensor.element_size, tensor.cols
            place = layout.placements[pc.tensor]
            r0 = self.generator.region(tensor, g)[0]
            width = (pc.col1 - pc.col0) * e
            src = ((pc.row0 - self.source_row0(tensor, t)) * cols + pc.col0) * e
            dst = place.offset + (pc.row0 - r0) * width
            if pc.col0 == 0 and pc.col1 == cols:  # whole rows: one contiguous block on both sides
                rows.append((pc.tensor, place.bucket, src, dst, 1, pc.rows * width, pc.rows * width, pc.rows * width))
            else:
                rows.append((pc.tensor, place.bucket, src, dst, pc.rows, width, cols * e, width))
        return np.asarray(rows, dtype=np.int64).reshape(-1, 8)

    def pieces(self, t: int, g: int) -> tuple[Piece, ...]:
        return self._pieces[(t, g)]

    def ops(self, t: int, g: int) -> np.ndarray:
        """Indexed copy ops [n, 8] from trainer rank t's local tensors to generator rank g's bucket slot."""
        return self._ops[(t, g)]

    def bytes_moved(self, t: int | None = None) -> int:
        """Bytes written by trainer rank t (all ranks if None) into all generator ranks."""
        ts = range(self.trainer.world_size) if t is None else [t]
        return int(sum((o[:, 4] * o[:, 5]).sum() for tt in ts for g in range(self.generator.world_size)
                       for o in [self._ops[(tt, g)]]))

    # ---- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError unless every destination byte is written exactly once and every read is in bounds."""
        for g in range(self.generator.world_size):
            layout = self.buckets[g]
            for b in range(len(layout.dtypes)):
                self._validate_bucket(g, b, layout)
        for (t, g), ops in self._ops.items():
            for op in ops:
                tensor = self.tensors[op[0]]
                shape = self.source_shape(tensor, t)
                nbytes = int(np.prod(shape)) * tensor.element_size
                end = op[2] + (op[4] - 1) * op[6] + op[5]
                if op[2] < 0 or end > nbytes:
                    raise ValueError(f"plan bug: op {op.tolist()} reads bytes [{op[2]}, {end}) of {tensor.name} on "
                                     f"trainer rank {t}, whose local tensor has {nbytes} bytes")

    def _validate_bucket(self, g: int, b: int, layout: BucketLayout) -> None:
        starts, lens = [], []
        for t in range(self.trainer.world_size):
            ops = self._ops[(t, g)]
            ops = ops[ops[:, 1] == b]
            if not len(ops):
                continue
            reps = ops[:, 4]
            first = np.repeat(ops[:, 3], reps)
            step = np.repeat(ops[:, 7], reps)
            idx = np.arange(int(reps.sum())) - np.repeat(np.cumsum(reps) - reps, reps)
            starts.append(first + idx * step)
            lens.append(np.repeat(ops[:, 5], reps))
        regions = sorted((p.offset, p.offset + p.nbytes, p.name) for p in layout.placements if p.bucket == b)
        need = sum(e - s for s, e, _ in regions)
        if not starts:
            if need:
                raise ValueError(f"plan does not cover generator rank {g} bucket {b}: no op writes its {need} bytes")
            return
        s = np.concatenate(starts)
        n = np.concatenate(lens)
        order = np.argsort(s, kind="stable")
        s, e = s[order], s[order] + n[order]
        if len(s) > 1 and np.any(s[1:] < e[:-1]):
            i = int(np.argmax(s[1:] < e[:-1]))
            raise ValueError(f"plan writes bytes [{s[i + 1]}, {min(e[i], e[i + 1])}) of generator rank {g} bucket {b} "
                             "more than once")
        rs = np.asarray([r[0] for r in regions], dtype=np.int64)
        re_ = np.asarray([r[1] for r in regions], dtype=np.int64)
        k = np.searchsorted(rs, s, side="right") - 1
        bad = (k < 0) | (e > re_[np.clip(k, 0, None)])
        if np.any(bad):
            i = int(np.argmax(bad))
            raise ValueError(f"plan writes bytes [{s[i]}, {e[i]}) of generator rank {g} bucket {b} outside any tensor")
        if int(n.sum()) != need:
            covered = np.zeros(len(regions), dtype=np.int64)
            np.add.at(covered, k, e - s)
            missing = [regions[j][2] for j in range(len(regions)) if covered[j] != regions[j][1] - regions[j][0]]
            raise ValueError(f"plan does not cover every byte of generator rank {g}: {missing[:5]} are incomplete "
                             "(a layout that does not cover a parameter?)")


@functools.lru_cache(maxsize=32)
def _plan_cached(specs: tuple[ParamSpec, ...], trainer: TrainerLayout, generator: GeneratorLayout) -> SyncPlan:
    return SyncPlan(specs, trainer, generator)


def plan_sync(specs: Sequence[ParamSpec], trainer: TrainerLayout, generator: GeneratorLayout) -> SyncPlan:
    """The validated copy schedule for these specs and layouts (computed once per distinct input).

    ValueError, before any planning, if ``generator.tp_size`` would split a parameter inside one of its
    ``tp_unit``s (an attention head; see ``GeneratorLayout.check_specs``)."""
    if not specs:
        raise ValueError("plan_sync needs at least one ParamSpec")
    for s in specs:
        if not isinstance(s, ParamSpec):
            raise TypeError(f"plan_sync expects ParamSpec items, got {type(s).__name__}")
    generator.check_specs(specs)
    return _plan_cached(tuple(specs), trainer, generator)
