"""The trainer executor: AIPO updates with AdamW, and the DDMA push of each new policy version.

``train_step(batch)`` takes a collated batch (llamarl.rollouts.collate) and minimises the AIPO loss

    L = − Σ_t m_t · min(π(y_t)/μ(y_t), ρ) · A · log π(y_t) / Σ_t m_t          (token mean over the batch)

in micro-batches of ``micro_batch_size`` sequences whose gradients add up to exactly the full-batch
gradient (each micro-batch loss is weighted by its share of the batch's tokens), then clips the global
gradient norm and steps AdamW. log π uses the generator's convention: log_softmax(logits / T) in fp32.
The loss runs as the fused Triton kernel (``trainer.loss="fused"``, the default on CUDA) or as the eager
reference (``"reference"``, the default on CPU, where Triton only runs interpreted). A non-finite loss or
gradient skips the update (``applied=False``), leaving weights and optimizer state untouched.

``push_weights(version)`` writes this rank's parameters straight into every generator's buckets with the
cached copy plan (llamarl.weight_sync.WeightSender) and publishes them as ``version``.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

from llamarl.algorithms import aipo_loss, token_logprobs
from llamarl.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from llamarl.models import Llama
from llamarl.runtime import RankInfo
from llamarl.weight_sync import GeneratorLayout, TrainerLayout, WeightSender, llama_param_specs, plan_sync

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SUM_METRICS = ("tokens",)
MAX_METRICS = ("ratio_max",)


class TrainerExecutor:
    def __init__(self, *, model_path: str, trainer: dict, temperature: float, generator_handles: list,
                 generator_replicas: int = 1, resume: str | None = None, seed: int = 0,
                 threads: int | None = None, rank_info: RankInfo):
        if rank_info.world_size != 1:
            raise ValueError("a sharded trainer (trainer.ranks > 1) is not wired into the training loop yet; "
                             "use trainer.ranks=1")
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.cfg = trainer
        self.model_path = model_path
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = torch.device(rank_info.device or "cpu")
        self.model = Llama.from_pretrained(model_path, dtype=DTYPES[trainer["dtype"]], device=self.device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=trainer["lr"], betas=tuple(trainer["betas"]),
                                     weight_decay=trainer["weight_decay"])
        # KL penalty target: the policy the run started from, frozen (only kept when kl_coef > 0)
        self.ref = None
        if trainer["kl_coef"] > 0:
            self.ref = Llama.from_pretrained(model_path, dtype=DTYPES[trainer["dtype"]], device=self.device)
            self.ref.eval().requires_grad_(False)
        loss = trainer["loss"]
        self.fused = loss == "fused" or (loss == "auto" and self.device.type == "cuda")
        if resume:
            ckpt = load_checkpoint(resume)
            self.opt.load_state_dict(ckpt.optimizer_state())
            if ckpt.rng_state:
                restore_rng_state(ckpt.rng_state)
        plan = plan_sync(llama_param_specs(self.model.config, dtype=DTYPES[trainer["dtype"]]),
                         TrainerLayout(world_size=1), GeneratorLayout(tp_size=1, replicas=generator_replicas))
        self.sender = WeightSender(plan, rank_info.rank, generator_handles, device=self.device)

    # ------------------------------------------------------------------ commands
    def train_step(self, batch: dict[str, torch.Tensor]) -> dict:
        t0 = time.perf_counter()
        batch = {k: v.to(self.device) for k, v in batch.items()}
        total_tokens = batch["mask"].sum()
        rows = batch["input_ids"].shape[0]
        mb = self.cfg["micro_batch_size"]
        self.opt.zero_grad(set_to_none=True)
        loss_sum, metrics = 0.0, []
        for lo in range(0, rows, mb):
            part = {k: v[lo : lo + mb] for k, v in batch.items()}
            share = part["mask"].sum() / total_tokens.clamp(min=1.0)
            if share == 0:
                continue
            loss, m = self._loss(part)
            (loss * share).backward()
            loss_sum += float(loss.detach()) * float(share)
            metrics.append((float(share), m))
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg["grad_clip"] or float("inf"))
        applied = math.isfinite(loss_sum) and bool(torch.isfinite(grad_norm)) and bool(grads)
        if applied:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {"applied": applied, "loss": loss_sum, "grad_norm": float(grad_norm),
                "train_s": time.perf_counter() - t0, **_combine(metrics)}

    def push_weights(self, version: int) -> dict:
        shards = {name: p.detach() for name, p in self.model.named_parameters()}
        stats = self.sender.sync(shards, version)
        return {"seconds": stats.seconds, "bytes": stats.bytes, "copy_seconds": stats.copy_seconds,
                "wait_seconds": stats.wait_seconds}

    def save_checkpoint(self, run_dir: str, step: int, policy_version: int, data_cursor: int,
                        keep: int = 3) -> str:
        path = save_checkpoint(run_dir, step, policy_state=self._save_policy,
                               optimizer_state=self.opt.state_dict(), policy_version=policy_version,
                               data_cursor=data_cursor, rng_state=capture_rng_state(), keep=keep)
        return str(path)

    def _save_policy(self, path: Path) -> None:
        """HF weights + config, and the tokenizer files of the directory the run started from."""
        self.model.save_pretrained(path)
        for name in TOKENIZER_FILES:
            src = Path(self.model_path) / name
            if src.is_file():
                shutil.copyfile(src, Path(path) / name)

    def close(self) -> None:
        self.sender.close()

    # ------------------------------------------------------------------ the loss
    def _loss(self, part: dict[str, torch.Tensor]):
        c = self.cfg
        adv = part["advantages"][:, None].expand_as(part["mask"])
        if c["correction"] == "none":
            return self._uncorrected_loss(part, adv)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref(part["input_ids"])[:, :-1], part["targets"], self.temperature)
        if self.fused:
            from llamarl_kernels import fused_aipo_loss

            hidden = self.model.hidden_states(part["input_ids"])[:, :-1]
            keep = part["mask"] > 0
            return fused_aipo_loss(hidden[keep], self.model.lm_head_weight, part["targets"][keep],
                                   part["behavior_logprobs"][keep], adv[keep], part["mask"][keep],
                                   rho=c["rho"], temperature=self.temperature,
                                   ref_logprobs=None if ref is None else ref[keep], kl_coef=c["kl_coef"],
                                   entropy_coef=c["entropy_coef"])
        logits = self.model(part["input_ids"])[:, :-1]
        logprobs, entropy = token_logprobs(logits, part["targets"], self.temperature)
        return aipo_loss(logprobs, part["behavior_logprobs"], adv, part["mask"], rho=c["rho"], norm=c["norm"],
                         ref_logprobs=ref, kl_coef=c["kl_coef"], entropy=entropy, entropy_coef=c["entropy_coef"])


    def _uncorrected_loss(self, part, adv):
        """The ablation: AIPO with μ := π (ratio 1), i.e. vanilla policy gradient on stale samples.

        Mismatch metrics are still measured against the real μ, so the two runs are comparable."""
        logits = self.model(part["input_ids"])[:, :-1]
        logprobs, entropy = token_logprobs(logits, part["targets"], self.temperature)
        loss, _ = aipo_loss(logprobs, logprobs.detach(), adv, part["mask"], rho=self.cfg["rho"],
                            norm=self.cfg["norm"], entropy=entropy, entropy_coef=self.cfg["entropy_coef"])
        _, metrics = aipo_loss(logprobs.detach(), part["behavior_logprobs"], adv, part["mask"],
                               rho=self.cfg["rho"], norm=self.cfg["norm"], entropy=entropy.detach())
        return loss, metrics


def _combine(parts: list[tuple[float, dict]]) -> dict:
    """Token-weighted means of per-micro-batch metrics (sums for counts, max for maxima)."""
    out: dict[str, float] = {}
    for share, m in parts:
        for k, v in m.items():
            v = float(v)
            if k in SUM_METRICS:
                out[k] = out.get(k, 0.0) + v
            elif k in MAX_METRICS:
                out[k] = max(out.get(k, -math.inf), v)
            else:
                out[k] = out.get(k, 0.0) + share * v
    return out
