"""What llamarl.train checks of a user's model, tokenizer and data before anything starts (exit 2, no run
directory), how a resumed run finds its inputs again, and the warning for completions cut by the token
budget."""

from __future__ import annotations

import json
import os
import re

import pytest

from llamarl.config_cli import load_config
from llamarl.config_values import ConfigError
from llamarl.models import LLAMA_CONFIGS, CharTokenizer, Llama
from llamarl.train import load_inputs, main

SMOKE = ["--preset", "smoke", "--set", "warm_start.steps=3"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


def assert_refused_before_start(cases: list[tuple[list[str], str]], tmp_path, capsys) -> None:
    """Each (arguments, pattern): the smoke run exits 2, its message matches, and no run directory is made."""
    for i, (args, pattern) in enumerate(cases):
        out = tmp_path / f"r{i}"
        assert main(SMOKE + args + ["--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert re.search(pattern, err), (args, err)
        assert not out.exists()


def _model(path, tokenizer=None, **generation):
    Llama(LLAMA_CONFIGS["tiny"]).save_pretrained(path)
    (tokenizer or CharTokenizer()).save(path)
    if generation:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_model_inputs_that_would_fail_later_are_configuration_errors(tmp_path, capsys):
    bad_json = _model(tmp_path / "bad_json")
    (bad_json / "generation_config.json").write_text('{"eos_token_id": [2, 3')
    broken_template = _model(tmp_path / "broken_template")
    config = json.loads((broken_template / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('no roles here') }}"
    (broken_template / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "run" / "checkpoints" / "step_000002" / "policy").mkdir(parents=True)
    cases = [
        (["--model", str(_model(tmp_path / "named", eos_token_id="<eos>"))],
         r"policy.model: .*generation_config.json: eos_token_id must be a token id or a list of them, got '<eos>'"),
        (["--model", str(bad_json)], r"policy.model: .*generation_config.json is not valid JSON"),
        (["--model", str(_model(tmp_path / "outside", eos_token_id=[2, 999]))],
         r"policy.model: end-of-text token id\(s\) \[999\] .* outside the vocabulary \[0, 100\)"),
        (["--model", str(broken_template), "--set", "data.chat=true"],
         r"policy.tokenizer: its chat template fails on a plain user message: .*no roles here"),
        (["--model", str(tmp_path / "run")],
         rf"policy.model: it is a training run directory, not a model: pass {tmp_path}/run/checkpoints/step_NNNNNN"),
    ]
    assert_refused_before_start(cases, tmp_path, capsys)


def test_an_upper_case_suffix_is_a_dataset_file_too(tmp_path):
    path = tmp_path / "data.JSONL"
    path.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    assert load_config(SMOKE + ["--dataset", str(path)]).data.dataset == str(path)


def test_a_resumed_run_finds_its_relative_inputs_from_anywhere_and_keeps_its_model(tmp_path, monkeypatch):
    work = tmp_path / "work"
    model = _model(work / "models" / "m")
    (work / "data.jsonl").write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                             for i in range(40)))
    monkeypatch.chdir(work)
    assert main(SMOKE + ["--model", "models/m", "--dataset", "data.jsonl", "--max-steps", "2",
                         "--out", "run"]) == 0
    saved = (work / "run" / "config.yaml").read_text()
    assert f"model: {model}" in saved and f"dataset: {work / 'data.jsonl'}" in saved
    monkeypatch.chdir(tmp_path)  # elsewhere: the saved absolute paths still resolve
    cfg = load_config(["--resume", str(work / "run"), "--max-steps", "3"])
    assert cfg.policy.model == str(model) and cfg.data.dataset == str(work / "data.jsonl")

    other = _model(tmp_path / "other")
    with pytest.raises(Exception, match=r"policy.model: the resumed run started with policy.model="):
        load_config(["--resume", str(work / "run"), "--max-steps", "3", "--model", str(other)])
    # the model moved: its new place is accepted, and a model of other shapes is refused
    os.rename(model, tmp_path / "moved")
    assert load_config(["--resume", str(work / "run"), "--max-steps", "3", "--model", str(tmp_path / "moved")])
    Llama(LLAMA_CONFIGS["tiny"].replace(num_hidden_layers=1)).save_pretrained(other)
    assert main(["--resume", str(work / "run"), "--max-steps", "3", "--model", str(other)]) == 2
    assert main(["--resume", str(work / "run"), "--max-steps", "3", "--model", str(tmp_path / "moved")]) == 0


def test_a_resume_continues_only_the_data_stream_its_checkpoint_counts_into(tmp_path, capsys):
    """The checkpoint records its data position with the stream's id: a resume after the dataset file was
    edited is refused before anything starts; one whose settings leave the stream alone (another
    max_new_tokens that drops no prompt) continues."""
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    assert main(SMOKE + ["--dataset", str(data), "--max-steps", "2", "--out", str(run)]) == 0
    state = json.loads(next((run / "checkpoints").glob("step_*/state.json")).read_text())
    assert set(state["data_cursor"]) == {"position", "stream"} and state["data_cursor"]["position"] > 0
    rows[30]["answer"] = "wrong"  # an edit in place: the same path, another stream
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["--resume", str(run), "--max-steps", "3"]) == 2
    assert "data.dataset: the data stream of" in capsys.readouterr().err
    rows[30]["answer"] = "31"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--resume", str(run), "--max-steps", "3", "--set", "generator.max_new_tokens=5"]) == 0


def test_gsm8k_answers_that_are_not_one_number_are_warned_about(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]
    rows.append({"question": "area?", "answer": "5 m^2"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(SMOKE + ["--dataset", str(data), "--reward", "gsm8k"])
    load_inputs(cfg)
    assert "1 of 21 answers are not one number (e.g. '5 m^2')" in capsys.readouterr().err
    load_inputs(load_config(SMOKE + ["--dataset", str(data), "--reward", "math"]))
    assert "not one number" not in capsys.readouterr().err


def test_code_reward_samples_without_tests_are_warned_about_or_refused(tmp_path, capsys):
    """Every completion of a sample without readable tests is a failed reward: some such samples are warned
    about, a dataset with none that has tests is refused before anything starts."""
    data = tmp_path / "data.jsonl"
    rows = [{"question": f"Print {i}.", "answer": json.dumps({"inputs": [""], "outputs": [str(i)]})} for i in range(20)]
    rows[7]["answer"] = "7"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    load_inputs(load_config(SMOKE + ["--dataset", str(data), "--reward", "code"]))
    assert "1 of 20 samples have no tests the code verifier can read (e.g. sample " in capsys.readouterr().err
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    with pytest.raises(ConfigError, match=r"^reward.reward: code, but 20 of 20 samples have no tests"):
        load_inputs(load_config(SMOKE + ["--dataset", str(data), "--reward", "code"]))


def test_completions_cut_by_the_token_budget_are_warned_about_once(tmp_path, capsys):
    assert main(SMOKE + ["--set", "generator.max_new_tokens=1", "--max-steps", "3", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert err.count("completions stopped at generator.max_new_tokens=1 tokens") == 1


def test_a_config_json_leaving_out_defaults_matches_its_own_checkpoint(tmp_path):
    from llamarl.config import ConfigError
    from llamarl.training import _check_resumed_model

    config = LLAMA_CONFIGS["tiny"].replace(num_key_value_heads=LLAMA_CONFIGS["tiny"].num_attention_heads)
    Llama(config).save_pretrained(tmp_path / "policy")  # the checkpoint's config.json: every field written
    given = {k: v for k, v in config.to_hf_dict().items() if k not in ("num_key_value_heads", "head_dim")}
    _check_resumed_model(given, tmp_path / "policy")
    with pytest.raises(ConfigError, match="differs in num_hidden_layers"):
        _check_resumed_model({**given, "num_hidden_layers": 1}, tmp_path / "policy")


def test_the_warm_start_cache_does_not_depend_on_how_a_path_is_spelled(tmp_path, monkeypatch):
    from llamarl.train import load_inputs, prepare_policy

    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                                 for i in range(20)))
    monkeypatch.chdir(tmp_path)
    relative = load_config(SMOKE + ["--dataset", "data.jsonl"])
    first, _ = prepare_policy(relative, *load_inputs(relative))
    absolute = load_config(SMOKE + ["--dataset", str(tmp_path / "data.jsonl")])  # as a resumed run's config.yaml
    again, info = prepare_policy(absolute, *load_inputs(absolute))
    assert again == first and info["cached"]


def test_few_shot_raw_prompts_without_a_stop_string_are_warned_about(tmp_path):
    from llamarl.run_warnings import config_warnings

    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                              for i in range(40)))
    base = SMOKE + ["--dataset", str(tmp_path / "d.jsonl"), "--set", "data.few_shot=2"]
    warned = [w for w in config_warnings(load_config(base)) if w.startswith("data.few_shot=2 without generator.stop")]
    assert len(warned) == 1
    for extra in (["--set", 'generator.stop=["\\n"]'], ["--set", "data.chat=true"], ["--set", "data.few_shot=0"]):
        assert not any("generator.stop" in w for w in config_warnings(load_config(base + extra))), extra


def test_a_stop_string_with_a_literal_backslash_n_is_warned_about():
    from llamarl.run_warnings import config_warnings

    literal = config_warnings(load_config(SMOKE + ["--set", "generator.stop=\\nQuestion:"]))
    assert any(w.startswith("generator.stop '\\\\nQuestion:' holds a backslash") for w in literal), literal
    newline = config_warnings(load_config(SMOKE + ["--set", 'generator.stop=["\\nQuestion:"]']))
    assert not any("backslash" in w for w in newline), newline


def test_a_template_with_a_literal_backslash_n_is_warned_about_but_latex_is_not():
    from llamarl.run_warnings import config_warnings

    literal = config_warnings(load_config(SMOKE + ["--set", "data.template=Q: {prompt}\\nA: "]))
    assert any(w.startswith("data.template 'Q: {prompt}\\\\nA: ' holds a backslash") for w in literal), literal
    for fine in ("Q: {prompt}\nA: ", "Solve {prompt}, \\neq \\text{no} \\theta; put it in \\boxed{}"):
        warnings = config_warnings(load_config(SMOKE + ["--set", f"data.template={fine}"]))
        assert not any("backslash" in w for w in warnings)


def test_truncated_sampling_with_raw_logprobs_is_warned_about_since_mu_is_then_the_full_softmax():
    from llamarl.run_warnings import config_warnings

    raw = ["--set", "generator.logprobs_mode=raw"]
    for flag, name in (("generator.top_p=0.9", "generator.top_p=0.9"), ("generator.top_k=20", "generator.top_k=20"),
                       ("generator.min_p=0.05", "generator.min_p=0.05")):
        warned = config_warnings(load_config(SMOKE + raw + ["--set", flag]))
        assert any(w.startswith(f"{name} samples from the truncated distribution") for w in warned), warned
        processed = config_warnings(load_config(SMOKE + ["--set", flag]))  # the default: mu is the sampler's
        assert not any("truncated" in w for w in processed), processed
    assert not any("truncated" in w for w in config_warnings(load_config(SMOKE + raw)))


def test_a_stop_string_that_looks_like_a_list_is_warned_about():
    from llamarl.run_warnings import config_warnings

    warned = config_warnings(load_config(SMOKE + ["--set", 'generator.stop=["</answer>", Question:]']))
    assert any("is one stop string that looks like a list" in w for w in warned), warned
    for fine in ("[INST]", '["</answer>", "Question:"]'):
        assert not any("looks like a list" in w for w in config_warnings(load_config(SMOKE + ["--set",
                                                                                         f"generator.stop={fine}"])))


def test_synthetic_prompts_longer_than_the_context_are_refused_before_the_warm_start(tmp_path, capsys):
    """The built-in model's context is 128 tokens, the smoke run's generation 4: 30 few-shot examples or a
    200-character template make every prompt too long. Refused with the field and the numbers, before any
    warm start or process (a file dataset's over-long prompts are dropped instead)."""
    assert_refused_before_start([
        (["--set", "data.few_shot=30"],
         r"data.few_shot: prompts take up to \d{3} tokens with data.few_shot=30, but the model context of 128 "
         r"tokens minus generator.max_new_tokens=4 leaves 124"),
        (["--set", "data.template=" + "x" * 200 + "{prompt}"],
         r"data.template: prompts take up to 2\d\d tokens .* leaves 124"),
        (["--set", "data.few_shot=4", "--set", "generator.max_new_tokens=100"],
         r"data.few_shot: prompts take up to \d+ tokens with data.few_shot=4, but .* minus "
         r"generator.max_new_tokens=100 leaves 28"),
    ], tmp_path, capsys)
    assert not (tmp_path / "cache").exists()  # no warm start was trained
    from llamarl.train import load_inputs

    load_inputs(load_config(SMOKE + ["--set", "data.few_shot=4"]))  # fits: accepted


def test_the_warm_start_key_reads_a_reward_modules_source_file(tmp_path, monkeypatch):
    """reward.reward=pkg.mod:fn (the probe's reward decides when a warm start stops): its source file is part
    of the cache key, as a file.py:fn's is; a built-in has none."""
    from llamarl.warmstart import content_fingerprint, reward_source

    pkg = tmp_path / "rewardpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text("def score(completion, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert reward_source("rewardpkg.scores:score") == str(pkg / "scores.py")
    assert reward_source(f"{pkg / 'scores.py'}:score") == str(pkg / "scores.py")
    assert reward_source("exact") is None and reward_source("no_such_module_anywhere:fn") is None
    before = content_fingerprint(reward_source("rewardpkg.scores:score"))
    (pkg / "scores.py").write_text("def score(completion, answer):\n    return 0.0\n")
    assert content_fingerprint(reward_source("rewardpkg.scores:score")) != before


def test_the_first_complete_warm_start_entry_wins_and_is_never_replaced(tmp_path):
    """Two runs with one cache key both train; the later one used to delete the entry the earlier one was
    loading from (and concurrent saves failed with 'Directory not empty'). Now the first rename wins, later
    writers keep it, and only a directory that is not a complete entry is replaced."""
    import threading

    import torch

    from llamarl.warmstart import save_atomic

    tok = CharTokenizer()
    models = []
    for seed in range(4):
        torch.manual_seed(seed)
        models.append(Llama(LLAMA_CONFIGS["tiny"]))
    path = tmp_path / "cache" / "tiny-key"
    assert save_atomic(models[0], tok, path, {"steps": 0})
    first = (path / "model.safetensors").read_bytes()
    assert not save_atomic(models[1], tok, path, {"steps": 1})
    assert (path / "model.safetensors").read_bytes() == first and json.loads((path / "warmstart.json").read_text()) == {
        "steps": 0}
    results: list = []
    racers = [threading.Thread(target=lambda m=m, i=i: results.append(save_atomic(m, tok, tmp_path / "race", {"i": i})))
              for i, m in enumerate(models)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert sorted(results) == [False, False, False, True]  # no writer failed, exactly one won
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "race"]  # no temp dir left behind
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.safetensors").write_text("not a complete entry")
    assert save_atomic(models[2], tok, tmp_path / "half", {"steps": 2})
    assert json.loads((tmp_path / "half" / "warmstart.json").read_text()) == {"steps": 2}


def test_a_reward_failing_on_every_probe_sample_stops_the_warm_start(tmp_path, capsys):
    """A reward that fails on every sample (here: returns None) was counted as 0.0 by the warm start's probe,
    so the warm start ran all its steps and cached its entry before RL's reward.max_failed_steps stopped the
    run; it stops at the first probe now, naming the error, and caches nothing."""
    reward = tmp_path / "forgot_return.py"
    reward.write_text("def score(completion, answer):\n    completion.strip()\n")
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--max-steps", "3", "--reward", f"{reward}:score", "--set",
                 "warm_start.steps=50", "--set", "warm_start.target_accuracy=0.3", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "failed on every one of the warm start's" in err and "None" in err, err
    assert "warm start 50/50" not in err
    assert not list((tmp_path / "cache").rglob("warmstart.json"))  # nothing cached


def test_warm_start_settings_with_a_model_directory_are_warned_about(tmp_path):
    """warm_start.* does nothing for a Hugging Face model directory (RL starts from its weights): it was
    silently ignored."""
    from llamarl.run_warnings import config_warnings

    model = str(_model(tmp_path / "m"))

    def warned(*extra):
        return [w for w in config_warnings(load_config(["--model", model, *extra])) if "warm start trains" in w]

    assert warned() == [] and [w for w in config_warnings(load_config(["--set", "warm_start.steps=100"]))
                               if "warm start trains" in w] == []
    got = warned("--set", "warm_start.steps=100", "--set", "warm_start.lr=0.01")
    assert len(got) == 1 and got[0].startswith("warm_start.steps=100, warm_start.lr=0.01: the warm start trains"), got
