"""Several reward functions as one reward (TRL's ``reward_funcs`` with ``reward_weights``).

A sample's reward is the weighted sum of its terms,

    r = sum_i w_i * r_i,    r_0 the verifier (``reward.reward``), r_1.. the extra terms (``reward.extra``),

with w_i = 1 unless ``weights`` says otherwise. The verifier alone says whether a completion is correct
(accuracy counts r_0 >= 1), so a format bonus can shape the reward without inflating the accuracy. Each
term is checked like a single reward (a finite number within float32's range); a term that raises or
returns something else fails the whole sample (it costs that sample, as one failing function does), and
the error names the term. Terms are scored one after another in the same worker, under the sample's one
timeout.

``term_names(specs)`` names the terms in metrics: a built-in's name, or a user function's own name,
with ``_2``, ``_3``... on repeats.
"""

from __future__ import annotations

import math
import os
import traceback
from typing import Any, Mapping, Sequence

from llamarl.rewards.registry import InfoParams, call_reward, file_module, info_params, load_reward

_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max; workers do not import torch


def _shown(obj: Any) -> str:
    """``repr(obj)`` cut to 80 characters, or ``<unprintable>`` when that raises (it is the user's object)."""
    try:
        return f"{obj!r:.80}"
    except BaseException:  # noqa: BLE001 - a __repr__ that raises must not cost more than its sample
        return "<unprintable>"


def as_reward(value: Any) -> float:
    """``value`` as a reward: a finite float within float32's range, or a TypeError/ValueError saying why not."""
    if isinstance(value, (str, bytes)):  # float("1.0") would accept a string: refuse, it is a bug upstream
        raise TypeError(f"reward function returned {_shown(value)} ({type(value).__name__}); expected a number")
    try:
        reward = float(value)
    except BaseException:  # noqa: BLE001 - OverflowError (10**400), a __float__ that raises...: one sample's error
        raise TypeError(f"reward function returned {_shown(value)} ({type(value).__name__}); expected a number "
                        "that converts to float") from None
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward}; expected a finite number")
    if abs(reward) > _FLOAT32_MAX:
        raise ValueError(f"reward function returned {reward:g}, beyond float32's range (|r| <= 3.4e38), "
                         "the precision advantages are computed in")
    return reward


def as_specs(spec: str | Sequence[str]) -> tuple[str, ...]:
    """One spec or several, as a non-empty tuple of specs; a file spec (``path/to/file.py:function``) with its
    path made absolute, so a worker started later (a respawn after a timeout) finds it after a chdir."""
    specs = (spec,) if isinstance(spec, str) else tuple(spec) if isinstance(spec, (list, tuple)) else None
    if specs is None or not all(isinstance(s, str) for s in specs):
        bad = spec if specs is None else next(s for s in specs if not isinstance(s, str))
        raise TypeError(f"reward functions are given by name, as strings: 'gsm8k', 'math', 'module:function' or "
                        f"'path/to/file.py:function' (the workers import them), got {type(bad).__name__}: {bad!r:.80}")
    if not specs:
        raise ValueError("no reward function given: pass a spec such as 'gsm8k' (or several)")
    return tuple(_absolute_file_spec(s.strip()) for s in specs)  # (load_reward strips a spec too)


def _absolute_file_spec(spec: str) -> str:
    module, sep, fn = spec.rpartition(":")
    path = file_module(module) if sep else None
    return spec if path is None else f"{path}:{fn}"


def check_weights(weights: Sequence[float] | None, terms: int) -> tuple[float, ...]:
    """One finite weight per term (None or empty: 1.0 each)."""
    if not weights:
        return (1.0,) * terms
    out = tuple(float(w) for w in weights)
    if len(out) != terms:
        raise ValueError(f"{len(out)} reward weights for {terms} reward functions; give one per function "
                         "(the verifier first) or none")
    if not all(math.isfinite(w) for w in out):
        raise ValueError(f"reward weights must be finite numbers, got {list(out)}")
    return out


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens out of at most ``max_tokens``:

        0                                              if length <= max_tokens - buffer
        -penalty * (length - (max_tokens - buffer)) / buffer   otherwise (down to -penalty at max_tokens)

    so a completion that runs into its budget, whose answer was likely cut off, is worth less than a finished
    one, smoothly over the last ``buffer`` tokens (``buffer`` 0: never)."""
    excess = min(max(length - (max_tokens - buffer), 0), buffer) if buffer > 0 else 0
    return -penalty * excess / buffer if excess else 0.0


def term_names(specs: Sequence[str]) -> list[str]:
    """Metric names of the terms (module docstring)."""
    names: list[str] = []
    for spec in specs:
        base = spec.rpartition(":")[2].rpartition(".")[2] or spec
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


def union_params(params: Sequence[InfoParams]) -> InfoParams:
    """What any of the functions takes: the info entries that must reach the worker scoring them all."""
    return InfoParams(any(p.takes_all for p in params), frozenset().union(*(p.names for p in params)),
                      frozenset().union(*(p.required for p in params)),
                      frozenset.intersection(*(p.positional for p in params)) if params else frozenset())


class RewardTerms:
    """The loaded terms of a reward: ``score`` gives (r, (r_0, r_1, ...)) for one completion."""

    def __init__(self, spec: str | Sequence[str], weights: Sequence[float] | None = None, *,
                 format_weight: float = 0.0, format_style: str | None = None) -> None:
        self.specs = as_specs(spec)
        self.weights = check_weights(weights, len(self.specs))
        # the format mix (llamarl.rewards.format.FormattedReward) applies to the verifier
        self.fns = [load_reward(s, format_weight=format_weight, format_style=format_style) if i == 0
                    else load_reward(s) for i, s in enumerate(self.specs)]
        self.params = [info_params(fn) for fn in self.fns]
        self.info = union_params(self.params)
        self.names = term_names(self.specs)

    def score(self, completion: str, answer: str, info: Mapping[str, Any] | None = None, *,
              verifier_only: bool = False) -> tuple[float, tuple[float, ...], str | None]:
        """(r, (r_0, r_1, ...), None), or (0.0, (), error) when a term fails: it raised (the error gives its
        exception and where), or returned what is not a reward. With several terms the error names the term.
        ``verifier_only``: (r_0, (r_0,), None) from the verifier alone, unweighted (is the answer correct)."""
        count = 1 if verifier_only else len(self.fns)
        weights = (1.0,) if verifier_only else self.weights
        parts = []
        for name, fn, params in zip(self.names[:count], self.fns[:count], self.params[:count]):
            try:
                value = call_reward(fn, completion, answer, info, params)
            except BaseException as e:  # SystemExit from user code too: it costs the sample, not the worker
                return 0.0, (), self._error(name, describe_exception(e))
            try:
                parts.append(as_reward(value))
            except (TypeError, ValueError) as e:
                return 0.0, (), self._error(name, str(e))
        try:
            total = as_reward(math.fsum(w * r for w, r in zip(weights, parts)))
        except (ArithmeticError, TypeError, ValueError) as e:  # finite terms whose weighted sum overflows
            return 0.0, (), f"the weighted sum of the reward terms {dict(zip(self.names, parts))}: {e}"
        return total, tuple(parts), None

    def _error(self, name: str, text: str) -> str:
        return text if len(self.fns) == 1 else f"reward term {name!r}: {text}"


def describe_exception(e: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame."""
    try:
        text = f"{type(e).__name__}: {e}"
    except BaseException:  # noqa: BLE001 - a __str__ that raises (the user's exception)
        text = f"{type(e).__name__}: <unprintable>"
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {os.path.basename(last.filename)}:{last.lineno} in {last.name})"
    return text
