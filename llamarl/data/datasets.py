"""Prompt/answer datasets: local JSONL or Parquet files -> a list of ``Sample``.

A ``Sample(id, prompt, answer)`` is what every stage passes around: the prompt text before any
formatting (templates, few-shot prefixes and chat templates are ``prompts.py``'s concern) and the
reference answer *in the form the verifier expects*. GSM8K files store full solutions ending in
``#### 72``; ``load_dataset`` reduces those to ``"72"`` (``reduce_answer=True``), so the verifier and the
eval logs see the final answer only, and keeps the full text in ``Sample.solution``: a few-shot example
shows it (the reasoning and the ``#### 72`` the verifier and the format reward look for), not the bare number.

File formats:
  * ``.jsonl``: one JSON object per line, blank lines skipped;
  * ``.parquet``: one row per sample (needs ``pyarrow``).
``prompt_field``/``answer_field`` name the columns (defaults: GSM8K's ``question``/``answer``); a prompt
is text, or a conversation (a list of ``{"role", "content"}`` messages ending with a user turn, as in
TRL's conversational datasets; it needs chat formatting). Sample ids
come from ``id_field`` when every record has it (must be unique), else ``"<file stem>-<index>"``
(``id_field=None``: always; e.g. for a file whose ids repeat).

A record's other fields, the id field as written included, are kept in ``Sample.extra``: a reward function
that names one of them as a keyword parameter receives it (llamarl.rewards.registry).

Numeric answers become text: integral numbers as integers (``72.0`` → ``"72"``), others in positional
notation with the digits of Python's shortest repr (``1e-05`` → ``"0.00001"``); NaN/inf and empty answers
are errors (such a sample could never be scored).

Errors name the file, the line (JSONL) or row (Parquet), the missing field and the fields present.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from llamarl._text import decimal_text

GSM8K_MARKER = "####"
SUPPORTED_SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class Sample:
    """One problem: a unique id, the raw prompt text, and the reference answer for the verifier.

    A conversational sample (TRL's format: the prompt field holds a list of ``{"role", "content"}``
    messages) keeps them in ``messages`` as (role, content) pairs, ending with a user turn; its ``prompt``
    is then their plain rendering, one ``role: content`` line per message, which identifies it (held-out
    split, few-shot exclusion) and is what logs show."""

    id: str
    prompt: str
    answer: str
    messages: tuple[tuple[str, str], ...] | None = None
    # the record's other fields (for reward functions that ask for them by name); not part of equality
    extra: Mapping[str, Any] | None = field(default=None, compare=False)
    # the answer as written, when ``answer`` was reduced from it (a GSM8K solution ending in "#### 72"):
    # what a few-shot example shows; None when the answer is the text as written
    solution: str | None = field(default=None, compare=False)

    @property
    def written_answer(self) -> str:
        """The answer as the file wrote it: ``solution`` when ``answer`` was reduced from it, else ``answer``."""
        return self.solution or self.answer

    def reward_info(self) -> dict[str, Any]:
        """What a reward function may ask for by name (llamarl.rewards.registry.call_reward): the record's
        other fields, then ``prompt`` (the text before formatting) and ``sample_id``, which take precedence."""
        info = {k: v for k, v in (self.extra or {}).items() if k not in ("completion", "answer")}
        return {**info, "prompt": self.prompt, "sample_id": self.id}


def reduce_answer(answer: str) -> str:
    """GSM8K convention: the final answer is what follows the last ``####``; otherwise the stripped text."""
    if GSM8K_MARKER in answer:
        return answer.rsplit(GSM8K_MARKER, 1)[1].strip()
    return answer.strip()


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # -sig: a leading byte-order mark is not data
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as "
                         "UTF-8") from None
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                             "JSON object") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object per line, got {type(obj).__name__}")
        records.append((f"line {lineno}", obj))
    return records


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow (or convert it to .jsonl)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid & co. for corrupt files
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
    return [(f"row {i}", row) for i, row in enumerate(rows)]


def _as_messages(value: Any, field: str, where: str, path: Path) -> tuple[tuple[str, str], ...] | None:
    """A conversational prompt as (role, content) pairs; None if ``value`` is not a list (plain text)."""
    if not isinstance(value, list):
        return None
    pairs = []
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{path} {where}: field {field!r} is a list, so a conversation, but its item {i} is not "
                             f"a {{\"role\": str, \"content\": str}} message: {m!r:.80}")
        pairs.append((m["role"], m["content"]))
    if not pairs or pairs[-1][0] != "user":
        raise ValueError(f"{path} {where}: the conversation in field {field!r} must end with a user message (the "
                         f"model answers it), got {pairs[-1][0] if pairs else 'no message'!r} last")
    return tuple(pairs)


def _as_text(value: Any, field: str, where: str, path: Path, *, numbers_ok: bool) -> str:
    if isinstance(value, str):
        return value
    if numbers_ok and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if numbers_ok and isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} {where}: field {field!r} is {value}; an answer must be a finite number or text")
        return decimal_text(value)  # 72.0 -> "72", 1e21 -> "1000000000000000000000", 1e-05 -> "0.00001"
    kind = "a string or number" if numbers_ok else "a string"
    raise ValueError(f"{path} {where}: field {field!r} must be {kind}, got {type(value).__name__} {value!r:.80}")


def load_dataset(
    path: str | os.PathLike,
    prompt_field: str = "question",
    answer_field: str = "answer",
    *,
    id_field: str | None = "id",
    reduce_answers: bool = True,
    limit: int | None = None,
    require_answers: bool = True,
) -> list[Sample]:
    """Read ``path`` (.jsonl or .parquet) into samples; see the module docstring for the conventions.
    ``require_answers=False`` (a run scored by a reward model alone): a record may lack the answer field, or
    hold an empty or non-text one; its answer is then "" (text or a number is still read, for the logs)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"dataset file {str(p)!r} does not exist")
    if not p.is_file():
        raise ValueError(f"dataset path {str(p)!r} is not a file")
    suffix = p.suffix.lower()
    if suffix == ".jsonl":
        records = _read_jsonl(p)
    elif suffix == ".parquet":
        records = _read_parquet(p)
    else:
        raise ValueError(f"dataset file {str(p)!r}: unsupported extension {suffix!r}; use one of {SUPPORTED_SUFFIXES}")
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be a positive number of samples, got {limit}")
        records = records[:limit]
    if not records:
        raise ValueError(f"dataset file {str(p)!r} holds no records")

    use_ids = id_field is not None and all(id_field in r for _, r in records)
    samples: list[Sample] = []
    seen: dict[str, str] = {}
    for index, (where, rec) in enumerate(records):
        for name in (prompt_field, answer_field) if require_answers else (prompt_field,):
            if name not in rec:
                raise ValueError(
                    f"{p} {where}: missing field {name!r}; fields present: {sorted(rec)}. "
                    "Pick the right ones with data.prompt_field= / data.answer_field= (llamarl.train --set) or "
                    "--prompt-field / --answer-field (llamarl.eval)"
                )
        messages = _as_messages(rec[prompt_field], prompt_field, where, p)
        prompt = ("\n".join(f"{role}: {content}" for role, content in messages) if messages is not None
                  else _as_text(rec[prompt_field], prompt_field, where, p, numbers_ok=False))
        raw = rec.get(answer_field, "")
        if not require_answers and (isinstance(raw, bool) or not isinstance(raw, (str, int, float))):
            raw = ""
        written = _as_text(raw, answer_field, where, p, numbers_ok=True)
        answer = reduce_answer(written) if reduce_answers else written
        if require_answers and not answer.strip():
            raise ValueError(f"{p} {where}: field {answer_field!r} is empty" + (" after the final '####'" if
                             reduce_answers and GSM8K_MARKER in rec[answer_field] else "") +
                             "; every sample needs a reference answer to be scored against")
        sid = _as_text(rec[id_field], id_field, where, p, numbers_ok=True) if use_ids else f"{p.stem}-{index}"
        if sid in seen:
            raise ValueError(f"{p} {where}: duplicate id {sid!r} (first seen at {seen[sid]}); ids must be unique: "
                             f"to number the samples by position instead, set data.id_field=null (llamarl.eval: "
                             f"--id-field none)")
        seen[sid] = where
        extra = {k: v for k, v in rec.items() if k not in (prompt_field, answer_field)}  # the id too, as written
        samples.append(Sample(sid, prompt, answer, messages, extra or None,
                              written.strip() if answer != written.strip() else None))
    return samples


def write_jsonl(
    samples: Iterable[Sample],
    path: str | os.PathLike,
    prompt_field: str = "question",
    answer_field: str = "answer",
    id_field: str = "id",
) -> Path:
    """Write samples so that ``load_dataset(path, prompt_field, answer_field, id_field=id_field)`` reads them
    back unchanged (``extra`` too, as the record's other fields; a reduced answer is written as its
    ``solution``, which reduces to it again)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            prompt = s.prompt if s.messages is None else [{"role": r, "content": c} for r, c in s.messages]
            record = {id_field: s.id, **(s.extra or {}), prompt_field: prompt, answer_field: s.written_answer}
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, p)
    return p


def check_unique_ids(samples: Sequence[Sample]) -> None:
    """Raise if two samples share an id (results are keyed by id)."""
    seen: set[str] = set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"duplicate sample id {s.id!r}; ids must be unique")
        seen.add(s.id)
