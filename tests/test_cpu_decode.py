"""The native decoder layer of a CPU decode step (llamarl.models.cpu_decode, csrc/decode_layer_cpu.cpp).

Reference: the module path of the same model (the layer's ops one by one, ``cpu_decode.ENABLED`` off),
which tests/test_cpu_fused.py and tests/test_model.py tie to the eager ops and to transformers. The
native layer runs the same kernels in the same order, so the KV cache it writes is bitwise the module
path's and its outputs agree to fp32 rounding (SiLU's exp is std::exp instead of torch's).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llamarl._native import native
from llamarl.generation import GenerationEngine, SamplingParams
from llamarl.generation.kv_cache import KVCache
from llamarl.models import Llama, LlamaConfig, cpu_decode, linear
from llamarl.models.packing import pack_parameters_
from llamarl.models.quantize import quantize_model
from dist_harness import random_model
from native_harness import count_calls

CFG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _model(seed: int = 0, pack: bool = True) -> Llama:
    m = random_model(CFG, seed).eval()
    if pack:
        assert pack_parameters_(m)
    return m


@pytest.fixture
def native_calls(monkeypatch):
    return count_calls(monkeypatch, native(), ["decode_layer_f32_cpu"])


def _decode(model: Llama, prompts: list[list[int]], steps: int, native_layer: bool, monkeypatch):
    """Left-padded prefill, then ``steps`` greedy decode steps by hand; returns (logits per step, cache)."""
    monkeypatch.setattr(cpu_decode, "ENABLED", native_layer)
    B, P = len(prompts), max(len(p) for p in prompts)
    cache = KVCache(CFG, B, P + steps, dtype=torch.float32, device="cpu")
    cache.set_start(torch.tensor([P - len(p) for p in prompts]))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    out = []
    with torch.inference_mode():
        logits = model(ids, 0, cache)[:, -1]
        for t in range(steps):
            y = logits.argmax(-1)
            logits = model(y[:, None], P + t, cache)[:, -1]
            out.append(logits)
    return torch.stack(out, 1), cache


@pytest.mark.parametrize("prompts", [[[5, 6, 7]], [[5, 6, 7, 8], [9, 10], [11, 12, 13]]], ids=["one_row", "padded"])
def test_native_layer_matches_the_module_path(prompts, native_calls, monkeypatch):
    model = _model()
    steps = 5
    got, got_cache = _decode(model, prompts, steps, True, monkeypatch)
    assert native_calls["decode_layer_f32_cpu"] == steps * CFG.num_hidden_layers  # every decode layer, no prefill
    ref, ref_cache = _decode(model, prompts, steps, False, monkeypatch)
    assert native_calls["decode_layer_f32_cpu"] == steps * CFG.num_hidden_layers  # the module path made none
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_cache.k + got_cache.v, ref_cache.k + ref_cache.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the first layer of the first decode step sees the same input on both paths and runs the same kernels
    # up to its cache write: those k, v are bitwise equal
    P = max(len(p) for p in prompts)
    assert torch.equal(got_cache.k[0][:, :, P], ref_cache.k[0][:, :, P])
    assert torch.equal(got_cache.v[0][:, :, P], ref_cache.v[0][:, :, P])


def test_engine_generates_the_same_tokens(native_calls, monkeypatch):
    model = _model(1)
    engine = GenerationEngine(model, max_batch_size=6, max_seq_len=40)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, n=2)
    monkeypatch.setattr(cpu_decode, "ENABLED", True)
    a = engine.generate(prompts, params, eos_token_id=())
    assert native_calls["decode_layer_f32_cpu"] > 0
    monkeypatch.setattr(cpu_decode, "ENABLED", False)
    b = engine.generate(prompts, params, eos_token_id=())
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5


def test_module_path_where_the_native_layer_does_not_apply(native_calls, monkeypatch):
    """Separately allocated weights (no stacked q|k|v), a quantized model, autograd on, autocast, the
    static-shape step (slot tensor) and the native linear switched off all keep the module path."""
    prompts, steps = [[5, 6, 7]], 2
    _decode(_model(2, pack=False), prompts, steps, True, monkeypatch)
    q = _model(2, pack=False)
    quantize_model(q, "int8", backend="eager")
    pack_parameters_(q)
    _decode(q, prompts, steps, True, monkeypatch)
    monkeypatch.setattr(linear, "CPU_LINEAR", False)
    _decode(_model(2), prompts, steps, True, monkeypatch)
    monkeypatch.setattr(linear, "CPU_LINEAR", True)
    model = _model(2)
    cache = KVCache(CFG, 1, 8, dtype=torch.float32, device="cpu")
    cache.set_start(torch.zeros(1, dtype=torch.long))
    model(torch.tensor([[5, 6]]), 0, cache)  # autograd on
    with torch.inference_mode():
        model(torch.tensor([[7]]), torch.tensor([2]), cache)  # slot tensor (CUDA-graph step shape)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.tensor([[7]]), 2, cache)  # autocast: the module path's projections are bf16, none native
    assert native_calls["decode_layer_f32_cpu"] == 0
    with torch.inference_mode():
        model(torch.tensor([[7]]), 2, cache)
    assert native_calls["decode_layer_f32_cpu"] == CFG.num_hidden_layers


def test_cache_overflow_is_an_error():
    model = _model(3)
    cache = KVCache(CFG, 1, 4, dtype=torch.float32, device="cpu")
    cache.set_start(torch.zeros(1, dtype=torch.long))
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7, 8]]), 0, cache)
        with pytest.raises(ValueError, match="KV cache overflow"):
            model(torch.tensor([[9]]), 4, cache)
        with pytest.raises(ValueError, match="negative slot -1"):
            model(torch.tensor([[9]]), -1, cache)
    with pytest.raises(ValueError, match="negative slot -2"):
        model(torch.tensor([[9, 9]]), -2, cache)  # the eager path (autograd on)


_MISFIT = """
import sys, torch
sys.path.insert(0, "tests")
from test_cpu_decode import CFG, _model
from llamarl.generation.kv_cache import KVCache
from llamarl.models import LlamaConfig
case = sys.argv[1]
fewer_heads = LlamaConfig(**{**CFG.__dict__, "num_key_value_heads": 1})
cache, ids = {"bf16": (KVCache(CFG, 1, 8, dtype=torch.bfloat16, device="cpu"), [[5]]),
              "rows": (KVCache(CFG, 1, 8, dtype=torch.float32, device="cpu"), [[5], [6], [7], [8]]),
              "heads": (KVCache(fewer_heads, 1, 8, dtype=torch.float32, device="cpu"), [[5]])}[case]
with torch.inference_mode():
    try:
        _model(0)(torch.tensor(ids), 7, cache)
        print("no error")
    except ValueError as exc:
        print("ValueError", exc)
"""


@pytest.mark.parametrize("case", ["bf16", "rows", "heads"])
def test_a_cache_that_does_not_fit_the_layer_is_refused_not_written_past(case):
    """A cache of another dtype, with fewer rows than the batch or other kv heads than the model: the native
    layer indexes the cache blindly (it wrote past its end, or read garbage), so it must leave such a cache to
    the module path, which names the misfit. Run in a child: the failure this guards against is a segfault."""
    run = subprocess.run([sys.executable, "-c", _MISFIT, case], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("ValueError"), run.stdout
