"""Run configuration model: one small frozen dataclass per component, validated on construction.

    TrainConfig(policy, generator, trainer, reward, data, warm_start, run)

The sections are ``llamarl.config_sections`` (re-exported here); this module joins them: the cross-field
rules, the YAML file format and the placement layout.

Named presets live in ``llamarl.presets``; the command line and YAML files (``--preset``, ``--config``,
named flags, ``--set``) are read by ``llamarl.config_cli``. ``TrainConfig.to_dict``/``to_yaml``/``save``
write the YAML file format, which mirrors the dataclasses (``trainer: {lr: 3.0e-4}``), and
``TrainConfig.from_dict`` reads it back. Values given as text (the CLI, YAML strings such as ``3e-4``) are
parsed by the field's type, plain ``str`` values from Python callers are not (llamarl.config_values).

Validation happens before any process starts, and every message starts with the field it is about
("trainer.lr: must be > 0, got -1"):
* construction (``__post_init__``): types, ranges, choices, and cross-field rules (below); building from a
  dict rejects unknown sections and keys with a did-you-mean; pure, no filesystem access, so presets and
  tests can build configs freely;
* ``TrainConfig.check_environment()`` (``llamarl.config_env``; called by ``llamarl.config_cli.load_config``):
  files and directories exist, CUDA is there when asked for, a ``module:function`` reward imports, ``--out``
  is not an earlier run.

Mode and staleness: ``mode="sync"`` if and only if ``max_staleness == 0`` (sync is async with no run-ahead,
the baseline of every speed-up); a config that breaks this is an error (``llamarl.config_cli`` fills in
the one of the two that a command line leaves out).

Placement: ``trainer.ranks``/``trainer.parallel``, ``generator.tp``/``generator.replicas`` and
``reward.workers`` define the ``Layout``; ``run.layout`` ("trainer=2,generator=2x1,reward=2") is a shorthand
that must agree with those fields for the items it names (``llamarl.config_cli`` lets it set them).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llamarl._fs import write_text_atomic
from llamarl.config_sections import (BUILTIN_MODELS, DATASET_SUFFIXES, FORMAT_REWARD_NAMES, MIN_TEMPERATURE,
                                     REWARD_NAMES, SYNTHETIC_DATASETS, DataConfig, GeneratorConfig, PolicyConfig,
                                     RewardConfig, RunConfig, TrainerConfig, WarmStartConfig)
from llamarl.config_values import ConfigError, did_you_mean, fail, plain
from llamarl.run_files import RUN_CONFIG
from llamarl.runtime.placement import GeneratorSpec, Layout, LayoutError, RewardSpec, TrainerSpec

__all__ = [
    "BUILTIN_MODELS", "DATASET_SUFFIXES", "FORMAT_REWARD_NAMES", "MIN_TEMPERATURE", "REWARD_NAMES", "SECTIONS",
    "SYNTHETIC_DATASETS", "ConfigError", "DataConfig", "GeneratorConfig", "PolicyConfig", "RewardConfig",
    "RunConfig", "TrainConfig", "TrainerConfig", "WarmStartConfig",
]


@dataclass(frozen=True)
class TrainConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                fail(name, f"must be a {cls.__name__}", getattr(self, name))
        g, t = self.generator, self.trainer
        if not self.reward.verified and self.data.few_shot:
            fail("data.few_shot", "shows solved examples, which need reference answers, and reward.reward=none runs "
                 "read none", self.data.few_shot)
        if g.samples_per_prompt < 2:
            fail("generator.samples_per_prompt", f"must be >= 2: the '{t.advantage}' advantage compares the "
                 f"samples of one prompt", g.samples_per_prompt)
        batch = g.prompts_per_step * g.samples_per_prompt
        if batch % t.ranks:
            fail("trainer.ranks", f"the step's {g.prompts_per_step}x{g.samples_per_prompt}={batch} sequences "
                 f"must split evenly over the trainer ranks", t.ranks)
        if g.prompts_per_step % t.mini_batches:
            fail("trainer.mini_batches", f"must divide generator.prompts_per_step={g.prompts_per_step} (each "
                 "mini-batch holds whole prompt groups)", t.mini_batches)
        if self.reward.overlong_buffer >= g.max_new_tokens:
            fail("reward.overlong_buffer", f"must be below generator.max_new_tokens={g.max_new_tokens} (the "
                 "punishment starts overlong_buffer tokens before the end)", self.reward.overlong_buffer)
        if g.quantization != "none" and g.tp > 1:
            fail("generator.quantization", "quantized generators run with generator.tp=1 (the tensor-parallel "
                 "linears are not quantized); use more generator.replicas, or quantization=none", g.quantization)
        if t.dtype == "bfloat16" and self.policy.dtype == "float32":
            fail("trainer.dtype", "bfloat16 with policy.dtype=float32 (the generator's) would give the generator "
                 "weights rounded to bfloat16 in float32 storage; use trainer.dtype=float32 (the default), or set "
                 "policy.dtype=bfloat16 too", t.dtype)
        part = batch // t.mini_batches
        if part % t.ranks:
            fail("trainer.mini_batches", f"each of the {t.mini_batches} mini-batches holds {part} sequences, "
                 f"which must split evenly over trainer.ranks={t.ranks}", t.mini_batches)
        if self.run.layout is not None:
            for key, value in _layout_fields(self.run.layout).items():
                section, name = key.split(".")
                actual = getattr(getattr(self, section), name)
                if actual != value:
                    fail("run.layout", f"{self.run.layout!r} sets {key}={value} but {key}={actual}; "
                         f"give one or make them agree")

    # ---------------------------------------------------------------- derived views
    @property
    def device(self) -> str:
        """``run.device`` with "auto" resolved ("cuda" if torch sees a GPU, else "cpu")."""
        if self.run.device != "auto":
            return self.run.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def layout(self) -> Layout:
        """The process placement this config asks for."""
        return Layout(trainer=TrainerSpec(self.trainer.ranks, self.trainer.parallel),
                      generator=GeneratorSpec(self.generator.tp, self.generator.replicas),
                      reward=RewardSpec(self.reward.workers), device=self.device)

    def to_dict(self) -> dict:
        """Nested plain dict (tuples as lists), the YAML file format."""
        return {name: {f.name: plain(getattr(getattr(self, name), f.name))
                       for f in dataclasses.fields(getattr(self, name))} for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, run_dir: str | Path) -> Path:
        """Write ``run_dir/config.yaml``: every field of the run, with the paths of existing input files and
        directories made absolute (``with_absolute_paths``), so ``--resume run_dir`` works from any working
        directory. To start a new run from it with ``--config``, give a new ``--out`` (it names this run's)
        and drop ``run.resume``."""
        path = Path(run_dir) / RUN_CONFIG
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, self.with_absolute_paths().to_yaml())
        return path

    def with_absolute_paths(self) -> TrainConfig:
        """This config with ``policy.model``, ``policy.tokenizer``, ``data.dataset`` and ``data.eval_dataset``,
        reward function files (``path/to/file.py:function`` in ``reward.reward`` and ``reward.extra``),
        ``reward.model`` and ``run.resume`` absolute where they name an existing path (built-in names, synthetic
        datasets and importable modules stay as they are), and ``run.out`` absolute."""
        def absolute(value: str | None) -> str | None:
            return str(Path(value).resolve()) if value and Path(value).exists() else value

        def absolute_spec(spec: str) -> str:  # path/to/file.py:function
            module, sep, fn = spec.rpartition(":")
            return f"{absolute(module)}{sep}{fn}" if sep and module.endswith(".py") else spec

        return dataclasses.replace(
            self,
            policy=dataclasses.replace(self.policy, tokenizer=absolute(self.policy.tokenizer),
                                       model=self.policy.model if self.policy.model in BUILTIN_MODELS
                                       else absolute(self.policy.model)),
            data=dataclasses.replace(self.data, dataset=self.data.dataset if self.data.dataset.startswith("synthetic:")
                                     else absolute(self.data.dataset), eval_dataset=absolute(self.data.eval_dataset)),
            reward=dataclasses.replace(self.reward, reward=absolute_spec(self.reward.reward),
                                       extra=tuple(absolute_spec(s) for s in self.reward.extra),
                                       model=absolute(self.reward.model)),
            # run.out: also before the directory exists (a new run's config.yaml is rendered first)
            run=dataclasses.replace(self.run, out=str(Path(self.run.out).resolve()) if self.run.out else self.run.out,
                                    resume=absolute(self.run.resume)))

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """Build from a nested dict; missing keys keep their defaults, unknown keys are errors."""
        return _build(_merge(TrainConfig().to_dict(), data, "config"))

    # ---------------------------------------------------------------- environment
    def check_environment(self) -> None:
        """Check what depends on this machine (llamarl.config_env.check_environment). Raises ConfigError."""
        from llamarl.config_env import check_environment

        check_environment(self)


SECTIONS: dict[str, type] = {
    "policy": PolicyConfig, "generator": GeneratorConfig, "trainer": TrainerConfig, "reward": RewardConfig,
    "data": DataConfig, "warm_start": WarmStartConfig, "run": RunConfig,
}


# -------------------------------------------------------------------- internals
def _merge(base: dict, update: dict, source: str) -> dict:
    """Copy of ``base`` with ``update``'s sections/keys applied; unknown names raise with a suggestion."""
    out = {name: dict(section) for name, section in base.items()}
    for section, values in update.items():
        if section not in SECTIONS:
            fail(str(section), f"unknown config section in {source}{did_you_mean(str(section), SECTIONS)}; "
                 f"sections: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            fail(section, f"must be a mapping of keys in {source}", values)
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for key, value in values.items():
            if key not in names:
                hint = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
                did = f" (did you mean '{section}.{hint[0]}'?)" if hint else ""
                fail(f"{section}.{key}", f"unknown key in {source}{did}; "
                     f"'{section}' has: {', '.join(names)}")
            out[section][key] = value
    return out


def _build(data: dict) -> TrainConfig:
    return TrainConfig(**{name: cls(**data[name]) for name, cls in SECTIONS.items()})


def _layout_fields(spec: str) -> dict[str, Any]:
    """Fields set by a layout shorthand, only for the items the string names."""
    try:
        layout = Layout.parse(spec)
    except LayoutError as exc:
        raise ConfigError(f"run.layout: {exc}") from None
    named = {part.partition("=")[0].strip() for part in spec.split(",")}
    fields: dict[str, Any] = {}
    if "trainer" in named:
        fields.update({"trainer.ranks": layout.trainer.ranks, "trainer.parallel": layout.trainer.parallel})
    if "generator" in named:
        fields.update({"generator.tp": layout.generator.tp, "generator.replicas": layout.generator.replicas})
    if "reward" in named:
        fields["reward.workers"] = layout.reward.workers
    if "device" in named:
        fields["run.device"] = layout.device
    return fields


