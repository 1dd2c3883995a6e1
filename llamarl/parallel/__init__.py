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

from llamarl.parallel.ddp import allreduce_gradients, replicas_agree
from llamarl.parallel.fsdp import (
    FSDPConfig,
    LocalShard,
    accumulate_gradients,
    apply_fsdp,
    clip_grad_norm_,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    local_shards,
    sync_sources,
)
from llamarl.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    check_tp_size,
    parallelize_llama,
    tp_local_config,
    tp_shard,
    vocab_parallel_logprobs,
)

__all__ = [
    "ColumnParallelLinear", "FSDPConfig", "LocalShard", "RowParallelLinear", "TPGroup", "VocabParallelEmbedding",
    "VocabParallelLMHead", "accumulate_gradients", "allreduce_gradients", "apply_fsdp", "check_tp_size", "clip_grad_norm_",
    "full_optimizer_state", "full_state_dict", "load_full_optimizer_state", "local_shards", "parallelize_llama",
    "replicas_agree",
    "sync_sources", "tp_local_config", "tp_shard", "vocab_parallel_logprobs",
]
