"""Asynchronous vs synchronous LlamaRL on the same configuration, in one run; and why AIPO matters.

Part 1 runs the embedded default (or ``--preset``) twice, identically except for the mode:
sync (``max_staleness=0``: generate → score → train → sync in lock step, the baseline) and async
(generator and trainer processes overlap; rollouts at most ``max_staleness`` versions old). It prints step
time, generated tokens/s and held-out accuracy for both, and the async/sync step-time ratio.

Part 2 (``--ablation``) trains at a high staleness twice: with AIPO's truncated importance weights and
without any correction (plain policy gradient on stale samples, ``trainer.correction=none``), and prints
reward, accuracy and the rollout/trainer mismatch (KL(μ‖π), mean ratio) of both.

Both parts share one warm start (cached), so the comparisons differ only in what they claim to.
    python -m benchmarks.async_vs_sync [--steps N] [--seeds N] [--ablation] [--staleness K]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness import Report, positive_int
from llamarl.config_cli import load_config
from llamarl.train import train


def run_one(args: list[str], out: Path) -> dict:
    summary = train(load_config(args + ["--out", str(out)]))
    rows = [r for r in _rows(out) if "event" not in r]
    steady = rows[2:] or rows  # the first steps include process warm-up
    return {**summary, "step_s_median": statistics.median(r["step_s"] for r in steady),
            "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in steady),
            "ratio_mean": statistics.fmean(r["ratio_mean"] for r in steady),
            "staleness_mean": statistics.fmean(r["staleness"] for r in steady),
            "reward_last": statistics.fmean(r["reward_mean"] for r in rows[-5:])}


def _rows(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="default")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run (default: the preset's)")
    p.add_argument("--staleness", type=int, default=1, help="max_staleness of the async run")
    p.add_argument("--seeds", type=positive_int, default=1,
                   help="repeat every run with run.seed = 0..N-1 (each seed has its own warm start): "
                        "accuracy differences between runs are only meaningful against this spread")
    p.add_argument("--ablation", action="store_true", help="also run the AIPO vs no-correction ablation")
    p.add_argument("--ablation-staleness", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="smoke-sized runs (seconds), for CI")
    args = p.parse_args(argv)
    base = ["--preset", "smoke" if args.quick else args.preset]
    if args.steps:
        base += ["--max-steps", str(args.steps)]
    report = Report("async_vs_sync", "LlamaRL: asynchronous vs synchronous training, same configuration")
    k = str(args.ablation_staleness)
    runs = [("sync", 0, []), ("async", args.staleness, [])]
    if args.ablation:
        runs += [(f"async, staleness<={k}, correction={corr}", int(k), ["--set", f"trainer.correction={corr}"])
                 for corr in ("aipo", "none")]
    results: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for i, (name, staleness, extra) in enumerate(runs):
                mode = "sync" if staleness == 0 else "async"
                r = run_one(base + ["--mode", mode, "--max-staleness", str(staleness), "--set", f"run.seed={seed}",
                                    *extra], Path(tmp) / f"s{seed}-{i}")
                results[name].append(r)
                report.add(run=name, seed=seed, max_staleness=staleness, step_s=r["step_s_median"],
                           tokens_per_s=r["tokens_per_s"], rl_s=r["rl_s"], acc_before=r["accuracy_before"],
                           acc_after=r["accuracy_after"], staleness_mean=r["staleness_mean"],
                           mismatch_kl=r["mismatch_kl"], reward_last5=r["reward_last"])
    ratios = [a["step_s_median"] / s["step_s_median"] for a, s in zip(results["async"], results["sync"])]
    report.note(f"async/sync median step time: {_spread(ratios, 'x')} over {args.seeds} seed(s) "
                "(target <= 0.6x on a 2-core CPU)")
    for name, rs in results.items():
        gain = [r["accuracy_after"] - r["accuracy_before"] for r in rs]
        report.note(f"{name}: accuracy after RL {_spread([r['accuracy_after'] for r in rs])}, "
                    f"gain over the warm start {_spread(gain)}")
    report.save()


def _spread(values: list[float], unit: str = "") -> str:
    """'mean (min-max)' of several runs, or the one value."""
    if len(values) == 1:
        return f"{values[0]:.3f}{unit}"
    return f"{statistics.fmean(values):.3f}{unit} (min {min(values):.3f}, max {max(values):.3f})"


if __name__ == "__main__":
    main()
