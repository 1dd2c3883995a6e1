"""reward.model: a learned reward model's score as a reward term (llamarl.rewards.model), checked against
transformers' LlamaForSequenceClassification on the exact sequences the run scored."""

import json
from pathlib import Path

import pytest
import torch

from llamarl.config_cli import load_config
from llamarl.models import CharTokenizer
from llamarl.rewards.model import RewardModelScorer, same_tokenizer
from llamarl.train import train
from test_train_inputs import assert_refused_before_start
from test_train_loop import SMOKE, read_metrics, read_samples

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


def hf_reward_model(path: Path, vocab_size: int, context: int = 128, seed: int = 0):
    """A random transformers LlamaForSequenceClassification with one label, saved to ``path``; its score head
    is drawn with std 1 so that the scores of different sequences differ visibly."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=context, num_labels=1, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


def hf_scores(model, sequences) -> list[float]:
    with torch.no_grad():
        return [model(torch.tensor([list(s)])).logits[0, 0].item() for s in sequences]


def test_scores_equal_transformers_in_input_order_at_any_batch_size(tmp_path):
    tok = CharTokenizer()
    ref = hf_reward_model(tmp_path / "rm", tok.vocab_size, context=24)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, tok.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 1, 9, 24, 12, 3)]
    expected = hf_scores(ref, seqs)
    for batch_size in (1, 3, 16):
        scorer = RewardModelScorer(tmp_path / "rm", policy_tokenizer=tok, batch_size=batch_size)
        got = scorer.score(seqs)
        assert got == pytest.approx(expected, abs=1e-5), (batch_size, got, expected)
    too_long = scorer.score([seqs[0], seqs[0] + [5] * 20, []])
    assert too_long[0] == pytest.approx(expected[0], abs=1e-5)
    assert "25 tokens, more than the reward model's context of 24" in too_long[1]
    assert "empty sequence" in too_long[2]
    # trailing pad ids (pad_token_id=0; e.g. pad == eos and a completion that ends in eos) are skipped, as
    # transformers does: the score is that of the sequence without them
    padded = scorer.score([seqs[1] + [0, 0], [0, 0]])
    assert padded[0] == pytest.approx(expected[1], abs=1e-5)
    assert padded == pytest.approx(hf_scores(ref, [seqs[1] + [0, 0], [0, 0]]), abs=1e-5)


def test_a_reward_model_with_another_tokenizer_reads_the_text_again(tmp_path):
    """The policy's ids are decoded (special tokens kept) and encoded with the reward model's tokenizer; with
    no tokenizer in its directory, or the policy's, it reads the policy's ids as they are."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from llamarl.models import load_tokenizer

    policy = CharTokenizer()
    words = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "1", "+", "2", "=", "3", "12"])}
    hf = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    ref = hf_reward_model(tmp_path / "rm", len(words))
    hf.save(str(tmp_path / "rm" / "tokenizer.json"))
    (tmp_path / "rm" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    scorer = RewardModelScorer(tmp_path / "rm", policy_tokenizer=policy)
    prompt, completion = policy.encode("1+2="), policy.encode("3")
    assert scorer.sequence(prompt, completion) == [3, 4, 5, 6, 7]
    assert scorer.score_pairs([(prompt, completion)]) == pytest.approx(hf_scores(ref, [[3, 4, 5, 6, 7]]), abs=1e-5)
    own = load_tokenizer(tmp_path / "rm")
    assert same_tokenizer(own, load_tokenizer(tmp_path / "rm")) and not same_tokenizer(own, policy)
    assert same_tokenizer(policy, CharTokenizer())


def test_a_reward_model_whose_vocabulary_is_too_small_for_the_policy_ids_is_refused(tmp_path):
    hf_reward_model(tmp_path / "rm", 10)  # no tokenizer of its own: it would read the char ids (up to ~100)
    with pytest.raises(ValueError, match=r"its embedding has 10 rows but the tokenizer it reads with has"):
        RewardModelScorer(tmp_path / "rm", policy_tokenizer=CharTokenizer())


def test_a_run_adds_the_weighted_model_score_of_each_sequence_to_its_reward(tmp_path, monkeypatch):
    """Every logged sample's reward is its verifier's plus 0.5 x the model term, and each model term is
    transformers' score of the exact ids the run handed the reward model (prompt ids + completion ids)."""
    tok = CharTokenizer()
    ref = hf_reward_model(tmp_path / "rm", tok.vocab_size)
    calls: list[list[tuple[list[int], float]]] = []  # each call's (ids, score) pairs
    original = RewardModelScorer.score_pairs

    def recording(self, pairs):
        scores = original(self, pairs)
        calls.append([(list(p) + list(c), s) for (p, c), s in zip(pairs, scores)])
        return scores

    monkeypatch.setattr(RewardModelScorer, "score_pairs", recording)
    out = tmp_path / "run"
    cfg = load_config(SMOKE + ["--out", str(out), "--max-steps", "2", "--set", f"reward.model={tmp_path / 'rm'}",
                               "--set", "reward.model_weight=0.5", "--set", "generator.samples_per_prompt=4",
                               "--set", "run.log_samples=16"])
    summary = train(cfg)
    assert summary["steps"] == 2
    # the two steps' rollouts (4 prompts x 4 samples each) and the evaluations before and after RL (8 held-out
    # problems each, greedy)
    assert sorted(len(c) for c in calls) == [8, 8, 16, 16]
    seen = [x for c in calls if len(c) == 16 for x in c]
    evals = [c for c in calls if len(c) == 8]
    every = [x for c in calls for x in c]
    expected = hf_scores(ref, [ids for ids, _ in every])
    assert [s for _, s in every] == pytest.approx(expected, abs=1e-5)
    got = [s for _, s in seen]
    assert len(set(round(s, 4) for s in got)) > 1  # the term varies with the sequence
    samples = read_samples(out)
    assert len(samples) == len(seen)
    by_score = {round(s, 5) for s in got}
    for r in samples:
        terms = r["reward_terms"]
        assert set(terms) == {"exact", "model"}
        assert round(terms["model"], 5) in by_score
        assert r["reward"] == pytest.approx(terms["exact"] + 0.5 * terms["model"], abs=1e-6)
    steps, eval_rows = read_metrics(out)
    for row in steps:
        rows = [r for r in samples if r["step"] == row["step"]]
        assert row["reward/model"] == pytest.approx(sum(r["reward_terms"]["model"] for r in rows) / len(rows),
                                                    abs=1e-5)
    # each evaluation logs the reward model's mean score of its completions, and the summary the first and last
    assert [r["model_score"] for r in eval_rows] == pytest.approx([sum(s for _, s in c) / 8 for c in evals],
                                                                  abs=1e-6)
    assert (summary["model_score_before"], summary["model_score_after"]) == (eval_rows[0]["model_score"],
                                                                              eval_rows[-1]["model_score"])


def test_bad_reward_model_settings_are_refused_before_anything_starts(tmp_path, capsys):
    from llamarl.models import LLAMA_CONFIGS, Llama

    causal = tmp_path / "causal"
    Llama(LLAMA_CONFIGS["tiny"]).save_pretrained(causal)
    cases = [
        (["--set", f"reward.model={tmp_path / 'none'}"], r"reward.model: no such directory"),
        (["--set", f"reward.model={causal}"], r"reward.model: .*score"),
        (["--set", "reward.model_weight=nan"], r"reward.model_weight: must be a finite number"),
        (["--set", "reward.model_batch_size=0"], r"reward.model_batch_size: must be > 0"),
    ]
    assert_refused_before_start(cases, tmp_path, capsys)


@pytest.mark.gpu
def test_the_scorer_on_cuda_in_bf16_matches_transformers_fp32(tmp_path):
    """The controller's reward model on the GPU (run.device=cuda, policy.dtype=bfloat16): the scores of a
    ragged set of sequences, batched, within bf16 rounding of transformers' fp32 scores on the CPU."""
    tok = CharTokenizer()
    ref = hf_reward_model(tmp_path / "rm", tok.vocab_size, context=64)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, tok.vocab_size, (n,), generator=g).tolist() for n in (7, 64, 1, 33, 20)]
    expected = hf_scores(ref, seqs)
    scorer = RewardModelScorer(tmp_path / "rm", policy_tokenizer=tok, dtype="bfloat16", device="cuda", batch_size=2)
    got = scorer.score(seqs)
    scale = max(abs(x) for x in expected)
    assert got == pytest.approx(expected, abs=0.03 * scale + 1e-3), (got, expected)
