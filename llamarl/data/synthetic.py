"""The built-in synthetic task: integer arithmetic with exact answers ("123+456=" -> "579").

It is small enough for a tiny character-level model to learn on a CPU, which makes it the embedded
default's task and a fast end-to-end check of the RL loop (rewards should rise as the policy improves).

Problems: ``n_terms`` integers, each uniform in [0, 10^digits), joined by operators drawn from ``ops``
(``+ - * /``) and evaluated with the usual precedence (``*``/``/`` before ``+``/``-``, left to right). A
``/`` always divides exactly: its divisor is drawn among the divisors (< 10^digits) of the product/
quotient chain it divides (any nonzero term when that value is 0), so every answer is an integer, written
in plain decimal with a leading ``-`` when negative. Prompt ``"12*30/4-5="``, answer ``"85"``. The
alphabet stays within digits, ``+-*/=``; a prompt has at most ``n_terms*(digits+1)`` characters.

Splits: a problem is held out iff a keyed hash of its prompt text falls below ``heldout_fraction``, so
the train and held-out splits can never share a problem, whatever the sample counts. Each split is a
deterministic stream from ``random.Random(f"{seed}:{split}")``: ``train_samples(n)`` is the first n
training problems (i.i.d., repeats possible in a small problem space), ``heldout_samples(n)`` the first n
*distinct* held-out problems; both are prefix-stable (``train_samples(10)`` starts ``train_samples(20)``).
``write_jsonl`` exports a split so the same data flows through ``load_dataset``; the verifier is the
``"exact"`` reward.

A dataset spec string names the task on command lines and in configs:
``synthetic:arithmetic[:digits=3,n_terms=2,ops=+-,seed=0,heldout_fraction=0.1,n=200]``
(``parse_synthetic_spec`` -> the task and a sample count).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llamarl.data.datasets import Sample, write_jsonl

SYNTHETIC_PREFIX = "synthetic:arithmetic"
DEFAULT_SYNTHETIC_N = 200
ALL_OPS = ("+", "-", "*", "/")
SPLITS = ("train", "heldout")
MAX_DIGITS_WITH_DIVISION = 4  # divisor search is O(10^digits)


@dataclass(frozen=True)
class ArithmeticTask:
    """Templated arithmetic problems with exact integer answers (see the module docstring)."""

    digits: int = 3
    n_terms: int = 2
    ops: tuple[str, ...] = ("+",)
    seed: int = 0
    heldout_fraction: float = 0.1
    pad: bool = False  # zero-pad every operand to `digits` characters ("07+45="): aligned digits learn faster

    def __post_init__(self) -> None:
        ops = tuple(self.ops)  # accepts "+-" or ["+", "-"] too
        object.__setattr__(self, "ops", ops)
        if not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be an int in [1, 9], got {self.digits!r}")
        if not isinstance(self.n_terms, int) or self.n_terms < 2:
            raise ValueError(f"n_terms must be an int >= 2, got {self.n_terms!r}")
        if not ops or any(op not in ALL_OPS for op in ops):
            raise ValueError(f"ops must be a non-empty subset of {ALL_OPS}, got {self.ops!r}")
        if "/" in ops and self.digits > MAX_DIGITS_WITH_DIVISION:
            raise ValueError(f"division supports digits <= {MAX_DIGITS_WITH_DIVISION}, got digits={self.digits}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must lie strictly between 0 and 1, got {self.heldout_fraction!r}")

    @property
    def max_prompt_chars(self) -> int:
        """Longest possible prompt: n_terms numbers of ``digits`` chars, the operators and '='."""
        return self.n_terms * (self.digits + 1)

    def longest_prompts(self) -> list[str]:
        """Prompts of ``max_prompt_chars`` characters, one per operator (every operand ``digits`` nines):
        what a tokenizer's longest encoding of this task's problems is measured on."""
        return [op.join(["9" * self.digits] * self.n_terms) + "=" for op in self.ops]

    # ---------------------------------------------------------------- problems
    def problem(self, rng: random.Random) -> tuple[str, str]:
        """One random (prompt, answer) pair drawn with ``rng``."""
        hi = 10**self.digits
        first = rng.randrange(hi)
        fmt = f"0{self.digits}d" if self.pad else "d"
        text = [format(first, fmt)]
        total, sign, group = 0, 1, first  # value = total + sign * group, group = current * / chain
        for _ in range(self.n_terms - 1):
            op = rng.choice(self.ops)
            if op == "/":
                term = self._divisor(group, rng)
                group //= term  # exact by construction; group >= 0 since every term is >= 0
            else:
                term = rng.randrange(hi)
                if op == "*":
                    group *= term
                else:
                    total += sign * group
                    sign, group = (1 if op == "+" else -1), term
            text += [op, format(term, fmt)]
        return "".join(text) + "=", str(total + sign * group)

    def _divisor(self, value: int, rng: random.Random) -> int:
        hi = 10**self.digits
        if value == 0:
            return rng.randrange(1, hi)
        v = abs(value)
        return rng.choice([d for d in range(1, min(hi, v + 1)) if v % d == 0])

    def is_heldout(self, prompt: str) -> bool:
        """The split rule: a keyed hash of the prompt text below ``heldout_fraction``."""
        digest = hashlib.blake2b(prompt.encode(), digest_size=8, key=str(self.seed).encode()).digest()
        return int.from_bytes(digest, "big") / 2.0**64 < self.heldout_fraction

    # ---------------------------------------------------------------- splits
    def iter_split(self, split: str) -> Iterator[Sample]:
        """The endless deterministic stream of a split (held-out problems never repeat)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        heldout = split == "heldout"
        rng = random.Random(f"{self.seed}:{split}")
        seen: set[str] = set()
        index, misses = 0, 0
        while True:
            prompt, answer = self.problem(rng)
            if self.is_heldout(prompt) != heldout or (heldout and prompt in seen):
                misses += 1
                if misses > 10_000 + 100 * index:
                    raise ValueError(
                        f"found only {index} {split} problems for {self}; the problem space is too small, "
                        "raise digits/n_terms or add ops"
                    )
                continue
            if heldout:
                seen.add(prompt)
            yield Sample(f"arith-{split}-{index}", prompt, answer)
            index += 1

    def heldout_capacity(self) -> int | None:
        """A bound on the number of distinct held-out problems (None: too many to matter): the prompt space (at
        most 10^(digits*n_terms) * len(ops)^(n_terms-1) texts) times heldout_fraction, plus six standard
        deviations of the hash split and 10, so only a count that cannot be met is refused."""
        if self.digits * self.n_terms > 12:
            return None
        space = 10 ** (self.digits * self.n_terms) * len(self.ops) ** (self.n_terms - 1)
        f = self.heldout_fraction
        return int(f * space + 6 * math.sqrt(f * (1 - f) * space) + 10)

    def samples(self, split: str, n: int) -> list[Sample]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"number of samples must be an int >= 0, got {n!r}")
        cap = self.heldout_capacity() if split == "heldout" else None
        if cap is not None and n > cap:  # (else the search for more distinct problems runs for minutes)
            raise ValueError(f"{n} distinct held-out problems asked of {self}, which has at most {cap}; ask for "
                             "fewer (data.eval_size, --limit) or enlarge the task (digits, n_terms, ops)")
        stream = self.iter_split(split)
        return [next(stream) for _ in range(n)]

    def train_samples(self, n: int) -> list[Sample]:
        """The first ``n`` training problems."""
        return self.samples("train", n)

    def heldout_samples(self, n: int) -> list[Sample]:
        """The first ``n`` distinct held-out problems."""
        return self.samples("heldout", n)

    def write_jsonl(self, path: str | os.PathLike, split: str, n: int) -> Path:
        """Export ``n`` samples of ``split`` as JSONL readable by ``load_dataset(path)``."""
        return write_jsonl(self.samples(split, n), path)


def parse_synthetic_spec(spec: str) -> tuple[ArithmeticTask, int]:
    """``synthetic:arithmetic[:digits=3,n_terms=2,ops=+-,seed=0,heldout_fraction=0.1,pad=0,n=200]``."""
    if not spec.startswith(SYNTHETIC_PREFIX):
        raise ValueError(f"not a synthetic dataset spec: {spec!r}")
    rest = spec[len(SYNTHETIC_PREFIX) :]
    options: dict[str, str] = {}
    if rest:
        if not rest.startswith(":"):
            raise ValueError(f"synthetic dataset spec {spec!r}: expected ':key=value,...' after {SYNTHETIC_PREFIX!r}")
        for item in filter(None, rest[1:].split(",")):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"synthetic dataset spec {spec!r}: option {item!r} is not key=value")
            options[key.strip()] = value.strip()
    known = {"digits", "n_terms", "ops", "seed", "heldout_fraction", "n", "pad"}
    unknown = set(options) - known
    if unknown:
        raise ValueError(
            f"synthetic dataset spec {spec!r}: unknown option(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    try:
        kwargs: dict[str, Any] = {key: int(options[key]) for key in ("digits", "n_terms", "seed") if key in options}
        if "heldout_fraction" in options:
            kwargs["heldout_fraction"] = float(options["heldout_fraction"])
        n = int(options.get("n", DEFAULT_SYNTHETIC_N))
    except ValueError as e:
        raise ValueError(f"synthetic dataset spec {spec!r}: {e}") from None
    if "ops" in options:
        kwargs["ops"] = tuple(options["ops"])
    if "pad" in options:
        if options["pad"] not in ("0", "1"):
            raise ValueError(f"synthetic dataset spec {spec!r}: pad must be 0 or 1, got {options['pad']!r}")
        kwargs["pad"] = options["pad"] == "1"
    return ArithmeticTask(**kwargs), n
