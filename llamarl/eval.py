"""Evaluate a policy: generate n completions per prompt, verify them, report accuracy and pass@k.

    python -m llamarl.eval --model PATH --dataset FILE|synthetic:arithmetic \\
        --reward gsm8k|math|exact|module:function -n 8 -k 1,8 --output results.jsonl

Metrics, over P prompts with n completions each, c_i of them correct (reward >= ``correct_threshold``,
1.0 by default, so a built-in verifier's 1.0/0.0 is right/wrong):
  * accuracy   = sum_i c_i / (P n)                       (the mean correctness of a single sample)
  * pass@k     = mean_i [1 - C(n - c_i, k) / C(n, k)]    (Chen et al. 2021, unbiased for k <= n),
                 computed as 1 - prod_{j = n - c + 1}^{n} (1 - k / j), which never forms a binomial;
  * mean_reward, and the number of reward errors/timeouts;
  * model_score, with a reward model (``--reward-model DIR``, llamarl.rewards.model): the mean of its scores
    of the completions it can score (each record holds its own). ``--reward none`` scores with the reward
    model alone: no verifier, no accuracy or pass@k, and the dataset needs no answer field.

Flow: samples -> ``PromptFormatter`` (template, few-shot, chat template) -> token ids -> batches of
``batch_size`` prompts through one ``GenerationEngine`` (KV cache reused across batches) -> decoded
completions -> rewards. With a ``RewardPool`` the completions of a batch are scored in the worker
processes while the next batch generates; a plain callable is scored in-process (an exception costs
the sample a 0.0 and is recorded, but there is no timeout). Per-sample records go to JSONL.

A rendered prompt of >= max_position_embeddings tokens leaves no room to generate; such prompts are found
up front, by sample id, and refuse the whole evaluation unless ``drop_long`` (``--drop-long``) drops them,
in which case the metrics are over the rest and the dropped ids are in the result (``dropped_ids``).

``--dataset synthetic:arithmetic[:digits=3,n_terms=2,ops=+-,seed=0,n=200]`` evaluates the built-in
task's held-out split (n problems; its reward defaults to ``exact`` and its stop string to newline).
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import math
import os
import sys
import time
import re
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from llamarl._fs import unwritable
from llamarl.data import PromptFormat, PromptFormatter, Sample, load_dataset, select_shots, shot_key
from llamarl.data.prompts import literal_escapes
from llamarl.data.synthetic import SYNTHETIC_PREFIX, parse_synthetic_spec
from llamarl.rewards import RewardPool, RewardPoolError, load_reward
from llamarl.rewards.registry import InfoParams, call_reward, info_params
from llamarl.rewards.terms import as_reward, describe_exception



# ------------------------------------------------------------------------------------ metrics
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct out of ``n`` samples (Chen et al. 2021)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= correct <= samples, got correct={c}, samples={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (samples per prompt), got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for j in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / j
    return 1.0 - prob_all_wrong


@dataclass(frozen=True)
class SampleRecord:
    """One completion and its verdict; a line of the per-sample JSONL."""

    sample_id: str
    completion_index: int
    prompt: str
    completion: str
    answer: str
    reward: float | None  # None without a verifier (--reward none)
    correct: bool | None
    error: str | None
    finish_reason: str
    num_tokens: int
    model_score: float | None = None  # the reward model's (--reward-model), or None: none, or it could not score
    model_error: str | None = None  # why it could not


@dataclass(frozen=True)
class EvalResult:
    accuracy: float | None  # None (and no pass@k, mean_reward) without a verifier: reward_fn None
    pass_at_k: dict[int, float]
    mean_reward: float | None
    num_prompts: int
    n: int
    num_errors: int
    wall_s: float
    records: list[SampleRecord] = field(repr=False)
    dropped_ids: list[str] = field(default_factory=list)  # samples left out: no room to generate (drop_long)
    model_score: float | None = None  # the mean reward-model score of the completions it could score
    num_model_errors: int = 0  # completions the reward model could not score (model_error on their lines)

    def summary(self) -> dict[str, Any]:
        """Everything but the per-sample records, JSON-ready."""
        out = {k: v for k, v in asdict(self).items() if k != "records"}
        out["pass_at_k"] = {f"pass@{k}": v for k, v in self.pass_at_k.items()}
        out["num_dropped"] = len(self.dropped_ids)
        return out

    def format(self) -> str:
        parts = ([f"accuracy={self.accuracy:.4f}", *(f"pass@{k}={v:.4f}" for k, v in self.pass_at_k.items()),
                  f"mean_reward={self.mean_reward:.4f}"] if self.accuracy is not None else [])
        if self.model_score is not None or self.num_model_errors:
            parts.append("model_score=" + ("n/a" if self.model_score is None else f"{self.model_score:.4f}"))
        parts += [f"model_errors={self.num_model_errors}"] if self.num_model_errors else []
        parts += [f"prompts={self.num_prompts}", *([f"dropped={len(self.dropped_ids)}"] if self.dropped_ids else []),
                  f"n={self.n}", f"reward_errors={self.num_errors}", f"wall={self.wall_s:.1f}s"]
        return "  ".join(parts)

    def write_jsonl(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in self.records:
                f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")
        os.replace(tmp, p)
        return p


# ------------------------------------------------------------------------------------ evaluation
RewardLike = str | Callable[[str, str], float] | RewardPool


def _score_in_process(fn: Callable[..., float], params: InfoParams, sample: Sample,
                      completion: str) -> tuple[float, str | None]:
    """(reward, None), or (0.0, the error) when the function raises or returns what the worker pool would
    refuse too (a string, NaN, inf, beyond float32: llamarl.rewards.terms.as_reward)."""
    try:
        return as_reward(call_reward(fn, completion, sample.answer, sample.reward_info(), params)), None
    except Exception as e:  # noqa: BLE001 - a failing reward costs its sample, not the evaluation
        return 0.0, f"sample {sample.id!r}: {describe_exception(e)}"


def eos_ids(tokenizer, config, model_dir: str | Path | None = None) -> list[int]:
    """Where generation ends: the tokenizer's eos, every eos id of the model's config and, with
    ``model_dir``, of its generation_config.json (instruct checkpoints often list several, e.g. end-of-turn
    and end-of-text, some only in generation_config.json). Training and evaluation stop at the same tokens."""
    from llamarl.models.hf_io import generation_eos_ids

    extra = generation_eos_ids(model_dir) if model_dir is not None else ()
    return sorted({int(tokenizer.eos_id), *getattr(config, "eos_token_ids", ()), *extra})


def evaluate(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    reward_fn: RewardLike,
    n: int = 1,
    k: Sequence[int] = (1,),
    temperature: float = 0.0,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    *,
    fmt: PromptFormat = PromptFormat(),
    shots: Sequence[Sample] = (),
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    correct_threshold: float = 1.0,
    engine: Any = None,
    progress: bool = False,
    drop_long: bool = False,
    reward_model: Any = None,
) -> EvalResult:
    """Generate ``n`` completions per sample, score them with ``reward_fn``, compute the metrics.

    ``reward_fn``: a spec string, a ``(completion, answer) -> float`` callable, or a ``RewardPool``.
    ``engine``: an existing ``GenerationEngine`` to reuse (its batch capacity must fit
    ``batch_size * n`` rows); by default one is built for this call.
    ``stop``: stop strings (llamarl.generation.stop: a completion ends at the first token whose text holds one).
    ``drop_long``: leave out the samples whose rendered prompt fills the model's context (one line on stderr
    names them; the result's ``dropped_ids`` lists them) instead of refusing the whole evaluation. An
    error all the same if no sample is left.
    ``reward_model``: a ``llamarl.rewards.model.RewardModelScorer`` scoring every completion (``model_score``);
    ``reward_fn`` may then be None: no verifier (no accuracy, pass@k or mean_reward).
    """
    import torch
    from tqdm import tqdm

    from llamarl.generation import GenerationEngine, SamplingParams
    from llamarl.generation.engine import cache_slots

    if not samples:
        raise ValueError("evaluate needs at least one sample")
    ks = sorted(set(int(x) for x in k))
    if not ks or ks[0] < 1 or ks[-1] > n:
        raise ValueError(f"every k must satisfy 1 <= k <= n={n} (samples per prompt), got k={list(k)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if reward_fn is None and reward_model is None:
        raise ValueError("evaluate needs a reward_fn, a reward_model or both")
    if isinstance(reward_fn, str):
        reward_fn = load_reward(reward_fn)
    # the sample fields an in-process function takes, read from its signature once
    fn_params = None if isinstance(reward_fn, RewardPool) or reward_fn is None else info_params(reward_fn)
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, n=n,
        stop_token_ids=tuple(stop_token_ids), seed=seed, stop=tuple(stop),
    )
    formatter = PromptFormatter(fmt, shots=shots, tokenizer=tokenizer)
    texts = [formatter.render(s) for s in samples]
    token_ids = [formatter.encode_text(t) for t in texts]
    config = getattr(engine, "config", None) if engine is not None else model.config
    context = config.max_position_embeddings if config is not None else math.inf
    too_long = [(i, len(ids)) for i, ids in enumerate(token_ids) if len(ids) >= context]
    # checked up front, by sample id: not after earlier batches were generated
    if too_long and not drop_long:
        i, length = too_long[0]
        raise ValueError(f"{len(too_long)} of {len(samples)} prompts leave no room to generate in the model's "
                         f"context of {context} tokens (e.g. sample {samples[i].id!r}: {length} tokens); shorten "
                         "the template / few-shot prefix, or pass --drop-long (drop_long=True) to evaluate the "
                         "other samples")
    if too_long and len(too_long) == len(samples):
        i, length = too_long[0]
        raise ValueError(f"all {len(samples)} prompts leave no room to generate in the model's context of "
                         f"{context} tokens (e.g. sample {samples[i].id!r}: {length} tokens), so --drop-long "
                         "leaves nothing to evaluate; shorten the template / few-shot prefix or use a model "
                         "with a longer context")
    dropped = {i for i, _ in too_long}
    dropped_ids = [samples[i].id for i, _ in too_long]
    if dropped:
        shown = ", ".join(repr(sid) for sid in dropped_ids[:5]) + (", ..." if len(dropped_ids) > 5 else "")
        print(f"llamarl.eval: dropped {len(dropped)} of {len(samples)} samples whose prompt leaves no room to "
              f"generate in the model's context of {context} tokens: {shown}", file=sys.stderr)
        keep = [i for i in range(len(samples)) if i not in dropped]
        samples = [samples[i] for i in keep]
        texts = [texts[i] for i in keep]
        token_ids = [token_ids[i] for i in keep]
    if engine is None:
        engine = GenerationEngine(model, max_batch_size=min(batch_size, len(samples)) * n,
                                  max_seq_len=cache_slots([len(t) for t in token_ids], max_new_tokens, model.config))
    elif engine.max_batch_size < min(batch_size, len(samples)) * n:
        raise ValueError(
            f"the engine holds {engine.max_batch_size} rows but a batch needs {min(batch_size, len(samples)) * n} "
            f"(batch_size={batch_size} x n={n}); lower batch_size or build a larger engine"
        )

    eos = eos_ids(tokenizer, config)
    start = time.perf_counter()
    # (prompt index, sample index, (reward, error) or Future, completion, token ids, finish reason)
    pending: list[tuple[int, int, Any, str, list[int], str]] = []
    bar = tqdm(total=len(samples), desc="eval", unit="prompt", disable=not progress, file=sys.stderr)
    for b0 in range(0, len(samples), batch_size):
        batch = token_ids[b0 : b0 + batch_size]
        batch_params = replace(params, seed=seed * 1_000_003 + b0)  # fresh randomness per batch
        with torch.inference_mode():
            outs = engine.generate(batch, batch_params, eos_token_id=eos, decode=tokenizer.decode)
        for out in outs:
            i = b0 + out.prompt_index
            s = samples[i]
            completion = tokenizer.decode(out.token_ids)
            if isinstance(reward_fn, RewardPool):
                scored: Any = reward_fn.submit(s.id, completion, s.answer, s.reward_info(), verifier_only=True)
            elif reward_fn is not None:
                scored = _score_in_process(reward_fn, fn_params, s, completion)
            else:
                scored = (0.0, None)
            pending.append((i, out.sample_index, scored, completion, list(out.token_ids), out.finish_reason))
        bar.update(len(batch))
    bar.close()

    model_scores: list[Any] = [None] * len(pending)
    if reward_model is not None:
        model_scores = reward_model.score_pairs([(token_ids[i], ids, formatter.messages(samples[i])
                                                  if reward_model.wants_messages else None)
                                                 for i, _, _, _, ids, _ in pending])
    records: list[SampleRecord] = []
    correct_per_prompt = [0] * len(samples)
    for (i, j, scored, completion, ids, finish_reason), ms in zip(pending, model_scores):
        if isinstance(scored, Future):
            res = scored.result()
            reward, error = res.reward, res.error
        else:
            reward, error = scored
        s = samples[i]
        correct = reward >= correct_threshold if reward_fn is not None else None
        correct_per_prompt[i] += int(bool(correct))
        reward = reward if reward_fn is not None else None
        records.append(SampleRecord(s.id, j, texts[i], completion, s.answer, reward, correct, error,
                                    finish_reason, len(ids), None if isinstance(ms, str) else ms,
                                    ms if isinstance(ms, str) else None))
    total = len(records)
    verified = reward_fn is not None
    scored_by_model = [r.model_score for r in records if r.model_score is not None]
    return EvalResult(
        accuracy=sum(correct_per_prompt) / total if verified else None,
        pass_at_k={kk: sum(pass_at_k(n, c, kk) for c in correct_per_prompt) / len(samples) for kk in ks}
        if verified else {},
        mean_reward=sum(r.reward for r in records) / total if verified else None,
        num_model_errors=sum(r.model_error is not None for r in records),
        model_score=math.fsum(scored_by_model) / len(scored_by_model) if scored_by_model else None,
        num_prompts=len(samples),
        n=n,
        num_errors=sum(r.error is not None for r in records),
        wall_s=time.perf_counter() - start,
        records=records,
        dropped_ids=dropped_ids,
    )


# ------------------------------------------------------------------------------------ CLI

def _check_reward_on(spec: str, samples: list[Sample]) -> None:
    """As llamarl.train does before a run: a user function's required keyword arguments must be fields of every
    sample (ValueError), gsm8k references that are not one number are warned about, and so are samples without
    tests for the code verifier (ValueError when none has any)."""
    from llamarl.config import FORMAT_REWARD_NAMES, REWARD_NAMES
    from llamarl.rewards.data_checks import common_fields, missing_fields, verifier_data_problems

    if spec not in REWARD_NAMES + FORMAT_REWARD_NAMES:
        problem = missing_fields(spec, common_fields(samples))
        if problem:
            raise ValueError(f"--reward {problem}")
    error, warning = verifier_data_problems(spec, samples)
    if error:
        raise ValueError(f"--reward {spec}, but {error}")
    if warning:
        print(f"llamarl.eval: warning: {warning}", file=sys.stderr)


def _id_field(value: str) -> str | None:
    """``--id-field``: a field name, or none/null/'' for ids by position."""
    return None if value.strip().lower() in ("", "none", "null") else value


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llamarl.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--tokenizer", help="tokenizer directory or 'char' (default: the model directory)")
    p.add_argument("--dataset", required=True, help=f"a .jsonl/.parquet file or '{SYNTHETIC_PREFIX}[:opts]'")
    p.add_argument("--reward", help="gsm8k | math | exact | module:function | file.py:function "
                                    "(default: exact for the synthetic task); none: --reward-model alone")
    p.add_argument("--reward-model", default=None,
                   help="a reward model (Hugging Face LlamaForSequenceClassification, one label) that scores every "
                        "completion too: per-sample model_score, and its mean")
    p.add_argument("-n", "--num-samples", dest="n", type=int, default=1, help="completions per prompt (default: 1)")
    p.add_argument("-k", dest="k", default=None, help="comma-separated k for pass@k (default: 1 and n)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: 0, greedy, if n == 1, else 1.0; the model's "
                        "generation_config.json sampling settings are not read, only its stop tokens)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default: 0, off)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="completion budget (default: 256; 16 for the synthetic task)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch (default: 16)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N samples")
    p.add_argument("--prompt-field", default="question", help="dataset field of the prompt (default: question)")
    p.add_argument("--answer-field", default="answer", help="dataset field holding the answer (default: answer)")
    p.add_argument("--id-field", default="id", type=_id_field,
                   help="dataset field of sample ids, if any (default: id); none: number the samples by position")
    p.add_argument("--template", default="{prompt}",
                   help="raw prompt template with a {prompt} placeholder (default: {prompt})")
    p.add_argument("--chat", action="store_true", help="render prompts with the tokenizer's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--few-shot", type=int, default=0, help="number of solved examples to prefix (default: 0)")
    p.add_argument("--few-shot-file", default=None,
                   help="where few-shot examples come from (default: the synthetic train split, or the dataset "
                        "itself, in which case the examples are left out of the evaluation)")
    p.add_argument("--drop-long", action="store_true",
                   help="leave out the samples whose rendered prompt leaves no room to generate in the model's "
                        "context (their ids go to the summary) instead of refusing the whole dataset")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, escapes allowed (e.g. '\\nQuestion:'): a completion ends at the first token "
                        "whose text holds it, kept; repeatable (default: newline for the synthetic task, else none)")
    p.add_argument("--seed", type=int, default=0, help="sampling and few-shot selection seed (default: 0)")
    p.add_argument("--reward-workers", type=int, default=2, help="reward worker processes (default: 2)")
    p.add_argument("--reward-timeout", type=float, default=5.0,
                   help="seconds per sample before its worker is killed (default: 5)")
    p.add_argument("--correct-threshold", type=float, default=1.0,
                   help="a completion counts as correct when its reward >= this (default: 1)")
    p.add_argument("--device", default="cpu", help="torch device for the model (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model weight dtype (default: float32)")
    p.add_argument("--output", default="eval_results.jsonl",
                   help="per-sample JSONL; the summary goes to <name>.summary.json (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


# Python's string escapes (a \x, \u, \U or \N cut short is matched too, so that it is reported, not kept)
_ESCAPE_RE = re.compile(r"\\(?:[\\'\"abfnrtv]|x[0-9a-fA-F]{0,2}|u[0-9a-fA-F]{0,4}|U[0-9a-fA-F]{0,8}"
                        r"|N(?:\{[^}]*\})?|[0-7]{1,3})")


def _stop_strings(stops: Sequence[str]) -> list[str]:
    """``--stop`` values with their escapes read (``'\\n'`` is a newline); any other text, a backslash that
    starts no escape (``'\\)'``, ``'\\→'``) included, is kept as it is."""
    out = []
    for raw in stops:
        try:
            text = _ESCAPE_RE.sub(lambda m: codecs.decode(m.group(0), "unicode_escape"), raw)
        except UnicodeDecodeError as e:
            raise ValueError(f"--stop {raw!r}: not a valid escape sequence ({e.reason}); write e.g. '\\n'") from None
        if not text:
            raise ValueError(f"--stop {raw!r} is empty; a stop string needs at least one character")
        out.append(text)
    return out


# SamplingParams' field names as the command line spells them, for its error messages
_SAMPLING_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                   "top_p": "--top-p", "n": "-n", "seed": "--seed"}


def _check_sampling(args: argparse.Namespace, n: int, ks: Sequence[int], temperature: float, max_new: int) -> None:
    """The checks ``evaluate`` and ``SamplingParams`` make on the sampling options, made before the model is
    loaded (which takes minutes for a large one), with the flags' names in the messages."""
    from llamarl.generation import SamplingParams

    if not ks or min(ks) < 1 or max(ks) > n:
        raise ValueError(f"-k {args.k}: every k must satisfy 1 <= k <= n={n} (-n, completions per prompt)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1 (prompts per generation batch), got {args.batch_size}")
    try:
        SamplingParams(max_new_tokens=max_new, temperature=temperature, top_k=args.top_k, top_p=args.top_p, n=n,
                       seed=args.seed)
    except ValueError as e:
        message = str(e)
        for name, flag in _SAMPLING_FLAGS.items():
            message = message.replace(f"SamplingParams.{name} ", f"{flag} ", 1)
        raise ValueError(message) from None


def run(args: argparse.Namespace) -> EvalResult:
    import torch

    from llamarl.models import Llama, load_tokenizer
    from llamarl.models.hf_io import generation_eos_ids
    from llamarl.rewards.model import RewardModelScorer, check_reader

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (samples to evaluate), got {args.limit}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    out = Path(args.output)
    if out.is_dir() or out.with_name(out.stem + ".summary.json").is_dir():
        raise ValueError(f"--output {args.output} is a directory; pass a file name such as {out / 'eval.jsonl'}")
    problem = unwritable(out.parent)  # where the results go must take them: found now, not after the evaluation
    if problem:
        raise ValueError(f"--output {args.output}: cannot write into {out.parent}: {problem}")
    if not math.isfinite(args.correct_threshold):
        raise ValueError(f"--correct-threshold must be a finite number (a reward >= it counts as correct), got "
                         f"{args.correct_threshold}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: llamarl.eval runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA device; use --device cpu")
    if not Path(args.model).exists():
        raise ValueError(f"--model {args.model} does not exist (pass a Hugging Face model directory or a run's "
                         "checkpoints/step_NNNNNN/policy)")
    if args.dataset.startswith("synthetic:") and not args.dataset.startswith(SYNTHETIC_PREFIX):
        raise ValueError(f"--dataset {args.dataset}: unknown synthetic dataset; known: {SYNTHETIC_PREFIX}[:options]")
    synthetic = args.dataset.startswith(SYNTHETIC_PREFIX)
    verified = args.reward != "none"  # none: the reward model alone (no verifier, no answers needed)
    if not verified and args.reward_model is None:
        raise ValueError("--reward none scores with the reward model alone: pass --reward-model DIR")
    if not verified and args.few_shot:
        raise ValueError("--few-shot shows solved examples, which need answers; --reward none reads none")
    if args.reward_model is not None and not Path(args.reward_model).is_dir():
        raise ValueError(f"--reward-model {args.reward_model}: no such directory (pass a Hugging Face "
                         "LlamaForSequenceClassification directory)")
    if synthetic:
        task, count = parse_synthetic_spec(args.dataset)
        samples = task.heldout_samples(count if args.limit is None else min(count, args.limit))
    else:
        samples = load_dataset(args.dataset, args.prompt_field, args.answer_field, id_field=args.id_field,
                               require_answers=verified)
    if args.few_shot_file:
        shot_pool = load_dataset(args.few_shot_file, args.prompt_field, args.answer_field, id_field=args.id_field)
    elif synthetic:
        shot_pool = task.train_samples(max(args.few_shot * 10, 1)) if args.few_shot else []
    else:
        shot_pool = samples
    shots = select_shots(shot_pool, args.few_shot, seed=args.seed) if args.few_shot else []
    if shots:  # a problem shown solved is not evaluated (shots from this file, or the same problem in another)
        used = {shot_key(s) for s in shots}
        samples = [s for s in samples if shot_key(s) not in used]
    if not synthetic and args.limit is not None:
        samples = samples[: args.limit]
    reward_spec = args.reward or ("exact" if synthetic else None)
    if reward_spec is None:
        raise ValueError("--reward is required for a dataset file (gsm8k, math, exact or module:function; none "
                         "with --reward-model)")
    if verified:
        load_reward(reward_spec)  # a bad spec fails here, before the model is loaded
        _check_reward_on(reward_spec, samples)
    args.reward = reward_spec
    n = args.n
    if n < 1:
        raise ValueError(f"-n must be >= 1 (completions per prompt), got {n}")
    try:
        ks = [int(x) for x in args.k.split(",")] if args.k else sorted({1, n})
    except ValueError:
        raise ValueError(f"-k {args.k!r}: must be comma-separated integers, e.g. -k 1,8") from None
    temperature = args.temperature if args.temperature is not None else (0.0 if n == 1 else 1.0)
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (16 if synthetic else 256)
    _check_sampling(args, n, ks, temperature, max_new)  # before the model is loaded, not after
    if n > 1 and temperature == 0.0:
        print(f"llamarl.eval: warning: -n {n} with --temperature 0 samples the same greedy completion {n} times; "
              "pass@k then equals pass@1", file=sys.stderr)
    for flag, text in (("--template", args.template), ("--system", args.system)):
        if literal_escapes(text):  # (--stop reads escapes; a template cannot: \boxed, \frac, \text are LaTeX)
            print(f"llamarl.eval: warning: {flag} {text!r} holds a backslash followed by n or t as two characters, "
                  "not a newline or a tab, so the model sees them as written; if the run was trained with a newline "
                  f"there, pass one (bash: {flag} $'...\\n...')", file=sys.stderr)

    from llamarl.checkpoint import training_dir_hint

    hint = training_dir_hint(args.model)
    if hint:
        raise ValueError(f"--model {args.model}: {hint}")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    fmt = PromptFormat(template=args.template, chat=args.chat, system=args.system)
    if args.reward_model is not None:  # what it reads with, against its vocabulary: before any weights are read
        messages = PromptFormatter(fmt, shots=shots, tokenizer=tokenizer).messages(samples[0]) if samples else None
        try:
            check_reader(args.reward_model, tokenizer, chat=args.chat, messages=messages)
        except (OSError, ValueError) as e:
            raise ValueError(f"--reward-model {args.reward_model}: {e}") from None
    stops = args.stop if args.stop is not None else (["\\n"] if synthetic else [])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = Llama.from_pretrained(args.model, dtype=dtype, device=args.device).eval()
    scorer = None if args.reward_model is None else RewardModelScorer(  # (training's end-of-text ids: eos_ids)
        args.reward_model, policy_tokenizer=tokenizer, eos_ids=eos_ids(tokenizer, model.config, args.model),
        chat=args.chat, dtype="bfloat16" if args.dtype == "bfloat16" else "float32", device=args.device,
        batch_size=args.batch_size)
    with (RewardPool(reward_spec, num_workers=args.reward_workers, timeout_s=args.reward_timeout) if verified
          else contextlib.nullcontext()) as pool:
        return evaluate(
            model, tokenizer, samples, pool, n=n, k=ks, temperature=temperature, max_new_tokens=max_new,
            batch_size=args.batch_size, fmt=fmt, shots=shots, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
            stop_token_ids=list(generation_eos_ids(args.model)), stop=_stop_strings(stops),
            correct_threshold=args.correct_threshold,
            progress=not args.no_progress, drop_long=args.drop_long, reward_model=scorer,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        result = run(args)
    except (FileNotFoundError, ValueError, ImportError, RewardPoolError) as e:
        print(f"llamarl.eval: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the reward workers are shut down on the way out (RewardPool's context)
        print(f"llamarl.eval: interrupted; nothing was written to {args.output}", file=sys.stderr)
        return 130
    print(result.format())
    try:
        out = result.write_jsonl(args.output)
        summary_path = out.with_name(out.stem + ".summary.json")
        summary_path.write_text(json.dumps({"dataset": args.dataset, "model": args.model, "reward": args.reward,
                                            "reward_model": args.reward_model, **result.summary()}, indent=2))
    except OSError as e:  # (checked before the evaluation; e.g. the disk filled meanwhile): the metrics are printed
        print(f"llamarl.eval: error: cannot write --output {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"per-sample results: {out}\nsummary: {summary_path}")
    if args.reward == "none" and result.model_score is None:  # nothing was measured: not a success
        print("llamarl.eval: error: the reward model could score no completion (see model_error in the "
              "per-sample results)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
