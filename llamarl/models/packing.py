"""Pack a model's weights into one flat buffer per device, for inference.

``pack_parameters_(model)`` moves every parameter and buffer into one freshly allocated buffer per
device and makes each of them a view into it (``t.data = view``). Values are bitwise unchanged and the
``Parameter`` objects stay the same (optimizers, hooks and ``state_dict`` keep working); only the
storage moves. What that buys a generator:

* Stacked projections (llamarl.models.stacked): tensors are placed dtype by dtype, each group in
  ``named_parameters()`` then ``named_buffers()`` order, at offsets rounded up to ``ALIGN`` = 64 bytes.
  In Hugging Face order a layer's q, k, v projections and its gate, up projections are consecutive (for
  a quantized model: their int8/fp8 codes, and separately their fp32 scales), so whenever their byte
  sizes are multiples of 64 (every Llama shape) they are adjacent and run as one product each.
* Huge pages on the CPU: a decode step streams every weight from memory once per token. With 4 KiB
  pages a stream crosses a page (and a TLB entry) every 4 KiB; on Linux the buffer is an anonymous
  mapping advised ``MADV_HUGEPAGE`` and 2 MiB aligned, so the kernel backs it with 2 MiB pages where it
  can (THP "madvise" or "always" mode). Measured on the 2-core benchmark host, one thread, the 22M
  model's 32000x384 lm_head product: 2.6-3.1 ms on 4 KiB pages, 1.8 ms on huge pages.

Skipped (returns False, nothing changed) when packing would be wrong or pointless: a parameter that is
not a plain dense tensor (FSDP's DTensors, meta tensors), tensors that already are views into a larger
storage (a packed model, or the weight sync's buckets: packing would detach the model from the memory the
trainer writes into), or nothing to pack. A deep copy of a packed model (separate parameters, buffers that
view one copy of the flat buffer, the original's ``weights_key``) is packed anew and gets its own key.

Memory: each tensor's old storage is freed as soon as it is copied (unless something else holds it). On
the CPU the new buffer's pages are only committed as they are written, so the peak stays about one
model plus one tensor (100M-parameter model, 382 MiB: peak RSS 699 -> 701 MiB). A GPU buffer is
committed whole up front, a transient doubling of the model's footprint, so a GPU without that much
free memory (plus 256 MiB) is left unpacked with a RuntimeWarning that says so (``pack_weights=False``
on the engine skips packing outright). Sets ``model.weights_key`` (CUDA-graph decoders key their graphs
by it, see llamarl.generation.cuda_graphs) and ``model.packed_hugepages`` (whether the CPU buffer was
advised for huge pages). Views share the buffer's storage, so ``torch.save`` of a single packed tensor
writes the whole buffer (it saves storages; a whole ``state_dict`` writes it once); ``save_pretrained``
copies each tensor out.
"""

from __future__ import annotations

import mmap
import sys
import warnings

import torch
from torch import nn

ALIGN = 64
HUGE_PAGE = 2 << 20


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def cpu_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """A zero-filled uint8 CPU tensor of ``nbytes`` and whether it was advised for huge pages: on Linux an
    anonymous mapping (kept alive by the tensor), advised before first touch, the tensor starting on a
    2 MiB boundary inside it."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8), False
    # private: an anonymous *shared* mapping is shmem, which the kernel's THP "madvise" mode leaves alone
    mem = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mem.madvise(mmap.MADV_HUGEPAGE)
    flat = torch.frombuffer(mem, dtype=torch.uint8)
    skip = (-flat.data_ptr()) % HUGE_PAGE
    return flat[skip : skip + nbytes], True


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.device.type != "meta"


def owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage's only content (False for a view into a larger buffer: a packed model's
    flat buffer or the weight sync's buckets)."""
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _copy_of_packed(model: nn.Module, tensors) -> bool:
    """Whether ``model`` is a deep copy of a packed model: it carries a packed ``weights_key`` that names
    another buffer. (``copy.deepcopy`` clones parameters one by one but keeps plain-tensor buffers, such
    as a quantized model's codes and scales, as views into one copy of the original's flat buffer.)"""
    key = getattr(model, "weights_key", None)
    return isinstance(key, tuple) and key[:1] == ("packed",) and key[1] != min(t.data_ptr() for t in tensors)


def _layout(group: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], int]:
    """(tensors in packing order, their byte offsets, total bytes): dtype by dtype, ALIGN-aligned."""
    dtypes = list(dict.fromkeys(t.dtype for t in group))
    order = [t for d in dtypes for t in group if t.dtype == d]
    offsets, cursor = [], 0
    for t in order:
        offsets.append(cursor)
        cursor = _round_up(cursor + t.numel() * t.element_size(), ALIGN)
    return order, offsets, max(cursor, 1)


def pack_parameters_(model: nn.Module) -> bool:
    """Move ``model``'s parameters and buffers into one buffer per device (see the module docstring);
    returns whether it did."""
    tensors: dict[int, torch.Tensor] = {}  # id -> tensor; tied parameters appear once
    for _, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t is None or id(t) in tensors:
            continue
        if not _plain(t) or not t.is_contiguous():
            return False
        tensors[id(t)] = t
    if not tensors:
        return False
    if not all(owns_storage(t) for t in tensors.values()) and not _copy_of_packed(model, tensors.values()):
        return False  # views into a larger storage (this model packed, or weight-sync buckets): leave them
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors.values():
        by_device.setdefault(t.device, []).append(t)
    layouts = {device: _layout(group) for device, group in by_device.items()}
    for device, (_, _, nbytes) in layouts.items():
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            # memory torch's caching allocator holds but no tensor uses is free for this buffer too
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            if free < nbytes + (256 << 20):
                warnings.warn(f"pack_parameters_: not packing the model's weights: {device} has {free / 2**30:.2f} GiB "
                              f"free and the packed copy needs {nbytes / 2**30:.2f} GiB while the weights are copied "
                              "(q|k|v and gate|up then run as separate products)", RuntimeWarning, stacklevel=2)
                return False
    hugepages = False
    with torch.no_grad():
        for device, (order, offsets, nbytes) in layouts.items():
            if device.type == "cpu":
                flat, hugepages = cpu_buffer(nbytes)
            else:
                flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for t, off in zip(order, offsets):
                view = flat[off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                view.copy_(t)
                t.data = view
    model.weights_key = ("packed", min(t.data_ptr() for t in tensors.values()))
    model.packed_hugepages = hugepages
    return True
