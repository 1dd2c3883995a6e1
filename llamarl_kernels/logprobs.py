"""Fused token log-probs and entropy from the last hidden states, without materialising [N, V] logits.

For rows i of ``hidden [N, D]``, lm_head ``weight [V, D]`` and ``targets [N]`` (ids in [0, V)), with
z_i = hidden_i · weightᵀ (the raw logits, in the dtype of the inputs) and T the sampling temperature:

    lse_i      = log Σ_j exp(z_ij / T)
    logprob_i  = z_{i, y_i} / T − lse_i                  = log_softmax(z_i.float() / T)[y_i]
    entropy_i  = − Σ_j p_ij log p_ij,  p_ij = exp(z_ij / T − lse_i)

exactly the convention of ``llamarl.algorithms.token_logprobs`` and the generation engine.

How: the N rows are processed in chunks of C rows. Per chunk, cuBLAS writes the logits ``[C, V]`` into
one reused buffer (input dtype, fp32 accumulation inside the GEMM), then one Triton program per row
streams the row in blocks of BLOCK_V with an online softmax in fp32 — a running max m, s = Σ exp(z' − m)
and t = Σ exp(z' − m)·(z' − m), rescaled whenever m grows — so that lse = m + log s and the entropy
H = log s − t / s need no second pass and no cancellation between two large numbers. Extra memory is
the chunk buffer, C·V elements (C is chosen so that it stays under ``LOGITS_CHUNK_BYTES``), plus two fp32
vectors [N]. Row offsets are int64 so that C·V may exceed 2³¹.

``softmax_row_stats`` (the online pass) and the launch helpers are shared with ``aipo_loss.py``.

Triton on CPU: kernels run only under ``TRITON_INTERPRET=1`` set before this module is imported. The
interpreter has no bf16 arithmetic, so every load is upcast to fp32 at once, and it cannot autotune,
so block sizes are fixed (smaller when interpreting). CPU tests use fp32 inputs.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Read once, like @triton.jit does when it decides between compiling and interpreting.
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOGITS_CHUNK_BYTES = 768 * 2**20  # budget for the [C, V] logits buffer of one chunk
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RowLaunch:
    """Fixed launch configuration of the per-row kernels (one program per row of the chunk)."""

    block_v: int
    num_warps: int


def row_launch(vocab: int) -> RowLaunch:
    """BLOCK_V and warps: wide blocks for the GPU, small fixed ones for the interpreter."""
    if INTERPRETING:
        return RowLaunch(block_v=min(256, triton.next_power_of_2(vocab)), num_warps=1)
    return RowLaunch(block_v=min(4096, triton.next_power_of_2(vocab)), num_warps=8)


def chunk_rows(n_rows: int, vocab: int, dtype: torch.dtype, chunk_size: int | None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else as many as fit in ``LOGITS_CHUNK_BYTES``."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
        return min(chunk_size, n_rows)
    max_rows = max(1, LOGITS_CHUNK_BYTES // (vocab * (torch.finfo(dtype).bits // 8)))
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // n_chunks)  # balanced chunks rather than a small remainder
    if n_chunks > 1 and rows >= 256:
        rows = min(max_rows, -(-rows // 128) * 128)  # whole GEMM tiles
    return rows


def check_device_runnable(where: str, device: torch.device) -> None:
    """Triton needs CUDA, or the interpreter for CPU tensors; say so instead of failing deep inside."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and INTERPRETING:
        return
    if device.type == "cpu":
        raise RuntimeError(
            f"{where}: CPU tensors need the Triton interpreter; set TRITON_INTERPRET=1 before importing "
            "llamarl_kernels (tests/conftest.py does this), or move the tensors to a CUDA device"
        )
    raise RuntimeError(f"{where}: unsupported device {device}; use a CUDA device (or CPU with TRITON_INTERPRET=1)")


def check_hidden_weight_targets(
    where: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> None:
    """Shape, dtype, device and range checks shared by the fused kernels."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"{where}: hidden must be [N, D], got shape {tuple(hidden.shape)}; "
                         "flatten [B, T, D] with hidden.reshape(-1, D)")
    if weight.dim() != 2:
        raise ValueError(f"{where}: weight (lm_head) must be [V, D], got shape {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{where}: hidden is [N, D={hidden.shape[1]}] but weight is [V, D={weight.shape[1]}]; "
                         "the hidden size must match")
    if hidden.shape[0] == 0 or weight.shape[0] == 0:
        raise ValueError(f"{where}: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be non-empty")
    if hidden.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{where}: hidden dtype {hidden.dtype} not supported; use one of {SUPPORTED_DTYPES}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{where}: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}; cast one")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise ValueError(f"{where}: hidden ({hidden.device}), weight ({weight.device}) and targets "
                         f"({targets.device}) must be on one device")
    check_device_runnable(where, hidden.device)
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: targets must be int64 or int32 token ids, got {targets.dtype}")
    if tuple(targets.shape) != (hidden.shape[0],):
        raise ValueError(f"{where}: targets has shape {tuple(targets.shape)}, expected [N] = ({hidden.shape[0]},)")
    vocab = weight.shape[0]
    lo, hi = targets.min().item(), targets.max().item()
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{where}: targets must lie in [0, V={vocab}), got values in [{lo}, {hi}]; "
                         "give masked/padding rows any valid id")
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{where}: temperature must be a finite number > 0 (1.0 for greedy), got {temperature!r}")


@triton.jit
def softmax_row_stats(row_ptr, target, V, temperature, BLOCK_V: tl.constexpr):
    """One streaming pass over a row of raw logits z: (lse, logprob of target, entropy) of softmax(z / T).

    The running max m is the block-wide max (one cross-warp reduction per block of BLOCK_V); the sums
    s = Σ exp(z' − m) and t = Σ exp(z' − m)·(z' − m) are kept per lane, rescaled with the block-wide m
    when it grows, and reduced across the block once, after the loop (so the loop does one cross-warp
    reduction per block: 3 barriers on sm_90, against 9 if s and t were reduced per block too)."""
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max of z' (a scalar: every lane shares the reference point)
    s = tl.zeros([BLOCK_V], tl.float32)  # per lane: Σ exp(z' − m)
    t = tl.zeros([BLOCK_V], tl.float32)  # per lane: Σ exp(z' − m)·(z' − m)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)  # 0 on the first block, where m = -inf
        e = tl.exp(z - m_new)  # 0 on the padding lanes
        d = e * tl.where(e > 0, z - m_new, 0.0)  # the where keeps 0·(−inf) out
        # moving the reference point of t from m to m_new adds s·(m − m_new); on the first block m = −inf
        # and s = 0, so the shift is taken as 0 rather than computing 0·(−inf)
        shift = tl.where(m > float("-inf"), m - m_new, 0.0)
        t = scale * (t + s * shift) + d
        s = s * scale + e
        m = m_new
    s_sum = tl.sum(s, axis=0)
    log_s = tl.log(s_sum)
    z_target = tl.load(row_ptr + target).to(tl.float32) / temperature
    # (z'_y − m) − log s rounds like log_softmax does; z'_y − (m + log s) would round lse first
    return m + log_s, (z_target - m) - log_s, log_s - tl.sum(t, axis=0) / s_sum


@triton.jit
def _logprobs_kernel(
    logits_ptr, stride_row, targets_ptr, logprobs_ptr, entropy_ptr, V, temperature, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    _, logprob, entropy = softmax_row_stats(row_ptr, target, V, temperature, BLOCK_V)
    tl.store(logprobs_ptr + row, logprob)
    tl.store(entropy_ptr + row, entropy)


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [N], entropy [N])`` in fp32 of ``targets`` under ``softmax(hidden @ weightᵀ / T)``.

    No gradient (use it for reference-policy log-probs and mismatch metrics; the trainable path is
    ``fused_aipo_loss``). ``chunk_size`` overrides the rows per chunk.
    """
    check_hidden_weight_targets("fused_logprobs", hidden, weight, targets, temperature)
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows = chunk_rows(n_rows, vocab, hidden.dtype, chunk_size)
    launch = row_launch(vocab)
    targets = targets.contiguous()
    logprobs = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        buffer = torch.empty((rows, vocab), dtype=hidden.dtype, device=hidden.device)
        for start in range(0, n_rows, rows):
            stop = min(start + rows, n_rows)
            logits = buffer[: stop - start]
            torch.matmul(hidden[start:stop], weight.t(), out=logits)
            _logprobs_kernel[(stop - start,)](
                logits, logits.stride(0), targets[start:stop], logprobs[start:stop], entropy[start:stop],
                vocab, float(temperature), BLOCK_V=launch.block_v, num_warps=launch.num_warps,
            )
    return logprobs, entropy
