"""Fused RMSNorm / RoPE / SiLU·up kernels against eager PyTorch and float64, and their wiring into Llama.

RoPE and SiLU·up must reproduce eager's bytes: every product of two bf16 or fp16 values is exact in
fp32, so the kernels' roundings are eager's. The exception is silu's exp under the interpreter: numpy's
``exp`` is not torch-CPU's (Sleef) ``exp``, so on the CPU the kernel is compared bitwise with the eager
formula evaluated with numpy's exp (and with torch's own silu: bitwise in bf16, within a few ulps
in fp16/fp32); on CUDA both use libdevice's ``expf`` and the comparison with ``F.silu(g) * up`` is bitwise.

RMSNorm's mean of squares is a reduction whose order is the kernel's own, so bits are not guaranteed.
The bound used, against the float64 value ref = w · x / sqrt(mean(x²) + eps):

    |y − ref| <= (2u + 2^-19) · |ref| + s

u = 2^-8 (bf16), 2^-11 (fp16), 2^-24 (fp32) is the unit roundoff: y goes through two roundings to the
dtype (x·r, then w·(x·r)), each at most u relative; 2^-19 covers the fp32 error of r = rsqrt(mean + eps)
(the sum of squares, the division, the hardware rsqrt: ~2^-20 together); s is the dtype's smallest
subnormal (rounding in the subnormal range is absolute). In bf16/fp16 that is about two ulps of the
output. The eager module must satisfy the same bound, and the number of elements whose bits differ from
eager is checked to be small (it is usually zero: a flip needs the fp32 mean to move x·r across a
rounding boundary of the dtype). Shapes are tiny and odd (Triton runs interpreted on the CPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llamarl.generation.kv_cache import KVCache
from llamarl.models import Llama, LlamaConfig
from llamarl.models import llama as llama_mod
from llamarl.models.llama import RMSNorm, apply_rope
from llamarl_kernels import fused_ops
from llamarl_kernels.fused_ops import rms_norm, rope, silu_mul
from native_harness import count_calls

FLOATS = [torch.bfloat16, torch.float16, torch.float32]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}  # smallest subnormal


def _bitwise_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype and a.shape == b.shape
    view = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.cpu().view(view) != b.cpu().view(view)).sum())


def _assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    n = _bitwise_diff(a, b)
    assert n == 0, f"{n} of {a.numel()} elements differ bitwise"


def _eager_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's eager RMSNorm (the specification) with weight w."""
    norm = RMSNorm(w.shape[0], eps).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        return norm._norm(x)


def _within_bound(y: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    err = (y.double().cpu() - ref64).abs()
    return err <= (2 * UNIT_ROUNDOFF[dtype] + 2.0**-19) * ref64.abs() + TINY[dtype]


# ----------------------------------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows, D", [(1, 48), (3, 100), (37, 2061)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_fp64_bound_and_eager_bits(dtype, rows, D, with_residual, device):
    torch.manual_seed(rows * D)
    eps = 1e-5
    scale = torch.logspace(-2, 2, rows)[:, None]  # rows of very different magnitude
    x = (torch.randn(rows, D) * scale).to(dtype).to(device)
    if rows >= 3:
        x[1] = 0  # an all-zero row: mean 0, y = 0
    w = (torch.rand(D) + 0.5).to(dtype).to(device)
    if with_residual:
        res = (torch.randn(rows, D) * scale).to(dtype).to(device)
        y, h = rms_norm(x, w, eps, residual=res)
        _assert_same_bits(h, x + res)  # the add, rounded once to the dtype like eager's
        src = x + res
    else:
        y = rms_norm(x, w, eps)
        src = x
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device

    x64 = src.double().cpu()
    ref64 = w.double().cpu() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    eager = _eager_norm(src, w, eps)
    assert _within_bound(y, ref64, dtype).all(), f"max err {(y.double().cpu() - ref64).abs().max()}"
    assert _within_bound(eager, ref64, dtype).all(), "the bound must hold for eager too"
    n_diff = _bitwise_diff(y, eager)
    print(f"rms_norm {dtype} {rows}x{D} residual={with_residual}: {n_diff}/{y.numel()} elements differ from eager")
    if dtype != torch.float32:  # fp32 eager is F.rms_norm: other roundings, the bound is the spec there
        assert n_diff <= max(1, y.numel() // 200)


def test_rms_norm_strided_rows_and_leading_dims(device):
    torch.manual_seed(0)
    wide = torch.randn(2, 5, 80).to(torch.bfloat16).to(device)
    x = wide[..., :72]  # rows of 72 inside rows of 80: a strided view, no copy needed
    res = torch.randn(2, 5, 72).to(torch.bfloat16).to(device)
    w = torch.rand(72).to(torch.bfloat16).to(device)
    y, h = rms_norm(x, w, 1e-6, residual=res)
    assert y.shape == h.shape == (2, 5, 72) and y.is_contiguous()
    _assert_same_bits(h, x + res)
    assert _bitwise_diff(y, _eager_norm(x + res, w, 1e-6)) <= 1
    y2 = rms_norm(x, w, 1e-6)
    assert _bitwise_diff(y2, _eager_norm(x, w, 1e-6)) <= 1


# ----------------------------------------------------------------------------------------------------
# rope
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("B, T, H, Hkv, Dh", [(1, 1, 4, 2, 64), (2, 3, 6, 2, 48), (1, 5, 3, 3, 2)])
def test_rope_bitwise_equals_eager(dtype, B, T, H, Hkv, Dh, device):
    torch.manual_seed(B * T * H * Dh)
    q = torch.randn(B, T, H, Dh).to(dtype).to(device)
    k = torch.randn(B, T, Hkv, Dh).to(dtype).to(device)
    cos = torch.randn(B, T, 1, Dh).to(dtype).to(device)  # arbitrary values: the roundings, not trigonometry
    sin = torch.randn(B, T, 1, Dh).to(dtype).to(device)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape and q_out.is_contiguous() and k_out.is_contiguous()
    _assert_same_bits(q_out, apply_rope(q, cos, sin))
    _assert_same_bits(k_out, apply_rope(k, cos, sin))


def test_rope_strided_inputs_and_model_tables(device):
    """q and k as views of one packed projection, cos/sin broadcast over the batch (stride 0), and the
    model's own rotary tables (llama3 scaling)."""
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=11, hidden_size=48, intermediate_size=40, num_hidden_layers=1, num_attention_heads=6,
                      num_key_value_heads=2, rope_theta=500.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    B, T, H, Hkv, Dh = 3, 4, 6, 2, 8
    qkv = torch.randn(B, T, (H + 2 * Hkv) * Dh).to(torch.bfloat16).to(device)
    q = qkv[..., : H * Dh].view(B, T, H, Dh)
    k = qkv[..., H * Dh : (H + Hkv) * Dh].view(B, T, Hkv, Dh)
    model = Llama(cfg).to(device)
    cos, sin = model._rope(torch.arange(T, device=device)[None] + 1000, torch.bfloat16)
    cos, sin = cos.expand(B, T, 1, Dh), sin.expand(B, T, 1, Dh)
    assert cos.stride(0) == 0
    q_out, k_out = rope(q, k, cos, sin)
    _assert_same_bits(q_out, apply_rope(q, cos, sin))
    _assert_same_bits(k_out, apply_rope(k, cos, sin))


@pytest.mark.parametrize("impl, dtype", [("triton", torch.bfloat16), ("triton", torch.float16),
                                         ("triton", torch.float32), ("cpu_native", torch.float32)])
@pytest.mark.parametrize("slots_kind", ["int", "tensor"])
def test_rope_kv_writes_the_cache_bitwise(impl, dtype, slots_kind, device):
    """rope_kv = RoPE on q and k, then rotated k and v copied into the cache at the token slots: q bitwise
    eager's RoPE, the cache rows at the slots bitwise rope(k) and v, every other cache element untouched.
    q, k, v are column views of one fused q|k|v product; the cache is the row slice of a bigger one."""
    from llamarl.models import cpu_fused

    op = fused_ops.rope_kv if impl == "triton" else cpu_fused.rope_kv
    dev = device if impl == "triton" else torch.device("cpu")
    torch.manual_seed(7)
    B, T, H, Hkv, Dh, S = 2, 3, 6, 2, 8, 10
    qkv = torch.randn(B, T, (H + 2 * Hkv) * Dh).to(dtype).to(dev)
    q, k, v = (t.view(B, T, -1, Dh) for t in qkv.split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1))
    cos, sin = (torch.randn(B, T, 1, Dh).to(dtype).to(dev) for _ in range(2))
    full_k, full_v = (torch.randn(B + 1, Hkv, S, Dh).to(dtype).to(dev) for _ in range(2))
    want_k, want_v = full_k.clone(), full_v.clone()
    slots = 4 if slots_kind == "int" else torch.tensor([7, 2, 5], device=dev)
    idx = torch.arange(4, 4 + T) if slots_kind == "int" else slots.cpu()
    with torch.no_grad():
        q_out = op(q, k, v, cos, sin, full_k[:B], full_v[:B], slots)
    want_k[:B, :, idx.to(dev)] = apply_rope(k, cos, sin).transpose(1, 2)
    want_v[:B, :, idx.to(dev)] = v.transpose(1, 2)
    assert q_out.is_contiguous()
    _assert_same_bits(q_out, apply_rope(q, cos, sin))
    _assert_same_bits(full_k, want_k)
    _assert_same_bits(full_v, want_v)


# ----------------------------------------------------------------------------------------------------
# silu_mul
# ----------------------------------------------------------------------------------------------------
def _silu_mul_with_numpy_exp(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Eager's formula and roundings, with the interpreter's exp (numpy's) in place of torch's."""
    gf = g.float().cpu()
    silu = (gf / (1.0 + torch.from_numpy(np.exp(-gf.numpy())))).to(g.dtype)
    return silu * u.cpu()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 8229), (3, 100), (37, 48), (2, 3, 50)])
def test_silu_mul_matches_eager(dtype, shape, device):
    torch.manual_seed(sum(shape))
    g = (torch.randn(shape) * 6).to(dtype)
    g.view(-1)[:8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 30.0, -30.0]).to(dtype)
    g, u = g.to(device), torch.randn(shape).to(dtype).to(device)
    out = silu_mul(g, u)
    assert out.dtype == dtype and out.shape == g.shape
    eager = F.silu(g) * u
    if device.type == "cuda" or dtype == torch.bfloat16:
        _assert_same_bits(out, eager)
    if device.type == "cpu":
        _assert_same_bits(out, _silu_mul_with_numpy_exp(g, u))
        # two exps that are each within ~1 ulp of exact differ by up to ~2 ulps, which silu keeps; the
        # roundings of silu and of the product can add one each: a few ulps, relative
        rel = torch.finfo(dtype).eps * eager.double().abs().clamp(min=torch.finfo(dtype).tiny)
        assert ((out.double() - eager.double()).abs() <= 4 * rel).all()


def test_silu_mul_strided_rows(device):
    torch.manual_seed(5)
    gate_up = torch.randn(7, 2 * 60).to(torch.bfloat16).to(device)  # a packed [gate | up] projection
    g, u = gate_up[:, :60], gate_up[:, 60:]
    _assert_same_bits(silu_mul(g, u), F.silu(g) * u)


# ----------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors(device, monkeypatch):
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.randn(3, 8, dtype=bf, device=device)
    w = torch.ones(8, dtype=bf, device=device)
    with pytest.raises(TypeError, match="one dtype"):
        rms_norm(x, w.float(), 1e-5)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        rms_norm(x.to(torch.int32), w.to(torch.int32), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be contiguous of shape \[8\]"):
        rms_norm(x, torch.ones(7, dtype=bf, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        rms_norm(x, w, 1e-5, residual=torch.randn(3, 1, 8, dtype=bf, device=device))
    with pytest.raises(ValueError, match="unit stride"):
        rms_norm(torch.randn(8, 3, dtype=bf, device=device).t(), w, 1e-5)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, -1.0)
    # no backward: an input that asks for a gradient is refused (the output was silently detached), unless
    # autograd is off
    trainable = torch.ones(8, dtype=bf, device=device, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"rms_norm: the fused inference ops have no backward, but \['weight'\]"):
        rms_norm(x, trainable, 1e-5)
    with pytest.raises(RuntimeError, match="silu_mul: the fused inference ops have no backward"):
        silu_mul(x.clone().requires_grad_(), x)
    with torch.no_grad():
        torch.testing.assert_close(rms_norm(x, trainable, 1e-5), rms_norm(x, w, 1e-5), rtol=0, atol=0)

    q = torch.randn(1, 2, 4, 8, dtype=f32, device=device)
    k = torch.randn(1, 2, 2, 8, dtype=f32, device=device)
    cs = torch.randn(1, 2, 1, 8, dtype=f32, device=device)
    with pytest.raises(ValueError, match=r"k must be \[1, 2, kv_heads, 8\]"):
        rope(q, torch.randn(1, 3, 2, 8, device=device), cs, cs)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope(q[..., :7], k[..., :7], cs[..., :7], cs[..., :7])
    with pytest.raises(ValueError, match=r"cos must have shape \(1, 2, 1, 8\)"):
        rope(q, k, cs[:, :1], cs)
    with pytest.raises(ValueError, match="q and k must be"):
        rope(q[0], k[0], cs, cs)
    with pytest.raises(TypeError, match="one dtype"):
        rope(q, k, cs.to(bf), cs)

    with pytest.raises(ValueError, match="one shape"):
        silu_mul(x, x[:, :4])
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        silu_mul(x, 1.0)

    # CPU tensors without the interpreter: Triton cannot run them
    monkeypatch.setattr("llamarl_kernels.logprobs.INTERPRETING", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        silu_mul(x.cpu(), x.cpu())


# ----------------------------------------------------------------------------------------------------
# the model's wiring
# ----------------------------------------------------------------------------------------------------
TINY_CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=83, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)


def _tiny_model(dtype: torch.dtype, device) -> Llama:
    torch.manual_seed(11)
    model = Llama(TINY_CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(5.0)  # std 0.1: activations of order one, not vanishing
    return model.to(device=device, dtype=dtype).eval()


def _prefill_and_decode(model: Llama, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Logits of a full forward of ids[:, :P] and then of `steps` single-token decode steps."""
    B, P = ids.shape[0], ids.shape[1] - steps
    cache = KVCache(model.config, B, ids.shape[1], dtype=model.dtype, device=ids.device)
    with torch.inference_mode():
        out = [model(ids[:, :P], 0, cache)]
        for t in range(P, ids.shape[1]):
            out.append(model(ids[:, t : t + 1], t, cache))
    return torch.cat(out, dim=1)


def _compare_fused(model: Llama, ids: torch.Tensor, steps: int, set_fused) -> None:
    set_fused(False)
    ref = _prefill_and_decode(model, ids, steps)
    set_fused(True)
    got = _prefill_and_decode(model, ids, steps)
    n_diff = _bitwise_diff(got, ref)
    print(f"model logits: {n_diff}/{got.numel()} elements differ between fused and eager")
    # Only RMSNorm may differ (rarely, by an ulp of one element), and that propagates through the
    # layers: the logits must agree to a few bf16 ulps of their scale, and almost all bitwise.
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 4 * 2.0**-8 * scale
    assert n_diff <= got.numel() // 10


def test_model_uses_fused_ops_and_matches_eager_on_cpu(monkeypatch):
    """The wiring, on the CPU: the fused path is forced for bf16 CPU tensors (the kernels run under the
    interpreter) and compared with the eager path; every fused op must actually be called."""
    if fused_ops.INTERPRETED is False:
        pytest.skip("the forced CPU path needs the Triton interpreter")
    calls = count_calls(monkeypatch, fused_ops, ["rms_norm", "rope_kv", "silu_mul"])
    model = _tiny_model(torch.bfloat16, "cpu")
    ids = torch.randint(0, TINY_CFG.vocab_size, (2, 7))
    state = {"on": False}
    monkeypatch.setattr(llama_mod, "_fused", lambda x: fused_ops if state["on"] and not torch.is_grad_enabled()
                        and x.dtype in (torch.bfloat16, torch.float16) else None)
    _compare_fused(model, ids, 3, lambda on: state.update(on=on))
    L = TINY_CFG.num_hidden_layers
    # 1 prefill + 3 decode forwards; per forward 2 norms per layer + the final one, 1 rope with the cache
    # write and 1 silu_mul per layer
    assert calls == {"rms_norm": 4 * (2 * L + 1), "rope_kv": 4 * L, "silu_mul": 4 * L}


def test_fused_path_is_off_with_autograd_and_on_cpu():
    from llamarl.models import cpu_fused

    x = torch.ones(2, dtype=torch.bfloat16)
    with torch.no_grad():
        assert llama_mod._fused(x) is None  # bf16 on the CPU: eager (the Triton kernels serve CUDA)
        assert llama_mod._fused(x.float()) is (cpu_fused if llama_mod.FUSED_OPS else None)  # fp32: native ops
        assert llama_mod._fused(torch.ones(2, 2).T.float()) is None  # not contiguous: eager
    assert llama_mod._fused(x.float()) is None  # grad mode: no backward
    if torch.cuda.is_available():
        xc = x.cuda()
        with torch.no_grad():
            assert llama_mod._fused(xc) is (fused_ops if llama_mod.FUSED_OPS else None)
            assert llama_mod._fused(xc.float()) is None
        assert llama_mod._fused(xc) is None  # grad mode: the kernels have no backward


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_fused_matches_eager_on_cuda(dtype, monkeypatch):
    """GPU only: LLAMARL_FUSED_OPS on vs off (the module switch) on a tiny model, prefill + decode; and a
    forward with autograd on still takes the eager path (gradients flow)."""
    model = _tiny_model(dtype, "cuda")
    ids = torch.randint(0, TINY_CFG.vocab_size, (3, 12), device="cuda")
    _compare_fused(model, ids, 4, lambda on: monkeypatch.setattr(llama_mod, "FUSED_OPS", on))
    monkeypatch.setattr(llama_mod, "FUSED_OPS", True)
    logits = model(ids)
    assert logits.requires_grad
    logits.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


# ----------------------------------------------------------------------------------------------------
# GPU lowering without a GPU: compile the kernels for sm_90 (H100/H200) ahead of time
# ----------------------------------------------------------------------------------------------------
_SM90_SCRIPT = r"""
import llamarl_kernels.fused_ops as F

PTR = {0: "*fp32", 1: "*i16", 2: "*fp16"}  # per KIND: bf16 travels as int16 bits
for kind in (0, 1, 2):
    p = PTR[kind]
    names = ["x_ptr", "res_ptr", "w_ptr", "y_ptr", "h_ptr"]
    sig = dict({n: p for n in names}, D="i32", stride_x="i32", stride_res="i32", stride_y="i32", stride_h="i32",
               eps="fp32", d_f32="fp32", inv_d="fp32", HAS_RESIDUAL="constexpr", MEAN_BY_RECIPROCAL="constexpr",
               KIND="constexpr", BLOCK="constexpr")
    build(F._rms_norm_kernel, sig, dict(HAS_RESIDUAL=True, MEAN_BY_RECIPROCAL=True, KIND=kind, BLOCK=2048),
          names, num_warps=8, enable_fp_fusion=False)
    names = ["q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr"]
    ints = ["T", "H", "HKV", "half", "sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sc_b", "sc_t", "ss_b", "ss_t"]
    sig = dict({n: p for n in names}, **{n: "i32" for n in ints}, KIND="constexpr", BLOCK_H="constexpr",
               BLOCK_HALF="constexpr")
    build(F._rope_kernel, sig, dict(KIND=kind, BLOCK_H=32, BLOCK_HALF=32), names, num_warps=4, enable_fp_fusion=False)
    for slots in (True, False):
        names = ["q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "kc_ptr", "vc_ptr"]
        ints = ["slot0", "T", "H", "HKV", "half", "sq_b", "sq_t", "sq_h", "sk_b", "sk_t", "sk_h", "sv_b", "sv_t",
                "sv_h", "sc_b", "sc_t", "ss_b", "ss_t", "skc_b", "skc_h", "skc_s", "svc_b", "svc_h", "svc_s"]
        sig = dict({n: p for n in names}, slots_ptr="*i64" if slots else p, **{n: "i32" for n in ints},
                   KIND="constexpr", SLOTS="constexpr", BLOCK_H="constexpr", BLOCK_HALF="constexpr")
        build(F._rope_kv_kernel, sig, dict(KIND=kind, SLOTS=slots, BLOCK_H=32, BLOCK_HALF=32), names, num_warps=4,
              enable_fp_fusion=False)
    names = ["g_ptr", "u_ptr", "out_ptr"]
    sig = dict({n: p for n in names}, N="i32", stride_g="i32", stride_u="i32", stride_o="i32", KIND="constexpr",
               LIBDEVICE_EXP="constexpr", BLOCK="constexpr")
    build(F._silu_mul_kernel, sig, dict(KIND=kind, LIBDEVICE_EXP=True, BLOCK=1024), names, num_warps=4,
          enable_fp_fusion=False)
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """Every fused-op kernel, in every dtype (and rope_kv with both slot sources), lowers to sm_90 code."""
    from native_harness import run_sm90_compile

    run_sm90_compile(_SM90_SCRIPT, tmp_path)
