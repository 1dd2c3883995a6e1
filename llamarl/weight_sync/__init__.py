"""DDMA weight sync: trainer shards copied straight into generator memory, versioned, no torn reads.

    specs = llama_param_specs(state_dict_or_config)
    plan = plan_sync(specs, TrainerLayout(world_size=R_t), GeneratorLayout(tp_size=R_g, replicas=n, quant=None))

    # generator rank g (owner of the memory)
    buckets = GeneratorBuckets.create(plan, g, storage="shm" | "cuda" | "local", slots=2)
    handle = buckets.handle()                 # small and picklable: send it to every trainer rank
    receiver = WeightReceiver(buckets); receiver.bind(model)
    with receiver.reading() as version: ...   # compute on one complete version

    # trainer rank t (same host: shared memory or CUDA IPC)
    sender = WeightSender(plan, t, [handles of all generator ranks])
    sender.sync(local_shards, version)        # name -> this rank's dim-0 shard

    # other hosts: DistSender(plan, t, topology).sync(...) / DistInbox(plan, buckets, topology).receive()

Modules: layout (specs, layouts), planner (the static copy plan), buckets (flat per-dtype buckets),
versioning (slots and the version protocol), sender (shm / CUDA IPC), dist (torch.distributed),
receiver (generator-side holds), quantize_on_sync (trainer-side sources), cleanup (segment lifetime).
"""

from llamarl.weight_sync.buckets import AttachedBuckets, BucketHandle, GeneratorBuckets
from llamarl.weight_sync.dist import DistInbox, DistSender, DistTopology
from llamarl.weight_sync.layout import (
    GeneratorLayout,
    ParamSpec,
    SyncTensor,
    TrainerLayout,
    llama_param_specs,
    llama_tp_split,
    sync_tensors,
)
from llamarl.weight_sync.planner import SyncPlan, plan_sync
from llamarl.weight_sync.receiver import WeightReceiver
from llamarl.weight_sync.sender import SyncStats, WeightSender
from llamarl.weight_sync.versioning import ControlHandle, PeerDied, SyncTimeout, VersionControl

__all__ = [
    "AttachedBuckets", "BucketHandle", "ControlHandle", "DistInbox", "DistSender", "DistTopology",
    "GeneratorBuckets", "GeneratorLayout", "ParamSpec", "PeerDied", "SyncPlan", "SyncStats", "SyncTensor",
    "SyncTimeout", "TrainerLayout", "VersionControl", "WeightReceiver", "WeightSender", "llama_param_specs",
    "llama_tp_split", "plan_sync", "sync_tensors",
]
