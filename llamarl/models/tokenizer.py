"""Tokenizers: a built-in character-level one and one backed by a Hugging Face ``tokenizer.json``.

Both expose the same small interface the rest of llamarl uses:

    encode(text, add_bos=False) -> list[int]      no special tokens are added unless add_bos: then
                                                  prefix_ids (or [bos_id] where that is empty)
    decode(ids, skip_special_tokens=True) -> str
    vocab_size, bos_id, eos_id, pad_id            ints
    prefix_ids                                    the special tokens the tokenizer puts before a text
    apply_chat_template(messages, add_generation_prompt=True) -> str
    save(path)                                    a directory that load_tokenizer(path) reads back

CharTokenizer (the embedded default) maps each character to one id:

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4 "\\n"   5..99 printable ASCII 0x20..0x7E

so it covers digits, letters, arithmetic and LaTeX punctuation. A character outside the alphabet
encodes to <unk> (decoded as U+FFFD) rather than failing, so arbitrary dataset text can be fed in.
Its chat template is the trivial ``Q: ...\\nA: ...\\n`` form (keeps prompts short for a tiny context).

HFTokenizer reads ``tokenizer.json`` with the ``tokenizers`` library (any truncation or padding saved in
it is turned off, as transformers does per call) and the special tokens and chat template from
``tokenizer_config.json`` (special tokens missing there from ``special_tokens_map.json``, which overrides
it in the layout saved before transformers 4.34, without ``added_tokens_decoder``, as there; the template
from ``chat_template.jinja`` first, and of named templates only the one named ``default``). Templates are
rendered with jinja2 in a sandbox (compiled once per template text), with the same conventions as
transformers (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a ``tojson`` that
does not HTML-escape, ``{% generation %}`` blocks, ``tools`` and ``documents`` defined as none, the special
tokens the checkpoint has defined, the others not). A checkpoint without a pad
token gets ``pad_id = eos_id`` (padding is always masked, the id only has to be valid). Its
``prefix_ids`` are what the post-processor of ``tokenizer.json`` puts before a single text, as
transformers' ``tokenizer(text)`` (``add_special_tokens=True``) does: ``<s>`` for Llama 2,
``<|begin_of_text|>`` for Llama 3, nothing for many chat models, whatever ``bos_token`` is named; a
suffix it appends (an EOS) is not part of them, since a prompt must not end the text.

Decoding ids past the tokenizer's vocabulary: many checkpoints pad their embedding matrix beyond the
tokenizer (e.g. to a multiple of 64 or 128), so a sampler can emit ids no tokenizer entry covers. Both
tokenizers decode such ids to nothing, as Hugging Face ``tokenizers`` does; a negative id is an error.
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from llamarl._fs import write_text_atomic

CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHAR_PAD_ID, CHAR_BOS_ID, CHAR_EOS_ID, CHAR_UNK_ID = 0, 1, 2, 3
CHAR_ALPHABET = "\n" + "".join(chr(c) for c in range(0x20, 0x7F))
CHAR_VOCAB_SIZE = len(CHAR_SPECIALS) + len(CHAR_ALPHABET)  # 100

CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}Q: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}A: {{ message['content'] }}\n"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)

TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")  # the ones a template may lack


# ------------------------------------------------------------------------------------ chat templates
def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("apply_chat_template expects a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation: pass at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise ValueError(f"chat message {i} must be a dict with a 'role' (and usually 'content'), got {m!r}")
        out.append(dict(m))
    return out


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """Render a Hugging Face style chat template with jinja2 (sandboxed)."""
    # what transformers always defines, so ``is defined`` / ``is not none`` tests behave the same
    import jinja2

    context = {"tools": None, "documents": None, **variables}
    try:
        return _compiled(template).render(messages=_check_messages(messages),
                                          add_generation_prompt=add_generation_prompt, **context)
    except jinja2.UndefinedError as e:
        name = re.match(r"'(\w+)' is undefined", e.message or "")
        if name and name.group(1) in _SPECIAL_TOKEN_NAMES:
            raise ValueError(f"chat template uses {e.message}: the tokenizer does not define it (a special token "
                             f"belongs in {TOKENIZER_CONFIG} or special_tokens_map.json)") from e
        raise ValueError(f"chat template failed on these messages: {e.message}") from e



def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return _dt.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The compiled template (once per template text: every prompt of a chat dataset renders the same one)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _generation_tag()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not parse (line {e.lineno}): {e.message}") from e


def _generation_tag():
    """A jinja2 extension for ``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's
    tokens with it for training masks): here it renders its body unchanged."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationTag


# ------------------------------------------------------------------------------------ CharTokenizer
class CharTokenizer:
    """One id per character; see the module docstring for the id layout."""

    def __init__(self) -> None:
        self._to_id = {ch: i + len(CHAR_SPECIALS) for i, ch in enumerate(CHAR_ALPHABET)}
        self.chat_template = CHAR_CHAT_TEMPLATE

    vocab_size = CHAR_VOCAB_SIZE
    pad_id = CHAR_PAD_ID
    bos_id = CHAR_BOS_ID
    eos_id = CHAR_EOS_ID
    unk_id = CHAR_UNK_ID
    prefix_ids = (CHAR_BOS_ID,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = [self._to_id.get(ch, CHAR_UNK_ID) for ch in text]
        return [CHAR_BOS_ID] + ids if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i < 0:
                raise ValueError(f"negative token id {i}")
            if i >= CHAR_VOCAB_SIZE:  # a model's padded embedding rows: no text (module docstring)
                continue
            if i >= len(CHAR_SPECIALS):
                out.append(CHAR_ALPHABET[i - len(CHAR_SPECIALS)])
            elif i == CHAR_UNK_ID:
                out.append("\ufffd")
            elif not skip_special_tokens:
                out.append(CHAR_SPECIALS[i])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt)

    def save(self, path: str | os.PathLike) -> None:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        cfg = {
            "tokenizer_class": "CharTokenizer",
            "llamarl_alphabet": CHAR_ALPHABET,
            "pad_token": CHAR_SPECIALS[CHAR_PAD_ID],
            "bos_token": CHAR_SPECIALS[CHAR_BOS_ID],
            "eos_token": CHAR_SPECIALS[CHAR_EOS_ID],
            "unk_token": CHAR_SPECIALS[CHAR_UNK_ID],
            "chat_template": self.chat_template,
        }
        write_text_atomic(d / TOKENIZER_CONFIG, json.dumps(cfg, indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        cfg = _read_json(Path(path) / TOKENIZER_CONFIG)
        if cfg.get("tokenizer_class") != "CharTokenizer":
            raise ValueError(f"{Path(path) / TOKENIZER_CONFIG} does not describe a CharTokenizer")
        if cfg.get("llamarl_alphabet") != CHAR_ALPHABET:
            raise ValueError(
                f"{Path(path) / TOKENIZER_CONFIG} was saved with a different character alphabet than this "
                "version of llamarl's CharTokenizer; ids would not match"
            )
        tok = cls()
        tok.chat_template = cfg.get("chat_template") or CHAR_CHAT_TEMPLATE
        return tok

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


# ------------------------------------------------------------------------------------ HFTokenizer
def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, Mapping):
        return tok.get("content")
    return str(tok)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens and chat template of a checkpoint."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_token: str | None,
        eos_token: str | None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        additional_special_tokens: Sequence[str] = (),
        chat_template: str | None = None,
        chat_template_problem: str | None = None,
        source: str = "<memory>",
    ) -> None:
        # truncation or padding saved in tokenizer.json would cut or pad every prompt and answer; transformers
        # turns them off for each call unless asked, and llamarl never asks
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tok = tokenizer
        self.source = source
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.unk_token, self.additional_special_tokens = unk_token, list(additional_special_tokens)
        self.chat_template = chat_template
        self.chat_template_problem = chat_template_problem  # why there is no usable template, when known
        self.bos_id = self._special_id("bos_token", bos_token)
        self.eos_id = self._special_id("eos_token", eos_token)
        if self.eos_id is None:
            raise ValueError(f"{source}: tokenizer has no eos_token; set 'eos_token' in {TOKENIZER_CONFIG}")
        pad = self._special_id("pad_token", pad_token)
        self.pad_id = self.eos_id if pad is None else pad

    def _special_id(self, field: str, token: str | None) -> int | None:
        if token is None:
            return None
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{self.source}: {field} {token!r} is not in the tokenizer vocabulary")
        return int(i)

    @functools.cached_property
    def vocab_size(self) -> int:
        """The largest id + 1, the embedding rows the tokenizer needs (its entry count where the ids are
        contiguous; a vocabulary with unused ids, e.g. a reserved block, has fewer entries than that)."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos:
            prefix = self.prefix_ids or ((self.bos_id,) if self.bos_id is not None else ())
            if not prefix:
                raise ValueError(f"{self.source}: add_bos=True but the tokenizer adds no special token before a "
                                 "text and defines no bos_token")
            ids = list(prefix) + ids
        return ids

    @functools.cached_property
    def prefix_ids(self) -> tuple[int, ...]:
        """The special tokens before the first token of a text that ``encode(text, add_special_tokens=True)``
        keeps (see the module docstring), probed with "a", else with the text of a vocabulary entry; () if no
        probe encodes to a token of its own (then nothing tells a prefix from a suffix)."""
        decoded = (self._tok.decode([i], skip_special_tokens=True) for i in range(min(self.vocab_size, 4096)))
        for probe in itertools.chain(("a",), (t for t in decoded if t.strip())):
            enc = self._tok.encode(probe, add_special_tokens=True)
            first = next((k for k, special in enumerate(enc.special_tokens_mask) if not special), None)
            if first is not None:
                return tuple(int(i) for i in enc.ids[:first])
        return ()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0]
        if bad:
            raise ValueError(f"negative token id(s) {bad[:5]}")
        # ids past the vocabulary (a model's padded embedding rows) have no text (module docstring)
        return self._tok.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.source}: " + (self.chat_template_problem or (
                f"no chat template (expected 'chat_template' in {TOKENIZER_CONFIG} or a {CHAT_TEMPLATE_FILE} file)")))
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            additional_special_tokens=self.additional_special_tokens,
            # the checkpoint's special tokens; one it does not have stays undefined, as in transformers (a
            # template that uses it in an expression then fails, instead of rendering without it)
            **{k: v for k, v in dict(bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token,
                                     unk_token=self.unk_token).items() if v},
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "HFTokenizer":
        from tokenizers import Tokenizer

        d = Path(path)
        tj = d / TOKENIZER_JSON
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} not found: a Hugging Face tokenizer directory needs {TOKENIZER_JSON}")
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as e:  # the tokenizers library raises a bare Exception on parse errors
            raise ValueError(f"{tj} is not a valid tokenizer.json: {e}") from e
        cfg = _read_json(d / TOKENIZER_CONFIG) if (d / TOKENIZER_CONFIG).is_file() else {}
        # older checkpoints keep their special tokens only in special_tokens_map.json; as in transformers, it
        # overrides the config's of a checkpoint saved before added_tokens_decoder (transformers 4.34)
        special_map = _read_json(d / SPECIAL_TOKENS_MAP) if (d / SPECIAL_TOKENS_MAP).is_file() else {}
        first, then = (cfg, special_map) if "added_tokens_decoder" in cfg else (special_map, cfg)

        def special(name: str) -> str | None:
            value = first.get(name)
            return _token_content(value if value is not None else then.get(name))

        extra = cfg.get("additional_special_tokens") or special_map.get("additional_special_tokens") or []
        template, problem = cfg.get("chat_template"), None
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
            if template is None:  # as transformers: no guessing which one is meant
                problem = (f"{TOKENIZER_CONFIG} has named chat templates {sorted(map(str, named))} but none named "
                           "'default'; llamarl renders the default one")
        if (d / CHAT_TEMPLATE_FILE).is_file():
            template, problem = (d / CHAT_TEMPLATE_FILE).read_text(), None
        return cls(
            tok,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            additional_special_tokens=[t for t in map(_token_content, extra) if t],
            chat_template=template,
            chat_template_problem=problem,
            source=str(d),
        )

    def save(self, path: str | os.PathLike) -> None:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (TOKENIZER_JSON + ".tmp")
        self._tok.save(str(tmp))
        os.replace(tmp, d / TOKENIZER_JSON)
        cfg: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        if self.additional_special_tokens:
            cfg["additional_special_tokens"] = self.additional_special_tokens
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        write_text_atomic(d / TOKENIZER_CONFIG, json.dumps(cfg, indent=2, ensure_ascii=False))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


# ------------------------------------------------------------------------------------ loading
def load_tokenizer(path: str | os.PathLike) -> CharTokenizer | HFTokenizer:
    """Load the tokenizer saved in directory ``path``; the name ``"char"`` gives the built-in CharTokenizer."""
    p = Path(path)
    if not p.exists():
        if str(path) == "char":
            return CharTokenizer()
        raise FileNotFoundError(f"tokenizer path {p} does not exist (pass a checkpoint directory or 'char')")
    if p.is_file():
        if p.name == TOKENIZER_JSON:
            return HFTokenizer.from_dir(p.parent)
        raise ValueError(f"{p} is a file; pass the directory holding {TOKENIZER_JSON} or {TOKENIZER_CONFIG}")
    if (p / TOKENIZER_JSON).is_file():
        return HFTokenizer.from_dir(p)
    if (p / TOKENIZER_CONFIG).is_file():
        cfg = _read_json(p / TOKENIZER_CONFIG)
        if cfg.get("tokenizer_class") == "CharTokenizer":
            return CharTokenizer.load(p)
        raise FileNotFoundError(
            f"{p} has a {TOKENIZER_CONFIG} for {cfg.get('tokenizer_class')!r} but no {TOKENIZER_JSON}; "
            "only tokenizer.json-based (fast) tokenizers are supported"
        )
    raise FileNotFoundError(f"{p} holds neither {TOKENIZER_JSON} nor {TOKENIZER_CONFIG}")


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


