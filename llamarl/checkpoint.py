"""Atomic training checkpoints: policy (HF format), optimizer, policy version, data cursor, RNG states.

On-disk layout of a run directory::

    run_dir/checkpoints/
        step_000123/                   one complete checkpoint (never modified after it appears)
            policy/                    Hugging Face directory (config.json + *.safetensors), or absent
            optimizer.pt               torch.save of the optimizer state (optional; any other files
                                       written into the checkpoint directory are kept too, e.g.
                                       per-rank shards "optimizer.rank1.pt")
            rng.pt                     RNG states (torch.save, loadable with weights_only=True)
            state.json                 step, policy_version, data_cursor, extra (JSON)
            config.yaml, config.start.yaml   the run's settings (copied from run_dir when it has them)
            MANIFEST.json              written last: every file with its size and SHA-256
        latest                         text "step_000123": the last committed checkpoint
        .tmp-step_000124-<host>-<pid>-<rand>/   a checkpoint being written (or torn by a crash)

Atomicity: everything is written into a temporary directory inside ``checkpoints/`` (same filesystem),
every file and directory is fsynced, ``MANIFEST.json`` is written and fsynced last, and only then is the
directory renamed to ``step_NNNNNN`` with ``os.replace`` (atomic), its parent fsynced and the ``latest``
pointer replaced atomically. A crash at any point leaves either the old set of checkpoints or the old
set plus the complete new one; never a half-written ``step_*``. Readers trust the manifest, not the
pointer: ``load_latest`` returns the highest-step checkpoint whose manifest matches its files (sizes,
and the SHA-256 of every file for the one it loads: a flipped byte is not loaded silently) and whose
state parses, falling back to the next older one with a warning; so a crash between the rename and the
pointer update still resumes from the newest complete state. Re-saving an existing step moves the old copy
aside (``.old-…``) for the rename and deletes it after; if the rename fails it is put back, and if the writer
dies in between, the next save or load puts it back.
Temporary directories left by dead writers on this host are removed by the next save or load; old
checkpoints beyond ``keep`` are renamed away (atomic) and then deleted. History is linear: committing step N
first removes checkpoints with a step above N (left by a continuation abandoned when resuming from an older
checkpoint), before the rename, so "newest complete" and the ``latest`` pointer agree even after a crash; a
run resumed from step N sets them aside already when it starts (``discard_newer(set_aside=True)``, where it
cuts its logs): renamed ``abandoned-step_M``, invisible to resume, kept until that first commit deletes them
(so a checkpoint skipped because it failed to load is not lost before anyone can look at it).
A manifest is trusted only in its own checkpoint: an entry of the wrong type, or a path that is absolute or
leaves the directory (``..``), makes the checkpoint unusable, like a checksum failure.
Once the rename is done the checkpoint is committed: a failure after it (the pointer, pruning) is
reported as a warning, not as a failed save.

Writers from other processes (e.g. FSDP trainer ranks writing their shards) can fill
``CheckpointWriter.path`` before the owner commits; the commit fsyncs whatever is there.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import shutil
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import numpy as np
import torch

from llamarl._fs import fsync_dir, write_text_atomic
from llamarl.run_files import RUN_CONFIG, START_CONFIG, checkpoints_dir, step_dirs as _step_dirs

FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
STATE = "state.json"
RNG = "rng.pt"
OPTIMIZER = "optimizer.pt"
POLICY = "policy"
LATEST = "latest"
_TMP_RE = re.compile(r"^\.(?P<kind>tmp|trash|old)-(?P<name>.*)-(?P<host>[^-]+)-(?P<pid>\d+)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the directory and what is wrong."""


# -------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict:
    """RNG states of Python ``random``, NumPy's global generator, torch CPU and (if initialised) CUDA."""
    np_state = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"kind": np_state[0], "key": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``: afterwards the generators produce the same streams again."""
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise CheckpointError(f"RNG state lacks {sorted(missing)}; it must come from capture_rng_state()")
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint. ``optimizer_state()`` and ``policy_dir`` are read lazily."""

    path: Path
    step: int
    policy_version: int
    data_cursor: Any
    rng_state: dict | None
    extra: dict = field(default_factory=dict)

    @property
    def policy_dir(self) -> Path | None:
        """The Hugging Face policy directory (``Llama.from_pretrained``-loadable), if one was saved."""
        p = self.path / POLICY
        return p if p.is_dir() else None

    def optimizer_state(self, name: str = OPTIMIZER, map_location: str | torch.device = "cpu") -> Any:
        """Load ``name`` (default ``optimizer.pt``) from this checkpoint with ``weights_only=True``."""
        p = self.path / name
        if not p.is_file():
            raise CheckpointError(f"checkpoint {self.path} has no '{name}'")
        return torch.load(p, map_location=map_location, weights_only=True)


def training_dir_hint(path: str | os.PathLike) -> str:
    """For a model argument that is a training run or checkpoint directory rather than a model: what it is
    and the model directory inside it to pass ('' for any other path)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return ""
    if checkpoints_dir(path).is_dir():
        return f"it is a training run directory, not a model: pass {path / 'checkpoints/step_NNNNNN' / POLICY}"
    if (path / POLICY).is_dir():
        return f"it is a training checkpoint directory, not a model: pass {path / POLICY}"
    return ""


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of ``run_dir`` as (step, path), ascending; torn ones are skipped."""
    return [(step, path) for step, path in _step_dirs(run_dir) if _verify(path) is None]


ABANDONED = "abandoned-"  # checkpoints/abandoned-step_N: set aside by a resume from an older step


def discard_newer(run_dir: str | os.PathLike, step: int, *, point_latest: bool = True,
                  set_aside: bool = False) -> list[Path]:
    """Take the complete checkpoints of ``run_dir`` with a step above ``step`` out of the run and, with
    ``point_latest``, point ``latest`` at ``step_{step}`` if that one is there; returns the paths they had.
    The run's history is linear, so these belong to a continuation abandoned by resuming from ``step``.
    ``set_aside``: each is renamed ``abandoned-step_N`` (atomic; resume never looks there), what a resumed
    run does when it starts, where it also cuts its logs back to ``step``, so that checkpoints and logs agree
    even if it fails before its first checkpoint. Otherwise each is renamed away and deleted, and so are the
    set-aside ones: what ``CheckpointWriter.commit`` does before its rename."""
    root = checkpoints_dir(run_dir)
    gone = [path for s, path in list_checkpoints(run_dir) if s > step]
    doomed = [] if set_aside else [p for p in (root.iterdir() if root.is_dir() else ())
                                   if p.name.startswith(ABANDONED) and p.is_dir()]
    for path in gone + doomed:
        if set_aside:
            target, n = root / (ABANDONED + path.name), 1
            while target.exists():
                target, n = root / f"{ABANDONED}{path.name}.{n}", n + 1
            os.replace(path, target)
            continue
        _discard(path)
    name = f"step_{step:06d}"
    if gone and point_latest and (root / name).is_dir():
        _write_atomic(root / LATEST, name + "\n")
    return gone


def latest_checkpoint_dir(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint directory of ``run_dir`` (or ``run_dir`` itself if it is one)."""
    run_dir = Path(run_dir)
    if (run_dir / MANIFEST).is_file() and _verify(run_dir) is None:
        return run_dir
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read one checkpoint directory; raises ``CheckpointError`` if it is incomplete or corrupt (every file
    is checked against the SHA-256 the manifest records)."""
    path = Path(path)
    problem = _verify(path, checksums=True)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} is not usable: {problem}")
    try:
        state = json.loads((path / STATE).read_text())
        rng = torch.load(path / RNG, weights_only=True) if (path / RNG).is_file() else None
        return Checkpoint(path=path, step=int(state["step"]), policy_version=int(state["policy_version"]),
                          data_cursor=state.get("data_cursor"), rng_state=rng, extra=state.get("extra") or {})
    except Exception as exc:  # noqa: BLE001 - any parse failure means: not usable
        raise CheckpointError(f"checkpoint {path} is not usable: its {STATE} or {RNG} does not parse "
                              f"({type(exc).__name__}: {exc})") from None


def load_latest(run_dir: str | os.PathLike) -> Checkpoint | None:
    """The newest usable checkpoint of ``run_dir`` (None if there is none): a newer ``step_*`` that is not
    usable (torn, a malformed manifest, failed checksums, a state that does not parse) is skipped with a
    warning naming the problem. Cleans dead temp dirs."""
    run_dir = Path(run_dir)
    _clean_stale(checkpoints_dir(run_dir))
    if (run_dir / MANIFEST).is_file():  # a checkpoint directory itself: that one or nothing
        return load_checkpoint(run_dir)
    for step, path in reversed(_step_dirs(run_dir)):
        try:
            return load_checkpoint(path)
        except CheckpointError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", stacklevel=2)
    return None


def _verify(path: Path, *, checksums: bool = False) -> str | None:
    """None if ``path`` is a complete checkpoint (every manifest file present with its size, ``state.json``
    among them; with ``checksums`` also its SHA-256), else what is wrong with it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST} (the write did not finish)"
    except (OSError, ValueError) as exc:
        return f"unreadable {MANIFEST}: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        return f"format {manifest.get('format') if isinstance(manifest, dict) else None!r}, this code reads " \
               f"format {FORMAT_VERSION}"
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE not in files:
        return f"the manifest lists no {STATE}"
    for rel, entry in files.items():
        # an int entry holds the size only, no checksum (commit() writes {"bytes", "sha256"})
        size = entry.get("bytes") if isinstance(entry, dict) else entry
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or (
                isinstance(entry, dict) and not isinstance(entry.get("sha256"), (str, type(None)))):
            return f"the manifest entry for {rel!r} is malformed ({json.dumps(entry)}; expected a size in bytes or " \
                   '{"bytes": N, "sha256": HEX})'
        parts = PurePosixPath(rel).parts
        if not rel or rel.startswith("/") or "\\" in rel or ".." in parts:
            return f"the manifest names {rel!r}, not a file inside the checkpoint"
        f = path / rel
        if not f.is_file():
            return f"missing file {rel}"
        if f.stat().st_size != size:
            return f"file {rel} has {f.stat().st_size} bytes, manifest says {size}"
    if checksums:
        key = (str(path.resolve()), (path / MANIFEST).stat().st_mtime_ns)
        if key not in _CHECKSUMS_OK:  # once per process (a resume checks the config, then loads)
            for rel, entry in files.items():
                if isinstance(entry, dict) and entry.get("sha256") and _sha256(path / rel) != entry["sha256"]:
                    return f"file {rel} does not match its SHA-256 in the manifest (corrupted on disk)"
            _CHECKSUMS_OK.add(key)
    return None


_CHECKSUMS_OK: set[tuple[str, int]] = set()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# -------------------------------------------------------------------- writing
class CheckpointWriter:
    """Write one checkpoint atomically: fill ``path`` (a temp dir), then ``commit()``.

    As a context manager it commits on normal exit and removes the temp dir on an exception::

        with CheckpointWriter(run_dir, step) as ckpt:
            model.save_pretrained(ckpt.policy_dir)
            ckpt.save_optimizer(optimizer.state_dict())
            ckpt.write_state(policy_version=v, data_cursor=cursor)
    """

    def __init__(self, run_dir: str | os.PathLike, step: int, *, keep: int = 3):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be an integer >= 0, got {step!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"keep must be an integer >= 1 (checkpoints to retain), got {keep!r}")
        self.run_dir, self.step, self.keep = Path(run_dir), step, keep
        self.root = checkpoints_dir(run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        _clean_stale(self.root)
        self.name = f"step_{step:06d}"
        self.path = self.root / _scratch_name("tmp", self.name)
        self.path.mkdir()
        self._state_written = False
        self._done = False

    @property
    def policy_dir(self) -> Path:
        """Where the HF-format policy goes (created on first access)."""
        p = self.path / POLICY
        p.mkdir(exist_ok=True)
        return p

    def save_policy(self, writer: Callable[[Path], Any]) -> None:
        """Call ``writer(dir)`` (e.g. ``model.save_pretrained``); it must leave a config.json there."""
        writer(self.policy_dir)
        if not (self.policy_dir / "config.json").is_file():
            raise CheckpointError(f"policy writer {writer!r} left no config.json in {self.policy_dir}; it must "
                                  f"write a Hugging Face model directory (e.g. model.save_pretrained)")

    def save_optimizer(self, state: Any, name: str = OPTIMIZER) -> None:
        torch.save(state, self.path / name)

    def write_state(self, *, policy_version: int, data_cursor: Any = None, rng_state: dict | None = None,
                    extra: dict | None = None) -> None:
        """Record the scalar state; ``rng_state`` defaults to this process's ``capture_rng_state()``."""
        if isinstance(policy_version, bool) or not isinstance(policy_version, int) or policy_version < 0:
            raise CheckpointError(f"policy_version must be an integer >= 0, got {policy_version!r}")
        doc = {"step": self.step, "policy_version": policy_version, "data_cursor": data_cursor,
               "extra": extra or {}}
        try:
            text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"data_cursor and extra must be JSON-serialisable (dicts, lists, str, "
                                  f"int, finite float, bool, None): {exc}") from None
        (self.path / STATE).write_text(text)
        torch.save(rng_state if rng_state is not None else capture_rng_state(), self.path / RNG)
        self._state_written = True

    def commit(self) -> Path:
        """Make the checkpoint visible atomically, update ``latest``, prune old ones; returns its path."""
        if self._done:
            raise CheckpointError(f"checkpoint {self.name} was already committed or aborted")
        if not self._state_written:
            raise CheckpointError(f"checkpoint {self.name}: call write_state(policy_version=...) before commit")
        try:
            files = {}
            for f in sorted(p for p in self.path.rglob("*") if p.is_file()):
                _fsync_file(f)
                files[f.relative_to(self.path).as_posix()] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for d in sorted((p for p in self.path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                fsync_dir(d)
            manifest = {"format": FORMAT_VERSION, "step": self.step, "files": files}
            _write_atomic(self.path / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            # an abandoned continuation: gone before this step becomes the newest (the pointer follows the rename)
            discard_newer(self.run_dir, self.step, point_latest=False)
            final = self.root / self.name
            if final.exists():  # re-saving a step: the old copy steps aside ("old") until the new one is in place
                old = self.root / _scratch_name("old", self.name)
                os.replace(final, old)
                try:
                    os.replace(self.path, final)
                except BaseException:
                    os.replace(old, final)  # put it back (a crash right here: _clean_stale puts it back)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(self.path, final)
        except BaseException:
            self.abort()  # nothing became visible: drop the temp dir (no half checkpoint, no leak)
            raise
        self._done = True
        try:  # committed: what follows only tidies up
            fsync_dir(self.root)
            _write_atomic(self.root / LATEST, self.name + "\n")
            self._prune(final)
        except OSError as exc:
            warnings.warn(f"checkpoint {final} is committed, but updating '{LATEST}' or pruning old checkpoints "
                          f"failed: {exc}", stacklevel=2)
        return final

    def abort(self) -> None:
        """Discard the temp dir (nothing visible changes)."""
        if not self._done:
            self._done = True
            shutil.rmtree(self.path, ignore_errors=True)

    def _prune(self, just_written: Path) -> None:
        """Drop checkpoints beyond the newest ``keep``, and any with a higher step than ``just_written``:
        the run's history is linear, so those belong to a continuation that was abandoned by resuming
        from an older checkpoint."""
        found = list_checkpoints(self.run_dir)
        superseded = [p for s, p in found if s > self.step]
        kept = [p for s, p in found if s <= self.step]
        for path in superseded + kept[:-self.keep]:
            if path != just_written:
                _discard(path)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def save_checkpoint(run_dir: str | os.PathLike, step: int, *, policy_state: Callable[[Path], Any] | None,
                    optimizer_state: Any = None, policy_version: int, data_cursor: Any = None,
                    rng_state: dict | None = None, extra: dict | None = None, keep: int = 3) -> Path:
    """Write ``run_dir/checkpoints/step_{step:06d}`` atomically and return its path.

    ``policy_state(dir)`` writes the HF-format policy (e.g. ``model.save_pretrained``); ``optimizer_state``
    is saved with ``torch.save``; ``data_cursor``/``extra`` must be JSON-serialisable; ``rng_state``
    defaults to ``capture_rng_state()``. Keeps the newest ``keep`` checkpoints. The run's settings files
    (``run_dir/config.yaml`` and ``config.start.yaml``, llamarl.run_files.RUN_CONFIG / START_CONFIG) are copied in
    too, so a checkpoint copied out of its run directory resumes with them.
    """
    try:
        with CheckpointWriter(run_dir, step, keep=keep) as ckpt:
            for name in (RUN_CONFIG, START_CONFIG):  # the run's settings: a copied checkpoint resumes with them
                if (Path(run_dir) / name).is_file():
                    shutil.copyfile(Path(run_dir) / name, ckpt.path / name)
            if policy_state is not None:
                ckpt.save_policy(policy_state)
            if optimizer_state is not None:
                ckpt.save_optimizer(optimizer_state)
            ckpt.write_state(policy_version=policy_version, data_cursor=data_cursor, rng_state=rng_state,
                             extra=extra)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a full disk: OSError, RuntimeError (torch.save), SafetensorError
        free = shutil.disk_usage(run_dir).free if Path(run_dir).is_dir() else None
        room = f"; {free / 2**20:.0f} MiB free there" if free is not None else ""
        raise CheckpointError(f"writing checkpoint step {step} under {run_dir} failed ({type(exc).__name__}: {exc})"
                              f"{room}; the earlier checkpoints are intact (nothing partial is kept): free some "
                              "space and continue with --resume") from exc
    return ckpt.root / ckpt.name


# -------------------------------------------------------------------- filesystem helpers
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname()) or "host"


def _scratch_name(kind: str, name: str) -> str:
    """The name of this process's temporary ("tmp"), doomed ("trash") or replaced ("old") copy of ``name``,
    unique, in the form ``_TMP_RE`` matches, so ``_clean_stale`` removes (or puts back) what a dead writer left."""
    return f".{kind}-{name}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


def _discard(path: Path) -> None:
    """Remove a committed checkpoint: renamed away first (atomic), then deleted."""
    trash = path.parent / _scratch_name("trash", path.name)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(root: Path) -> None:
    """Remove trash, and temp files/dirs whose writer (a process on this host) no longer exists. An "old"
    copy (a step being re-saved) whose writer died before the new copy took its name is put back."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        m = _TMP_RE.match(entry.name)
        if not m or m.group("host") != _host():
            continue
        pid = int(m.group("pid"))
        if m.group("kind") == "tmp" and (pid == os.getpid() or _pid_alive(pid)):
            continue  # a writer that may still be working
        if m.group("kind") == "old":
            if pid != os.getpid() and _pid_alive(pid):
                continue  # a re-save in progress
            if not (root / m.group("name")).exists():
                os.replace(entry, root / m.group("name"))
                continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    """``write_text_atomic`` (file and directory fsynced) through a scratch file ``_clean_stale`` knows."""
    write_text_atomic(path, text, tmp_name=_scratch_name("tmp", path.name))
