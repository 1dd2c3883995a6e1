"""Experiment trackers: what ``run.report_to`` sends to TensorBoard and Weights & Biases.

``metrics.jsonl`` stays the record of a run; a reporter mirrors it to a tracker, step by step:

* every numeric field of a step row as ``train/<field>`` at x = step (booleans as 0/1; text is skipped);
* every numeric field of an evaluation as ``eval/<field>`` at x = the step it was taken after;
* the step's logged samples (``run.log_samples``) as text (TensorBoard) or a table (W&B);
* the run summary once at the end.

TensorBoard writes event files under ``OUT/tensorboard``; a resumed run purges the events after its
checkpoint step (``purge_step``), so the curves stay one history like metrics.jsonl, except that the
resumed run logs the evaluation at the checkpoint step again (two ``eval/*`` points there when the first
run also evaluated at that step). W&B runs offline-capable (``WANDB_MODE=offline``) under ``OUT/wandb``;
the run id is kept in ``OUT/wandb_run_id`` so a resumed run continues the same W&B run (W&B does not
rewrite history: steps it already holds past the checkpoint keep their first values, and it warns about
the redone ones).

Both trackers are optional dependencies: ``pip install "llamarl[tensorboard]"`` or ``"llamarl[wandb]"``;
``check_available`` tells the config check up front which one is missing.
"""

from __future__ import annotations

import importlib.util
import math
import secrets
from pathlib import Path
from typing import Any, Protocol

REPORTERS = ("tensorboard", "wandb")  # each is also the name of the package it needs


class Reporter(Protocol):
    def step(self, row: dict) -> None: ...
    def eval(self, step: int, row: dict) -> None: ...
    def samples(self, step: int, rows: list[dict]) -> None: ...
    def summary(self, summary: dict) -> None: ...
    def close(self) -> None: ...


def parse_report_to(value: str) -> list[str]:
    """``"none"`` → [], ``"tensorboard,wandb"`` → both; raises ValueError naming an unknown tracker."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if names in ([], ["none"]):
        return []
    unknown = [n for n in names if n not in REPORTERS]
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown}; use none or a comma list of {', '.join(REPORTERS)}")
    return list(dict.fromkeys(names))


def check_available(names: list[str]) -> str | None:
    """None if every tracker's package imports here, else what to install."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        extras = ",".join(missing)
        return f"needs {' and '.join(missing)}, not installed here: pip install \"llamarl[{extras}]\""
    return None


def make_reporters(names: list[str], out: Path, config: dict, *, initial_step: int = 0) -> list[Reporter]:
    made: list[Reporter] = []
    try:
        for name in names:
            made.append(TensorBoardReporter(out, config, initial_step) if name == "tensorboard"
                        else WandbReporter(out, config, initial_step))
    except BaseException:
        for r in made:
            r.close()
        raise
    return made


def numbers(row: dict) -> dict[str, float]:
    """The numeric fields of a row (bools as 0/1; non-finite floats kept, text and ``step`` dropped)."""
    out = {}
    for k, v in row.items():
        if k in ("step", "event") or isinstance(v, str) or v is None:
            continue
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)):
            out[k] = float(v)
    return out


class TensorBoardReporter:
    def __init__(self, out: Path, config: dict, initial_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run redoes the steps after its checkpoint: its writer's START event (purge_step) tells
        # TensorBoard to drop their old events (step >= initial_step + 1). TensorBoard's UI reader ignores a log
        # directory's first START, so a fresh run writes one too (at step 0, nothing to drop), and a resume adds
        # a second for a directory written before fresh runs did
        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"),
                                    purge_step=initial_step + 1 if initial_step else 0)
        if initial_step:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.writer.file_writer.add_event(Event(step=initial_step + 1,
                                                    session_log=SessionLog(status=SessionLog.START)))
        else:
            self.writer.add_text("config", _config_markdown(config), 0)

    def step(self, row: dict) -> None:
        for k, v in numbers(row).items():
            self.writer.add_scalar(f"train/{k}", v, row["step"])

    def eval(self, step: int, row: dict) -> None:
        for k, v in numbers(row).items():
            self.writer.add_scalar(f"eval/{k}", v, step)

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows:
            self.writer.add_text("samples", _samples_markdown(rows), step)

    def summary(self, summary: dict) -> None:
        # at the run's last step: a resume's purge drops an earlier segment's summary with its steps
        self.writer.add_text("summary", _table({k: v for k, v in summary.items() if not isinstance(v, dict)}),
                             summary.get("steps") or 0)

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    def __init__(self, out: Path, config: dict, initial_step: int = 0):
        import wandb

        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=config.get("run", {}).get("wandb_project") or "llamarl", name=out.name,
                              id=run_id, resume="allow", dir=str(out), config=config)

    def step(self, row: dict) -> None:
        self.run.log({f"train/{k}": v for k, v in numbers(row).items()}, step=row["step"])

    def eval(self, step: int, row: dict) -> None:
        self.run.log({f"eval/{k}": v for k, v in numbers(row).items()}, step=step)

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows:
            cols = list(rows[0])
            table = self.wandb.Table(columns=cols, data=[[_cell(r.get(c)) for c in cols] for r in rows])
            self.run.log({"samples": table}, step=step)

    def summary(self, summary: dict) -> None:
        for k, v in summary.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


def _cell(v: Any) -> Any:
    return v if v is None or isinstance(v, (int, float, str, bool)) else str(v)


def _escape(v: Any) -> str:
    text = f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)
    return text.replace("|", "\\|").replace("\n", "⏎")


def _table(row: dict) -> str:
    return "| key | value |\n|---|---|\n" + "".join(f"| {k} | {_escape(v)} |\n" for k, v in row.items())


def _samples_markdown(rows: list[dict]) -> str:
    cols = ["sample_id", "prompt", "completion", "answer", "reward", "advantage", "finish_reason"]
    cols = [c for c in cols if any(c in r for r in rows)]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(_escape(r.get(c, "")) for c in cols) + " |\n" for r in rows)


def _config_markdown(config: dict) -> str:
    return _table({f"{section}.{k}": v for section, fields in config.items() for k, v in fields.items()})
