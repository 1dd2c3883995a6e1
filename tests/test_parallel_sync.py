"""FSDP trainer -> DDMA weight sync -> tensor-parallel generator, on 4 CPU processes (gloo).

One launch of 4 ranks runs two placements taken from ``llamarl.runtime.placement.Layout`` (the controller
rank 0 of the layout is not started; executor ranks are shifted down by one):

    "2+2"   trainer=2 (FSDP)  generator=2x1 (TP=2)
    "1+3"   trainer=1 (FSDP)  generator=3x1 (TP=3)

In each, the trainer ranks take two AdamW steps on their part of the batch and, after each, write their
dim-0 shards (``sync_sources``, no gather) straight into the generator ranks' shared-memory buckets with
``WeightSender`` (versions 1 and 2); the generator is a meta-built ``Llama`` made tensor parallel, whose
parameters are bound to the buckets by ``WeightReceiver``. Version 3 repeats the current weights over the
torch.distributed transport (``DistSender`` -> ``DistInbox``) into fresh buckets. Checked:

  * trainer: gathered updated weights == a single-process trainer on the whole batch (fp32 tolerance)
  * generator: every local parameter is byte-identical to its slice of the trainer's actual weights
  * generator: TP logits == a single-process Llama holding those weights (fp32 tolerance)
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from dist_harness import launch, random_model
from llamarl.models import Llama, LlamaConfig
from llamarl.runtime.placement import Layout

CFG = LlamaConfig(vocab_size=67, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=12,
                  num_key_value_heads=6, head_dim=8, max_position_embeddings=64)
LAYOUTS = {"2+2": "trainer=2,generator=2x1,reward=0", "1+3": "trainer=1,generator=3x1,reward=0"}
ROWS = 4  # global batch rows (split over the trainer ranks)
LR = 1e-3
FP32_ATOL = 2e-6  # updated weights vs the single-process trainer
LOGITS_ATOL = 2e-5  # TP logits vs the single-process model


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (ROWS, 10), generator=torch.Generator().manual_seed(seed))


def _loss(model, ids):
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))


def _executor_ranks(spec: str) -> tuple[list[int], list[int]]:
    layout = Layout.parse(spec)
    (trainer,) = layout.groups_of("trainer")
    (generator,) = layout.groups_of("generator")
    return [r - 1 for r in trainer.global_ranks], [r - 1 for r in generator.global_ranks]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


# ------------------------------------------------------------------------------------ the two roles
def _train(rank, t_ranks, g_ranks, t_group, plan, batches, ref_states) -> dict:
    import torch.distributed as dist

    from llamarl.parallel import apply_fsdp, full_state_dict, sync_sources
    from llamarl.weight_sync import DistSender, DistTopology, WeightSender

    t, world = t_ranks.index(rank), len(t_ranks)
    out: dict = {}
    handles = [None] * dist.get_world_size()
    dist.all_gather_object(handles, None)  # the generator leader's control handle (not needed here)
    dist.all_gather_object(handles, None)  # every generator rank's bucket handle
    sender = WeightSender(plan, t, [handles[r] for r in g_ranks], num_threads=1, timeout=60)
    model = apply_fsdp(random_model(CFG), t_group)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    per = ROWS // world
    for version, ids in enumerate(batches, start=1):
        opt.zero_grad()
        _loss(model, ids[t * per:(t + 1) * per]).backward()
        opt.step()
        stats = sender.sync(sync_sources(model), version)
        full = full_state_dict(model)  # for the checks only: the sync above never gathers
        dist.broadcast_object_list([full if t == 0 else None], src=t_ranks[0])
        out[f"v{version}_vs_single_process"] = _max_diff(full, ref_states[version - 1])
        out[f"v{version}_bytes"] = stats.bytes
    sender.close()

    dist.all_gather_object(handles, None)  # local buckets created on the generator
    DistSender(plan, t, DistTopology(tuple(t_ranks), tuple(g_ranks)), timeout=60).sync(sync_sources(model), 3)
    out["expected_bytes"] = plan.bytes_moved(t)
    return out


def _generate(rank, t_ranks, g_ranks, g_group, plan, ids) -> dict:
    import torch.distributed as dist

    from llamarl.parallel import parallelize_llama
    from llamarl.weight_sync import DistInbox, DistTopology, GeneratorBuckets, WeightReceiver

    g = g_ranks.index(rank)
    with torch.device("meta"):
        gen = Llama(CFG)
    gen = parallelize_llama(gen, g_group)  # local, uninitialised tensors: the sync fills them
    specs = {s.name: s for s in plan.specs}

    def check(receiver, version, full) -> dict:
        with receiver.reading(version=version, timeout=60) as v:
            assert v == version
            exact = all(gen.get_parameter(n).view(torch.uint8).equal(
                plan.generator.shard(full[n], s, g).view(torch.uint8)) for n, s in specs.items())
            bound = all(gen.get_parameter(n).data_ptr() == t.data_ptr() for n, t in receiver.named_tensors().items())
            ref = Llama(CFG)
            ref.load_state_dict(full)
            with torch.no_grad():
                diff = float((gen(ids) - ref(ids)).abs().max())
        return {"exact": exact, "bound": bound, "logits": diff}

    leader = [None] * dist.get_world_size()
    buckets = GeneratorBuckets.create(plan, 0, storage="shm") if g == 0 else None
    dist.all_gather_object(leader, buckets.handle().control if g == 0 else None)
    if g:
        buckets = GeneratorBuckets.create(plan, g, storage="shm", control=leader[g_ranks[0]])
    dist.all_gather_object([None] * dist.get_world_size(), buckets.handle())
    receiver = WeightReceiver(buckets)
    receiver.bind(gen)
    out = {}
    for version in (1, 2):
        obj = [None]
        dist.broadcast_object_list(obj, src=t_ranks[0])
        full = obj[0]
        out[f"v{version}"] = check(receiver, version, full)
    receiver.close()

    # Version 3 over torch.distributed into fresh (zeroed) "local" buckets.
    local = GeneratorBuckets.create(plan, 0, storage="local") if g == 0 else None
    dist.all_gather_object(leader, local.control.handle if g == 0 else None)
    if g:
        local = GeneratorBuckets.create(plan, g, storage="local", control=leader[g_ranks[0]])
    inbox = DistInbox(plan, local, DistTopology(tuple(t_ranks), tuple(g_ranks)), timeout=60)
    assert inbox.receive() == 3
    receiver = WeightReceiver(local)
    receiver.bind(gen)
    out["v3_dist"] = check(receiver, 3, full)
    receiver.close()
    inbox.close()
    local.close()
    buckets.close()
    return out


def _phase(rank: int, spec: str) -> dict:
    import torch.distributed as dist

    from llamarl.weight_sync import GeneratorLayout, TrainerLayout, llama_param_specs, plan_sync

    t_ranks, g_ranks = _executor_ranks(spec)
    t_group, g_group = dist.new_group(t_ranks), dist.new_group(g_ranks)
    plan = plan_sync(llama_param_specs(CFG), TrainerLayout(world_size=len(t_ranks)),
                     GeneratorLayout(tp_size=len(g_ranks)))
    batches = [_batch(20), _batch(21)]
    if rank in t_ranks:
        ref = random_model(CFG)  # the single-process trainer on the whole batch
        opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
        states = []
        for ids in batches:
            opt.zero_grad()
            _loss(ref, ids).backward()
            opt.step()
            states.append({n: p.detach().clone() for n, p in ref.named_parameters()})
        out = _train(rank, t_ranks, g_ranks, t_group, plan, batches, states)
    else:
        out = _generate(rank, t_ranks, g_ranks, g_group, plan, _batch(30))
    dist.barrier()
    return out


def _worker(rank: int, world: int) -> dict:
    return {name: _phase(rank, spec) for name, spec in LAYOUTS.items()}


# ------------------------------------------------------------------------------------ launching
def test_fsdp_trainer_syncs_exact_weights_into_tp_generator(tmp_path):
    results = launch(_worker, 4, tmp_path)
    for name, spec in LAYOUTS.items():
        t_ranks, g_ranks = _executor_ranks(spec)
        for r in t_ranks:
            res = results[r][name]
            for version in (1, 2):
                d = res[f"v{version}_vs_single_process"]
                assert d <= FP32_ATOL, f"{name} trainer rank {r} v{version}: differs from 1 process by {d:.3g}"
                assert res[f"v{version}_bytes"] == res["expected_bytes"] > 0
        for r in g_ranks:
            for key in ("v1", "v2", "v3_dist"):
                res = results[r][name][key]
                assert res["exact"], f"{name} generator rank {r} {key}: weights are not byte-identical"
                assert res["bound"], f"{name} generator rank {r} {key}: model parameters are not the bucket views"
                assert res["logits"] <= LOGITS_ATOL, f"{name} rank {r} {key}: TP logits differ by {res['logits']:.3g}"
    print({name: {k: results[_executor_ranks(s)[1][0]][name][k]["logits"] for k in ("v1", "v2", "v3_dist")}
           for name, s in LAYOUTS.items()})
