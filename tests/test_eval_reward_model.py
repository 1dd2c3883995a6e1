"""`python -m llamarl.eval --reward-model`: every completion scored by a reward model, beside the verifier or
alone (--reward none), against transformers' LlamaForSequenceClassification scores of the exact sequences.
``checkpoint``: tests/conftest.py's tiny transformers-saved policy."""

from __future__ import annotations

import json
import shutil

import pytest

from llamarl.eval import main
from llamarl.models import CharTokenizer

pytest.importorskip("transformers")


def test_cli_reward_model_scores_every_completion_with_or_without_a_verifier(checkpoint, tmp_path, capsys,
                                                                            monkeypatch):
    """--reward-model: each record's model_score is transformers' score of the exact sequence scored (the
    prompt's ids, then the completion's), the summary's is their mean; --reward none scores with it alone on
    a file without answers: no accuracy, pass@k or mean_reward."""
    from test_reward_model_term import hf_reward_model, hf_scores, record_scores

    _, path = checkpoint
    tok = CharTokenizer()
    rm = hf_reward_model(tmp_path / "rm", tok.vocab_size)
    calls = record_scores(monkeypatch)
    prompts = ["12+30=", "7*8=", "99-1="]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": "1"}) + "\n" for p in prompts))
    base = ["--model", str(path), "--reward-model", str(tmp_path / "rm"), "--max-new-tokens", "6", "-n", "2",
            "--temperature", "1.0", "--reward-workers", "1", "--no-progress"]
    assert main(base + ["--dataset", str(data), "--reward", "exact", "--output", str(tmp_path / "a.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    (scored,) = calls
    assert [s for _, s in scored] == pytest.approx(hf_scores(rm, [ids for ids, _ in scored]), abs=1e-5)
    assert [r["model_score"] for r in records] == [s for _, s in scored]
    for r, (ids, _) in zip(records, scored):
        prompt = [tok.bos_id, *tok.encode(r["prompt"])]
        assert ids[:len(prompt)] == prompt and len(ids) == len(prompt) + r["num_tokens"]
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert summary["model_score"] == pytest.approx(sum(r["model_score"] for r in records) / 6)
    assert summary["accuracy"] is not None and summary["reward_model"] == str(tmp_path / "rm")
    capsys.readouterr()

    prompt_only = tmp_path / "p.jsonl"
    prompt_only.write_text("".join(json.dumps({"question": p}) + "\n" for p in prompts))
    assert main(base + ["--dataset", str(prompt_only), "--reward", "none", "--output", str(tmp_path / "b.jsonl")]) == 0
    summary = json.loads((tmp_path / "b.summary.json").read_text())
    assert (summary["accuracy"], summary["mean_reward"], summary["pass_at_k"]) == (None, None, {})
    records = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert summary["model_score"] == pytest.approx(sum(r["model_score"] for r in records) / 6)
    assert all(r["reward"] is None and r["correct"] is None for r in records)  # nothing was verified
    out = capsys.readouterr().out
    assert "model_score=" in out and "accuracy" not in out
    for extra, message in [(["--reward", "none"], "--reward none scores with the reward model alone: pass "
                                                  "--reward-model DIR"),
                           (["--reward", "exact", "--reward-model", str(tmp_path / "no")],
                            f"--reward-model {tmp_path / 'no'}: no such directory")]:
        args = ["--model", str(path), "--dataset", str(data), "--no-progress", *extra]
        assert main(args) == 2 and message in capsys.readouterr().err


def test_cli_reports_what_the_reward_model_could_not_score(checkpoint, tmp_path, capsys, monkeypatch):
    """A reward model whose context (10 tokens) holds some sequences only: the line counts model_errors and
    the mean is over the others; with --reward none and nothing scored the evaluation fails (exit 1). The
    scorer stops at the policy's end-of-text ids as training does (llamarl.eval.eos_ids)."""
    from llamarl.rewards.model import RewardModelScorer
    from test_reward_model_term import hf_reward_model

    _, path = checkpoint
    hf_reward_model(tmp_path / "rm", CharTokenizer.vocab_size, context=10)
    built = []
    init = RewardModelScorer.__init__
    monkeypatch.setattr(RewardModelScorer, "__init__", lambda self, *a, **k: (built.append(k), init(self, *a, **k))[1])
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": "1"}) + "\n" for p in ["1=", "12+30=", "123+456="]))
    base = ["--model", str(path), "--reward-model", str(tmp_path / "rm"), "--dataset", str(data), "--no-progress",
            "--max-new-tokens", "4", "--stop", "never", "--output", str(tmp_path / "o.jsonl")]
    assert main(base + ["--reward", "exact"]) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    failed = [r for r in records if r["model_error"] is not None]
    assert failed and len(failed) < 3 and f"model_errors={len(failed)}" in out
    assert all("more than the reward model's context of 10" in r["model_error"] for r in failed)
    # a policy whose config.json lists another end-of-text id, and which has no generation_config.json
    policy = tmp_path / "policy"
    shutil.copytree(path, policy)
    (policy / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 50]}))
    assert main(["--model", str(policy)] + base[2:] + ["--reward", "exact"]) == 0
    assert 50 in built[-1]["eos_ids"]
    capsys.readouterr()
    long_only = tmp_path / "long.jsonl"
    long_only.write_text(json.dumps({"question": "123456789+1="}) + "\n")
    assert main(base[:5] + [str(long_only)] + base[6:] + ["--reward", "none"]) == 1
    captured = capsys.readouterr()
    assert "model_score=n/a" in captured.out and "model_errors=1" in captured.out
    assert "the reward model could score no completion" in captured.err
