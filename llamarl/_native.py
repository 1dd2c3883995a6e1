"""Thin Python interface to the native engine ``llamarl._C``.

The extension takes buffers as (address, nbytes) so it never links libtorch; this module turns tensors
into those pairs and schedules into the ``[n, 6]`` int64 layout of ``csrc/copy_engine.h``:
``(src_offset, dst_offset, rows, row_bytes, src_stride, dst_stride)``, all in bytes, meaning
``dst[dst_offset + r*dst_stride : +row_bytes] = src[src_offset + r*src_stride : +row_bytes]`` for each row r.
Every op is bounds-checked in C++ before anything is copied; a bad op raises ValueError naming it.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=None)
def native():
    """The compiled module, or an ImportError that says how to build it."""
    try:
        from llamarl import _C
    except ImportError as e:  # pragma: no cover - exercised only on broken installs
        raise ImportError(
            "llamarl._C (the native copy engine) is not built. Install the package so the extension "
            "compiles: `pip install -e .` (add --no-build-isolation offline). "
            f"Original error: {e}"
        ) from e
    return _C


def build_info() -> dict:
    """What the native engine was compiled with: CUDA or not, CUDA version and archs, compiler."""
    return dict(native().build_info())


def as_ops(ops) -> np.ndarray:
    """A schedule as a C-contiguous int64 [n, 6] array (accepts lists of 6-tuples, arrays, tensors)."""
    if isinstance(ops, torch.Tensor):
        ops = ops.cpu().numpy()
    arr = np.ascontiguousarray(np.asarray(ops, dtype=np.int64))
    if arr.size == 0:
        return np.zeros((0, 6), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != 6:
        raise ValueError(f"a copy schedule must have shape [n, 6], got {tuple(arr.shape)}")
    return arr


def _contiguous_bytes(t: torch.Tensor, name: str) -> tuple[int, int]:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (copy ops address it as flat bytes)")
    return t.data_ptr(), t.numel() * t.element_size()


def copy_ops(dst: torch.Tensor, src: torch.Tensor, ops, *, num_threads: int = 1, num_streams: int = 4,
             stream: torch.cuda.Stream | None = None) -> None:
    """Run a copy schedule from ``src`` to ``dst`` (both viewed as flat bytes).

    CPU tensors: host threads, returns when done. CUDA tensors: enqueued on ``num_streams`` internal
    streams that ``stream`` (default: the current stream) waits on; no host synchronisation.
    """
    arr = as_ops(ops)
    sp, sn = _contiguous_bytes(src, "src")
    dp, dn = _contiguous_bytes(dst, "dst")
    if src.device.type == "cpu" and dst.device.type == "cpu":
        native().copy_ops_cpu(sp, sn, dp, dn, arr, num_threads)
        return
    if src.device.type == "cuda" and dst.device.type == "cuda":
        stream = stream if stream is not None else torch.cuda.current_stream(dst.device)
        native().copy_ops_cuda(sp, sn, dp, dn, arr, num_streams, stream.cuda_stream, dst.device.index or 0)
        return
    raise ValueError(
        f"copy_ops needs src and dst on the same kind of device, got src on {src.device} and dst on "
        f"{dst.device}; stage host<->device copies explicitly"
    )
