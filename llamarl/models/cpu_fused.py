"""Fused fp32 decoder-layer ops on the CPU, the counterpart of ``llamarl_kernels.fused_ops`` (same names and
signatures), run by the native extension (csrc/fused_cpu.cpp) for inference.

A CPU decode step applies each norm and RoPE to a few rows of a few hundred values, where torch's eager
chains cost about 3 us of dispatch per op (an RMSNorm ~30 us, a RoPE of q and k ~35 us) for well under a
microsecond of arithmetic. Math, identical to the eager ops of ``llamarl.models.llama`` in fp32:

    rms_norm(x, w, eps[, residual])  h = x + residual;  y = w * (h * (1 / sqrt(mean(h^2) + eps)))
    rope(q, k, cos, signed_sin)      x' = x * cos + swap(x) * signed_sin,  swap(lo, hi) = (hi, lo)
    rope_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
                                     rope, with rotated k and v written straight into one layer's KV cache
    silu_mul(gate, up)               F.silu(gate) * up (eager: two vectorised torch ops, already cheap)
    decode_attention(q, k, v, mask)  softmax(q kᵀ / sqrt(Dh) + mask) v for one query per row, grouped-query
                                     (csrc/attention_cpu.cpp; torch's CPU SDPA costs ~30 us per call at one
                                     row and ~420 us at 128 rows of the tiny model, the native op a tenth)

RoPE and the residual add are bitwise equal to eager (same fp32 products and sums, no FMA contraction);
the norm's mean(h^2) is summed in double, so it may differ from torch's fp32 reduction in its last bit;
attention sums in another order than torch (fp32 rounding-level differences).
Callers (``llamarl.models.llama``) use these only with autograd off, for fp32 CPU tensors; the functions
raise on other dtypes or devices and on a strided x of rms_norm or q of decode_attention (rope and rope_kv
make strided q/k/v contiguous first where they need to, rms_norm its residual).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llamarl._native import native
from llamarl_kernels.shapes import rope_kv_shapes

_FP32 = torch.float32


def usable(x: torch.Tensor) -> bool:
    """Whether the ops here take activations ``x`` (fp32, CPU, contiguous)."""
    return x.is_cpu and x.dtype is _FP32 and x.is_contiguous()


def _check(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not usable(t):
            raise ValueError(f"{op}: {name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device} "
                             f"(contiguous={t.is_contiguous()})")
    _no_backward(op, *tensors.values())


def _check_fp32_cpu(op: str, **tensors: torch.Tensor) -> None:
    """float32 CPU tensors of any layout (the caller handles strides)."""
    for name, t in tensors.items():
        if not (t.is_cpu and t.dtype is _FP32):
            raise ValueError(f"{op}: {name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def _no_backward(op: str, *tensors: torch.Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{op}: the native CPU op has no backward; call it under torch.no_grad()")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim: ``y``, or ``(y, h)`` with h = x + residual normalised in its place
    (a strided residual is made contiguous first)."""
    if residual is not None:
        residual = residual.contiguous()
    _check("rms_norm", x=x, weight=weight, **({} if residual is None else {"residual": residual}))
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight must have shape [{D}] (x's last dim), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    rows = x.numel() // D if D else 0
    if rows:
        native().rms_norm_f32_cpu(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                                  y.data_ptr(), 0 if h is None else h.data_ptr(), rows, D, float(eps))
    return y if residual is None else (y, h)


def _token_stride(x: torch.Tensor) -> int | None:
    """The distance in elements between consecutive tokens of x [B, T, H, Dh] when its heads are contiguous
    within a token and its B*T tokens evenly spaced (contiguous x, or the q / k columns of a fused q|k|v
    product); None otherwise."""
    B, T, H, Dh = x.shape
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or (H > 1 and s2 != Dh):
        return None
    if B * T <= 1:
        return H * Dh
    if T > 1 and B > 1 and s0 != T * s1:
        return None
    stride = s0 if T == 1 else s1
    return stride if stride >= H * Dh else None


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B, T, H, Dh] and k [B, T, Hkv, Dh] with cos / signed_sin [B, T, 1, Dh]; new contiguous
    tensors. q and k may have strided tokens (heads contiguous within a token, as in the column slices of a
    fused q|k|v product); other layouts, and the tables, are made contiguous first."""
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    if q.dim() != 4 or k.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"rope: q and k must be [batch, seq, heads, head_dim] with the same batch, seq and "
                         f"head_dim, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    B, T, H, Dh = q.shape
    if Dh % 2:
        raise ValueError(f"rope: head_dim must be even (rotate-half layout), got {Dh}")
    _check_fp32_cpu("rope", q=q, k=k)
    strides = []
    for x in (q, k):
        stride = _token_stride(x)
        if stride is None:
            x = x.contiguous()
            stride = x.shape[2] * Dh
        strides.append((x, stride))
    _check("rope", cos=cos, signed_sin=signed_sin)
    _no_backward("rope", q, k)
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.shape != (B, T, 1, Dh):
            raise ValueError(f"rope: {name} must have shape {(B, T, 1, Dh)}, got {tuple(t.shape)}")
    q_out, k_out = torch.empty(q.shape, dtype=_FP32), torch.empty(k.shape, dtype=_FP32)
    if B * T:
        n = native()
        for (x, stride), out in zip(strides, (q_out, k_out)):
            n.rope_f32_cpu(x.data_ptr(), stride, cos.data_ptr(), signed_sin.data_ptr(), out.data_ptr(), B * T,
                           x.shape[2], Dh)
    return q_out, k_out


def rope_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: int | torch.Tensor,
) -> torch.Tensor:
    """``rope`` on q and k plus one layer's KV-cache write: rotated k and v go straight into
    ``k_cache`` / ``v_cache`` [B, Hkv, S, Dh] at slot ``slots + t`` (int) or ``slots[t]`` (LongTensor [T])
    for token t; returns rotated q, contiguous. Bitwise what ``rope`` followed by the cache's copies gives."""
    B, T, H, Hkv, Dh = rope_kv_shapes(q, k, v, cos, signed_sin, k_cache, v_cache, slots)
    cos, signed_sin = cos.contiguous(), signed_sin.contiguous()
    _check("rope_kv", cos=cos, signed_sin=signed_sin)
    _check_fp32_cpu("rope_kv", q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache)
    xs = []
    for x in (q, k, v):
        if x.stride(3) != 1 or (x.shape[2] > 1 and x.stride(2) != Dh):
            x = x.contiguous()  # heads must be contiguous within a token; batch and token strides are free
        xs.append(x)
    _no_backward("rope_kv", q, k, v, k_cache, v_cache)
    q_out = torch.empty(q.shape, dtype=_FP32)
    slot_t = slots.contiguous() if isinstance(slots, torch.Tensor) else None
    if B * T:
        q, k, v = xs
        native().rope_kv_f32_cpu(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(),
            [q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)],
            q_out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            [k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
             v_cache.stride(2)],
            0 if slot_t is None else slot_t.data_ptr(), 0 if slot_t is not None else int(slots), k_cache.shape[2],
            B, T, H, Hkv, Dh)
    return q_out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (the product computed in place in silu's output)."""
    return F.silu(gate).mul_(up)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One decode step of attention: q [B, Hkv, G, Dh] (query head h*G + g uses kv head h), k, v
    [B, Hkv, S, Dh] (any strides but the last, e.g. slices of the KV cache), mask additive [B, 1, 1, S]
    or None; returns [B, Hkv, G, Dh] = softmax(q kᵀ / sqrt(Dh) + mask) v."""
    _check("decode_attention", q=q)
    B, Hkv, G, Dh = q.shape
    S = k.shape[2]
    for name, t in (("k", k), ("v", v)):
        if t.dtype is not _FP32 or not t.is_cpu or t.shape != (B, Hkv, S, Dh) or t.stride(3) != 1:
            raise ValueError(f"decode_attention: {name} must be float32 [{B}, {Hkv}, S, {Dh}] on the CPU with unit "
                             f"stride along the last dim, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    _no_backward("decode_attention", k, v)
    mask_ptr, mask_sb = 0, 0
    if mask is not None:
        if mask.dtype is not _FP32 or not mask.is_cpu or mask.shape != (B, 1, 1, S) or mask.stride(3) != 1:
            raise ValueError(f"decode_attention: mask must be float32 [{B}, 1, 1, {S}] with unit stride along the "
                             f"last dim, got {mask.dtype} {tuple(mask.shape)} strides {mask.stride()}")
        mask_ptr, mask_sb = mask.data_ptr(), mask.stride(0)
    out = torch.empty_like(q)
    if B:
        native().decode_attention_f32_cpu(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), mask_ptr, out.data_ptr(), B, Hkv, G, S, Dh,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), mask_sb,
            float(Dh) ** -0.5, torch.get_num_threads())
    return out
