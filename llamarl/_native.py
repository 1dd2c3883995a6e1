"""Thin Python interface to the native engine ``llamarl._C``.

The extension takes buffers as (address, nbytes) so it never links libtorch; this module turns tensors
into those pairs and schedules into the ``[n, 6]`` int64 layout of ``csrc/copy_engine.h``:
``(src_offset, dst_offset, rows, row_bytes, src_stride, dst_stride)``, all in bytes, meaning
``dst[dst_offset + r*dst_stride : +row_bytes] = src[src_offset + r*src_stride : +row_bytes]`` for each row r.
Every op is bounds-checked in C++ before anything is copied; a bad op raises ValueError naming it.

Indexed schedules (``[n, 8]``: ``src_buf, dst_buf`` first, then the six columns above) run between two
*tables* of buffers, e.g. every parameter shard of a trainer rank into the flat buckets of every
generator rank, in one call (``copy_indexed``).

Memory the engine owns is exposed as Python objects: ``shm_create``/``shm_attach`` give a mapped POSIX
shared-memory segment, ``cuda_bucket``/``cuda_ipc_open`` a device bucket or a peer's bucket opened from
its IPC handle; ``as_tensor`` views any of them as a flat uint8 tensor that keeps the mapping alive.
``SyncTimeout`` (a TimeoutError) and ``PeerDied`` (a RuntimeError) are raised by the version control
block functions ``ctl_*`` (see csrc/sync_ctl.h and llamarl/weight_sync/versioning.py).
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


def _schedule(ops, columns: int, what: str) -> np.ndarray:
    """``ops`` (lists of tuples, arrays, tensors) as a C-contiguous int64 [n, columns] array."""
    if isinstance(ops, torch.Tensor):
        ops = ops.cpu().numpy()
    raw = np.asarray(ops)
    if raw.size and not (np.issubdtype(raw.dtype, np.integer) and not np.issubdtype(raw.dtype, np.bool_)):
        raise ValueError(f"{what} must hold integers (byte offsets, counts, strides), got dtype {raw.dtype}")
    arr = np.ascontiguousarray(raw.astype(np.int64, copy=False))
    if arr.size == 0:
        return np.zeros((0, columns), dtype=np.int64)
    if arr.ndim != 2 or arr.shape[1] != columns:
        raise ValueError(f"{what} must have shape [n, {columns}], got {tuple(arr.shape)}")
    return arr


def as_ops(ops) -> np.ndarray:
    """A schedule as a C-contiguous int64 [n, 6] array (accepts lists of 6-tuples, arrays, tensors)."""
    return _schedule(ops, 6, "a copy schedule")


def _contiguous_bytes(t: torch.Tensor, name: str) -> tuple[int, int]:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (copy ops address it as flat bytes)")
    return t.data_ptr(), t.numel() * t.element_size()


CUDA_ENGINES = ("memcpy", "kernel")


def copy_ops(dst: torch.Tensor, src: torch.Tensor, ops, *, num_threads: int = 1, num_streams: int = 4,
             stream: torch.cuda.Stream | None = None, engine: str = "memcpy") -> None:
    """Run a copy schedule from ``src`` to ``dst`` (both viewed as flat bytes, not overlapping).

    CPU tensors: host threads, returns when done. CUDA tensors, no host synchronisation: ``engine``
    "memcpy" enqueues cudaMemcpy(2D)Async on ``num_streams`` internal streams that ``stream`` (default:
    the current stream) waits on; "kernel" runs the SM copy kernel on ``stream`` (one launch per 384
    segments; ``num_streams`` unused).
    """
    arr = as_ops(ops)
    sp, sn = _contiguous_bytes(src, "src")
    dp, dn = _contiguous_bytes(dst, "dst")
    if src.device == dst.device and sn and dn and sp < dp + dn and dp < sp + sn:
        raise ValueError("copy_ops: src and dst overlap in memory; the engine copies rows concurrently (memcpy, not "
                         "memmove, semantics), so copy through a separate buffer")
    if src.device.type == "cpu" and dst.device.type == "cpu":
        native().copy_ops_cpu(sp, sn, dp, dn, arr, num_threads)
        return
    if src.device.type == "cuda" and dst.device.type == "cuda":
        stream = stream if stream is not None else torch.cuda.current_stream(dst.device)
        native().copy_ops_cuda(sp, sn, dp, dn, arr, num_streams, stream.cuda_stream, dst.device.index or 0, engine)
        return
    raise ValueError(
        f"copy_ops needs src and dst on the same kind of device, got src on {src.device} and dst on "
        f"{dst.device}; stage host<->device copies explicitly"
    )


# ----------------------------------------------------------------------------------------------------
# indexed schedules
# ----------------------------------------------------------------------------------------------------
INDEXED_COLUMNS = ("src_buf", "dst_buf", "src_offset", "dst_offset", "rows", "row_bytes", "src_stride", "dst_stride")


def as_indexed_ops(ops) -> np.ndarray:
    """An indexed schedule as a C-contiguous int64 [n, 8] array (columns: INDEXED_COLUMNS)."""
    if (isinstance(ops, np.ndarray) and ops.dtype == np.int64 and ops.ndim == 2 and ops.shape[1] == 8
            and ops.flags.c_contiguous):
        return ops  # already in the engine's layout (the planner's cached schedules)
    return _schedule(ops, 8, f"an indexed copy schedule ({', '.join(INDEXED_COLUMNS)})")


class BufferTable:
    """Base addresses and byte sizes of a list of buffers (the ``src_buf`` / ``dst_buf`` index space).

    ``BufferTable.of(tensors)`` keeps the tensors alive as long as the table; a table built from raw
    addresses does not, and its creator must keep the memory alive.
    """

    __slots__ = ("ptrs", "nbytes", "_keep")

    def __init__(self, ptrs, nbytes, keep=()):
        self._keep = tuple(keep)
        self.ptrs = np.ascontiguousarray(np.asarray(ptrs, dtype=np.uint64).reshape(-1))
        self.nbytes = np.ascontiguousarray(np.asarray(nbytes, dtype=np.int64).reshape(-1))
        if self.ptrs.shape != self.nbytes.shape:
            raise ValueError(f"BufferTable: {self.ptrs.size} pointers but {self.nbytes.size} sizes")

    @classmethod
    def of(cls, tensors) -> "BufferTable":
        """The table of contiguous tensors (each addressed as flat bytes)."""
        tensors = list(tensors)  # kept below: a generator would be used up by the loop
        ptrs, sizes = [], []
        for i, t in enumerate(tensors):
            ptr, n = _contiguous_bytes(t, f"buffer {i}")
            ptrs.append(ptr)
            sizes.append(n)
        return cls(ptrs, sizes, keep=tensors)

    def __len__(self) -> int:
        return int(self.ptrs.size)


def copy_indexed(dst: BufferTable, src: BufferTable, ops, *, device: torch.device | str = "cpu",
                 num_threads: int = 1, num_streams: int = 4, stream: torch.cuda.Stream | None = None,
                 engine: str = "memcpy") -> None:
    """Run an indexed schedule from the ``src`` buffers to the ``dst`` buffers.

    ``device`` says where both tables live: cpu (host threads, returns when done) or cuda:N (enqueued
    with ``engine`` as in ``copy_ops``, relative to ``stream``, default the current stream of cuda:N).
    """
    arr = as_indexed_ops(ops)
    device = torch.device(device)
    if device.type == "cpu":
        native().copy_indexed_cpu(src.ptrs, src.nbytes, dst.ptrs, dst.nbytes, arr, num_threads)
        return
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = stream if stream is not None else torch.cuda.current_stream(index)
        native().copy_indexed_cuda(src.ptrs, src.nbytes, dst.ptrs, dst.nbytes, arr, num_streams,
                                   stream.cuda_stream, index, engine)
        return
    raise ValueError(f"copy_indexed runs on cpu or cuda buffers, got device {device}")


# ----------------------------------------------------------------------------------------------------
# memory owned by the engine: shared-memory segments, CUDA buckets, CUDA IPC mappings
# ----------------------------------------------------------------------------------------------------
def shm_create(name: str, nbytes: int):
    """Create, reserve (posix_fallocate) and map a new POSIX shared-memory segment owned by this process."""
    return native().ShmSegment.create(name, int(nbytes))


def shm_attach(name: str, nbytes: int):
    """Map an existing segment by name; its size must equal ``nbytes``."""
    return native().ShmSegment.attach(name, int(nbytes))


def shm_unlink(name: str) -> bool:
    """Remove a segment name (False if it was already gone); existing mappings stay valid."""
    return bool(native().shm_unlink(name))


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a live, non-zombie process on this host."""
    return bool(native().pid_alive(int(pid)))


def cuda_bucket(nbytes: int, device: int):
    """A ``cudaMalloc``'d buffer on ``cuda:device`` (its own allocation, so one IPC handle names it)."""
    return native().CudaBuffer(int(nbytes), int(device))


def cuda_ipc_open(handle: bytes, nbytes: int, device: int):
    """Map another process's bucket from its 64-byte IPC handle; closed when the object is dropped."""
    return native().CudaIpcMapping(bytes(handle), int(nbytes), int(device))


def as_tensor(mem) -> torch.Tensor:
    """A flat uint8 tensor over a ShmSegment / CudaBuffer / CudaIpcMapping; it keeps ``mem`` alive."""
    if hasattr(mem, "__cuda_array_interface__"):
        return torch.as_tensor(mem, device=torch.device("cuda", mem.device))
    return torch.frombuffer(mem, dtype=torch.uint8)


def sync_errors() -> tuple[type, type]:
    """(SyncTimeout, PeerDied): the exception classes of the version control block."""
    return native().SyncTimeout, native().PeerDied


def linear_f32_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for fp32 CPU tensors by the native decode kernel (csrc/linear_cpu.cpp): the weight is
    read once for all rows of x, split over ``torch.get_num_threads()`` threads. x is [..., K], weight [N, K]."""
    if x.device.type != "cpu" or weight.device.type != "cpu":
        raise ValueError(f"linear_f32_cpu runs on CPU tensors, got x on {x.device} and weight on {weight.device}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ValueError(f"linear_f32_cpu needs float32 tensors, got {x.dtype} and {weight.dtype}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"shapes do not multiply: x {tuple(x.shape)} @ weight {tuple(weight.shape)}.T")
    return linear_f32_cpu_unchecked(x.contiguous(), weight.contiguous())


def linear_f32_cpu_unchecked(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear_f32_cpu`` for callers that guarantee its preconditions and contiguity (the decode hot path)."""
    N, K = weight.shape
    y = x.new_empty(x.shape[:-1] + (N,))
    if K == 0 or N == 0:  # an empty product: zeros, or nothing (F.linear's result)
        return y.zero_()
    rows = x.numel() // K
    if rows:
        native().linear_f32_cpu(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, K, N, torch.get_num_threads())
    return y
