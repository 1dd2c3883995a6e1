"""A whole decoder layer of a CPU decode step as one native call (csrc/decode_layer_cpu.cpp).

With the native CPU ops (llamarl.models.cpu_fused, the native linear) a layer of a decode step is a
dozen native calls glued by Python: on the 22M benchmark model ~100 us of glue per layer against ~20 us
of native work besides the weight products, i.e. ~0.6 ms of every ~4.6 ms step, and most of a decode
step of the RL default's tiny model. ``decode_layer`` runs the same kernels in the same order from C++
(the math is in the .cpp file), so its results are the module path's up to SiLU's exp (one ulp).

It applies, and ``DecoderLayer.forward`` uses it, exactly when the module path would run the native ops
for every piece of the layer: one new token per row, contiguous fp32 CPU activations, autograd and autocast off,
a ``KVCache`` addressed by an int slot (the eager decode; the static-shape CUDA-graph step keeps the
module path) whose fp32 rows fit the layer (else the module path raises the error that names the misfit),
plain ``Linear`` projections without bias whose q|k|v and gate|up weights are stacked
(llamarl.models.stacked: packed weights or the weight sync's buckets), fp32 contiguous weights and at
most ``CPU_DECODE_MAX_ROWS`` rows. Otherwise it returns None and the module path runs. The switches of
the native ops turn it off with them (``LLAMARL_FUSED_OPS=0``: the model does not call it;
``LLAMARL_CPU_LINEAR=0``); ``ENABLED`` is the module's own (tests compare the two paths).
"""

from __future__ import annotations

import torch

from llamarl._native import native
from llamarl.models import cpu_fused, linear, stacked

ENABLED = True
_FP32 = torch.float32


def _weights(layer) -> tuple[torch.Tensor, ...] | None:
    """(w_qkv, w_o, w_gate_up, w_down) of ``layer`` when all four products can run natively, else None."""
    attn, mlp = layer.self_attn, layer.mlp
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if any(type(m) is not linear.Linear for m in projections):
        return None
    qkv = stacked.views(attn, "qkv", projections[:3])
    gate_up = stacked.views(mlp, "gate_up", projections[4:6])
    if qkv is None or gate_up is None:
        return None
    out = (qkv[0], attn.o_proj.weight, gate_up[0], mlp.down_proj.weight)
    if any(w.dtype is not _FP32 or not w.is_cpu or not w.is_contiguous() for w in out):
        return None
    return out


def _fits(kc: torch.Tensor, vc: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: tuple) -> bool:
    """The cache rows and RoPE tables are what the kernel indexes blindly: fp32 CPU, K and V [B, Hkv, slots,
    Dh] (the cache may have fewer rows or other heads than the model), unit stride along Dh, cos/sin [B, 1, 1,
    Dh]."""
    B, _, _, Dh = shape
    return (kc.dtype is _FP32 and vc.dtype is _FP32 and kc.is_cpu and vc.is_cpu and kc.shape == shape
            and vc.shape == shape and kc.stride(3) == 1 and vc.stride(3) == 1
            and cos.dtype is _FP32 and sin.dtype is _FP32 and cos.shape == (B, 1, 1, Dh) and sin.shape == cos.shape)


def decode_layer(layer, x: torch.Tensor, ctx,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``layer(x, ctx, residual)`` (llamarl.models.llama.DecoderLayer) as one native call, or None when the
    conditions of the module docstring do not hold."""
    if not (ENABLED and linear.CPU_LINEAR) or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None  # (autocast: the module path's ops cast inside, so it runs none of the native ones)
    B, T, D = x.shape
    cache, slot = ctx.cache, ctx.input_pos
    if (T != 1 or B > linear.CPU_DECODE_MAX_ROWS or not isinstance(slot, int) or not hasattr(cache, "update_rope")
            or not cpu_fused.usable(x) or (residual is not None and not cpu_fused.usable(residual))):
        return None
    weights = _weights(layer)
    if weights is None:
        return None
    attn, n1, n2 = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    if not (cpu_fused.usable(n1.weight) and cpu_fused.usable(n2.weight)) or n1.eps != n2.eps:
        return None
    H, Hkv, Dh = attn.n_heads, attn.n_kv, attn.head_dim
    kc, vc, S = cache.rows(attn.layer_idx, B, 1, slot)  # attention reads slots [0, S = slot + 1)
    cos, sin = ctx.cos.contiguous(), ctx.sin.contiguous()
    if not _fits(kc, vc, cos, sin, (B, Hkv, cache.max_seq_len, Dh)):
        return None  # the module path raises the error that names what does not fit
    mask, mask_sb = ctx.mask, 0
    if mask is not None:
        if mask.dtype is not _FP32 or mask.shape != (B, 1, 1, S) or mask.stride(3) != 1:
            return None
        mask_sb = mask.stride(0)
    mlp_out, h_out = torch.empty_like(x), torch.empty_like(x)
    w_qkv, w_o, w_gate_up, w_down = weights
    native().decode_layer_f32_cpu(
        [x.data_ptr(), 0 if residual is None else residual.data_ptr(), mlp_out.data_ptr(), h_out.data_ptr(),
         n1.weight.data_ptr(), n2.weight.data_ptr(), w_qkv.data_ptr(), w_o.data_ptr(), w_gate_up.data_ptr(),
         w_down.data_ptr(), cos.data_ptr(), sin.data_ptr(), kc.data_ptr(), vc.data_ptr(),
         0 if mask is None else mask.data_ptr()],
        [kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), cache.max_seq_len,
         slot, S, mask_sb, B, D, H, Hkv, Dh, w_down.shape[1]],
        float(n1.eps), torch.get_num_threads())
    return mlp_out, h_out
