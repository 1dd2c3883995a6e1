"""What a run configuration needs of this machine, checked before any process starts.

``check_environment(config)`` (``TrainConfig.check_environment``, called by ``llamarl.config_cli.load_config``)
raises ``ConfigError`` naming the field when: the policy is neither a built-in model nor a Hugging Face model
directory; the tokenizer or dataset file is missing or of an unsupported type; a ``module:function`` reward does
not import; ``reward.model`` is not a reward model checkpoint; a ``run.report_to`` backend is not installed;
``LLAMARL_START_METHOD`` is set to an unknown method; CUDA is asked for but absent; ``--resume`` holds no complete
checkpoint or is already at ``run.max_steps``; ``--out`` already holds another run. The construction checks in
``llamarl.config`` stay pure (no filesystem access); everything that reads the disk or imports user code is here.
"""

from __future__ import annotations

from pathlib import Path

from llamarl.config import BUILTIN_MODELS, DATASET_SUFFIXES, TrainConfig
from llamarl.run_files import resume_run_dir
from llamarl.config_values import ConfigError, fail
from llamarl.reporting import check_available, parse_report_to


def check_environment(config: TrainConfig) -> None:
    """Check what depends on this machine: paths, CUDA, importable reward. Raises ConfigError."""
    p = config.policy
    if p.model not in BUILTIN_MODELS:
        path = Path(p.model)
        if path.is_dir():
            if not (path / "config.json").is_file():
                from llamarl.checkpoint import training_dir_hint

                fail("policy.model", training_dir_hint(path) or "directory has no config.json; is it a Hugging "
                     "Face model directory?", p.model)
        else:
            from llamarl.models.config import LLAMA_CONFIGS

            if p.model not in LLAMA_CONFIGS:
                fail("policy.model", f"is neither a built-in model ({', '.join(LLAMA_CONFIGS)}) nor an "
                     f"existing directory; pass a Hugging Face Llama directory (config.json + "
                     f"*.safetensors)", p.model)
    if p.tokenizer is not None and not Path(p.tokenizer).exists():
        fail("policy.tokenizer", "no such file or directory", p.tokenizer)
    for name in ("dataset", "eval_dataset"):
        d = getattr(config.data, name)
        if d is None or d.startswith("synthetic:"):
            continue
        path = Path(d)
        if not path.is_file():
            expected = "synthetic:NAME or a .jsonl/.parquet file" if name == "dataset" else "a .jsonl/.parquet file"
            fail(f"data.{name}", f"no such file (expected {expected})", d)
        if path.suffix.lower() not in DATASET_SUFFIXES:
            fail(f"data.{name}", f"unsupported file type {path.suffix!r}; use {', '.join(DATASET_SUFFIXES)}", d)
    if config.reward.model is not None:
        from llamarl.models.reward_model import check_reward_model

        if not Path(config.reward.model).is_dir():
            fail("reward.model", "no such directory (pass a Hugging Face LlamaForSequenceClassification directory)",
                 config.reward.model)
        try:
            check_reward_model(config.reward.model)  # config.json and the tensor headers: no weights are read
        except (ValueError, FileNotFoundError) as exc:
            fail("reward.model", str(exc))
    for path, spec in config.reward.user_functions():
        from llamarl.rewards.registry import RewardSpecError, load_reward

        try:
            load_reward(spec)
        except RewardSpecError as exc:
            fail(path, str(exc))
    from llamarl.runtime.starting import forced_method

    try:
        forced_method()
    except ValueError as exc:
        raise ConfigError(f"environment: {exc}") from None
    missing = check_available(parse_report_to(config.run.report_to))
    if missing:
        fail("run.report_to", missing, config.run.report_to)
    if config.run.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            fail("run.device", "cuda requested but torch sees no CUDA device; use --set run.device=cpu")
    resumed_run = None
    if config.run.resume is not None:
        from llamarl.checkpoint import CheckpointError, load_latest

        if not Path(config.run.resume).is_dir():
            fail("run.resume", "no such directory", config.run.resume)
        try:
            latest = load_latest(config.run.resume)  # checksums verified; a corrupt newest one is skipped
        except CheckpointError as exc:
            fail("run.resume", str(exc))
        if latest is None:
            fail("run.resume", "holds no complete checkpoint (expected DIR/checkpoints/step_*/ or a "
                 "checkpoint directory); pass the --out directory of an earlier run", config.run.resume)
        step = latest.step
        if config.run.max_steps <= step:
            fail("run.max_steps", f"the run at {config.run.resume} is already at step {step}; pass --max-steps "
                 f"above it to continue (nothing was changed)", config.run.max_steps)
        resumed_run = resume_run_dir(config.run.resume).resolve()
        from llamarl.checkpoint import MANIFEST

        bare = (Path(config.run.resume) / MANIFEST).is_file() and resumed_run == Path(config.run.resume).resolve()
        if bare and config.run.out is not None and Path(config.run.out).resolve() == resumed_run:
            fail("run.out", f"--resume {config.run.resume} is a checkpoint outside its run directory, and the "
                 "continued run would be written into it (a checkpoint is never modified, and a later --resume of it "
                 "would start from it again); pass --out NEW_DIR for the continued run")
    if config.run.out is not None:
        out = Path(config.run.out)
        if out.exists() and not out.is_dir():
            fail("run.out", "exists and is not a directory", config.run.out)
        earlier = (out / "checkpoints").is_dir() or (out / "metrics.jsonl").is_file()
        if earlier and config.run.resume is None:
            from llamarl.checkpoint import latest_checkpoint_dir

            if latest_checkpoint_dir(out) is None:
                fail("run.out", "holds a run that wrote no checkpoint (it stopped before its first one), so "
                     "there is nothing to resume; delete that directory or choose a new --out", config.run.out)
            fail("run.out", "already holds a run; pass --resume with it to continue, or choose a new --out",
                 config.run.out)
        if earlier and resumed_run is not None and out.resolve() != resumed_run:
            fail("run.out", f"already holds another run than the one resumed ({resumed_run}); a resumed run "
                 "continues in its own directory or in a new one", config.run.out)
