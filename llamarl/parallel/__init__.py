"""Scale-out building blocks: FSDP2 (or plain data parallelism) for the trainer, tensor parallelism for the
generator.

    from llamarl.parallel import apply_fsdp, FSDPConfig, sync_sources, accumulate_gradients
    model = apply_fsdp(Llama(cfg), trainer_group, FSDPConfig(mixed_precision=True))
    sender.sync(sync_sources(model), version)          # this rank's dim-0 shards, no gather
    norm = clip_grad_norm_(model.parameters(), 1.0)    # global norm, same on every rank
    state = full_optimizer_state(opt)                  # checkpoint format of one process (collective)

    from llamarl.parallel import parallelize_llama
    with torch.device("meta"):
        gen = Llama(cfg)
    gen = parallelize_llama(gen, tp_group)             # local slices under HF names, filled by the sync
    logits = gen(ids)                                  # [B, T, V], identical on every TP rank

Both layouts are the weight sync's (``TrainerLayout`` dim-0 chunks, ``GeneratorLayout`` balanced
column/row splits), so the DDMA planner connects them directly.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule, imported on first use (PEP 562): the FSDP module imports torch.distributed.fsdp and
# torch.distributed.tensor (about 1.5 s on a 2-core CPU), which a generator or a single-rank trainer never uses.
_EXPORTS = {
    "llamarl.parallel.ddp": ("allreduce_gradients", "replicas_agree"),
    "llamarl.parallel.fsdp": ("FSDPConfig", "LocalShard", "accumulate_gradients", "apply_fsdp",
                              "full_optimizer_state", "full_state_dict", "load_full_optimizer_state", "local_shards",
                              "sync_sources"),
    "llamarl.parallel.grads": ("clip_grad_norm_",),
    "llamarl.parallel.tensor_parallel": ("ColumnParallelLinear", "RowParallelLinear", "TPGroup",
                                         "VocabParallelEmbedding", "VocabParallelLMHead", "check_tp_size",
                                         "parallelize_llama", "tp_local_config", "tp_shard",
                                         "vocab_parallel_logprobs"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'llamarl.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_MODULE_OF))


__all__ = sorted(_MODULE_OF)
