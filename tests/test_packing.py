"""Packed weights (llamarl.models.packing) and stacked projections (llamarl.models.stacked).

Packing must change nothing but where the weights live: same Parameter objects, bitwise the same values,
logits equal to transformers' on the same weights, checkpoints that still save. Stacked q|k|v and
gate|up products must equal the separate products (bitwise on the native CPU decode path, which computes
every weight row independently; within fp32 tolerance through a BLAS), never run where autograd needs
the weights' gradients, and follow weights that get re-pointed after the first call.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from llamarl.generation import GenerationEngine, SamplingParams
from llamarl.models import Llama, LlamaConfig, stacked
from llamarl.models.packing import pack_parameters_
from llamarl.models.quantize import quantize_model
from llamarl.weight_sync.buckets import load_views
from dist_harness import random_model

CFG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def _model(seed: int = 0, **over) -> Llama:
    return random_model(LlamaConfig(**{**CFG, **over}), seed).eval()


def _adjacent(*ts: torch.Tensor) -> bool:
    return stacked.adjacent_view(ts) is not None


def test_packing_moves_storage_only():
    m = _model()
    before = {n: (p, p.detach().clone()) for n, p in m.named_parameters()}
    assert not _adjacent(m.model.layers[0].self_attn.q_proj.weight, m.model.layers[0].self_attn.k_proj.weight)
    assert pack_parameters_(m)
    storages = {p.untyped_storage().data_ptr() for p in m.parameters()}
    assert len(storages) == 1
    for n, p in m.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]) and p.data_ptr() % 64 == 0, n
    for layer in m.model.layers:
        a, f = layer.self_attn, layer.mlp
        assert _adjacent(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)
        assert _adjacent(f.gate_proj.weight, f.up_proj.weight)
    assert m.weights_key[0] == "packed"
    if sys.platform.startswith("linux"):
        assert m.packed_hugepages and min(p.data_ptr() for p in m.parameters()) % (2 << 20) == 0
    assert not pack_parameters_(m)  # once is enough: the tensors already are views of one buffer
    twin = copy.deepcopy(m)  # separate tensors again, with the original's weights_key: packed anew
    assert pack_parameters_(twin) and twin.weights_key != m.weights_key
    assert _adjacent(*(getattr(twin.model.layers[0].self_attn, n).weight for n in ("q_proj", "k_proj", "v_proj")))


def test_packing_leaves_bucket_views_alone():
    """Parameters that are views into one flat buffer (the weight sync's buckets) stay there."""
    m = _model()
    flat = torch.zeros(sum(p.numel() for p in m.parameters()))
    views, off = {}, 0
    for n, p in m.named_parameters():
        views[n] = flat[off : off + p.numel()].view(p.shape)
        views[n].copy_(p.detach())
        off += p.numel()
    load_views(m, views, strict=True, where="test")
    del m.weights_key  # even without the key, views into a larger storage are not packed
    assert not pack_parameters_(m)
    assert m.model.embed_tokens.weight.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_packed_model_matches_transformers_and_saves(tmp_path):
    transformers = pytest.importorskip("transformers")
    m = _model(1, tie_word_embeddings=True)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in m.config.to_hf_dict().items()
                                          if k not in ("architectures", "model_type")})
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(m.state_dict(), strict=False)
    ids = torch.randint(0, CFG["vocab_size"], (3, 11), generator=torch.Generator().manual_seed(0))
    assert pack_parameters_(m)
    with torch.no_grad():
        ref = hf(ids).logits
        got = m(ids)  # no_grad: stacked q|k|v and gate|up through F.linear
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    m.save_pretrained(tmp_path / "packed")  # views into one storage are saved as separate tensors
    back = Llama.from_pretrained(tmp_path / "packed")
    for (n, p), (_, q) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("rows", [1, 3, 8, 12])
def test_stacked_projection_equals_separate_products(rows):
    m = _model(2)
    assert pack_parameters_(m)
    a, f = m.model.layers[1].self_attn, m.model.layers[1].mlp
    x = torch.randn(rows, CFG["hidden_size"], generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        qkv = stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj))
        gu = stacked.project(f, "gate_up", x, (f.gate_proj, f.up_proj))
        sep = (a.q_proj(x), a.k_proj(x), a.v_proj(x), f.gate_proj(x), f.up_proj(x))
    assert qkv is not None and gu is not None
    for got, ref in zip(qkv + gu, sep):
        assert got.shape == ref.shape
        if rows <= 8:  # the native decode kernel: each output row independent of the rows around it
            assert torch.equal(got, ref)
        else:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_stacked_projection_not_used_for_training():
    m = _model(3)
    ref = _model(3)
    assert pack_parameters_(m)
    a = m.model.layers[0].self_attn
    x = torch.randn(2, 5, CFG["hidden_size"])
    assert stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj)) is None  # grad enabled, params need it
    ids = torch.randint(0, CFG["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    m(ids).logsumexp(-1).mean().backward()
    ref(ids).logsumexp(-1).mean().backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_stacked_projection_follows_repointed_weights():
    """After the first stacked call, re-pointing one weight (as a weight sync does) is seen at once: the
    projections run separately (no longer adjacent) with the new values, never the cached view."""
    m = _model(4)
    assert pack_parameters_(m)
    a = m.model.layers[0].self_attn
    x = torch.randn(1, CFG["hidden_size"])
    with torch.no_grad():
        assert stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj)) is not None
        new_k = torch.randn_like(a.k_proj.weight)
        a.k_proj.weight.data = new_k.clone()
        assert stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj)) is None
        ids = torch.randint(0, CFG["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(2))
        ref = _model(4)
        ref.model.layers[0].self_attn.k_proj.weight.copy_(new_k)
        torch.testing.assert_close(m(ids), ref(ids), rtol=1e-5, atol=1e-5)


def test_stacked_quantized_projections():
    """A quantized model packs codes and scales separately, so both stack; outputs equal the separate ones."""
    m = _model(5)
    quantize_model(m, "int8", backend="eager")
    assert pack_parameters_(m)
    a = m.model.layers[0].self_attn
    assert _adjacent(a.q_proj.qweight, a.k_proj.qweight, a.v_proj.qweight)
    assert _adjacent(a.q_proj.scale, a.k_proj.scale, a.v_proj.scale)
    x = torch.randn(4, CFG["hidden_size"])
    with torch.no_grad():
        got = stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj))
        ref = (a.q_proj(x), a.k_proj(x), a.v_proj(x))
    assert got is not None
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
    # a deep copy keeps the codes and scales (buffers) as views into one copy of the flat buffer and the
    # original's weights_key: it is packed anew, with its own key, and stacks on its own storage
    twin = copy.deepcopy(m)
    b = twin.model.layers[0].self_attn
    assert b.q_proj.qweight.untyped_storage().nbytes() > b.q_proj.qweight.nbytes  # still a view after the copy
    assert pack_parameters_(twin) and twin.weights_key != m.weights_key
    assert _adjacent(b.q_proj.qweight, b.k_proj.qweight, b.v_proj.qweight)
    assert b.q_proj.qweight.untyped_storage().data_ptr() != a.q_proj.qweight.untyped_storage().data_ptr()
    assert torch.equal(b.q_proj.qweight, a.q_proj.qweight) and torch.equal(b.v_proj.scale, a.v_proj.scale)


def test_engine_packs_by_default_and_generates_the_same():
    """The engine packs the weights (not the one-shot ``generate``); greedy tokens and log-probs match an
    engine on an unpacked copy of the same model."""
    packed, plain = _model(6), _model(6)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    e1 = GenerationEngine(packed, max_batch_size=2, max_seq_len=32)
    e2 = GenerationEngine(plain, max_batch_size=2, max_seq_len=32, pack_weights=False)
    assert e1.packed and not e2.packed and not hasattr(plain, "weights_key")
    for a, b in zip(e1.generate(prompts, params, eos_token_id=()), e2.generate(prompts, params, eos_token_id=())):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
    # the stacked views cached under inference_mode serve later no_grad and autograd forwards too
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), plain(ids), rtol=1e-5, atol=1e-5)
    packed(ids).sum().backward()
    assert packed.lm_head.weight.grad is not None


def test_weight_sync_buckets_lay_out_stackable_projections():
    """The generator's flat buckets (state-dict order, 256-byte aligned) put q|k|v and gate|up end to end
    for shapes whose projections are multiples of 256 bytes: the generator runs them stacked too."""
    from llamarl.weight_sync import GeneratorBuckets, GeneratorLayout, TrainerLayout, llama_param_specs, plan_sync

    m = _model(7)
    plan = plan_sync(llama_param_specs(CFG, torch.float32), TrainerLayout(1), GeneratorLayout())
    b = GeneratorBuckets.create(plan, 0, storage="shm", slots=1)
    try:
        b.load_into(m, 0)
        x = torch.randn(1, CFG["hidden_size"])
        with torch.no_grad():
            for layer in m.model.layers:
                a, f = layer.self_attn, layer.mlp
                assert stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj)) is not None
                assert stacked.project(f, "gate_up", x, (f.gate_proj, f.up_proj)) is not None
        assert not pack_parameters_(m)  # the bucket views stay where the trainer writes
    finally:
        del m
        b.close()


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["none", "int8", "fp8"])
def test_packed_engine_on_cuda(quantization):
    """GPU only: an engine that packs (stacked q|k|v and gate|up, cuBLAS or the Triton quantized kernels,
    CUDA graphs) gives the tokens and log-probs of an engine on an unpacked copy of the same model."""
    packed, plain = _model(8).cuda(), _model(8).cuda()
    e1 = GenerationEngine(packed, max_batch_size=4, max_seq_len=40, quantization=quantization)
    e2 = GenerationEngine(plain, max_batch_size=4, max_seq_len=40, quantization=quantization, pack_weights=False)
    assert e1.packed and not e2.packed
    a = packed.model.layers[0].self_attn
    x = torch.randn(3, CFG["hidden_size"], device="cuda")
    with torch.no_grad():
        got = stacked.project(a, "qkv", x, (a.q_proj, a.k_proj, a.v_proj))
        assert got is not None
        for g, r in zip(got, (a.q_proj(x), a.k_proj(x), a.v_proj(x))):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    for x, y in zip(e1.generate(prompts, params, eos_token_id=()), e2.generate(prompts, params, eos_token_id=())):
        assert x.token_ids == y.token_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
