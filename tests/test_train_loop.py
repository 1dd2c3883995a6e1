"""The training loop end to end with real executor processes (smoke-sized): both modes, the staleness
bound, checkpoints and resume after a kill, executor failure, config rejection."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llamarl.algorithms import lr_at
from llamarl.config_cli import load_config
from llamarl.models import CharTokenizer, load_tokenizer
from llamarl.train import main, train
from test_train_inputs import assert_refused_before_start

SMOKE = ["--preset", "smoke", "--set", "warm_start.steps=3"]


def read_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" not in r], [r for r in rows if r.get("event") == "eval"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("mode, staleness, replicas", [("sync", 0, 1), ("async", 2, 1), ("async", 1, 2)])
def test_loop_runs_and_never_exceeds_the_staleness_bound(tmp_path, mode, staleness, replicas):
    out = tmp_path / "run"
    cfg = load_config(SMOKE + ["--out", str(out), "--mode", mode, "--max-staleness", str(staleness),
                               "--max-steps", "5", "--set", "run.checkpoint_every=2",
                               "--set", f"generator.replicas={replicas}", "--set", "run.log_samples=8"])
    summary = train(cfg)
    steps, evals = read_metrics(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4, 5]
    samples = read_samples(out)  # every sample of every step (run.log_samples=8)
    for r in steps:
        assert 0 <= r["staleness"] <= staleness
        # generated tokens (all samples) vs trained ones (zero-advantage samples are skipped)
        assert r["tokens"] == sum(x["tokens"] for x in samples if x["step"] == r["step"]) >= r["trained_tokens"]
        for key in ("reward_mean", "step_s", "sync_s", "ratio_mean", "truncated_frac", "mismatch_kl"):
            assert key in r
        assert 0 <= r["sync_wait_s"] <= r["sync_s"]
    if mode == "sync":
        # lock step: the generator always samples with the newest weights, so π = μ exactly
        assert all(r["staleness"] == 0 for r in steps)
        assert all(abs(r["ratio_mean"] - 1.0) < 1e-4 for r in steps)
    assert [e["step"] for e in evals] == [0, 5]
    assert summary["mode"] == mode and summary["steps"] == 5
    assert [r["step"] for r in samples] == [s for s in range(1, 6) for _ in range(cfg.run.log_samples)]
    for r in samples:
        assert r["sample_id"].endswith(("#0", "#1"))
        assert r["reward"] in (0.0, 1.0) and r["reward_error"] is None and "=" in r["prompt"]
        assert r["finish_reason"] in ("stop", "length") and 0 <= r["tokens"] <= cfg.generator.max_new_tokens
    for a, b in zip(samples[::2], samples[1::2]):  # one group: mean baseline, advantages differ by rewards
        assert a["advantage"] - b["advantage"] == pytest.approx(a["reward"] - b["reward"], abs=1e-6)
    written = json.loads((out / "summary.json").read_text())
    assert {"accuracy_before", "accuracy_after", "wall_s", "mode"} <= set(written)
    assert (out / "plot.png").stat().st_size > 0
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts[-1] == "step_000005"


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _executor_pid(root: int, name: str) -> int | None:
    """The process of rank 0 of executor group ``name`` under the controller ``root`` (a child, or a
    grandchild forked by the controller's fork server), found by the name it gives itself ("generator-0")."""
    for pid in _descendants(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == f"{name}-0":
                return pid
        except OSError:
            continue
    return None


def _start(args: list[str], tmp_path: Path, ignore_sigint: bool = False) -> subprocess.Popen:
    """The run as a subprocess in its own session, started as an interactive shell starts a command: no
    signal blocked, SIGINT at its default. (A child inherits ignored signals: run from a background job, as
    `pytest &` in a script, pytest itself has SIGINT ignored, and a Ctrl-C test would then test nothing but
    that.) ``ignore_sigint``: started with SIGINT ignored, as a background job of a shell script is."""
    env = dict(os.environ, LLAMARL_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        signal.signal(signal.SIGINT, signal.SIG_IGN if ignore_sigint else signal.SIG_DFL)

    return subprocess.Popen([sys.executable, "-m", "llamarl.train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, preexec_fn=setup)


def _wait_for(predicate, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"run exited early ({proc.returncode}):\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.2)


def test_resume_after_kill_continues_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    # slow the run down (many steps) so it can be killed mid-way, after its step-2 checkpoint
    schedule = ["--set", "trainer.lr_warmup_steps=3", "--set", "trainer.lr_schedule=linear"]
    proc = _start(SMOKE + schedule + ["--out", str(out), "--max-steps", "5000", "--set", "run.checkpoint_every=2"],
                  tmp_path)
    # any checkpoint from step 2 on: step_000002 itself may already be pruned (keep_checkpoints) when polled
    _wait_for(lambda: any(p.name.startswith("step_") and int(p.name[5:]) >= 2
                          for p in (out / "checkpoints").glob("step_*")), 180, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # the run may have got further than step 2 before the kill landed: resume from whatever it saved last
    saved = max(int(p.name[5:]) for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    target = saved + 4
    # keep one checkpoint: the one the run resumed from is pruned while it goes on
    cfg = load_config(["--resume", str(out), "--max-steps", str(target), "--set", "run.checkpoint_every=2",
                       "--set", "run.keep_checkpoints=1"])
    train(cfg)
    last, = (out / "checkpoints").glob("step_*")
    assert last.name == f"step_{target:06d}" and not (out / "checkpoints" / f"step_{saved:06d}").exists()
    assert isinstance(load_tokenizer(last / "policy"), CharTokenizer)  # its tokenizer survived the pruning
    steps, evals = read_metrics(out)
    # continues after the checkpoint, does not restart; the steps the killed run logged after its last
    # checkpoint are redone and logged once: metrics.jsonl is one history
    assert [r["step"] for r in steps] == list(range(1, target + 1))
    assert len({e["step"] for e in evals}) == len(evals)
    per_step = cfg.run.log_samples
    assert [r["step"] for r in read_samples(out)] == [s for s in range(1, target + 1) for _ in range(per_step)]
    assert steps[-1]["policy_version"] == target
    assert saved >= 2
    # the learning-rate schedule continues from the optimizer's restored step count (over the new horizon)
    trainer = dataclasses.asdict(cfg.trainer)
    assert trainer["lr_warmup_steps"] == 3 and trainer["lr_schedule"] == "linear"
    for r in steps[saved:]:
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, trainer, target), rel=1e-12), r["step"]


def _signal_the_generator_mid_run(tmp_path: Path, sig: int, args: list[str], timeout: float):
    """Start a long smoke run, send ``sig`` to its generator executor after two steps, and wait for the run
    to end: (process, its output, seconds from the signal to the end)."""
    out = tmp_path / "run"
    proc = _start(SMOKE + ["--out", str(out), "--max-steps", "100000", *args], tmp_path)
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and len(read_metrics(out)[0]) >= 2, 180, proc)
    victim = _executor_pid(proc.pid, "generator")
    assert victim is not None, "could not find the generator process"
    t0 = time.monotonic()
    os.kill(victim, sig)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, output, time.monotonic() - t0


def test_a_killed_executor_ends_the_run_with_its_name(tmp_path):
    proc, output, seconds = _signal_the_generator_mid_run(tmp_path, signal.SIGKILL, [], timeout=60)
    assert proc.returncode == 1, output
    assert seconds < 30
    assert "generator" in output and "executor failed" in output
    assert _descendants(proc.pid) == []


def test_a_hung_executor_ends_the_run_with_its_stacks(tmp_path):
    """A generator that stops answering (SIGSTOP: not dead, so nothing else would notice) mid-run: after
    run.command_timeout_s the run stops with exit 1, the message names the command and the setting."""
    proc, output, _ = _signal_the_generator_mid_run(tmp_path, signal.SIGSTOP, ["--set", "run.command_timeout_s=10"],
                                                    timeout=120)
    assert proc.returncode == 1, output
    assert "an executor hung" in output and "generate()" in output and "run.command_timeout_s=20" in output, output
    assert _descendants(proc.pid) == []


@pytest.mark.parametrize("overrides, field", [(["trainer.lr=-1"], "trainer.lr"),
                                              (["generator.quantization=int8", "generator.tp=2"],
                                               "generator.quantization"),
                                              (["generator.tp=3"], "generator.tp"),
                                              (["trainer.dtype=bfloat16"], "trainer.dtype"),
                                              (["generator.max_new_tokens=4096"], "generator.max_new_tokens"),
                                              (["warm_start.cache_dir=/proc/llamarl"], "warm_start.cache_dir")])
def test_bad_config_is_rejected_before_anything_starts(tmp_path, capsys, overrides, field):
    args = [a for o in overrides for a in ("--set", o)]
    assert main(args + ["--out", str(tmp_path / "r")]) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def _reward_module(tmp_path: Path, monkeypatch, name: str, source: str) -> None:
    """Write ``name.py`` into tmp_path, importable here and in the reward worker processes."""
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))


def test_a_failed_verifier_costs_its_sample_and_does_not_skew_its_group(tmp_path, monkeypatch):
    """Samples whose reward function raised are logged with their error and advantage 0; the advantages of
    their group are computed over the other samples only (mean baseline: r_i - mean of the valid r)."""
    _reward_module(tmp_path, monkeypatch, "flaky_reward",
                   "def reward(completion, answer):\n"
                   "    if len(completion) % 2:\n"
                   "        raise RuntimeError('verifier crashed')\n"
                   "    return float(len(completion) % 4 == 0)  # some 1s, some 0s: the baseline matters\n")
    out = tmp_path / "run"
    cfg = load_config(SMOKE + ["--out", str(out), "--max-steps", "3", "--reward", "flaky_reward:reward",
                               "--set", "generator.samples_per_prompt=4", "--set", "run.log_samples=16"])
    train(cfg)
    steps, _ = read_metrics(out)
    samples = read_samples(out)
    failed = [r for r in samples if r["reward_error"] is not None]
    assert failed and all("verifier crashed" in r["reward_error"] and r["advantage"] == 0.0 for r in failed)
    assert sum(r["reward_errors"] for r in steps) == len(failed)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_errors"] >= len(failed) and summary["reward_worker_deaths"] == 0
    assert any(r["reward"] == 1.0 for r in samples)
    for step in (1, 2, 3):
        rows = [r for r in samples if r["step"] == step]  # 4 prompts x 4 samples, prompt-major
        for group in (rows[g:g + 4] for g in range(0, 16, 4)):
            assert len({r["sample_id"].split("#")[0] for r in group}) == 1
            ok = [r for r in group if r["reward_error"] is None]
            mean = sum(r["reward"] for r in ok) / max(1, len(ok))
            for r in ok:
                assert r["advantage"] == pytest.approx(r["reward"] - mean, abs=1e-6)


def test_a_reward_function_that_always_fails_stops_the_run(tmp_path, capsys, monkeypatch):
    _reward_module(tmp_path, monkeypatch, "broken_reward",
                   "def reward(completion, answer):\n"
                   "    return {'score': 1.0}['scroe']  # a bug that only shows when called\n")
    out = tmp_path / "run"
    assert main(SMOKE + ["--out", str(out), "--max-steps", "50", "--reward", "broken_reward:reward",
                         "--set", "reward.max_failed_steps=2"]) == 1
    err = capsys.readouterr().err
    assert "failed on every sample of 2 steps in a row (steps 1-2)" in err and "KeyError" in err, err
    assert [r["step"] for r in read_metrics(out)[0]] in ([], [1])  # step 2 was scored, never trained


def test_reward_workers_that_cannot_start_end_the_run_with_one_line(tmp_path, capsys, monkeypatch):
    _reward_module(tmp_path, monkeypatch, "worker_refuses",
                   "import multiprocessing\n"
                   "if multiprocessing.parent_process() is not None:\n"
                   "    raise RuntimeError('no GPU driver in the worker')\n"
                   "def reward(completion, answer):\n"
                   "    return 1.0\n")
    assert main(SMOKE + ["--reward", "worker_refuses:reward", "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "llamarl.train: the reward workers failed, the run stopped" in err and "no GPU driver" in err
    assert "Traceback" not in err


def test_fused_loss_on_a_cpu_without_the_interpreter_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(SMOKE + ["--set", "trainer.loss=fused", "--device", "cpu", "--out", str(tmp_path / "r")]) == 2
    assert "trainer.loss: fused runs the Triton kernel" in capsys.readouterr().err


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_bad_data_and_model_files_are_rejected_before_anything_starts(tmp_path, capsys):
    """Dataset, model-config and tokenizer problems are configuration errors (exit 2, the file and line
    named, no run directory), not tracebacks from inside a started run."""
    ok = b'{"question": "1+1=", "answer": "2"}\n'
    from tokenizers import Tokenizer, models

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    from llamarl.models import LLAMA_CONFIGS, Llama, LlamaConfig

    small = tmp_path / "small_vocab"  # a 10-token model with a 40-token tokenizer
    Llama(LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=2)).save_pretrained(small)
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(40)}, unk_token="w0")).save(str(small / "tokenizer.json"))
    (small / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1", "bos_token": "w2"}))
    no_weights, cut = tmp_path / "no_weights", tmp_path / "truncated"
    for d in (no_weights, cut):
        Llama(LLAMA_CONFIGS["tiny"]).save_pretrained(d)
        CharTokenizer().save(d)
    (no_weights / "model.safetensors").unlink()
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 100])
    cases = [
        (["--dataset", _write(tmp_path / "bad.jsonl", ok * 2 + b'{"question": 1\n')],
         r"data.dataset: .*bad.jsonl:3: not valid JSON"),
        (["--dataset", _write(tmp_path / "latin1.jsonl", ok + b'{"question": "caf\xe9", "answer": "1"}\n')],
         r"data.dataset: .*latin1.jsonl:2: not UTF-8 text"),
        (["--dataset", _write(tmp_path / "nofield.jsonl", b'{"q": "1+1=", "answer": "2"}\n')],
         r"data.dataset: .*missing field 'question'.*data.prompt_field="),
        (["--dataset", _write(tmp_path / "small.jsonl", ok * 3)], r"data.dataset: .* has 3 usable samples"),
        (["--dataset", _write(tmp_path / "long.jsonl", b'{"question": "%s", "answer": "2"}\n' % (b"1" * 400))],
         r"data.dataset: .*every one of its 1 prompts is longer than"),
        (["--model", str(model)], r"policy.model: cannot read .*config.json"),
        (["--model", str(small)], r"policy.tokenizer: its token ids go up to 39 but the model's vocab_size is 10"),
        (["--model", str(no_weights)], r"policy.model: .*no_weights has neither model.safetensors"),
        (["--model", str(cut)], r"policy.model: .*truncated/model.safetensors is not a readable safetensors file"),
    ]
    assert_refused_before_start(cases, tmp_path, capsys)


def test_over_long_prompts_are_dropped_from_a_file_dataset(tmp_path):
    from llamarl.config import DataConfig
    from llamarl.models import CharTokenizer
    from llamarl.train_data import TrainData

    rows = [{"question": "1" * n, "answer": "1"} for n in (3, 50, 4, 60, 5, 6)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8-sig")  # with a BOM
    data = TrainData(DataConfig(dataset=str(path), eval_size=1), CharTokenizer(), max_prompt_tokens=20)
    assert data.dropped == 2
    seen = data.heldout + data.next(3)
    assert sorted(len(s.prompt) for s in seen) == [3, 4, 5, 6]


def test_an_edited_dataset_file_gets_its_own_warm_start(tmp_path):
    """The warm-start cache key holds the dataset file's contents, not only its path: editing the file must
    not serve weights trained on its old rows."""
    from llamarl.train import load_inputs, prepare_policy

    path = tmp_path / "sums.jsonl"
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(SMOKE + ["--dataset", str(path), "--set", "warm_start.steps=2"])
    first, info = prepare_policy(cfg, *load_inputs(cfg))
    assert info["cached"] is False
    again, info = prepare_policy(cfg, *load_inputs(cfg))
    assert info["cached"] is True and again == first
    path.write_text("".join(json.dumps({**r, "answer": r["answer"] + "0"}) + "\n" for r in rows))
    edited, info = prepare_policy(cfg, *load_inputs(cfg))
    assert info["cached"] is False and edited != first


def test_a_prompt_repeated_in_the_file_is_held_out_with_all_its_copies(tmp_path):
    from llamarl.config import DataConfig
    from llamarl.models import CharTokenizer
    from llamarl.train_data import TrainData

    rows = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(50)] * 2  # every prompt twice
    path = tmp_path / "dups.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = TrainData(DataConfig(dataset=str(path), eval_size=10), CharTokenizer(), seed=1)
    held = {s.prompt for s in data.heldout}
    train_prompts = {s.prompt for s in data.next(500)}
    assert len(data.heldout) == len(held) == 10 and not held & train_prompts and len(train_prompts) == 40
    unique = tmp_path / "unique.jsonl"  # without repeats the split is the plain seeded shuffle
    unique.write_text("".join(json.dumps(r) + "\n" for r in rows[:50]))
    import random
    order = list(range(50))
    random.Random("1:heldout").shuffle(order)
    data = TrainData(DataConfig(dataset=str(unique), eval_size=10), CharTokenizer(), seed=1)
    assert [s.prompt for s in data.heldout] == [rows[i]["question"] for i in order[:10]]


def test_forked_streams_keep_the_held_out_split_out(tmp_path):
    """The warm start's and the probe's streams (``fork``) draw from the run's training pool only: never a
    held-out sample, whatever their seed, and the run's own stream position is untouched."""
    from llamarl.config import DataConfig
    from llamarl.models import CharTokenizer
    from llamarl.train_data import TrainData

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(40)))
    data = TrainData(DataConfig(dataset=str(path), eval_size=10), CharTokenizer(), seed=3)
    first = data.next(5)
    held = {s.id for s in data.heldout}
    for seed in (4, 5, 99):
        fork = data.fork(seed)
        drawn = fork.next(60)  # two epochs of the 30-sample pool
        assert not held & {s.id for s in drawn} and len({s.id for s in drawn}) == 30
        assert fork.heldout is data.heldout
    assert data.cursor == 5 and data.next(0) == [] and data.fork(3).next(5) == first  # same seed, same order


def test_longest_prompt_bounds_every_prompt_of_the_run(tmp_path):
    """The generator's KV cache is sized from ``TrainData.longest_prompt``: exact for a file (after the
    over-long prompts are dropped), an upper bound for the synthetic task's prompts."""
    from llamarl.config import DataConfig
    from llamarl.models import CharTokenizer
    from llamarl.train_data import TrainData

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"question": "1" * n, "answer": "1"}) + "\n" for n in (3, 50, 9, 60, 5, 6)))
    data = TrainData(DataConfig(dataset=str(path), eval_size=1, template="Q: {prompt}\nA:"), CharTokenizer(),
                     max_prompt_tokens=30)
    longest = max(len(p) for p in data.encode(data.heldout + data.next(3)))
    assert data.longest_prompt == longest == 1 + len("Q: \nA:") + 9  # BOS, the template, the 9-char prompt
    for spec in ("synthetic:arithmetic", "synthetic:arithmetic:digits=4,n_terms=3,ops=+-*"):
        data = TrainData(DataConfig(dataset=spec, eval_size=64, template="Q: {prompt}\nA:"), CharTokenizer())
        lengths = [len(p) for p in data.encode(data.heldout + data.next(2000))]
        assert max(lengths) <= data.longest_prompt <= max(lengths) + 16


def test_generator_replicas_sample_with_different_seeds():
    """Each replica gets its own seed (one seed gave every replica the same random numbers), distinct from
    the seeds of the next steps; outputs come back in prompt-major order."""
    import asyncio

    from llamarl.config import TrainConfig
    from llamarl.controller import Controller, Executors
    from llamarl.generation import SamplingParams

    class Replica:
        def __init__(self, seconds):
            self.seeds, self.seconds = [], seconds

        async def acall(self, name, prompts, params):
            self.seeds.append(params.seed)
            return [{"samples": [{"prompt": p, "sample": j} for p in prompts for j in range(params.n)],
                     "seconds": self.seconds}]  # one TP rank

    replicas = [Replica(s) for s in (0.25, 1.5, 0.5)]
    ctrl = Controller(TrainConfig(), None, Executors(replicas, None, None), None, tokenizer=None)
    prompts = [[i] for i in range(7)]
    outs, seconds = asyncio.run(ctrl.generate(prompts, SamplingParams(n=2, seed=5)))
    assert [(o["prompt"], o["sample"]) for o in outs] == [([i], j) for i in range(7) for j in range(2)]
    assert seconds == 1.5  # the slowest replica's engine time
    seeds = [r.seeds[0] for r in replicas]
    assert seeds[0] == 5 and all(s > 5 + 10**6 for s in seeds[1:]) and len(set(seeds)) == 3  # steps use seed + step
    asyncio.run(ctrl.generate(prompts, dataclasses.replace(SamplingParams(n=2), seed=None)))
    assert [r.seeds[1] for r in replicas] == [None] * 3  # greedy evaluation: no seed to vary


RESUMABLE = ["--preset", "sync", "--set", "data.dataset=synthetic:arithmetic:digits=1", "--set", "warm_start.steps=30",
             "--set", "warm_start.batch_size=32", "--set", "warm_start.target_accuracy=0", "--set", "data.eval_size=8",
             "--set", "run.eval_every=0", "--set", "run.checkpoint_every=3"]  # rewards > 0 after 30 warm steps


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.endswith("_s")}  # wall times differ, nothing else may


def test_a_resumed_run_keeps_the_kl_reference_of_the_run_start(tmp_path):
    """kl_coef > 0: the reference is the starting policy, also after --resume from a checkpoint (not the
    checkpoint's weights), so a resumed sync run's KL and loss equal the uninterrupted run's."""
    args = RESUMABLE + ["--mode", "sync", "--set", "run.checkpoint_every=2", "--set", "trainer.kl_coef=0.5"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(load_config(args + ["--max-steps", "4", "--out", str(whole)]))
    train(load_config(args + ["--max-steps", "2", "--out", str(cut)]))
    train(load_config(["--resume", str(cut), "--max-steps", "4"]))
    a, b = read_metrics(whole)[0], read_metrics(cut)[0]
    assert a[2]["kl_ref"] > 0
    assert [(r["kl_ref"], r["loss"]) for r in b] == [(r["kl_ref"], r["loss"]) for r in a]


@pytest.mark.slow
def test_a_resumed_run_continues_exactly_like_the_uninterrupted_one(tmp_path):
    """Stop after the step-3 checkpoint and resume to step 6: sync mode gives the uninterrupted run's
    metrics and weights exactly. In async mode the step after a checkpoint samples with the checkpointed
    weights in both runs (staleness 0), so it too is the same; later steps may see other versions, as
    timing decides when the generator picks up the newest weights."""
    from safetensors.torch import load_file

    flaky = tmp_path / "flaky.py"  # an extra reward term that fails on a fixed fifth of the training samples
    flaky.write_text("import zlib\n\ndef some_fail(completion, answer, sample_id):\n"
                     "    if zlib.crc32(sample_id.encode()) % 5 == 0:\n        raise ValueError(sample_id)\n"
                     "    return 0.0\n")
    for mode in ("sync", "async"):
        args = RESUMABLE + ["--mode", mode, "--set", f"reward.extra=[{flaky}:some_fail]"] + (
            ["--max-staleness", "1"] if mode == "async" else [])
        whole, cut = tmp_path / f"{mode}-whole", tmp_path / f"{mode}-cut"
        train(load_config(args + ["--max-steps", "6", "--out", str(whole)]))
        train(load_config(args + ["--max-steps", "3", "--out", str(cut)]))
        train(load_config(["--resume", str(cut), "--max-steps", "6"]))
        a, b = read_metrics(whole)[0], read_metrics(cut)[0]
        assert [r["step"] for r in a] == [1, 2, 3, 4, 5, 6] == [r["step"] for r in b]
        assert a[0]["reward_mean"] > 0 and a[0]["grad_norm"] > 0  # the weights really move
        same = 6 if mode == "sync" else 4
        assert [_deterministic(r) for r in b[:same]] == [_deterministic(r) for r in a[:same]], mode
        summaries = [json.loads((d / "summary.json").read_text()) for d in (whole, cut)]
        for key in ("steps", "accuracy_before", "skipped_updates", "max_staleness_seen", "reward_errors"):
            assert summaries[1][key] == summaries[0][key], (mode, key)  # the whole run's
        assert summaries[0]["reward_errors"] == sum(r["reward_errors"] for r in a) > 0
        assert summaries[1]["resumed_from_step"] == 3 and summaries[0]["resumed_from_step"] is None
        if mode == "async":
            assert a[3]["staleness"] == b[3]["staleness"] == 0
            assert all(r["staleness"] <= 1 for r in a + b)
        else:
            final = [load_file(d / "checkpoints" / "step_000006" / "policy" / "model.safetensors") for d in (whole, cut)]
            assert final[0].keys() == final[1].keys()
            assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_a_resumed_run_with_dynamic_sampling_draws_the_same_prompts(tmp_path):
    """Dynamic sampling draws a varying number of batches per step, one after another: a resumed sync run
    still repeats the uninterrupted one exactly (a step's checkpoint records the data position after its
    last batch). The cut run resumes from its step-3 checkpoint written mid-run, not from its final one."""
    import shutil

    args = RESUMABLE + ["--mode", "sync", "--set", "generator.dynamic_sampling=true",
                        "--set", "generator.prompts_per_step=4", "--set", "generator.max_sample_batches=3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    train(load_config(args + ["--max-steps", "6", "--out", str(whole)]))
    train(load_config(args + ["--max-steps", "4", "--out", str(cut)]))
    shutil.rmtree(cut / "checkpoints" / "step_000004")  # as if the run had died during step 4
    train(load_config(["--resume", str(cut), "--max-steps", "6"]))
    a, b = read_metrics(whole)[0], read_metrics(cut)[0]
    assert [_deterministic(r) for r in b] == [_deterministic(r) for r in a]
    assert a[2]["sample_batches"] > 1  # the step before the checkpoint drew extra batches


def test_an_unwritable_run_directory_is_refused_before_anything_starts(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(SMOKE + ["--out", str(tmp_path / "file" / "run")]) == 2
    assert "run.out: cannot write the run directory" in capsys.readouterr().err


def test_chat_formatted_training_prompts(tmp_path):
    """data.chat renders every training and held-out prompt with the tokenizer's chat template (one user
    turn after data.template, data.system as a system message), and a run trains on them."""
    from llamarl.config import DataConfig
    from llamarl.data import Sample
    from llamarl.models import CharTokenizer
    from llamarl.train_data import TrainData

    tok = CharTokenizer()
    cfg = DataConfig(template="Solve: {prompt}", chat=True, system="Be brief.", eval_size=8)
    data = TrainData(cfg, tok)
    sample = data.heldout[0]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Solve: {sample.prompt}"}]
    assert data.formatter.render(sample) == tok.apply_chat_template(messages, add_generation_prompt=True)
    assert data.encode([sample])[0] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    assert max(len(p) for p in data.encode(data.heldout + data.next(500))) <= data.longest_prompt
    assert data.formatter.render(Sample("x", "1+1=", "2")) != TrainData(DataConfig(eval_size=8), tok).formatter.render(
        Sample("x", "1+1=", "2"))
    out = tmp_path / "run"
    assert main(SMOKE + ["--set", "data.chat=true", "--max-steps", "2", "--out", str(out)]) == 0
    assert [r["step"] for r in read_metrics(out)[0]] == [1, 2]
