"""Settings that are valid but likely not what was meant: printed as warnings when a run starts
(``llamarl.train``), never refused. ``config_warnings`` looks at the config alone; ``resume_warnings`` at
a resume against the run's saved config.yaml."""

from __future__ import annotations

import dataclasses
import math

from llamarl.config import TrainConfig, WarmStartConfig
from llamarl.run_files import resume_file
from llamarl.config_cli import saved_config
from llamarl.config_values import ConfigError
from llamarl.data.prompts import literal_escapes
from llamarl.algorithms import lr_at
from llamarl.models.config import LLAMA_CONFIGS
from llamarl.presets import PRESETS


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Settings that are valid but likely not what was meant; printed when a run starts."""
    out = []
    g = cfg.generator
    if (g.top_p < 1.0 or g.top_k > 0 or g.min_p > 0.0) and g.logprobs_mode == "raw":
        what = (f"generator.top_p={g.top_p}" if g.top_p < 1.0 else f"generator.top_k={g.top_k}" if g.top_k > 0
                else f"generator.min_p={g.min_p}")
        out.append(f"{what} samples from the truncated distribution, but generator.logprobs_mode=raw reports the log-"
                   "probs (mu) of the full softmax (llamarl.generation.sampling), so the AIPO importance weights do "
                   "not correct for the truncation; logprobs_mode=processed reports the sampler's own mu")
    if cfg.trainer.lr_warmup_steps >= cfg.run.max_steps:
        out.append(f"trainer.lr_warmup_steps={cfg.trainer.lr_warmup_steps} >= run.max_steps={cfg.run.max_steps}: "
                   "the learning rate never reaches trainer.lr")
    for stop in g.stop:
        if stop.startswith("[") and stop.endswith("]") and any(c in stop for c in ",'\""):
            out.append(f"generator.stop {stop!r} is one stop string that looks like a list: a list's items must all "
                       'be quoted, e.g. --set \'generator.stop=["</answer>", "\\nQuestion:"]\'')
        if "\\n" in stop or "\\t" in stop:
            out.append(f"generator.stop {stop!r} holds a backslash followed by n or t as two characters (a --set value "
                       "is taken literally); for a newline or a tab write a YAML list with double quotes, e.g. "
                       '--set \'generator.stop=["\\nQuestion:"]\'')
    for name in ("template", "system"):
        text = getattr(cfg.data, name)
        if literal_escapes(text):
            out.append(f"data.{name} {text!r} holds a backslash followed by n or t as two characters (a --set value "
                       "is taken literally), so the model sees them as written; for a newline or a tab write the "
                       f"value in a YAML file with double quotes, e.g. {name}: \"Q: {{prompt}}\\nA: \"")
    ws, base = dataclasses.replace(cfg.warm_start, cache_dir=None), PRESETS["default"].warm_start
    given = [WarmStartConfig(), *(dataclasses.replace(p.warm_start, cache_dir=None) for p in PRESETS.values())]
    if cfg.policy.model not in LLAMA_CONFIGS and ws not in given:  # set by the user, not by a preset
        changed = ", ".join(f"warm_start.{f.name}={getattr(ws, f.name)}" for f in dataclasses.fields(ws)
                            if getattr(ws, f.name) != getattr(base, f.name))
        out.append(f"{changed}: the warm start trains the built-in models only; policy.model={cfg.policy.model} "
                   "starts RL from its own weights, without a warm start")
    t = cfg.trainer
    if t.dtype == "bfloat16":
        out.append(f"trainer.dtype=bfloat16 steps AdamW on bfloat16 weights (no float32 master copy): an update below "
                   f"half a bfloat16 ulp is lost, so at trainer.lr={t.lr:g} most weights barely move (and norm weights "
                   "near 1.0 never do); --set trainer.dtype=float32 keeps float32 weights for the updates while the "
                   "generator stays in policy.dtype=bfloat16 (the weight sync casts), and --set "
                   "trainer.compute_dtype=bfloat16 keeps the bfloat16 compute (mixed precision)")
    if 0 < t.micro_batch_tokens <= g.max_new_tokens:
        out.append(f"trainer.micro_batch_tokens={t.micro_batch_tokens} is not above generator.max_new_tokens="
                   f"{g.max_new_tokens}: a sequence near the length limit does not fit the budget with its prompt, so "
                   "it runs alone, over budget; give the budget room for several full-length sequences")
    d = cfg.data
    if d.few_shot and not d.chat and not g.stop and not d.dataset.startswith("synthetic:"):
        out.append(f"data.few_shot={d.few_shot} without generator.stop: a base model tends to write the next example "
                   "after its answer, and the verifier then reads that example's answer; set a stop string that "
                   'starts an example, e.g. generator.stop: ["\\nQuestion:"] for the template '
                   '"Question: {prompt}\\nAnswer: "')
    return out


_LR_FIELDS = ("lr", "lr_schedule", "lr_warmup_steps", "min_lr_ratio")
_EVAL_FIELDS = ("eval_samples", "eval_temperature")


def resume_warnings(cfg: TrainConfig, step: int) -> list[str]:
    """A resume at ``step`` (steps done) whose settings move the learning-rate schedule (the rate jumps at the
    first resumed step instead of continuing the run's curve: ``lr_at``) or change how the held-out split is
    evaluated. Compared with the run's saved config.yaml (or the checkpoint's copy); nothing to say without one
    (a checkpoint of an earlier llamarl)."""
    saved = resume_file(cfg.run.resume)
    try:
        # as the resume read it ("lr: 3e-4" is a number, not YAML 1.1's string)
        old_cfg = saved_config(saved) if saved is not None else None
    except (OSError, ConfigError):
        old_cfg = None
    if old_cfg is None:
        return []
    out = []
    new = dataclasses.asdict(cfg.trainer)
    old = {**new, **{k: getattr(old_cfg.trainer, k) for k in _LR_FIELDS}}
    old_total = old_cfg.run.max_steps
    before, after = lr_at(step, old, old_total), lr_at(step, new, cfg.run.max_steps)
    if not math.isclose(before, after, rel_tol=1e-9, abs_tol=0.0):
        changed = [f"run.max_steps {old_total} -> {cfg.run.max_steps}"] if old_total != cfg.run.max_steps else []
        changed += [f"trainer.{k} {old[k]} -> {new[k]}" for k in _LR_FIELDS if old[k] != new[k]]
        out.append(f"the learning rate of step {step + 1} moves from {before:.4g} (the schedule the run was on) to "
                   f"{after:.4g} on this resume ({', '.join(changed)}): the {new['lr_schedule']} schedule restarts "
                   "from there; keep the run's values to continue its curve unchanged")
    evals = [f"run.{k} {getattr(old_cfg.run, k)} -> {getattr(cfg.run, k)}" for k in _EVAL_FIELDS
             if getattr(old_cfg.run, k) != getattr(cfg.run, k)]
    if evals:
        out.append(f"this resume evaluates otherwise than the run did ({', '.join(evals)}): its accuracies are not "
                   "comparable with the earlier ones, the accuracy before RL in summary.json included")
    return out
