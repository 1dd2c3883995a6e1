"""A training run, end to end, in real processes: what ``python -m llamarl.train`` (llamarl.train) runs.

``train(cfg)`` checks the inputs (``load_inputs``: tokenizer, data; ``check_supported``), prepares the
policy (``prepare_policy``: the model, or the cached supervised warm start of the built-in one), claims
the run directory, starts the executors of the layout (``executor_layout``: generator groups and the
trainer, started together; reward scoring in the controller's worker pool) and runs the controller
(llamarl.controller) until ``run.max_steps``, evaluating before and after, checkpointing and logging
(llamarl.runlog); it returns the run's summary. Errors before anything is written or started are
``ConfigError``; an executor's failure is ``ExecutorError`` (``ExecutorHung`` for a hang), the reward
workers' ``RewardPoolError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from llamarl._fs import unwritable, write_text_atomic
from llamarl.checkpoint import load_latest
from llamarl.config import REWARD_NAMES, ConfigError, TrainConfig
from llamarl.config_cli import saved_config
from llamarl.controller import Controller, Executors
from llamarl.eval import eos_ids, evaluate
from llamarl.executors import MODULES as EXECUTOR_MODULES
from llamarl.generation.engine import cache_slots
from llamarl.models import CharTokenizer, Llama, LlamaConfig, LLAMA_CONFIGS, load_tokenizer
from llamarl.models.hf_io import check_checkpoint
from llamarl.parallel.tensor_parallel import check_tp_size
from llamarl.rewards import RewardPool, RewardPoolError, RewardStats, load_reward
from llamarl.rewards.data_checks import missing_fields, verifier_data_problems
from llamarl.rewards.model import RewardModelScorer, check_reader
from llamarl.reporting import make_reporters, parse_report_to
from llamarl.run_files import START_CONFIG, resume_file, resume_run_dir
from llamarl.run_warnings import config_warnings, resume_warnings
from llamarl.runlog import RunLog, carry_history, claim_run_dir
from llamarl.runtime import RewardSpec, TorchrunEnv, run, serve_torchrun, starting
from llamarl.train_data import EvalDataError, PromptsTooLong, TrainData
from llamarl.warmstart import (cache_key, content_fingerprint, default_cache_dir, reward_source, save_atomic,
                               train_supervised)


def log(msg: str) -> None:
    print(f"[llamarl] {msg}", file=sys.stderr, flush=True)


# DataConfig fields added after warm starts were first cached: left out of the key at their default (None), so
# the caches of runs that do not set them stay valid
_LATER_DATA_FIELDS = ("eval_dataset",)


def warm_start_key(cfg: TrainConfig) -> str:
    """The warm-start cache key: everything the warm-started weights depend on (the probe uses the reward and
    the generation length), input files by their absolute paths (as a resumed run's config.yaml holds them)
    and their contents."""
    a = cfg.with_absolute_paths()
    tok_path = a.policy.tokenizer  # a tokenizer.json file is read with its directory's config files
    files = [a.data.dataset, a.data.eval_dataset, reward_source(a.reward.reward),
             os.path.dirname(tok_path) if tok_path and os.path.isfile(tok_path) else tok_path]
    data = {k: v for k, v in dataclasses.asdict(a.data).items() if not (k in _LATER_DATA_FIELDS and v is None)}
    return cache_key("warmstart-v2", LLAMA_CONFIGS[cfg.policy.model].to_hf_dict(),
                     dataclasses.replace(cfg.warm_start, cache_dir=None), data, cfg.run.seed, a.reward.reward,
                     cfg.generator.max_new_tokens,
                     *([cfg.generator.stop] if cfg.generator.stop else []),  # (the probe's completions end there)
                     *([a.policy.tokenizer] if a.policy.tokenizer else []),
                     *[content_fingerprint(f) for f in files if f and os.path.exists(f)])


def prepare_policy(cfg: TrainConfig, tokenizer, data: TrainData) -> tuple[Path, dict]:
    """The HF directory the trainer starts from: a given checkpoint, or the (cached) warm start, trained
    on streams forked from the run's ``data`` (never its held-out split)."""
    if cfg.policy.model not in LLAMA_CONFIGS:
        return Path(cfg.policy.model), {"cached": None, "seconds": 0.0}
    ws = cfg.warm_start
    model_cfg = LLAMA_CONFIGS[cfg.policy.model]
    path = (Path(ws.cache_dir) if ws.cache_dir else default_cache_dir()) / f"{cfg.policy.model}-{warm_start_key(cfg)}"
    if (path / "warmstart.json").is_file():
        info = json.loads((path / "warmstart.json").read_text())
        log(f"warm start: cached at {path} (trained {info['steps']} steps, loss {info['loss']:.3f})")
        return path, {**info, "cached": True, "seconds": 0.0}
    torch.manual_seed(cfg.run.seed)
    model = Llama(model_cfg)
    stream = data.fork(cfg.run.seed + 1)  # its own streams: the RL stream's position stays untouched
    log(f"warm start: {ws.steps} supervised steps on {cfg.data.dataset} ({model.num_parameters() / 1e6:.2f}M params)")
    probe_samples = data.fork(cfg.run.seed + 2).next(128)
    with contextlib.ExitStack() as stack:
        if cfg.reward.reward in REWARD_NAMES:  # built-in verifiers: scored in this process
            reward_fn = load_reward(cfg.reward.reward)
        else:  # a user's function: in worker processes, with the run's per-sample timeout
            reward_fn = stack.enter_context(RewardPool(cfg.reward.reward, num_workers=max(1, cfg.reward.workers),
                                                       timeout_s=cfg.reward.timeout_s))

        def probe() -> float:  # greedy accuracy on training problems (never the held-out split)
            result = evaluate(model, tokenizer, probe_samples, reward_fn, max_new_tokens=cfg.generator.max_new_tokens,
                              batch_size=len(probe_samples), fmt=stream.formatter.fmt,
                              shots=stream.formatter.shots, stop=cfg.generator.stop)
            if result.records and result.num_errors == len(result.records):  # as RL's reward.max_failed_steps would
                raise RewardPoolError(f"the reward failed on every one of the warm start's {len(result.records)} probe "
                                      f"samples (first: {result.records[0].error}); fix the reward function (nothing "
                                      "was cached)")
            return result.accuracy

        info = train_supervised(model, stream.next, steps=ws.steps, lr=ws.lr, batch_size=ws.batch_size,
                                encode_prompt=stream.formatter.encode, encode_answer=tokenizer.encode,
                                eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, log=log, probe=probe,
                                target_accuracy=ws.target_accuracy)
    if not save_atomic(model, tokenizer, path, info):  # a run with the same key cached it first: use its weights
        log(f"warm start: another run cached the same entry first at {path}; using it")
        info = {**json.loads((path / "warmstart.json").read_text()), "seconds": info["seconds"]}
    return path, {**info, "cached": False}


def _dump_tasks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints every asyncio task's stack: what the controller is waiting for."""
    import asyncio
    import signal

    def dump() -> None:
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)


def make_tokenizer(cfg: TrainConfig):
    if cfg.policy.tokenizer:
        return load_tokenizer(cfg.policy.tokenizer)
    if cfg.policy.model in LLAMA_CONFIGS:
        return CharTokenizer()
    return load_tokenizer(cfg.policy.model)


def model_config_dict(cfg: TrainConfig) -> dict:
    """The policy's Hugging Face config: the built-in one, or the model directory's config.json."""
    if cfg.policy.model in LLAMA_CONFIGS:
        return LLAMA_CONFIGS[cfg.policy.model].to_hf_dict()
    path = Path(cfg.policy.model) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"policy.model: cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"policy.model: {path} must hold a JSON object, got {type(raw).__name__}")
    missing = [k for k in ("vocab_size", "num_attention_heads") if k not in raw]
    if missing:
        raise ConfigError(f"policy.model: {path} is not a Llama config (missing {missing})")
    return raw


def load_inputs(cfg: TrainConfig, cursor: int = 0):
    """(tokenizer, TrainData), checked against the policy before anything is written or started:
    unreadable files (the model's weights too: names, shapes, dtypes, file sizes), a tokenizer larger than
    the model's vocabulary, a generation length that fills the context, synthetic prompts longer than the
    context leaves (``data.few_shot``, a long ``data.template``), dataset errors and a reward model that cannot
    read the run's text (llamarl.rewards.model.check_reader) raise ConfigError. Prompts
    longer than the context minus ``generator.max_new_tokens`` are dropped from a file dataset (and counted)."""
    model = model_config_dict(cfg)
    if not cfg.reward.verified and cfg.policy.model in LLAMA_CONFIGS:
        raise ConfigError(f"reward.reward: none (no verifier) needs policy.model=DIR, a Hugging Face policy: the "
                          f"built-in {cfg.policy.model!r} starts from a warm start trained on reference answers and "
                          "probed by the verifier")
    if cfg.policy.model not in LLAMA_CONFIGS:  # a directory: its weights must load (headers and sizes only)
        try:
            check_checkpoint(cfg.policy.model)
        except (OSError, ValueError) as e:
            raise ConfigError(f"policy.model: {e}") from None
    try:
        tokenizer = make_tokenizer(cfg)
    except (OSError, ValueError) as e:
        raise ConfigError(f"policy.tokenizer: {e}") from None
    if tokenizer.vocab_size > int(model["vocab_size"]):
        raise ConfigError(f"policy.tokenizer: its token ids go up to {tokenizer.vocab_size - 1} but the model's "
                          f"vocab_size is {model['vocab_size']}; use the model's own tokenizer")
    if cfg.data.chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.chat: the tokenizer has no chat template (chat_template in tokenizer_config.json or "
                          "a chat_template.jinja file); add one or set data.chat=false")
    if cfg.data.chat:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True)
        except Exception as e:  # a template error of any kind: jinja2's, or raise_exception's
            raise ConfigError(f"policy.tokenizer: its chat template fails on a plain user message: {e}") from None
    if cfg.policy.model not in LLAMA_CONFIGS:  # where generation stops: config.json and generation_config.json
        try:
            stops = eos_ids(tokenizer, LlamaConfig.from_hf_dict(model), cfg.policy.model)
        except (OSError, ValueError) as e:
            raise ConfigError(f"policy.model: {e}") from None
        outside = [i for i in stops if not 0 <= i < int(model["vocab_size"])]
        if outside:
            raise ConfigError(f"policy.model: end-of-text token id(s) {outside} (config.json, generation_config.json "
                              f"or the tokenizer's eos) lie outside the vocabulary [0, {model['vocab_size']})")
    context = int(model.get("max_position_embeddings") or 2048)
    max_prompt = context - cfg.generator.max_new_tokens
    if max_prompt < 1:
        raise ConfigError(f"generator.max_new_tokens: {cfg.generator.max_new_tokens} leaves no room for a prompt in "
                          f"the model's context of {context} tokens")
    try:
        data = TrainData(cfg.data, tokenizer, seed=cfg.run.seed, cursor=cursor, max_prompt_tokens=max_prompt,
                         answers=cfg.reward.verified)
    except PromptsTooLong as e:
        raise ConfigError(f"{e.field}: {e}, but the model context of {context} tokens minus generator.max_new_tokens="
                          f"{cfg.generator.max_new_tokens} leaves {max_prompt}; change {e.field} or lower "
                          "generator.max_new_tokens") from None
    except EvalDataError as e:
        raise ConfigError(f"data.eval_dataset: {e}") from None
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"data.dataset: {e}") from None
    if cfg.reward.model is not None:  # what the reward model reads with, against its vocabulary (no weights read)
        try:
            rm_config, rm_tokenizer = check_reader(cfg.reward.model, tokenizer, chat=cfg.data.chat, messages=(
                data.formatter.messages(data.heldout[0]) if data.heldout else None))
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward.model: {e}") from None
        rm_context = rm_config.max_position_embeddings
        if rm_tokenizer is None and data.heldout:  # it reads the policy's ids, whose lengths are known
            shortest = min(map(len, data.encode(data.heldout)))
            if shortest + 1 > rm_context:
                raise ConfigError(f"reward.model: its context of {rm_context} tokens holds no prompt with a completion "
                                  f"(the shortest held-out prompt has {shortest} tokens): it could score nothing")
            if data.longest_prompt + cfg.generator.max_new_tokens > rm_context:
                log(f"warning: reward.model: its context of {rm_context} tokens is shorter than the longest prompt "
                    f"({data.longest_prompt} tokens) plus generator.max_new_tokens={cfg.generator.max_new_tokens}; "
                    "a sequence beyond it costs its sample (counted in reward_errors)")
    for path, spec in cfg.reward.user_functions():  # the keyword arguments it asks for must exist for every sample
        problem = missing_fields(spec, data.info_fields)
        if problem:
            raise ConfigError(f"{path}: {problem}")
    if data.dropped:
        log(f"data: dropped {data.dropped} prompts longer than {max_prompt} tokens (the context {context} minus "
            f"generator.max_new_tokens)")
    if cfg.data.eval_dataset is not None:
        dropped = (f"{data.excluded} training samples with one of them dropped" if data.excluded is not None
                   else "the training stream skips them")
        log(f"data: {len(data.heldout)} held-out prompts drawn from data.eval_dataset, whose prompts never reach "
            f"training ({dropped})")
    error, warning = verifier_data_problems(cfg.reward.reward, data.samples) if cfg.reward.verified else (None, None)
    if error:
        raise ConfigError(f"reward.reward: {cfg.reward.reward}, but {error}")
    if warning:
        log(f"warning: data: {warning}")
    return tokenizer, data


def _data_position(cursor) -> tuple[int, str | None]:
    """A checkpoint's data cursor as (position, stream id): ``{"position", "stream"}`` (what runs write), or a
    bare position (checkpoints written before stream ids; nothing to compare)."""
    if isinstance(cursor, dict):
        return int(cursor["position"]), cursor.get("stream")
    return int(cursor or 0), None


def _check_resumed_model(model: dict, policy_dir: Path) -> None:
    """ConfigError unless ``policy.model`` (whose tokenizer and stop tokens a resumed run uses) has the
    shapes of the checkpoint's policy, whose weights it trains."""
    ours = LlamaConfig.from_hf_dict(model)  # parsed: fields a config.json leaves out take their defaults
    saved = LlamaConfig.from_hf_dict(json.loads((policy_dir / "config.json").read_text()))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")
    differ = {k: (getattr(ours, k), getattr(saved, k)) for k in keys if getattr(ours, k) != getattr(saved, k)}
    if differ:
        raise ConfigError(f"policy.model: not the model the resumed run trained (its checkpoint {policy_dir} differs "
                          f"in {', '.join(f'{k} {a} vs {b}' for k, (a, b) in differ.items())}); pass that run's model")


def _check_writable(directory: Path, field: str) -> None:
    """ConfigError unless ``directory`` can be created and written (found now, not after the warm start)."""
    problem = unwritable(directory)
    if problem:
        raise ConfigError(f"{field}: cannot write {directory}: {problem}; point it (or $LLAMARL_CACHE_DIR) "
                          "at a writable directory")


def check_supported(cfg: TrainConfig) -> None:
    """Settings the config accepts but this training loop does not run: refuse them up front."""
    missing = {  # (the rules that need no torch and no files are TrainConfig's own, checked at construction)
        "trainer.loss": (cfg.trainer.loss == "fused" and cfg.device == "cpu"
                         and os.environ.get("TRITON_INTERPRET") != "1",
                         "fused runs the Triton kernel, which needs a CUDA device (or TRITON_INTERPRET=1 on the "
                         "CPU, slowly); use trainer.loss=auto (fused where it runs) or reference"),
    }
    for field, (bad, why) in missing.items():
        if bad:
            raise ConfigError(f"{field}: {why}")
    policy = _policy_config(cfg) if cfg.generator.tp > 1 else None
    if policy is not None:
        try:
            check_tp_size(policy, cfg.generator.tp)
        except ValueError as exc:
            raise ConfigError(f"generator.tp: {exc} ({cfg.policy.model})") from None
    tr = TorchrunEnv.detect()
    need = executor_layout(cfg).world_size - 1  # executor ranks; rank 0 also hosts the controller
    if tr is not None and tr.world_size not in (need, need + 1):
        raise ConfigError(f"trainer.ranks/generator.tp/generator.replicas: under torchrun the job needs "
                          f"{cfg.trainer.ranks} trainer + {cfg.generator.tp}x{cfg.generator.replicas} generator "
                          f"= {need} processes (rank 0 also runs the controller; or {need + 1} with a process of "
                          f"its own for it), but torchrun started WORLD_SIZE={tr.world_size}; use "
                          f"--nproc-per-node {need} (one node) or change the layout")


def _policy_config(cfg: TrainConfig) -> LlamaConfig | None:
    """The policy's LlamaConfig, or None if it cannot be read here (check_environment reports why)."""
    if cfg.policy.model not in LLAMA_CONFIGS and not (Path(cfg.policy.model) / "config.json").is_file():
        return None
    try:
        return LlamaConfig.from_hf_dict(model_config_dict(cfg))
    except (ConfigError, ValueError):
        return None


def executor_layout(cfg: TrainConfig):
    """The process layout of a run: the config's, with reward scoring in the controller's worker pool."""
    return dataclasses.replace(cfg.layout(), reward=RewardSpec(0))


def train(cfg: TrainConfig) -> dict:
    check_supported(cfg)
    layout = executor_layout(cfg)
    tr = TorchrunEnv.detect()
    if tr is not None and tr.rank != 0:  # a torchrun executor rank: serve the controller, then exit
        sys.exit(serve_torchrun(layout, tr))
    if tr is None and not (torch.cuda.is_available() and all(g.on_accelerator for g in layout.groups)):
        # CPU executor ranks fork from a server that imports torch and their modules while this process
        # loads the data and the policy (llamarl.runtime.starting)
        starting.warm(EXECUTOR_MODULES)
    t_start = time.perf_counter()
    for warning in config_warnings(cfg):
        log(f"warning: {warning}")
    trainer_on_gpu = torch.cuda.is_available() and any(g.on_accelerator for g in layout.groups
                                                       if g.role == "trainer")
    if cfg.trainer.compute_dtype == "bfloat16" and cfg.trainer.dtype == "float32" and not trainer_on_gpu:
        log("warning: trainer.compute_dtype=bfloat16 on the CPU: a CPU without bfloat16 matrix units (AVX512-BF16, "
            "AMX) multiplies bfloat16 many times slower than float32 (20x on a 2-core test machine); mixed "
            "precision is for GPUs, leave trainer.compute_dtype unset here")
    out = Path(cfg.run.out) if cfg.run.out else default_out()
    resume = load_latest(cfg.run.resume) if cfg.run.resume else None
    for warning in resume_warnings(cfg, resume.step) if resume else ():
        log(f"warning: {warning}")
    position, stream = _data_position(resume.data_cursor if resume else 0)
    tokenizer, data = load_inputs(cfg, cursor=position)
    if stream is not None and stream != data.stream_id:
        files = cfg.data.dataset + (f" with the held-out file {cfg.data.eval_dataset}" if cfg.data.eval_dataset else "")
        raise ConfigError(f"data.dataset: the data stream of {files} is not the one the checkpoint's "
                          "position counts into (a file was edited, or a setting changed which prompts are held out, "
                          "kept or how they read, e.g. generator.max_new_tokens dropping other prompts as too long); "
                          "resume with the run's own data and settings, or start a new run from the checkpoint's "
                          "weights (--model <checkpoint>/policy)")
    if resume and resume.policy_dir is not None and cfg.policy.model not in LLAMA_CONFIGS:
        _check_resumed_model(model_config_dict(cfg), Path(resume.policy_dir))
    if cfg.policy.model in LLAMA_CONFIGS:
        _check_writable(Path(cfg.warm_start.cache_dir) if cfg.warm_start.cache_dir else default_cache_dir(),
                        "warm_start.cache_dir")
    # the run directory is this run's from here until it ends (a second run on it is refused); a resumed
    # run's logs and checkpoints are cut back to the resumed step right away, before anything can fail
    config_yaml = cfg.with_absolute_paths().to_yaml()
    lock = claim_run_dir(out, config_yaml, resume_step=resume.step if resume else None,
                         warn=lambda message: log(f"warning: {message}"))
    try:
        _carry_run_start(out, config_yaml, resume)
        return _train_in(out, cfg, resume, tokenizer, data, t_start)
    finally:
        lock.release()


def _carry_run_start(out: Path, config_yaml: str, resume) -> None:
    """What a run keeps from its start in ``out``: ``config.start.yaml``, the settings of its first segment
    (``config_yaml`` for a new run), kept through every resume, into a new --out too (config.yaml is each
    segment's own; the KL reference is rebuilt from them), and, for a resume into a new --out, the run's logs
    up to the resumed step (``runlog.carry_history``)."""
    dest = out / START_CONFIG
    if dest.is_file():
        return
    if resume is None:
        write_text_atomic(dest, config_yaml)
        return
    start = resume_file(resume.path, START_CONFIG)  # the run directory's, or the checkpoint's copy
    if start is not None:
        write_text_atomic(dest, start.read_text(encoding="utf-8"))
    source = resume_run_dir(resume.path)
    if source.resolve() != out.resolve():  # resumed into a new directory: the history comes along
        carry_history(source, out, resume.step)


def _starting_policy(out: Path, cfg: TrainConfig, tokenizer, data: TrainData) -> Path:
    """The policy a resumed run started from, its KL reference: the model, or the warm start of the run's
    starting settings (cached; else trained again from them), whatever this resume changed (the reward, the
    generation length, warm_start.*: all part of the warm start's cache key)."""
    start = out / START_CONFIG
    if start.is_file():
        return prepare_policy(saved_config(start), tokenizer, data)[0]
    log(f"warning: {out} has no {START_CONFIG} (a run of an earlier llamarl): the KL reference is the warm start of "
        "this command's settings, which differs from the run's if they changed the reward, the generation length "
        "or warm_start.*")
    return prepare_policy(cfg, tokenizer, data)[0]


def _train_in(out: Path, cfg: TrainConfig, resume, tokenizer, data: TrainData, t_start: float) -> dict:
    """The run itself, in the run directory ``out`` that ``train`` holds."""
    layout = executor_layout(cfg)
    if resume:
        policy_dir, warm = resume.policy_dir, {"cached": None, "seconds": 0.0}
        log(f"resuming from {resume.path} (step {resume.step}, policy version {resume.policy_version})")
        # the KL reference stays the policy the run started from (the model, or its cached warm start)
        reference_dir = _starting_policy(out, cfg, tokenizer, data) if cfg.trainer.kl_coef > 0 else None
    else:
        policy_dir, warm = prepare_policy(cfg, tokenizer, data)
        reference_dir = policy_dir
    model_config = json.loads((Path(policy_dir) / "config.json").read_text())
    policy_config = LlamaConfig.from_hf_dict(model_config)
    start_step = resume.step if resume else 0
    start_version = resume.policy_version if resume else 0
    g = cfg.generator
    threads = max(1, (os.cpu_count() or 2) // (layout.world_size - 1))  # CPU threads per executor process
    # KV-cache slots for any batch of the run's prompts (1 to longest_prompt tokens) with its full generation,
    # so the cache never cuts a completion short; a multiple of 64 (attention kernels like aligned lengths)
    kv_slots = -(-cache_slots([1, data.longest_prompt], g.max_new_tokens, policy_config) // 64) * 64

    async def main(rt) -> dict:
        _dump_tasks_on_sigusr1()
        stops = eos_ids(tokenizer, policy_config, policy_dir)  # where generation ends: the reward model's EOS too
        gens = rt.spawn_role("generator", "llamarl.executors.generator:GeneratorExecutor", init_kwargs=dict(
            model_config=model_config, dtype=cfg.policy.dtype, trainer_ranks=cfg.trainer.ranks,
            replicas=g.replicas,  # (an evaluation of more rows runs in batches of this many)
            max_batch_size=max(g.prompts_per_step * g.samples_per_prompt, cfg.data.eval_size, cfg.run.eval_samples),
            max_seq_len=kv_slots, pad_id=tokenizer.pad_id, threads=threads, quantization=g.quantization,
            eos_token_ids=stops, tokenizer=tokenizer),
            env={"LLAMARL_EXECUTOR": "generator"}, wait=False)
        # the trainer starts alongside (each process spends seconds importing torch and loading the model)
        # and attaches to the generators' buckets once they are up
        trainer, = rt.spawn_role("trainer", "llamarl.executors.trainer:TrainerExecutor", init_kwargs=dict(
            model_path=str(policy_dir), trainer=dataclasses.asdict(cfg.trainer), temperature=g.temperature,
            generator_replicas=g.replicas, generator_tp=g.tp, generator_quantization=g.quantization,
            resume=str(resume.path) if resume else None, seed=cfg.run.seed, total_steps=cfg.run.max_steps,
            threads=threads, tokenizer_path=cfg.policy.tokenizer,
            reference_path=str(reference_dir) if reference_dir else None, max_new_tokens=g.max_new_tokens,
            sync_dtype=cfg.policy.dtype),
            env={"LLAMARL_EXECUTOR": "trainer"}, wait=False)
        # the reward model loads in a thread meanwhile (llamarl.rewards.model: it scores in this process)
        reward_model = (asyncio.ensure_future(asyncio.to_thread(
            RewardModelScorer, cfg.reward.model, policy_tokenizer=tokenizer, chat=cfg.data.chat,
            eos_ids=stops, dtype=cfg.policy.dtype, device=cfg.device,
            batch_size=cfg.reward.model_batch_size, threads=threads))
            if cfg.reward.model else None)
        await rt.await_ready([*gens, trainer])  # the loop runs meanwhile: a Ctrl-C stops the start at once
        if reward_model is not None:
            reward_model = await reward_model
        handles = [h for grp in gens for h in await grp.acall("handle")]  # every TP rank of every replica
        await trainer.acall("connect", handles)
        await trainer.acall("push_weights", start_version)
        runlog = RunLog(out, cfg.run.max_steps, initial_step=start_step, reporters=reporters, mirror_history=carried)

        async def checkpoint(step: int, version: int, cursor: int) -> None:
            position = {"position": cursor, "stream": data.stream_id}
            await trainer.acall("save_checkpoint", str(out), step, version, position, cfg.run.keep_checkpoints)

        with (RewardPool(cfg.reward.specs, num_workers=max(1, cfg.reward.workers), timeout_s=cfg.reward.timeout_s,
                         weights=cfg.reward.weights) if cfg.reward.specs else contextlib.nullcontext()) as pool:
            ctrl = Controller(cfg, data, Executors(gens, trainer, pool, reward_model), runlog, tokenizer=tokenizer,
                              start_step=start_step, start_version=start_version, on_checkpoint=checkpoint)
            try:
                await ctrl.evaluate(start_step)  # resumed: the accuracy at the checkpoint (the summary takes step 0's)
                t_rl = time.perf_counter()
                await ctrl.run()
                rl_s = time.perf_counter() - t_rl
                after = await ctrl.evaluate(ctrl.step)
                await checkpoint(ctrl.step, ctrl.version, data.cursor)
            finally:
                runlog.close()
            reward_stats = pool.stats if pool is not None else RewardStats()  # (reward.reward=none: no pool)
        rows = runlog.rows  # a resumed run's include the steps before the checkpoint: the summary covers them
        per_step = cfg.trainer.mini_batches * cfg.trainer.epochs  # updates
        plot = runlog.plot(out / "plot.png")
        return {
            "mode": cfg.run.mode, "max_staleness": cfg.run.max_staleness, "steps": len(rows),
            # (None without a verifier, reward.reward=none: its model_score is the measure)
            "accuracy_before": runlog.evals[0].get("accuracy"), "accuracy_after": after.get("accuracy"),
            **({f"pass@{k}_before": runlog.evals[0].get(f"pass@{k}"), f"pass@{k}_after": after.get(f"pass@{k}")}
               if (k := cfg.run.eval_samples) > 1 and cfg.reward.verified else {}),
            # the reward model's mean held-out score (llamarl.controller.evaluate); None where none was measured
            **({"model_score_before": runlog.evals[0].get("model_score"), "model_score_after": after.get("model_score")}
               if cfg.reward.model else {}),
            "eval": ("greedy" if cfg.run.eval_temperature == 0 else
                     f"mean@{cfg.run.eval_samples}, temperature {cfg.run.eval_temperature:g}"),
            "resumed_from_step": start_step if resume else None,
            "eval_size": len(data.heldout), "rl_s": rl_s, "warm_start_s": warm.get("seconds", 0.0),
            "warm_start_cached": warm.get("cached"),
            "step_s_mean": sum(r["step_s"] for r in rows) / max(1, len(rows)),
            "sync_s_mean": sum(r["sync_s"] for r in rows) / max(1, len(rows)),
            "max_staleness_seen": max((r["staleness"] for r in rows), default=0),
            "tokens_per_s": sum(r["tokens"] for r in rows) / max(1e-9, sum(r["generate_s"] for r in rows)),
            # training samples whose reward failed, over the whole run (the rows); timeouts and worker deaths
            # are this process's pool's (since a resume; evaluations included)
            "reward_errors": sum(r["reward_errors"] for r in rows), "reward_timeouts": reward_stats.timeouts,
            "reward_worker_deaths": reward_stats.worker_deaths,
            # updates (mini_batches x epochs per step) skipped for a non-finite loss or gradient, and those with
            # no trained token (every completion truncated away under trainer.mask_truncated: nothing to update)
            "skipped_updates": sum(per_step - r.get("updates", per_step if r["applied"] else 0)
                                   - r.get("empty_updates", 0) for r in rows),
            "empty_updates": sum(r.get("empty_updates", 0) for r in rows),
            "policy_version": ctrl.version,
            "plot": str(plot) if plot else None, "out": str(out),
        }

    # resumed into another directory than the run's: its trackers start empty, and get the carried history first
    carried = resume is not None and resume_run_dir(resume.path).resolve() != out.resolve()
    reporters = make_reporters(parse_report_to(cfg.run.report_to), out, cfg.to_dict(),
                               initial_step=0 if carried else start_step)
    try:
        summary = run(layout, main, command_timeout_s=cfg.run.command_timeout_s)
        summary["wall_s"] = time.perf_counter() - t_start
        write_text_atomic(out / "summary.json", json.dumps(summary, indent=2))
        for r in reporters:
            r.summary(summary)
    finally:
        for r in reporters:
            r.close()
    return summary


def default_out() -> Path:
    """The run directory when ``--out`` is not given: ``runs/<timestamp>``, created here and only here, so
    runs started in the same second (a seed sweep in the background) each get their own: ``-2``, ``-3``..."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    base.parent.mkdir(parents=True, exist_ok=True)
    path, k = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            k += 1
            path = base.with_name(f"{base.name}-{k}")
