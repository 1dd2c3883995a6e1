"""Flat per-dtype generator buckets: layout, views, module binding, handles, errors and segment lifetime."""

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from llamarl import _native
from llamarl.weight_sync import (
    GeneratorBuckets,
    GeneratorLayout,
    ParamSpec,
    TrainerLayout,
    WeightReceiver,
    WeightSender,
    llama_param_specs,
    plan_sync,
)
from llamarl.weight_sync import cleanup

TINY = dict(vocab_size=29, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def shm_names():
    return {"/" + n for n in os.listdir("/dev/shm") if n.startswith("llamarl-")}


@pytest.fixture
def tiny_plan():
    specs = llama_param_specs(TINY, torch.float32)
    return plan_sync(specs, TrainerLayout(2), GeneratorLayout())


def sync_full(plan, handles, full, version):
    for t in range(plan.trainer.world_size):
        with WeightSender(plan, t, handles, num_threads=2) as s:
            s.sync({sp.name: plan.trainer.shard(full[sp.name], sp, t) for sp in plan.specs}, version)


def test_one_segment_per_dtype_and_views_alias_the_buckets():
    specs = llama_param_specs(TINY, torch.bfloat16)
    plan = plan_sync(specs, TrainerLayout(1), GeneratorLayout(quant="int8"))
    b = GeneratorBuckets.create(plan, 0, storage="shm", slots=2)
    try:
        h = b.handle()
        assert len(h.segments) == len(plan.buckets[0].dtypes) == 3  # bf16, int8, fp32 scales
        assert all(os.path.exists("/dev/shm" + n) for n in h.segments)
        for slot in range(2):
            flat = [_native.as_tensor(m) for m in b._mems]
            for name, v in b.tensors(slot).items():
                p = next(p for p in plan.buckets[0].placements if p.name == name)
                base = flat[p.bucket].data_ptr() + slot * plan.buckets[0].slot_nbytes[p.bucket]
                assert v.data_ptr() == base + p.offset and v.data_ptr() % 256 == 0
                assert v.dtype == p.dtype and tuple(v.shape) == p.shape
                assert int(v.view(torch.uint8).sum()) == 0  # zero-filled
        blob = pickle.dumps(h)
        assert len(blob) < 8192 and b"torch.Tensor" not in blob
        assert pickle.loads(blob) == h
    finally:
        b.close()
    assert not (set(h.segments) | {h.control.name}) & shm_names()


def test_sync_changes_a_bound_transformers_model_in_place(tiny_plan):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    trainer_model = transformers.LlamaForCausalLM(cfg).eval()
    generator_model = transformers.LlamaForCausalLM(cfg).eval()
    full = {k: v.detach().clone() for k, v in trainer_model.state_dict().items()}
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=1)
    try:
        r = WeightReceiver(b)
        r.bind(generator_model)
        sync_full(tiny_plan, [b.handle()], full, version=1)
        ids = torch.tensor([[1, 5, 7, 3]])
        with r.reading() as v, torch.no_grad():
            assert v == 1
            assert generator_model.model.layers[1].mlp.down_proj.weight.data_ptr() == \
                r.named_tensors()["model.layers.1.mlp.down_proj.weight"].data_ptr()
            torch.testing.assert_close(generator_model(ids).logits, trainer_model(ids).logits, rtol=0, atol=0)
        full2 = {k: v * 0.5 for k, v in full.items()}
        sync_full(tiny_plan, [b.handle()], full2, version=2)
        with r.reading() as v, torch.no_grad():
            assert v == 2
            for n, p in generator_model.named_parameters():
                assert p.equal(full2[n]), n
        r.close()
    finally:
        b.close()


def test_bind_refuses_a_module_that_does_not_fit_the_buckets(tiny_plan):
    """A wrong model is refused at bind (before any sync), and left untouched."""
    transformers = pytest.importorskip("transformers")
    wider = {**TINY, "intermediate_size": TINY["intermediate_size"] * 2}
    wrong = transformers.LlamaForCausalLM(transformers.LlamaConfig(**wider, tie_word_embeddings=False))
    before = {n: p.data_ptr() for n, p in wrong.named_parameters()}
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=1)
    try:
        r = WeightReceiver(b)
        with pytest.raises(ValueError, match=r"module tensor 'model.layers.0.mlp.gate_proj.weight' is .* but the"):
            r.bind(wrong)
        assert {n: p.data_ptr() for n, p in wrong.named_parameters()} == before
        r.close()
    finally:
        b.close()


def test_bound_module_weights_key_names_the_slot_it_points_at(tiny_plan):
    """Double buffering re-points the parameters; ``weights_key`` (what CUDA-graph decoders key their graphs
    by) must change with the slot and be the same whenever the same slot comes back."""
    transformers = pytest.importorskip("transformers")
    generator_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=False))
    full = {k: v.detach().clone() for k, v in generator_model.state_dict().items()}
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=2)
    try:
        r = WeightReceiver(b)
        r.bind(generator_model)
        seen = {}
        for version in range(1, 5):
            sync_full(tiny_plan, [b.handle()], {k: v * version for k, v in full.items()}, version=version)
            with r.reading() as v:
                assert v == version
                ptr = generator_model.model.embed_tokens.weight.data_ptr()
                seen.setdefault(generator_model.weights_key, set()).add(ptr)
        assert len(seen) == 2 and all(len(ptrs) == 1 for ptrs in seen.values())  # one key per slot address
        r.close()
    finally:
        b.close()


def test_mismatched_module_or_specs_raise_clearly(tiny_plan):
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=1)
    try:
        wrong = torch.nn.Linear(3, 3)
        with pytest.raises(ValueError, match="missing from the module"):
            b.load_into(wrong, 0)
        # a trainer whose specs disagree with the generator's: one weight has another shape
        specs = llama_param_specs({**TINY, "intermediate_size": 20}, torch.float32)
        other = plan_sync(specs, TrainerLayout(2), GeneratorLayout())
        with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight.*mismatched shapes"):
            WeightSender(other, 0, [b.handle()])
        dtype_specs = llama_param_specs(TINY, torch.bfloat16)
        with pytest.raises(ValueError, match="bfloat16"):
            WeightSender(plan_sync(dtype_specs, TrainerLayout(2), GeneratorLayout()), 0, [b.handle()])
        with pytest.raises(ValueError, match="cover generator ranks"):
            WeightSender(plan_sync(tiny_plan.specs, TrainerLayout(2), GeneratorLayout(tp_size=2)), 0, [b.handle()])
    finally:
        b.close()


def test_bad_shards_raise_before_anything_is_written(tiny_plan):
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=1)
    try:
        full = {s.name: torch.randn(s.shape) for s in tiny_plan.specs}
        shards = {s.name: tiny_plan.trainer.shard(full[s.name], s, 0) for s in tiny_plan.specs}
        with WeightSender(tiny_plan, 0, [b.handle()]) as s:
            bad = dict(shards)
            del bad["model.norm.weight"]
            with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
                s.sync(bad, 1)
            with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
                s.sync({**shards, "extra": torch.zeros(1)}, 1)
            name = "model.layers.0.self_attn.q_proj.weight"
            with pytest.raises(ValueError, match="dim-0 sharded layout over 2 ranks expects"):
                s.sync({**shards, name: full[name]}, 1)
            with pytest.raises(TypeError, match="float64"):
                s.sync({**shards, name: shards[name].double()}, 1)
            with pytest.raises(ValueError, match="not contiguous"):
                s.sync({**shards, name: shards[name].t().contiguous().t()}, 1)
            assert b.control.snapshot()["claim_version"] == -1  # nothing was claimed
    finally:
        b.close()


def test_shared_memory_errors_are_clear():
    with pytest.raises(RuntimeError, match=r"/dev/shm has only \d+ bytes free"):
        _native.shm_create(cleanup.unique_name("huge"), 1 << 50)
    with pytest.raises(RuntimeError, match="has exited or unlinked it"):
        _native.shm_attach("/llamarl-does-not-exist", 4096)
    name = cleanup.unique_name("x")
    seg = _native.shm_create(name, 4096)
    try:
        with pytest.raises(RuntimeError, match="already exists"):
            _native.shm_create(name, 4096)
        with pytest.raises(RuntimeError, match="holds 4096 bytes but the handle says 8192"):
            _native.shm_attach(name, 8192)
        with pytest.raises(ValueError, match="segment name must look like"):
            _native.shm_create("no-slash", 10)
    finally:
        seg.unlink()
    assert not _native.shm_unlink(name)


def test_segment_names_are_registered_before_the_segments_exist(tiny_plan, monkeypatch):
    # A kill between creating a segment and registering it would leak it: registration comes first.
    real = _native.shm_create
    registered_at_create = {}

    def spying(name, nbytes):
        registered_at_create[name] = name in cleanup.owned()
        return real(name, nbytes)

    monkeypatch.setattr(_native, "shm_create", spying)
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=2)
    try:
        names = set(b.handle().segments) | {b.control_handle.name}
        assert set(registered_at_create) == names and all(registered_at_create.values())
    finally:
        b.close()
    assert not names & cleanup.owned() and not names & shm_names()

    # a creation that fails leaves neither a registered name nor a segment behind (the control block is
    # created first, then the bucket)
    for fail_at in (1, 2):
        calls = []

        def failing(name, nbytes):
            calls.append(name)
            if len(calls) == fail_at:
                raise RuntimeError("no room in /dev/shm")
            return real(name, nbytes)

        monkeypatch.setattr(_native, "shm_create", failing)
        before = cleanup.owned()
        with pytest.raises(RuntimeError, match="no room"):
            GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=2)
        assert len(calls) == fail_at
        assert cleanup.owned() == before and not set(calls) & shm_names()
    # releasing a registered name that was never created is harmless
    name = cleanup.unique_name("never")
    cleanup.register(name)
    cleanup.release(name)
    assert name not in cleanup.owned() and not _native.shm_unlink(name)


def test_indexed_copy_bounds_are_checked_per_buffer():
    a, b = torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"copy op 1 \(src_buf 0, dst_buf 1\): writes past the end"):
        _native.copy_indexed(_native.BufferTable.of([a, b]), _native.BufferTable.of([a]),
                             [(0, 0, 0, 0, 1, 4, 4, 4), (0, 1, 0, 2, 1, 4, 4, 4)])
    with pytest.raises(ValueError, match="not an index into the 1 source buffers"):
        _native.copy_indexed(_native.BufferTable.of([a]), _native.BufferTable.of([a]), [(1, 0, 0, 0, 1, 1, 1, 1)])


CRASHING_OWNER = r"""
import sys, torch
from llamarl.weight_sync import GeneratorBuckets, GeneratorLayout, TrainerLayout, llama_param_specs, plan_sync
specs = llama_param_specs(dict(vocab_size=7, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
                               num_attention_heads=2), torch.float32)
from llamarl.weight_sync import cleanup
cleanup.register(cleanup.unique_name("never_created"))  # harmless for every unlink path, the reaper's too
b = GeneratorBuckets.create(plan_sync(specs, TrainerLayout(1), GeneratorLayout()), 0, storage="shm", slots=2)
h = b.handle()
print(" ".join(h.segments + (h.control.name,)), flush=True)
sys.stdin.read()  # wait to be killed
"""


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_no_segment_outlives_its_owner(how):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    names = set(proc.stdout.readline().split())
    assert len(names) == 2 and names <= shm_names()
    if how == "sigkill":
        proc.send_signal(signal.SIGKILL)  # no atexit, no handler: only the reaper can clean up
    else:
        proc.stdin.close()  # normal interpreter exit without close(): the atexit hook unlinks
    proc.wait(timeout=30)
    deadline = time.time() + 15
    while names & shm_names() and time.time() < deadline:
        time.sleep(0.05)
    assert not names & shm_names()


def test_a_tp_peer_given_its_leaders_control_object_leaves_it_alone_on_close():
    """control= accepts the leader's VersionControl itself (not only its handle): the peer does not own it."""
    plan = plan_sync([ParamSpec("model.layers.0.mlp.up_proj.weight", (6, 4), torch.float32, 0)], TrainerLayout(1),
                     GeneratorLayout(tp_size=2))
    leader = GeneratorBuckets.create(plan, 0, storage="shm", slots=2)
    try:
        for control in (leader.control, leader.control_handle):
            GeneratorBuckets.create(plan, 1, storage="shm", slots=2, control=control).close()
            assert leader.control_handle.name in shm_names()
            assert leader.control.snapshot()["latest_version"] == -1  # still mapped and usable
    finally:
        leader.close()
    assert leader.control_handle.name not in shm_names()


def test_a_forked_child_does_not_unlink_its_parents_segments(tiny_plan):
    """A child made by os.fork inherits the owned names; its exit (atexit runs) must not unlink them."""
    b = GeneratorBuckets.create(tiny_plan, 0, storage="shm", slots=1)
    try:
        names = set(b.handle().segments) | {b.control_handle.name}
        assert names <= shm_names() and names <= cleanup.owned()
        pid = os.fork()
        if pid == 0:  # the child: a normal interpreter exit would run atexit; run it as sys.exit does
            code = 0 if not cleanup.owned() else 3
            cleanup._unlink_all()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # the child owned nothing
        assert names <= shm_names()
    finally:
        b.close()
    assert not names & shm_names()


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_kernel_quantizes_whole_row_pieces_straight_into_the_buckets(mode):
    from llamarl_kernels import quantize

    specs = [ParamSpec("model.layers.0.mlp.up_proj.weight", (7, 12), torch.bfloat16, 0),
             ParamSpec("model.layers.0.mlp.down_proj.weight", (9, 10), torch.float32, 1),
             ParamSpec("model.norm.weight", (9,), torch.float32, None)]
    plan = plan_sync(specs, TrainerLayout(2), GeneratorLayout(tp_size=2, replicas=2, quant=mode))
    gens = []
    for g in range(4):
        gens.append(GeneratorBuckets.create(plan, g, storage="shm", slots=2,
                                            control=None if g % 2 == 0 else gens[g - 1].control_handle))
    try:
        handles = [b.handle() for b in gens]
        g0 = torch.Generator().manual_seed(1)
        full = {s.name: torch.randn(s.shape, generator=g0).to(s.dtype) for s in specs}
        senders = [WeightSender(plan, t, handles, quantizer="kernel") for t in range(2)]
        # up_proj (column-parallel) goes direct, down_proj (row-parallel over 2 ranks) is staged
        assert {d[0] for d in senders[0]._direct} == {"model.layers.0.mlp.up_proj.weight"}
        assert senders[0]._skip == frozenset({"model.layers.0.mlp.up_proj.weight"})
        for t, s in enumerate(senders):
            s.sync({sp.name: plan.trainer.shard(full[sp.name], sp, t) for sp in specs}, 1)
        for g, b in enumerate(gens):
            r = WeightReceiver(b)
            with r.reading():
                got = r.named_tensors()
                for tensor in plan.tensors:
                    w = full[tensor.param]
                    if tensor.kind != "param":
                        w = quantize(w, mode)[0 if tensor.kind == "qweight" else 1]
                    exp = plan.generator.shard(w, tensor, g)
                    assert got[tensor.name].view(torch.uint8).equal(exp.view(torch.uint8)), (tensor.name, g)
            r.close()
        for s in senders:
            s.close()
    finally:
        for b in reversed(gens):
            b.close()


def test_a_shard_repointed_to_new_storage_is_read_from_there():
    """The sender caches the shards' copy sources; a shard tensor given new storage between syncs (``.data =``,
    ``load_state_dict(assign=True)``) must be read from its new memory (the cache is keyed by the addresses)."""
    specs = [ParamSpec("model.norm.weight", (64,), torch.float32, None),
             ParamSpec("model.layers.0.mlp.up_proj.weight", (8, 16), torch.float32, 0)]
    plan = plan_sync(specs, TrainerLayout(1), GeneratorLayout())
    gen = GeneratorBuckets.create(plan, 0, storage="shm", slots=2)
    try:
        shards = {s.name: torch.full(s.shape, 1.0) for s in specs}
        with WeightSender(plan, 0, [gen.handle()]) as sender:
            sender.sync(shards, 1)
            shards["model.norm.weight"].data = torch.full((64,), 2.0)  # the same tensor object, new storage
            shards["model.layers.0.mlp.up_proj.weight"].mul_(3.0)  # in place: the same address
            sender.sync(shards, 2)
        r = WeightReceiver(gen)
        with r.reading() as version:
            got = r.named_tensors()
            assert version == 2 and all(torch.equal(got[n], t) for n, t in shards.items())
        r.close()
    finally:
        gen.close()


def test_quantize_on_sync_writes_each_replica_into_its_own_slot():
    """Two replicas whose control blocks pick different slots (a reader of replica 1 holds version 1): every
    replica's newest version holds exactly quantize(w), written into that replica's slot."""
    from llamarl_kernels import quantize

    specs = [ParamSpec("model.layers.0.mlp.up_proj.weight", (7, 12), torch.float32, 0),
             ParamSpec("model.norm.weight", (9,), torch.float32, None)]
    plan = plan_sync(specs, TrainerLayout(1), GeneratorLayout(tp_size=1, replicas=2, quant="int8"))
    gens = [GeneratorBuckets.create(plan, g, storage="shm", slots=3) for g in range(2)]
    try:
        sender = WeightSender(plan, 0, [b.handle() for b in gens], quantizer="kernel")
        assert sender._direct, "the direct (in-bucket) quantization path"
        readers = [WeightReceiver(b) for b in gens]
        chosen = []
        for version in range(1, 7):
            full = {s.name: torch.randn(s.shape, generator=torch.Generator().manual_seed(version)) for s in specs}
            chosen.append(sender.sync(full, version).slots)
            if version == 1:
                readers[1].acquire(1)  # held: replica 1's slot choices now differ from replica 0's
            if version >= 2:
                for g in (0,) if version < 6 else (0, 1):
                    if g == 1:
                        readers[1].release()
                    with readers[g].reading() as v:
                        got = readers[g].named_tensors()["model.layers.0.mlp.up_proj.weight"]
                        assert v == version and torch.equal(got, quantize(full[specs[0].name], "int8")[0]), g
        assert any(len(set(slots.values())) > 1 for slots in chosen), chosen  # the replicas really diverged
        for r in readers:
            r.close()
        sender.close()
    finally:
        for b in reversed(gens):
            b.close()


@pytest.mark.gpu
def test_cuda_buckets_are_written_through_ipc_and_in_process():
    specs = [ParamSpec("model.layers.0.mlp.down_proj.weight", (64, 48), torch.bfloat16, 1),
             ParamSpec("model.norm.weight", (64,), torch.bfloat16, None)]
    plan = plan_sync(specs, TrainerLayout(2), GeneratorLayout(tp_size=1, quant="fp8"))
    b = GeneratorBuckets.create(plan, 0, storage="cuda", device="cuda:0", slots=2)
    try:
        full = {s.name: torch.randn(s.shape, device="cuda").to(s.dtype) for s in specs}
        for t in range(2):
            with WeightSender(plan, t, [b.handle()], device="cuda:0") as s:
                s.sync({sp.name: plan.trainer.shard(full[sp.name], sp, t) for sp in specs}, 1)
        from llamarl_kernels import quantize

        r = WeightReceiver(b)
        with r.reading():
            got = r.named_tensors()
            q, scale = quantize(full["model.layers.0.mlp.down_proj.weight"], "fp8")
            assert got["model.layers.0.mlp.down_proj.weight"].view(torch.uint8).equal(q.view(torch.uint8))
            assert got["model.layers.0.mlp.down_proj.weight_scale"].equal(scale)
            assert got["model.norm.weight"].equal(full["model.norm.weight"])
        r.close()
    finally:
        b.close()


def test_segments_of_an_owner_killed_with_its_reaper_are_swept_by_the_next_owner():
    """``pkill -9 python`` kills the owner and its reaper together: nobody unlinked its segments. The next
    process that registers a segment unlinks them (owner gone); a live owner's segments stay."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    dead = set(proc.stdout.readline().split())
    reaper = [int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()]
    assert reaper and dead <= shm_names()
    for pid in reaper:  # the reaper first, so it cannot unlink anything
        os.kill(pid, signal.SIGKILL)
    proc.kill()
    proc.wait(timeout=30)
    time.sleep(0.2)
    assert dead <= shm_names()  # leaked
    live = cleanup.unique_name("live")  # this (live) process's own segment, created without register
    seg = _native.shm_create(live, 4096)
    try:
        swept = set(cleanup.sweep_stale())
        assert dead <= swept and live not in swept
        assert not dead & shm_names() and live in shm_names()
    finally:
        del seg
        _native.shm_unlink(live)
