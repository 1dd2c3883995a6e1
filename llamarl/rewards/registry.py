"""Reward specs: a string names a reward function, so it can cross process boundaries as plain text.

    "gsm8k" | "math" | "exact" | "code"   the built-in verifiers
    "format_gsm8k" | "format_math" | ...  the built-in format rewards (llamarl.rewards.format)
    "package.module:function"             a user function, imported with importlib
    "path/to/file.py:function"            a user function defined in a file (no package needed)

A reward function has the signature ``fn(completion: str, answer: str) -> float``; it may also take
keyword parameters named after what is known of the sample (``call_reward``): ``prompt`` (its text
before formatting), ``sample_id``, and any other field of its dataset record (veRL's ``extra_info``, TRL's
dataset columns), or ``**kwargs`` for all of them. Worker processes
receive the *spec*, not a pickled function, and call ``load_reward`` themselves; user functions thus
need not be picklable (closures, lambdas bound to a module name and objects with state all work).

``load_reward(spec, format_weight=w)`` mixes in the format reward of ``format.py`` as
``(1 - w) * correct + w * format_ok``; the format style defaults to the built-in's own name and must be
given (``format_style=``) for a user function.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from llamarl.rewards.code import code_reward
from llamarl.rewards.exact import exact_reward
from llamarl.rewards.format import FORMAT_REWARDS, FORMAT_STYLES, FormattedReward
from llamarl.rewards.gsm8k import gsm8k_reward
from llamarl.rewards.math import math_reward
from llamarl.rewards.math import warm_up as _math_warm_up

RewardFn = Callable[[str, str], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "gsm8k": gsm8k_reward,
    "math": math_reward,
    "exact": exact_reward,
    "code": code_reward,
    **FORMAT_REWARDS,  # format_gsm8k, format_math, format_exact: the form of the answer, not its correctness
}
_WARM_UPS: dict[str, Callable[[], None]] = {"math": _math_warm_up}


class RewardSpecError(ValueError):
    """A reward spec that names nothing loadable; the message says which part failed and why."""


def file_module(module: str) -> Path | None:
    """The absolute path of a spec's module part that names a file (``path/to/file.py``), else None (an
    importable module name)."""
    if module.endswith(".py") or os.sep in module or "/" in module:
        return Path(module).expanduser().resolve()
    return None


def _import_module(module: str, spec: str):
    path = file_module(module)
    if path is not None:
        if not path.is_file():
            raise RewardSpecError(f"reward spec {spec!r}: file {str(path)!r} does not exist")
        name = f"llamarl_user_reward_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        if name in sys.modules:
            return sys.modules[name]
        file_spec = importlib.util.spec_from_file_location(name, path)
        if file_spec is None or file_spec.loader is None:
            raise RewardSpecError(f"reward spec {spec!r}: cannot load {str(path)!r} as a Python module")
        mod = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = mod
        try:
            file_spec.loader.exec_module(mod)
        except BaseException as e:
            del sys.modules[name]
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C while it loads: the user's stop, not a bad reward
                raise
            raise RewardSpecError(
                f"reward spec {spec!r}: executing {str(path)!r} failed with {type(e).__name__}: {e}"
            ) from e
        return mod
    parents = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in parents:  # the module was found; something it imports is missing
            raise RewardSpecError(
                f"reward spec {spec!r}: importing module {module!r} failed with ModuleNotFoundError: {e} "
                "(install what it imports)"
            ) from e
        raise RewardSpecError(
            f"reward spec {spec!r}: cannot import module {module!r} ({e}); make sure it is on PYTHONPATH "
            "(or pass a file path, e.g. 'path/to/rewards.py:my_reward')"
        ) from e
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise RewardSpecError(
            f"reward spec {spec!r}: importing module {module!r} failed with {type(e).__name__}: {e}"
        ) from e


def _check_signature(fn: RewardFn, spec: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; calling them will tell
        return
    try:  # its other required parameters come by keyword (call_reward)
        sig.bind("completion", "answer", **dict.fromkeys(info_params(fn).required))
    except TypeError as e:
        raise RewardSpecError(
            f"reward spec {spec!r}: {getattr(fn, '__name__', fn)!r}{sig} cannot be called as "
            f"fn(completion, answer, **info): {e}"
        ) from None


@dataclass(frozen=True)
class InfoParams:
    """What a reward function takes besides (completion, answer): ``takes_all`` (a ``**kwargs``), ``names``
    (its other keyword-capable parameters), ``required`` (those without a default) and ``positional`` (the
    names of its first two parameters, which are never passed by keyword)."""

    takes_all: bool = False
    names: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()
    positional: frozenset[str] = frozenset()

    def select(self, info: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The entries of ``info`` to pass; None when there are none (nothing else crosses to a worker)."""
        kw = {k: v for k, v in (info or {}).items()
              if (self.takes_all or k in self.names) and k not in self.positional}
        return kw or None


def info_params(fn: Callable) -> InfoParams:
    """``fn``'s ``InfoParams`` (a ``FormattedReward``'s are its inner function's)."""
    target = fn.reward_fn if isinstance(fn, FormattedReward) else fn
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # no signature to read: it gets (completion, answer) only
        return InfoParams()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    named = [p for p in params if p not in positional and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return InfoParams(any(p.kind == p.VAR_KEYWORD for p in params), frozenset(p.name for p in named),
                      frozenset(p.name for p in named if p.default is p.empty), frozenset(p.name for p in positional))


def call_reward(fn: Callable, completion: str, answer: str, info: Mapping[str, Any] | None = None,
                params: InfoParams | None = None) -> Any:
    """``fn(completion, answer, **kw)``, kw the entries of ``info`` that ``fn`` takes (``InfoParams.select``;
    ``params`` computed once by callers that call often)."""
    kw = (params if params is not None else info_params(fn)).select(info)
    return fn(completion, answer, **(kw or {}))


def resolve_function(spec: str) -> RewardFn:
    """Import the callable named by ``"module:function"`` (``function`` may be dotted: ``Cls.method``)."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise RewardSpecError(
            f"reward spec {spec!r} is neither a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) nor of "
            "the form 'module:function'"
        )
    obj = _import_module(module, spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:20]
            raise RewardSpecError(
                f"reward spec {spec!r}: {module!r} has no attribute {part!r} (it defines: {', '.join(public)})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    _check_signature(obj, spec)
    return obj


def load_reward(spec: str, *, format_weight: float = 0.0, format_style: str | None = None) -> RewardFn:
    """The reward function named by ``spec`` (see the module docstring), optionally with a format term."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    fn = BUILTIN_REWARDS[spec] if spec in BUILTIN_REWARDS else resolve_function(spec)
    if format_weight == 0.0:
        return fn
    style = format_style or (spec.removeprefix("format_") if spec in BUILTIN_REWARDS else None)
    if style is None:
        raise RewardSpecError(
            f"reward spec {spec!r}: format_weight={format_weight} needs a format_style for a user function "
            f"(one of {sorted(FORMAT_STYLES)})"
        )
    try:
        return FormattedReward(fn, style, float(format_weight))
    except ValueError as e:
        raise RewardSpecError(f"reward spec {spec!r}: {e}") from None


def warm_up(spec: str) -> None:
    """Pay one-time import costs of a built-in (math-verify, sympy) before the first timed sample."""
    hook = _WARM_UPS.get(spec.strip() if isinstance(spec, str) else spec)
    if hook is not None:
        hook()
