"""Reward model: HF LlamaForSequenceClassification (num_labels=1) checkpoints load in ours with the scores
transformers computes, ours load in transformers, and every checkpoint that is not a scalar reward model is
refused with a message naming the problem, by check_reward_model (headers only) and at load alike."""

from __future__ import annotations

import copy
import json

import pytest
import safetensors
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from llamarl.models import Llama, LlamaConfig, LlamaRewardModel, check_reward_model, load_reward_model  # noqa: E402
from llamarl.models.hf_io import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, check_checkpoint  # noqa: E402

PAD = 0
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CONFIGS = {
    "gqa_llama3_tied": dict(vocab_size=83, hidden_size=48, intermediate_size=77, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2, rope_theta=500.0, rope_scaling=LLAMA3,
                            tie_word_embeddings=True),
    "mha_odd": dict(vocab_size=61, hidden_size=40, intermediate_size=70, num_hidden_layers=3, num_attention_heads=5,
                    num_key_value_heads=5),
    "mqa_head_dim": dict(vocab_size=89, hidden_size=32, intermediate_size=57, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16),
}
LENGTHS = [13, 5, 1, 9]  # ragged, right-padded to T = 13


def hf_reward_model(tmp_path, name="gqa_llama3_tied", num_labels=1, causal=False, **save_kw):
    """A random tiny transformers reward model (or causal LM), saved to ``tmp_path/name``."""
    kw = copy.deepcopy(dict(max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-5, **CONFIGS[name]))
    torch.manual_seed(1234)
    if causal:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    else:
        hf = transformers.LlamaForSequenceClassification(
            transformers.LlamaConfig(**kw, num_labels=num_labels, pad_token_id=PAD))
    with torch.no_grad():  # non-trivial norm weights, so a mix-up of norms would show
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = tmp_path / name
    hf.eval().save_pretrained(path, **save_kw)
    return hf, path


def ragged_batch(vocab_size, seed=0):
    """Right-padded ids [4, 13] (real tokens never equal PAD, so transformers finds the same last token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (len(LENGTHS), max(LENGTHS)), generator=g)
    real = torch.arange(ids.shape[1])[None, :] < torch.tensor(LENGTHS)[:, None]
    return ids.masked_fill(~real, PAD), real.long()


def hf_scores(model_or_path, ids, mask):
    hf = model_or_path
    if not isinstance(hf, torch.nn.Module):
        hf = transformers.LlamaForSequenceClassification.from_pretrained(model_or_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask).logits
    assert logits.shape == (ids.shape[0], 1)
    return logits[:, 0]


def assert_scores_close(ours, ref, atol=1e-5):
    diff = (ours - ref).abs().max().item()
    assert diff <= atol, f"reward model scores differ from transformers' by up to {diff:.3g} (atol {atol})"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scores_match_transformers_on_a_ragged_right_padded_batch(tmp_path, name):
    hf, path = hf_reward_model(tmp_path, name)
    rm = load_reward_model(path)
    assert isinstance(rm, LlamaRewardModel) and not rm.training
    assert list(rm.state_dict()) == list(hf.state_dict())  # HF's names, 1:1, no lm_head
    assert "lm_head" not in "".join(n for n, _ in rm.named_parameters())
    ids, mask = ragged_batch(hf.config.vocab_size)
    ref = hf_scores(hf, ids, mask)
    ours = rm.scores(ids, LENGTHS)
    assert ours.dtype == torch.float32 and ours.shape == (len(LENGTHS),) and not ours.requires_grad
    assert_scores_close(ours, ref)
    assert ref.std() > 0.05  # the rows really score differently: a wrong token position would show
    # padding invariant: what the pad positions hold changes nothing; each row alone scores the same
    garbage = torch.randint(0, hf.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(rm.scores(torch.where(mask.bool(), ids, garbage), torch.tensor(LENGTHS)), ours)
    alone = torch.cat([rm.scores(ids[b : b + 1, :n], [n]) for b, n in enumerate(LENGTHS)])
    assert_scores_close(alone, ref)


def test_save_pretrained_loads_in_transformers_with_the_same_scores(tmp_path):
    config = LlamaConfig(**CONFIGS["mqa_head_dim"], max_position_embeddings=64, pad_token_id=PAD)
    torch.manual_seed(0)
    rm = LlamaRewardModel(config).eval()
    rm.reset_parameters(std=0.1)
    rm.save_pretrained(tmp_path)
    assert set(load_file(tmp_path / WEIGHTS_FILE)) == set(rm.state_dict()) and not list(tmp_path.glob("*.tmp"))
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["architectures"] == ["LlamaForSequenceClassification"]
    hf = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.num_labels == 1
    ids, mask = ragged_batch(config.vocab_size, seed=1)
    ours = rm.scores(ids, LENGTHS)
    assert_scores_close(ours, hf_scores(hf, ids, mask))
    again = load_reward_model(tmp_path)
    assert again.config == rm.config and torch.equal(again.scores(ids, LENGTHS), ours)
    # sharded: the index and every shard are read back
    rm.save_pretrained(tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(set(json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())["weight_map"].values())) > 2
    assert torch.equal(load_reward_model(tmp_path / "sharded").scores(ids, LENGTHS), ours)
    assert_scores_close(hf_scores(tmp_path / "sharded", ids, mask), ours)


def test_loads_a_sharded_transformers_checkpoint(tmp_path):
    hf, path = hf_reward_model(tmp_path, "mha_odd", max_shard_size="30KB")
    assert (path / INDEX_FILE).exists() and not (path / WEIGHTS_FILE).exists()
    ids, mask = ragged_batch(hf.config.vocab_size, seed=2)
    assert_scores_close(load_reward_model(path).scores(ids, LENGTHS), hf_scores(hf, ids, mask))


def test_bf16_load_is_close_to_fp32(tmp_path):
    hf, path = hf_reward_model(tmp_path)
    r32, r16 = load_reward_model(path), load_reward_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in r16.parameters())
    ids, _ = ragged_batch(hf.config.vocab_size)
    a, b = r32.scores(ids, LENGTHS), r16.scores(ids, LENGTHS)
    assert b.dtype == torch.float32 and not torch.equal(a, b)  # really computed in bf16
    diff = (a - b).abs().max().item()
    assert diff < 0.03 * a.abs().max().item() + 0.02, f"bf16 scores differ from fp32 by {diff:.3g}"


# ------------------------------------------------------------------------------------ refused checkpoints
class _HeadersOnly:
    """safetensors.safe_open whose tensors cannot be read: keys and header slices (shape, dtype) only."""

    def __init__(self, real):
        self._f = real

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self):
        return self._f.keys()

    def get_slice(self, key):
        sl = self._f.get_slice(key)
        return type("Header", (), {"get_shape": lambda _: sl.get_shape(), "get_dtype": lambda _: sl.get_dtype()})()

    def get_tensor(self, key):
        raise AssertionError(f"check_reward_model read tensor {key!r}")


@pytest.fixture
def headers_only(monkeypatch):
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _HeadersOnly(real(*a, **k)))
    return monkeypatch


def refused_by_both(path, match, monkeypatch):
    """check_reward_model (reading no tensor) and load_reward_model refuse ``path`` with the same message."""
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _HeadersOnly(real(*a, **k)))
    with pytest.raises(ValueError, match=match) as checked:
        check_reward_model(path)
    monkeypatch.setattr(safetensors, "safe_open", real)
    with pytest.raises(ValueError, match=match) as loaded:
        load_reward_model(path)
    assert str(checked.value) == str(loaded.value)


def edit_config(path, **changes):
    cfg = json.loads((path / CONFIG_FILE).read_text())
    cfg.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(cfg))


def edit_weights(path, drop=(), **tensors):
    sd = {k: t for k, t in load_file(path / WEIGHTS_FILE).items() if k not in drop}
    sd.update({k.replace("__", "."): t for k, t in tensors.items()})
    save_file(sd, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


def test_check_reward_model_reads_no_tensor(tmp_path, headers_only):
    _, path = hf_reward_model(tmp_path)
    config = check_reward_model(path)
    headers_only.undo()
    assert config == load_reward_model(path).config and config.vocab_size == CONFIGS["gqa_llama3_tied"]["vocab_size"]


def test_more_than_one_label_is_refused(tmp_path, monkeypatch):
    _, path = hf_reward_model(tmp_path, num_labels=2)  # transformers writes no id2label for its default, 2 labels
    refused_by_both(path, "num_labels=2 \\(no id2label in config.json: transformers' default\\); a scalar "
                          "reward model needs one label", monkeypatch)
    edit_config(path, id2label={"0": "bad", "1": "good", "2": "best"})
    refused_by_both(path, "num_labels=3 \\(id2label\\); a scalar reward model needs one label", monkeypatch)


def test_a_causal_lm_is_no_reward_model(tmp_path, monkeypatch):
    _, path = hf_reward_model(tmp_path, "mha_odd", causal=True)  # untied: it saves lm_head.weight
    refused_by_both(path, "is a causal LM: it has no score head", monkeypatch)
    # its config.json without architectures (and one label): the weights give it away
    edit_config(path, architectures=None, id2label={"0": "LABEL_0"})
    refused_by_both(path, "has 'lm_head.weight' and no 'score.weight': a causal LM has no score head", monkeypatch)


def test_missing_score_extra_head_wrong_shapes_and_dtypes_are_refused(tmp_path, monkeypatch):
    hf, path = hf_reward_model(tmp_path)
    d = hf.config.hidden_size
    edit_weights(path, drop=["score.weight"])
    refused_by_both(path, "no 'score.weight' \\(the reward head", monkeypatch)
    edit_weights(path, score__weight=torch.zeros(2, d))
    refused_by_both(path, f"'score.weight' has shape \\(2, {d}\\) but config.json implies \\(1, {d}\\)", monkeypatch)
    edit_weights(path, score__weight=torch.zeros(1, d), lm_head__weight=torch.zeros(hf.config.vocab_size, d))
    refused_by_both(path, "does not have, e.g. \\['lm_head.weight'\\]", monkeypatch)
    edit_weights(path, drop=["lm_head.weight"], score__weight=torch.zeros(1, d, dtype=torch.int32))
    refused_by_both(path, "'score.weight' has dtype I32; llamarl loads only", monkeypatch)
    edit_weights(path, score__weight=torch.zeros(1, d))
    check_reward_model(path)  # repaired: accepted again
    edit_config(path, intermediate_size=hf.config.intermediate_size + 1)
    refused_by_both(path, "mlp.(gate|up|down)_proj.weight' has shape .* but config.json implies", monkeypatch)
    edit_config(path, intermediate_size=hf.config.intermediate_size, num_hidden_layers=3)
    refused_by_both(path, "missing .*model.layers.2", monkeypatch)


def test_a_reward_model_given_as_the_policy_is_refused(tmp_path):
    _, path = hf_reward_model(tmp_path)
    for load in (Llama.from_pretrained, check_checkpoint):
        with pytest.raises(ValueError, match="is a reward model .* use it as reward.model, not as the policy"):
            load(path)
    with pytest.raises(ValueError, match="architecture must be"):
        LlamaConfig.from_hf_dict(json.loads((path / CONFIG_FILE).read_text()), architecture="LlamaForQA")


def test_bad_inputs_raise():
    config = LlamaConfig(**CONFIGS["mha_odd"])
    rm = LlamaRewardModel(config)
    ids = torch.randint(0, config.vocab_size, (2, 6))
    cases = [((ids, [6, 0]), "lengths must lie in 1..6.*row 1 has 0"),
             ((ids, [7, 6]), "lengths must lie in 1..6.*row 0 has 7"),
             ((ids, [6]), "lengths has 1 entries for a batch of 2 rows"),
             ((ids, torch.tensor([6.0, 2.0])), "lengths must be an integer tensor"),
             ((ids, [6, 2.0]), "lengths must be a list of ints"),
             ((ids[0], [6]), "input_ids must be an integer tensor \\[batch, seq\\]"),
             ((ids.float(), [6, 6]), "input_ids must be an integer tensor"),
             ((ids + config.vocab_size, [6, 6]), "token ids must lie in \\[0, 61\\)")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            rm.scores(*args)
    assert not hasattr(rm, "lm_head") and not hasattr(rm, "lm_head_weight")
    r = rm(ids, [6, 3])  # forward keeps autograd (scores does not)
    r.sum().backward()
    assert rm.score.weight.grad is not None and rm.score.weight.grad.abs().sum() > 0
