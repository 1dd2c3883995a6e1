"""The generator executor: the generation engine running on weights the trainer writes into its memory.

The generator rank owns its weight buckets (``GeneratorBuckets``: flat per-dtype shared-memory
segments on CPU, CUDA IPC-exportable allocations on GPU, ``slots`` complete copies); the model's
parameters are views into the slot it currently holds. ``handle()`` gives the trainer ranks what they
need to map those buckets and write into them.

Every ``generate`` call runs inside ``receiver.reading()``: it holds the newest complete policy version
for the whole batch (the trainer writes the other slot meanwhile), so no token is ever computed with a
partially written version, and every token is tagged with the held version number.
"""

from __future__ import annotations

import dataclasses

import torch

from llamarl.generation import GenerationEngine, SamplingParams
from llamarl.models import Llama, LlamaConfig
from llamarl.runtime import RankInfo
from llamarl.weight_sync import (GeneratorBuckets, GeneratorLayout, TrainerLayout, WeightReceiver,
                                 llama_param_specs, plan_sync)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class GeneratorExecutor:
    def __init__(self, *, model_config: dict, dtype: str, trainer_ranks: int, replicas: int = 1, max_batch_size: int = 64, max_seq_len: int | None = None,
                 pad_id: int = 0, slots: int = 2, threads: int | None = None, rank_info: RankInfo):
        if rank_info.world_size != 1:
            raise ValueError("tensor-parallel generators (generator.tp > 1) are not wired into the training "
                             "loop yet; use generator.tp=1 and more generator.replicas")
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(rank_info.device or "cpu")
        config = LlamaConfig.from_hf_dict(model_config)
        # parameters are re-pointed at the buckets by receiver.bind(); their initial values never matter
        self.model = Llama(config).to(device=self.device, dtype=DTYPES[dtype])
        self.model.eval()
        self.pad_id = pad_id
        # replica groups are named "generator" (one replica) or "generator.<i>"
        replica = int(rank_info.group.rsplit(".", 1)[1]) if "." in rank_info.group else 0
        plan = plan_sync(llama_param_specs(config, dtype=DTYPES[dtype]), TrainerLayout(world_size=trainer_ranks),
                         GeneratorLayout(tp_size=1, replicas=replicas))
        storage = "cuda" if self.device.type == "cuda" else "shm"
        self.buckets = GeneratorBuckets.create(plan, replica, storage=storage, device=self.device, slots=slots)
        self.receiver = WeightReceiver(self.buckets)
        self.receiver.bind(self.model)
        self.engine = GenerationEngine(self.model, max_batch_size=max_batch_size, max_seq_len=max_seq_len)

    def handle(self):
        """What a trainer rank needs to write into this rank's buckets (small, picklable)."""
        return self.buckets.handle()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
        """Samples for ``prompts`` on the newest complete weights; per-token log μ and versions."""
        with self.receiver.reading() as version:
            self.model.policy_version = version
            outs = self.engine.generate(prompts, params, pad_token_id=self.pad_id)
        return [dataclasses.asdict(o) | {"prompt_token_ids": None} for o in outs]

    def close(self) -> None:
        self.receiver.close()
        self.buckets.close()
