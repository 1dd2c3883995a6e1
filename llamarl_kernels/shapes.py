"""Argument and shape checks shared by the Triton kernels, their native CPU counterparts
(``llamarl.models.cpu_fused``) and the eager specifications (``llamarl.algorithms``); pure Python and torch,
so importing this never imports Triton."""

from __future__ import annotations

import math

import torch


def rope_kv_shapes(q, k, v, cos, signed_sin, k_cache, v_cache, slots) -> tuple[int, int, int, int, int]:
    """The sizes (B, T, H, Hkv, Dh) of a ``rope_kv`` call (fused_ops and cpu_fused take the same arguments);
    raises ValueError naming the first argument that does not fit."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"rope_kv: q must be [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim], "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, T, H, Dh = q.shape
    Hkv = k.shape[2]
    if Dh % 2:
        raise ValueError(f"rope_kv: head_dim must be even (rotate-half layout), got {Dh}")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.shape != (B, T, 1, Dh):
            raise ValueError(f"rope_kv: {name} must have shape {(B, T, 1, Dh)}, got {tuple(t.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[0] != B or c.shape[1] != Hkv or c.shape[3] != Dh or c.stride(3) != 1:
            raise ValueError(f"rope_kv: {name} must be [{B}, {Hkv}, slots, {Dh}] with unit stride along the last dim, "
                             f"got {tuple(c.shape)} strides {c.stride()}")
    if v_cache.shape != k_cache.shape:  # the kernels bound the slots by k_cache's alone
        raise ValueError(f"rope_kv: v_cache {tuple(v_cache.shape)} must have k_cache's shape {tuple(k_cache.shape)}")
    if isinstance(slots, torch.Tensor) and (slots.dtype != torch.long or slots.shape != (T,)):
        raise ValueError(f"rope_kv: slots must be an int or a LongTensor [{T}], got {slots.dtype} {tuple(slots.shape)}")
    return B, T, H, Hkv, Dh


NORMS = ("token", "sequence", "constant")  # the loss normalisations (llamarl.algorithms.aipo)


def check_norm(where: str, norm: str, constant) -> None:
    """``norm`` is one of ``NORMS``; ``constant`` (the divisor C of norm="constant") is a finite number > 0
    given exactly with norm="constant"."""
    if norm not in NORMS:
        raise ValueError(f"{where}: norm must be one of {NORMS}, got {norm!r}")
    if norm == "constant":
        ok = isinstance(constant, (int, float)) and not isinstance(constant, bool) and math.isfinite(constant)
        if not (ok and constant > 0):
            raise ValueError(f"{where}: norm='constant' needs norm_constant, the divisor C > 0 (Dr. GRPO: sequences "
                             f"x max_new_tokens), got {constant!r}")
    elif constant is not None:
        raise ValueError(f"{where}: norm_constant is only read with norm='constant' (norm is {norm!r}); drop it")


def check_clip(where: str, clip) -> None:
    """``clip`` is None or (ε_low, ε_high) with 0 ≤ ε_low < 1 and finite ε_high ≥ 0."""
    if clip is None:
        return
    ok = (isinstance(clip, (tuple, list)) and len(clip) == 2
          and all(isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) for e in clip))
    if not ok or not (0 <= clip[0] < 1 and clip[1] >= 0):
        raise ValueError(f"{where}: clip must be None or (eps_low, eps_high) with 0 <= eps_low < 1 and "
                         f"eps_high >= 0, e.g. (0.2, 0.2) or DAPO's (0.2, 0.28); got {clip!r}")


KL_ESTIMATORS = ("k3", "k2")  # the KL-to-reference term's estimator (llamarl.algorithms.aipo)


def check_kl_estimator(where: str, kl_estimator: str) -> None:
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"{where}: kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
