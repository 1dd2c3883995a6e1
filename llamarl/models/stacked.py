"""Several projections of one input as one product, when their weights lie end to end in memory.

A decoder layer multiplies the same normed activations by W_q, W_k and W_v, and by W_gate and W_up.
When those weights are adjacent in one storage, in that order, the stacked matrix is a free view and

    (x W_qᵀ, x W_kᵀ, x W_vᵀ) = split(x [W_q; W_k; W_v]ᵀ, (n_q, n_k, n_v), dim=-1)

runs as one product: one kernel launch (one native call on the CPU) and one longer pass over the same
bytes instead of three short ones. The generator's flat weight buckets (llamarl.weight_sync: tensors in
state-dict order, 256-byte aligned) and ``pack_parameters_`` (llamarl.models.packing: 64-byte aligned)
both lay the projections out that way for every Llama shape whose projection sizes are multiples of the
alignment; anything else (separately allocated weights, a gap, another dtype or device) simply runs the
separate products.

Numerics: every output element is the same dot product as in the separate products. The CPU decode
kernel computes each weight row's result independently of the rows around it, so there the outputs are
bitwise equal; a BLAS or cuBLAS may block a taller matrix differently (fp32 rounding-level differences).

Used only where autograd needs no gradient through the weights or the input (generation, ``no_grad``
evaluation, frozen reference policies); training runs the separate modules. The outputs are column
slices of one [..., n_q + n_k + n_v] tensor (unit stride in the last dim, rows strided), which every
consumer in the model accepts.

Protocol: a projection module offers ``stack_tensors()`` (the tensors stacked along dim 0: ``(weight,)``
for ``Linear``, ``(qweight, scale)`` for ``QuantizedLinear``; None when it cannot stack, e.g. with a
bias) and ``stacked_forward(x, *stacked)``. The stacked views are cached per (module, group) in a weak
table keyed by the tensors' addresses, so a weight sync that re-points the parameters (``param.data =
view``) is picked up on the next call, and the cache never travels with a pickled or copied model.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
from torch import nn

_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def adjacent_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view [sum of dim 0, *rest] of ``tensors`` if they lie end to end, in order, in one storage (same
    dtype, device, trailing shape, all contiguous); None otherwise."""
    first = tensors[0]
    rest = first.shape[1:]
    storage = first.untyped_storage().data_ptr()
    ptr, rows = first.data_ptr(), 0
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or t.shape[1:] != rest or not t.is_contiguous()
                or t.data_ptr() != ptr or t.untyped_storage().data_ptr() != storage):
            return None
        ptr += t.numel() * t.element_size()
        rows += t.shape[0]
    return first.as_strided((rows, *rest), first.stride(), first.storage_offset())


def project(owner: nn.Module, group: str, x: torch.Tensor,
            modules: Sequence[nn.Module]) -> tuple[torch.Tensor, ...] | None:
    """``tuple(m(x) for m in modules)`` as one stacked product (see the module docstring), or None when the
    modules cannot run stacked right now; ``owner`` / ``group`` name the cache entry (e.g. the attention
    module and "qkv"). Runs once per group per decode step, so the path that finds its cache entry valid
    costs a few microseconds: the tensors' addresses are compared, the rest was checked when it was built."""
    entry = _lookup(owner, group, modules, x)
    if entry is None:
        return None
    return modules[0].stacked_forward(x, *entry[2]).split(entry[3], dim=-1)


def views(owner: nn.Module, group: str, modules: Sequence[nn.Module]) -> tuple[torch.Tensor, ...] | None:
    """The stacked tensors ``project`` would multiply by (e.g. ``(W_qkv,)``), or None; for callers that run
    the product themselves (llamarl.models.cpu_decode). Autograd is the caller's concern here."""
    entry = _lookup(owner, group, modules, None)
    return None if entry is None else entry[2]


def _lookup(owner: nn.Module, group: str, modules: Sequence[nn.Module], x: torch.Tensor | None):
    """The valid cache entry (key, ids, stacked views, sizes) for ``modules`` now, or None."""
    try:
        parts = [m.stack_tensors() for m in modules]
    except AttributeError:  # not a stackable projection type
        return None
    if None in parts:
        return None
    if x is not None and torch.is_grad_enabled() and (
            x.requires_grad or any(t.requires_grad for p in parts for t in p)):
        return None
    key = tuple(t.data_ptr() for p in parts for t in p)
    groups = _CACHE.get(owner)
    if groups is None:
        groups = _CACHE.setdefault(owner, {})
    entry, ids = groups.get(group), tuple(map(id, modules))
    if entry is None or entry[0] != key or entry[1] != ids:
        entry = groups[group] = _entry(key, ids, modules, parts)
    return entry if entry[2] is not None else None


def _entry(key: tuple[int, ...], ids: tuple[int, ...], modules: Sequence[nn.Module],
           parts: list[tuple[torch.Tensor, ...]]) -> tuple:
    """(address key, module ids, stacked views or None, output sizes): stacked only for modules of one type
    (and one backend, for quantized ones) whose tensors are adjacent."""
    kind = type(modules[0])
    if any(type(m) is not kind for m in modules) or len({getattr(m, "backend", None) for m in modules}) != 1:
        return key, ids, None, None
    stacked = tuple(adjacent_view([p[i] for p in parts]) for i in range(len(parts[0])))
    if any(s is None for s in stacked):
        return key, ids, None, None
    return key, ids, stacked, [p[0].shape[0] for p in parts]
