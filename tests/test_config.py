"""llamarl.config and llamarl.config_cli: presets, YAML, CLI precedence, the mode/staleness rule, layout
shorthand, and that every validation error starts with the name of the field it is about."""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import yaml

from llamarl.checkpoint import save_checkpoint
from llamarl.config import (
    ConfigError,
    GeneratorConfig,
    RunConfig,
    TrainConfig,
    TrainerConfig,
)
from llamarl.config_cli import load_config
from llamarl.presets import PRESETS
from llamarl.runtime import Layout


def test_presets_are_valid_and_the_default_is_the_embedded_default():
    assert {"default", "sync", "smoke"} <= set(PRESETS)
    cfg = load_config([])
    assert cfg == PRESETS["default"]
    assert (cfg.policy.model, cfg.run.mode) == ("tiny", "async")
    assert cfg.data.dataset.startswith("synthetic:arithmetic")
    assert load_config(["--preset", "sync"]).run == dataclasses.replace(cfg.run, mode="sync", max_staleness=0)
    for preset in PRESETS.values():
        assert TrainConfig.from_dict(preset.to_dict()) == preset


def test_precedence_preset_yaml_flags_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "trainer": {"lr": "3e-4", "betas": [0.8, 0.9]},  # "3e-4" is a YAML string: parsed by the field type
        "generator": {"prompts_per_step": 4, "samples_per_prompt": 4},
        "run": {"max_steps": 9, "seed": 5},
    }))
    cfg = load_config(["--preset", "smoke", "--config", str(path), "--max-steps", "7", "--set", "run.seed=6",
                       "--set", "trainer.lr=5e-4"])
    smoke = PRESETS["smoke"]
    assert cfg.trainer.lr == 5e-4  # --set beats YAML
    assert cfg.trainer.betas == (0.8, 0.9)  # YAML beats preset
    assert cfg.run.max_steps == 7 and cfg.run.seed == 6  # named flag / --set beat YAML
    assert cfg.generator.max_new_tokens == smoke.generator.max_new_tokens  # untouched: preset
    assert cfg.generator.prompts_per_step == 4
    both = load_config(["--max-steps", "7", "--set", "run.max_steps=8"])
    assert both.run.max_steps == 8  # --set wins over a named flag


def test_yaml_round_trip(tmp_path):
    cfg = load_config(["--preset", "smoke", "--set", "trainer.betas=0.5,0.6", "--set", "policy.tokenizer=none",
                       "--layout", "trainer=2,generator=1x2,reward=1"])
    path = cfg.save(tmp_path / "run")
    assert path.name == "config.yaml"
    assert yaml.safe_load(path.read_text())["trainer"]["betas"] == [0.5, 0.6]
    assert load_config(["--config", str(path)]) == cfg
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_mode_and_staleness_follow_each_other():
    assert load_config(["--mode", "sync"]).run.max_staleness == 0
    assert load_config(["--mode", " sync"]).run.max_staleness == 0  # the field strips spaces; so does the rule
    assert load_config(["--max-staleness", "0"]).run.mode == "sync"
    assert load_config(["--max-staleness", "3"]).run.mode == "async"
    assert load_config(["--preset", "sync", "--mode", "async"]).run.max_staleness == 1
    assert load_config(["--mode", "async", "--max-staleness", "2"]).run.max_staleness == 2
    with pytest.raises(ConfigError, match=r"^run.max_staleness: must be 0 in sync mode"):
        RunConfig(mode="sync", max_staleness=1)
    with pytest.raises(ConfigError, match=r"^run.max_staleness: must be >= 1 in async mode"):
        load_config(["--mode", "async", "--max-staleness", "0"])


def test_a_flag_over_a_config_file_decides_the_fields_it_implies(tmp_path):
    """A run's config.yaml lists every field: --mode / --max-staleness / --layout over it (the command line
    outranks the file) set the fields they imply instead of being refused as inconsistent with the file."""
    saved = PRESETS["default"].save(tmp_path / "run1")  # async, max_staleness 1, one trainer rank
    sync = load_config(["--config", str(saved), "--mode", "sync"], check_environment=False).run
    assert (sync.mode, sync.max_staleness) == ("sync", 0)
    assert load_config(["--config", str(saved), "--max-staleness", "0"], check_environment=False).run.mode == "sync"
    (tmp_path / "a.yaml").write_text("run:\n  mode: async\n  max_staleness: 3\n")
    kept = load_config(["--config", str(tmp_path / "a.yaml"), "--mode", "async"], check_environment=False).run
    assert kept.max_staleness == 3  # the file's staleness stands where the flag agrees with it
    (tmp_path / "zero.yaml").write_text("run:\n  max_staleness: 0.0\n")
    assert load_config(["--config", str(tmp_path / "zero.yaml")], check_environment=False).run.mode == "sync"
    two = load_config(["--config", str(saved), "--layout", "trainer=2"], check_environment=False)
    assert two.trainer.ranks == 2
    with pytest.raises(ConfigError, match=r"^run.max_staleness: must be 0 in sync mode"):  # one level: must agree
        load_config(["--mode", "sync", "--max-staleness", "1"], check_environment=False)
    # a resumed run saved with a layout, one of whose fields the command line changes: that field wins
    run = tmp_path / "laid"
    load_config(["--preset", "smoke", "--layout", "trainer=1,generator=1x1", "--out", str(run)]).save(run)
    resumed = load_config(["--resume", str(run), "--max-steps", "9", "--set", "trainer.ranks=2"],
                          check_environment=False)
    assert resumed.trainer.ranks == 2 and resumed.run.layout is None


@pytest.mark.parametrize("text", ["4", "[trainer=2, reward=2]", "no"])
def test_a_layout_that_is_not_text_is_refused(tmp_path, text):
    (tmp_path / "c.yaml").write_text(f"run:\n  layout: {text}\n")
    with pytest.raises(ConfigError, match=r"^run.layout: must be a string like 'trainer=2"):
        load_config(["--config", str(tmp_path / "c.yaml")], check_environment=False)


def test_config_files_lose_nothing_silently(tmp_path):
    """A key given twice (a second trainer: section) is refused; integers are decimal (no YAML 1.1 octal or
    base 60); a directory, a non-UTF-8 file and a YAML mapping where text belongs get messages that say what
    to do; a pipe (--config <(...)) is read."""
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 1.0e-3\nrun:\n  seed: 3\ntrainer:\n  kl_coef: 0.1\n")
    with pytest.raises(ConfigError, match=r"the key 'trainer' is given twice \(lines 1 and 5\)"):
        load_config(["--config", str(f)], check_environment=False)
    for text in ("trainer: {lr: 1.0e-3, lr: 5.0e-4}\n", "{trainer: {lr: 1.0e-3}, trainer: {kl_coef: 0.1}}\n"):
        f.write_text(text)  # two on one line (flow style)
        with pytest.raises(ConfigError, match=r"the key '(lr|trainer)' is given twice \(lines 1 and 1\)"):
            load_config(["--config", str(f)], check_environment=False)
    f.write_text("run:\n  seed: 0042\n  max_steps: 0x10\n")
    assert (lambda r: (r.seed, r.max_steps))(load_config(["--config", str(f)], check_environment=False).run) == \
        (42, 16)
    f.write_text("run:\n  eval_every: 1:30\n")
    with pytest.raises(ConfigError, match=r"^run.eval_every: must be an integer, got '1:30'"):
        load_config(["--config", str(f)], check_environment=False)
    with pytest.raises(ConfigError, match=r"^--config: is a directory; give the YAML file"):
        load_config(["--config", str(tmp_path)], check_environment=False)
    f.write_bytes("data:\n  template: 'Pregunta: {prompt} ¿'\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"is not UTF-8 text .*; save the file as UTF-8"):
        load_config(["--config", str(f)], check_environment=False)
    f.write_text("data:\n  template: {prompt}\n")
    with pytest.raises(ConfigError, match=r"^data.template: must be a string; in a YAML file quote text"):
        load_config(["--config", str(f)], check_environment=False)
    read, write = os.pipe()
    os.write(write, b"run:\n  seed: 9\n")
    os.close(write)
    try:
        assert load_config(["--config", f"/dev/fd/{read}"], check_environment=False).run.seed == 9
    finally:
        os.close(read)


def test_synthetic_dataset_options_are_checked_up_front():
    for spec, message in [("synthetic:arithmetic:digts=3", "unknown option(s) ['digts']"),
                          ("synthetic:arithmetic:digits=12", "digits must be an int in [1, 9], got 12")]:
        with pytest.raises(ConfigError, match=r"^data.dataset: .*" + re.escape(message)):
            load_config(["--dataset", spec], check_environment=False)
    assert load_config(["--set", "generator.stop="], check_environment=False).generator.stop == ()


def test_layout_shorthand_sets_and_checks_the_fields():
    cfg = load_config(["--layout", "trainer=2:ddp,generator=2x3,reward=1"])
    assert (cfg.trainer.ranks, cfg.trainer.parallel, cfg.generator.tp, cfg.generator.replicas,
            cfg.reward.workers) == (2, "ddp", 2, 3, 1)
    assert cfg.layout() == Layout.parse("trainer=2:ddp,generator=2x3,reward=1", device=cfg.device)
    only_trainer = load_config(["--layout", "trainer=2", "--set", "generator.tp=2"])
    assert (only_trainer.trainer.ranks, only_trainer.generator.tp) == (2, 2)  # unnamed items stay free
    plain = load_config(["--set", "trainer.ranks=4", "--set", "reward.workers=0"])
    assert plain.layout().world_size == 1 + 4 + 1 and plain.layout().groups_of("reward") == ()
    for null in ("null", "none", "~", ""):  # drops a layout given earlier (a resumed run's saved one)
        dropped = load_config(["--layout", "trainer=2", "--set", f"run.layout={null}", "--set", "trainer.ranks=1"])
        assert dropped.run.layout is None and dropped.trainer.ranks == 1


def test_resume_defaults_out_to_the_run_dir(tmp_path):
    run = tmp_path / "run"
    step = save_checkpoint(run, 4, policy_state=None, policy_version=4)
    assert load_config(["--resume", str(run)]).run.out == str(run)
    assert load_config(["--resume", str(step)]).run.out == str(run)  # a checkpoint dir names its run
    assert load_config(["--resume", str(run), "--out", str(run)]).run.resume == str(run)


def test_resume_continues_with_the_runs_own_config(tmp_path):
    """A resumed run keeps its model/data/reward settings (its config.yaml replaces the preset); the command
    line still overrides them; the step count must go past the checkpoint; --out may not be another run."""
    run = tmp_path / "run"
    load_config(["--preset", "smoke", "--set", "data.eval_size=10", "--set", "trainer.lr=1e-3",
                 "--reward", "gsm8k", "--max-steps", "4", "--out", str(run)]).save(run)
    save_checkpoint(run, 4, policy_state=None, policy_version=4)
    cfg = load_config(["--resume", str(run), "--max-steps", "9", "--set", "trainer.lr=2e-3"])
    assert (cfg.data.eval_size, cfg.reward.reward, cfg.run.max_steps) == (10, "gsm8k", 9)
    assert cfg.trainer.lr == 2e-3  # the command line still wins
    assert cfg.generator == PRESETS["smoke"].generator and cfg.run.out == str(run)
    with pytest.raises(ConfigError, match=r"^run.max_steps: the run at .* is already at step 4; pass --max-steps"):
        load_config(["--resume", str(run)])  # its own max_steps (4): nothing left to run
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^run.out: already holds another run than the one resumed"):
        load_config(["--resume", str(run), "--max-steps", "9", "--out", str(other)])
    assert load_config(["--resume", str(run), "--max-steps", "9", "--out", str(tmp_path / "new")]).run.out == \
        str(tmp_path / "new")


@pytest.mark.parametrize("override, dataset", [
    ("run.seed=1", "synthetic:arithmetic"),
    ("data.eval_size=30", "synthetic:arithmetic"),
    ("data.few_shot=2", "synthetic:arithmetic"),
    ("data.template=Q: {prompt}", "synthetic:arithmetic"),
    ("data.dataset=synthetic:arithmetic:seed=5", "synthetic:arithmetic"),  # a spec is not a file that moved
    ("data.eval_size=12", "file"),
])
def test_a_resume_keeps_its_data_stream(tmp_path, override, dataset):
    """The checkpoint's data position counts into an order fixed by the seed, the held-out split and the
    prompt format: a resume that changes one of them is refused, naming it; settings that leave the stream
    alone (the learning rate, max_new_tokens: llamarl.train compares the stream itself) are accepted."""
    run = tmp_path / "run"
    if dataset == "file":
        dataset = str(tmp_path / "d.jsonl")
        rows = "".join(f'{{"question": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(40))
        (tmp_path / "d.jsonl").write_text(rows)
    load_config(["--preset", "smoke", "--set", f"data.dataset={dataset}", "--set", "data.eval_size=8", "--max-steps",
                 "4", "--out", str(run)], check_environment=False).save(run)
    save_checkpoint(run, 4, policy_state=None, policy_version=4)
    base = ["--resume", str(run), "--max-steps", "9"]
    with pytest.raises(ConfigError, match=rf"^{override.split('=')[0]}: the resumed run started with"):
        load_config(base + ["--set", override], check_environment=False)
    assert load_config(base + ["--set", "trainer.lr=2e-3"], check_environment=False).trainer.lr == 2e-3
    if not dataset.startswith("synthetic"):  # the same file, spelled relative to the working directory
        relative = os.path.relpath(dataset)
        assert load_config(base + ["--dataset", relative], check_environment=False).data.dataset == relative
    assert load_config(base + ["--set", "generator.max_new_tokens=6"], check_environment=False)


def _messages(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "run_text.yaml").write_text("run: fast\n")
    (tmp_path / "typo.yaml").write_text("trainer:\n  lrate: 1\n")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("{}\n")
    t = str(tmp_path)
    return [
        (["--set", "trainer.lr=-1"], r"trainer.lr: must be > 0, got -1"),
        (["--set", "trainer.lr=fast"], r"trainer.lr: must be a number, got 'fast'"),
        (["--set", "trainer.lrr=1"], r"trainer.lrr: unknown key in command line \(did you mean 'trainer.lr'\?\)"),
        (["--set", "trainr.lr=1"], r"trainr: unknown config section .*did you mean 'trainer'"),
        ([f"--config={t}/typo.yaml"], r"trainer.lrate: unknown key in .*typo.yaml \(did you mean 'trainer.lr'\?\)"),
        (["--mode", "asink"], r"run.mode: must be one of 'async', 'sync' \(did you mean 'async'\?\)"),
        (["--max-steps", "0"], r"run.max_steps: must be > 0, got 0"),
        (["--max-steps", "2.5"], r"run.max_steps: must be an integer, got '2.5'"),
        (["--mode", "sync", "--max-staleness", "2"], r"run.max_staleness: must be 0 in sync mode"),
        (["--set", "run.keep_checkpoints=0"], r"run.keep_checkpoints: must be > 0"),
        (["--set", "run.eval_every=-1"], r"run.eval_every: must be >= 0"),
        (["--set", "generator.top_p=1.5"], r"generator.top_p: must be in \(0, 1\]"),
        (["--set", "generator.min_p=-0.1"], r"generator.min_p: must be in \[0, 1\] \(0: off\)"),
        (["--set", "generator.temperature=0"], r"generator.temperature: must be > 0"),
        (["--set", "generator.quantization=int4"], r"generator.quantization: must be one of 'none', 'int8', 'fp8'"),
        (["--set", "generator.samples_per_prompt=1"], r"generator.samples_per_prompt: must be >= 2"),
        (["--set", "generator.tp=0"], r"generator.tp: must be > 0"),
        (["--set", "generator.max_sample_batches=0"], r"generator.max_sample_batches: must be > 0"),
        (["--set", "generator.top_k=-1"], r"generator.top_k: must be >= 0"),
        (["--set", "generator.logprobs_mode=raw_logprobs"], r"generator.logprobs_mode: must be one of"),
        (["--set", "trainer.ranks=3"], r"trainer.ranks: the step's 16x8=128 sequences must split evenly"),
        (["--set", "trainer.parallel=none", "--set", "trainer.ranks=2"], r"trainer.parallel: 'none' needs"),
        (["--set", "trainer.betas=0.9,1.2"], r"trainer.betas: both must be in \[0, 1\)"),
        (["--set", "trainer.betas=0.9"], r"trainer.betas: must be a list of 2 numbers"),
        (["--set", 'generator.stop=["a", ""]'], r"generator.stop: must hold non-empty strings"),
        (["--set", 'generator.stop=["\\q"]'], r"generator.stop: is not a valid YAML list"),
        (["--set", "trainer.rho=0.5"], r"trainer.rho: must be >= 1"),
        (["--set", "trainer.kl_coef=-0.1"], r"trainer.kl_coef: must be >= 0"),
        (["--set", "trainer.loss=fastest"], r"trainer.loss: must be one of 'auto', 'fused', 'reference'"),
        (["--set", "trainer.advantage=ppo"], r"trainer.advantage: must be one of"),
        (["--set", "policy.dtype=fp16"], r"policy.dtype: must be one of 'float32', 'bfloat16'"),
        (["--set", "reward.timeout_s=0"], r"reward.timeout_s: must be > 0"),
        (["--set", "warm_start.steps=-1"], r"warm_start.steps: must be >= 0"),
        (["--set", "data.few_shot=-2"], r"data.few_shot: must be >= 0"),
        (["--set", "data.eval_size=0"], r"data.eval_size: must be > 0"),
        (["--set", "data.template=Q:"], r"data.template: must contain \{prompt\}"),
        (["--set", "data.template={question}"], r"data.template: must contain \{prompt\}"),
        (["--set", "run.seed=4294967296"], r"run.seed: must be below 2\*\*32"),
        (["--set", "trainer=1"], r"--set: expects SECTION.KEY=VALUE"),
        (["--dataset", "synthetic:poetry"], r"data.dataset: unknown synthetic dataset"),
        (["--dataset", f"{t}/missing.jsonl"], r"data.dataset: no such file"),
        (["--dataset", f"{t}/data.csv"], r"data.dataset: unsupported file type '.csv'; use .jsonl, .parquet"),
        (["--model", f"{t}/missing"], r"policy.model: is neither a built-in model \(tiny, .*\) nor an existing"),
        (["--model", f"{t}/model"], r"policy.model: directory has no config.json"),
        (["--set", f"policy.tokenizer={t}/tok.json"], r"policy.tokenizer: no such file"),
        (["--reward", "best"],
         r"reward.reward: must be one of exact, gsm8k, math, code, none \(reward.model alone\), 'module:function' or"),
        (["--reward", "os.path:no_such_fn"], r"reward.reward: reward spec 'os.path:no_such_fn': .*no attribute"),
        (["--reward", f"{t}/missing.py:fn"], r"reward.reward: reward spec .*missing.py:fn.* does not exist"),
        (["--resume", f"{t}/missing"], r"run.resume: no such directory"),
        (["--resume", f"{t}/empty"], r"run.resume: holds no complete checkpoint"),
        (["--out", f"{t}/old"], r"run.out: holds a run that wrote no checkpoint .* delete that directory"),
        (["--layout", "trainer=x"], r"run.layout: layout: trainer='x'"),
        (["--layout", "trainer=2", "--set", "trainer.ranks=4"], r"run.layout: 'trainer=2' sets trainer.ranks=2"),
        (["--device", "tpu"], r"run.device: must be one of 'auto', 'cpu', 'cuda'"),
        (["--preset", "smok"], r"--preset: unknown preset \(did you mean 'smoke'\?\)"),
        (["--config", f"{t}/missing.yaml"], r"--config: no such file"),
        (["--config", f"{t}/list.yaml"], r"--config: .*must hold a mapping of sections"),
        (["--config", f"{t}/run_text.yaml"], r"run: must be a mapping of keys in .*run_text.yaml, got 'fast'"),
        (["--set", "trainer.dtype=bfloat16"], r"trainer.dtype: bfloat16 with policy.dtype=float32"),
        (["--set", "trainer.lr"], r"--set: expects SECTION.KEY=VALUE"),
        (["--set", "trainer.lr", "3e-4"], r"--set: expects SECTION.KEY=VALUE, e.g. --set trainer.lr=3e-4 \(one arg"),
        (["--max_steps", "3"], r"--max_steps: unknown option \(did you mean '--max-steps'\?\)"),
    ]


def test_a_dataset_id_field_may_be_named_or_null():
    assert load_config([]).data.id_field == "id"
    assert load_config(["--set", "data.id_field=null"]).data.id_field is None
    assert load_config(["--set", "data.id_field=problem_id"]).data.id_field == "problem_id"
    with pytest.raises(ConfigError, match="data.id_field: must name a field"):
        dataclasses.replace(load_config([]).data, id_field=" ").check()


def test_every_validation_error_starts_with_its_field(tmp_path):
    for argv, pattern in _messages(tmp_path):
        with pytest.raises(ConfigError) as info:
            load_config(argv)
        assert re.match(pattern, str(info.value)), (argv, str(info.value))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on a machine without CUDA")
def test_cuda_requested_without_cuda():
    with pytest.raises(ConfigError, match=r"^run.device: cuda requested but torch sees no CUDA device"):
        load_config(["--device", "cuda"])


def test_valid_paths_and_reward_function_are_accepted(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    (tmp_path / "my_reward.py").write_text("def score(completion, answer):\n    return float(completion == answer)\n")
    cfg = load_config(["--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "train.jsonl"),
                       "--reward", f"{tmp_path}/my_reward.py:score", "--out", str(tmp_path / "new"),
                       "--device", "cpu"])
    assert (cfg.policy.model, cfg.device) == (str(tmp_path / "model"), "cpu")
    assert load_config(["--reward", "operator:eq", "--dataset", "synthetic:arithmetic:digits=2"]).reward.reward == \
        "operator:eq"


def test_direct_construction_validates_too():
    assert TrainerConfig(lr=1).lr == 1.0 and isinstance(TrainerConfig(lr=1).lr, float)
    assert TrainerConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)
    with pytest.raises(ConfigError, match=r"^generator.max_new_tokens: must be an integer, got '8'"):
        GeneratorConfig(max_new_tokens="8")  # Python callers get no text parsing
    with pytest.raises(ConfigError, match=r"^trainer.micro_batch_size: must be an integer, got True"):
        TrainerConfig(micro_batch_size=True)
    with pytest.raises(ConfigError, match=r"^run.max_staleness: must be >= 1 in async mode"):
        TrainConfig(run=RunConfig(max_staleness=0))


def test_set_keeps_a_string_as_typed_and_parses_the_rest_around_spaces():
    cfg = load_config(["--set", "data.template=Solve: {prompt} in \\boxed{}. A= ", "--set", "run.mode= sync",
                       "--set", "run.max_staleness= 0 ", "--set", "trainer.share_prompts= false",
                       "--set", "trainer.betas= (0.9, 0.95)"], check_environment=False)
    assert cfg.data.template == "Solve: {prompt} in \\boxed{}. A= "  # braces and the trailing space kept
    assert (cfg.run.mode, cfg.run.max_staleness, cfg.trainer.share_prompts, cfg.trainer.betas) == \
        ("sync", 0, False, (0.9, 0.95))


def test_set_reads_a_quoted_value_as_the_string_inside():
    """``--set k='"v"'`` (quotes that reach the program) is the string v, as in a YAML file; escapes are read
    in double quotes; text with quotes inside, or only on one side, stays as typed."""
    cfg = load_config(["--set", 'run.report_to="none"', "--set", "data.template='Q: {prompt} '",
                       "--set", 'generator.stop="\\nQ:"', "--set", "trainer.lr='3e-4'"], check_environment=False)
    assert (cfg.run.report_to, cfg.data.template, cfg.generator.stop, cfg.trainer.lr) == \
        ("none", "Q: {prompt} ", ("\nQ:",), 3e-4)
    for text in ('say "hi" {prompt}', '"a {prompt}', "'it''s' {prompt}", '"\\q {prompt}"'):
        assert load_config(["--set", f"data.template={text}"], check_environment=False).data.template == text
    with pytest.raises(ConfigError, match="^run.resume: must name"):
        load_config(["--set", 'run.resume=""'])


def test_stop_strings_from_yaml_and_the_command_line(tmp_path):
    """A YAML list of quoted items (escapes read in double quotes), else one string taken exactly: commas,
    brackets and all ("[INST]" is a stop string, in a --set and in a YAML file)."""
    cfg = load_config(["--set", 'generator.stop=["\\n\\nQuestion:", "</answer>"]'], check_environment=False)
    assert cfg.generator.stop == ("\n\nQuestion:", "</answer>")
    for text in ("a, b", "[INST]", "[Question:]", "[a", '["a", 3]'):
        assert load_config(["--set", f"generator.stop={text}"], check_environment=False).generator.stop == (text,)
    assert load_config(["--set", "generator.stop=['[/INST]', 'it''s']"],
                       check_environment=False).generator.stop == ("[/INST]", "it's")
    (tmp_path / "s.yaml").write_text('generator:\n  stop: "[INST]"\n')
    assert load_config(["--config", str(tmp_path / "s.yaml")], check_environment=False).generator.stop == ("[INST]",)
    (tmp_path / "c.yaml").write_text('generator:\n  stop: ["\\nQ:", "x"]\n')
    cfg = load_config(["--config", str(tmp_path / "c.yaml")], check_environment=False)
    assert cfg.generator.stop == ("\nQ:", "x")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg and load_config([], check_environment=False).generator.stop == ()


@pytest.mark.parametrize("args", [["--resume", ""], ["--resume", "none"], ["--resume", " Null "],
                                  ["--set", "run.resume=~"], ["--set", "run.resume="]])
def test_an_empty_or_null_resume_on_the_command_line_is_refused(tmp_path, monkeypatch, args):
    """``--resume "$RUN"`` with RUN unset asks for a resume: it must not start a fresh run in the current
    directory (or in ./none)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^run.resume: must name a run or checkpoint directory"):
        load_config(["--preset", "smoke", *args])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, refused", [('""', True), ("none", True), ("null", False), ("~", False)])
def test_an_empty_resume_in_a_config_file_is_refused_and_yaml_null_is_no_resume(tmp_path, monkeypatch, text, refused):
    """In a --config file, ``resume: ""`` or the text ``none`` asks for a resume of nothing (refused, as on the
    command line); YAML's null is the absence of a resume (a saved config.yaml holds ``resume: null``)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(f"run:\n  resume: {text}\n")
    if refused:
        with pytest.raises(ConfigError, match=r"^run.resume: must name a run or checkpoint directory"):
            load_config(["--preset", "smoke", "--config", str(tmp_path / "c.yaml")])
    else:
        assert load_config(["--preset", "smoke", "--config", str(tmp_path / "c.yaml")]).run.resume is None


def test_a_new_runs_relative_out_is_saved_absolute(tmp_path, monkeypatch):
    """config.yaml is rendered before the run directory exists: run.out must still be saved absolute."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["--out", "runs/new"], check_environment=False).with_absolute_paths()
    assert cfg.run.out == str(tmp_path.resolve() / "runs" / "new") and not (tmp_path / "runs").exists()
