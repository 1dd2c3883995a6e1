"""Where a run keeps its settings, and which of them a resume continues with.

A run directory holds ``config.yaml`` (each segment's settings, rewritten when a resumed segment starts) and
``config.start.yaml`` (its first segment's: the KL reference is the warm start of these settings). Every
checkpoint carries copies of both (``llamarl.checkpoint.save_checkpoint``), so a checkpoint copied out of its run
still resumes with the run's settings. ``--resume`` takes a run directory or one of its checkpoints
(``RUN/checkpoints/step_N``)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

RUN_CONFIG, START_CONFIG = "config.yaml", "config.start.yaml"
CHECKPOINTS = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``checkpoints/step_*`` directory of ``run_dir`` as (step, path), ascending, complete or not
    (llamarl.checkpoint verifies them)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry))
    return sorted(found)


def resume_run_dir(resume: Any) -> Path:
    """The run directory a ``--resume`` path belongs to (the path itself, or a checkpoint's run)."""
    path = Path(str(resume))
    return path.parent.parent if path.parent.name == CHECKPOINTS else path


def resume_file(resume: Any, name: str = RUN_CONFIG) -> Path | None:
    """The settings file ``name`` a resume from ``resume`` continues with: its run directory's, else the copy
    the checkpoint carries (a checkpoint copied out of its run; for a run directory without the file, e.g. only
    its checkpoints/ copied, the newest checkpoint's); None without any."""
    run_dir, path = resume_run_dir(resume), Path(str(resume))
    candidates = [run_dir, path]
    if path == run_dir:
        candidates += [d for _, d in reversed(step_dirs(run_dir))]
    return next((d / name for d in candidates if (d / name).is_file()), None)
