"""Native fp32 CPU decode ops (csrc/fused_cpu.cpp via llamarl.models.cpu_fused) against independent references.

RMSNorm: float64 math, within fp32 rounding (the mean is summed in double, everything else is fp32);
with the residual the sum ``h`` must be bitwise the fp32 add. RoPE: bitwise equal to the eager
``apply_rope`` (same fp32 products and sums). The model: a decode with the native ops against the eager
path of the same model (``LLAMARL_FUSED_OPS=0`` semantics, by calling with autograd on).
"""

from __future__ import annotations

import pytest
import torch

from llamarl.models import LlamaConfig, Llama, cpu_fused
from llamarl.models.llama import apply_rope
from native_harness import count_calls, run_with_cpu_isa


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return w.double() * (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 1, 384), (3, 5, 7), (8, 1, 1), (2, 2, 2048), (4, 1000)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_float64(shape, residual):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    x.view(-1, shape[-1])[0] = 0.0  # an all-zero row: y = 0, no NaN (eps > 0)
    eps = 1e-5
    with torch.no_grad():
        if residual:
            r = torch.randn(shape, generator=g)
            y, h = cpu_fused.rms_norm(x, w, eps, r)
            assert torch.equal(h, x + r)  # the fp32 add, bitwise
            r_strided = torch.stack([r, r], dim=-1)[..., 0]  # a strided residual is copied contiguous first
            y2, h2 = cpu_fused.rms_norm(x, w, eps, r_strided)
            assert torch.equal(y2, y) and torch.equal(h2, h)
            ref = _rms_ref(h, w, eps)
        else:
            y = cpu_fused.rms_norm(x, w, eps)
            ref = _rms_ref(x, w, eps)
    assert y.shape == x.shape and y.dtype == torch.float32
    # three fp32 roundings (mean, rsqrt, two products) on values of size |w * x / rms|
    tol = 8 * torch.finfo(torch.float32).eps * ref.abs() + 1e-30
    assert bool(((y.double() - ref).abs() <= tol).all()), float(((y.double() - ref).abs() / tol).max())
    # and close to torch's own fp32 RMSNorm (which sums the squares in fp32)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x if not residual else h, (shape[-1],), w, eps),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("B,T,H,Hkv,Dh", [(1, 1, 6, 2, 64), (3, 4, 4, 4, 8), (2, 7, 8, 1, 2), (1, 1, 32, 8, 128)])
def test_rope_is_bitwise_the_eager_rope(B, T, H, Hkv, Dh):
    g = torch.Generator().manual_seed(B * 100 + T)
    q, k = torch.randn(B, T, H, Dh, generator=g), torch.randn(B, T, Hkv, Dh, generator=g)
    ang = torch.rand(B, T, 1, Dh // 2, generator=g) * 100
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((-ang.sin(), ang.sin()), -1)
    with torch.no_grad():
        qo, ko = cpu_fused.rope(q, k, cos, sin)
        wide = torch.zeros(B, T, 2, Dh)  # strided tables are taken too (copied contiguous first)
        wide[:, :, :1] = cos
        qs, ks = cpu_fused.rope(q, k, wide[:, :, :1], sin)
    assert torch.equal(qo, apply_rope(q, cos, sin)) and torch.equal(ko, apply_rope(k, cos, sin))
    assert torch.equal(qs, qo) and torch.equal(ks, ko)


@pytest.mark.parametrize("B,T", [(1, 1), (4, 1), (1, 5), (3, 4)])
def test_rope_takes_the_columns_of_a_fused_qkv_product(B, T):
    """q and k as column slices of one [B, T, (H + 2 Hkv) Dh] product (tokens strided, heads contiguous) are
    read in place, bitwise as their contiguous copies; a layout that is not token-strided is copied first."""
    H, Hkv, Dh = 6, 2, 8
    g = torch.Generator().manual_seed(B * 10 + T)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * Dh, generator=g)
    q, k, _ = qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
    q, k = q.view(B, T, H, Dh), k.view(B, T, Hkv, Dh)
    assert cpu_fused._token_stride(q) == ((H + 2 * Hkv) * Dh if B * T > 1 else H * Dh)  # one token: any
    ang = torch.rand(B, T, 1, Dh // 2, generator=g) * 100
    cos = torch.cat((ang.cos(), ang.cos()), -1)
    sin = torch.cat((-ang.sin(), ang.sin()), -1)
    with torch.no_grad():
        qo, ko = cpu_fused.rope(q, k, cos, sin)
        ref_q, ref_k = cpu_fused.rope(q.contiguous(), k.contiguous(), cos, sin)
        heads_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # heads outermost: not token-strided
        assert cpu_fused._token_stride(heads_t) is None or T == 1
        qt, _ = cpu_fused.rope(heads_t, k, cos, sin)
    assert qo.is_contiguous() and ko.is_contiguous()
    assert torch.equal(qo, ref_q) and torch.equal(ko, ref_k) and torch.equal(qt, ref_q)
    assert torch.equal(qo, apply_rope(q, cos, sin))


def test_bad_inputs_are_named():
    x, w = torch.randn(2, 8), torch.randn(8)
    with torch.no_grad():
        with pytest.raises(ValueError, match="x must be a contiguous float32 CPU tensor"):
            cpu_fused.rms_norm(x.double(), w, 1e-5)
        with pytest.raises(ValueError, match="x must be a contiguous"):
            cpu_fused.rms_norm(torch.randn(8, 2).T, w, 1e-5)
        with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
            cpu_fused.rms_norm(x, torch.randn(7), 1e-5)
        with pytest.raises(ValueError, match="residual must have x's shape"):
            cpu_fused.rms_norm(x, w, 1e-5, torch.randn(3, 8))
        q = torch.randn(1, 1, 2, 6)
        with pytest.raises(ValueError, match="cos must have shape"):
            cpu_fused.rope(q, q, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 6))
        with pytest.raises(ValueError, match="head_dim must be even"):
            q5 = torch.randn(1, 1, 2, 5)
            cpu_fused.rope(q5, q5, torch.randn(1, 1, 1, 5), torch.randn(1, 1, 1, 5))
    with pytest.raises(RuntimeError, match="no backward"):
        cpu_fused.rms_norm(x.requires_grad_(), w, 1e-5)


def test_rope_kv_rejects_slots_outside_the_cache():
    q, kv = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 1, 4)
    cos = torch.ones(1, 1, 1, 4)
    cache = torch.zeros(1, 1, 5, 4)
    with torch.no_grad():
        with pytest.raises(ValueError, match="slot 5 outside the cache's 5 slots"):
            cpu_fused.rope_kv(q, kv, kv, cos, cos, cache, cache.clone(), 5)
        with pytest.raises(ValueError, match=r"k_cache must be \[1, 1, slots, 4\]"):
            cpu_fused.rope_kv(q, kv, kv, cos, cos, torch.zeros(1, 2, 5, 4), cache, 0)
        with pytest.raises(ValueError, match="slots must be an int or a LongTensor"):
            cpu_fused.rope_kv(q, kv, kv, cos, cos, cache, cache.clone(), torch.tensor([1, 2]))


def test_model_decode_with_native_ops_matches_the_eager_path(monkeypatch):
    """Prefill + KV-cache decode steps under no_grad (native norm / RoPE) against the same forward with
    autograd on (the eager ops), logits within fp32 summation-order tolerance."""
    from llamarl.generation.kv_cache import KVCache

    calls = count_calls(monkeypatch, cpu_fused, ["rms_norm", "rope_kv", "decode_attention"])

    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    ids = torch.randint(0, 97, (2, 9))
    full = model(ids)  # autograd on: eager ops
    cache = KVCache(cfg, max_batch_size=2, max_seq_len=16, dtype=torch.float32, device=torch.device("cpu"))
    with torch.no_grad():
        cache.set_start(torch.zeros(2, dtype=torch.long))
        pre = model(ids[:, :6], 0, cache)
        steps = [model(ids[:, t:t + 1], t, cache) for t in range(6, 9)]
    got = torch.cat([pre] + steps, dim=1)
    # 4 forwards x (2 norms per layer + the final one), one RoPE + cache write per layer; attention in the
    # 3 decode steps
    assert calls == {"rms_norm": 4 * (2 * 2 + 1), "rope_kv": 4 * 2, "decode_attention": 3 * 2}
    torch.testing.assert_close(got, full.detach(), rtol=1e-5, atol=1e-5)


def _attention_ref(q, k, v, mask):
    """float64 softmax(q kᵀ / sqrt(Dh) + mask) v, q [B, Hkv, G, Dh], k/v [B, Hkv, S, Dh], mask [B, 1, 1, S]."""
    s = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        s = s + mask.double()
    return torch.softmax(s, dim=-1) @ v.double()


@pytest.mark.parametrize("B,Hkv,G,S,Dh", [(1, 2, 3, 1, 64), (4, 2, 3, 37, 64), (3, 1, 1, 16, 8), (2, 4, 2, 70, 24),
                                          (5, 2, 4, 33, 128)])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_matches_float64(B, Hkv, G, S, Dh, masked):
    g = torch.Generator().manual_seed(B * 1000 + S)
    q = torch.randn(B, Hkv, G, Dh, generator=g)
    cache_k = torch.randn(B + 1, Hkv, S + 9, Dh, generator=g) * 2  # the op reads strided slices of a cache
    cache_v = torch.randn(B + 1, Hkv, S + 9, Dh, generator=g)
    k, v = cache_k[:B, :, :S], cache_v[:B, :, :S]
    mask = None
    if masked:  # left padding: row b sees slots [start_b, S)
        start = torch.randint(0, S, (B,), generator=g)
        visible = torch.arange(S)[None, :] >= start[:, None]
        mask = torch.where(visible, 0.0, float("-inf"))[:, None, None, :].contiguous()
    with torch.no_grad():
        out = cpu_fused.decode_attention(q, k, v, mask)
        torch.set_num_threads(2)
        try:
            out2 = cpu_fused.decode_attention(q, k, v, mask)
        finally:
            torch.set_num_threads(1)
    ref = _attention_ref(q, k, v, mask)
    assert out.shape == q.shape and torch.equal(out, out2)  # one (row, kv head) per thread: no bit depends on it
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-6)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else
                                                            mask.expand(B, 1, G, S))
    torch.testing.assert_close(out, sdpa, rtol=2e-5, atol=2e-6)


def test_decode_attention_edge_cases():
    q, k, v = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 5, 16), torch.randn(2, 1, 5, 16)
    mask = torch.zeros(2, 1, 1, 5)
    mask[1] = float("-inf")  # a row that sees nothing: NaN, as torch's SDPA gives
    mask[0, ..., 1:] = float("-inf")  # a row that sees one slot: exactly that slot's value
    with torch.no_grad():
        out = cpu_fused.decode_attention(q, k, v, mask)
        assert torch.isnan(out[1]).all()
        torch.testing.assert_close(out[0, 0], v[0, 0, :1].expand(2, 16), rtol=0, atol=0)
        with pytest.raises(ValueError, match="k must be float32"):
            cpu_fused.decode_attention(q, k.double(), v, mask)
        with pytest.raises(ValueError, match="mask must be float32"):
            cpu_fused.decode_attention(q, k, v, mask[:, :, :, :4])


def test_portable_attention_path():
    """Hosts without AVX-512 run the portable decode attention: the same checks in a process where
    LLAMARL_CPU_ISA=avx2 caps the instruction set (the attention kernel has AVX-512 and portable paths)."""
    code = ("import itertools, torch; import tests.test_cpu_fused as t\n"
            "for shape, masked in itertools.product([(4, 2, 3, 37, 64), (3, 1, 1, 16, 8), (2, 4, 2, 70, 24)], "
            "[False, True]):\n"
            "    t.test_decode_attention_matches_float64(*shape, masked)\n"
            "t.test_decode_attention_edge_cases()\n"
            "from llamarl._native import native; print(native().linear_cpu_isa())")
    assert run_with_cpu_isa(code, "avx2") in ("avx2+fma", "scalar")
