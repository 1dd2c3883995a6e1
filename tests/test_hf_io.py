"""Checkpoint I/O: our save_pretrained loads in transformers (same logits), HF checkpoints (single and
sharded) load in ours, and every kind of bad checkpoint raises an error naming the problem."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from llamarl.models import Llama, LlamaConfig, hf_io  # noqa: E402
from llamarl.models.hf_io import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, check_checkpoint  # noqa: E402

CFG = LlamaConfig(
    vocab_size=83, hidden_size=48, intermediate_size=77, num_hidden_layers=2, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0,
    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16},
)


def ours(tied: bool = False, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    m = Llama(CFG.replace(tie_word_embeddings=tied)).eval()
    m.reset_parameters(std=0.1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


def hf_logits(path, x):
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(x).logits


@pytest.mark.parametrize("tied", [False, True])
def test_our_checkpoint_loads_in_transformers(tmp_path, tied):
    m = ours(tied)
    m.save_pretrained(tmp_path)
    assert (tmp_path / WEIGHTS_FILE).is_file() and not list(tmp_path.glob("*.tmp"))
    keys = set(load_file(tmp_path / WEIGHTS_FILE))
    assert ("lm_head.weight" in keys) == (not tied)  # omitted when tied, like transformers
    x = torch.randint(0, CFG.vocab_size, (2, 17))
    with torch.no_grad():
        mine = m(x)
    torch.testing.assert_close(hf_logits(tmp_path, x), mine, rtol=1e-5, atol=1e-5)
    again = Llama.from_pretrained(tmp_path)
    assert again.config == m.config
    with torch.no_grad():
        assert torch.equal(again(x), mine)


def test_sharded_save_roundtrip_and_transformers(tmp_path):
    m = ours(tied=False)
    m.save_pretrained(tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / WEIGHTS_FILE).exists()
    assert set(index["weight_map"]) == set(m.state_dict())
    x = torch.randint(0, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        mine = m(x)
    torch.testing.assert_close(hf_logits(tmp_path, x), mine, rtol=1e-5, atol=1e-5)
    loaded = Llama.from_pretrained(tmp_path)
    for (n, a), (_, b) in zip(m.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    # re-saving as a single file replaces the shards (no stale mix of two checkpoints)
    m.save_pretrained(tmp_path)
    assert (tmp_path / WEIGHTS_FILE).exists() and not (tmp_path / INDEX_FILE).exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))


def test_loads_transformers_sharded_checkpoint(tmp_path):
    """A transformers checkpoint in shards, with rms_norm_eps 1e-6 (Llama 2, Qwen2; transformers' init keeps
    hidden states small, so eps 1e-5 instead would move the logits by ~6e-3)."""
    torch.manual_seed(3)
    fields = {k: v for k, v in CFG.to_hf_dict().items() if k not in ("architectures", "model_type")}
    hc = transformers.LlamaConfig(**fields | {"rms_norm_eps": 1e-6})
    hf = transformers.LlamaForCausalLM(hc).eval()
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / INDEX_FILE).exists()
    m = Llama.from_pretrained(tmp_path)
    assert m.config.rms_norm_eps == 1e-6
    x = torch.randint(0, CFG.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(m(x), hf(x).logits, rtol=1e-5, atol=1e-5)


def test_dtype_conversion(tmp_path):
    m = ours()
    m.to(torch.bfloat16).save_pretrained(tmp_path)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["torch_dtype"] == "bfloat16"
    assert load_file(tmp_path / WEIGHTS_FILE)["model.norm.weight"].dtype == torch.bfloat16
    m32 = Llama.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in m32.parameters())
    assert torch.equal(m32.model.norm.weight, m.model.norm.weight.float())
    with pytest.raises(ValueError, match="dtype"):
        Llama.from_pretrained(tmp_path, dtype=torch.int8)


# ------------------------------------------------------------------------------------ bad input
def saved(tmp_path, tied=False):
    ours(tied).save_pretrained(tmp_path)
    return tmp_path


def edit_config(path, **changes):
    cfg = json.loads((path / CONFIG_FILE).read_text())
    cfg.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(cfg))


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Llama.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Llama.from_pretrained(tmp_path)
    p = saved(tmp_path)
    (p / WEIGHTS_FILE).rename(p / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="model.safetensors.*convert"):
        Llama.from_pretrained(p)


def test_corrupt_config_and_weights(tmp_path):
    p = saved(tmp_path)
    (p / CONFIG_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        Llama.from_pretrained(p)
    p = saved(tmp_path)
    data = (p / WEIGHTS_FILE).read_bytes()
    (p / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="model.safetensors"):
        Llama.from_pretrained(p)
    (p / WEIGHTS_FILE).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        Llama.from_pretrained(p)


def test_unsupported_architecture(tmp_path):
    p = saved(tmp_path)
    edit_config(p, model_type="mistral", architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match="unsupported architecture.*mistral"):
        Llama.from_pretrained(p)
    p = saved(tmp_path)
    edit_config(p, architectures=["LlamaModel"])
    with pytest.raises(ValueError, match="headless Llama .* needs a LlamaForCausalLM checkpoint"):
        Llama.from_pretrained(p)


def test_a_pad_token_id_outside_the_vocabulary_is_dropped_with_a_warning(tmp_path):
    p = saved(tmp_path)
    for pad in (-1, CFG.vocab_size):
        edit_config(p, pad_token_id=pad)
        with pytest.warns(UserWarning, match=f"pad_token_id={pad} lies outside the vocabulary"):
            model = Llama.from_pretrained(p)
        assert model.config.pad_token_id is None


def test_shape_mismatch_between_config_and_weights(tmp_path):
    p = saved(tmp_path)
    edit_config(p, intermediate_size=CFG.intermediate_size + 1)
    with pytest.raises(ValueError, match="mlp.gate_proj.weight.*shape"):
        Llama.from_pretrained(p)


def test_missing_and_unexpected_tensors(tmp_path):
    p = saved(tmp_path)
    edit_config(p, num_hidden_layers=3)
    with pytest.raises(ValueError, match="missing .*model.layers.2"):
        Llama.from_pretrained(p)
    p = saved(tmp_path)
    edit_config(p, num_hidden_layers=1)
    with pytest.raises(ValueError, match="does not have.*model.layers.1"):
        Llama.from_pretrained(p)
    p = saved(tmp_path, tied=True)
    edit_config(p, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="lm_head.weight.*tie"):
        Llama.from_pretrained(p)


def edit_weights(path, **tensors):
    sd = load_file(path / WEIGHTS_FILE)
    sd.update({k.replace("__", "."): t for k, t in tensors.items()})
    save_file(sd, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def refused_by_both(path, match):
    """check_checkpoint (headers) and from_pretrained (the load) refuse ``path`` with the same message."""
    with pytest.raises(ValueError, match=match) as checked:
        check_checkpoint(path)
    with pytest.raises(ValueError, match=match) as loaded:
        Llama.from_pretrained(path)
    assert str(checked.value) == str(loaded.value)


@pytest.mark.parametrize("dtype, name", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3"),
                                         (torch.float8_e5m2, "F8_E5M2")])
def test_weights_outside_the_dtype_whitelist_are_refused_on_both_paths(tmp_path, dtype, name):
    p = saved(tmp_path)
    w = load_file(p / WEIGHTS_FILE)["model.layers.0.mlp.up_proj.weight"]
    edit_weights(p, model__layers__0__mlp__up_proj__weight=w.to(dtype))  # float8: would upcast silently
    refused_by_both(p, f"'model.layers.0.mlp.up_proj.weight' has dtype {name}; llamarl loads only "
                       "float64/float32/bfloat16/float16")


def test_missing_shard(tmp_path):
    p2 = tmp_path / "sharded"
    ours().save_pretrained(p2, max_shard_bytes=40_000)
    next(p2.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard model-00002"):
        Llama.from_pretrained(p2)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path, monkeypatch):
    # an untied checkpoint whose config.json claims tied: its own head must not be dropped silently
    p = saved(tmp_path, tied=False)
    edit_config(p, tie_word_embeddings=True)
    refused_by_both(p, "tie_word_embeddings=true, but the checkpoint's 'lm_head.weight' .*differs from "
                       "'model.embed_tokens.weight'.*set \"tie_word_embeddings\": false in config.json")
    # one ulp in the last row, found by the block-wise comparison (10 rows per block here)
    monkeypatch.setattr(hf_io, "_COMPARE_BLOCK_BYTES", 8 * CFG.hidden_size * 10)
    emb = load_file(p / WEIGHTS_FILE)["model.embed_tokens.weight"]
    head = emb.clone()
    head[-1, 0] = torch.nextafter(head[-1, 0], torch.tensor(2.0))
    edit_weights(p, lm_head__weight=head)
    refused_by_both(p, r"differs .* first in rows \[80, 83\)")


@pytest.mark.parametrize("head_dtype", [torch.float32, torch.float64])
def test_tied_config_accepts_an_lm_head_equal_to_the_embedding(tmp_path, head_dtype):
    m = ours(tied=True)
    m.save_pretrained(tmp_path)
    emb = load_file(tmp_path / WEIGHTS_FILE)["model.embed_tokens.weight"]
    edit_weights(tmp_path, lm_head__weight=emb.to(head_dtype))  # some tools save both (same values)
    assert check_checkpoint(tmp_path).tie_word_embeddings
    loaded = Llama.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    x = torch.randint(0, CFG.vocab_size, (1, 7))
    with torch.no_grad():
        assert torch.equal(loaded(x), m(x))


def test_generation_config_eos_ids_join_the_stop_tokens(tmp_path):
    from llamarl.eval import eos_ids
    from llamarl.executors.trainer import policy_side_files
    from llamarl.models import CharTokenizer
    from llamarl.models.hf_io import generation_eos_ids

    assert generation_eos_ids(tmp_path) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9], "temperature": 0.6}))
    assert generation_eos_ids(tmp_path) == (2, 9)
    config = LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, eos_token_id=7)
    assert eos_ids(CharTokenizer(), config) == [2, 7]
    assert eos_ids(CharTokenizer(), config, tmp_path) == [2, 7, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert generation_eos_ids(tmp_path) == (5,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ValueError, match="eos_token_id must be a token id or a list of them"):
        generation_eos_ids(tmp_path)
    # a saved policy carries it, and the tokenizer files of the tokenizer the run used
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("model's own")
    files = policy_side_files(str(tmp_path), str(tok / "tokenizer.json"))
    assert files == {"tokenizer.json": b"{}", "generation_config.json": (tmp_path / "generation_config.json").read_bytes()}
