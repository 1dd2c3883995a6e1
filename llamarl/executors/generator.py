"""The generator executor: the generation engine running on weights the trainer writes into its memory.

The generator rank owns its weight buckets (``GeneratorBuckets``: flat per-dtype shared-memory
segments on CPU, CUDA IPC-exportable allocations on GPU, ``slots`` complete copies); the model's
parameters are views into the slot it currently holds. ``handle()`` gives the trainer ranks what they
need to map those buckets and write into them.

Every ``generate`` call runs inside ``receiver.reading()`` (with TP, the protocol below): it holds the
newest complete policy version for the whole batch (the trainer writes the other slot meanwhile), so no
token is ever computed with a partially written version, and every token is tagged with the held version
number.

Tensor parallelism (``generator.tp`` = R_g > 1): one executor group per replica, its R_g ranks are the TP
shards and its process group is the TP group. Each rank builds the model on the meta device and makes it
its tensor-parallel shard (``llamarl.parallel.parallelize_llama``: local slices under the HF names, which
are exactly what the DDMA plan writes into generator rank g = replica * R_g + tp_rank), so no rank ever
materialises the full model; its KV cache holds only its heads (``tp_local_config``). TP rank 0 creates the
replica's version control block and the others attach to it (one block per replica, as the sync expects).

``generate`` on R_g ranks (the controller calls every rank with the same prompts and parameters):

    1. TP rank 0 acquires the newest complete version v (its hold keeps v's slot from being rewritten)
       and draws the sampling seed if the caller gave none; it broadcasts (v, seed) to the TP group.
    2. The other ranks acquire exactly v (a hold on a slot that is READY, or DRAINING because a writer
       already waits for it, is allowed); an all-reduce of "acquired" makes every rank fail together if
       any could not, instead of leaving its peers blocked inside a collective.
    3. Every rank runs the same engine on the same prompts with the same seed. The collectives of the
       forward pass give every rank identical bytes (gathered logits), so the sampled tokens, log-probs
       and versions are identical on every rank; the controller uses rank 0's result and checks that
       the others agree.
So a TP rank never computes with another version than its peers, and no version is torn.

Quantized generators (``generator.quantization`` = int8 | fp8, with tp = 1): the decoder linears become
``QuantizedLinear`` modules (llamarl.models.quantize) before the buckets are bound, and the plan's
``GeneratorLayout(quant=...)`` makes the trainer quantize each weight where it lives and write codes and
per-row scales straight into the buckets (quantize-on-sync). The sync names them ``<m>.weight`` /
``<m>.weight_scale``, the module ``<m>.qweight`` / ``<m>.scale``: the receiver binds through that map.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from llamarl.generation import GenerationEngine, SamplingParams
from llamarl.models import Llama, LlamaConfig
from llamarl.models.quantize import quantize_model, quantized_state_names
from llamarl.parallel import check_tp_size, parallelize_llama
from llamarl.runtime import RankInfo
from llamarl.weight_sync import (GeneratorBuckets, GeneratorLayout, TrainerLayout, WeightReceiver,
                                 llama_param_specs, plan_sync)
from llamarl.weight_sync.layout import SCALE_SUFFIX

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def generator_layout(tp: int, replicas: int, quantization: str = "none") -> GeneratorLayout:
    """The weight sync's destination layout of the generators (the trainer builds the same plan)."""
    return GeneratorLayout(tp_size=tp, replicas=replicas, quant=None if quantization == "none" else quantization)


class GeneratorExecutor:
    def __init__(self, *, model_config: dict, dtype: str, trainer_ranks: int, replicas: int = 1,
                 max_batch_size: int = 64, max_seq_len: int | None = None, pad_id: int = 0, slots: int = 2,
                 threads: int | None = None, quantization: str = "none", eos_token_ids: list[int] | None = None,
                 tokenizer: Any = None, rank_info: RankInfo):
        if threads:
            torch.set_num_threads(threads)
        self.device = torch.device(rank_info.device or "cpu")
        self.tp_size, self.tp_rank = rank_info.world_size, rank_info.rank
        config = LlamaConfig.from_hf_dict(model_config)
        if self.tp_size == 1:
            # parameters are re-pointed at the buckets by receiver.bind(); their initial values never matter
            self.model = Llama(config).to(device=self.device, dtype=DTYPES[dtype])
        else:
            try:
                check_tp_size(config, self.tp_size)
            except ValueError as exc:
                raise ValueError(f"generator.tp={self.tp_size}: {exc}") from None
            with torch.device("meta"):
                model = Llama(config).to(DTYPES[dtype])
            self.model = parallelize_llama(model, None, device=self.device)  # this group = the TP group
        self.model.eval()
        names = None
        if quantization != "none":  # before bind: the QuantizedLinear buffers are what the sync writes
            if self.tp_size > 1:
                raise ValueError(f"generator.quantization={quantization!r} needs generator.tp=1")
            names = self._quantize(quantization)
        self.pad_id = pad_id
        self.eos = None if eos_token_ids is None else tuple(eos_token_ids)  # None: the model config's
        self.decode = None if tokenizer is None else tokenizer.decode  # for stop strings (SamplingParams.stop)
        # replica groups are named "generator" (one replica) or "generator.<i>"
        replica = int(rank_info.group.rsplit(".", 1)[1]) if "." in rank_info.group else 0
        plan = plan_sync(llama_param_specs(config, dtype=DTYPES[dtype]), TrainerLayout(world_size=trainer_ranks),
                         generator_layout(self.tp_size, replicas, quantization))
        storage = "cuda" if self.device.type == "cuda" else "shm"
        rank = replica * self.tp_size + self.tp_rank  # this rank's index in the plan's generator layout
        self.buckets = self._create_buckets(plan, rank, storage, slots)
        self.receiver = WeightReceiver(self.buckets)
        self.receiver.bind(self.model, names=names)
        self.engine = self._engine(max_batch_size, max_seq_len)

    def _quantize(self, mode: str) -> dict[str, str]:
        """Swap the decoder linears for int8/fp8 ``QuantizedLinear`` modules, whose ``qweight``/``scale``
        buffers the trainer then fills by quantize-on-sync; returns sync name -> module buffer name.

        Kernels: the Triton ones on CUDA; on CPU the eager reference of the same math (Triton would run
        interpreted there, orders of magnitude slower) - the codes and scales are the same bytes."""
        backend = "triton" if self.device.type == "cuda" else "eager"
        quantize_model(self.model, mode, backend=backend)
        names: dict[str, str] = {}
        for weight, nm in quantized_state_names(self.model).items():
            names[weight] = nm.qweight
            names[weight + SCALE_SUFFIX] = nm.scale
        return names

    def _create_buckets(self, plan, rank: int, storage: str, slots: int) -> GeneratorBuckets:
        """This rank's buckets; with TP, rank 0 creates the replica's control block and shares it."""
        if self.tp_size == 1:
            return GeneratorBuckets.create(plan, rank, storage=storage, device=self.device, slots=slots)
        leader: list = [None]
        buckets, error = None, None
        if self.tp_rank == 0:
            try:
                buckets = GeneratorBuckets.create(plan, rank, storage=storage, device=self.device, slots=slots)
                leader = [buckets.control_handle]
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers heard of it
                error, leader = exc, [f"{type(exc).__name__}: {exc}"]
        dist.broadcast_object_list(leader, src=0)  # the control block's handle, or rank 0's error
        if error is not None:
            raise error
        if isinstance(leader[0], str):
            raise RuntimeError(f"TP rank 0 of this generator replica could not create its weight buckets: {leader[0]}")
        if self.tp_rank != 0:
            buckets = GeneratorBuckets.create(plan, rank, storage=storage, device=self.device, slots=slots,
                                              control=leader[0])
        return buckets

    def _engine(self, max_batch_size: int, max_seq_len: int | None) -> GenerationEngine:
        """The engine; a TP rank's KV cache is sized for its own heads.

        ``GenerationEngine`` sizes its cache from ``model.config``; during its construction the model
        shows its local config (``tp_local_config``: the same vocabulary, context and EOS, only the head
        counts divided by R_g), and gets the full config back afterwards. A TP engine decodes eagerly
        (no CUDA graphs): a captured graph keeps the parameter addresses of its capture, but the receiver
        re-points the parameters at another slot whenever the held version moves there, and capturing the
        TP collectives has not been verified."""
        if self.tp_size == 1:
            return GenerationEngine(self.model, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                    pack_weights=False)  # the weights live in the sync buckets
        full = self.model.config
        self.model.config = self.model.tp_config
        try:
            return GenerationEngine(self.model, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                    cuda_graphs=False, pack_weights=False)
        finally:
            self.model.config = full

    def handle(self):
        """What a trainer rank needs to write into this rank's buckets (small, picklable)."""
        return self.buckets.handle()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> dict:
        """Samples for ``prompts`` on the newest complete weights, per-token log μ and versions:
        ``{"samples": [GenerationOutput as dict, prompt-major], "seconds": time in the engine}`` (the
        engine's own time: the caller's wall time also counts waiting behind this rank's other commands)."""
        t0 = time.perf_counter()
        if self.tp_size == 1:
            with self.receiver.reading() as version:
                self.model.policy_version = version
                outs = self.engine.generate(prompts, params, eos_token_id=self.eos, pad_token_id=self.pad_id,
                                            decode=self.decode)
        else:
            with self._tp_reading(params) as (version, params):
                self.model.policy_version = version
                outs = self.engine.generate(prompts, params, eos_token_id=self.eos, pad_token_id=self.pad_id,
                                            decode=self.decode)
        return {"samples": [dataclasses.asdict(o) | {"prompt_token_ids": None} for o in outs],
                "seconds": time.perf_counter() - t0}

    @contextlib.contextmanager
    def _tp_reading(self, params: SamplingParams) -> Iterator[tuple[int, SamplingParams]]:
        """Hold the same version on every TP rank, with one sampling seed (steps 1-2 of the protocol)."""
        msg = torch.zeros(2, dtype=torch.long, device=self.device)
        error: Exception | None = None
        if self.tp_rank == 0:
            try:  # everything that can fail happens here, so the peers always hear of it (broadcast below)
                msg[1] = params.seed if params.seed is not None else secrets.randbits(62)  # before holding anything
                msg[0] = self.receiver.acquire()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the peers heard of it
                error, msg[0] = exc, -1
        dist.broadcast(msg, src=0)
        version, seed = int(msg[0]), int(msg[1])
        if self.tp_rank != 0 and version >= 0:
            try:
                self.receiver.acquire(version=version)
            except Exception as exc:  # noqa: BLE001
                error = exc
        held = torch.tensor([0 if error is not None or version < 0 else 1], device=self.device)
        dist.all_reduce(held, op=dist.ReduceOp.MIN)
        if not int(held[0]):
            if self.receiver.slot is not None:
                self.receiver.release()
            if error is not None:
                raise error
            raise RuntimeError(f"another TP rank of this generator replica could not hold weight version {version} "
                               "(its own error names the cause); no rank generated")
        try:
            yield version, dataclasses.replace(params, seed=seed)
        finally:
            self.receiver.release()

    def close(self) -> None:
        self.receiver.close()
        self.buckets.close()
