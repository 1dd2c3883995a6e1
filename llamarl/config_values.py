"""Configuration values: the error type, and reading a value given as text or as a Python object into a
config field's annotated type (``coerce``), with messages that start with the dotted field name.

Values given as text (``Text``: the command line, YAML strings such as ``3e-4``) are parsed by the field's
type; plain ``str`` values from Python callers are not (``GeneratorConfig(tp="2")`` is an error). Tuples:
text "0.9,0.95" or "[0.9, 0.95]"; for strings also a YAML list (``[gsm8k, "x.py:f"]``). A field annotated
``Annotated[tuple[str, ...], VERBATIM]`` (stop strings, which may start with "[") takes a YAML list only
when its items are quoted (``["\\nQ:", 'x']``, escapes read in double quotes), else the one string as it is
(``[INST]`` is the string "[INST]").
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the dotted field name."""


def fail(path: str, what: str, value: Any = dataclasses.MISSING) -> None:
    got = "" if value is dataclasses.MISSING else f", got {value!r}"
    raise ConfigError(f"{path}: {what}{got}")


class Text(str):
    """A value given as text (CLI, YAML strings): parsed according to the field's type.

    Plain ``str`` values (Python callers) are not parsed, so ``GeneratorConfig(tp="2")`` is an error."""


def did_you_mean(word: str, options) -> str:
    hint = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{hint[0]}'?)" if hint else ""


VERBATIM = "verbatim"  # Annotated[tuple[str, ...], VERBATIM] (see _string_list)

_QUOTED = r"""(?:"(?:[^"\\]|\\.)*"|'(?:[^']|'')*')"""
_QUOTED_LIST = re.compile(rf"\[\s*(?:{_QUOTED}(?:\s*,\s*{_QUOTED})*\s*,?)?\s*\]", re.DOTALL)


def _string_list(path: str, text: str) -> list:
    """A VERBATIM field's text (strings that may hold anything, "[INST]" too): a YAML flow list whose items
    are all quoted, else the one string as it is."""
    if not text:  # --set generator.stop= : none
        return []
    return _yaml_list(path, text) if _QUOTED_LIST.fullmatch(text.strip()) else [text]


def _yaml_list(path: str, text: str) -> list:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        fail(path, f"is not a valid YAML list ({exc.__class__.__name__}); write e.g. "
             '\'["\\nQuestion:", "</answer>"]\' (double quotes read escapes like \\n)', str(text))
    if not isinstance(value, list):
        fail(path, "must be a list", str(text))
    return [Text(v) if isinstance(v, str) else v for v in value]


def unquote(text: str) -> str:
    """A command-line value wrapped in one pair of YAML quotes (``"a b"``, ``'it''s'``) is the string inside,
    as in a YAML file (double quotes read escapes such as \\n); any other text stays exactly as it is."""
    inner = text.strip()
    if len(inner) < 2 or not re.fullmatch(_QUOTED, inner, re.DOTALL):
        return text
    try:
        value = yaml.safe_load(inner)
    except yaml.YAMLError:  # e.g. an unknown escape ("\q"): the text as typed
        return text
    return value if isinstance(value, str) else text


def plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def is_null_text(text: str) -> bool:
    """Does this text spell "no value" for an optional field ("", none, null, ~; any case, spaces around)?"""
    return text.strip().lower() in ("", "none", "null", "~")


def coerce(path: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against annotation ``tp``; parse it first if it is ``Text`` for a non-text type
    (surrounding whitespace ignored there; a string field keeps its text exactly, spaces included)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:  # Annotated[tuple[str, ...], VERBATIM]: strings that may start with "["
        if isinstance(value, Text) and VERBATIM in args[1:]:
            value = _string_list(path, value)
        return coerce(path, value, args[0])
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, Text) and is_null_text(value)):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return coerce(path, value, inner[0])
    if origin is Literal:
        if isinstance(value, Text):
            value = value.strip()
        if value not in args:
            fail(path, f"must be one of {', '.join(repr(a) for a in args)}{did_you_mean(str(value), args)}", value)
        return str(value)
    if origin is tuple:
        if isinstance(value, Text) and args[0] is str:  # a YAML list ([a, "b"]), else items split at commas
            value = _yaml_list(path, value) if value.strip().startswith("[") else value.split(",")
            value = [Text(str(v).strip()) for v in value if str(v).strip()]
        elif isinstance(value, Text):
            value = [v for v in value.strip("[]() ").split(",") if v.strip()]
        fixed_length = Ellipsis not in args
        if not isinstance(value, (list, tuple)) or (fixed_length and len(value) != len(args)):
            fail(path, f"must be a list of {len(args)} numbers" if fixed_length else "must be a list", value)
        return tuple(coerce(f"{path}[{i}]", Text(v) if isinstance(v, str) else v, args[0])
                     for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, Text):
            lowered = value.strip().lower()
            if lowered in ("true", "yes", "on", "1"):
                return True
            if lowered in ("false", "no", "off", "0"):
                return False
        if not isinstance(value, bool):
            fail(path, "must be true or false", value)
        return value
    if tp in (int, float):
        return _number(path, value, tp)
    if tp is str:
        if isinstance(value, dict):  # YAML's {prompt} ... unquoted: a mapping
            fail(path, "must be a string; in a YAML file quote text that starts with { or [ (template: \"{prompt} "
                 "...\")", value)
        if not isinstance(value, str):
            fail(path, "must be a string", value)
        return str(value)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in config dataclass")


def _number(path: str, value: Any, tp: type) -> int | float:
    """An int field takes ints (and floats with an integral value), a float field ints and floats; text is
    parsed; bools are refused."""
    what = "an integer" if tp is int else "a number"
    if isinstance(value, Text):
        try:
            return tp(value.strip())
        except ValueError:
            fail(path, f"must be {what}", str(value))
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int if tp is int else (int, float)):
        fail(path, f"must be {what}", value)
    return tp(value)
