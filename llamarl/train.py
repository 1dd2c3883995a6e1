"""``python -m llamarl.train``: asynchronous AIPO training, end to end, in real processes.

With no arguments it runs the embedded default: the built-in tiny Llama (char-level) on the built-in
arithmetic task — a cached supervised warm start, then asynchronous RL with one generator process, one
trainer process and reward worker processes, weights moving trainer → generator through shared memory.

    python -m llamarl.train [--preset NAME] [--config FILE.yaml] [--out DIR] [--max-steps N]
                            [--mode async|sync] [--max-staleness K] [--model HF_DIR] [--dataset FILE]
                            [--reward NAME|module:function] [--resume DIR] [--set section.key=value ...]

Outputs in the run directory (``--out``, default ``runs/<timestamp>``): config.yaml, metrics.jsonl (one
object per step), summary.json (held-out accuracy before/after RL, wall time, mode, ...), plot.png
(reward and accuracy against step), checkpoints/ (atomic; ``--resume DIR`` continues from the newest).
Exit status: 0 on success, 2 for a bad configuration (nothing started), 1 when an executor failed (the
message names it and carries the remote error; the last checkpoint stays intact).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from llamarl.checkpoint import load_latest
from llamarl.config import ConfigError, TrainConfig, load_config
from llamarl.controller import Controller, Executors
from llamarl.eval import evaluate
from llamarl.models import CharTokenizer, Llama, LLAMA_CONFIGS, load_tokenizer
from llamarl.rewards import RewardPool, load_reward
from llamarl.runlog import RunLog, summary_table
from llamarl.runtime import ExecutorError, RewardSpec, run
from llamarl.train_data import TrainData
from llamarl.warmstart import cache_key, default_cache_dir, save_atomic, train_supervised


def log(msg: str) -> None:
    print(f"[llamarl] {msg}", file=sys.stderr, flush=True)


def prepare_policy(cfg: TrainConfig, tokenizer) -> tuple[Path, dict]:
    """The HF directory the trainer starts from: a given checkpoint, or the (cached) warm start."""
    if cfg.policy.model not in LLAMA_CONFIGS:
        return Path(cfg.policy.model), {"cached": None, "seconds": 0.0}
    ws = cfg.warm_start
    model_cfg = LLAMA_CONFIGS[cfg.policy.model]
    # everything the warm-started weights depend on (the probe uses the reward and the generation length)
    key = cache_key("warmstart-v1", model_cfg.to_hf_dict(), dataclasses.replace(ws, cache_dir=None), cfg.data,
                    cfg.run.seed, cfg.reward.reward, cfg.generator.max_new_tokens)
    path = (Path(ws.cache_dir) if ws.cache_dir else default_cache_dir()) / f"{cfg.policy.model}-{key}"
    if (path / "warmstart.json").is_file():
        info = json.loads((path / "warmstart.json").read_text())
        log(f"warm start: cached at {path} (trained {info['steps']} steps, loss {info['loss']:.3f})")
        return path, {**info, "cached": True, "seconds": 0.0}
    torch.manual_seed(cfg.run.seed)
    model = Llama(model_cfg)
    stream = TrainData(cfg.data, tokenizer, seed=cfg.run.seed + 1)  # its own stream: RL data stays untouched
    log(f"warm start: {ws.steps} supervised steps on {cfg.data.dataset} ({model.num_parameters() / 1e6:.2f}M params)")
    probe_samples = TrainData(cfg.data, tokenizer, seed=cfg.run.seed + 2).next(128)
    reward_fn = load_reward(cfg.reward.reward)

    def probe() -> float:  # greedy accuracy on training problems (never the held-out split)
        return evaluate(model, tokenizer, probe_samples, reward_fn, max_new_tokens=cfg.generator.max_new_tokens,
                        batch_size=len(probe_samples), fmt=stream.formatter.fmt).accuracy

    info = train_supervised(model, stream.next, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size,
                            encode_prompt=stream.formatter.encode, encode_answer=tokenizer.encode,
                            eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, log=log, probe=probe,
                            target_accuracy=ws.target_accuracy)
    save_atomic(model, tokenizer, path, info)
    return path, {**info, "cached": False}


def _dump_tasks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every asyncio task's stack: what the controller is waiting for."""
    import asyncio
    import signal

    def dump() -> None:
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)


def make_tokenizer(cfg: TrainConfig):
    if cfg.policy.tokenizer:
        return load_tokenizer(cfg.policy.tokenizer)
    if cfg.policy.model in LLAMA_CONFIGS:
        return CharTokenizer()
    return load_tokenizer(cfg.policy.model)


def check_supported(cfg: TrainConfig) -> None:
    """Settings the config accepts but this training loop does not run yet: refuse them up front."""
    missing = {
        "generator.quantization": (cfg.generator.quantization != "none",
                                   "int8/fp8 generators work in the generation engine and `python -m "
                                   "llamarl.eval`, but quantize-on-sync into the training loop's generator is "
                                   "not wired yet; use generator.quantization=none"),
        "generator.tp": (cfg.generator.tp != 1, "tensor-parallel generators exist (llamarl.parallel) but are "
                         "not wired into the training loop yet; use generator.tp=1 (and more replicas)"),
        "trainer.ranks": (cfg.trainer.ranks != 1, "the FSDP2 trainer exists (llamarl.parallel) but is not "
                          "wired into the training loop yet; use trainer.ranks=1"),
    }
    for field, (bad, why) in missing.items():
        if bad:
            raise ConfigError(f"{field}: {why}")


def train(cfg: TrainConfig) -> dict:
    check_supported(cfg)
    t_start = time.perf_counter()
    out = Path(cfg.run.out) if cfg.run.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    cfg.save(out)
    resume = load_latest(cfg.run.resume) if cfg.run.resume else None
    tokenizer = make_tokenizer(cfg)
    data = TrainData(cfg.data, tokenizer, seed=cfg.run.seed, cursor=resume.data_cursor if resume else 0)
    if resume:
        policy_dir, warm = resume.policy_dir, {"cached": None, "seconds": 0.0}
        log(f"resuming from {resume.path} (step {resume.step}, policy version {resume.policy_version})")
    else:
        policy_dir, warm = prepare_policy(cfg, tokenizer)
    model_config = json.loads((Path(policy_dir) / "config.json").read_text())
    start_step = resume.step if resume else 0
    start_version = resume.policy_version if resume else 0
    g, threads = cfg.generator, max(1, (os.cpu_count() or 2) // 2)
    layout = dataclasses.replace(cfg.layout(), reward=RewardSpec(0))  # rewards: RewardPool worker processes

    async def main(rt) -> dict:
        _dump_tasks_on_sigusr1()
        gens = rt.spawn_role("generator", "llamarl.executors.generator:GeneratorExecutor", init_kwargs=dict(
            model_config=model_config, dtype=cfg.policy.dtype, trainer_ranks=cfg.trainer.ranks,
            replicas=g.replicas, max_batch_size=max(g.prompts_per_step * g.samples_per_prompt, cfg.data.eval_size),
            pad_id=tokenizer.pad_id, threads=threads), env={"LLAMARL_EXECUTOR": "generator"})
        handles = [(await grp.acall("handle"))[0] for grp in gens]
        trainer, = rt.spawn_role("trainer", "llamarl.executors.trainer:TrainerExecutor", init_kwargs=dict(
            model_path=str(policy_dir), trainer=dataclasses.asdict(cfg.trainer), temperature=g.temperature,
            generator_handles=handles, generator_replicas=g.replicas,
            resume=str(resume.path) if resume else None, seed=cfg.run.seed, threads=threads),
            env={"LLAMARL_EXECUTOR": "trainer"})
        await trainer.acall("push_weights", start_version)
        runlog = RunLog(out, cfg.run.max_steps, initial_step=start_step)

        async def checkpoint(step: int, version: int, cursor: int) -> None:
            await trainer.acall("save_checkpoint", str(out), step, version, cursor, cfg.run.keep_checkpoints)

        with RewardPool(cfg.reward.reward, num_workers=max(1, cfg.reward.workers),
                        timeout_s=cfg.reward.timeout_s) as pool:
            ctrl = Controller(cfg, data, Executors(gens, trainer, pool), runlog, tokenizer=tokenizer,
                              start_step=start_step, start_version=start_version, on_checkpoint=checkpoint)
            try:
                before = await ctrl.evaluate(start_step)
                t_rl = time.perf_counter()
                await ctrl.run()
                rl_s = time.perf_counter() - t_rl
                after = await ctrl.evaluate(cfg.run.max_steps)
                await checkpoint(cfg.run.max_steps, ctrl.version, data.cursor)
            finally:
                runlog.close()
            reward_stats = pool.stats
        rows = runlog.rows
        plot = runlog.plot(out / "plot.png")
        return {
            "mode": cfg.run.mode, "max_staleness": cfg.run.max_staleness, "steps": len(rows),
            "accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
            "eval_size": len(data.heldout), "rl_s": rl_s, "warm_start_s": warm.get("seconds", 0.0),
            "warm_start_cached": warm.get("cached"),
            "step_s_mean": sum(r["step_s"] for r in rows) / max(1, len(rows)),
            "sync_s_mean": sum(r["sync_s"] for r in rows) / max(1, len(rows)),
            "max_staleness_seen": max((r["staleness"] for r in rows), default=0),
            "tokens_per_s": sum(r["tokens"] for r in rows) / max(1e-9, sum(r["generate_s"] for r in rows)),
            "reward_errors": reward_stats.errors, "reward_timeouts": reward_stats.timeouts,
            "skipped_updates": sum(not r["applied"] for r in rows), "policy_version": ctrl.version,
            "plot": str(plot) if plot else None, "out": str(out),
        }

    summary = run(layout, main)
    summary["wall_s"] = time.perf_counter() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
        check_supported(cfg)
    except ConfigError as e:
        print(f"llamarl.train: invalid configuration: {e}", file=sys.stderr)
        return 2
    try:
        summary = train(cfg)
    except ExecutorError as e:
        print(f"llamarl.train: an executor failed, the run stopped: {e}", file=sys.stderr)
        return 1
    print("\nllamarl run summary\n" + summary_table(summary) + f"\n  outputs in {summary['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
