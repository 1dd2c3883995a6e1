"""The Llama policy model (Llama 2 / 3 / 3.1 / 3.2), numerically equivalent to transformers' LlamaForCausalLM.

Per decoder layer, with x the residual stream [B, T, D]:

    h = x + o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))            (SwiGLU)

    RMSNorm  n(x) = w * cast_x(x / sqrt(mean(x^2) + eps)): the normalisation in fp32 (fp64 for fp64), cast to
             x's dtype, then multiplied by w in the promoted dtype of w and x (as HF does)
    RoPE     rotate-half layout (HF checkpoints): x' = x * cos + rotate_half(x) * sin,
             rotate_half(x_lo, x_hi) = (-x_hi, x_lo), with
             cos/sin = cos/sin(position * inv_freq) computed in fp32 and cast to the model dtype;
             inv_freq_i = theta^(-2i/head_dim), optionally rescaled ("linear" or Llama 3.1 "llama3"),
             computed in fp32 with transformers' exact expressions (``rope_inv_freq``): the angle error of
             a differently rounded inv_freq grows with the position.
    GQA      query head h attends with kv head h // (num_attention_heads / num_key_value_heads),
             softmax(q k^T / sqrt(head_dim) + mask) v via scaled_dot_product_attention.

logits = lm_head(norm(x_L)); with tie_word_embeddings lm_head.weight IS embed_tokens.weight.

Parameter names are exactly Hugging Face's (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.
q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``) and every linear layer is a plain
``nn.Linear(bias=False)`` (``llamarl.models.linear.Linear``: an ``nn.Linear`` with a CPU decode fast path),
so HF state dicts load as-is and quantization can swap the linears.

Three ways to call the model (``hidden_states`` takes the same arguments and stops before lm_head):

1. ``model(input_ids)``: full causal forward. Right-padded batches need nothing else: causal attention
   means tokens before the padding never see it (ignore outputs at pad positions).
2. ``model(input_ids, attention_mask=m)`` with m [B, T] (1 = token, 0 = pad), any padding side: positions
   are ``cumsum(m) - 1`` and pad keys are masked. A pad query sees the real tokens before it plus itself
   (finite garbage; ignore outputs at pad positions).
3. ``model(input_ids, input_pos, cache)``: incremental decoding over a preallocated KV cache (see
   llamarl.generation.kv_cache). The T new tokens are written at cache slots ``input_pos + arange(T)``
   (``input_pos`` an int; attention then reads slots ``[0, input_pos + T)``) or at the slots listed by a
   LongTensor ``input_pos`` [T] (attention reads the whole cache: static shapes for CUDA graphs). Batches
   are left-padded: row b's first real token sits at slot ``cache.start[b]``; its RoPE position is
   ``slot - start[b]``; key slot s is visible to query slot t iff ``start[b] <= s <= t`` (or s == t).

The cache protocol used here: ``cache.start`` (LongTensor [rows]), ``cache.max_seq_len``,
``cache.has_padding`` (host bool: False promises every start is 0, which lets decode skip the mask) and
``cache.update(layer, k, v, input_pos) -> (k_all, v_all)`` with k, v [B, kv_heads, T, head_dim]; a cache
that also has ``update_rope`` (llamarl.generation.kv_cache.KVCache) lets the fused ops apply RoPE and write
k, v into it in one op (``rope_kv``) wherever the fused ops run.

Residual stream: layers pass it on in two parts, like vLLM's: layer i returns (mlp_out, h) and layer
i + 1's input norm computes the stream ``mlp_out + h`` itself (the final norm does it after the last
layer), so every residual add sits right before a norm. This is the same arithmetic in the same dtype
as ``x + f(x)``; it lets the fused kernels below do each add in the norm's pass over the row.

Activation checkpointing (``model.activation_checkpointing = True``; training with autograd on): each
decoder layer runs under non-reentrant ``torch.utils.checkpoint``, so only its inputs are kept and its
activations are recomputed in backward: one more forward of compute for the activation memory of all
layers but one. The gradients are those of the plain forward (same ops, recomputed in the same order).

Stacked projections (llamarl.models.stacked): when a layer's q, k, v weights (and its gate, up weights) lie
end to end in memory, as in the generator's weight buckets or after ``pack_parameters_``, and autograd
needs no gradient through them, each group runs as one product whose output is split into column slices.

Fused kernels (llamarl_kernels.fused_ops): for bf16/fp16 activations on CUDA with autograd off (the
kernels have no backward: generation, evaluation, ``no_grad`` log-probs), RMSNorm with the residual add
before it, RoPE on q and k, and SiLU(gate)·up each run as one Triton kernel with eager's roundings:
RoPE and SiLU·up are bitwise equal to the eager ops; RMSNorm differs only where its fp32 mean (a
reduction in another order) moves the rounding of an element, by one ulp (21 of 8.4M elements on an
H200 in bf16). Without stacked projections and ``rope_kv``, a Llama-3.2-1B decode forward on an H200
launches 272 kernels instead of 663 (about 17 per layer instead of 41) and its CUDA-graph replay takes
1.40 ms instead of 1.94 ms (benchmarks/results/generation_h200_2026-11-30.md); stacked projections and
``rope_kv`` take 3 GEMVs and 2 cache copies more out of every layer, an effect no H200 run has measured.
For contiguous fp32 activations on the CPU with autograd off, RMSNorm (with the add) and RoPE run as
native C++ ops instead (llamarl.models.cpu_fused: RoPE bitwise equal to eager, the norm's mean summed
in double), which removes ~16 eager torch calls per layer from a CPU decode step, and so does decode
attention (one query per row, summed in another order than torch's SDPA); where a decode step's whole
layer qualifies (stacked fp32 weights, an int cache slot), it runs as one native call instead
(llamarl.models.cpu_decode: the same kernels without the Python between them). Autograd, fp64 and the
other layouts of the activations run the eager code below. ``LLAMARL_FUSED_OPS=0`` in the environment (read once, at
import: ``FUSED_OPS``) turns both off, for A/B measurements; when they are on, a failing kernel raises,
it never falls back.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from llamarl.models import cpu_decode, cpu_fused, stacked
from llamarl.models.config import LlamaConfig
from llamarl.models.linear import Linear

FUSED_OPS = os.environ.get("LLAMARL_FUSED_OPS", "1") != "0"
_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _fused(x: torch.Tensor):
    """The fused-op module for activations ``x`` (see the module docstring), or None for the eager ops:
    llamarl_kernels.fused_ops (Triton) for bf16/fp16 on CUDA, llamarl.models.cpu_fused (native) for
    contiguous fp32 on the CPU; both only with autograd off, and not under autocast (its casts happen in the
    eager ops: an autocast forward of fp32 activations has bf16 projections)."""
    if not FUSED_OPS or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return None
    if x.is_cuda and x.dtype in _FUSED_DTYPES:
        from llamarl_kernels import fused_ops  # imported on first use: Triton loads only when a kernel runs

        return fused_ops
    if cpu_fused.usable(x):
        return cpu_fused
    return None


# ------------------------------------------------------------------------------------ RoPE
def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32 on the CPU, bitwise those of transformers (5.x
    ``_compute_default_rope_parameters`` / ``_compute_linear_scaling_rope_parameters`` /
    ``_compute_llama3_parameters``), Meta's reference code and vLLM.

        inv_i = 1 / theta^(2i / head_dim)                                   (fp32 pow of an fp32 exponent)
        linear:  inv_i / factor
        llama3:  wavelen_i = 2 pi / inv_i; lo_wl = old_ctx / low_freq_factor; hi_wl = old_ctx / high_freq_factor
                 inv_i / factor                    where wavelen_i > lo_wl   (long wavelengths: interpolated)
                 inv_i                             where wavelen_i < hi_wl   (short wavelengths: kept)
                 (1 - s) inv_i / factor + s inv_i  otherwise, s = (old_ctx / wavelen_i - low) / (high - low)

    Every step runs in fp32, with the same expressions (so the same roundings) as transformers. This is
    not a detail: the angle at position p is p * inv_i, so a 1-ulp difference in inv_i (what computing in
    fp64 and rounding once gives, in about a third of the entries) is an angle error growing with p,
    ~2e-3 rad at 32k, and logits that drift from the checkpoint's reference implementation.
    """
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    s = config.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    # llama3: low frequencies (long wavelengths) are divided by `factor`, high ones kept, and the band
    # in between interpolated smoothly in 1/wavelength.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_ctx / lo, old_ctx / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, Dh]; cos [B, T, 1, Dh]; signed_sin = (-sin_lo, sin_hi), see ``Llama._rope``.

    rotate_half(x) * sin = (-x_hi, x_lo) * (sin_lo, sin_hi) = (x_hi, x_lo) * (-sin_lo, sin_hi): the
    same products (negation is exact), with the halves swapped by one flip instead of chunk/neg/cat.
    """
    Dh = x.shape[-1]
    swapped = x.unflatten(-1, (2, Dh // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


# ------------------------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """n(x); with ``residual``: h = x + residual and (n(h), h), the add fused into the norm's kernel."""
        ops = _fused(x)
        if ops is not None and self.weight.dtype == x.dtype:
            return ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        h = x + residual
        return self._norm(h), h

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # same math, one kernel
        xf = x.to(torch.promote_types(dtype, torch.float32))  # fp32 for half types; fp64 stays fp64
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


@dataclass
class _AttnContext:
    """What every layer of one forward pass shares: rotary tables, mask, cache addressing."""

    cos: torch.Tensor  # [B, T, 1, Dh]
    sin: torch.Tensor  # signed: (-sin, sin) halves, see apply_rope
    mask: torch.Tensor | None  # [B, 1, T, S] additive (0 visible, -inf hidden); None: causal / all visible
    cache: Any = None
    input_pos: int | torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        d, q, kv = config.hidden_size, self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = Linear(d, q, bias=False)
        self.k_proj = Linear(d, kv, bias=False)
        self.v_proj = Linear(d, kv, bias=False)
        self.o_proj = Linear(q, d, bias=False)

    def forward(self, x: torch.Tensor, ctx: _AttnContext) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_heads, self.n_kv, self.head_dim
        qkv = stacked.project(self, "qkv", x, (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = qkv if qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, k, v = q.view(B, T, H, Dh), k.view(B, T, Hkv, Dh), v.view(B, T, Hkv, Dh)
        ops = _fused(x)
        if ops is not None and hasattr(ctx.cache, "update_rope"):  # RoPE writes k, v into the cache itself
            q, k, v = ctx.cache.update_rope(self.layer_idx, ops, q, k, v, ctx.cos, ctx.sin, ctx.input_pos)
        else:
            if ops is not None:
                q, k = ops.rope(q, k, ctx.cos, ctx.sin)
            else:
                q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, Dh]
            if ctx.cache is not None:
                k, v = ctx.cache.update(self.layer_idx, k, v, ctx.input_pos)
        G = H // Hkv
        if T == 1:
            # Decode: the G query heads sharing a kv head are stacked along the query axis,
            # [B, Hkv, G, Dh], so K/V are read once per kv head and never repeated.
            if ops is cpu_fused:
                out = cpu_fused.decode_attention(q.view(B, Hkv, G, Dh), k, v, ctx.mask)
            else:
                mask = None if ctx.mask is None else ctx.mask.expand(B, 1, G, k.shape[2])
                out = F.scaled_dot_product_attention(q.view(B, Hkv, G, Dh), k, v, attn_mask=mask)
        elif ctx.mask is None:  # plain causal self-attention over the whole sequence
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, enable_gqa=G > 1)
            out = out.transpose(1, 2)  # [B, T, H, Dh]
        else:
            if q.is_cuda and G > 1:  # fused CUDA kernels take masks but not always GQA: repeat K/V
                S = k.shape[2]
                k = k[:, :, None].expand(B, Hkv, G, S, Dh).reshape(B, H, S, Dh)
                v = v[:, :, None].expand(B, Hkv, G, S, Dh).reshape(B, H, S, Dh)
            gqa = k.shape[1] != H
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=ctx.mask, enable_gqa=gqa)
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(B, T, H * Dh))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, f, bias=False)
        self.up_proj = Linear(d, f, bias=False)
        self.down_proj = Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = stacked.project(self, "gate_up", x, (self.gate_proj, self.up_proj))
        gate, up = gate_up if gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        ops = _fused(x)
        if ops is not None:
            return self.down_proj(ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, ctx: _AttnContext, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream entering the layer is ``x + residual`` (``x`` for the first layer, residual None);
        returns (mlp_out, h), whose sum is the stream leaving it (see the module docstring)."""
        if FUSED_OPS and x.is_cpu:  # a CPU decode step: the whole layer as one native call where it applies
            out = cpu_decode.decode_layer(self, x, ctx, residual)
            if out is not None:
                return out
        if residual is None:
            h, a = x, self.input_layernorm(x)
        else:
            a, h = self.input_layernorm(x, residual)  # h = x + residual
        a, h = self.post_attention_layernorm(self.self_attn(a, ctx), h)  # h = attn_out + h
        return self.mlp(a), h


class LlamaBackbone(nn.Module):
    """Holds the ``model.*`` parameters (HF's LlamaModel)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if _building_on_meta():  # an uninitialised weight: nn.Embedding's own init is normal_ (see Llama)
            weight = torch.empty(config.vocab_size, config.hidden_size)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _building_on_meta() -> bool:
    """Whether modules are being built under ``with torch.device("meta")`` (for weights loaded or assigned
    next). Nothing is initialised then: there is nothing to initialise, and ``normal_`` on a meta tensor
    imports torch._dynamo, 3-4 s of a process's start-up on a 2-core CPU."""
    return torch.empty(0).device.type == "meta"


# ------------------------------------------------------------------------------------ the model
class Llama(nn.Module):
    """Llama causal LM; see the module docstring for the calling conventions."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama(config) needs a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.policy_version: int = 0
        # recompute each decoder layer in backward instead of keeping its activations (training only)
        self.activation_checkpointing = False
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        if not _building_on_meta():
            self.reset_parameters()

    # ---------------------------------------------------------------- parameters
    def reset_parameters(self, std: float = 0.02) -> None:
        """HF's initialisation: N(0, std) for linears and embeddings, ones for norms."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, std)
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The [vocab, hidden] output projection (the embedding matrix when tied)."""
        return self.lm_head.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ---------------------------------------------------------------- rotary tables and masks
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dev = positions.device
        inv = self._inv_freq.get(dev)
        if inv is None:
            inv = rope_inv_freq(self.config).to(device=dev, dtype=torch.float32)
            self._inv_freq[dev] = inv
        freqs = positions.to(torch.float32).unsqueeze(-1) * inv  # [B, T, Dh/2]
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        sin = freqs.sin()
        signed_sin = torch.cat((-sin, sin), dim=-1)
        return cos.unsqueeze(2).to(dtype), signed_sin.unsqueeze(2).to(dtype)  # [B, T, 1, Dh]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """bool [B, T, S] -> [B, 1, T, S] in the model dtype: 0 where visible, -inf elsewhere."""
        zero = torch.zeros((), dtype=self.dtype, device=visible.device)
        return torch.where(visible, zero, float("-inf")).unsqueeze(1)

    def _context(
        self,
        input_ids: torch.Tensor,
        input_pos: int | torch.Tensor | None,
        cache: Any,
        attention_mask: torch.Tensor | None,
        positions: torch.Tensor | None,
    ) -> _AttnContext:
        B, T = input_ids.shape
        dev = input_ids.device
        if cache is not None:
            if input_pos is None:
                raise ValueError("a cache was given without input_pos (the cache slot of the first new token)")
            if attention_mask is not None or positions is not None:
                raise ValueError("with a cache, padding comes from cache.start; do not pass attention_mask/positions")
            start = cache.start[:B]
            if isinstance(input_pos, int):
                slots = torch.arange(input_pos, input_pos + T, device=dev)
                kv_len = input_pos + T
            else:
                slots = input_pos.to(device=dev, dtype=torch.long).reshape(T)
                kv_len = cache.max_seq_len
            pos = (slots[None, :] - start[:, None]).clamp(min=0)
            cos, sin = self._rope(pos, self.dtype)
            if isinstance(input_pos, int) and not getattr(cache, "has_padding", True) and (T == 1 or input_pos == 0):
                # no left padding and attention reads exactly slots [0, input_pos + T): decode sees all
                # of them, a prefill from slot 0 is plain causal
                return _AttnContext(cos, sin, None, cache, input_pos)
            keys = torch.arange(kv_len, device=dev)
            visible = (keys <= slots[:, None]) & (keys >= start[:, None, None])  # [B, T, S]
            visible |= keys == slots[:, None]
            return _AttnContext(cos, sin, self._additive(visible), cache, input_pos)
        if input_pos is not None:
            raise ValueError("input_pos was given without a cache")
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(
                    f"attention_mask must have shape {(B, T)} like input_ids, got {tuple(attention_mask.shape)}"
                )
            valid = attention_mask.to(device=dev, dtype=torch.bool)
            if positions is None:
                positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
            idx = torch.arange(T, device=dev)
            causal = idx[None, :] <= idx[:, None]  # [T(query), S(key)]
            visible = (causal & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=dev)
            mask = self._additive(visible)
        else:
            mask = None
            if positions is None:
                positions = torch.arange(T, device=dev).expand(B, T)
        if positions.shape != (B, T):
            raise ValueError(f"positions must have shape {(B, T)} like input_ids, got {tuple(positions.shape)}")
        cos, sin = self._rope(positions, self.dtype)
        return _AttnContext(cos, sin, mask)

    # ---------------------------------------------------------------- forward
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        input_pos: int | torch.Tensor | None = None,
        cache: Any = None,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, T, D] (what lm_head multiplies)."""
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(
                f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
            )
        ctx = self._context(input_ids, input_pos, cache, attention_mask, positions)
        x, residual = self.model.embed_tokens(input_ids), None
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.model.layers:
            if recompute:  # non-reentrant: gradients also flow through K/V a cache keeps (shared prefixes)
                x, residual = torch.utils.checkpoint.checkpoint(layer, x, ctx, residual, use_reentrant=False,
                                                                preserve_rng_state=False)  # no dropout
            else:
                x, residual = layer(x, ctx, residual)
        return self.model.norm(x, residual)[0]  # LlamaConfig has >= 1 layer, so residual is set

    def forward(
        self,
        input_ids: torch.Tensor,
        input_pos: int | torch.Tensor | None = None,
        cache: Any = None,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] in the model dtype."""
        h = self.hidden_states(input_ids, input_pos, cache, attention_mask=attention_mask, positions=positions)
        return self.lm_head(h)

    # ---------------------------------------------------------------- checkpoints
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> "Llama":
        """Load a local Hugging Face Llama directory (config.json + model.safetensors or a sharded index)."""
        from llamarl.models.hf_io import load_llama

        return load_llama(path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
        """Write config.json + safetensors that transformers' LlamaForCausalLM loads."""
        from llamarl.models.hf_io import save_llama

        save_llama(self, path, max_shard_bytes=max_shard_bytes)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}/"
            f"{c.num_key_value_heads}, vocab={c.vocab_size}, tied={c.tie_word_embeddings}, "
            f"policy_version={self.policy_version}"
        )
