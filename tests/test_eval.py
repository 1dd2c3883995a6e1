"""Evaluation: the unbiased pass@k estimator against brute-force enumeration, evaluate()'s bookkeeping on
hand-computed cases, and `python -m llamarl.eval` end to end on a tiny checkpoint whose greedy
completions are checked against transformers' generate."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llamarl.data import PromptFormat, Sample
from llamarl.eval import evaluate, main, parse_synthetic_spec, pass_at_k
from llamarl.generation import GenerationOutput
from llamarl.models import CharTokenizer
from llamarl.rewards import RewardPool

transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ pass@k
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_equals_subset_enumeration(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_large_n_and_errors():
    assert pass_at_k(200, 3, 100) == pytest.approx(1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-9)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct"):
        pass_at_k(4, 5, 1)


# ------------------------------------------------------------------------------------ evaluate()
class ScriptedEngine:
    """Stands in for GenerationEngine: returns fixed completions per prompt text, records batch sizes."""

    def __init__(self, tok, script: dict[str, list[str]], max_batch_size: int = 64):
        self.tok, self.script, self.max_batch_size = tok, script, max_batch_size
        self.batches: list[int] = []

    def generate(self, prompts, params, *, eos_token_id=None, decode=None):
        self.batches.append(len(prompts))
        outs = []
        for b, ids in enumerate(prompts):
            completions = self.script[self.tok.decode(ids)]
            assert len(completions) == params.n
            for j, text in enumerate(completions):
                toks = self.tok.encode(text) + [eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0]]
                outs.append(GenerationOutput(b, j, list(ids), toks, [0.0] * len(toks), [0] * len(toks), "stop"))
        return outs


def _scripted_case():
    tok = CharTokenizer()
    samples = [Sample(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    # prompt i gets exactly i correct completions out of n = 4
    script = {s.prompt: [s.answer + "\n"] * i + ["x\n"] * (4 - i) for i, s in enumerate(samples)}
    return tok, samples, ScriptedEngine(tok, script)


def test_evaluate_metrics_on_a_scripted_engine():
    tok, samples, engine = _scripted_case()
    res = evaluate(None, tok, samples, "exact", n=4, k=(1, 2, 4), batch_size=3, engine=engine,
                   fmt=PromptFormat(add_bos=False))
    assert engine.batches == [3, 1]
    # c = 0, 1, 2, 3 correct of 4: accuracy 6/16; pass@2 = mean(0, 1-3/6, 1-1/6, 1) by hand
    assert res.accuracy == pytest.approx(6 / 16)
    assert res.pass_at_k[1] == pytest.approx(6 / 16)
    assert res.pass_at_k[2] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert res.pass_at_k[4] == pytest.approx(3 / 4)
    assert res.mean_reward == pytest.approx(6 / 16) and res.num_errors == 0
    assert [(r.sample_id, r.completion_index) for r in res.records[:5]] == [
        ("p0", 0), ("p0", 1), ("p0", 2), ("p0", 3), ("p1", 0)]  # prompt-major
    assert res.records[4].completion == "2\n" and res.records[4].correct and res.records[4].num_tokens == 3


def test_evaluate_keeps_each_records_own_prompt_and_seeds_each_batch_afresh():
    """With an over-long first sample dropped, every record still shows its own sample's prompt; sampled
    evaluation in several batches draws each batch with its own seed."""
    class Context:
        max_position_embeddings = 12

    tok = CharTokenizer()
    samples = [Sample("long", "1+1+1+1+1+1+1=", "7"), Sample("a", "1+1=", "2"), Sample("b", "2+2=", "4")]
    engine = ScriptedEngine(tok, {s.prompt: [s.answer] for s in samples})
    engine.config = Context()
    res = evaluate(None, tok, samples, "exact", n=1, batch_size=4, engine=engine, fmt=PromptFormat(add_bos=False),
                   drop_long=True)
    prompts = {s.id: s.prompt for s in samples}
    assert [r.sample_id for r in res.records] == ["a", "b"]
    assert all(r.prompt == prompts[r.sample_id] for r in res.records)
    samples = [Sample(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    engine, seeds = ScriptedEngine(tok, {s.prompt: [s.answer] * 2 for s in samples}), []
    generate = engine.generate
    engine.generate = lambda prompts, params, **kw: (seeds.append(params.seed), generate(prompts, params, **kw))[1]
    evaluate(None, tok, samples, "exact", n=2, k=(1,), temperature=1.0, seed=3, batch_size=2, engine=engine,
             fmt=PromptFormat(add_bos=False))
    assert len(seeds) == 2 and len(set(seeds)) == 2, seeds


def test_evaluate_with_a_reward_pool_and_a_raising_function():
    tok, samples, engine = _scripted_case()
    with RewardPool("exact", num_workers=1) as pool:
        pooled = evaluate(None, tok, samples, pool, n=4, k=(1, 4), engine=engine, fmt=PromptFormat(add_bos=False))
    assert pooled.accuracy == pytest.approx(6 / 16) and pooled.pass_at_k[4] == pytest.approx(3 / 4)

    def flaky(completion, answer):
        if answer == "4":
            raise KeyError("no luck")
        return float(completion.strip() == answer)

    res = evaluate(None, tok, samples, flaky, n=4, k=(1,), engine=engine, fmt=PromptFormat(add_bos=False))
    assert res.num_errors == 4 and res.accuracy == pytest.approx((1 + 3) / 16)  # p2's two right answers lost
    assert all("'p2'" in r.error and "KeyError" in r.error for r in res.records if r.sample_id == "p2")

    # in process, a reward the worker pool would refuse is refused too: a string, or beyond float32's range
    for bad, message in (("1.0", "expected a number"), (1e39, "beyond float32")):
        res = evaluate(None, tok, samples, lambda c, a, bad=bad: bad, n=4, k=(1,), engine=engine,
                       fmt=PromptFormat(add_bos=False))
        assert res.num_errors == 4 * len(samples) and res.accuracy == 0.0
        assert all(message in r.error for r in res.records)


def test_evaluate_rejects_bad_arguments():
    tok, samples, engine = _scripted_case()
    with pytest.raises(ValueError, match="1 <= k <= n=2"):
        evaluate(None, tok, samples, "exact", n=2, k=(1, 4), engine=engine)
    with pytest.raises(ValueError, match="at least one sample"):
        evaluate(None, tok, [], "exact", engine=engine)
    with pytest.raises(ValueError, match="the engine holds 4 rows"):
        evaluate(None, tok, samples, "exact", n=4, batch_size=2, engine=ScriptedEngine(tok, {}, max_batch_size=4))


def test_parse_synthetic_spec():
    task, n = parse_synthetic_spec("synthetic:arithmetic")
    assert (task.digits, task.n_terms, task.ops, n) == (3, 2, ("+",), 200)
    task, n = parse_synthetic_spec("synthetic:arithmetic:digits=2,n_terms=3,ops=+-,seed=4,n=7")
    assert (task.digits, task.n_terms, task.ops, task.seed, n) == (2, 3, ("+", "-"), 4, 7)
    with pytest.raises(ValueError, match="unknown option"):
        parse_synthetic_spec("synthetic:arithmetic:digitz=2")


# ------------------------------------------------------------------------------------ CLI end to end
# (``checkpoint``: tests/conftest.py, a tiny transformers-saved Llama over the CharTokenizer vocabulary)
def _hf_greedy(hf, tok, prompt: str, max_new: int) -> str:
    ids = torch.tensor([[tok.bos_id] + tok.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=tok.eos_id, pad_token_id=0)
    return tok.decode(out[0, ids.shape[1]:].tolist())


def test_cli_greedy_matches_transformers_and_scores_with_a_user_reward(checkpoint, tmp_path, capsys):
    hf, path = checkpoint
    tok = CharTokenizer()
    prompts = ["12+30=", "7*8=", "99-1=", "What is 2+2?", "abc", "x^2="]
    reference = [_hf_greedy(hf, tok, p, 8) for p in prompts]
    answers = reference[:4] + ["WRONG", "WRONG"]  # four prompts are "right" by construction
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": a}) + "\n" for p, a in zip(prompts, answers)))
    (tmp_path / "match.py").write_text(textwrap.dedent(
        """
        def reward(completion, answer):
            return float(completion.strip() == answer.strip())
        """))
    out = tmp_path / "res.jsonl"
    rc = main(["--model", str(path), "--dataset", str(data), "--reward", f"{tmp_path / 'match.py'}:reward",
               "--max-new-tokens", "8", "--batch-size", "4", "--reward-workers", "1", "--output", str(out),
               "--no-progress"])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["completion"] for r in records] == reference  # the engine's greedy text == transformers'
    assert [r["reward"] for r in records] == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    summary = json.loads((tmp_path / "res.summary.json").read_text())
    assert summary["accuracy"] == pytest.approx(4 / 6) and summary["pass_at_k"] == {"pass@1": pytest.approx(4 / 6)}
    assert "accuracy=0.6667" in capsys.readouterr().out


def test_a_template_with_a_literal_backslash_n_is_warned_about(checkpoint, tmp_path, capsys):
    """--stop reads escapes but --template cannot (LaTeX's \\boxed, \\frac): a typed '\\n' stays two characters,
    so the model may be evaluated on a prompt format it never saw; say so."""
    _, path = checkpoint
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    args = ["--model", str(path), "--dataset", str(data), "--reward", "exact", "--max-new-tokens", "2",
            "--reward-workers", "1", "--output", str(tmp_path / "r.jsonl"), "--no-progress"]
    assert main(args + ["--template", "Q: {prompt}\\nA: "]) == 0
    assert "--template 'Q: {prompt}\\\\nA: ' holds a backslash followed by n" in capsys.readouterr().err
    assert main(args + ["--template", "Q: {prompt}\nA: \\boxed{}"]) == 0
    assert "backslash" not in capsys.readouterr().err


def test_cli_stop_strings_of_several_tokens_cut_the_transformers_greedy_text(checkpoint, tmp_path):
    """--stop takes strings of any length (escapes read): each completion is transformers' greedy text up to
    the first token whose text holds a stop, and is scored as such."""
    hf, path = checkpoint
    tok = CharTokenizer()
    prompts = ["12+30=", "7*8=", "99-1=", "abc"]
    reference = [_hf_greedy(hf, tok, p, 12) for p in prompts]
    def window(text: str, n: int, start: int) -> str:  # n characters from start on, none of them U+FFFD (unk)
        return next(text[i:i + n] for i in range(start, len(text)) if "\ufffd" not in text[i:i + n])

    stops = [window(reference[0], 3, 2), window(reference[1], 2, 4) + "\n"]  # a newline, once escaped
    flags = ["--stop", stops[0], "--stop", stops[1].replace("\n", "\\n")]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": "0"}) + "\n" for p in prompts))
    out = tmp_path / "res.jsonl"
    rc = main(["--model", str(path), "--dataset", str(data), "--reward", "exact", "--max-new-tokens", "12",
               "--reward-workers", "1", "--output", str(out), "--no-progress", *flags])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for r, ref in zip(records, reference):
        ends = [k for k in range(1, len(ref) + 1) if any(s in ref[:k] for s in stops)]
        assert r["completion"] == (ref[: ends[0]] if ends else ref)
    assert records[0]["completion"].endswith(stops[0]) and records[0]["finish_reason"] == "stop"


def test_cli_few_shot_file_with_the_same_ids_drops_only_the_repeated_problem(checkpoint, tmp_path):
    """Two files of the same stem give the same default ids (gsm8k-0, ...): examples from one do not
    collide with the other's samples by id; the one test problem that is also an example is dropped."""
    _, path = checkpoint
    (tmp_path / "train").mkdir()
    (tmp_path / "test").mkdir()
    shots = [("1+2=", "3"), ("4+4=", "8")]
    tests = [("4+4=", "8"), ("5+5=", "10"), ("6+1=", "7")]
    for folder, rows in (("train", shots), ("test", tests)):
        (tmp_path / folder / "gsm8k.jsonl").write_text(
            "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    out = tmp_path / "res.jsonl"
    rc = main(["--model", str(path), "--dataset", str(tmp_path / "test" / "gsm8k.jsonl"), "--reward", "exact",
               "--few-shot", "2", "--few-shot-file", str(tmp_path / "train" / "gsm8k.jsonl"), "--max-new-tokens",
               "2", "--reward-workers", "1", "--output", str(out), "--no-progress"])
    assert rc == 0
    assert [json.loads(line)["sample_id"] for line in out.read_text().splitlines()] == ["gsm8k-1", "gsm8k-2"]


def test_cli_sampling_pass_at_k_is_consistent_with_its_records(checkpoint, tmp_path):
    _, path = checkpoint
    out = tmp_path / "s.jsonl"
    rc = main(["--model", str(path), "--dataset", "synthetic:arithmetic:digits=1,n=5", "-n", "4", "-k", "1,2,4",
               "--temperature", "1.0", "--reward-workers", "1", "--output", str(out), "--no-progress", "--seed", "3"])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 20 and [r["completion_index"] for r in records[:4]] == [0, 1, 2, 3]
    summary = json.loads((tmp_path / "s.summary.json").read_text())
    correct = {}
    for r in records:
        assert r["correct"] == (r["reward"] == 1.0)
        assert r["reward"] == float(r["completion"].split("\n")[0].strip() == r["answer"])  # "exact", by hand
        correct[r["sample_id"]] = correct.get(r["sample_id"], 0) + r["correct"]
    for k in (1, 2, 4):
        expected = sum(1 - math.comb(4 - c, k) / math.comb(4, k) for c in correct.values()) / len(correct)
        assert summary["pass_at_k"][f"pass@{k}"] == pytest.approx(expected)


def test_cli_errors_are_one_line_messages(tmp_path, capsys):
    rc = main(["--model", str(tmp_path), "--dataset", str(tmp_path / "missing.jsonl"), "--reward", "gsm8k"])
    assert rc == 2 and "missing.jsonl" in capsys.readouterr().err
    (tmp_path / "d.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    rc = main(["--model", str(tmp_path), "--dataset", str(tmp_path / "d.jsonl")])
    assert rc == 2 and "--reward is required" in capsys.readouterr().err
    rc = main(["--model", str(tmp_path), "--dataset", str(tmp_path / "d.jsonl"), "--reward", "nope_mod:fn"])
    assert rc == 2 and "nope_mod" in capsys.readouterr().err


def test_cli_checks_the_reward_against_the_dataset_as_training_does(checkpoint, tmp_path, capsys):
    """A user reward asking for a field not every record has is refused before the model loads (training
    refused it; eval scored every sample as an error and exited 0); gsm8k references that are not one number
    are warned about."""
    _, path = checkpoint
    (tmp_path / "needs_level.py").write_text("def score(completion, answer, level):\n    return 1.0\n")
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "x = 4 or 5"}\n')
    base = ["--model", str(path), "--dataset", str(data), "--reward-workers", "1", "--no-progress",
            "--output", str(tmp_path / "o.jsonl")]
    assert main(base + ["--reward", f"{tmp_path / 'needs_level.py'}:score"]) == 2
    assert "needs the keyword argument(s) ['level'], which not every sample has" in capsys.readouterr().err
    assert main(base + ["--reward", "gsm8k", "--max-new-tokens", "2"]) == 0
    assert "1 of 2 answers are not one number" in capsys.readouterr().err
    assert main(base + ["--reward", "code"]) == 2  # no sample has tests: every reward would fail
    assert "--reward code, but 2 of 2 samples have no tests the code verifier can read" in capsys.readouterr().err


def test_cli_checks_lengths_counts_and_output_up_front(checkpoint, tmp_path, capsys):
    """An over-long prompt is named by its sample id before anything is generated; 0 for --limit or
    --max-new-tokens is an error, not the default; an --output that is a directory or cannot be written is
    refused first."""
    _, path = checkpoint  # max_position_embeddings = 64
    data = tmp_path / "d.jsonl"
    rows = [{"question": "1+1=", "answer": "2"}] * 3 + [{"question": "9" * 80, "answer": "1"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--model", str(path), "--reward", "exact", "--reward-workers", "1", "--no-progress",
            "--output", str(tmp_path / "o.jsonl")]
    assert main(base + ["--dataset", str(data)]) == 2
    err = capsys.readouterr().err
    assert "1 of 4 prompts leave no room to generate" in err and "sample 'd-3': 81 tokens" in err
    for flag in ("--limit", "--max-new-tokens"):
        assert main(base + ["--dataset", "synthetic:arithmetic:n=3", flag, "0"]) == 2
        assert f"{flag} must be >= 1" in capsys.readouterr().err
    assert main(base[:-1] + [str(tmp_path), "--dataset", "synthetic:arithmetic:n=3"]) == 2
    assert "is a directory" in capsys.readouterr().err
    # a folder that cannot be made (its parent is a file): refused before the evaluation, not after it
    assert main(base[:-1] + [str(data / "o.jsonl"), "--dataset", "synthetic:arithmetic:n=3"]) == 2
    assert f"--output {data / 'o.jsonl'}: cannot write into {data}" in capsys.readouterr().err
    synthetic = ["--dataset", "synthetic:arithmetic:n=3"]
    for extra, message in [(["--correct-threshold", "nan"], "--correct-threshold must be a finite number"),
                           (["--device", "meta"], "--device meta: llamarl.eval runs on cpu or cuda"),
                           (["--device", "gpu0"], "--device 'gpu0' is not a torch device")]:
        assert main(base + synthetic + extra) == 2
        assert message in capsys.readouterr().err
    assert main(base + ["--dataset", "synthetic:arith"]) == 2
    assert "--dataset synthetic:arith: unknown synthetic dataset" in capsys.readouterr().err
    for extra, message in [(["-k", "1,"], "-k '1,': must be comma-separated integers"),
                           (["-n", "0"], "-n must be >= 1 (completions per prompt), got 0"),
                           (["--few-shot", "1", "--few-shot-file", str(tmp_path / "no.jsonl")], "no.jsonl")]:
        assert main(base + synthetic + extra) == 2  # (the few-shot file is read for the synthetic task too)
        assert message in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nope")] + base[2:] + synthetic) == 2
    assert f"--model {tmp_path / 'nope'} does not exist" in capsys.readouterr().err


def test_cli_checks_the_sampling_options_before_the_model_is_loaded(checkpoint, tmp_path, capsys, monkeypatch):
    """k > n, a zero batch size and invalid sampling parameters are refused by their flags' names before the
    weights are read (a large model takes minutes to load), not by evaluate() after it."""
    from llamarl.models import Llama

    _, path = checkpoint

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(Llama, "from_pretrained", no_load)
    base = ["--model", str(path), "--dataset", "synthetic:arithmetic:n=3", "--reward-workers", "1", "--no-progress",
            "--output", str(tmp_path / "o.jsonl")]
    for extra, message in [(["-n", "2", "-k", "1,4"], "-k 1,4: every k must satisfy 1 <= k <= n=2"),
                           (["-k", "0"], "-k 0: every k must satisfy 1 <= k <= n=1"),
                           (["--batch-size", "0"], "--batch-size must be >= 1"),
                           (["--top-p", "0"], "--top-p must be in (0, 1]"),
                           (["--top-k", "-1"], "--top-k must be an int >= 0"),
                           (["--temperature", "-1"], "--temperature must be 0 (greedy)"),
                           (["--seed", "-1"], "--seed must be None or an int")]:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "SamplingParams" not in err, (extra, err)
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_limit_caps_the_synthetic_count_and_few_shot_examples_are_distinct_problems(checkpoint, tmp_path):
    _, path = checkpoint
    out = tmp_path / "o.jsonl"
    base = ["--model", str(path), "--reward-workers", "1", "--no-progress", "--output", str(out),
            "--max-new-tokens", "2"]
    assert main(base + ["--dataset", "synthetic:arithmetic:n=5", "--limit", "12"]) == 0
    assert len(out.read_text().splitlines()) == 5  # --limit caps n=5, it does not raise it
    data = tmp_path / "dup.jsonl"  # "1+1=" twice: two shots must still be two problems
    rows = [{"id": f"d{i}", "question": "1+1=" if i < 2 else f"{i}+{i}=", "answer": str(2 if i < 2 else 2 * i)}
            for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for seed in range(6):
        assert main(base + ["--dataset", str(data), "--reward", "exact", "--few-shot", "2", "--seed", str(seed)]) == 0
        prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
        shown = prompts[0].split("\n")[:2]
        assert len(set(shown)) == 2, (seed, prompts[0])


def test_stop_escapes_are_read_and_other_backslashes_kept():
    from llamarl.eval import _stop_strings

    assert _stop_strings(["\\n", "a\\tb", "\\x41", "\\u2192", "\\\\n"]) == ["\n", "a\tb", "A", "\u2192", "\\n"]
    assert _stop_strings(["\\)", "\\\u2192", "\\\u00e9", "\\q"]) == ["\\)", "\\\u2192", "\\\u00e9", "\\q"]
    with pytest.raises(ValueError, match="not a valid escape sequence"):
        _stop_strings(["\\x4"])


def _long_prompt_case(tmp_path, path, rows):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o.jsonl"
    args = ["--model", str(path), "--dataset", str(data), "--reward", "exact", "--reward-workers", "1",
            "--max-new-tokens", "4", "--batch-size", "2", "--no-progress", "--output", str(out)]
    return args, out, tmp_path / "o.summary.json"


SHORT_AND_LONG = [{"id": "a", "question": "1+1=", "answer": "2"},
                  {"id": "long", "question": "9" * 80, "answer": "1"},  # 81 tokens >= the context of 64
                  {"id": "b", "question": "2+3=", "answer": "5"},
                  {"id": "c", "question": "7*8=", "answer": "56"}]


def test_cli_without_drop_long_refuses_an_over_long_prompt_and_names_the_flag(checkpoint, tmp_path, capsys):
    _, path = checkpoint
    args, out, summary = _long_prompt_case(tmp_path, path, SHORT_AND_LONG)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "1 of 4 prompts leave no room to generate" in err and "sample 'long': 81 tokens" in err
    assert "--drop-long" in err
    assert not out.exists() and not summary.exists()  # nothing was evaluated


def test_cli_drop_long_evaluates_exactly_the_prompts_that_fit(checkpoint, tmp_path, capsys):
    """The over-long prompt is dropped up front; the others are generated (greedy, checked against
    transformers, so no completion lands on the wrong sample) and the summary names the dropped id."""
    hf, path = checkpoint
    tok = CharTokenizer()
    args, out, summary_path = _long_prompt_case(tmp_path, path, SHORT_AND_LONG)
    assert main(args + ["--drop-long"]) == 0
    captured = capsys.readouterr()
    assert "dropped 1 of 4 samples" in captured.err and "'long'" in captured.err
    assert "prompts=3  dropped=1" in captured.out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    short = [r for r in SHORT_AND_LONG if r["id"] != "long"]
    assert [r["sample_id"] for r in records] == [r["id"] for r in short]
    assert [r["completion"] for r in records] == [_hf_greedy(hf, tok, r["question"], 4) for r in short]
    summary = json.loads(summary_path.read_text())
    assert summary["dropped_ids"] == ["long"] and summary["num_dropped"] == 1 and summary["num_prompts"] == 3
    assert summary["accuracy"] == pytest.approx(sum(r["correct"] for r in records) / 3)


def test_cli_drop_long_with_every_prompt_too_long_is_an_error(checkpoint, tmp_path, capsys):
    _, path = checkpoint
    rows = [{"id": f"x{i}", "question": str(i) * 70, "answer": "1"} for i in range(3)]
    args, out, summary = _long_prompt_case(tmp_path, path, rows)
    assert main(args + ["--drop-long"]) == 2
    err = capsys.readouterr().err
    assert "all 3 prompts leave no room to generate" in err and "nothing to evaluate" in err
    assert not out.exists() and not summary.exists()


def test_python_dash_m_llamarl_eval(checkpoint, tmp_path):
    _, path = checkpoint
    out = tmp_path / "cli.jsonl"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "llamarl.eval", "--model", str(path), "--dataset", "synthetic:arithmetic:n=6",
         "-n", "2", "--output", str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "accuracy=" in proc.stdout and "pass@1=" in proc.stdout and "pass@2=" in proc.stdout
    assert "eval: 100%" in proc.stderr  # the tqdm progress bar
    assert len(out.read_text().splitlines()) == 12


def test_generation_stops_at_the_tokenizer_eos_and_every_config_eos():
    """Training rollouts and evaluation stop at the same tokens: the union of the tokenizer's eos and the
    model config's eos ids (the generator used only the config's, evaluation only the tokenizer's)."""
    from llamarl.eval import eos_ids
    from llamarl.models import CharTokenizer, LlamaConfig

    tok = CharTokenizer()
    base = dict(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=32)
    assert eos_ids(tok, LlamaConfig(**base, eos_token_id=(7, tok.eos_id))) == sorted({7, tok.eos_id})
    assert eos_ids(tok, LlamaConfig(**base, eos_token_id=None)) == [tok.eos_id]


def test_a_run_or_checkpoint_directory_as_model_names_the_policy_directory(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints" / "step_000004" / "policy").mkdir(parents=True)
    for given, want in (("run", "run/checkpoints/step_NNNNNN/policy"),
                        ("run/checkpoints/step_000004", "run/checkpoints/step_000004/policy")):
        assert main(["--model", str(tmp_path / given), "--dataset", "synthetic:arithmetic", "--limit", "1"]) == 2
        assert f"pass {tmp_path / want}" in capsys.readouterr().err


def test_ctrl_c_ends_eval_with_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import llamarl.eval as ev

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(ev, "run", interrupted)
    out = tmp_path / "o.jsonl"
    assert main(["--model", "tiny", "--dataset", "synthetic:arithmetic", "--output", str(out)]) == 130
    assert capsys.readouterr().err == f"llamarl.eval: interrupted; nothing was written to {out}\n"
    assert not out.exists()


def test_a_write_that_fails_after_the_evaluation_still_prints_the_metrics(checkpoint, tmp_path, capsys, monkeypatch):
    """The output folder was checked up front; a write that fails later (the disk filled) is a clean error
    after the metrics are printed, not a traceback that loses them."""
    from llamarl.eval import EvalResult

    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EvalResult, "write_jsonl", full)
    _, path = checkpoint
    assert main(["--model", str(path), "--dataset", "synthetic:arithmetic:n=3", "--reward", "exact",
                 "--reward-workers", "1", "--no-progress", "--output", str(tmp_path / "o.jsonl")]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("accuracy=") and "pass@1=" in out
    assert f"cannot write --output {tmp_path / 'o.jsonl'}: No space left on device" in err
