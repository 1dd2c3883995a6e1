"""Weight-only quantized linear: y = x · dequantize(q, scale)ᵀ without materialising the dequantized weight.

Math (q[N, K] int8 or float8_e4m3fn codes with one fp32 scale per output channel, from
``llamarl_kernels.quant.quantize``):

    quantized_linear(x, q, scale, bias)[m, n] = scale_n * sum_k x[m, k] * float(q[n, k]) + bias_n

accumulated in fp32, with the scale (and bias) applied once in the epilogue, then rounded to x's dtype.

Layouts: q[N, K] row-major with unit stride along K (row stride may be larger: a slice of a bigger
buffer is fine); scale[N] fp32 contiguous; x[..., K] (flattened to [M, K]); output [..., N] in x's dtype.

Kernels:
- ``_qlinear_kernel``: grid (tiles of [BLOCK_M, BLOCK_N], SPLIT_K).
  BLOCK_M < 16 is the decode GEMV path (no tensor-core padding of M=1 to 16): codes stream through
  registers in vector loads, x is broadcast, products accumulate elementwise in an fp32 register tile
  that is reduced over K once, after the loop (no shuffles inside it), and int8 is upcast by an integer
  add plus one FADD instead of the quarter-rate I2F. BLOCK_M = 1 (batch-1 decode) uses a 2-D
  [BLOCK_N, BLOCK_K] tile in which x is loaded in the codes' own register layout, so the loop has no
  shared-memory layout conversion and no barrier (the 3-D [BLOCK_M, BLOCK_N, BLOCK_K] tile of
  BLOCK_M > 1 moves every code tile through shared memory, with four barriers per tile, in the sm_90
  code of Triton 3.6 and 3.9); PREFETCH keeps the next tiles' loads in flight while a tile is multiplied.
  BLOCK_M >= 16 is the tiled path with ``tl.dot``: weights are upcast in registers to x's dtype
  (exact for int8 and e4m3 in bf16/fp16; fp32 x uses an IEEE fp32 dot).
  SPLIT_K > 1 splits K across programs to fill the GPU when N / BLOCK_N is small; partial sums go to
  an fp32 workspace [SPLIT_K, M, N] and ``_splitk_epilogue_kernel`` adds them in a fixed order
  (deterministic, no atomics), then applies scale and bias.

Numerics: as in ``llamarl_kernels.quant`` (every value upcast to fp32 after its load, the output rounded
onto its grid in fp32 before the exact down-cast), so the GPU and the interpreter produce the same bytes
for the same summation order.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from llamarl_kernels.quant import (
    _FLOAT_DTYPES,
    _OUT_KIND,
    _RNE_MAGIC,
    INTERPRETED,
    _check_pow2,
    _check_qweight,
    _launch_guard,
    _round_for_store,
)


@triton.jit
def _weight_to_f32(w):
    """int8 -> fp32 without the slow I2F conversion: the sign-extended integer added to the bits of
    1.5 * 2**23 is that float plus w, exactly (|w| < 2**22); subtracting 1.5 * 2**23 leaves w.
    float8 -> fp32 is Triton's cast (bit manipulation, no F2F on sm_90)."""
    if w.dtype == tl.int8:
        return (w.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - _RNE_MAGIC
    return w.to(tl.float32)


@triton.jit
def _load_tiles(x_rows, q_rows, mask_m, mask_n, k0, k_end, cols):
    """The x and code tiles at column k0, masked past k_end (a tile wholly past the end reads nothing); both
    the GEMV and the tl.dot path read their tiles with it."""
    mask_k = (k0 + cols < k_end)[None, :]
    x = tl.load(x_rows + (k0 + cols)[None, :], mask=mask_m[:, None] & mask_k, other=0.0)
    w = tl.load(q_rows + (k0 + cols)[None, :], mask=mask_n[:, None] & mask_k, other=0.0)
    return x, w


@triton.jit
def _gemv_fma(acc, x, w, BLOCK_M: tl.constexpr):
    """acc += x * q elementwise, in fp32 (the tile shapes of ``_gemv_partial``)."""
    if BLOCK_M == 1:  # one return statement: Triton checks every return's type, even in a dead branch
        acc += x.to(tl.float32) * _weight_to_f32(w)
    else:
        acc += x.to(tl.float32)[:, None, :] * _weight_to_f32(w)[None, :, :]
    return acc


@triton.jit
def _gemv_partial(x_rows, q_rows, mask_m, mask_n, k_start, k_end, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """sum_k x[m, k] * q[n, k] over [k_start, k_end) on CUDA cores, as [BLOCK_M, BLOCK_N]: products are
    accumulated elementwise in a register tile and reduced across K once, after the loop, so the
    streaming loop has no cross-thread shuffles.

    BLOCK_M = 1 (the grid has one row tile per row of x, so the row always exists): a 2-D
    [BLOCK_N, BLOCK_K] tile. x is loaded as that same 2-D shape (every row of the pointer tile is the one
    row of x; the copies come from L1), and the column offsets are written so that the compiler sees runs
    of VEC contiguous columns, x's 16-byte vector (8 for bf16/fp16): codes and activations then get one
    register layout and nothing moves through shared memory in the loop. BLOCK_M > 1: a 3-D
    [BLOCK_M, BLOCK_N, BLOCK_K] tile (its code tiles go through a shared-memory layout conversion).

    PREFETCH = p > 0 keeps the next p tiles in registers: the loads of tile i + p are issued before tile
    i is multiplied, so a program has p + 1 tiles of loads in flight instead of stalling on each tile's
    latency (a GEMV at M = 1 is latency-bound with few programs per SM); codes are 1 byte, so a tile
    costs BLOCK_N * BLOCK_K / threads bytes of registers. The order of the additions is the same for
    every p."""
    cols = tl.arange(0, BLOCK_K)
    if BLOCK_M == 1:
        VEC: tl.constexpr = 128 // x_rows.dtype.element_ty.primitive_bitwidth
        cols = (cols // VEC) * VEC + cols % VEC  # the same values, seen as runs of VEC contiguous columns
        x_rows = x_rows + tl.zeros([BLOCK_N, 1], tl.int32)  # [BLOCK_N, 1] pointers, all to the row of x
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    if PREFETCH == 0:
        for k0 in range(k_start, k_end, BLOCK_K):
            x, w = _load_tiles(x_rows, q_rows, mask_m, mask_n, k0, k_end, cols)
            acc = _gemv_fma(acc, x, w, BLOCK_M)
    elif PREFETCH == 1:
        x, w = _load_tiles(x_rows, q_rows, mask_m, mask_n, k_start, k_end, cols)
        for k0 in range(k_start, k_end, BLOCK_K):
            x1, w1 = _load_tiles(x_rows, q_rows, mask_m, mask_n, k0 + BLOCK_K, k_end, cols)
            acc = _gemv_fma(acc, x, w, BLOCK_M)
            x, w = x1, w1
    else:
        x, w = _load_tiles(x_rows, q_rows, mask_m, mask_n, k_start, k_end, cols)
        x1, w1 = _load_tiles(x_rows, q_rows, mask_m, mask_n, k_start + BLOCK_K, k_end, cols)
        for k0 in range(k_start, k_end, BLOCK_K):
            x2, w2 = _load_tiles(x_rows, q_rows, mask_m, mask_n, k0 + 2 * BLOCK_K, k_end, cols)
            acc = _gemv_fma(acc, x, w, BLOCK_M)
            x, w = x1, w1
            x1, w1 = x2, w2
    if BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = tl.sum(acc, axis=2)
    return out


@triton.jit
def _dot_partial(x_rows, q_rows, mask_m, mask_n, k_start, k_end, DOT_FP32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The same partial sum with tl.dot on [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles."""
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x, w = _load_tiles(x_rows, q_rows, mask_m, mask_n, k0, k_end, cols)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(_weight_to_f32(w)), acc, input_precision="ieee")
        elif w.dtype == tl.int8:  # bf16/fp16 activations on the GPU: int8 and e4m3 are exact in both
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)  # Triton's int8 cast is bit tricks already
        else:  # e4m3 -> fp32 is bit tricks + HADD2, -> bf16 a packed F2FP; direct e4m3 -> bf16 uses F2F
            acc = tl.dot(x, tl.trans(_weight_to_f32(w).to(x.dtype)), acc)
    return acc


@triton.jit
def _qlinear_kernel(
    x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr, ws_ptr,
    M, N, K, stride_xm, stride_qn, stride_om,
    HAS_BIAS: tl.constexpr, OUT_KIND: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, PREFETCH: tl.constexpr,
):
    # grouped ordering of the (m, n) tiles: GROUP_M row-tiles share each column sweep (L2 reuse of q)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn

    # this program's K range: whole BLOCK_K chunks, the last split may be short or empty
    k_chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_chunk
    k_end = tl.minimum(k_start + k_chunk, K)

    if BLOCK_M >= 16:
        acc = _dot_partial(x_rows, q_rows, mask_m, mask_n, k_start, k_end, DOT_FP32, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _gemv_partial(x_rows, q_rows, mask_m, mask_n, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K, PREFETCH)

    if SPLIT_K == 1:
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        y = acc * scale[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = _round_for_store(y, OUT_KIND)
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
    else:
        ws = ws_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _splitk_epilogue_kernel(
    ws_ptr, scale_ptr, bias_ptr, out_ptr, M, N, stride_om,
    HAS_BIAS: tl.constexpr, OUT_KIND: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        ws = ws_ptr + (s * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        acc += tl.load(ws, mask=mask, other=0.0)
    y = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y = _round_for_store(y, OUT_KIND)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QLinearConfig:
    """Launch parameters of ``_qlinear_kernel``.

    block_m < 16 selects the GEMV path (broadcast-multiply-reduce), block_m >= 16 the ``tl.dot`` path.
    split_k > 1 splits K across programs and adds a deterministic epilogue kernel. prefetch (0, 1 or 2;
    GEMV path only) is how many tiles of codes ahead each program loads (``_gemv_partial``).
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    prefetch: int = 0

    def __post_init__(self):
        _check_pow2(self, ("block_m", "block_n", "block_k"))
        if self.split_k < 1 or self.group_m < 1:
            raise ValueError(f"QLinearConfig needs split_k >= 1 and group_m >= 1, got {self}")
        if self.prefetch not in (0, 1, 2):
            raise ValueError(f"QLinearConfig.prefetch must be 0, 1 or 2 (tiles loaded ahead), got {self.prefetch}")


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def default_qlinear_config(M: int, N: int, K: int, device: torch.device) -> QLinearConfig:
    """Heuristic launch config; tuned by shape class (decode GEMV, small-M dot, prefill tiles)."""
    if INTERPRETED or device.type != "cuda":
        # few, large programs: the interpreter's cost is mostly per program and per loop iteration
        bn, bk = min(256, triton.next_power_of_2(N)), min(256, triton.next_power_of_2(K))
        return QLinearConfig(triton.next_power_of_2(M) if M <= 8 else min(64, triton.next_power_of_2(M)), bn, bk)
    if M == 1:
        # 8 x 512 codes per tile, one tile ahead: 115 registers on sm_90 (4 programs per SM), 32 codes in
        # 4 loads per thread per tile. The alternative (1, 32, 256) measured 24.8 µs (int8) for
        # 4096 -> 14336 on the H200; benchmarks.quant_matmul --sweep compares both
        cfg = QLinearConfig(1, 8, 512, num_warps=4, num_stages=4, prefetch=1)
    elif M <= 16:
        cfg = QLinearConfig(16, 64, 128, num_warps=4, num_stages=4)
    elif M <= 64:
        cfg = QLinearConfig(64, 64, 128, num_warps=4, num_stages=4)
    elif M <= 128:
        cfg = QLinearConfig(64, 128, 64, num_warps=4, num_stages=4)
    else:
        cfg = QLinearConfig(128, 128, 64, num_warps=8, num_stages=3)
    # split K until there are >= 2 programs per SM (keeping >= 4 K-chunks per split): a second launch
    # (the split-K epilogue) is cheaper than leaving SMs idle while a few long programs stream K
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    k_chunks = triton.cdiv(K, cfg.block_k)
    split = 1
    while tiles * split < 2 * _num_sms(device) and k_chunks // (2 * split) >= 4 and split < 16:
        split *= 2
    return dataclasses.replace(cfg, split_k=split)


# ----------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------
def quantized_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: QLinearConfig | None = None,
) -> torch.Tensor:
    """y[..., n] = scale[n] * sum_k x[..., k] * q[n, k] (+ bias[n]), fp32 accumulation, in x's dtype.

    Differentiable in x and bias (q and scale are codes, not trained): with autograd recording it runs through
    ``_QuantizedLinearFn``, whose backward is the eager math (the kernel is the inference path)."""
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _QuantizedLinearFn.apply(x, q, scale, bias, config)
    return _quantized_linear(x, q, scale, bias, config)


class _QuantizedLinearFn(torch.autograd.Function):
    """dL/dx[m, k] = sum_n dL/dy[m, n] * scale[n] * float(q[n, k]), dL/dbias[n] = sum_m dL/dy[m, n] (fp32)."""

    @staticmethod
    def forward(ctx, x, q, scale, bias, config):
        ctx.save_for_backward(q, scale)
        ctx.x_dtype, ctx.bias_dtype = x.dtype, None if bias is None else bias.dtype
        return _quantized_linear(x, q, scale, bias, config)

    @staticmethod
    def backward(ctx, grad_y):
        q, scale = ctx.saved_tensors
        g = grad_y.float()
        grad_x = ((g * scale) @ q.float()).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grad_bias = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None


def _quantized_linear(x, q, scale, bias, config) -> torch.Tensor:
    _check_qweight(q, scale, "quantized_linear")
    N, K = q.shape
    if x.dtype not in _OUT_KIND:
        raise TypeError(f"quantized_linear: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"quantized_linear: x's last dim must equal q's K={K} (q is [N={N}, K={K}]), "
                         f"got x of shape {tuple(x.shape)}")
    tensors = [x, q, scale]
    if bias is not None:
        if bias.shape != (N,) or bias.dtype not in _FLOAT_DTYPES or not bias.is_contiguous():
            raise ValueError(f"quantized_linear: bias must be a contiguous float tensor of shape [{N}], "
                             f"got {bias.dtype} {tuple(bias.shape)}")
        tensors.append(bias)
    guard = _launch_guard(*tensors, op="quantized_linear")

    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.reshape(*lead, N)
    cfg = config or default_qlinear_config(M, N, K, x.device)
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
    else:
        ws = out  # unused by the kernel when SPLIT_K == 1
    dummy_bias = bias if bias is not None else scale
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), cfg.split_k)
    common = dict(HAS_BIAS=bias is not None, OUT_KIND=_OUT_KIND[x.dtype])
    with guard:
        _qlinear_kernel[grid](
            x2, q, scale, dummy_bias, out, ws, M, N, K, x2.stride(0), q.stride(0), out.stride(0),
            DOT_FP32=INTERPRETED or x.dtype == torch.float32,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
            GROUP_M=cfg.group_m, PREFETCH=cfg.prefetch if cfg.block_m < 16 else 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common,
        )
        if cfg.split_k > 1:
            bm, bn = (min(64, triton.next_power_of_2(M)), min(128, triton.next_power_of_2(N))) if INTERPRETED \
                else (min(16, triton.next_power_of_2(M)), 256)
            _splitk_epilogue_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
                ws, scale, dummy_bias, out, M, N, out.stride(0),
                SPLIT_K=cfg.split_k, BLOCK_M=bm, BLOCK_N=bn, **common,
            )
    return out.reshape(*lead, N)
