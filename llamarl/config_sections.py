"""The run configuration's sections: one small frozen dataclass per component, each validated on construction.

    PolicyConfig, GeneratorConfig, TrainerConfig, RewardConfig, DataConfig, WarmStartConfig, RunConfig

Each section coerces its fields by their types (``llamarl.config_values.coerce``: values given as text are
parsed, plain ``str`` values from Python callers are not) and checks its own ranges and choices in
``check()``; every message starts with the field it is about ("trainer.lr: must be > 0, got -1"). The rules
that join sections, the YAML I/O and the placement layout are ``TrainConfig``'s (``llamarl.config``, which
re-exports every name here). Pure: no filesystem access and no torch import.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Literal

from llamarl.config_values import VERBATIM, coerce, fail
from llamarl.reporting import parse_report_to
from llamarl.runtime.placement import Layout, LayoutError

# Names checked without importing the modules that define them (llamarl.models.config.LLAMA_CONFIGS,
# llamarl.rewards.BUILTIN_REWARDS, llamarl.data): validating a command line must stay cheap.
BUILTIN_MODELS = ("tiny",)  # more names are looked up in LLAMA_CONFIGS when needed
SYNTHETIC_DATASETS = ("arithmetic",)  # "synthetic:arithmetic[:options]"
REWARD_NAMES = ("exact", "gsm8k", "math", "code")  # the built-in verifiers
NO_VERIFIER = "none"  # reward.reward=none: the reward model alone
# the built-in extra terms (llamarl.rewards.format)
FORMAT_REWARD_NAMES = ("format_exact", "format_gsm8k", "format_math", "format_code")
DATASET_SUFFIXES = (".jsonl", ".parquet")


# the sampler's smallest temperature (llamarl.generation.sampling.MIN_TEMPERATURE, equal by a test; not
# imported from there, so that reading a config does not import torch)
MIN_TEMPERATURE = 1e-4


class _Section:
    """Base of every config section: type coercion and validation after construction."""

    SECTION: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self), include_extras=True)
        for f in dataclasses.fields(self):
            value = coerce(f"{self.SECTION}.{f.name}", getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Range and consistency checks of this section (override)."""

    def _positive(self, name: str, strict: bool = True) -> None:
        v = getattr(self, name)
        if (v <= 0 if strict else v < 0) or (isinstance(v, float) and not math.isfinite(v)):
            fail(f"{self.SECTION}.{name}", "must be > 0" if strict else "must be >= 0", v)


@dataclass(frozen=True)
class PolicyConfig(_Section):
    SECTION = "policy"
    model: str = "tiny"  # a built-in model name or a Hugging Face Llama directory
    dtype: Literal["float32", "bfloat16"] = "float32"
    tokenizer: str | None = None  # tokenizer dir/file; None: the model's own

    def check(self) -> None:
        if not self.model.strip():
            fail("policy.model", f"must be a built-in model ({', '.join(BUILTIN_MODELS)}) or a model directory",
                 self.model)


@dataclass(frozen=True)
class GeneratorConfig(_Section):
    SECTION = "generator"
    replicas: int = 1
    tp: int = 1
    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    # top-k / nucleus / min-p sampling (0 / 1 / 0: off); min-p keeps the tokens at least min_p times as likely as
    # the most likely one (applied first, then top-k, then top-p: vLLM's order)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # the behaviour log-probs mu with truncation: "processed" (the truncated distribution the tokens are drawn
    # from, so the AIPO weight pi/mu is exact) or "raw" (the untruncated softmax(z / T); the weights then do not
    # correct for the truncation, and the run warns); vLLM's logprobs_mode, llamarl.generation.sampling
    logprobs_mode: Literal["processed", "raw"] = "processed"
    quantization: Literal["none", "int8", "fp8"] = "none"
    # stop strings: a completion ends at the first token whose text holds one (kept; llamarl.generation.stop),
    # e.g. ["\nQuestion:"] for few-shot prompts "Question: {prompt}\nAnswer: " (examples are joined by a newline)
    # or ["</answer>"]; on the command line a YAML list of quoted items (--set 'generator.stop=["\nQuestion:"]')
    # or one string, taken as it is
    stop: Annotated[tuple[str, ...], VERBATIM] = ()
    # DAPO's dynamic sampling: a prompt whose samples all earn the same reward teaches nothing (advantage 0), so
    # draw further batches of prompts_per_step prompts until the step has prompts_per_step prompts whose rewards
    # differ, at most max_sample_batches batches (then flat ones fill the step); the controller's docstring
    dynamic_sampling: bool = False
    max_sample_batches: int = 4

    def check(self) -> None:
        for name in ("replicas", "tp", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                     "max_sample_batches"):
            self._positive(name)
        self._positive("top_k", strict=False)
        if "" in self.stop:
            fail("generator.stop", "must hold non-empty strings", list(self.stop))
        if not self.temperature > 0 or not math.isfinite(self.temperature):
            fail("generator.temperature", "must be > 0 (RL needs sampling; 0 would make every sample of a "
                 "prompt identical)", self.temperature)
        if self.temperature < MIN_TEMPERATURE:
            fail("generator.temperature", f"must be >= {MIN_TEMPERATURE} (below it the scaled logits overflow)",
                 self.temperature)
        if not 0 < self.top_p <= 1:
            fail("generator.top_p", "must be in (0, 1]", self.top_p)
        if not 0 <= self.min_p <= 1:
            fail("generator.min_p", "must be in [0, 1] (0: off)", self.min_p)


@dataclass(frozen=True)
class TrainerConfig(_Section):
    SECTION = "trainer"
    ranks: int = 1
    parallel: Literal["fsdp", "ddp", "none"] = "fsdp"
    lr: float = 1e-5
    # learning rate at RL step k (0-based; llamarl.algorithms.lr_schedule): linear warm-up to lr over the
    # first lr_warmup_steps steps, then "constant", or "cosine"/"linear" decay to min_lr_ratio * lr at
    # run.max_steps (a --resume that raises --max-steps stretches the rest of the decay to the new end)
    lr_warmup_steps: int = 0
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    # > 0: a micro-batch holds as many sequences as fit in this many padded token positions (at least one;
    # veRL's use_dynamic_bsz / ppo_max_token_len_per_gpu), and micro_batch_size is not used; 0: off
    micro_batch_tokens: int = 0
    # order a rank's sequences by length (prompt groups by their longest) before cutting micro-batches, so
    # each holds similar lengths; every micro-batch runs only up to its longest sequence (llamarl.micro_batches)
    length_grouping: bool = True
    # optimizer updates per RL step: the step's prompt groups are cut into mini_batches equal parts (whole
    # groups), and epochs passes are made over them, one AdamW update per part (veRL's ppo_mini_batch_size /
    # ppo_epochs, TRL's num_iterations); the generators receive the weights once, after the last update
    mini_batches: int = 1
    epochs: int = 1
    # several updates per step: pi/pi_old clipped to [1 - clip_ratio, 1 + clip_ratio_high], tokens weighted by
    # min(pi_old/mu, rho), pi_old the step's starting policy (AReaL's decoupled PPO; DAPO: clip_ratio_high=0.28);
    # 0: no clip. A step of one update is plain AIPO either way (llamarl.algorithms.aipo)
    clip_ratio: float = 0.2
    clip_ratio_high: float | None = None  # None: clip_ratio
    # the trainer's weights and AdamW state; float32 with policy.dtype=bfloat16 keeps full-precision weights for
    # the updates and a bfloat16 generator (the weight sync casts). bfloat16 steps bf16 weights directly (warned)
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the forward/backward's precision; None: trainer.dtype. bfloat16 with dtype=float32 is mixed precision (the
    # usual GPU recipe): bf16 matmuls, fp32 master weights, gradients and AdamW state (autocast on one rank or
    # DDP; FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) when sharded)
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    loss: Literal["auto", "fused", "reference"] = "auto"  # auto: fused Triton kernel where it runs
    rho: float = 2.0  # AIPO one-sided truncation of pi/mu
    kl_coef: float = 0.0
    # the KL-to-reference term's estimator: k3 (GRPO's; its gradient is that of KL(pi_ref||pi)) or k2
    # (1/2 (log pi - log pi_ref)^2, veRL's "mse": the gradient of KL(pi||pi_ref) on-policy); llamarl.algorithms.aipo
    kl_estimator: Literal["k3", "k2"] = "k3"
    entropy_coef: float = 0.0
    advantage: Literal["mean", "grpo", "rloo", "reinforce_baseline"] = "mean"  # llamarl.algorithms.advantages
    # the loss's mean: over tokens, over sequences (of their token means), or Dr. GRPO's "constant"
    # (sum / (sequences x generator.max_new_tokens): no length bias); llamarl.algorithms.aipo
    norm: Literal["token", "sequence", "constant"] = "token"
    # where the importance ratios are taken: per token (AIPO), or per sequence (GSPO's ratio, TRL's
    # importance_sampling_level="sequence"): each sequence's geometric-mean pi/mu weights, truncates (and, with
    # several updates, clips) all its tokens together; llamarl.algorithms.aipo
    ratio_level: Literal["token", "sequence"] = "token"
    # "aipo": weight each token by min(pi/mu, rho); "none": plain policy gradient that treats stale
    # samples as on-policy (w = 1) — only for the ablation that shows why the correction matters
    correction: Literal["aipo", "none"] = "aipo"
    # skip samples whose advantage is 0 (a group with equal rewards): they add nothing to the gradient,
    # so the update is the same with less work; applies only where that is exact (kl_coef = entropy_coef = 0,
    # either norm), see llamarl.rollouts. AIPO metrics then cover the trained tokens.
    skip_zero_advantage: bool = True
    # train on no token of a completion cut by generator.max_new_tokens (its reward still counts in its group's
    # baseline): TRL's mask_truncated_completions, DAPO's overlong filtering; llamarl.rollouts.without_truncated
    mask_truncated: bool = False
    # run each prompt once for its samples_per_prompt completions instead of once per sample (exact up to
    # float reassociation; llamarl.models.shared_prefix); False: one flat right-padded row per sample
    share_prompts: bool = True
    # recompute each decoder layer's activations in the backward pass instead of storing them (less memory
    # for long sequences and big micro-batches, about one more forward of compute; same gradients)
    activation_checkpointing: bool = False

    def check(self) -> None:
        if self.compute_dtype == "float32" and self.dtype == "bfloat16":
            fail("trainer.compute_dtype", "float32 with trainer.dtype=bfloat16 would compute in float32 from weights "
                 "already rounded to bfloat16; for full-precision weights with bfloat16 compute set "
                 "trainer.dtype=float32 and trainer.compute_dtype=bfloat16", self.compute_dtype)
        self._positive("ranks")
        self._positive("lr")
        self._positive("lr_warmup_steps", strict=False)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("trainer.min_lr_ratio", "must be in [0, 1] (the final learning rate as a fraction of lr)",
                 self.min_lr_ratio)
        self._positive("micro_batch_size")
        self._positive("micro_batch_tokens", strict=False)
        self._positive("mini_batches")
        self._positive("epochs")
        for name in ("weight_decay", "grad_clip", "kl_coef", "entropy_coef"):
            self._positive(name, strict=False)
        if self.parallel == "none" and self.ranks != 1:
            fail("trainer.parallel", f"'none' needs trainer.ranks=1 (got ranks={self.ranks}); use fsdp or ddp",
                 self.parallel)
        if not all(0 <= b < 1 for b in self.betas):
            fail("trainer.betas", "both must be in [0, 1)", self.betas)
        if not 0 <= self.clip_ratio < 1:
            fail("trainer.clip_ratio", "must be in [0, 1) (0: no clip; veRL and TRL use 0.2)", self.clip_ratio)
        high = self.clip_ratio_high
        if high is not None and not (high >= 0 and math.isfinite(high) and self.clip_ratio > 0):
            fail("trainer.clip_ratio_high", "must be a finite number >= 0 (DAPO: 0.28), with trainer.clip_ratio > 0",
                 high)
        if not (self.rho >= 1 and math.isfinite(self.rho)):
            fail("trainer.rho", "must be >= 1 (AIPO truncates pi/mu at rho; typical 2-10)", self.rho)


@dataclass(frozen=True)
class RewardConfig(_Section):
    SECTION = "reward"
    # the verifier: a built-in name or "module:function" taking (completion, answer) -> float; it alone decides
    # correctness (held-out accuracy counts its reward >= 1). "none": no verifier, the reward model alone
    # (reward.model; RLHF on prompts without reference answers: no accuracy, evaluations report its score)
    reward: str = "exact"
    # more reward functions added to the verifier's reward (TRL's reward_funcs): built-in format_exact |
    # format_gsm8k | format_math (1 if the answer is in the form the verifier reads) or module:function; a
    # sample's reward is sum_i weights[i] * r_i over [reward, *extra] (llamarl.rewards.terms)
    extra: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()  # one per function, the verifier first; empty: 1.0 each
    # DAPO's soft overlong punishment, a reward term "overlong" (llamarl.rewards.terms.overlong_penalty): a
    # completion within the last overlong_buffer tokens of generator.max_new_tokens loses up to
    # overlong_penalty, linearly in how far in it reached (0: off)
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # a learned reward model (llamarl.rewards.model; TRL's reward_funcs=<model>): a Hugging Face
    # LlamaForSequenceClassification directory with one label; model_weight x its score of prompt + completion is
    # a reward term "model" added to the functions' reward (None: none). It runs in the controller process, on
    # the run's device, in policy.dtype
    model: str | None = None
    model_weight: float = 1.0
    model_batch_size: int = 16  # sequences per reward-model forward
    # reward worker processes of the controller (0 counts as 1: scoring always runs in a worker, under the timeout)
    workers: int = 2
    timeout_s: float = 5.0  # per completion
    # stop the run once the reward function failed (raised, timed out) on every sample of this many steps in a
    # row: such a run trains on nothing (0: never stop)
    max_failed_steps: int = 3

    def check(self) -> None:
        self._positive("workers", strict=False)
        self._positive("timeout_s")
        self._positive("max_failed_steps", strict=False)
        if self.reward == NO_VERIFIER:
            if self.model is None:
                fail("reward.reward", "none (no verifier) needs a reward model to score with: set reward.model=DIR",
                     self.reward)
            if self.extra:
                fail("reward.extra", "needs a verifier in reward.reward: with reward.reward=none the reward model "
                     "alone scores", list(self.extra))
            if self.weights:
                fail("reward.weights", "weigh reward functions, and reward.reward=none has none (reward.model_weight "
                     "weighs the reward model)", list(self.weights))
        else:
            _check_reward_spec("reward.reward", self.reward, (*REWARD_NAMES, f"{NO_VERIFIER} (reward.model alone)"))
        for i, spec in enumerate(self.extra):
            _check_reward_spec(f"reward.extra[{i}]", spec, REWARD_NAMES + FORMAT_REWARD_NAMES)
        if self.weights and len(self.weights) != 1 + len(self.extra):
            fail("reward.weights", f"needs one weight per reward function, the verifier first: {1 + len(self.extra)} "
                 f"for reward.reward and {len(self.extra)} reward.extra, or none (1.0 each)", list(self.weights))
        if not all(math.isfinite(w) for w in self.weights):
            fail("reward.weights", "must be finite numbers", list(self.weights))
        self._positive("overlong_buffer", strict=False)
        self._positive("overlong_penalty", strict=False)
        if self.model is not None and not self.model.strip():
            fail("reward.model", "must be a reward model directory, or unset for none", self.model)
        if not math.isfinite(self.model_weight):
            fail("reward.model_weight", "must be a finite number", self.model_weight)
        self._positive("model_batch_size")

    @property
    def specs(self) -> tuple[str, ...]:
        """The reward functions, the verifier first (none with reward.reward=none)."""
        return () if self.reward == NO_VERIFIER else (self.reward, *self.extra)

    @property
    def verified(self) -> bool:
        """Whether a verifier scores the samples (reward.reward is not none): accuracy exists."""
        return self.reward != NO_VERIFIER

    def user_functions(self) -> list[tuple[str, str]]:
        """(field, spec) of each spec that names a user's function, not a built-in: the field is
        ``reward.reward`` or ``reward.extra[i]``, for messages."""
        fields = ["reward.reward", *(f"reward.extra[{i}]" for i in range(len(self.extra)))]
        return [(f, s) for f, s in zip(fields, self.specs) if s not in REWARD_NAMES + FORMAT_REWARD_NAMES]


def _check_reward_spec(path: str, spec: str, builtins: tuple[str, ...]) -> None:
    module, sep, fn = spec.rpartition(":")
    if spec not in builtins and not (sep and module.strip() and fn.strip()):
        fail(path, f"must be one of {', '.join(builtins)}, 'module:function' or 'path/to/file.py:function'", spec)


@dataclass(frozen=True)
class DataConfig(_Section):
    SECTION = "data"
    dataset: str = "synthetic:arithmetic"  # "synthetic:NAME[:options]" or a .jsonl/.parquet file
    prompt_field: str = "question"
    answer_field: str = "answer"
    # the field of sample ids when every record has it (they must be unique); null: "<file stem>-<index>"
    id_field: str | None = "id"
    template: str = "{prompt}"
    # render each prompt with the tokenizer's chat template as one user turn (instruct models), after
    # ``template``; ``system`` adds a system message. As llamarl.eval --chat/--system.
    chat: bool = False
    system: str | None = None
    few_shot: int = 0  # solved examples before every prompt, drawn from the training side (llamarl.train_data)
    # held-out problems: eval_size distinct prompts drawn from data.dataset, or from this .jsonl/.parquet file
    # (up to eval_size of them, 0: all; veRL's data.val_files), whose prompts then never reach training
    eval_size: int = 64
    eval_dataset: str | None = None

    def check(self) -> None:
        self._positive("few_shot", strict=False)
        self._positive("eval_size", strict=False)  # held-out accuracy before and after RL is part of every run
        if self.eval_size == 0 and self.eval_dataset is None:
            fail("data.eval_size", "must be > 0 (0 means every prompt of data.eval_dataset, which is not set)",
                 self.eval_size)
        for name in ("prompt_field", "answer_field"):
            if not getattr(self, name):
                fail(f"data.{name}", "must name a field of the dataset records", getattr(self, name))
        if self.id_field is not None and not self.id_field.strip():
            fail("data.id_field", "must name a field of the dataset records, or be null (ids by position)",
                 self.id_field)
        if self.dataset.startswith("synthetic:"):
            if self.dataset.split(":")[1] not in SYNTHETIC_DATASETS:
                fail("data.dataset", f"unknown synthetic dataset; known: "
                     f"{', '.join('synthetic:' + n for n in SYNTHETIC_DATASETS)}", self.dataset)
            from llamarl.data.synthetic import parse_synthetic_spec  # (no torch: cheap) its options, up front

            try:
                parse_synthetic_spec(self.dataset)
            except (ValueError, TypeError) as exc:
                fail("data.dataset", str(exc))
        if self.eval_dataset is not None and (self.eval_dataset.startswith("synthetic:")
                                              or not self.eval_dataset.strip()):
            fail("data.eval_dataset", "must be a .jsonl or .parquet file of held-out problems (a synthetic task "
                 "holds its own out: leave this null)", self.eval_dataset)
        if "{prompt}" not in self.template:  # filled in literally (str.replace): other braces stay as written
            fail("data.template", "must contain {prompt} (where the problem text goes; other braces, e.g. "
                 "LaTeX's \\boxed{}, are kept as written)", self.template)
        if self.system is not None and not self.chat:
            fail("data.system", "needs data.chat=true (a raw prompt has no roles; put the text into data.template)",
                 self.system)


@dataclass(frozen=True)
class WarmStartConfig(_Section):
    """Supervised warm start of the policy on the task's answers before RL (0 steps: none), for the built-in
    models only (their weights start random); a Hugging Face model directory starts RL from its own weights."""

    SECTION = "warm_start"
    steps: int = 200  # at most this many steps
    lr: float = 1e-3
    batch_size: int = 32
    target_accuracy: float = 0.0  # > 0: stop once greedy accuracy on probe training problems reaches it
    cache_dir: str | None = None  # reuse warm-started weights across runs

    def check(self) -> None:
        if not 0.0 <= self.target_accuracy <= 1.0:
            fail("warm_start.target_accuracy", "must be in [0, 1] (0 disables the accuracy stop)",
                 self.target_accuracy)
        self._positive("steps", strict=False)
        self._positive("lr")
        self._positive("batch_size")


@dataclass(frozen=True)
class RunConfig(_Section):
    SECTION = "run"
    mode: Literal["async", "sync"] = "async"
    max_staleness: int = 1  # policy versions the generator may run ahead of the trainer
    max_steps: int = 50
    seed: int = 0
    eval_every: int = 10  # steps; 0: evaluate only before and after
    # the held-out evaluation: greedy (1 sample, temperature 0), or eval_samples completions per problem drawn at
    # eval_temperature from the full distribution (veRL's val_kwargs): accuracy is their mean (mean@k), and
    # pass@k (a correct one among the k) is logged beside it
    eval_samples: int = 1
    eval_temperature: float = 0.0
    checkpoint_every: int = 25  # steps; 0: only at the end
    keep_checkpoints: int = 3
    log_samples: int = 2  # decoded completions per step written to OUT/samples.jsonl (0: none)
    report_to: str = "none"  # experiment trackers: none, tensorboard, wandb, or "tensorboard,wandb"
    wandb_project: str = "llamarl"
    out: str | None = None
    resume: str | None = None
    layout: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # an executor command (one generate, train_step, checkpoint...) running longer is a hang: the stuck ranks
    # print their Python stacks and the run stops with a message instead of waiting forever (0: no limit)
    command_timeout_s: float = 1800.0

    def check(self) -> None:
        self._positive("max_steps")
        self._positive("command_timeout_s", strict=False)
        if self.command_timeout_s > 1e6:  # the runtime's MAX_COMMAND_TIMEOUT_S (its waits count milliseconds)
            fail("run.command_timeout_s", "must be at most 1e6 seconds (about 11 days); 0 means no limit",
                 self.command_timeout_s)
        self._positive("keep_checkpoints")
        self._positive("eval_samples")
        self._positive("eval_temperature", strict=False)
        if 0 < self.eval_temperature < MIN_TEMPERATURE:
            fail("run.eval_temperature", f"must be 0 (greedy) or at least {MIN_TEMPERATURE}", self.eval_temperature)
        if self.eval_samples > 1 and self.eval_temperature == 0:
            fail("run.eval_samples", "more than one greedy completion per problem would be the same completion; "
                 "set run.eval_temperature (e.g. 0.6 or 1.0) to sample them", self.eval_samples)
        for name in ("max_staleness", "seed", "eval_every", "checkpoint_every", "log_samples"):
            self._positive(name, strict=False)
        if self.seed >= 2**32:  # step seeds are seed * 1_000_003 + step (+ replica strides): they must fit int64
            fail("run.seed", "must be below 2**32", self.seed)
        if self.mode == "sync" and self.max_staleness != 0:
            fail("run.max_staleness", "must be 0 in sync mode (sync means no run-ahead); drop it or use "
                 "--mode async", self.max_staleness)
        if self.mode == "async" and self.max_staleness == 0:
            fail("run.max_staleness", "must be >= 1 in async mode (0 is sync mode: use --mode sync)",
                 self.max_staleness)
        try:
            parse_report_to(self.report_to)
        except ValueError as exc:
            fail("run.report_to", str(exc), self.report_to)
        if self.layout is not None:
            try:
                Layout.parse(self.layout)
            except LayoutError as exc:
                fail("run.layout", str(exc))
