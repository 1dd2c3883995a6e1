"""Fused decoder-layer ops: RMSNorm (optionally after the residual add), RoPE on q and k, SiLU(gate)·up.

Each op replaces a chain of eager kernels of ``llamarl.models.llama`` by one launch and reproduces the
eager chain's roundings, so that swapping it in changes no bits (RoPE, SiLU·up) or almost none
(RMSNorm, whose mean is a reduction in some order). With ``rnd`` = round to nearest even onto the
grid of the tensors' dtype (the identity for fp32):

    rms_norm(x, w, eps)            y = rnd(w · rnd(x · rsqrt(mean(x²) + eps)))    mean, rsqrt in fp32
    rms_norm(x, w, eps, residual)  h = rnd(x + residual) first, then y = rms_norm(h); returns (y, h)
    rope(q, k, cos, signed_sin)    out = rnd(rnd(x · cos) + rnd(swap(x) · signed_sin)) for x = q and k,
                                   swap(x_lo, x_hi) = (x_hi, x_lo) (halves of head_dim, HF layout)
    rope_kv(q, k, v, cos, signed_sin, k_cache, v_cache, slots)
                                   rope, rotated k and v written straight into one layer's KV cache
    silu_mul(gate, up)             out = rnd(rnd(g / (1 + exp(-g))) · up)

Why these are eager's bits: every value is upcast to fp32 right after its load (exact); a product of
two bf16 (8-bit significands) or two fp16 (11-bit) values is exact in fp32, so eager's "compute in fp32,
round once to the dtype" for ``a * b`` equals ``rnd(a * b)`` here; a sum is rounded in fp32 and then to
the dtype, exactly as eager does. Divisions are IEEE (``div_rn``), and the kernels are compiled without
FMA contraction, so fp32 ``a*b + c*d`` is not fused either. What is not bitwise fixed:

- rms_norm's mean: the sum of squares is a reduction whose order differs from torch's, so mean(x²)
  can differ in its last fp32 bit, which flips the rounding of ``x · rsqrt(.)`` to the dtype for rare
  elements (one output ulp). ``rsqrt`` is the hardware approximation on CUDA (as torch's ``rsqrtf``)
  and ``1/sqrt`` under the interpreter (as torch on the CPU). CUDA torch computes the mean as
  sum · fl(1/D), the CPU as sum / D; the kernel does the same on each.
- silu_mul's exp: CUDA uses libdevice's ``expf``, the function torch's CUDA ``silu`` calls; the
  interpreter uses numpy's ``exp``, which differs from torch's CPU (Sleef) ``exp`` by one fp32 ulp on
  many inputs, so on the CPU only bf16 is reliably bitwise equal to eager (fp16/fp32 may be 1 ulp off).

Layouts: any leading dims, unit stride along the last dim (rows may be strided). rms_norm and silu_mul
view their inputs as rows [M, N]; rope takes q [B, T, H, Dh], k [B, T, Hkv, Dh] and cos / signed_sin
[B, T, 1, Dh] (any strides but the last). Outputs are new contiguous tensors in the input dtype.

Kernels and launch (GPU; the interpreter uses the same grids, except silu_mul, whose blocks are 8192 wide
there):
- ``_rms_norm_kernel``: one program per row, the whole row in registers (BLOCK = next_pow2(D), masked),
  num_warps = BLOCK / 256 in [1, 16]: at D = 2048 that is 8 warps, one 16-byte bf16 vector per thread.
- ``_rope_kernel``: grid (B·T, 2): program (token, 0) rotates the token's q heads, (token, 1) its k
  heads, so decode (B·T = 1) still runs two programs side by side; cos/sin are read once per program,
  heads go in tiles of [BLOCK_H, Dh/2] per half (BLOCK_H·Dh/2 <= 2048), 4 warps.
- ``_rope_kv_kernel``: grid (B·T, 3): as ``_rope_kernel``, with k's output the cache row of the token's
  slot, and a third program copying the token's v heads there.
- ``_silu_mul_kernel``: grid (M, cdiv(N, 1024)), 4 warps, 8 elements per thread.

Numerics shared by the GPU and the interpreter: bf16 tensors are passed as int16 bits and widened by a
shift (the interpreter's bf16 cast flushes subnormals); results are rounded to the dtype in fp32 with
the integer/grid tricks of ``quant._round_for_store`` and stored as bits (bf16) or by an exact cast.

The kernels have no backward: callers use them only with autograd off (generation, evaluation).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from llamarl_kernels.logprobs import check_device_runnable
from llamarl_kernels.quant import _round_for_store
from llamarl_kernels.shapes import rope_kv_shapes

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' dtype switch
MAX_ROW = 65536  # rms_norm keeps a row in registers


# ----------------------------------------------------------------------------------------------------
# load / store in fp32 (KIND 0 fp32, 1 bf16 passed as int16 bits, 2 fp16)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_f32(ptrs, mask, KIND: tl.constexpr):
    if KIND == 1:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_f32(ptrs, v, mask, KIND: tl.constexpr):
    """Store ``v`` (fp32, already on the dtype's grid, see ``_round_for_store``): the cast is exact."""
    if KIND == 1:
        tl.store(ptrs, (v.to(tl.uint32, bitcast=True) >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, D, stride_x, stride_res, stride_y, stride_h, eps, d_f32, inv_d,
    HAS_RESIDUAL: tl.constexpr, MEAN_BY_RECIPROCAL: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = _load_f32(x_ptr + row * stride_x + cols, mask, KIND)
    if HAS_RESIDUAL:  # h = x + residual in the dtype, then normalise h
        x = _round_for_store(x + _load_f32(res_ptr + row * stride_res + cols, mask, KIND), KIND)
        _store_f32(h_ptr + row * stride_h + cols, x, mask, KIND)
    sum_sq = tl.sum(x * x, axis=0)  # masked columns are 0
    if MEAN_BY_RECIPROCAL:  # torch's CUDA mean
        mean_sq = sum_sq * inv_d
    else:  # torch's CPU mean
        mean_sq = tl.math.div_rn(sum_sq, d_f32)
    normed = _round_for_store(x * tl.math.rsqrt(mean_sq + eps), KIND)
    w = _load_f32(w_ptr + cols, mask, KIND)
    _store_f32(y_ptr + row * stride_y + cols, _round_for_store(w * normed, KIND), mask, KIND)


@triton.jit
def _rope_token(x_ptr, stride_h, out_ptr, out_stride_h, n_heads, cos_row, sin_row, half,
                KIND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate n_heads heads of one token with its cos / signed_sin rows: x at x_ptr + h * stride_h +
    [0, 2·half), out at out_ptr + h * out_stride_h + [0, 2·half)."""
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    c_lo = _load_f32(cos_row + d, d_mask, KIND)
    c_hi = _load_f32(cos_row + half + d, d_mask, KIND)
    s_lo = _load_f32(sin_row + d, d_mask, KIND)
    s_hi = _load_f32(sin_row + half + d, d_mask, KIND)
    for h0 in range(0, n_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        mask = (heads < n_heads)[:, None] & d_mask[None, :]
        src = x_ptr + heads.to(tl.int64)[:, None] * stride_h + d[None, :]
        dst = out_ptr + heads.to(tl.int64)[:, None] * out_stride_h + d[None, :]
        x_lo = _load_f32(src, mask, KIND)
        x_hi = _load_f32(src + half, mask, KIND)
        lo = _round_for_store(x_lo * c_lo[None, :], KIND) + _round_for_store(x_hi * s_lo[None, :], KIND)
        hi = _round_for_store(x_hi * c_hi[None, :], KIND) + _round_for_store(x_lo * s_hi[None, :], KIND)
        _store_f32(dst, _round_for_store(lo, KIND), mask, KIND)
        _store_f32(dst + half, _round_for_store(hi, KIND), mask, KIND)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, T, H, HKV, half,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sc_b, sc_t, ss_b, ss_t,
    KIND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    b = token // T
    t = token % T
    cos_row = cos_ptr + b * sc_b + t * sc_t
    sin_row = sin_ptr + b * ss_b + t * ss_t
    if tl.program_id(1) == 0:
        _rope_token(q_ptr + b * sq_b + t * sq_t, sq_h, qo_ptr + token * H * 2 * half, 2 * half, H,
                    cos_row, sin_row, half, KIND, BLOCK_H, BLOCK_HALF)
    else:
        _rope_token(k_ptr + b * sk_b + t * sk_t, sk_h, ko_ptr + token * HKV * 2 * half, 2 * half, HKV,
                    cos_row, sin_row, half, KIND, BLOCK_H, BLOCK_HALF)


@triton.jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, slots_ptr, slot0, T, H, HKV, half,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sc_b, sc_t, ss_b, ss_t,
    skc_b, skc_h, skc_s, svc_b, svc_h, svc_s,
    KIND: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """``_rope_kernel`` writing rotated k straight into the KV cache at the token's slot, plus a third
    program per token that copies its v heads there (raw bits)."""
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    b = token // T
    t = token % T
    if SLOTS:
        slot = tl.load(slots_ptr + t).to(tl.int64)
    else:
        slot = slot0 + t
    cos_row = cos_ptr + b * sc_b + t * sc_t
    sin_row = sin_ptr + b * ss_b + t * ss_t
    which = tl.program_id(1)
    if which == 0:
        _rope_token(q_ptr + b * sq_b + t * sq_t, sq_h, qo_ptr + token * H * 2 * half, 2 * half, H,
                    cos_row, sin_row, half, KIND, BLOCK_H, BLOCK_HALF)
    elif which == 1:
        _rope_token(k_ptr + b * sk_b + t * sk_t, sk_h, kc_ptr + b * skc_b + slot * skc_s, skc_h, HKV,
                    cos_row, sin_row, half, KIND, BLOCK_H, BLOCK_HALF)
    else:
        d = tl.arange(0, BLOCK_HALF)
        d_mask = d < half
        for h0 in range(0, HKV, BLOCK_H):
            heads = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            mask = (heads < HKV)[:, None] & d_mask[None, :]
            src = v_ptr + b * sv_b + t * sv_t + heads[:, None] * sv_h + d[None, :]
            dst = vc_ptr + b * svc_b + slot * svc_s + heads[:, None] * svc_h + d[None, :]
            tl.store(dst, tl.load(src, mask=mask), mask=mask)
            tl.store(dst + half, tl.load(src + half, mask=mask), mask=mask)


@triton.jit
def _silu_mul_kernel(
    g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, stride_o,
    KIND: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = _load_f32(g_ptr + row * stride_g + cols, mask, KIND)
    u = _load_f32(u_ptr + row * stride_u + cols, mask, KIND)
    if LIBDEVICE_EXP:  # the accurate expf torch's CUDA silu calls (tl.exp is ex2.approx on the GPU)
        e = libdevice.exp(-g)
    else:  # the interpreter has no libdevice; its tl.exp is numpy's
        e = tl.exp(-g)
    silu = _round_for_store(tl.math.div_rn(g, 1.0 + e), KIND)
    _store_f32(out_ptr + row * stride_o + cols, _round_for_store(silu * u, KIND), mask, KIND)


INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------
def _check_float(op: str, **tensors: torch.Tensor) -> torch.dtype:
    """All tensors: torch.Tensor, one float dtype of float32/bfloat16/float16, one device, unit last stride, and
    no gradient asked for (these ops have no backward)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = {name: t.dtype for name, t in tensors.items()}
    dtype = next(iter(dtypes.values()))
    if dtype not in _KIND:
        raise TypeError(f"{op}: tensors must be float32, bfloat16 or float16, got {dtypes}")
    if len(set(dtypes.values())) != 1:
        raise TypeError(f"{op}: all tensors must have one dtype (cast them first), got {dtypes}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{op}: all tensors must be on one device, got "
                         f"{ {name: str(t.device) for name, t in tensors.items()} }")
    check_device_runnable(op, devices.pop())
    needs_grad = [name for name, t in tensors.items() if t.requires_grad]
    if needs_grad and torch.is_grad_enabled():  # the output would be detached: gradients silently lost
        raise RuntimeError(f"{op}: the fused inference ops have no backward, but {needs_grad} require grad; run "
                           "them under torch.no_grad() / torch.inference_mode(), or use the eager op for training")
    for name, t in tensors.items():
        if t.dim() == 0:
            raise ValueError(f"{op}: {name} must have at least one dimension, got a scalar")
        if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} needs unit stride along its last dim, got strides {t.stride()}; "
                             "call .contiguous()")
    return dtype


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [M, N] (a view when the leading dims allow it)."""
    return t.reshape(-1, t.shape[-1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bf16 enters and leaves the kernels as int16 bits (see the module docstring)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make t's device current for the launch."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (see the module docstring): ``y``, or ``(y, h)`` with h = x + residual
    (rounded to the dtype) normalised in its place when ``residual`` is given."""
    tensors = dict(x=x, weight=weight) if residual is None else dict(x=x, weight=weight, residual=residual)
    dtype = _check_float("rms_norm", **tensors)
    D = x.shape[-1]
    if weight.shape != (D,) or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be contiguous of shape [{D}] (x's last dim), "
                         f"got {tuple(weight.shape)} strides {weight.stride()}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not 1 <= D <= MAX_ROW:
        raise ValueError(f"rms_norm: rows must have 1..{MAX_ROW} elements (one row is kept in registers), got {D}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"rms_norm: eps must be a float >= 0, got {eps!r}")

    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    h = torch.empty(x.shape, dtype=dtype, device=x.device) if residual is not None else y
    if x.numel():
        r2 = _rows(residual) if residual is not None else x2
        y2, h2 = y.view(-1, D), h.view(-1, D)
        block = triton.next_power_of_2(D)
        with _device_guard(x):
            _rms_norm_kernel[(x2.shape[0],)](
                _bits(x2), _bits(r2), _bits(weight), _bits(y2), _bits(h2), D,
                x2.stride(0), r2.stride(0), y2.stride(0), h2.stride(0), float(eps), float(D),
                float(np.float32(1.0) / np.float32(D)),  # fl(1/D), as torch's CUDA mean
                HAS_RESIDUAL=residual is not None, MEAN_BY_RECIPROCAL=x.is_cuda, KIND=_KIND[dtype],
                BLOCK=block, num_warps=min(max(block // 256, 1), 16), enable_fp_fusion=False,
            )
    return y if residual is None else (y, h)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``llamarl.models.llama.apply_rope`` on q [B, T, H, Dh] and k [B, T, Hkv, Dh] in one launch, with
    cos / signed_sin [B, T, 1, Dh]; returns new contiguous (q_out, k_out), bitwise equal to eager."""
    dtype = _check_float("rope", q=q, k=k, cos=cos, signed_sin=signed_sin)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q and k must be [batch, seq, heads, head_dim], got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    B, T, H, Dh = q.shape
    Hkv = k.shape[2]
    if k.shape != (B, T, Hkv, Dh):
        raise ValueError(f"rope: k must be [{B}, {T}, kv_heads, {Dh}] like q {tuple(q.shape)}, got {tuple(k.shape)}")
    if Dh % 2:
        raise ValueError(f"rope: head_dim must be even (rotate-half layout), got {Dh}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.shape != (B, T, 1, Dh):
            raise ValueError(f"rope: {name} must have shape {(B, T, 1, Dh)}, got {tuple(t.shape)}")
    q_out = torch.empty((B, T, H, Dh), dtype=dtype, device=q.device)
    k_out = torch.empty((B, T, Hkv, Dh), dtype=dtype, device=q.device)
    if B * T == 0 or Dh == 0:
        return q_out, k_out
    half = Dh // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(H, Hkv, 1)), max(1, 2048 // block_half))
    with _device_guard(q):
        _rope_kernel[(B * T, 2)](
            _bits(q), _bits(k), _bits(cos), _bits(signed_sin), _bits(q_out), _bits(k_out), T, H, Hkv, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            cos.stride(0), cos.stride(1), signed_sin.stride(0), signed_sin.stride(1),
            KIND=_KIND[dtype], BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4, enable_fp_fusion=False,
        )
    return q_out, k_out


def rope_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: int | torch.Tensor,
) -> torch.Tensor:
    """``rope`` plus one layer's KV-cache write in one launch: rotated k and v go straight into ``k_cache`` /
    ``v_cache`` [B, Hkv, S, Dh] at slot ``slots + t`` (int) or ``slots[t]`` (LongTensor [T] on the device:
    CUDA-graph safe) for token t; returns rotated q (new, contiguous). Bitwise ``rope`` followed by the
    cache's copies. Slots must lie in [0, S) (the caller, ``KVCache.update_rope``, checks int slots)."""
    dtype = _check_float("rope_kv", q=q, k=k, v=v, cos=cos, signed_sin=signed_sin, k_cache=k_cache, v_cache=v_cache)
    B, T, H, Hkv, Dh = rope_kv_shapes(q, k, v, cos, signed_sin, k_cache, v_cache, slots)
    from_tensor = isinstance(slots, torch.Tensor)
    if from_tensor and slots.device != q.device:
        raise ValueError(f"rope_kv: slots must be on {q.device} like q, got {slots.device}")
    q_out = torch.empty((B, T, H, Dh), dtype=dtype, device=q.device)
    if B * T == 0:
        return q_out
    half = Dh // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(H, Hkv, 1)), max(1, 2048 // block_half))
    with _device_guard(q):
        _rope_kv_kernel[(B * T, 3)](
            _bits(q), _bits(k), _bits(v), _bits(cos), _bits(signed_sin), _bits(q_out), _bits(k_cache),
            _bits(v_cache), slots if from_tensor else _bits(q_out), 0 if from_tensor else int(slots), T, H, Hkv, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1), signed_sin.stride(0),
            signed_sin.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            KIND=_KIND[dtype], SLOTS=from_tensor, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4,
            enable_fp_fusion=False,
        )
    return q_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` with eager's two roundings (see the module docstring); a new tensor."""
    dtype = _check_float("silu_mul", gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    out = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    if gate.numel() == 0:
        return out
    g2, u2 = _rows(gate), _rows(up)
    o2 = out.view(-1, gate.shape[-1])
    M, N = g2.shape
    block = min(triton.next_power_of_2(N), 8192 if INTERPRETED else 1024)
    with _device_guard(gate):
        _silu_mul_kernel[(M, triton.cdiv(N, block))](
            _bits(g2), _bits(u2), _bits(o2), N, g2.stride(0), u2.stride(0), o2.stride(0),
            KIND=_KIND[dtype], LIBDEVICE_EXP=not INTERPRETED, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        )
    return out
