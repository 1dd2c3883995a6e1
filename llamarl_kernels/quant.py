"""Weight-only int8 / fp8 quantization: per-output-channel quantize and dequantize.

Math (one scale per output channel, i.e. per row r of a weight W[R, K]):

    absmax_r = max_k |W[r, k]|                  (fp32, exact: max is order-independent)
    scale_r  = absmax_r / QMAX                  QMAX = 127 (int8) or 448 (fp8 e4m3fn), IEEE division
    scale_r  = 1.0   if scale_r == 0            (all-zero row, or absmax so tiny the division underflows)
    p_r      = 2**64 if scale_r < 2**-64 else 1
    inv_r    = 1 / (scale_r * p_r)              IEEE division, once per row; 2**-122 < inv_r <= 2**85
    v        = clamp((W[r, k] * p_r) * inv_r, -QMAX, QMAX)      fp32 products, round to nearest
    int8:  q = round_half_to_even(v)            in [-127, 127]; -128 is never produced
    fp8:   q = e4m3fn(v)                        round-to-nearest-even onto the e4m3fn grid, |q| <= 448

    dequantize(q, scale)[r, k] = float(q[r, k]) * scale_r

The reciprocal: rho_r = 1 / scale_r rounded to 24 significant bits and v = fl(W * rho_r), one multiply
per element instead of a division: v = (W / scale_r)(1 + d) with |d| < 2**-23 where v is normal (two
roundings instead of one), so the round-trip error is a quantization half-step plus that. rho_r inverts
the rounded scale that dequantize multiplies by, not QMAX / absmax_r, which differs from it by an ulp
(far more where scale_r is subnormal and keeps few significant bits). 1 / scale_r overflows fp32 once
scale_r < 2**-128; p_r keeps it in range without changing v: scale_r * p_r is exact and >= 2**-85, so
inv_r = rho_r / p_r, and scale_r < 2**-64 means absmax_r < QMAX * 2**-64, so W * p_r is exact and
(W * p_r) * inv_r = fl(W * rho_r). Real weights have p_r = 1 in every row; the kernel skips the
multiply by p_r in a block where no row needs it.

The zero-row rule: a row whose scale would be 0 gets scale 1.0, hence p_r = inv_r = 1; every |W| in it
is then below the smallest positive fp32 times QMAX, so v = W rounds to 0 and dequantization gives exact
zeros, with no division by zero and no inf anywhere. fp8 saturates: v is clamped to +-448 before
rounding, so finite input never produces NaN (e4m3fn has no infinity; its only NaN is 0x7F/0xFF).
Input must be finite: an inf gives scale inf, so the row's finite entries get code 0 and dequantize to
NaN (0 * inf), and the inf entry's own code is unspecified (the kernel and the reference differ); a row
holding a NaN gets a NaN scale (its codes are meaningless). Either way a diverged weight shows up as NaN
outputs rather than as finite garbage; nothing raises, to stay sync-free.

Quantization is row-local, so quantizing a row-slice W[a:b] (a trainer shard) gives exactly the bytes
of quantize(W)[a:b]: this is what lets the weight sync quantize each shard where it lives.

The matmul on these codes, ``quantized_linear``, lives in ``llamarl_kernels.qlinear``; this module
holds the format (rounding rules, checks) that both share.

Layouts: W[R, K] and q[R, K] row-major with unit stride along K (row stride may be larger: a slice of a
bigger buffer is fine); scale[R] fp32 contiguous.

Kernels:
- ``_quantize_kernel``: BLOCK_R rows per program. When BLOCK_K >= K (the default for K <= 16384) the
  row block is loaded once and quantized from registers (one HBM read; on an H200 on 2026-11-30, with
  a division per element, fp8 still ran compute-bound at 1.3-2.2 TB/s, hence the per-row reciprocal,
  and on the GPU the fp8 rounding is the hardware e4m3 conversion: 555 instead of 1259 PTX instructions
  for a 2 x 4096 block); otherwise two passes over K (absmax, then quantize; the second pass re-reads
  the block, from L2).

Numerics shared by the GPU and the interpreter (TRITON_INTERPRET=1 on CPU): the interpreter has no bf16
arithmetic and its float down-casts do not round to nearest even, so every value is upcast to fp32
right after its load, and every down-cast first rounds in fp32 onto the target grid (integer bit tricks
for bf16, a power-of-two ``ulp`` for e4m3 and fp16), after which the cast itself is exact; compiled for
a GPU, the fp8 codes skip that step because the GPU's own e4m3 conversion rounds to nearest even (see
``_quantize_values``). Both backends therefore produce the bytes of torch's ``.to(dtype)``. bf16
weights enter ``quantize`` as int16 bits and are widened by a shift (the interpreter's own bf16 cast
mishandles subnormals); bf16 activations and outputs use the ordinary cast, so under the interpreter only,
bf16 values below 2^-126 (subnormals) convert to wrong values (measured 1.5-20x off, not flushed to 0), in
dequantize's output and in qlinear's input and output alike; normal values are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

QMAX = {"int8": 127.0, "fp8": 448.0}
QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# 1.5 * 2**23: adding and subtracting it rounds any |v| < 2**22 to an integer, half to even.
_RNE_MAGIC = tl.constexpr(12582912.0)
# rows with a scale below 2**-64 are multiplied by 2**64 before the reciprocal (module docstring: p_r)
_TINY_SCALE = tl.constexpr(2.0**-64)
_PRESCALE = tl.constexpr(2.0**64)


# ----------------------------------------------------------------------------------------------------
# rounding helpers (fp32 in, fp32 out on the target grid)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _round_to_int(v):
    """Round-half-to-even to an integer, exact for |v| < 2**22 (one rounding in the add)."""
    return (v + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def _round_to_grid(v, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """RNE of fp32 ``v`` onto a float grid with MANTISSA bits and min normal exponent MIN_EXP.

    With exp = max(exponent(v), MIN_EXP), ulp = 2**(exp - MANTISSA) and its reciprocal are built from
    the exponent bits; |v| * (1 / ulp) < 2**(MANTISSA + 1) is rounded with the magic constant and
    scaled back by ulp (every product exact: powers of two). exp is in [MIN_EXP, 128] (128: inf/NaN,
    which stay inf/NaN), so both are normal fp32 for every caller: biased exponents of 1 / ulp in
    [MANTISSA - 1, MANTISSA - MIN_EXP + 127] and of ulp in [MIN_EXP - MANTISSA + 127, 255 - MANTISSA],
    i.e. [2, 136] and [118, 252] for e4m3 (3, -6), [9, 151] and [103, 245] for fp16 (10, -14). The
    sign is restored from the bits so -0.0 and negative values that round to zero keep it, as torch does.
    """
    bits = v.to(tl.uint32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, MIN_EXP)
    ulp = ((exp - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((MANTISSA - exp + 127) << 23).to(tl.float32, bitcast=True)
    # the compiler may contract |v| * inv_ulp + MAGIC into one FMA: still exact, the product is exact
    mag = _round_to_int(tl.abs(v) * inv_ulp) * ulp
    return (mag.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _round_for_store(v, OUT_KIND: tl.constexpr):
    """Round fp32 ``v`` to the grid of the output dtype (0 fp32, 1 bf16, 2 fp16); NaN stays NaN."""
    if OUT_KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    elif OUT_KIND == 2:
        r = _round_to_grid(v, 10, -14)
        r = tl.where(tl.abs(r) > 65504.0, tl.where(r > 0, float("inf"), float("-inf")), r)  # RNE overflow
        v = tl.where(v != v, v, r)
    return v


# ----------------------------------------------------------------------------------------------------
# quantize / dequantize
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_weight_f32(ptrs, mask, BF16_BITS: tl.constexpr):
    """Load and upcast to fp32. BF16_BITS: the tensor is bf16 passed as int16 bits, upcast by a shift
    (exact for every bf16 value, subnormals included, which the interpreter's own cast flushes)."""
    if BF16_BITS:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row_scale(absmax, has_nan, QMAX_: tl.constexpr):
    """Per-row (scale, pre, inv) from absmax [R]: scale = absmax / QMAX, 1.0 where that is 0, NaN where
    the row holds a NaN (has_nan [R]: max drops NaN, so the row's NaN is put back explicitly);
    pre = 2**64 where scale < 2**-64, else 1; inv = 1 / (scale * pre). IEEE divisions (div_rn)."""
    scale = tl.math.div_rn(absmax, QMAX_)
    scale = tl.where(scale == 0.0, 1.0, scale)
    scale = tl.where(has_nan, float("nan"), scale)
    pre = tl.where(scale < _TINY_SCALE, _PRESCALE, 1.0)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale * pre)
    return scale, pre, inv


@triton.jit
def _quantize_values(w, inv, QMAX_: tl.constexpr, IS_FP8: tl.constexpr, Q_TY: tl.constexpr, HW_ROUND: tl.constexpr):
    """Codes of w [R, K] (fp32, p_r already applied) for the per-row inv [R]: RNE of clamp(w * inv, +-QMAX).
    Only the clamp consumes w * inv, never an add, so no FMA contraction can change its rounding.
    fp8 with HW_ROUND (compiled for a GPU): the cast itself is sm_89+'s cvt.rn.satfinite.e4m3x2.f32,
    round-to-nearest-even with subnormals and the sign of zero, so it gives the software rounding's bytes
    (v is clamped to +-448 first, so satfinite never acts) in one instruction per two values instead of
    a dozen per value; the interpreter's cast does not round to nearest even, so it keeps the software
    ``_round_to_grid``."""
    v = w * inv[:, None]
    v = tl.minimum(tl.maximum(v, -QMAX_), QMAX_)
    if IS_FP8 and HW_ROUND:
        q = v.to(Q_TY, fp_downcast_rounding="rtne")
    elif IS_FP8:
        q = _round_to_grid(v, 3, -6).to(Q_TY)
    else:
        q = _round_to_int(v).to(tl.int8)
    return q


@triton.jit
def _quantize_store(q_ptrs, mask, w, pre, inv, any_pre, QMAX_: tl.constexpr, IS_FP8: tl.constexpr,
                    HW_ROUND: tl.constexpr):
    """Store the codes of w [R, K] (fp32) for the per-row pre, inv [R] of ``_row_scale``: RNE of
    clamp((w * pre) * inv, +-QMAX). The exact w * pre runs only in a block where some row has pre != 1
    (any_pre, a scalar), so real weights pay one multiply per element. Each branch holds its own store,
    which keeps the compiler from flattening the branch into a multiply and a select per element."""
    q_ty = q_ptrs.dtype.element_ty
    if any_pre:
        tl.store(q_ptrs, _quantize_values(w * pre[:, None], inv, QMAX_, IS_FP8, q_ty, HW_ROUND), mask=mask)
    else:
        tl.store(q_ptrs, _quantize_values(w, inv, QMAX_, IS_FP8, q_ty, HW_ROUND), mask=mask)


@triton.jit
def _quantize_kernel(
    w_ptr, q_ptr, scale_ptr, R, K, stride_w, stride_q,
    QMAX_: tl.constexpr, IS_FP8: tl.constexpr, W_BF16_BITS: tl.constexpr, HW_ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_TILE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)

    if SINGLE_TILE:  # BLOCK_K >= K: the row block is read from memory once and stays in registers
        mask = row_mask[:, None] & (cols < K)[None, :]
        w = _load_weight_f32(w_ptr + rows64[:, None] * stride_w + cols[None, :], mask, W_BF16_BITS)
        scale, pre, inv = _row_scale(tl.max(tl.abs(w), axis=1), tl.max((w != w).to(tl.int32), axis=1) > 0, QMAX_)
        tl.store(scale_ptr + rows64, scale, mask=row_mask)
        _quantize_store(q_ptr + rows64[:, None] * stride_q + cols[None, :], mask, w, pre, inv,
                        tl.max(pre, axis=0) > 1.0, QMAX_, IS_FP8, HW_ROUND)
    else:
        amax = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
        nans = tl.zeros([BLOCK_R, BLOCK_K], tl.int32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k0 + cols < K)[None, :]
            w = _load_weight_f32(w_ptr + rows64[:, None] * stride_w + (k0 + cols)[None, :], mask, W_BF16_BITS)
            amax = tl.maximum(amax, tl.abs(w))
            nans = tl.maximum(nans, (w != w).to(tl.int32))
        scale, pre, inv = _row_scale(tl.max(amax, axis=1), tl.max(nans, axis=1) > 0, QMAX_)
        tl.store(scale_ptr + rows64, scale, mask=row_mask)
        any_pre = tl.max(pre, axis=0) > 1.0

        for k0 in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k0 + cols < K)[None, :]
            w = _load_weight_f32(w_ptr + rows64[:, None] * stride_w + (k0 + cols)[None, :], mask, W_BF16_BITS)
            _quantize_store(q_ptr + rows64[:, None] * stride_q + (k0 + cols)[None, :], mask, w, pre, inv,
                            any_pre, QMAX_, IS_FP8, HW_ROUND)


@triton.jit
def _dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, R, K, stride_q, stride_o,
    OUT_KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    q = tl.load(q_ptr + rows64[:, None] * stride_q + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + rows64, mask=rows < R, other=0.0)
    v = _round_for_store(q * scale[:, None], OUT_KIND)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
INTERPRETED = isinstance(_quantize_kernel, InterpretedFunction)


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """Tile of ``_quantize_kernel``: BLOCK_R rows per program, K walked in BLOCK_K chunks."""

    block_r: int = 8
    block_k: int = 512
    num_warps: int = 4

    def __post_init__(self):
        _check_pow2(self, ("block_r", "block_k"))


def _check_pow2(cfg, fields) -> None:
    for f in fields:
        v = getattr(cfg, f)
        if v < 1 or v & (v - 1):
            raise ValueError(f"{type(cfg).__name__}.{f} must be a power of two >= 1, got {v}")


def _default_quantize_config(K: int) -> QuantizeConfig:
    if INTERPRETED:  # big tiles: the interpreter's cost is per loop iteration, not per element
        return QuantizeConfig(block_r=32, block_k=min(1024, triton.next_power_of_2(K)))
    block_k = triton.next_power_of_2(K)
    if block_k <= 16384:  # whole rows in registers, one read of the weight (<= 64 fp32 values per thread)
        block_r = max(1, min(16, 8192 // block_k))
        return QuantizeConfig(block_r=block_r, block_k=block_k, num_warps=8 if block_r * block_k >= 8192 else 4)
    return QuantizeConfig(block_r=8, block_k=512, num_warps=4)  # very long rows: two passes over K


# ----------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------
def _launch_guard(*tensors: torch.Tensor, op: str) -> contextlib.AbstractContextManager:
    """Check that the tensors can be handed to a Triton launch; returns a guard that makes their CUDA
    device current (Triton launches on the current device)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    dev = devices.pop()
    if dev.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{op}: got CPU tensors, but Triton runs kernels on the CPU only in interpreter mode. Set "
            "TRITON_INTERPRET=1 before llamarl_kernels.quant is first imported, move the tensors to CUDA, "
            "or use the eager reference path (GenerationEngine(..., quantization_backend='eager'), "
            "llamarl.models.quantize.quantize_model(..., backend='eager'))."
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: tensors must be on cuda (or cpu under TRITON_INTERPRET=1), got {dev}")
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


def _check_mode(mode: str) -> None:
    if mode not in QMAX:
        raise ValueError(f"quantization mode must be one of {sorted(QMAX)}, got {mode!r}")


def _check_qweight(q: torch.Tensor, scale: torch.Tensor, op: str) -> None:
    if q.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise TypeError(f"{op}: q must be int8 or float8_e4m3fn (from quantize), got {q.dtype}")
    if q.dim() != 2 or (q.numel() and q.shape[1] > 1 and q.stride(1) != 1):  # (a size-1 dim's stride is moot)
        raise ValueError(f"{op}: q must be 2-D [N, K] with unit stride along K, got shape "
                         f"{tuple(q.shape)} strides {q.stride()}; call .contiguous()")
    if scale.dtype != torch.float32 or scale.shape != (q.shape[0],) or not scale.is_contiguous():
        raise ValueError(f"{op}: scale must be contiguous float32 of shape [{q.shape[0]}] (one per row of q), "
                         f"got {scale.dtype} {tuple(scale.shape)}")


# ----------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------
def quantize(
    w: torch.Tensor,
    mode: str,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: QuantizeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize W[R, K] per row: returns (q[R, K] int8 | float8_e4m3fn, scale[R] float32).

    ``out=(q, scale)`` writes into existing tensors (e.g. a row-slice of a generator's qweight buffer
    during weight sync) and returns them. ``config`` overrides the tile (tests, tuning).
    """
    _check_mode(mode)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"quantize expects a 2-D weight [rows, K], got {getattr(w, 'shape', type(w))}")
    if w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"quantize expects a float32/bfloat16/float16 weight, got {w.dtype}")
    R, K = w.shape
    if K == 0:
        raise ValueError(f"quantize needs K >= 1 columns, got shape {tuple(w.shape)}")
    if R and K > 1 and w.stride(1) != 1:
        raise ValueError(f"quantize needs unit stride along K (rows may be strided), got strides {w.stride()}; "
                         "call .contiguous()")
    if out is None:
        q = torch.empty((R, K), dtype=QDTYPE[mode], device=w.device)
        scale = torch.empty((R,), dtype=torch.float32, device=w.device)
    else:
        q, scale = out
        if q.dtype != QDTYPE[mode] or q.shape != w.shape or (R and q.stride(1) != 1):
            raise ValueError(f"quantize(out=...): q must be {QDTYPE[mode]} of shape {tuple(w.shape)} with unit "
                             f"stride along K, got {q.dtype} {tuple(q.shape)} strides {q.stride()}")
        if scale.dtype != torch.float32 or scale.shape != (R,) or not scale.is_contiguous():
            raise ValueError(f"quantize(out=...): scale must be contiguous float32 of shape [{R}], "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    guard = _launch_guard(w, q, scale, op="quantize")
    if R == 0:
        return q, scale
    cfg = config or _default_quantize_config(K)
    bf16_bits = w.dtype == torch.bfloat16
    with guard:
        _quantize_kernel[(triton.cdiv(R, cfg.block_r),)](
            w.view(torch.int16) if bf16_bits else w, q, scale, R, K, w.stride(0), q.stride(0),
            QMAX_=QMAX[mode], IS_FP8=mode == "fp8", W_BF16_BITS=bf16_bits, HW_ROUND=not INTERPRETED,
            BLOCK_R=cfg.block_r,
            BLOCK_K=cfg.block_k, SINGLE_TILE=cfg.block_k >= K, num_warps=cfg.num_warps,
        )
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float(q[r, k]) * scale[r], rounded (to nearest even) to ``dtype``; returns a new [R, K] tensor."""
    _check_qweight(q, scale, "dequantize")
    if dtype not in _OUT_KIND:
        raise TypeError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    guard = _launch_guard(q, scale, op="dequantize")
    R, K = q.shape
    out = torch.empty((R, K), dtype=dtype, device=q.device)
    if out.numel() == 0:
        return out
    block_r, block_k = (16, min(1024, triton.next_power_of_2(K))) if INTERPRETED else (8, 256)
    grid = (triton.cdiv(R, block_r), triton.cdiv(K, block_k))
    with guard:
        _dequantize_kernel[grid](q, scale, out, R, K, q.stride(0), out.stride(0),
                                 OUT_KIND=_OUT_KIND[dtype], BLOCK_R=block_r, BLOCK_K=block_k)
    return out
