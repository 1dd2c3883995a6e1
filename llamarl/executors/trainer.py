"""The trainer executor: AIPO updates with AdamW, and the DDMA push of each new policy version.

``train_step(batch)`` takes a collated batch (llamarl.rollouts.collate), or a list of them (the step's
mini-batches, ``trainer.mini_batches``; ``trainer.epochs`` passes over them), and on each minimises the
AIPO loss

    L = − Σ_t m_t · min(π(y_t)/μ(y_t), ρ) · A · log π(y_t) / Σ_t m_t          (token mean over the batch)

A step of several updates (``mini_batches`` × ``epochs`` > 1) with ``trainer.clip_ratio`` > 0 uses the
decoupled PPO clip of ``llamarl.algorithms.aipo_loss`` instead: before the first update, one no-grad
forward over the step's mini-batches records logπ_old (the policy the step starts from; the first
mini-batch of a one-epoch step needs none, its π is π_old); every update then weights a token by
min(π_old/μ, ρ) and clips π/π_old to [1 − clip_ratio, 1 + clip_ratio_high].

Each update runs in micro-batches (``micro_batch_size`` sequences, or as many as fit in ``micro_batch_tokens``
padded positions; ordered by length and cut to their longest sequence, llamarl.micro_batches) whose
gradients add up to exactly the full-batch gradient (each micro-batch loss is weighted by its share of
the batch's loss denominator: its tokens for ``norm="token"``, its non-empty sequences for
``norm="sequence"``, its sequences for ``norm="constant"``, Dr. GRPO's Σ m ℓ / (sequences ×
``max_new_tokens``)), then clips the global gradient norm and steps AdamW at the step's learning rate
(``lr_at``: warm-up, then constant, cosine or linear decay over ``total_steps`` RL steps, at the step the
controller names, so a resumed run continues the schedule). log π uses the generator's convention:
log_softmax(logits / T) in fp32.
The loss runs as the fused Triton kernel (``trainer.loss="fused"``, the default on CUDA) or as the eager
reference (``"reference"``, the default on CPU, where Triton only runs interpreted). A non-finite loss or
gradient skips the update (``applied=False``), leaving weights and optimizer state untouched.

``connect(generator_handles)`` attaches to the generators' buckets (the copy plan is built at construction,
so the trainer starts while the generators do); ``push_weights(version)`` then writes this rank's parameters
straight into every generator's buckets with the cached plan (llamarl.weight_sync.WeightSender) and
publishes them as ``version``.

Weights and AdamW state are in ``trainer.dtype``; the generator's (``sync_dtype``, policy.dtype) may be
lower: a float32 trainer pushes its weights cast to bfloat16 (staged in buffers kept between pushes), so
updates below a bfloat16 ulp accumulate in the float32 weights instead of rounding away. Checkpoints hold
the trainer's weights (float32 then), so a resume continues them exactly. Mixed precision
(``trainer.compute_dtype`` = bfloat16 over float32 weights): the forwards run under autocast (one rank, DDP)
or FSDP's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); the fused kernels get the hidden states
and the lm_head weight in bf16; gradients, the norm clip and AdamW stay fp32. The KL reference runs in the
same precision, so KL = 0 at the start as in fp32.

Sharded trainer (``trainer.ranks`` = R_t > 1, FSDP2; the executor group's process group is the mesh).
Every rank loads the policy and keeps its dim-0 shard of each parameter (``llamarl.parallel.apply_fsdp``,
in the trainer dtype, with the mixed-precision policy only under ``compute_dtype``); AdamW runs on the
shards. Protocol of one command (the controller calls every rank with the same arguments):

    train_step    every rank gets the same collated batch of B sequences (B % R_t == 0, checked by the
                  config) and trains on its B/R_t contiguous rows, in micro-batches as above, each
                  loss weighted by its share of the *global* denominator (tokens, or non-empty
                  sequences for norm="sequence"). Gradients are summed over ranks (FSDP "sum" reduction,
                  one reduce-scatter after the last micro-batch), so the sharded gradient is, up to fp
                  rounding, the single-process gradient of the whole batch Σ_r Σ_m (units_rm / units) ∇L_rm,
                  exactly the gradient of the batch's AIPO loss under either normalisation.
                  Every rank runs the same number of forward/backward passes (FSDP's all-gathers are
                  collectives); a micro-batch without tokens still runs, with weight 0, and a rank that
                  planned fewer micro-batches (token budget, shared prompts) adds idle ones. The gradient norm
                  is global (``clip_grad_norm_``: identical on every rank); per-rank loss and metrics are
                  all-gathered and combined, so the skip decision (non-finite loss or norm) and every
                  returned number are the same on all ranks.
    push_weights  each rank sends its own shards (``sync_sources``: no gather) with a WeightSender built
                  from ``plan_sync(.., TrainerLayout(world_size=R_t), ..)`` and its rank; rank 0 claims the
                  slot, the last rank to finish publishes the version.
    save_checkpoint  weights (``full_state_dict``) and optimizer state (``full_optimizer_state``) are
                  gathered on every rank; rank 0 alone writes the checkpoint (atomically, the single-process
                  format, so a run resumes on any number of ranks) and tells the others its path or error.
    resume        every rank loads the full optimizer state and keeps its shards; RNG states are rank 0's.
Data-parallel trainer (``trainer.parallel=ddp``, R_t > 1; llamarl.parallel.ddp): every rank keeps the
whole model and its own AdamW state. The protocol is the same, except: gradients are summed by one
bucketed all-reduce after the last micro-batch, every rank clips the same gradient and takes the same
step (the replicas stay bitwise equal); ``push_weights`` sends rank t's dim-0 chunk of every parameter
(``TrainerLayout(replicated=True)``: the copy work is split, nothing is gathered); ``save_checkpoint``
needs no gather (rank 0 writes its own copy); ``resume`` loads the optimizer state as one process does.
The single-rank path (R_t = 1) never touches torch.distributed.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from llamarl.algorithms import aipo_loss, lr_at, token_logprobs
from llamarl.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from llamarl.models import Llama
from llamarl.models.shared_prefix import shared_prefix_hidden_states
from llamarl import parallel  # FSDP/DDP helpers, imported on first use (a single rank never needs them)
from llamarl.parallel.grads import clip_grad_norm_
from llamarl.executors.generator import generator_layout
from llamarl.executors.step_stats import combine_micro_batches, combine_updates, merge_ranks
from llamarl.micro_batches import TOTAL_KEYS, extents, idle_part, part_positions, plan, take_rows
from llamarl.runtime import RankInfo
from llamarl.weight_sync import TrainerLayout, WeightSender, llama_param_specs, plan_sync

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MODEL_SIDE_FILES = ("generation_config.json",)


def policy_side_files(model_path: str, tokenizer_path: str | None = None) -> dict[str, bytes]:
    """What a saved policy needs beside its weights: the tokenizer files (of ``tokenizer_path``, a directory
    or its tokenizer.json, else of the model directory) and generation_config.json. Read once, when the run
    starts: the directory it started from may be a checkpoint that is pruned later (a resumed run)."""
    tok_dir = Path(tokenizer_path or model_path)
    if tok_dir.is_file():
        tok_dir = tok_dir.parent
    files = [(tok_dir, name) for name in TOKENIZER_FILES] + [(Path(model_path), name) for name in MODEL_SIDE_FILES]
    return {name: (d / name).read_bytes() for d, name in files if (d / name).is_file()}


class TrainerExecutor:
    def __init__(self, *, model_path: str, trainer: dict, temperature: float, generator_handles: list | None = None,
                 generator_replicas: int = 1, generator_tp: int = 1, generator_quantization: str = "none",
                 resume: str | None = None, seed: int = 0, total_steps: int | None = None,
                 threads: int | None = None, tokenizer_path: str | None = None, reference_path: str | None = None,
                 max_new_tokens: int | None = None, sync_dtype: str | None = None, rank_info: RankInfo):
        self.rank, self.world = rank_info.rank, rank_info.world_size
        self.distributed = self.world > 1
        if self.distributed and trainer["parallel"] not in ("fsdp", "ddp"):
            raise ValueError(f"trainer.parallel={trainer['parallel']!r}: a trainer of {self.world} ranks needs "
                             "trainer.parallel=fsdp or ddp")
        self.sharded = self.distributed and trainer["parallel"] == "fsdp"  # else whole replicas (ddp) or one rank
        if trainer["norm"] == "constant" and not (isinstance(max_new_tokens, int) and max_new_tokens > 0):
            raise ValueError(f"trainer.norm='constant' divides by sequences x max_new_tokens: pass max_new_tokens "
                             f"(the generator's length limit), got {max_new_tokens!r}")
        self.max_new_tokens = max_new_tokens
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.cfg = trainer
        self.total_steps = total_steps
        self.model_path = model_path
        self.side_files = policy_side_files(model_path, tokenizer_path)
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = torch.device(rank_info.device or "cpu")
        dtype = DTYPES[trainer["dtype"]]
        # mixed precision: bf16 forward/backward over fp32 weights (the config refuses fp32 compute of bf16 weights)
        self.compute_dtype = DTYPES[trainer["compute_dtype"] or trainer["dtype"]]
        self.mixed = self.compute_dtype != dtype
        fsdp = dict(mixed_precision=self.mixed, param_dtype=self.compute_dtype)
        self.model = Llama.from_pretrained(model_path, dtype=dtype, device=self.device)
        self.model.activation_checkpointing = trainer["activation_checkpointing"]
        if self.sharded:  # over this group's process group (the default group of an executor process)
            parallel.apply_fsdp(self.model, None, parallel.FSDPConfig(grad_reduce="sum", **fsdp))
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=trainer["lr"], betas=tuple(trainer["betas"]),
                                     weight_decay=trainer["weight_decay"])
        # KL penalty target: the policy the run started from (``reference_path``; a resumed run starts from a
        # checkpoint but keeps its original reference), frozen, only kept when kl_coef > 0
        self.ref = None
        if trainer["kl_coef"] > 0:
            self.ref = Llama.from_pretrained(reference_path or model_path, dtype=dtype, device=self.device)
            self.ref.eval().requires_grad_(False)
            if self.sharded:
                parallel.apply_fsdp(self.ref, None, parallel.FSDPConfig(**fsdp))
        loss = trainer["loss"]
        self.fused = loss == "fused" or (loss == "auto" and self.device.type == "cuda")
        # the reference loss's entropy: a term of the loss, or only the logged metric (no autograd tensors)
        self._entropy_mode = "grad" if self.cfg["entropy_coef"] else "detached"
        if resume:
            ckpt = load_checkpoint(resume)
            if self.sharded:
                parallel.load_full_optimizer_state(self.opt, ckpt.optimizer_state())
            else:
                self.opt.load_state_dict(ckpt.optimizer_state())
            # the saved param groups bring the saved betas and weight decay back: this run's settings win
            # (a resume may change them; lr is set at every update)
            for group in self.opt.param_groups:
                group["betas"], group["weight_decay"] = tuple(trainer["betas"]), trainer["weight_decay"]
            if ckpt.rng_state:
                restore_rng_state(ckpt.rng_state)
        source = TrainerLayout(world_size=self.world, replicated=self.distributed and not self.sharded)
        # the generator's dtype (policy.dtype): a float32 trainer feeds a bfloat16 generator, cast at each push
        self.sync_dtype = DTYPES[sync_dtype] if sync_dtype is not None else dtype
        self._cast: dict[str, torch.Tensor] = {}  # reused staging of the cast shards
        self.plan = plan_sync(llama_param_specs(self.model.config, dtype=self.sync_dtype), source,
                              generator_layout(generator_tp, generator_replicas, generator_quantization))
        self.sender: WeightSender | None = None
        if generator_handles is not None:
            self.connect(generator_handles)
        self.version: int | None = None  # the last version pushed to the generators
        self._rl_step: int | None = None  # the RL step being trained (train_step's step)
        self._clip: tuple[float, float] | None = None  # the step's decoupled clip range (None: plain AIPO)

    # ------------------------------------------------------------------ commands
    def connect(self, generator_handles: list) -> None:
        """Attach to the generators' weight buckets (one handle per generator rank, every replica), which
        ``push_weights`` writes into. Separate from construction so the trainer and the generators can start
        at the same time: the handles exist only once the generators are up."""
        if self.sender is not None:
            raise RuntimeError("the trainer is already connected to its generators; connect() is called once")
        # no timeout on a sync: with max_staleness >= 2 the trainer can push twice while one generation batch
        # holds the slot the second push needs, and must wait for the batch however long it runs (a dead
        # reader or writer still raises PeerDied at once; a hung generator stops the run anyway)
        self.sender = WeightSender(self.plan, self.rank, generator_handles, device=self.device,
                                   timeout=float("inf"))

    def train_step(self, batch: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]], push: bool = False,
                   step: int | None = None) -> dict:
        """RL step ``step`` (0-based; it sets the learning rate, ``lr_at``): an update on each collated
        mini-batch (a list, or one batch), ``trainer.epochs`` passes over them; with ``push``, a step with
        an applied update is also pushed to the generators as the next version, one more than the last one
        pushed (one round trip from the controller instead of two; ``stats["sync"]`` holds the push). The
        trainer owns the version count, so the controller can queue the next step's command before this one
        has answered. ``stats["version"]`` is the last version pushed after the call (None before the first
        ``push_weights``); ``stats["updates"]`` the number of updates applied. Without ``step`` the step is
        counted from the optimizer's updates (applied ones only) over mini_batches x epochs."""
        if push and self.version is None:
            raise RuntimeError("train_step(push=True) before any push_weights(version): push the starting "
                               "weights first, so the version count has a start")
        parts = batch if isinstance(batch, list) else [batch]
        update = self._distributed_train_step if self.distributed else self._train_step
        self._rl_step = step
        epochs = self.cfg["epochs"]
        self._clip = self._clip_range(len(parts) * epochs)
        olds: list[torch.Tensor | None] = [None] * len(parts)
        if self._clip is not None:  # π_old of each part, before the first update (in which π = π_old exactly)
            olds = [self._old_logprobs(p) if i or epochs > 1 else None for i, p in enumerate(parts)]
        updates = [p if (e == 0 and i == 0) or olds[i] is None else dict(p, old_logprobs=olds[i])
                   for e in range(epochs) for i, p in enumerate(parts)]
        stats = combine_updates([update(part) for part in updates], epochs)
        if push and stats["applied"]:
            stats["sync"] = self.push_weights(self.version + 1)
        stats["version"] = self.version
        return stats

    def _clip_range(self, updates: int) -> tuple[float, float] | None:
        """(ε_low, ε_high) of the decoupled clip for a step of ``updates`` updates; None: plain AIPO."""
        low, high = self.cfg["clip_ratio"], self.cfg["clip_ratio_high"]
        if updates == 1 or not low:
            return None
        return (low, low if high is None else high)

    def _my_rows(self, rows: int) -> tuple[int, int]:
        """The rows [lo, hi) of a batch of ``rows`` sequences this rank trains on (all of them on one rank)."""
        if not self.distributed:
            return 0, rows
        if rows % self.world:
            raise ValueError(f"train_step got {rows} sequences, which do not split evenly over trainer.ranks="
                             f"{self.world}; make generator.prompts_per_step x samples_per_prompt a multiple of it")
        per = rows // self.world
        return self.rank * per, (self.rank + 1) * per

    @torch.no_grad()
    def _old_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """logπ_old [rows, T] (fp32, on this device) under the current weights, for this rank's rows (the
        others stay 0 and are never read), in the micro-batches the update uses; an FSDP trainer runs
        the same forwards on every rank (they gather shards)."""
        batch, _, _ = self._on_device(batch)
        out = torch.zeros(batch["targets"].shape, dtype=torch.float32, device=self.device)
        for rows, part in self._micro_batches(batch):
            logprobs = self._logprobs(self.model, part)
            if rows is not None:
                out[rows, :logprobs.shape[1]] = logprobs
        if self.sharded:
            self.model.reshard()  # the root stays unsharded after a forward without backward
        return out

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[tuple[list[int] | None, dict[str, torch.Tensor]]]:
        """This rank's micro-batches of ``batch`` as (rows, part) pairs (llamarl.micro_batches: rows ordered
        by length when ``trainer.length_grouping``, ``micro_batch_size`` rows or ``micro_batch_tokens``
        padded positions each, every part cut to the columns it needs). FSDP ranks run the same number of
        forwards (each gathers the shards), but may plan different numbers of parts (under a token budget; with
        shared prompts, where each rank orders its rows by group or by row): a rank that planned fewer adds idle
        parts (rows None: a row cut to its fewest columns, untrained)."""
        lo, hi = self._my_rows(batch["targets"].shape[0])
        ext = extents(batch)
        groups = plan(batch, range(lo, hi), rows_per=self.cfg["micro_batch_size"], ext=ext,
                      token_budget=self.cfg["micro_batch_tokens"], by_length=self.cfg["length_grouping"])
        parts: list[tuple[list[int] | None, dict[str, torch.Tensor]]] = [(g, take_rows(batch, g, ext=ext))
                                                                          for g in groups]
        if self.sharded:
            count = torch.tensor([len(parts)], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            parts += [(None, idle_part(batch, range(lo, hi)))] * (int(count) - len(parts))
        return parts

    def _logprobs(self, model: Llama, part: dict[str, torch.Tensor]) -> torch.Tensor:
        """No-grad logπ [rows, T] of ``part["targets"]`` under ``model`` (fp32; with the fused loss, from
        the trained positions only, through ``fused_logprobs``: no [rows, T, V] logits; 0 elsewhere)."""
        if not self.fused:
            return token_logprobs(self._logits(model, part), part["targets"], self.temperature, entropy="none")[0]
        from llamarl_kernels import fused_logprobs

        idx, pick = _trained_positions(part)
        hidden = self._hidden(model, part)  # also without trained positions: an FSDP forward gathers on every rank
        if idx.numel() == 0:
            return torch.zeros(part["targets"].shape, dtype=torch.float32, device=hidden.device)
        picked, _ = fused_logprobs(pick(hidden), self._head(model), pick(part["targets"]), self.temperature)
        out = torch.zeros(part["targets"].numel(), dtype=torch.float32, device=hidden.device)
        return out.index_copy_(0, idx, picked).view(part["targets"].shape)

    def _train_step(self, batch: dict[str, torch.Tensor]) -> dict:
        t0 = time.perf_counter()
        batch, total, kept_tokens = self._on_device(batch)
        self.opt.zero_grad(set_to_none=True)
        loss_sum, metrics = 0.0, []
        for _, part in self._micro_batches(batch):
            share = self._units(part) / total
            if not bool(part["mask"].any()):  # no trained token (norm="constant" still counts its rows)
                continue
            loss, m = self._loss(part)
            (loss * share).backward()
            loss_sum += float(loss.detach()) * float(share)
            metrics.append((float(part["mask"].sum() / kept_tokens), {**m, "train_positions": part_positions(part)}))
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])
        applied = math.isfinite(loss_sum) and bool(torch.isfinite(grad_norm)) and bool(grads)
        return self._apply_update(applied, loss_sum, grad_norm, t0, combine_micro_batches(metrics), empty=not metrics)

    def push_weights(self, version: int) -> dict:
        if self.sender is None:
            raise RuntimeError("push_weights before connect(): the trainer has no generator buckets to write into; "
                               "call connect(generator_handles) once the generators are up")
        if self.sharded:
            shards = parallel.sync_sources(self.model)  # this rank's dim-0 shards, views of FSDP's storage
        else:
            shards = {name: p.detach() for name, p in self.model.named_parameters()}
        if self.sync_dtype != self._dtype():
            shards = {name: self._cast_shard(name, t) for name, t in shards.items()}
        stats = self.sender.sync(shards, version)
        self.version = version
        return {"seconds": stats.seconds, "bytes": stats.bytes, "copy_seconds": stats.copy_seconds,
                "wait_seconds": stats.wait_seconds}

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _cast_shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` in the generator's dtype, in a buffer kept for the next push (round to nearest even)."""
        buf = self._cast.get(name)
        if buf is None or buf.shape != t.shape:
            buf = self._cast[name] = torch.empty(t.shape, dtype=self.sync_dtype, device=t.device)
        return buf.copy_(t)

    def save_checkpoint(self, run_dir: str, step: int, policy_version: int, data_cursor,
                        keep: int = 3) -> str:
        if self.distributed:
            return self._distributed_save_checkpoint(run_dir, step, policy_version, data_cursor, keep)
        path = save_checkpoint(run_dir, step, policy_state=self._save_policy,
                               optimizer_state=self.opt.state_dict(), policy_version=policy_version,
                               data_cursor=data_cursor, rng_state=capture_rng_state(), keep=keep)
        return str(path)

    def _save_policy(self, path: Path, model: Llama | None = None) -> None:
        """HF weights + config, and the tokenizer and generation-config files the run started with."""
        (model if model is not None else self.model).save_pretrained(path)
        for name, data in self.side_files.items():
            (Path(path) / name).write_bytes(data)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    # ------------------------------------------------------------------ the multi-rank paths (FSDP, DDP)
    def _distributed_train_step(self, batch: dict[str, torch.Tensor]) -> dict:
        """``train_step`` on R_t ranks: this rank's rows of the batch; see the module docstring."""
        t0 = time.perf_counter()
        batch, total, kept_tokens = self._on_device(batch)
        parts = [part for _, part in self._micro_batches(batch)]
        metrics: list[tuple[float, dict]] = []

        def weighted_loss(part: dict[str, torch.Tensor]) -> torch.Tensor | None:
            share = self._units(part) / total
            tokens = bool(part["mask"].any())  # none: share 0, except under norm="constant" (rows count)
            if not tokens and not self.sharded:
                return None  # ddp: nothing to add (the all-reduce treats missing gradients as zeros)
            if not tokens:  # still the forwards and backward, FSDP's collectives need every rank
                if self.ref is not None:  # the sharded KL reference's forward gathers too (as in _loss)
                    with torch.no_grad():
                        self._logits(self.ref, part)
                return self._logits(self.model, part).float().sum() * 0.0
            loss, m = self._loss(part)
            metrics.append((float(part["mask"].sum() / kept_tokens), {**m, "train_positions": part_positions(part)}))
            return loss * share

        self.opt.zero_grad(set_to_none=True)
        if self.sharded:
            losses = parallel.accumulate_gradients(self.model, parts, weighted_loss, average=False)
            if self.ref is not None:
                self.ref.reshard()  # its root stays unsharded after a forward without backward
        else:  # ddp: local backward passes, then one sum over ranks; every rank then clips the same gradient
            losses = []
            for part in parts:
                loss = weighted_loss(part)
                if loss is not None:
                    loss.backward()
                    losses.append(float(loss.detach()))
            parallel.allreduce_gradients(self.model)
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"])  # global norm (FSDP: collective)
        local = {"loss": math.fsum(losses), "grads": any(p.grad is not None for p in self.model.parameters()),
                 "trained": bool(metrics), "metrics": combine_micro_batches(metrics)}
        per_rank: list = [None] * self.world
        dist.all_gather_object(per_rank, local)
        loss_sum = math.fsum(r["loss"] for r in per_rank)
        # no rank trained a token: the (zero-filled or zero-weighted) gradients are no update, as on one rank
        empty = not any(r["trained"] for r in per_rank)
        applied = (math.isfinite(loss_sum) and bool(torch.isfinite(grad_norm)) and all(r["grads"] for r in per_rank)
                   and not empty)
        return self._apply_update(applied, loss_sum, grad_norm, t0, merge_ranks([r["metrics"] for r in per_rank]),
                                  empty=empty)

    def _distributed_save_checkpoint(self, run_dir: str, step: int, policy_version: int, data_cursor,
                                     keep: int) -> str:
        """FSDP: gather weights and optimizer state on every rank (DDP: every rank has them); rank 0 writes;
        every rank returns its path."""
        if self.sharded:
            full = parallel.full_state_dict(self.model)  # collectives, in the same order on every rank
            optimizer_state = parallel.full_optimizer_state(self.opt)
        else:
            if not parallel.replicas_agree(self.model):  # collective; the replicas must still be bitwise equal
                raise RuntimeError("trainer.parallel=ddp: the trainer ranks' weights have diverged (they must take "
                                   "identical steps); not writing a checkpoint of one of them")
            full = {n: p.detach() for n, p in self.model.named_parameters()}
            optimizer_state = self.opt.state_dict()
        result: list = [None]
        if self.rank == 0:
            try:
                model = _llama_of(self.model.config, full)
                path = save_checkpoint(run_dir, step, policy_state=lambda d: self._save_policy(d, model),
                                       optimizer_state=optimizer_state, policy_version=policy_version,
                                       data_cursor=data_cursor, rng_state=capture_rng_state(), keep=keep)
                result = [("ok", str(path))]
            except Exception as exc:
                result = [("error", f"{type(exc).__name__}: {exc}")]
                dist.broadcast_object_list(result, src=0)
                raise
        dist.broadcast_object_list(result, src=0)
        status, text = result[0]
        if status != "ok":
            raise RuntimeError(f"trainer rank 0 failed to write the checkpoint: {text}")
        return text

    def _apply_update(self, applied: bool, loss: float, grad_norm: torch.Tensor, t0: float, metrics: dict,
                      empty: bool = False) -> dict:
        """The end of an update on every path: AdamW at the scheduled learning rate if ``applied``,
        gradients cleared, and the update's stats (``empty``: no trained token, so nothing to update; not
        applied, but no failure either). The schedule (``lr_at``) counts RL steps: the step
        ``train_step`` was given, else the optimizer's own update count over mini_batches x epochs."""
        step = self._rl_step
        if step is None:
            updates = next((int(st["step"]) for st in self.opt.state.values() if "step" in st), 0)
            step = updates // (self.cfg["mini_batches"] * self.cfg["epochs"])
        lr = lr_at(step, self.cfg, self.total_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if applied:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"applied": applied, "empty": empty, "loss": loss, "grad_norm": float(grad_norm), "lr": lr,
                "train_s": time.perf_counter() - t0, **metrics}

    def _on_device(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """(row tensors on this device, the loss denominator, the tokens present).

        The denominator is the whole batch's ``total_tokens``/``total_sequences`` (collate always records
        them, so dropped zero-advantage rows still count, llamarl.rollouts); a batch without them uses the
        ``_units`` of the rows present. Metrics are means over the tokens present."""
        batch = dict(batch)
        key = {"token": "total_tokens", "sequence": "total_sequences", "constant": "total_rows"}[self.cfg["norm"]]
        totals = {k: batch.pop(k) for k in TOTAL_KEYS if k in batch}
        batch = {k: v.to(self.device) for k, v in batch.items()}
        kept = batch["mask"].sum().clamp(min=1.0)
        total = totals[key].to(self.device, torch.float32) if key in totals else self._units(batch)
        return batch, total.clamp(min=1.0), kept

    def _units(self, part: dict[str, torch.Tensor]) -> torch.Tensor:
        """What the loss averages over: the tokens (norm="token"), the non-empty sequences (norm="sequence")
        or the sequences (norm="constant") of ``part``."""
        mask, norm = part["mask"], self.cfg["norm"]
        if norm == "constant":
            return torch.tensor(float(mask.shape[0]), device=mask.device)
        return mask.sum() if norm == "token" else (mask.sum(dim=-1) > 0).sum().to(torch.float32)

    def _norm_constant(self, part: dict[str, torch.Tensor]) -> float | None:
        """norm="constant": C of ``part`` alone (its sequences x max_new_tokens); the micro-batch shares
        (``_units``) then make the step's loss Σ m ℓ / (all sequences x max_new_tokens)."""
        return part["mask"].shape[0] * self.max_new_tokens if self.cfg["norm"] == "constant" else None

    # ------------------------------------------------------------------ the forward, in the compute dtype
    def _precision(self):
        """Mixed precision on one rank or DDP: autocast the forward to the compute dtype (matmuls in bf16,
        the fp32 residual stream and norms as they are; backward runs outside, in the ops' recorded dtypes).
        FSDP casts the gathered parameters itself (MixedPrecisionPolicy), so it needs no autocast."""
        if not self.mixed or self.sharded:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _hidden(self, model: Llama, part: dict[str, torch.Tensor]) -> torch.Tensor:
        """Final hidden states at the positions that predict ``part["targets"]``, in the compute dtype."""
        with self._precision():
            hidden = _final_hidden(model, part)
        return hidden.to(self.compute_dtype) if self.mixed else hidden

    def _head(self, model: Llama) -> torch.Tensor:
        """The lm_head weight the fused kernels multiply by: in the compute dtype (a differentiable cast of the
        fp32 master under autocast; FSDP's gathered bf16 parameter as it is)."""
        weight = model.lm_head_weight
        return weight.to(self.compute_dtype) if self.mixed else weight

    def _logits(self, model: Llama, part: dict[str, torch.Tensor]) -> torch.Tensor:
        hidden = self._hidden(model, part)
        return torch.nn.functional.linear(hidden, self._head(model))

    # ------------------------------------------------------------------ the loss
    def _loss_options(self, part: dict[str, torch.Tensor]) -> dict:
        """The loss options for ``part``, the same for the eager loss and the fused kernel."""
        c = self.cfg
        return dict(rho=c["rho"], norm=c["norm"], norm_constant=self._norm_constant(part), kl_coef=c["kl_coef"],
                    entropy_coef=c["entropy_coef"], clip=self._clip, level=c["ratio_level"],
                    kl_estimator=c["kl_estimator"])

    def _loss(self, part: dict[str, torch.Tensor]):
        adv = part["advantages"][:, None].expand_as(part["mask"])
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref = self._logprobs(self.ref, part)
        old = part.get("old_logprobs")
        if self.cfg["correction"] == "none":
            return self._uncorrected_loss(part, adv, ref, old)
        # the fused kernel refuses non-finite inputs; a diverged π_old takes the eager loss, whose non-finite
        # value then skips the update like any other (the eager losses skip their input scan: validate=False)
        if self.fused and (old is None or bool(torch.isfinite(old).all())):
            from llamarl_kernels import fused_aipo_loss

            width = part["mask"].shape[1]
            idx, pick = _trained_positions(part)  # before the forward is queued
            hidden = self._hidden(self.model, part)
            return fused_aipo_loss(pick(hidden), self._head(self.model), pick(part["targets"]),
                                   pick(part["behavior_logprobs"]), pick(adv), pick(part["mask"]),
                                   temperature=self.temperature, ref_logprobs=pick(ref), old_logprobs=pick(old),
                                   sequence_ids=idx // width if "sequence" in (self.cfg["norm"],
                                                                               self.cfg["ratio_level"]) else None,
                                   **self._loss_options(part))
        logprobs, entropy = token_logprobs(self._logits(self.model, part), part["targets"], self.temperature,
                                           entropy=self._entropy_mode)
        return aipo_loss(logprobs, part["behavior_logprobs"], adv, part["mask"], ref_logprobs=ref, entropy=entropy,
                         old_logprobs=old, validate=False, **self._loss_options(part))

    def _uncorrected_loss(self, part, adv, ref, old):
        """The ablation: AIPO with μ := π_old (weight 1), i.e. vanilla policy gradient on stale samples
        (π_old = π, the policy of the moment, without the clip); the clip, KL and entropy terms as in the
        corrected loss.

        Mismatch metrics are still measured against the real μ, so the two runs are comparable."""
        logprobs, entropy = token_logprobs(self._logits(self.model, part), part["targets"], self.temperature,
                                           entropy=self._entropy_mode)
        behavior = logprobs.detach() if old is None else old
        loss, _ = aipo_loss(logprobs, behavior, adv, part["mask"], ref_logprobs=ref, entropy=entropy,
                            old_logprobs=old, validate=False, **self._loss_options(part))
        metric_options = dict(self._loss_options(part), kl_coef=0.0, entropy_coef=0.0)  # values, no gradient
        _, metrics = aipo_loss(logprobs.detach(), part["behavior_logprobs"], adv, part["mask"], ref_logprobs=ref,
                               entropy=entropy.detach(), old_logprobs=old, validate=False, **metric_options)
        return loss, metrics


def _final_hidden(model: Llama, part: dict[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden states [rows, positions, D] at the positions that predict ``part["targets"]``, for
    either layout of llamarl.rollouts (shared prompts: one pass per prompt, llamarl.models.shared_prefix)."""
    if "prompt_ids" in part:
        return shared_prefix_hidden_states(model, part["prompt_ids"], part["prompt_start"], part["group"],
                                           part["targets"])
    return model.hidden_states(part["input_ids"])[:, :-1]


def _trained_positions(part: dict[str, torch.Tensor]):
    """The trained positions of ``part`` as flat indices (found once: one host sync), and ``pick``, which
    gathers a [rows, positions, ...] tensor (None stays None) at them without a sync of its own."""
    idx = (part["mask"] > 0).reshape(-1).nonzero().squeeze(1)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(-1, *t.shape[2:]).index_select(0, idx)

    return idx, pick




def _llama_of(config, state: dict[str, torch.Tensor]) -> Llama:
    """A plain ``Llama`` holding ``state`` (full tensors, e.g. ``full_state_dict``) without copying them."""
    with torch.device("meta"):
        model = Llama(config)
    if config.tie_word_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    model.load_state_dict(state, assign=True)
    return model
