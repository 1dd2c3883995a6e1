"""Trainer-side source tensors of a sync: shard checks and quantize-on-sync.

A trainer rank calls ``sync(shards, version)`` with its local tensors (name -> tensor, the layout's
shapes). ``TrainerSources.assemble`` checks them (every parameter present, nothing unknown, exact local
shape, dtype, device, contiguity) and returns the plan's source list, in ``plan.tensors`` order.

Quantize-on-sync (generator layout with ``quant="int8"|"fp8"``): each quantized weight becomes two
sources, ``q`` and ``scale``, computed on the trainer rank from the rows it copies (its FSDP dim-0 shard,
or its share of the rows when replicated). Quantization is per row,

    scale_r = max_k |W[r, k]| / QMAX  (1 where 0),   q[r, k] = round(clamp(W[r, k] * inv_r, +-QMAX))

with inv_r = 1 / scale_r rounded to fp32, once per row (llamarl_kernels.quant states the exact rule,
with its range guard for tiny scales); so a dim-0 shard quantizes independently and gives exactly the
bytes of quantize(W)[a:b]; and since a trainer rank owns whole rows, the scale of a row is computed from
the full row even when the generator splits that row over TP ranks (row-parallel o/down: each TP rank
receives a column slice of q and all scales). The generator side does no work at all. Two ways the bytes
get there:
  direct   (kernel quantizer, destination holds whole rows: column-parallel or unsplit weights) the
           kernel writes q and scale straight into the bucket slot (``quantize(w, mode, out=views)``):
           read 2 B + write 1 B per bf16 weight, less traffic than copying the bf16 weight itself;
  staged   (row-parallel destinations, or the eager quantizer) q/scale are computed into trainer
           buffers and then move through the copy plan like any other tensor.

Quantizers: ``"kernel"`` = ``llamarl_kernels.quantize`` (Triton; writes into preallocated outputs),
``"torch"`` = ``llamarl_kernels.reference.quantize_ref`` (the eager specification), ``"auto"`` = the
kernel for CUDA tensors and the eager reference for CPU tensors (Triton runs on a CPU only in its
interpreter, which is a test tool, not a fast path).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from llamarl.weight_sync.layout import QUANT_DTYPES
from llamarl.weight_sync.planner import SyncPlan

QUANTIZERS = ("auto", "kernel", "torch")


def resolve_quantizer(name: str, device: torch.device) -> str:
    if name not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {name!r}")
    if name == "auto":
        return "kernel" if device.type == "cuda" else "torch"
    return name


class TrainerSources:
    """Builds trainer rank ``rank``'s source tensors for ``plan`` from its shards."""

    def __init__(self, plan: SyncPlan, rank: int, device: torch.device | str, quantizer: str = "auto"):
        plan.trainer._check_rank(rank)
        self.plan = plan
        self.rank = rank
        self.device = torch.device(device)
        self.quantizer = resolve_quantizer(quantizer, self.device)
        self.expected = {s.name: (plan.trainer.local_shape(s, rank), s.dtype) for s in plan.specs}
        self._qout: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._quantize: Callable | None = None
        if plan.generator.quant is not None:
            if self.quantizer == "kernel":
                from llamarl_kernels import quantize  # noqa: PLC0415 - Triton only when it is used

                self._quantize = quantize
            else:
                from llamarl_kernels.reference import quantize_ref  # noqa: PLC0415

                self._quantize = quantize_ref

    def check(self, shards: Mapping[str, torch.Tensor]) -> None:
        """Raise with the first problem: missing/unknown names, shapes, dtypes, devices, layout."""
        if not isinstance(shards, Mapping):
            raise TypeError(f"shards must be a mapping name -> tensor, got {type(shards).__name__}")
        missing = [n for n in self.expected if n not in shards]
        unknown = [n for n in shards if n not in self.expected]
        if missing or unknown:
            raise ValueError(f"trainer rank {self.rank}: shards do not match the plan: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unknown {unknown[:5]}"
                             f"{' ...' if len(unknown) > 5 else ''} (the layout does not cover these parameters)")
        for name, (shape, dtype) in self.expected.items():
            t = shards[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"trainer rank {self.rank}: shard {name!r} is a {type(t).__name__}, not a tensor")
            if tuple(t.shape) != shape:
                raise ValueError(f"trainer rank {self.rank}: shard {name!r} has shape {list(t.shape)}, the "
                                 f"{'replicated' if self.plan.trainer.replicated else 'dim-0 sharded'} layout over "
                                 f"{self.plan.trainer.world_size} ranks expects {list(shape)}")
            if t.dtype != dtype:
                raise TypeError(f"trainer rank {self.rank}: shard {name!r} is {t.dtype}, the plan expects {dtype}")
            same = t.device == self.device or (t.device.type == self.device.type == "cuda"
                                               and self.device.index is None)
            if not same:
                raise ValueError(f"trainer rank {self.rank}: shard {name!r} is on {t.device}, this sender works "
                                 f"on {self.device}")
            if not t.is_contiguous():
                raise ValueError(f"trainer rank {self.rank}: shard {name!r} is not contiguous; pass .contiguous()")

    def assemble(self, shards: Mapping[str, torch.Tensor], skip: frozenset[str] = frozenset()) -> list[torch.Tensor]:
        """The source tensors in plan.tensors order (quantizing where the generator layout says so).

        ``skip``: quantized parameters whose q/scale no copy op reads (the sender quantized them
        straight into the buckets); they get empty placeholders.
        """
        self.check(shards)
        out: list[torch.Tensor] = []
        quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for tensor in self.plan.tensors:
            if tensor.kind == "param":
                out.append(shards[tensor.name])
                continue
            if tensor.param in skip:
                out.append(torch.empty(0, dtype=tensor.dtype, device=self.device))
                continue
            if tensor.param not in quantized:
                quantized[tensor.param] = self._quantize_rows(tensor.param, shards[tensor.param])
            q, scale = quantized[tensor.param]
            out.append(q if tensor.kind == "qweight" else scale)
        return out

    def copy_rows(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        """The rows of ``shard`` this rank copies (and quantizes): [a, b) of the full weight."""
        spec = self.plan.spec_by_name[name]
        a, b = self.plan.trainer.rows(spec, self.rank)
        h = self.plan.trainer.held_rows(spec, self.rank)[0]
        return shard[a - h:b - h]

    def quantize_into(self, w: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor) -> None:
        """Quantize rows ``w`` straight into destination views (kernel only: it takes ``out=``)."""
        if self.quantizer != "kernel":
            raise RuntimeError("quantize_into needs quantizer='kernel'")
        self._quantize(w, self.plan.generator.quant, out=(q_out, scale_out))

    def _quantize_rows(self, name: str, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.plan.spec_by_name[name]
        w = self.copy_rows(name, shard)
        mode = self.plan.generator.quant
        if w.shape[0] == 0:
            return (torch.empty((0, spec.cols), dtype=QUANT_DTYPES[mode], device=shard.device),
                    torch.empty((0,), dtype=torch.float32, device=shard.device))
        if self.quantizer == "kernel":
            if name not in self._qout:
                self._qout[name] = (torch.empty(tuple(w.shape), dtype=QUANT_DTYPES[mode], device=w.device),
                                    torch.empty((w.shape[0],), dtype=torch.float32, device=w.device))
            return self._quantize(w, mode, out=self._qout[name])
        q, scale = self._quantize(w, mode)
        return q.contiguous(), scale.reshape(-1).to(torch.float32).contiguous()
