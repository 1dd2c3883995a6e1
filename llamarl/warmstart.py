"""Supervised warm start: teach the policy the answer format before RL, cached across runs.

RL from a random policy on an exact-answer task has no signal (every reward is 0), so the embedded
default first fits the policy to reference answers for a short while: minimise

    L_SFT = − Σ_{b,t} m_{b,t} · log π(a_{b,t} | x_b, a_{b,<t}) / Σ m

over completions a = answer ‖ EOS of training problems (m masks the prompt and the padding). The result is
written as a Hugging Face directory (weights + tokenizer) under a cache key, built by
``llamarl.training.prepare_policy``, over everything that determines it: the model config, the warm-start
settings, the data settings, the seed, the reward, the generation length, the tokenizer and the contents
of the input files. ``prepare_policy`` loads a matching entry instead of training and reports
``cached=True``. Writes are atomic (temp dir + rename), so an interrupted warm start never leaves a
half-written cache entry.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from llamarl.data import Sample

CACHE_ENV = "LLAMARL_CACHE_DIR"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "llamarl")
    return Path(root) / "warmstart"


def cache_key(*parts: object) -> str:
    blob = json.dumps([_plain(p) for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


BIG_FILE_BYTES = 64 << 20  # files above this are fingerprinted by size and mtime, not read


def reward_source(spec: str) -> str | None:
    """The file a reward spec's function is defined in: the path of ``file.py:fn``, the module file of
    ``pkg.mod:fn`` (found without importing the module itself), None for a built-in name or what is not found."""
    target = spec.rpartition(":")[0]
    if not target:
        return None
    if os.path.exists(target):
        return target
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError, AttributeError):
        return None
    origin = found.origin if found is not None else None
    return origin if origin and os.path.isfile(origin) else None


def content_fingerprint(path: str | os.PathLike) -> str | None:
    """SHA-256 of a file's bytes, or of a directory's files (names and bytes, sorted); None if ``path`` is
    neither. A cache key that names an input file by its path alone would keep serving weights trained on
    the file's old contents after it was edited."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode() + b"\0")
        st = f.stat()
        if st.st_size > BIG_FILE_BYTES:  # e.g. a model's weights in a tokenizer directory: size and mtime
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            continue
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _plain(x: object) -> object:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(x).items()}
    return x


def sft_batch(samples: Sequence[Sample], encode_prompt: Callable[[Sample], list[int]],
              encode_answer: Callable[[str], list[int]], eos_id: int, pad_id: int):
    """(input_ids [B, L], mask [B, L-1]) with mask = 1 where the target is an answer or EOS token."""
    rows, spans = [], []
    for s in samples:
        p, a = encode_prompt(s), encode_answer(s.answer) + [eos_id]
        rows.append(p + a)
        spans.append((len(p), len(a)))
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), length - 1)
    for i, (row, (p, a)) in enumerate(zip(rows, spans)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, p - 1 : p - 1 + a] = 1.0
    return ids, mask


def sft_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    return (nll * mask.reshape(-1)).sum() / mask.sum().clamp_min(1.0)


def train_supervised(model: torch.nn.Module, next_samples: Callable[[int], Sequence[Sample]], *,
                     steps: int, lr: float, batch_size: int, encode_prompt, encode_answer, eos_id: int,
                     pad_id: int, log: Callable[[str], None] = print, time_budget_s: float | None = None,
                     probe: Callable[[], float] | None = None, target_accuracy: float = 0.0,
                     check_every: int = 25) -> dict:
    """AdamW on the SFT loss with a linear warm-up over the first 5% of steps, then a constant lr.

    With ``probe`` (greedy accuracy on a few training problems) and ``target_accuracy`` > 0, training
    stops at the first check (every ``check_every`` steps) where the probe reaches the target: small
    models learn arithmetic through a sharp, seed-dependent transition, and stopping on accuracy rather
    than on a step count hands RL a policy of the intended strength whatever the transition's timing."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warm = max(1, steps // 20)

    def lr_at(step: int) -> float:
        return lr * min(1.0, (step + 1) / warm)

    model.train()
    t0, losses, done = time.perf_counter(), [], 0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, mask = sft_batch(next_samples(batch_size), encode_prompt, encode_answer, eos_id, pad_id)
        loss = sft_loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        done = step + 1
        if done % max(1, steps // 10) == 0 or done == steps:
            log(f"warm start {done}/{steps}: loss {sum(losses[-20:]) / len(losses[-20:]):.3f} "
                f"({time.perf_counter() - t0:.0f}s)")
        if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
            log(f"warm start stopped by its time budget after {done} steps")
            break
        if probe is not None and target_accuracy > 0 and done % check_every == 0:
            acc = probe()
            model.train()
            if acc >= target_accuracy:
                log(f"warm start reached probe accuracy {acc:.3f} >= {target_accuracy} after {done} steps")
                break
    return {"steps": done, "loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
            "seconds": time.perf_counter() - t0}


def save_atomic(model, tokenizer, path: Path, info: dict) -> bool:
    """Write model, tokenizer and ``info`` (warmstart.json) into ``path`` via a sibling temp dir and a rename;
    False if another run completed the same entry first. The first complete entry wins and is never replaced:
    a run that found it (or wrote it) may still be loading from it. Only a directory without warmstart.json
    (not a complete entry) is set aside and replaced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save(tmp)
        (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
        while True:
            try:
                os.rename(tmp, path)  # fails on a non-empty directory: never replaces an entry
                return True
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
            if (path / "warmstart.json").is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale.", dir=path.parent))
            try:
                os.rename(path, aside / "entry")
            except FileNotFoundError:
                pass  # another writer moved it first
            shutil.rmtree(aside, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
