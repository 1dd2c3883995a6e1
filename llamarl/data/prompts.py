"""Prompt rendering: a ``Sample`` -> the text (and token ids) the policy model sees.

Three layers, each optional:
  1. template: a raw string with a ``{prompt}`` placeholder, e.g. ``"Question: {prompt}\\nAnswer:"``.
     Substitution is literal (``str.replace``), so LaTeX braces in a template need no escaping.
  2. few-shot prefix: k solved examples (``Sample``s, e.g. from the training split) shown before the
     question. Raw mode renders each as ``template(prompt) + shot_answer_template(solution) + separator``;
     chat mode renders them as user/assistant turns. An example shows its ``solution`` (the answer as the
     file wrote it, e.g. a GSM8K solution ending in ``#### 72``) when it has one, else its ``answer``. A
     sample whose prompt is one of the examples' cannot be rendered (its answer would leak): the check is
     on the prompt (``shot_key``), not the id, since ids of two files may coincide.
  3. chat template: ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` over
     ``[system?] + [user, assistant] * k + [user]``; the template decides every special token.

Token ids: raw text gets the special tokens the tokenizer puts before a text (``prefix_ids``: its
post-processor's, as transformers' ``tokenizer(text)``; ``add_bos=None`` means exactly that); chat text
gets none, since chat templates write their own.

``PromptDataset`` holds the samples with their rendered text and token ids (encoded once, up front, so a
prompt over ``max_prompt_tokens`` is reported at construction, not mid-run) and yields shuffled
batches per epoch, deterministically from ``(seed, epoch)``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

from llamarl.data.datasets import Sample, check_unique_ids

PROMPT_PLACEHOLDER = "{prompt}"
ANSWER_PLACEHOLDER = "{answer}"


class Tokenizer(Protocol):
    bos_id: int | None
    eos_id: int
    prefix_ids: Sequence[int]

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class PromptFormat:
    """How a sample becomes model input (see the module docstring)."""

    template: str = PROMPT_PLACEHOLDER
    chat: bool = False
    system: str | None = None
    shot_answer_template: str = ANSWER_PLACEHOLDER
    shot_separator: str = "\n"
    add_bos: bool | None = None  # None: raw text gets the tokenizer's prefix_ids (as transformers), chat text none

    def __post_init__(self) -> None:
        if PROMPT_PLACEHOLDER not in self.template:
            raise ValueError(f"prompt template {self.template!r} must contain the placeholder {PROMPT_PLACEHOLDER}")
        if ANSWER_PLACEHOLDER not in self.shot_answer_template:
            raise ValueError(
                f"shot_answer_template {self.shot_answer_template!r} must contain the placeholder {ANSWER_PLACEHOLDER}"
            )
        if self.system is not None and not self.chat:
            raise ValueError("a system message needs chat=True (raw prompts have no roles; put it in the template)")


_LITERAL_ESCAPE_RE = re.compile(r"\\[nt](?![a-z])")  # not LaTeX's \neq, \nu, \text, \times, \theta...


def literal_escapes(text: str | None) -> bool:
    """Whether ``text`` holds a backslash and n or t as two characters where a newline or tab was likely meant
    (a command-line value is taken literally): not where a lower-case letter follows, as in LaTeX commands."""
    return bool(text) and _LITERAL_ESCAPE_RE.search(text) is not None


def shot_key(sample: Sample) -> str:
    """What makes two samples the same problem for the few-shot leak check: the prompt text, stripped (a
    conversation's ``prompt`` is its plain rendering, so it covers the messages)."""
    return sample.prompt.strip()


def distinct_problems(pool: Sequence[Sample]) -> list[Sample]:
    """One sample per problem (``shot_key``), in the order problems first appear; of a problem the pool holds
    twice, its last sample."""
    return list({shot_key(s): s for s in pool}.values())


def select_shots(pool: Sequence[Sample], k: int, *, seed: int = 0, exclude: Sequence[Sample] = ()) -> list[Sample]:
    """``k`` examples of distinct problems drawn deterministically from ``pool`` (a problem the pool holds
    twice counts once), never the problem of one in ``exclude`` (compared by ``shot_key``)."""
    if k < 0:
        raise ValueError(f"number of few-shot examples must be >= 0, got {k}")
    banned = {shot_key(s) for s in exclude}
    candidates = [s for s in distinct_problems(pool) if shot_key(s) not in banned]
    if k > len(candidates):
        raise ValueError(f"asked for {k} few-shot examples but only {len(candidates)} candidates are available")
    return random.Random(f"few-shot:{seed}").sample(candidates, k)


class PromptFormatter:
    """Renders samples under a ``PromptFormat`` with fixed few-shot examples."""

    def __init__(self, fmt: PromptFormat = PromptFormat(), *, shots: Sequence[Sample] = (),
                 tokenizer: Tokenizer | None = None) -> None:
        if fmt.chat and tokenizer is None:
            raise ValueError("chat formatting needs a tokenizer (its apply_chat_template renders the messages)")
        self.fmt = fmt
        self.shots = tuple(shots)
        self.tokenizer = tokenizer
        self._shot_keys = {shot_key(s) for s in self.shots}

    def _question(self, prompt: str) -> str:
        return self.fmt.template.replace(PROMPT_PLACEHOLDER, prompt)

    def _answer(self, answer: str) -> str:
        return self.fmt.shot_answer_template.replace(ANSWER_PLACEHOLDER, answer)

    def messages(self, sample: Sample) -> list[dict[str, str]]:
        """The chat messages for ``sample`` (also meaningful in raw mode, for logging): the system message,
        each shot as a user turn (a conversational one: its turns) and the assistant's answer, then the
        sample's user turn (a conversational one: its turns). The template wraps the last user turn of each;
        a conversation's own system messages come first, in place of ``fmt.system``."""
        own = [{"role": r, "content": c} for r, c in sample.messages or () if r == "system"]
        msgs = own or ([{"role": "system", "content": self.fmt.system}] if self.fmt.system is not None else [])
        for shot in self.shots:
            msgs += self._turns(shot)
            msgs.append({"role": "assistant", "content": self._answer(shot.written_answer)})
        return msgs + self._turns(sample)

    def _turns(self, sample: Sample) -> list[dict[str, str]]:
        """A sample's turns without system messages, the template applied to the last (user) one."""
        if sample.messages is None:
            return [{"role": "user", "content": self._question(sample.prompt)}]
        turns = [{"role": r, "content": c} for r, c in sample.messages if r != "system"]
        turns[-1] = {"role": "user", "content": self._question(turns[-1]["content"])}
        return turns

    def render(self, sample: Sample) -> str:
        """The exact text the model is prompted with."""
        if shot_key(sample) in self._shot_keys:
            raise ValueError(f"sample {sample.id!r} has the prompt of one of the few-shot examples; its answer would "
                             "leak (drop it from the samples, or pick other examples)")
        if not self.fmt.chat and (sample.messages is not None or any(s.messages is not None for s in self.shots)):
            raise ValueError(f"sample {sample.id!r} is a conversation (a list of messages), which only a chat "
                             "template can render; use chat formatting (data.chat=true, llamarl.eval --chat)")
        if self.fmt.chat:
            assert self.tokenizer is not None
            text = self.tokenizer.apply_chat_template(self.messages(sample), add_generation_prompt=True)
            if not isinstance(text, str):
                raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected the rendered str")
            return text
        prefix = "".join(self._question(s.prompt) + self._answer(s.written_answer) + self.fmt.shot_separator
                         for s in self.shots)
        return prefix + self._question(sample.prompt)

    def add_bos(self) -> bool:
        if self.fmt.add_bos is not None:
            return self.fmt.add_bos
        return not self.fmt.chat and bool(getattr(self.tokenizer, "prefix_ids", ()))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of an already rendered prompt (BOS per ``add_bos``)."""
        if self.tokenizer is None:
            raise ValueError("encoding needs a tokenizer; pass tokenizer= to PromptFormatter")
        return list(self.tokenizer.encode(text, add_bos=self.add_bos()))

    def encode(self, sample: Sample) -> list[int]:
        """Token ids of ``render(sample)``."""
        return self.encode_text(self.render(sample))


@dataclass(frozen=True)
class Prompt:
    """A sample with its rendered text and the token ids the generator receives."""

    sample: Sample
    text: str
    token_ids: tuple[int, ...]


class PromptDataset(Sequence[Prompt]):
    """Samples rendered and tokenized once; index it, or iterate shuffled batches per epoch."""

    def __init__(
        self,
        samples: Sequence[Sample],
        tokenizer: Tokenizer,
        fmt: PromptFormat = PromptFormat(),
        *,
        shots: Sequence[Sample] = (),
        max_prompt_tokens: int | None = None,
        drop_long: bool = False,
    ) -> None:
        if not samples:
            raise ValueError("PromptDataset needs at least one sample")
        check_unique_ids(samples)
        self.formatter = PromptFormatter(fmt, shots=shots, tokenizer=tokenizer)
        prompts: list[Prompt] = []
        too_long: list[tuple[str, int]] = []
        for s in samples:
            text = self.formatter.render(s)
            ids = tuple(self.formatter.encode_text(text))
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                too_long.append((s.id, len(ids)))
                continue
            prompts.append(Prompt(s, text, ids))
        if too_long and not drop_long:
            sid, n = too_long[0]
            raise ValueError(
                f"{len(too_long)} of {len(samples)} prompts exceed max_prompt_tokens={max_prompt_tokens} (e.g. "
                f"sample {sid!r}: {n} tokens); shorten the template/few-shot prefix, raise the limit, or pass "
                "drop_long=True to skip them"
            )
        if not prompts:
            raise ValueError(f"every prompt exceeds max_prompt_tokens={max_prompt_tokens}")
        self.prompts = prompts
        self.dropped_ids: tuple[str, ...] = tuple(sid for sid, _ in too_long)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: Any) -> Any:
        return self.prompts[index]

    @property
    def samples(self) -> list[Sample]:
        return [p.sample for p in self.prompts]

    def batches(self, batch_size: int, *, epoch: int = 0, seed: int = 0, shuffle: bool = True,
                drop_last: bool = False) -> Iterator[list[Prompt]]:
        """One epoch of batches; the order depends only on ``(seed, epoch)``."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        order = list(range(len(self.prompts)))
        if shuffle:
            random.Random(f"prompt-batches:{seed}:{epoch}").shuffle(order)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            if drop_last and len(chunk) < batch_size:
                return
            yield [self.prompts[i] for i in chunk]
