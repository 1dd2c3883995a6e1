"""Llama model vs transformers' LlamaForCausalLM (the independent reference), plus config checks.

Random tiny HF models are saved with ``save_pretrained`` and loaded with ``Llama.from_pretrained``; the
configs cover GQA, MQA, multi-head, llama3 and linear RoPE scaling, tied embeddings, odd sizes and a
head_dim that differs from hidden_size / num_attention_heads. Everything is fp32 and CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from llamarl.generation.kv_cache import KVCache  # noqa: E402
from llamarl.models import LLAMA_CONFIGS, Llama, LlamaConfig  # noqa: E402
from llamarl.models.linear import Linear  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "gqa": dict(vocab_size=97, hidden_size=64, intermediate_size=83, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "llama3_rope_tied": dict(
        vocab_size=101, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, rope_theta=500.0, rope_scaling=LLAMA3, tie_word_embeddings=True,
    ),
    "mha_odd": dict(vocab_size=61, hidden_size=40, intermediate_size=70, num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=5),
    "mqa_head_dim": dict(
        vocab_size=89, hidden_size=32, intermediate_size=57, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16,
    ),
    "linear_rope": dict(
        vocab_size=70, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}


def hf_model(tmp_path, name: str, **extra):
    kw = copy.deepcopy(dict(max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-5, **CONFIGS[name]))
    kw.update(extra)  # (deep copy: transformers edits rope dicts in place)
    torch.manual_seed(1234)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a mix-up of norms would show
        for n, p in hf.named_parameters():
            if n.endswith("layernorm.weight") or n == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    path = tmp_path / name
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    hf, path = hf_model(tmp_path, name)
    model = Llama.from_pretrained(path)
    x = torch.randint(0, hf.config.vocab_size, (3, 23))
    with torch.no_grad():
        ref = hf(x).logits
        out = model(x)
        h = model.hidden_states(x)
    scale = ref.abs().max().item()
    assert (out - ref).abs().max().item() <= 2e-5 * max(scale, 1.0)
    # hidden_states is exactly what lm_head multiplies
    torch.testing.assert_close(h @ model.lm_head_weight.T, out, rtol=0, atol=1e-5)


def test_parameter_names_and_linears_match_hf(tmp_path):
    for name, tied in (("gqa", False), ("llama3_rope_tied", True)):
        hf, path = hf_model(tmp_path, name)
        model = Llama.from_pretrained(path)
        assert set(model.state_dict()) == set(hf.state_dict())
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        assert len(linears) == 7 * model.config.num_hidden_layers + 1
        assert all(type(m) is Linear and m.bias is None for m in linears)  # nn.Linear + the CPU decode path
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert model.lm_head_weight is model.lm_head.weight
        assert model.policy_version == 0


def test_right_padded_batch_matches_unpadded(tmp_path):
    _, path = hf_model(tmp_path, "gqa")
    model = Llama.from_pretrained(path)
    seqs = [torch.randint(0, 97, (n,)) for n in (11, 4, 8)]
    batch = torch.zeros(3, 11, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
        batch[i, len(s) :] = 5  # arbitrary pad token after the sequence
    with torch.no_grad():
        padded = model(batch)
        for i, s in enumerate(seqs):
            alone = model(s[None])
            torch.testing.assert_close(padded[i, : len(s)], alone[0], rtol=1e-5, atol=1e-5)


def test_attention_mask_left_padding_matches_unpadded(tmp_path):
    _, path = hf_model(tmp_path, "llama3_rope_tied")
    model = Llama.from_pretrained(path)
    seqs = [torch.randint(0, 101, (n,)) for n in (9, 3, 6)]
    T = 9
    batch = torch.full((3, T), 7, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    with torch.no_grad():
        out = model(batch, attention_mask=mask)
        assert torch.isfinite(out).all()
        for i, s in enumerate(seqs):
            torch.testing.assert_close(out[i, T - len(s) :], model(s[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ragged", [True, False])
def test_kv_cache_decode_equals_full_forward(tmp_path, ragged):
    """Chunked prefill then token-by-token decode (int and tensor input_pos) vs one full forward.

    ragged: left-padded rows (masked attention); otherwise equal lengths (the mask-free fast path)."""
    _, path = hf_model(tmp_path, "llama3_rope_tied")
    model = Llama.from_pretrained(path)
    lens = [20, 13, 17] if ragged else [20, 20, 20]
    seqs = [torch.randint(0, 101, (n,)) for n in lens]
    P = 8  # prompt length of the longest row; the others are left-padded by the same amount
    pad = [max(lens) - n for n in lens]
    batch = torch.zeros(3, max(lens), dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, pad[i] :] = s
    for tensor_pos in (False, True):
        cache = KVCache(model.config, 3, 32, dtype=torch.float32, device="cpu")
        cache.set_start(torch.tensor(pad))
        assert cache.has_padding == ragged
        with torch.no_grad():
            chunks = [model(batch[:, :P], 0, cache), model(batch[:, P : P + 5], P, cache)]
            for t in range(P + 5, max(lens)):
                pos = torch.tensor([t]) if tensor_pos else t
                chunks.append(model(batch[:, t : t + 1], pos, cache))
            inc = torch.cat(chunks, dim=1)
            for i, s in enumerate(seqs):
                full = model(s[None])[0]
                assert (inc[i, pad[i] :] - full).abs().max().item() < 1e-4


def test_gradients_match_transformers(tmp_path):
    hf, path = hf_model(tmp_path, "gqa")
    model = Llama.from_pretrained(path).train()
    hf.train()
    x = torch.randint(0, 97, (2, 12))
    y = torch.randint(0, 97, (2, 12))

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    loss_of(hf(x).logits).backward()
    loss_of(model(x)).backward()
    hf_params = dict(hf.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[n].grad, rtol=1e-4, atol=1e-6, msg=f"grad of {n}")


def test_bf16_close_to_fp32(tmp_path):
    _, path = hf_model(tmp_path, "gqa")
    m32 = Llama.from_pretrained(path)
    m16 = Llama.from_pretrained(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    x = torch.randint(0, 97, (2, 10))
    with torch.no_grad():
        a, b = m32(x), m16(x).float()
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()


def test_presets_sizes():
    tiny, small = LLAMA_CONFIGS["tiny"], LLAMA_CONFIGS["small"]
    assert 0.5e6 <= Llama(tiny).num_parameters() == tiny.num_parameters() <= 1.0e6
    assert 15e6 <= Llama(small).num_parameters() == small.num_parameters() <= 30e6
    # published parameter counts of the real checkpoints
    assert LLAMA_CONFIGS["llama-3.2-1b"].num_parameters() == 1_235_814_400
    assert LLAMA_CONFIGS["llama-3.1-8b"].num_parameters() == 8_030_261_248
    assert abs(LLAMA_CONFIGS["llama-3.1-70b"].num_parameters() - 70.55e9) < 0.05e9
    assert abs(LLAMA_CONFIGS["llama-3.1-405b"].num_parameters() - 405.85e9) < 0.1e9
    from llamarl.models import CharTokenizer

    assert tiny.vocab_size == CharTokenizer().vocab_size


def test_config_hf_dict_roundtrip_and_transformers_agrees(tmp_path):
    for name, cfg in LLAMA_CONFIGS.items():
        assert LlamaConfig.from_hf_dict(cfg.to_hf_dict()) == cfg, name
    # transformers 5.x writes the new dialect (rope_parameters); we read it back identically
    hf, path = hf_model(tmp_path, "llama3_rope_tied")
    import json

    ours = LlamaConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert ours.rope_scaling == LLAMA3 and ours.rope_theta == 500.0 and ours.tie_word_embeddings
    assert ours.num_key_value_heads == 2 and ours.head_dim == 8


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers():
    """A config.json holding both dialects (a hand- or tool-merged one) that disagree: transformers takes
    rope_scaling with the top-level rope_theta; so must we, or the logits differ silently."""
    d = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "max_position_embeddings": 256, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128},
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    ours, hf = LlamaConfig.from_hf_dict(d), transformers.LlamaConfig(**d)
    want = dict(hf.rope_parameters)
    assert ours.rope_theta == want.pop("rope_theta") == 500000.0
    assert ours.rope_scaling == want and want["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="'rope_parameters' must be a mapping"):
        LlamaConfig.from_hf_dict({**d, "rope_scaling": None, "rope_parameters": [1.0]})


@pytest.mark.parametrize(
    "special",
    [{}, {"bos_token_id": None, "eos_token_id": None}, {"bos_token_id": 5}, {"eos_token_id": [7, 9]},
     {"bos_token_id": 0, "eos_token_id": None}],
)
def test_from_hf_dict_special_ids_as_transformers_reads_them(special):
    # absent keys take transformers' defaults (bos 1, eos 2: what HF generate stops on); null stays None
    d = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, **special}
    ours, hf = LlamaConfig.from_hf_dict(d), transformers.LlamaConfig(**d)
    assert ours.bos_token_id == hf.bos_token_id
    hf_eos = tuple(hf.eos_token_id) if isinstance(hf.eos_token_id, list) else hf.eos_token_id
    assert ours.eos_token_id == hf_eos
    assert ours.eos_token_ids == (() if hf_eos is None else hf_eos if isinstance(hf_eos, tuple) else (hf_eos,))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_key_value_heads=3), "multiple of"),
        (dict(head_dim=7), "even"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
        (dict(eos_token_id=500), "eos_token_id"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ],
)
def test_config_validation(changes, match):
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    base.update(changes)
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**base)


def test_from_hf_dict_rejects_other_architectures():
    d = LLAMA_CONFIGS["tiny"].to_hf_dict()
    with pytest.raises(ValueError, match="mistral"):
        LlamaConfig.from_hf_dict({**d, "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="attention_bias"):
        LlamaConfig.from_hf_dict({**d, "attention_bias": True})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf_dict({**d, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="missing required"):
        LlamaConfig.from_hf_dict({"model_type": "llama", "vocab_size": 10})
    for field, value, match in [("vocab_size", None, "'vocab_size' must be an integer, got None"),
                                ("hidden_size", 64.5, "'hidden_size' must be an integer, got 64.5"),
                                ("tie_word_embeddings", "false", "'tie_word_embeddings' must be true or false"),
                                ("rope_scaling", "linear", "'rope_scaling' must be a mapping")]:
        with pytest.raises(ValueError, match=match):
            LlamaConfig.from_hf_dict({**d, field: value})
    assert LlamaConfig.from_hf_dict({**d, "vocab_size": float(d["vocab_size"])}).vocab_size == d["vocab_size"]


def test_bad_inputs_raise():
    model = Llama(LLAMA_CONFIGS["tiny"])
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.ones(1, 3))
    with pytest.raises(ValueError, match="input_pos"):
        model(torch.ones(1, 3, dtype=torch.long), cache=KVCache(model.config, 1, 8, dtype=torch.float32, device="cpu"))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 4))


def test_a_model_built_on_the_meta_device_is_not_initialised(tmp_path):
    """Building on the meta device (from_pretrained, the TP generator, checkpoint gathering) runs no init:
    normal_ on a meta tensor imports torch._dynamo, seconds of every executor's start. Checked in a fresh
    interpreter, where nothing imported it before. A CPU build is still initialised (HF's N(0, 0.02))."""
    import subprocess
    import sys

    Llama(LLAMA_CONFIGS["tiny"]).save_pretrained(tmp_path / "model")
    script = (f"import sys, torch\nfrom llamarl.models import LLAMA_CONFIGS, Llama\n"
              f"with torch.device('meta'):\n    Llama(LLAMA_CONFIGS['tiny'])\n"
              f"Llama.from_pretrained({str(tmp_path / 'model')!r})\nprint('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr + out.stdout
    model = Llama(LLAMA_CONFIGS["tiny"])
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
