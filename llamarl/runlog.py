"""What a training run leaves behind: metrics.jsonl, samples.jsonl, summary.json, a plot, a progress bar,
a summary table.

``metrics.jsonl`` has one JSON object per training step with at least: step, policy_version, staleness
(trainer version minus the oldest version among the batch's tokens), reward_mean, step_s (wall time since
the previous step ended), sync_s (weight sync time after the step; sync_wait_s of it waiting for a slot that a
generation batch still reads, with run.max_staleness >= 2), and the AIPO metrics of the update
(ratio_mean, ratio_max, truncated_frac, mismatch_kl, ...). Evaluation rows are separate objects with
``"event": "eval"``. ``samples.jsonl`` holds a few decoded completions of each step (``run.log_samples``:
prompt, completion, answer, reward, advantage, ...), to read what the policy actually writes. Each line is
written whole or not at all (a failed write, e.g. a full disk, is cut back), so a crashed run keeps
everything up to its last step. A resumed run (``initial_step`` = the checkpoint's step) first drops what
the interrupted run logged after that checkpoint (steps after it, and evaluations from it on, which the
resumed run redoes) and any torn last line, in both files: each stays one history. The kept rows are
loaded back (``rows``, ``evals``), so the plot and the run summary cover the whole run, not the last part.

``claim_run_dir`` is how a run takes its directory: one live run per directory (an flock on ``.lock``), and
for a resumed run the checkpoints, logs, summary and config cut back to the resumed step when it starts.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from llamarl._fs import LockFile, LockHeld, write_text_atomic
from llamarl.checkpoint import discard_newer
from llamarl.config_values import ConfigError
from llamarl.reporting import Reporter

LOCK = ".lock"  # run_dir/.lock: flock-ed by the live run, holds its pid
# what a segment writes only when it ends successfully: an earlier segment's is renamed away when a resumed
# segment starts, so the directory never shows a summary or plot of another history than its metrics
_END_OF_SEGMENT = {"summary.json": "summary.prev.json", "plot.png": "plot.prev.png"}


def _item(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _jsonable(v: Any) -> Any:
    v = _item(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


class RunLog:
    def __init__(self, out: Path | None, total_steps: int, *, initial_step: int = 0, progress: bool = True,
                 reporters: list[Reporter] = (), mirror_history: bool = False):
        """``mirror_history``: send the history this run continues (its rows, evaluations and samples up to
        ``initial_step``) to the reporters first: a run resumed into a new directory, whose trackers start
        empty (``carry_history`` brought the logs along)."""
        self.out = out
        self.reporters = list(reporters)  # trackers mirroring each row (llamarl.reporting; the caller closes them)
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self._fd: int | None = None
        self._samples_fd: int | None = None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            self._fd, kept = _open_history(out / "metrics.jsonl", initial_step)
            self._samples_fd, kept_samples = _open_history(out / "samples.jsonl", initial_step)
            for row in kept:
                row = {k: _float_back(v) for k, v in row.items()}
                (self.evals if row.get("event") == "eval" else self.rows).append(row)
                for r in self.reporters if mirror_history else ():
                    if row.get("event") == "eval":
                        r.eval(row["step"], row)
                    else:
                        r.step(row)
            by_step: dict[int, list[dict]] = {}
            for row in kept_samples if mirror_history else ():
                by_step.setdefault(row["step"], []).append(row)
            for step, rows in by_step.items():
                for r in self.reporters:
                    r.samples(step, rows)
        disable = not progress or not sys.stderr.isatty() and os.environ.get("LLAMARL_PROGRESS") != "1"
        self.bar = tqdm(total=total_steps, initial=initial_step, desc="rl", unit="step", dynamic_ncols=True,
                        disable=disable)
        self._quiet = disable

    def step(self, row: dict) -> None:
        row = {k: _item(v) for k, v in row.items()}  # numbers as they are; the file spells NaN/inf as text
        self.rows.append(row)
        _append(self._fd, {k: _jsonable(v) for k, v in row.items()})
        for r in self.reporters:
            r.step(row)
        name, value = _headline(self.evals[-1]) if self.evals else ("acc", float("nan"))
        post = dict(reward=f"{row['reward_mean']:.3f}", **{name: f"{value:.3f}"}, stale=row["staleness"],
                    tok_s=f"{row.get('tokens_per_s', 0):.0f}", sync_ms=f"{1e3 * row['sync_s']:.1f}")
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)
        if self._quiet and (row["step"] % 10 == 0):
            print(f"step {row['step']}: " + " ".join(f"{k} {v}" for k, v in post.items()), flush=True)

    def eval(self, step: int, result: dict) -> None:
        row = {"event": "eval", "step": step, **{k: _item(v) for k, v in result.items()}}
        self.evals.append(row)
        _append(self._fd, {k: _jsonable(v) for k, v in row.items()})
        for r in self.reporters:
            r.eval(step, row)
        shown = [k for k in row if k == "accuracy" or k.startswith("pass@") or k == "model_score"]
        self.bar.write(f"eval @ step {step}: " + (", ".join(f"{k} {row[k]:.3f}" for k in shown) or
                                                  "nothing measured (the reward model could score no completion)"))

    def warn(self, message: str) -> None:
        """A warning on stderr, above the progress bar."""
        self.bar.write(f"[llamarl] warning: {message}", file=sys.stderr)

    def samples(self, rows: list[dict]) -> None:
        """Append decoded completions (each row has the ``step`` it was trained in) to samples.jsonl."""
        rows = [{k: _jsonable(v) for k, v in row.items()} for row in rows]
        for row in rows:
            _append(self._samples_fd, row)
        for r in self.reporters:
            r.samples(rows[0]["step"] if rows else 0, rows)

    def close(self) -> None:
        self.bar.close()
        for name in ("_fd", "_samples_fd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)

    def plot(self, path: Path) -> Path | None:
        """reward_mean per step and held-out accuracy per evaluation, against step, as a PNG."""
        if not self.rows:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        ax.plot([r["step"] for r in self.rows], [r["reward_mean"] for r in self.rows], lw=1, alpha=0.6,
                label="train reward (mean)")
        label, measured = eval_curve(self.evals)
        if self.evals:
            ax.plot([e["step"] for e in self.evals], measured, "o-", lw=2, label=label)
        ax.set_xlabel("step")
        shown = [r["reward_mean"] for r in self.rows] + measured
        if all(0.0 <= v <= 1.0 for v in shown if math.isfinite(v)):
            ax.set_ylim(-0.02, 1.02)  # else (a reward of several terms, or beyond [0, 1]): matplotlib's range
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


def eval_curve(evals: list[dict]) -> tuple[str, list[float]]:
    """The plot's held-out line: (label, one value per evaluation) of one measure for the whole line, the
    accuracy, or where an evaluation has none (no verifier: reward.reward=none, perhaps only since a resume)
    the reward model's score (NaN where an evaluation lacks it)."""
    key = "accuracy" if all("accuracy" in e for e in evals) else "model_score"
    label = "held-out accuracy" if key == "accuracy" else "held-out reward model score"
    return label, [e.get(key, math.nan) for e in evals]


def _headline(evaluation: dict) -> tuple[str, float]:
    """An evaluation's measure, as the progress bar names it: the accuracy, or where there is none (no
    verifier: reward.reward=none) the reward model's mean score."""
    if "accuracy" in evaluation:
        return "acc", evaluation["accuracy"]
    return "rm", evaluation.get("model_score", float("nan"))


def claim_run_dir(out: Path, config_yaml: str, *, resume_step: int | None = None,
                  warn: Callable[[str], Any] = print) -> LockFile:
    """Make ``out`` this run's and start a segment in it; returns the lock, to ``release()`` when the run ends.

    Before anything is written it takes an exclusive lock on ``out/.lock`` (ConfigError naming the owner's pid
    if another run holds it: two runs in one directory would replace each other's metrics.jsonl, config.yaml
    and checkpoints). Then, for a run resumed at ``resume_step``, the directory is made to describe one
    history ending at that step, before anything of the new segment can fail: the checkpoints above it (an
    abandoned continuation, ``discard_newer``) are set aside first, then metrics.jsonl and samples.jsonl cut
    back as ``RunLog`` does, and summary.json / plot.png of the earlier segment renamed to summary.prev.json /
    plot.prev.png (the new ones are written when this segment ends). Last, ``config_yaml`` is written as
    config.yaml; a resumed run whose settings differ keeps the earlier one as config.prev.yaml (so the config
    of a failed attempt does not silently replace the one the checkpoints were trained with)."""
    try:
        lock = LockFile(out / LOCK)
    except LockHeld as e:
        owner = f"pid {e.pid}" if e.pid is not None else "its pid not written yet"
        raise ConfigError(f"run.out: {out} is in use by another llamarl run ({owner}); wait for it to end or pick "
                          "another --out") from None
    except OSError as e:
        raise _unwritable(out, e) from None
    if not lock.locked:
        warn(f"the file system of {out} cannot lock files (flock): a second run started on this directory would not "
             "be refused; start one run per --out")
    try:
        config = out / "config.yaml"
        if resume_step is not None:
            gone = discard_newer(out, resume_step, set_aside=True)  # first: logs longer than the checkpoints get cut
            for name in ("metrics.jsonl", "samples.jsonl"):
                if (out / name).exists():
                    _keep_history(out / name, resume_step)
            for name, prev in _END_OF_SEGMENT.items():
                if (out / name).exists():
                    os.replace(out / name, out / prev)
            if gone:
                warn(f"resuming from step {resume_step}, before the newest checkpoint of {out}: the newer "
                     f"checkpoint(s) {', '.join(p.name for p in gone)} (the continuation this resume abandons) are set "
                     "aside as checkpoints/abandoned-step_*, deleted when this run writes its first checkpoint (rename "
                     f"one back to resume from it); metrics.jsonl and samples.jsonl end at step {resume_step} as well")
            if config.is_file() and config.read_text(encoding="utf-8") != config_yaml:
                os.replace(config, out / "config.prev.yaml")
        write_text_atomic(config, config_yaml)
    except BaseException as e:
        lock.release()
        if isinstance(e, OSError):
            raise _unwritable(out, e) from None
        raise
    return lock


def _unwritable(out: Path, e: OSError) -> ConfigError:
    return ConfigError(f"run.out: cannot write the run directory {out}: {e.strerror or e}; pick another --out")


def _append(fd: int | None, row: dict) -> None:
    """Append one JSON line to ``fd``, whole: a write that fails part-way is truncated back before the
    error goes on. No-op without a file (``fd`` None)."""
    if fd is None:
        return
    data = (json.dumps(row) + "\n").encode()
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


def _float_back(v: Any) -> Any:
    """Undo ``_jsonable`` for non-finite floats."""
    return float(v) if v in ("nan", "inf", "-inf") else v


def _open_history(path: Path, initial_step: int) -> tuple[int, list[dict]]:
    """An append-only descriptor of ``path``, after dropping what a resumed run redoes (``_keep_history``),
    and the rows kept."""
    kept = _keep_history(path, initial_step) if path.exists() else []
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), kept


def carry_history(source: Path, out: Path, step: int) -> None:
    """A run resumed at ``step`` from ``source`` (another run directory) into a new ``out``: its metrics.jsonl
    and samples.jsonl up to that step are copied first, so the new directory's logs, plot and summary cover the
    whole run (its accuracy before RL is the run's, not the resumed step's). Files ``out`` has are kept."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        if (source / name).is_file() and not (out / name).exists():
            write_text_atomic(out / name, (source / name).read_text(encoding="utf-8", errors="replace"))
            _keep_history(out / name, step)


def _keep_history(path: Path, initial_step: int) -> list[dict]:
    """Rewrite ``path`` (atomically) with the lines a run resumed at ``initial_step`` continues: whole JSON
    rows of steps <= initial_step and evaluations before it; returns those rows."""
    kept, rows = [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn line (the crash came mid-write)
        if not line.endswith("\n") or not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        if row["step"] < initial_step or (row["step"] == initial_step and row.get("event") != "eval"):
            kept.append(line)
            rows.append(row)
    write_text_atomic(path, "".join(kept))
    return rows


def summary_table(summary: dict) -> str:
    """A short fixed-width table of the run's headline numbers."""
    passes = [(k, f"{k.replace('_', ' ')} RL") for k in summary if k.startswith("pass@")]
    keys = [("mode", "mode"), ("steps", "steps"), ("eval", "held-out evaluation"),
            ("accuracy_before", "held-out acc before RL"), ("accuracy_after", "held-out acc after RL"), *passes,
            ("model_score_before", "reward model before RL"), ("model_score_after", "reward model after RL"),
            ("wall_s", "wall time (s)"),
            ("warm_start_s", "warm start (s)"), ("rl_s", "RL (s)"), ("step_s_mean", "step time (s)"),
            ("sync_s_mean", "weight sync (ms)"), ("max_staleness_seen", "max staleness seen"),
            ("tokens_per_s", "generated tokens/s"), ("reward_errors", "reward errors"),
            ("reward_timeouts", "reward timeouts"), ("reward_worker_deaths", "reward worker deaths"),
            ("skipped_updates", "skipped updates"), ("empty_updates", "updates with no token")]
    lines = []
    for k, label in keys:
        if summary.get(k) is None:  # (no accuracy without a verifier: reward.reward=none)
            continue
        v = summary[k]
        if k == "sync_s_mean":
            v = 1e3 * v
        lines.append(f"  {label:<24} {v:.3f}" if isinstance(v, float) else f"  {label:<24} {v}")
    return "\n".join(lines)
