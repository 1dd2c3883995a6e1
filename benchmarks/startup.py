"""Executor start-up: ranks spawned (the baseline) vs forked from the preloaded fork server.

CPU executor ranks fork from a server that imported torch and the executors once
(llamarl.runtime.starting); ``LLAMARL_START_METHOD=spawn`` starts every rank as a fresh interpreter
instead, as before. Three measures, each with both methods in this one process:

1. a group of ``--ranks`` toy ranks, from ``ExecutorGroup.spawn`` until every rank has answered a command
   that uses torch (the server is already up: the warm-up run started it);
2. whole smoke runs inside this process (``train()``: ``--steps`` steps, the warm start cached), as a
   program or a test suite that trains several times sees them;
3. the same run from the shell (``python -m llamarl.train``: a fresh controller, which starts its own
   server), as a user sees it.

Each measure is repeated ``--repeats`` times after one more, the first (``first_s``), which the
median leaves out.

    python -m benchmarks.startup [--repeats N] [--ranks R] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import Report, positive_int
from llamarl.config_cli import load_config
from llamarl.runtime import ExecutorGroup
from llamarl.train import train

METHODS = ("spawn", "forkserver")  # the baseline first


def start_group(ranks: int) -> float:
    t0 = time.perf_counter()
    with ExecutorGroup.spawn("startup", "llamarl.runtime.testing:ToyExecutor", ranks, start_timeout_s=300) as g:
        g.call("info_dict").result(timeout=300)  # imports torch in a rank that has not yet
        return time.perf_counter() - t0


def smoke_args(steps: int) -> list[str]:
    return ["--preset", "smoke", "--max-steps", str(steps), "--set", "run.log_samples=0"]


def run_in_process(steps: int, out: Path) -> float:
    t0 = time.perf_counter()
    train(load_config(smoke_args(steps) + ["--out", str(out)]))
    return time.perf_counter() - t0


def run_from_shell(steps: int, out: Path, method: str) -> float:
    env = dict(os.environ, LLAMARL_START_METHOD=method)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "llamarl.train", *smoke_args(steps), "--out", str(out)], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--ranks", type=positive_int, default=2)
    p.add_argument("--steps", type=positive_int, default=2)
    args = p.parse_args(argv)
    report = Report("startup", "Executor start-up: spawned ranks vs ranks forked from the preloaded server")
    medians: dict[tuple[str, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LLAMARL_CACHE_DIR"] = os.environ.get("LLAMARL_CACHE_DIR", str(Path(tmp) / "cache"))
        run_in_process(args.steps, Path(tmp) / "warm")  # the warm start, cached for every run below
        for what, measure in (
                ("group of toy ranks", lambda m, i: start_group(args.ranks)),
                ("smoke run in-process", lambda m, i: run_in_process(args.steps, Path(tmp) / f"{m}-{i}")),
                ("smoke run from the shell", lambda m, i: run_from_shell(args.steps, Path(tmp) / f"sh-{m}-{i}", m))):
            for method in METHODS:
                os.environ["LLAMARL_START_METHOD"] = method
                times = [measure(method, i) for i in range(args.repeats + 1)]
                first, rest = times[0], times[1:]
                medians[what, method] = statistics.median(rest)
                report.add(measure=what, method=method, first_s=first, median_s=medians[what, method],
                           min_s=min(rest), max_s=max(rest), repeats=args.repeats)
        os.environ.pop("LLAMARL_START_METHOD", None)
    for what in ("group of toy ranks", "smoke run in-process", "smoke run from the shell"):
        ratio = medians[what, "forkserver"] / medians[what, "spawn"]
        report.note(f"{what}: forked/spawned median wall time {ratio:.2f}x "
                    f"({medians[what, 'forkserver']:.2f} s vs {medians[what, 'spawn']:.2f} s)")
    report.save()


if __name__ == "__main__":
    main()
