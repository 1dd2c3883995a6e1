"""Stop strings: a completion ends at the first token whose text contains one of them (vLLM's ``stop``).

Definition. For generated tokens y_1..y_m, stop strings S and ``decode`` (the tokenizer's, special tokens
skipped: the text the verifier scores), the completion keeps y_1..y_e with

    e = min { k : some s in S occurs in decode(y_1..y_k) }

(the stop string is kept, with whatever else the e-th token spells; no such k: no stop). The kept tokens
are exactly what the trainer trains on and their text exactly what the reward function reads, so the two
never disagree. Matching text, not token ids, makes a stop independent of how the model happened to
tokenize it: "\\n\\nQuestion:" ends a completion written as "\\n\\n" + "Question" + ":" or as ".\\n\\n" +
"Question:" alike.

``first_end(ids)`` finds e exactly, by trying k = 1, 2, ... over the tokens that could end a stop (below) and
decoding those prefixes. The predicate "decode(ids[:k]) contains a stop" is not monotone in k: a decoder
writes U+FFFD for bytes that do not (yet) form valid UTF-8, and ByteFallback decoders (Llama 2's) do so for
the whole run of byte tokens, so a newline spelled <0x0A> shows in one prefix and is gone from the next,
while the run is incomplete. What holds: when decode(ids) has no U+FFFD, each prefix's text is a prefix of it
with some trailing characters masked as U+FFFD, so a stop (which may not contain U+FFFD) in any prefix is in
decode(ids) too; one decode then settles that a completion has no stop, the common case. The same holds for
the longest prefix without U+FFFD when only a character cut at the end (by the token budget) spoils the
text: then only the few prefixes past it are tried. Otherwise (a stop, or U+FFFD inside the text) the scan
costs a decode of each candidate's prefix, O(m) each.

Early exit (``TailScanner``, used by the generation engine at its host synchronisations). Checking only at
the end would be exact but would let a stopped row decode to its budget. The scanner keeps each row's
tokens on the host and, when a new token could complete a stop, decodes the row's last ``window`` tokens;
a stop in that text (or, when it holds U+FFFD, in the text of one of its prefixes: bounded by the window)
is only a hint, confirmed by ``first_end``. So early exit never changes which tokens
a completion keeps (the engine applies ``first_end`` to every finished row), only when a stopped row stops
costing compute (with sampling, earlier compaction changes which random numbers the other rows draw, never
their distribution: llamarl.generation.engine). A token can complete a stop only if the text it adds
contains a stop's last character, so rows whose new tokens add none of those characters are skipped without
a decode. The text a token adds is read once per id as decode([t, t]) minus decode([t]) (after another token,
so a decoder that drops the leading space of a text's first word does not hide it); a token that adds part
of a character (U+FFFD), nothing, or text that does not extend decode([t]) is always a candidate.
"""

from __future__ import annotations

from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

REPLACEMENT_CHAR = "\ufffd"
MAX_CUT_TOKENS = 8  # tokens of a character cut at a completion's end that first_end steps back over


def check_stop_strings(name: str, stops: object) -> tuple[str, ...]:
    """``stops`` as a tuple of non-empty strings, or a ValueError naming ``name`` and what is wrong."""
    if isinstance(stops, str):
        raise ValueError(f"{name} must be a list of strings, got the string {stops!r}; write [{stops!r}]")
    try:
        out = tuple(stops)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be a list of strings, got {stops!r}") from None
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name} must hold non-empty strings, got {s!r} in {list(out)!r}")
        if REPLACEMENT_CHAR in s:
            raise ValueError(f"{name}: {s!r} holds U+FFFD, the character decoders put for bytes that are not valid "
                             "UTF-8; a stop must be text")
    return out


class StopStrings:
    """Stop strings ``stops`` matched against ``decode`` of the generated tokens (module docstring)."""

    def __init__(self, stops: Sequence[str], decode: Decode) -> None:
        self.stops = check_stop_strings("stop", stops)
        if not self.stops:
            raise ValueError("StopStrings needs at least one stop string")
        if not callable(decode):
            raise ValueError(f"decode must be a function from token ids to text, got {decode!r}")
        self.decode = decode
        self._last_chars = frozenset(s[-1] for s in self.stops)
        # tokens a stop of c characters can span: each character needs at least one token, a character written
        # in several byte tokens up to 4, and a skipped special token may sit between two
        self.window = 4 * max(len(s) for s in self.stops) + 8
        self._can_end: dict[int, bool] = {}

    def contains_stop(self, text: str) -> bool:
        return any(s in text for s in self.stops)

    def first_end(self, ids: Sequence[int]) -> int | None:
        """e of the module docstring for the completion ``ids``: the number of tokens it keeps, or None."""
        if not ids:
            return None
        # the longest prefix (all of ids, or all but a few tokens of a character cut at the end, e.g. by the token
        # budget) whose text has no U+FFFD: if it holds no stop, no shorter prefix does (module docstring)
        clean = next((m for m in range(len(ids), max(0, len(ids) - MAX_CUT_TOKENS) - 1, -1)
                      if REPLACEMENT_CHAR not in self.decode(ids[:m])), None)
        if clean is not None and not self.contains_stop(self.decode(ids[:clean])):
            start = clean + 1  # only the prefixes past it are left to try
        else:
            start = 1
        return next((k for k in range(start, len(ids) + 1)
                     if self.could_end(ids[k - 1]) and self.contains_stop(self.decode(ids[:k]))), None)

    def could_end(self, token: int) -> bool:
        """False only if the text ``token`` adds cannot hold the last character of a stop (module docstring)."""
        known = self._can_end.get(token)
        if known is None:
            alone, twice = self.decode([token]), self.decode([token, token])
            added = twice[len(alone):] if twice.startswith(alone) else ""
            known = not added or REPLACEMENT_CHAR in added or any(c in added for c in self._last_chars)
            self._can_end[token] = known
        return known


class TailScanner:
    """The engine's early-exit check over rows of one batch (module docstring): ``scan`` takes each live
    row's tokens generated since the last scan and says which rows' text now holds a stop string."""

    def __init__(self, stops: StopStrings, rows: int) -> None:
        self.stops = stops
        self.tokens: list[list[int]] = [[] for _ in range(rows)]

    def scan(self, new_tokens: list[list[int]], out_rows: list[int], done: list[bool]) -> list[int]:
        """Append ``new_tokens[i]`` to output row ``out_rows[i]``; return the indices i of rows not ``done``
        whose tokens now contain a stop string (confirmed by ``first_end``)."""
        hits = []
        stops = self.stops
        for i, (row, new) in enumerate(zip(out_rows, new_tokens)):
            toks = self.tokens[row]
            toks.extend(new)
            if done[i] or not any(stops.could_end(t) for t in new):
                continue
            tail = toks[-(stops.window + len(new)):]
            text = stops.decode(tail)
            # a stop in the tail's text; or, when the text has U+FFFD (a ByteFallback decoder masks a whole
            # run of byte tokens once a stray byte follows the stop's), in one of the tail's prefixes
            hint = stops.contains_stop(text) or (REPLACEMENT_CHAR in text and stops.first_end(tail) is not None)
            if hint and stops.first_end(toks) is not None:
                hits.append(i)
        return hits
