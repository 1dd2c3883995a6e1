"""Sampling parameters and the per-step sampler (greedy / temperature / min-p / top-k / top-p).

Given fp32 logits z [N, V] for the next token and temperature T:

    greedy (T == 0):  y = argmax z;                          logprob = log_softmax(z)[y]
    sampling (T > 0): p = softmax(z / T), truncated to the entries with p_i >= min_p * max(p) (if min_p > 0),
                      then to the top_k largest (if top_k > 0), then to the smallest prefix (in decreasing
                      probability) whose mass reaches top_p, each step renormalising what it keeps (vLLM's
                      order); y ~ p;                         logprob = log p[y]

The returned log-prob is the one of the distribution the token was drawn from (μ, what AIPO's importance
weight π/μ needs; vLLM's ``logprobs_mode="processed_logprobs"``): with min-p/top-k/top-p, log p[y] =
log_softmax(z / T)[y] − log(mass kept), so π/μ is the exact weight of a sample from the truncated sampler
(tokens outside the kept set are never drawn, so their part of the objective is not estimated).
``logprobs_mode="raw"`` reports log_softmax(z / T)[y], the untruncated temperature-scaled distribution,
instead (vLLM's ``raw_logprobs``); without truncation the two are the same.

Drawing y ~ p: on CUDA, y = argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. (P[y = i] = p_i, since
E_i / p_i are independent exponentials of rate p_i and the smallest wins), which needs no host
synchronisation; on the CPU, by the inverse CDF with one uniform per row: c = cumsum(p) in float64,
y = the first i with c_i > u * c_{V-1}, u ~ U[0, 1), so P[y = i] = p_i / sum(p) and a zero-probability
token (an empty interval) is never drawn. (``torch.multinomial`` draws V exponentials per row on the
CPU: 660 us for one row of 32000 on the 2-core host, against 43 us.) Both use an explicit
``torch.Generator``, so a seed fixes the whole generation on a given device.

On the CPU without truncation, the native sampler (csrc/sampling_cpu.cpp) does the whole step — greedy,
or temperature with the same inverse-CDF rule on the unnormalised exp(z/T - max) and the same uniforms
from the generator — in two passes over each row instead of torch's ~6 (8 rows x 32000: ~0.1 ms instead
of ~0.4 ms greedy, ~0.9 ms sampled). Its log-probs equal torch's log_softmax to fp32 rounding; a token
drawn at the very edge of a CDF interval may differ from the torch path for the same uniform (other
rounding of the sums). ``LLAMARL_FUSED_OPS=0`` (the switch of the model's native CPU ops) selects the
torch ops instead.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from llamarl._native import native
from llamarl.generation.stop import check_stop_strings

NATIVE_CPU = os.environ.get("LLAMARL_FUSED_OPS", "1") != "0"
LOGPROBS_MODES = ("processed", "raw")  # the module docstring
MIN_TEMPERATURE = 1e-4  # smallest sampling temperature (0 is greedy); below it z / T overflows fp32 for large z


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1.0 = no nucleus truncation
    min_p: float = 0.0  # 0.0 = no min-p truncation (keep tokens with p >= min_p * the most likely one's p)
    n: int = 1  # samples per prompt
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    # stop strings (vLLM's ``stop``): a sample ends at the first token whose text holds one (generation/stop.py);
    # the engine then needs the tokenizer's ``decode``
    stop: Sequence[str] = ()
    logprobs_mode: str = "processed"  # "processed": log-probs of the truncated sampler; "raw": of softmax(z / T)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "n"):
            object.__setattr__(self, name, _integer(f"SamplingParams.{name}", getattr(self, name)))
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, _real(f"SamplingParams.{name}", getattr(self, name)))
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not (t == 0.0 or MIN_TEMPERATURE <= t < float("inf")):
            raise ValueError(f"SamplingParams.temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} "
                             f"(below it z/T overflows fp32), got {t!r}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = disabled), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = disabled), got {self.top_p!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"SamplingParams.min_p must be in [0, 1] (0 = disabled), got {self.min_p!r}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n (samples per prompt) must be an int >= 1, got {self.n!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"SamplingParams.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        object.__setattr__(self, "stop_token_ids", token_ids("SamplingParams.stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop", check_stop_strings("SamplingParams.stop", self.stop))
        if self.seed is not None:
            seed = _integer("SamplingParams.seed", self.seed)
            if not 0 <= seed < 2**63:
                raise ValueError(f"SamplingParams.seed must be None or an int in [0, 2**63), got {seed!r}")
            object.__setattr__(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _integer(name: str, value: object) -> int:
    """``value`` as an int: Python and numpy integers (``operator.index``), never a bool or a float."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def token_ids(name: str, ids: object) -> tuple[int, ...]:
    """A sequence of non-negative token ids (numpy integers welcome) as a tuple; a str, bools or floats are
    refused (``"12"`` is not the ids 1 and 2)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name} must be a sequence of token ids, got {ids!r}")
    out = tuple(_integer(name, t) for t in ids)
    if any(t < 0 for t in out):
        raise ValueError(f"{name} must be non-negative token ids, got {out}")
    return out


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the min-p / top-k / top-p set to -inf (min-p first, then top-k, then top-p on what is
    left). min-p keeps p_i >= min_p * max p, i.e. z_i >= max z + log(min_p), which never drops the most likely
    token."""
    V = scaled.shape[-1]
    out = scaled
    if min_p > 0.0:
        top = out.max(dim=-1, keepdim=True).values
        out = out.masked_fill(out < top + math.log(min_p), float("-inf"))
    if 0 < top_k < V:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(out, dim=-1), dim=-1, descending=True)
        mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_p  # never drops the most likely token (mass_before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of fp32 ``logits`` [N, V] -> (tokens [N] long, logprobs [N] fp32 under μ)."""
    if logits.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be [N, V] (one row per sequence), got shape "
                         f"{tuple(logits.shape)}; take the last position, or reshape(-1, V)")
    logits = logits.float()
    truncated = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
    if NATIVE_CPU and logits.is_cpu and not truncated:
        return sample_native_cpu(logits, params.temperature, generator)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / params.temperature
        if truncated:
            kept = torch.log_softmax(truncate_logits(scaled, params.top_k, params.top_p, params.min_p), dim=-1)
            probs = kept.exp()
            logp = kept if params.logprobs_mode == "processed" else torch.log_softmax(scaled, dim=-1)
        else:
            logp = torch.log_softmax(scaled, dim=-1)
            probs = logp.exp()
        if probs.is_cuda:
            noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
            tokens = (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
        else:
            tokens = sample_inverse_cdf(probs, generator)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def sample_native_cpu(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The native CPU step (module docstring) on fp32 CPU ``logits`` [N, V]: temperature 0 is greedy."""
    if logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2:
        raise ValueError(f"sample_native_cpu needs fp32 CPU logits [N, V], got {logits.dtype} {tuple(logits.shape)} "
                         f"on {logits.device}")
    logits = logits.contiguous()
    N, V = logits.shape
    if N and not V:
        raise ValueError("sample_native_cpu: logits have an empty vocabulary (V = 0): there is no token to sample")
    tokens = torch.empty(N, dtype=torch.long)
    logprobs = torch.empty(N, dtype=torch.float32)
    u = None if temperature == 0 else torch.rand(N, dtype=torch.float64, generator=generator)
    if N and V:
        native().sample_f32_cpu(logits.data_ptr(), N, V, float(temperature), 0 if u is None else u.data_ptr(),
                                tokens.data_ptr(), logprobs.data_ptr(), torch.get_num_threads())
    return tokens, logprobs


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of non-negative ``probs`` [N, V] (rows with a positive sum), drawn with
    probability probs[i] / sum(probs): the first i whose float64 prefix sum exceeds u * total."""
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device, generator=generator)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp_(max=probs.shape[-1] - 1)  # u * total < total, so only a rounding could overshoot
