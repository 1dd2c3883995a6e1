"""``python -m llamarl.train``: asynchronous AIPO training, end to end, in real processes.

With no arguments it runs the embedded default: the built-in tiny Llama (char-level) on the built-in
arithmetic task — a cached supervised warm start, then asynchronous RL with one generator process, one
trainer process and reward worker processes, weights moving trainer → generator through shared memory.

    python -m llamarl.train [--preset NAME] [--config FILE.yaml] [--out DIR] [--max-steps N]
                            [--mode async|sync] [--max-staleness K] [--model HF_DIR] [--dataset FILE]
                            [--reward NAME|module:function] [--resume DIR] [--set section.key=value ...]

Scale-out: ``--set trainer.ranks=R_t`` shards the trainer over R_t processes (FSDP2),
``--set generator.tp=R_g`` makes each generator replica tensor parallel over R_g processes (R_g must divide
the model's attention and key/value heads), ``--set generator.replicas=D`` runs D replicas. Locally every
executor rank is a process of its own (llamarl.runtime.starting); under torchrun every process is one
executor rank of the same layout and rank 0 also runs the controller (with its executor rank in a child
process), so the job takes R_t + R_g*D processes, or 1 + R_t + R_g*D to give the controller a rank of
its own (reward workers are processes of the controller and take no rank)::

    # 2 trainer ranks + 2 generator (TP) ranks; the controller shares rank 0
    torchrun --standalone --nproc-per-node 4 -m llamarl.train --set trainer.ranks=2 --set generator.tp=2

Outputs in the run directory (``--out``, default ``runs/<timestamp>``): config.yaml, metrics.jsonl (one
object per step, and the evaluations), samples.jsonl (decoded completions), summary.json (held-out accuracy
before/after RL, wall time, mode, ...), plot.png (reward and accuracy against step), checkpoints/ (atomic;
``--resume DIR`` continues from the newest), .lock (the live run's pid: a second run on the same directory is
refused, exit 2). A run resumed from an older checkpoint cuts the newer checkpoints and the logs back to it when
it starts, and keeps the earlier segment's summary.json and plot.png (and config.yaml, if its settings differ)
as summary.prev.json, plot.prev.png and config.prev.yaml (llamarl.runlog.claim_run_dir).
Exit status: 0 on success, 2 for a bad configuration (nothing started), 1 when an executor failed or hung,
or the reward workers failed (e.g. could not start), or the reward function failed on every sample of
``reward.max_failed_steps`` steps in a row (the message names what failed and carries its error; the last
checkpoint stays intact), 130 after Ctrl-C and 143 after SIGTERM (executors shut down, the last checkpoint
intact).

This module stays light (no torch) until the run starts: ``main`` parses the command line, starts the
fork server of the CPU executor ranks so that it imports torch alongside this process, then runs
llamarl.training. Its API (``train``, ``prepare_policy``, ``load_inputs``, ``check_supported``, ...) is
importable from here too and loads llamarl.training on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys

# python -m llamarl.train: the SIGINT/SIGTERM handlers replaced while the imports below run, and the signals seen
_EARLY: dict = {"seen": []}


def _record_early_signals() -> None:
    """A Ctrl-C or SIGTERM that lands while this module imports (0.3 s; seconds on a loaded machine) is
    recorded, not raised inside an import (a KeyboardInterrupt traceback from the stdlib, or death by SIGTERM
    that leaves the fork server's directory behind); ``main`` puts the handlers back and stops cleanly. A
    signal ignored by the parent (a background job's SIGINT) stays ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous = signal.getsignal(sig)
        if previous is not signal.SIG_IGN:
            _EARLY[sig] = previous
            signal.signal(sig, lambda signum, frame: _EARLY["seen"].append(signum))


def _early_signals() -> list[int]:
    """Restore the handlers ``_record_early_signals`` replaced; the signals that came meanwhile."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig in _EARLY:
            signal.signal(sig, _EARLY.pop(sig))
    return list(_EARLY["seen"])


if __name__ == "__main__":
    _record_early_signals()

# (imported after the handlers above are in place)
from llamarl.config import ConfigError, TrainConfig
from llamarl.config_cli import load_config
from llamarl.executors import MODULES as EXECUTOR_MODULES
from llamarl.rewards import RewardPoolError
from llamarl.runtime import ExecutorError, ExecutorHung, TorchrunEnv, starting

# llamarl.training's names, loaded on first use (PEP 562)
_API = ("train", "prepare_policy", "load_inputs", "check_supported", "executor_layout", "default_out",
        "make_tokenizer", "model_config_dict", "log")


def __getattr__(name: str):
    if name in _API:
        from llamarl import training

        return getattr(training, name)
    raise AttributeError(f"module 'llamarl.train' has no attribute {name!r}")


def _config_error(e: ConfigError) -> int:
    tr = TorchrunEnv.detect()
    if tr is None or tr.rank == 0:  # under torchrun every rank refuses; one message is enough
        print(f"llamarl.train: invalid configuration: {e}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def _sigterm_as_ctrl_c():
    """SIGTERM stops the run the way Ctrl-C does (executors shut down, the last checkpoint intact): the
    handler raises SIGINT, which the event loop turns into cancelling the run. Yields a list that records
    whether it happened."""
    terminated: list[int] = []

    def on_sigterm(signum, frame):
        terminated.append(signum)
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
            # started with SIGINT ignored (a background job of a script): SIGTERM must still stop the run
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.raise_signal(signal.SIGINT)

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield terminated
        return
    try:
        yield terminated
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    early = _early_signals()  # those that came while the module imported (python -m llamarl.train)
    tr = TorchrunEnv.detect()
    if tr is not None and tr.rank != 0:  # a torchrun executor rank: torchrun's SIGTERM simply ends it
        return 128 + early[0] if early else _main(argv, tr, [], None)
    # from the first moment (reading the config, importing torch, starting the fork server): Ctrl-C and
    # SIGTERM end the process with its message and status, never a traceback or an uncleaned exit
    with _sigterm_as_ctrl_c() as terminated:
        out: list[str] = []  # the run directory, once known
        try:
            if early:
                terminated.extend(s for s in early if s == signal.SIGTERM)
                raise KeyboardInterrupt
            return _main(argv, tr, out, terminated)
        except KeyboardInterrupt:
            what, status = ("terminated (SIGTERM)", 143) if terminated else ("interrupted", 130)
            where = _where_it_stands(out[0]) if out else "the run had not started; nothing was written"
            print(f"llamarl.train: {what}; {where}", file=sys.stderr)
            return status


def _main(argv: list[str] | None, tr: TorchrunEnv | None, out: list[str], terminated: list[int] | None) -> int:
    with _ctrl_c_between_steps(terminated) as between:
        try:
            cfg = load_config(argv)
        except ConfigError as e:
            return _config_error(e)
        between()
        if tr is None and not _may_use_a_gpu(cfg):
            starting.warm(EXECUTOR_MODULES)  # before this process spends seconds importing torch: in parallel
        from llamarl import training

        between()
        try:
            training.check_supported(cfg)
        except ConfigError as e:
            return _config_error(e)
        if cfg.run.out is None and not (tr is not None and tr.rank != 0):  # known now: an interrupted run says
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out=str(training.default_out())))
        out.append(cfg.run.out)
    return _run_main(cfg)


@contextlib.contextmanager
def _ctrl_c_between_steps(terminated: list[int] | None):
    """While the run starts (reading the config, importing torch), a Ctrl-C (or a SIGTERM, which raises one)
    is recorded and raised as KeyboardInterrupt between those steps (``between()``) or when the block ends,
    never inside one: an interrupt that lands in a library's import can be swallowed there and leave the
    module half-imported (numpy.linalg then recursed until a RecursionError). The torch import delays it by
    seconds at most. ``terminated`` None (a torchrun executor rank): SIGINT is left alone."""
    pending: list[int] = []

    def between() -> None:
        if pending:
            raise KeyboardInterrupt

    if terminated is None:
        yield between
        return
    try:
        previous = signal.getsignal(signal.SIGINT)
        ignored = previous == signal.SIG_IGN  # (a background job: only SIGTERM's own SIGINT counts)
        signal.signal(signal.SIGINT, lambda signum, frame: None if ignored and not terminated else
                      pending.append(signum))
    except ValueError:  # not the main thread
        yield between
        return
    try:
        yield between
    finally:
        signal.signal(signal.SIGINT, previous)
    between()


def _may_use_a_gpu(cfg: TrainConfig) -> bool:
    """Whether the executors may land on a GPU, judged without importing torch (only for starting the fork
    server early; llamarl.training decides with torch, and a wrong guess costs time, never correctness):
    ``run.device`` cpu or cuda, else whether an NVIDIA or AMD GPU driver is visible to this process."""
    if cfg.run.device != "auto":
        return cfg.run.device != "cpu"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


def _where_it_stands(out: str) -> str:
    from llamarl.checkpoint import latest_checkpoint_dir

    if latest_checkpoint_dir(out) is not None:
        return f"the last checkpoint is intact (continue with --resume {out} --max-steps N)"
    return f"it wrote no checkpoint yet, so there is nothing to resume; start again (delete {out} or use a new --out)"


def _run_main(cfg: TrainConfig) -> int:
    from llamarl.runlog import summary_table
    from llamarl.training import train

    try:
        summary = train(cfg)
    except ConfigError as e:  # train() raises it only before it writes or starts anything
        return _config_error(e)
    except ExecutorHung as e:
        print(f"llamarl.train: an executor hung, the run stopped: {e}. If commands this long are expected "
              f"(a large model, a slow first step), raise --set run.command_timeout_s={2 * e.timeout_s:g} "
              "(0: no limit)", file=sys.stderr)
        return 1
    except ExecutorError as e:
        print(f"llamarl.train: an executor failed, the run stopped: {e}", file=sys.stderr)
        return 1
    except RewardPoolError as e:  # e.g. no reward worker can start: the reward function fails to load there
        who = "the reward workers" if cfg.reward.specs else "the reward model"  # (reward.reward=none: no workers)
        print(f"llamarl.train: {who} failed, the run stopped: {e}", file=sys.stderr)
        return 1
    print("\nllamarl run summary\n" + summary_table(summary) + f"\n  outputs in {summary['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
