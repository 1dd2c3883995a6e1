"""The quantized Llama: module swap, buffer layout for the weight sync, and numerics of the whole model.

Independent reference: the same model with every quantized weight replaced by its dequantization
(float(q) * scale, exact in fp32) in ordinary ``nn.Linear`` layers. The quantized model must give the
same logits up to fp32 accumulation order, and the generation engine with ``quantization=...`` must
report log-probs that this reference reproduces. Under TRITON_INTERPRET=1 the tiny model keeps the
interpreted kernels to a few hundred launches.
"""

import copy

import pytest
import torch
from torch import nn

from llamarl.generation import GenerationEngine, SamplingParams
from llamarl.models import Llama, LlamaConfig
from llamarl.models.linear import Linear
from llamarl.models.quantize import QuantizedLinear, quantize_model, quantized_state_names
from llamarl_kernels.quant import quantize
from llamarl_kernels.reference import dequantize_ref, quantize_ref

MODES = ["int8", "fp8"]
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def _model(device, dtype=torch.float32, tie=False, seed=0) -> Llama:
    torch.manual_seed(seed)
    m = Llama(TINY.replace(tie_word_embeddings=tie))
    m.reset_parameters(std=0.08)  # peakier next-token distributions than the default 0.02
    return m.to(device=device, dtype=dtype).eval()


def _dequantized_twin(qmodel: nn.Module, original: nn.Module) -> nn.Module:
    """``original`` with each quantized weight replaced by float(qweight) * scale (plain nn.Linear)."""
    twin = copy.deepcopy(original)
    params = dict(twin.named_parameters(remove_duplicate=False))
    buffers = dict(qmodel.named_buffers())
    with torch.no_grad():
        for names in quantized_state_names(qmodel).values():
            w = dequantize_ref(buffers[names.qweight], buffers[names.scale], torch.float32)
            params[names.weight].copy_(w)  # exact in fp32; rounds once for a bf16 model
    return twin


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_swaps_decoder_linears_only(mode, device):
    model = _model(device)
    n_params = model.num_parameters()
    assert quantize_model(model, mode) is model
    for i, layer in enumerate(model.model.layers):
        for name in LINEAR_NAMES:
            sub = layer.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            mod = getattr(sub, name)
            assert isinstance(mod, QuantizedLinear), f"layers.{i}.{name} was not quantized"
            assert mod.mode == mode and mod.bias is None
    assert type(model.lm_head) is Linear and type(model.model.embed_tokens) is nn.Embedding

    names = quantized_state_names(model)
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    expected = {f"model.layers.{i}.{'self_attn' if n in attn else 'mlp'}.{n}.weight"
                for i in range(TINY.num_hidden_layers) for n in LINEAR_NAMES}
    assert set(names) == expected
    state = model.state_dict()
    qdtype = torch.int8 if mode == "int8" else torch.float8_e4m3fn
    for full, nm in names.items():
        assert full not in state and nm.mode == mode
        assert state[nm.qweight].dtype == qdtype and state[nm.scale].dtype == torch.float32
        assert state[nm.scale].shape == state[nm.qweight].shape[:1]
    assert dict(model.named_buffers()).keys() >= {n for nm in names.values() for n in (nm.qweight, nm.scale)}
    # the quantized matrices left the parameter list (they are buffers for the weight sync)
    quantized = sum(state[nm.qweight].numel() for nm in names.values())
    assert model.num_parameters() == n_params - quantized


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_quantized_model_matches_dequantized_reference(mode, backend, device):
    original = _model(device)
    qmodel = quantize_model(copy.deepcopy(original), mode, backend=backend)
    twin = _dequantized_twin(qmodel, original)
    ids = torch.randint(0, TINY.vocab_size, (2, 7), device=device)
    with torch.no_grad():
        got, want, full = qmodel(ids), twin(ids), original(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(want, full), "quantization should change the model"


@pytest.mark.parametrize("mode", MODES)
def test_bf16_model(mode, device):
    original = _model(device, dtype=torch.bfloat16)
    qmodel = quantize_model(copy.deepcopy(original), mode)
    twin = _dequantized_twin(qmodel, original)
    ids = torch.randint(0, TINY.vocab_size, (1, 6), device=device)
    with torch.no_grad():
        got, want = qmodel(ids), twin(ids)
    assert got.dtype == torch.bfloat16
    # the twin rounds its weights to bf16; the kernel uses the exact fp32 dequantization
    torch.testing.assert_close(got.float(), want.float(), rtol=0.05, atol=0.05)


def test_backends_quantize_to_identical_bytes(device):
    lin = nn.Linear(50, 33, bias=True).to(device)
    for mode in MODES:
        a = QuantizedLinear.from_linear(lin, mode, backend="triton")
        b = QuantizedLinear.from_linear(lin, mode, backend="eager")
        assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
        assert torch.equal(a.scale, b.scale) and torch.equal(a.bias, lin.bias.detach())
        x = torch.randn(3, 50, device=device)
        torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-6)
        w_deq = dequantize_ref(a.qweight, a.scale).double()
        torch.testing.assert_close(a(x).double(), x.double() @ w_deq.t() + lin.bias.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_load_weight_writes_in_place(mode, device):
    mod = QuantizedLinear.from_linear(nn.Linear(40, 24, bias=False).to(device), mode)
    ptrs = (mod.qweight.data_ptr(), mod.scale.data_ptr())
    new_w = torch.randn(24, 40, device=device, dtype=torch.bfloat16)
    mod.load_weight_(new_w)
    assert (mod.qweight.data_ptr(), mod.scale.data_ptr()) == ptrs
    q, s = quantize_ref(new_w, mode)
    assert torch.equal(mod.qweight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(mod.scale, s)
    # a trainer shard written by the weight sync straight into a row block of the buffers
    shard = torch.randn(8, 40, device=device)
    quantize(shard, mode, out=(mod.qweight[8:16], mod.scale[8:16]))
    q2, s2 = quantize_ref(shard, mode)
    assert torch.equal(mod.qweight[8:16].view(torch.uint8), q2.view(torch.uint8)) and torch.equal(mod.scale[8:16], s2)
    with pytest.raises(ValueError, match=r"does not match the quantized buffer \(24, 40\)"):
        mod.load_weight_(torch.randn(40, 24, device=device))


def test_include_lm_head_on_tied_model(device):
    original = _model(device, tie=True)
    qmodel = quantize_model(copy.deepcopy(original), "int8", include_lm_head=True)
    assert isinstance(qmodel.lm_head, QuantizedLinear)
    assert isinstance(qmodel.model.embed_tokens, nn.Embedding)
    assert "lm_head.weight" in quantized_state_names(qmodel)
    twin = _dequantized_twin(qmodel, copy.deepcopy(original).requires_grad_(False))
    twin.lm_head.weight = nn.Parameter(dequantize_ref(qmodel.lm_head.qweight, qmodel.lm_head.scale))  # untie
    twin.model.embed_tokens.weight = nn.Parameter(original.model.embed_tokens.weight.detach().clone())
    ids = torch.randint(0, TINY.vocab_size, (1, 5), device=device)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(ids), twin(ids), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_generation_engine_logprobs_match_reference(mode, device):
    original = _model(device, seed=1)
    engine = GenerationEngine(copy.deepcopy(original), max_batch_size=2, max_seq_len=24, quantization=mode)
    assert isinstance(engine.model.model.layers[0].mlp.up_proj, QuantizedLinear)
    prompts = [[1, 5, 9, 33], [1, 70]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.0), eos_token_id=())
    twin = _dequantized_twin(engine.model, original)
    for out in outs:
        seq = torch.tensor([out.prompt_token_ids + out.token_ids], device=device)
        with torch.no_grad():
            logp = torch.log_softmax(twin(seq)[0].float(), dim=-1)
        P = len(out.prompt_token_ids)
        for t, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = logp[P - 1 + t]
            assert abs(row[tok].item() - lp) < 1e-4
            assert row[tok] >= row.max() - 1e-4, "greedy must pick the reference argmax (up to near-ties)"


def test_quantize_model_errors(device):
    model = _model(device)
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize_model(model, "int4")
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize_model(model, "int8", backend="cuda")
    assert quantize_model(model, "none") is model and isinstance(model.lm_head, nn.Linear)
    quantize_model(model, "int8", backend="eager")
    with pytest.raises(ValueError, match="found no nn.Linear inside decoder layers"):
        quantize_model(model, "int8")  # already quantized
    with pytest.raises(TypeError, match="expects an nn.Linear"):
        QuantizedLinear.from_linear(nn.Embedding(3, 4), "int8")
