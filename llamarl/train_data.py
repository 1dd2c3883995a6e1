"""Where a training run's prompts come from: a deterministic, resumable stream plus a held-out split.

``TrainData`` resolves ``DataConfig.dataset``:

* ``synthetic:arithmetic[:options]`` — the built-in task (llamarl.data.ArithmeticTask): training prompts
  are its endless train stream, the held-out split its first ``eval_size`` held-out problems (disjoint by
  construction);
* a ``.jsonl`` / ``.parquet`` file — one sample of each of the first ``eval_size`` distinct prompts of a
  seeded permutation is held out, and every copy of those prompts leaves the training side; the remaining
  samples are visited epoch by epoch, each epoch in a fresh seeded order.

``data.eval_dataset`` (a .jsonl / .parquet file; veRL's ``data.val_files``, TRL's ``eval_dataset``) holds the
problems out instead: one sample of each of the first ``eval_size`` distinct prompts of its seeded permutation
(all of them when it has fewer, or with ``eval_size`` = 0) is the held-out split, and every training sample whose
prompt occurs anywhere in that file leaves the training side (counted in ``excluded``), for a file and for the
synthetic task's stream alike, so held-out accuracy never measures a prompt the policy trained on.

``data.few_shot = k`` prefixes every prompt (training, warm start and held-out alike) with k solved
examples drawn once, with the run's seed, from the training side: for a file, k samples of distinct
prompts that are then removed from it (never held out, never trained on); for the synthetic task, k of
its first 10·k training problems, and the training stream skips any later problem with the same prompt.

The stream position is one integer, ``cursor`` (samples handed out so far), which checkpoints record:
``TrainData(..., cursor=c)`` continues exactly where a run with that cursor stopped, provided the stream is
the same one. Checkpoints therefore record ``stream_id`` too, a hash of everything the order and content
depend on (the held-out split, the training pool and its seed or the task's first problems, and the prompt
format with its few-shot examples): a resume whose stream differs (an edited dataset file, a setting that
drops other prompts as too long) is refused instead of continuing at a position in another order.

``longest_prompt`` bounds the token length of every prompt the run can see (held-out ones included), so
the generator's KV cache can be sized once: exact for a file, and for the synthetic task the bound
tokens(template text + prompt) <= its UTF-8 bytes, plus the tokens the tokenizer adds to any text (each
token of a byte-level or character tokenizer covers at least one byte).

Given ``max_prompt_tokens`` (the context minus the generation length), prompts that do not fit never reach the
generator: a file's are dropped (counted; an error if none is left); the synthetic task's prompts all share
their shape, so if its longest ones (measured) do not fit, ``PromptsTooLong`` names the setting that makes
them long (``data.few_shot``, ``data.template``, ``data.system`` or the task's own ``data.dataset``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import functools
import itertools
import random
from typing import Iterator, Sequence

from llamarl.config import DataConfig
from llamarl.data import (PromptFormat, PromptFormatter, Sample, distinct_problems, load_dataset, select_shots,
                          shot_key)
from llamarl.eval import SYNTHETIC_PREFIX, parse_synthetic_spec


class TrainData:
    """``max_prompt_tokens``: file samples whose formatted prompt is longer are dropped up front (counted in
    ``dropped``; an error if none is left), so one over-long prompt cannot stop a run mid-way. ``fork``
    gives another stream over the same training pool (the warm start's, the probe's) without loading,
    encoding or splitting the file again. ``answers=False`` (a run scored by its reward model alone,
    reward.reward=none): file samples need no reference answer (``load_dataset(require_answers=False)``)."""

    def __init__(self, cfg: DataConfig, tokenizer, *, seed: int = 0, cursor: int = 0,
                 max_prompt_tokens: int | None = None, answers: bool = True):
        self.cfg = cfg
        self.dropped = 0  # prompts too long for max_prompt_tokens (training and held out)
        # training samples whose prompt is in data.eval_dataset (None for the synthetic task's endless stream,
        # which skips them)
        self.excluded: int | None = None if cfg.dataset.startswith(SYNTHETIC_PREFIX) else 0
        self._seed = seed
        eval_samples = _load_eval(cfg, answers) if cfg.eval_dataset is not None else None
        eval_prompts = {shot_key(s) for s in eval_samples or ()}
        self._task, self._pool = None, None  # the training stream's source: the synthetic task or the file's pool
        if cfg.dataset.startswith(SYNTHETIC_PREFIX):
            self._task, _ = parse_synthetic_spec(cfg.dataset)
            if eval_prompts:  # the eval file must leave training problems (checked here: the stream is endless)
                try:
                    next(_skipping(self._task.iter_split("train"), eval_prompts, cfg))
                except ValueError as e:
                    raise EvalDataError(str(e).removeprefix("data.eval_dataset ")) from None
            # the examples: from the first 10k training problems outside the eval file
            candidates = list(itertools.islice(_skipping(self._task.iter_split("train"), eval_prompts, cfg),
                                               10 * cfg.few_shot))
            shots = _pick_shots(candidates, cfg.few_shot, seed, cfg.dataset)
        else:
            samples = load_dataset(cfg.dataset, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                                   id_field=cfg.id_field, require_answers=answers)
            if eval_prompts:
                kept = [s for s in samples if shot_key(s) not in eval_prompts]
                self.excluded = len(samples) - len(kept)
                if not kept:
                    raise ValueError(f"every prompt of data.dataset {cfg.dataset} also occurs in data.eval_dataset "
                                     f"{cfg.eval_dataset}: nothing would be left to train on")
                samples = kept
            shots = _pick_shots(samples, cfg.few_shot, seed, cfg.dataset)
        self._shot_prompts = {shot_key(s) for s in shots}  # the problems shown solved (never trained on or held out)
        # what the synthetic task's training stream skips (a file's pool has them removed already)
        self._skipped_prompts = self._shot_prompts | eval_prompts
        self._eval_prompts = eval_prompts
        if self._task is not None:
            next(self._new_stream())  # a stream whose first 10,000 problems are all skipped raises here, up front
        self.formatter = PromptFormatter(PromptFormat(template=cfg.template, chat=cfg.chat, system=cfg.system),
                                         shots=shots, tokenizer=tokenizer)
        if self._task is not None:
            self.heldout = (self._task.heldout_samples(cfg.eval_size) if eval_samples is None
                            else self._eval_split(eval_samples, max_prompt_tokens))
            empty = Sample(id="", prompt="", answer="")
            text = self.formatter.render(empty)
            # a bound, not the count: no tokenizer makes more tokens than UTF-8 bytes, plus one for a prepended
            # word-boundary token ("▁", SentencePiece style), plus the special tokens of the empty prompt
            self.longest_prompt = (len(text.encode("utf-8")) + self._task.max_prompt_chars + 1
                                   + len(self.formatter.encode(empty)))
            if eval_samples is not None:  # file prompts: measured
                self.longest_prompt = max(self.longest_prompt, self._eval_longest)
            if max_prompt_tokens is not None:
                self._check_synthetic_length(tokenizer, max_prompt_tokens)
        else:
            samples = [s for s in samples if shot_key(s) not in self._shot_prompts]
            lengths = [len(self.formatter.encode(s)) for s in samples]
            if max_prompt_tokens is not None:
                kept = [s for s, n in zip(samples, lengths) if n <= max_prompt_tokens]
                lengths = [n for n in lengths if n <= max_prompt_tokens]
                self.dropped = len(samples) - len(kept)
                if not kept:
                    raise ValueError(f"data.dataset {cfg.dataset}: every one of its {len(samples)} prompts is longer "
                                     f"than {max_prompt_tokens} tokens, the model context minus "
                                     "generator.max_new_tokens; lower max_new_tokens, shorten data.template or "
                                     "use fewer data.few_shot examples")
                samples = kept
            if eval_samples is None:
                self.heldout, self._pool = _split_heldout(samples, cfg.eval_size, seed, cfg.dataset)
            else:
                self.heldout, self._pool = self._eval_split(eval_samples, max_prompt_tokens), samples
                lengths.append(self._eval_longest)
            self.longest_prompt = max(lengths)
        self.cursor = 0
        self._stream = self._new_stream()
        self.seek(cursor)

    def _eval_split(self, samples: list[Sample], max_prompt_tokens: int | None) -> list[Sample]:
        """The held-out split drawn from ``data.eval_dataset``'s ``samples``: those that fit ``max_prompt_tokens``
        (the others are counted in ``dropped``), then one sample of each of the first ``eval_size`` distinct
        prompts of a seeded permutation, or of every prompt when there are fewer or ``eval_size`` is 0. Sets
        ``_eval_longest``, the most tokens one of them takes (each prompt is encoded once)."""
        lengths = {id(s): len(self.formatter.encode(s)) for s in samples}  # (by object: ids may repeat)
        if max_prompt_tokens is not None:
            kept = [s for s in samples if lengths[id(s)] <= max_prompt_tokens]
            self.dropped += len(samples) - len(kept)
            if not kept:
                raise EvalDataError(f"{self.cfg.eval_dataset}: every one of its {len(samples)} prompts is longer "
                                    f"than {max_prompt_tokens} tokens, the model context minus "
                                    "generator.max_new_tokens; lower max_new_tokens or shorten data.template")
            samples = kept
        heldout = _draw_distinct(samples, self.cfg.eval_size, self._seed)
        self._eval_longest = max(lengths[id(s)] for s in heldout)
        return heldout

    def _check_synthetic_length(self, tokenizer, limit: int) -> None:
        """``PromptsTooLong`` if the synthetic task's prompts, formatted, take more than ``limit`` tokens,
        naming the setting that makes them long (found by measuring without it)."""
        def tokens(formatter: PromptFormatter) -> int:
            return _synthetic_prompt_tokens(self._task, formatter, self.heldout, self._shot_prompts)

        need = tokens(self.formatter)
        if need <= limit:
            return
        cfg, fmt = self.cfg, self.formatter.fmt
        without_shots = PromptFormatter(fmt, tokenizer=tokenizer)
        plain = PromptFormatter(PromptFormat(template=DataConfig.template, chat=cfg.chat, system=cfg.system),
                                tokenizer=tokenizer)
        if cfg.few_shot and tokens(without_shots) <= limit:
            field, what = "data.few_shot", f"data.few_shot={cfg.few_shot}"
        elif cfg.template != DataConfig.template and tokens(plain) <= limit:
            field, what = "data.template", f"data.template of {len(cfg.template)} characters"
        elif cfg.system is not None:
            field, what = "data.system", f"data.system of {len(cfg.system)} characters"
        else:
            field, what = "data.dataset", f"data.dataset={cfg.dataset}"
        raise PromptsTooLong(field, f"prompts take up to {need} tokens with {what}", need)

    @functools.cached_property
    def info_fields(self) -> frozenset[str]:
        """What a reward function may ask for by name from every sample of the run (Sample.reward_info);
        computed when asked (a user reward function's check), not for every run."""
        from llamarl.rewards.data_checks import common_fields

        return common_fields(self.samples)

    @property
    def samples(self) -> list[Sample]:
        """Every sample of a file dataset the run can see (held out, then training); for the synthetic task,
        whose training stream is endless, the held-out ones and the stream's first 64 (what the data checks read:
        the fields a reward function may ask for, the references a verifier must read)."""
        if self._task is not None:
            return self.heldout + list(itertools.islice(self._new_stream(), 64))
        return self.heldout + self._pool

    @functools.cached_property
    def stream_id(self) -> str:
        """A hash of the stream this position counts into (see the module docstring); 16 hex digits."""
        h = hashlib.sha256()

        def add(*parts: object) -> None:
            h.update(json.dumps(parts).encode("ascii") + b"\n")  # ASCII escapes: lone surrogates hash too

        # the format's settings and examples, not a rendered prompt: a chat template may print today's date
        fmt = self.formatter.fmt
        add("format", fmt.template, fmt.chat, fmt.system, fmt.shot_answer_template, fmt.shot_separator)
        for s in self.formatter.shots:
            add("shot", s.id, s.prompt, s.written_answer)
        for s in self.heldout:  # an eval file's by content: positional ids name the file, which may move
            add(*(("heldout", s.id) if self.cfg.eval_dataset is None else ("eval",)), s.prompt, s.answer)
        for prompt in sorted(self._eval_prompts):  # data.eval_dataset's prompts leave the training side
            add("excluded", prompt)
        if self._task is None:
            add("seed", self._seed)
            for s in self._pool:
                add("pool", s.id, s.prompt, s.answer)
        else:  # the task's stream is its spec's: its first problems name it
            for s in itertools.islice(self._new_stream(), 64):
                add("train", s.prompt, s.answer)
        return h.hexdigest()[:16]

    def _new_stream(self) -> Iterator[Sample]:
        if self._task is None:
            return _epochs(self._pool, self._seed)
        return _skipping(self._task.iter_split("train"), self._skipped_prompts, self.cfg)

    def fork(self, seed: int) -> "TrainData":
        """A stream over this one's training pool (the same held-out split and dropped prompts), in the order
        of ``seed`` (a file's epochs; the synthetic task's train stream has one order), from its start. This
        stream's position is left alone."""
        other = copy.copy(self)
        other.__dict__.pop("stream_id", None)  # a cached id names this stream, not the fork's
        other._seed, other.cursor = seed, 0
        other._stream = other._new_stream()
        return other

    def seek(self, cursor: int) -> None:
        if cursor < self.cursor:
            self._stream, self.cursor = self._new_stream(), 0
        for _ in itertools.islice(self._stream, cursor - self.cursor):
            pass
        self.cursor = cursor

    def next(self, n: int) -> list[Sample]:
        out = list(itertools.islice(self._stream, n))
        self.cursor += len(out)
        return out

    def encode(self, samples: Sequence[Sample]) -> list[list[int]]:
        return [self.formatter.encode(s) for s in samples]


class EvalDataError(ValueError):
    """``data.eval_dataset`` cannot be read or gives no held-out problem."""


class PromptsTooLong(ValueError):
    """The run's prompts do not fit the room the context leaves; ``field`` names the setting to change."""

    def __init__(self, field: str, message: str, tokens: int):
        super().__init__(message)
        self.field, self.tokens = field, tokens


def _synthetic_prompt_tokens(task, formatter: PromptFormatter, heldout: list[Sample], shot_prompts: set[str]) -> int:
    """The most tokens a formatted prompt of ``task`` takes: measured on its longest possible problems
    (``task.longest_prompts``), the first held-out and training problems. A measure, not a bound: with a
    subword tokenizer a rare problem may take a token more than measured."""
    longest = [Sample(f"longest-{i}", prompt, "") for i, prompt in enumerate(task.longest_prompts())]
    samples = longest + heldout[:64] + task.train_samples(64)
    return max(len(formatter.encode(s)) for s in samples if shot_key(s) not in shot_prompts)


def _pick_shots(pool: list[Sample], k: int, seed: int, name: str) -> list[Sample]:
    """``k`` examples of distinct prompts from ``pool``, drawn with ``seed`` (none for k = 0)."""
    if not k:
        return []
    distinct = distinct_problems(pool)
    if k >= len(distinct):
        raise ValueError(f"data.few_shot={k}: data.dataset {name} has only {len(distinct)} distinct prompts, and "
                         "the examples must leave some to train on; lower data.few_shot")
    return select_shots(distinct, k, seed=seed)


def _epochs(samples: list[Sample], seed: int) -> Iterator[Sample]:
    for epoch in itertools.count():
        order = list(range(len(samples)))
        random.Random(f"{seed}:epoch:{epoch}").shuffle(order)
        for i in order:
            yield samples[i]


def _skipping(stream: Iterator[Sample], skip: set[str], cfg: DataConfig) -> Iterator[Sample]:
    """``stream``'s samples whose prompt is not in ``skip``; ValueError if its first 10,000 are all skipped,
    instead of searching an endless stream forever. Once one sample was found the stream never gives up (that
    problem recurs), so a check of the first sample (TrainData's, up front) is final."""
    found, skipped = False, 0
    for s in stream:
        if shot_key(s) not in skip:
            found = True
            yield s
            continue
        skipped += 1
        if not found and skipped >= 10_000:
            held = (f"data.eval_dataset {cfg.eval_dataset}" if cfg.eval_dataset is not None
                    else f"the data.few_shot={cfg.few_shot} examples")
            raise ValueError(f"{held} holds every one of the first {skipped} training problems of {cfg.dataset}: "
                             "hold out fewer problems or enlarge the task (digits, n_terms, ops)")


def _load_eval(cfg: DataConfig, answers: bool = True) -> list[Sample]:
    """``data.eval_dataset``'s samples, read with the training file's field names."""
    try:
        return load_dataset(cfg.eval_dataset, prompt_field=cfg.prompt_field, answer_field=cfg.answer_field,
                            id_field=cfg.id_field, require_answers=answers)
    except (OSError, ValueError, ImportError) as e:
        raise EvalDataError(str(e)) from None


def _heldout_order(n: int, seed: int) -> list[int]:
    order = list(range(n))
    random.Random(f"{seed}:heldout").shuffle(order)
    return order


def _draw_distinct(samples: list[Sample], size: int, seed: int) -> list[Sample]:
    """One sample of each of the first ``size`` distinct prompts of ``samples``' seeded permutation (0: of all)."""
    held: dict[str, Sample] = {}
    for i in _heldout_order(len(samples), seed):
        if len(held) == size > 0:
            break
        held.setdefault(shot_key(samples[i]), samples[i])
    return list(held.values())


def _split_heldout(samples: list[Sample], size: int, seed: int, name: str) -> tuple[list[Sample], list[Sample]]:
    """(held-out, training pool): ``size`` samples of distinct prompts, drawn in a seeded shuffle, and every
    sample whose prompt is not held out. A prompt that occurs several times in the file is held out with
    all its copies, so held-out accuracy never measures a prompt the policy trained on."""
    held_out = _draw_distinct(samples, size, seed)
    keys = {shot_key(s) for s in held_out}
    pool = [samples[i] for i in _heldout_order(len(samples), seed) if shot_key(samples[i]) not in keys]
    if len(held_out) < size or not pool:
        distinct = len({shot_key(s) for s in samples})
        raise ValueError(f"data.dataset {name} has {len(samples)} usable samples with {distinct} distinct prompts, "
                         f"not more than data.eval_size={size}: nothing would be left to train on; lower "
                         "data.eval_size")
    return held_out, pool
