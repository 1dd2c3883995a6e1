"""Where a run keeps its settings, and which of them a resume continues with.

A run directory holds ``config.yaml`` (each segment's settings, rewritten when a resumed segment starts) and
``config.start.yaml`` (its first segment's: the KL reference is the warm start of these settings). Every
checkpoint carries copies of both (``llamarl.checkpoint.save_checkpoint``), so a checkpoint copied out of its run
still resumes with the run's settings. ``--resume`` takes a run directory or one of its checkpoints
(``RUN/checkpoints/step_N``)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

RUN_CONFIG, START_CONFIG = "config.yaml", "config.start.yaml"


def resume_run_dir(resume: Any) -> Path:
    """The run directory a ``--resume`` path belongs to (the path itself, or a checkpoint's run)."""
    path = Path(str(resume))
    return path.parent.parent if path.parent.name == "checkpoints" else path


def resume_file(resume: Any, name: str = RUN_CONFIG) -> Path | None:
    """The settings file ``name`` a resume from ``resume`` continues with: its run directory's, else the copy
    the checkpoint carries (a checkpoint copied out of its run; for a run directory without the file, e.g. only
    its checkpoints/ copied, the newest checkpoint's); None without any."""
    run_dir, path = resume_run_dir(resume), Path(str(resume))
    candidates = [run_dir, path]
    if path == run_dir and (run_dir / "checkpoints").is_dir():
        steps = [d for d in (run_dir / "checkpoints").iterdir() if re.fullmatch(r"step_\d+", d.name)]
        candidates += sorted(steps, key=lambda d: int(d.name[5:]), reverse=True)
    return next((d / name for d in candidates if (d / name).is_file()), None)
