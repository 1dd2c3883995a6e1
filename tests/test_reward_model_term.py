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


def record_scores(monkeypatch) -> list[list[tuple[list[int], float]]]:
    """Every ``RewardModelScorer.score`` call of the run, as a list of (ids scored, score) pairs."""
    calls: list[list[tuple[list[int], float]]] = []
    original = RewardModelScorer.score

    def recording(self, sequences):
        scores = original(self, sequences)
        calls.append([(list(ids), s) for ids, s in zip(sequences, scores)])
        return scores

    monkeypatch.setattr(RewardModelScorer, "score", recording)
    return calls


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


def _word_tokenizer(path: Path, words: list[str], chat_template: str | None = None) -> None:
    """A one-token-per-character tokenizers.Tokenizer over ``words`` (specials <unk> <s> </s> first), saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(path / "tokenizer.json"))
    config = {"eos_token": "</s>", "bos_token": "<s>", **({"chat_template": chat_template} if chat_template else {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


WORDS = ["1", "+", "2", "=", "3", "u", "a", ":", "|"]  # ids 3..11


def test_a_reward_model_with_another_tokenizer_reads_the_text_as_trl_presents_it(tmp_path):
    """Another tokenizer: the prompt and completion text without the policy's special tokens, as its tokenizer
    encodes a text, and its EOS where the completion ended in the policy's (TRL's RewardTrainer form); chat
    data in its own chat template (TRL's GRPOTrainer form).
    With no tokenizer in its directory, or the policy's, it reads the policy's ids as they are."""
    from llamarl.models import load_tokenizer

    policy = CharTokenizer()
    ref = hf_reward_model(tmp_path / "rm", 3 + len(WORDS))
    _word_tokenizer(tmp_path / "rm", WORDS, chat_template="{{ bos_token }}{% for m in messages %}"
                    "{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}")
    scorer = RewardModelScorer(tmp_path / "rm", policy_tokenizer=policy)
    prompt = [policy.bos_id, *policy.encode("1+2=")]
    # 1 + 2 = 3: its tokenizer adds nothing before a text (no post-processor), so no BOS
    assert scorer.sequence(prompt, policy.encode("3")) == [3, 4, 5, 6, 7]
    ended = [*policy.encode("3"), policy.eos_id]
    assert scorer.sequence(prompt, ended) == [3, 4, 5, 6, 7, 2]  # ... </s>
    assert scorer.score_pairs([(prompt, ended, None)]) == pytest.approx(hf_scores(ref, [[3, 4, 5, 6, 7, 2]]),
                                                                        abs=1e-5)
    chat = RewardModelScorer(tmp_path / "rm", policy_tokenizer=policy, chat=True)
    assert chat.wants_messages and not scorer.wants_messages
    messages = [{"role": "user", "content": "1+2="}]
    # <s> u : 1 + 2 = | a : 3 |   (the completion as the assistant's turn; the policy's EOS is not spelled out)
    assert chat.sequence(prompt, ended, messages) == [1, 8, 10, 3, 4, 5, 6, 11, 9, 10, 7, 11]
    own = load_tokenizer(tmp_path / "rm")
    assert same_tokenizer(own, load_tokenizer(tmp_path / "rm")) and not same_tokenizer(own, policy)
    assert same_tokenizer(policy, CharTokenizer())
    plain = RewardModelScorer(tmp_path / "rm", policy_tokenizer=own)  # the policy's tokenizer: its ids as they are
    assert plain.tokenizer is None and plain.sequence([1, 3], [4, 2]) == [1, 3, 4, 2]


def test_what_the_reward_model_cannot_read_costs_one_sample_or_is_refused_up_front(tmp_path):
    """An id beyond its embedding (a policy embedding padded past its tokenizer) costs that sample; a tokenizer
    larger than its embedding, or chat data for a tokenizer without a chat template, is refused by check_reader
    (which llamarl.train runs before anything starts)."""
    from llamarl.rewards.model import check_reader

    tok = CharTokenizer()
    ref = hf_reward_model(tmp_path / "rm", tok.vocab_size)
    scorer = RewardModelScorer(tmp_path / "rm", policy_tokenizer=tok)
    got = scorer.score([[5, 6], [5, tok.vocab_size + 3], [7]])
    assert got[0] == pytest.approx(hf_scores(ref, [[5, 6]])[0], abs=1e-5)
    assert f"token id {tok.vocab_size + 3} lies outside its vocabulary [0, {tok.vocab_size})" in got[1]
    assert got[2] == pytest.approx(hf_scores(ref, [[7]])[0], abs=1e-5)
    hf_reward_model(tmp_path / "small", 10)  # no tokenizer of its own: it would read the char ids (up to ~100)
    with pytest.raises(ValueError, match=r"its embedding has 10 rows but the tokenizer it reads with \(the "
                                         r"policy's: the directory has none of its own\) has"):
        check_reader(tmp_path / "small", tok)
    with pytest.raises(ValueError, match=r"its embedding has 10 rows"):
        RewardModelScorer(tmp_path / "small", policy_tokenizer=tok)
    hf_reward_model(tmp_path / "nochat", 3 + len(WORDS))
    _word_tokenizer(tmp_path / "nochat", WORDS)
    check_reader(tmp_path / "nochat", tok)
    with pytest.raises(ValueError, match=r"data.chat.*chat template cannot render a conversation"):
        check_reader(tmp_path / "nochat", tok, chat=True)


@pytest.mark.parametrize("reads", ["policy_ids", "own_chat_template"])
def test_a_run_adds_the_weighted_model_score_of_each_sequence_to_its_reward(tmp_path, monkeypatch, reads):
    """Every logged sample's reward is its verifier's plus 0.5 x the model term, and each model term is
    transformers' score of the exact ids the run handed the reward model: the policy's prompt + completion
    ids, or (chat data, a reward model with its own tokenizer) the conversation in its chat template."""
    tok = CharTokenizer()
    chars = list("0123456789+-*=ua:|")
    ref = hf_reward_model(tmp_path / "rm", tok.vocab_size if reads == "policy_ids" else 3 + len(chars))
    if reads == "own_chat_template":
        _word_tokenizer(tmp_path / "rm", chars, chat_template="{{ bos_token }}{% for m in messages %}"
                        "{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}")
    calls = record_scores(monkeypatch)
    out = tmp_path / "run"
    cfg = load_config(SMOKE + ["--out", str(out), "--max-steps", "2", "--set", f"reward.model={tmp_path / 'rm'}",
                               "--set", "reward.model_weight=0.5", "--set", "generator.samples_per_prompt=4",
                               "--set", "run.log_samples=16", "--set", f"data.chat={reads != 'policy_ids'}"])
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
    if reads == "own_chat_template":  # <s> u : <the prompt> | a : <the completion> |
        assert all(ids[:3] == [1, 3 + chars.index("u"), 3 + chars.index(":")] for ids, _ in every)
        assert all(ids[-1] == 3 + chars.index("|") for ids, _ in every)
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
    small = tmp_path / "small"  # no tokenizer: it would read the char ids, beyond its 10 rows
    hf_reward_model(small, 10)
    slow = tmp_path / "slow"  # a tokenizer_config.json of a slow tokenizer, no tokenizer.json
    hf_reward_model(slow, CharTokenizer().vocab_size)
    (slow / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    hf_reward_model(tmp_path / "short", CharTokenizer().vocab_size, context=4)  # no prompt + completion fits
    cases = [
        (["--set", f"reward.model={tmp_path / 'short'}"], r"reward.model: its context of 4 tokens holds no prompt"),
        (["--set", f"reward.model={small}"], r"reward.model: its embedding has 10 rows but the tokenizer it reads"),
        (["--set", f"reward.model={slow}"], r"reward.model: its tokenizer cannot be read: .*tokenizer.json"),
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


def test_a_run_scored_by_the_reward_model_alone_on_prompts_without_answers(tmp_path, monkeypatch):
    """reward.reward=none: RLHF on a prompt-only file with a Hugging Face policy; every reward is
    model_weight x the reward model's score, evaluations report its mean score instead of an accuracy."""
    from llamarl.models import LLAMA_CONFIGS, Llama

    tok = CharTokenizer()
    policy = tmp_path / "policy"
    torch.manual_seed(0)
    Llama(LLAMA_CONFIGS["tiny"]).save_pretrained(policy)
    tok.save(policy)
    data = tmp_path / "prompts.jsonl"  # no answer field at all
    data.write_text("".join(json.dumps({"question": f"{a}+{b}="}) + "\n" for a in range(10) for b in range(8)))
    ref = hf_reward_model(tmp_path / "rm", tok.vocab_size)
    calls = record_scores(monkeypatch)
    out = tmp_path / "run"
    cfg = load_config(SMOKE + ["--out", str(out), "--max-steps", "2", "--model", str(policy), "--dataset", str(data),
                               "--set", "reward.reward=none", "--set", f"reward.model={tmp_path / 'rm'}",
                               "--set", "reward.model_weight=0.5", "--set", "run.log_samples=16",
                               "--set", "generator.samples_per_prompt=4", "--set", "run.eval_samples=3",
                               "--set", "run.eval_temperature=1.0"])
    summary = train(cfg)
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None
    assert not [k for k in summary if k.startswith("pass@")]  # (no verifier: no pass@k either)
    steps, eval_rows = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2] and all("accuracy" not in e for e in eval_rows)
    # 8 held-out prompts x 3 samples before and after; 2 steps of 4 prompts x 4 samples
    assert sorted(len(c) for c in calls) == [16, 16, 24, 24]
    evals = [c for c in calls if len(c) == 24]
    assert [e["model_score"] for e in eval_rows] == pytest.approx([sum(s for _, s in c) / 24 for c in evals],
                                                                  abs=1e-6)
    assert summary["model_score_after"] == eval_rows[-1]["model_score"]
    every = [x for c in calls for x in c]
    assert [s for _, s in every] == pytest.approx(hf_scores(ref, [ids for ids, _ in every]), abs=1e-5)
    trained = {round(s, 6) for c in calls if len(c) == 16 for _, s in c}
    samples = read_samples(out)
    assert len(samples) == 32
    for r in samples:
        assert r["answer"] == "" and r["reward_error"] is None
        assert round(r["reward"] / 0.5, 6) in trained  # the reward is 0.5 x a score the reward model gave


def test_reward_reward_none_settings_that_cannot_work_are_refused(tmp_path, capsys):
    from llamarl.config import ConfigError

    hf_reward_model(tmp_path / "rm", CharTokenizer().vocab_size)
    rm = ["--set", f"reward.model={tmp_path / 'rm'}"]
    with pytest.raises(ConfigError, match=r"reward.reward: must be one of .*none \(reward.model alone\)"):
        load_config(SMOKE + ["--set", "reward.reward=nonee"])
    for extra, message in [([], r"reward.reward: none \(no verifier\) needs a reward model"),
                           (rm + ["--set", "reward.extra=[format_exact]"], r"reward.extra: needs a verifier"),
                           (rm + ["--set", "reward.weights=[1.0]"], r"reward.weights: weigh reward functions"),
                           (rm + ["--set", "data.few_shot=2"], r"data.few_shot: shows solved examples")]:
        with pytest.raises(ConfigError, match=message):
            load_config(SMOKE + ["--set", "reward.reward=none", *extra])
    assert_refused_before_start([(["--set", "reward.reward=none", *rm],
                                  r"reward.reward: none \(no verifier\) needs policy.model=DIR")], tmp_path, capsys)


def test_a_chat_template_that_refuses_a_conversation_costs_that_sample_and_is_probed_up_front(tmp_path):
    """A reward model whose template refuses system messages (as Gemma's and Mistral's do): check_reader, given
    a prompt's real messages, refuses the run up front; a pair it cannot render anyway costs that sample."""
    from llamarl.rewards.model import check_reader

    policy = CharTokenizer()
    hf_reward_model(tmp_path / "rm", 3 + len(WORDS))
    _word_tokenizer(tmp_path / "rm", WORDS, chat_template=(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}|{% endfor %}"))
    system = [{"role": "system", "content": "1"}, {"role": "user", "content": "1+2="}]
    check_reader(tmp_path / "rm", policy, chat=True)  # (a lone user turn renders)
    with pytest.raises(ValueError, match="System role not supported"):
        check_reader(tmp_path / "rm", policy, chat=True, messages=system)
    scorer = RewardModelScorer(tmp_path / "rm", policy_tokenizer=policy, chat=True)
    got = scorer.score_pairs([(policy.encode("1+2="), policy.encode("3"), system),
                              (policy.encode("1+2="), policy.encode("3"), system[1:])])
    assert "its chat template cannot render this conversation: chat template error: System role not" in got[0]
    assert isinstance(got[1], float)
