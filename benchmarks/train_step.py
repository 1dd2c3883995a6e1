"""Trainer step time with micro-batches ordered by length and cut to their longest sequence.

RL completions of one step vary in length by an order of magnitude (most end early, a few run to
``max_new_tokens``), and a collated batch is padded to its longest. The rows (same batch, same model,
same trainer settings, one process, measured alternately):

  padded   the previous behaviour: micro-batches of ``micro_batch_size`` rows in batch order, each at
           the batch's full width (``take_rows(trim=False)``)
  trimmed  the same micro-batches, each cut to its longest row (``trainer.length_grouping=false``)
  grouped  rows ordered by length first, then cut (the default)
  budget   grouped, with ``trainer.micro_batch_tokens`` = the costliest micro-batch of ``grouped``
           (the same peak activation size) instead of a row count: fewer, fuller micro-batches

Each row reports the padded positions the step's forwards run (``llamarl.micro_batches.positions``,
deterministic), the median step time (forward, backward, AdamW) and the speed-up over ``padded``, the
memory a step adds, and the largest difference of the updated weights from ``padded``'s after one step
from the same weights (the variants are exact up to float summation order).

    python -m benchmarks.train_step [--model small] [--prompts 4] [--samples 8] [--max-new-tokens 128]
    python -m benchmarks.train_step --device cuda --dtype bfloat16 --model llama-3.2-1b \
        --prompts 8 --samples 16 --max-new-tokens 1024 --median-new-tokens 200 --micro-batch-size 16
    python -m benchmarks.train_step --compute-dtype bfloat16 ...   (mixed precision over float32 weights)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Report, completion_length, measure, positive_int
from llamarl import micro_batches
from llamarl.config import TrainerConfig
from llamarl.executors import trainer as trainer_module
from llamarl.models import LLAMA_CONFIGS, Llama
from llamarl.rollouts import Rollout, collate
from llamarl.runtime import RankInfo


def make_batch(args, vocab: int) -> dict[str, torch.Tensor]:
    """``prompts`` x ``samples`` rollouts: prompt lengths uniform in [P/2, P], completion lengths
    lognormal (median ``median_new_tokens``, sigma 0.8) capped at ``max_new_tokens``."""
    g = torch.Generator().manual_seed(args.seed)
    rollouts = []
    for p in range(args.prompts):
        n_prompt = int(torch.randint(args.prompt_len // 2, args.prompt_len + 1, (), generator=g))
        prompt = torch.randint(3, vocab, (n_prompt,), generator=g).tolist()
        for s in range(args.samples):
            c = completion_length(args.median_new_tokens, args.max_new_tokens, g)
            completion = torch.randint(3, vocab, (c,), generator=g).tolist()
            logprobs = (-9.0 + 0.3 * torch.randn(c, generator=g)).tolist()
            rollouts.append(Rollout(f"p{p}s{s}", p, prompt, completion, logprobs, [0] * c, "", "length"))
    adv = torch.randn(len(rollouts), generator=g)
    return collate(rollouts, adv, 0, share_prompts=args.share_prompts)


def positions_run(batch: dict, cfg: dict, trim: bool) -> int:
    """Padded positions of every micro-batch of one step, as run (untrimmed: at the batch's full width)."""
    ext = micro_batches.extents(batch)
    parts = micro_batches.plan(batch, range(len(ext)), rows_per=cfg["micro_batch_size"], ext=ext,
                               token_budget=cfg["micro_batch_tokens"], by_length=cfg["length_grouping"])
    width = ext if trim else [batch["mask"].shape[1]] * len(ext)
    return sum(micro_batches.positions(batch, part, width) for part in parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(LLAMA_CONFIGS))
    p.add_argument("--prompts", type=positive_int, default=4)
    p.add_argument("--samples", type=positive_int, default=8)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--median-new-tokens", type=positive_int, default=24)
    p.add_argument("--micro-batch-size", type=positive_int, default=8)
    p.add_argument("--flat", dest="share_prompts", action="store_false",
                   help="one flat row per sample instead of the shared-prompt layout (trainer.share_prompts)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU; the trainer's loss is then the fused "
                                                   "kernel, trainer.loss=auto)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--compute-dtype", default=None, choices=("float32", "bfloat16"),
                   help="trainer.compute_dtype: bfloat16 over --dtype float32 is mixed precision (default: --dtype)")
    p.add_argument("--iters", type=positive_int, default=3)
    p.add_argument("--threads", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    config = LLAMA_CONFIGS[args.model]
    batch = make_batch(args, config.vocab_size)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    base = dataclasses.asdict(TrainerConfig(lr=1e-4, micro_batch_size=args.micro_batch_size, dtype=args.dtype,
                                            compute_dtype=args.compute_dtype, loss="auto"))
    grouped = dict(base, length_grouping=True)
    ext = micro_batches.extents(batch)
    parts = micro_batches.plan(batch, range(len(ext)), rows_per=args.micro_batch_size, ext=ext)
    budget = max(micro_batches.positions(batch, part) for part in parts)
    variants = {"padded": (dict(base, length_grouping=False), False),
                "trimmed": (dict(base, length_grouping=False), True),
                "grouped": (grouped, True),
                f"budget {budget}": (dict(grouped, micro_batch_tokens=budget), True)}

    report = Report("train_step", f"Trainer step: micro-batches by length ({args.model}, {device.type})")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        Llama(config).save_pretrained(Path(tmp) / "model")
        executors, first = {}, {}
        take_rows = trainer_module.take_rows
        for name, (cfg, trim) in variants.items():
            ex = trainer_module.TrainerExecutor(model_path=str(Path(tmp) / "model"), trainer=cfg, temperature=1.0,
                                                threads=args.threads,
                                                rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, str(device),
                                                                   "nccl" if device.type == "cuda" else "gloo"))
            executors[name] = (ex, trim)
            executors_fused = ex.fused
        try:
            def step(name):
                ex, trim = executors[name]
                trainer_module.take_rows = take_rows if trim else functools.partial(take_rows, trim=False)
                try:
                    return ex.train_step(batch)
                finally:
                    trainer_module.take_rows = take_rows

            for name in variants:  # one step from the same weights: the variants' updates agree
                step(name)
                first[name] = {n: t.detach().clone() for n, t in executors[name][0].model.named_parameters()}
            times, peak = {}, {}
            for _ in range(args.iters):  # alternately, so drift in the machine's speed hits every variant
                for name in variants:
                    m = measure(functools.partial(step, name), warmup=0, iters=1, device=device)
                    times.setdefault(name, []).append(m.median_s)
                    peak[name] = max(peak.get(name, 0), m.peak_mem_bytes)
        finally:
            for ex, _ in executors.values():
                ex.close()
    ref = sorted(times["padded"])[len(times["padded"]) // 2]
    for name, (cfg, trim) in variants.items():
        t = sorted(times[name])[len(times[name]) // 2]
        diff = max(float((first[name][n] - w).abs().max()) for n, w in first["padded"].items())
        report.add(variant=name, positions=positions_run(batch, cfg, trim), step_s=t, min_s=min(times[name]),
                   speedup_vs_padded=ref / t, peak_MiB=peak[name] / 2**20, max_weight_diff=diff)
    rows = batch["mask"].shape[0]
    report.note(f"batch: {args.prompts} prompts x {args.samples} samples = {rows} rows, "
                f"{'shared-prompt' if args.share_prompts else 'flat'} layout, prompt {args.prompt_len // 2}-"
                f"{args.prompt_len} tokens, completions lognormal (median {args.median_new_tokens}) capped at "
                f"{args.max_new_tokens}: {int(batch['mask'].sum())} trained tokens, widest completion {max(ext)}")
    report.note(f"model {args.model} ({sum(t.numel() for t in first['padded'].values()) / 1e6:.1f}M parameters, "
                f"{args.dtype}{', ' + args.compute_dtype + ' compute' if args.compute_dtype else ''}), "
                f"{'fused' if executors_fused else 'eager'} loss, AdamW lr 1e-4, "
                f"micro_batch_size {args.micro_batch_size}; "
                f"median of {args.iters} steps per variant, timed alternately; threads={torch.get_num_threads()}; "
                "peak_MiB: resident memory a step adds (the harness's sampled estimate, largest of the "
                "untimed steps measure runs after each timed one; CUDA: the allocator's peak above the step's start)")
    report.save()


if __name__ == "__main__":
    main()
