"""Multi-process weight sync on CPU: random layouts through shared memory and through gloo send/recv.

Three long-lived worker processes (spawned once, one gloo process group) host the logical ranks of each
hypothesis example: R_t in 1..4 trainer ranks (sharded or replicated), R_g in 1..4 TP ranks, 1..2
replicas, odd shapes, uneven shards, bf16/fp16/fp32, optionally int8/fp8 quantize-on-sync. After each
sync every generator rank, in the process that owns its buckets, holds a complete version and compares
it byte for byte with the slice of the full weights (or of quantize_ref(full weights)).
"""

import multiprocessing as mp
import os
import tempfile
import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

N_WORKERS = 3
LLAMA_NAMES = [
    ("model.embed_tokens.weight", 2), ("model.layers.0.self_attn.q_proj.weight", 2),
    ("model.layers.0.self_attn.o_proj.weight", 2), ("model.layers.0.mlp.down_proj.weight", 2),
    ("model.layers.0.mlp.gate_proj.weight", 2), ("model.layers.0.post_attention_layernorm.weight", 1),
    ("lm_head.weight", 2), ("model.norm.weight", 1),
]


# ---- what the workers run ---------------------------------------------------------------------------
def full_weights(specs, seed, version):
    g = torch.Generator().manual_seed(seed * 1000 + version)
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}


def _plan(args):
    from llamarl.weight_sync import plan_sync

    return plan_sync(args["specs"], args["trainer"], args["generator"])


def w_create(state, args, ranks, storage, controls):
    """Create the buckets of generator `ranks` (owned here); returns their handles."""
    from llamarl.weight_sync import GeneratorBuckets

    plan = _plan(args)
    out = {}
    for g in ranks:
        ctl = controls.get(plan.generator.replica(g))
        b = GeneratorBuckets.create(plan, g, storage=storage, slots=args["slots"], control=ctl)
        state.setdefault("buckets", {})[g] = b
        out[g] = b.handle() if storage != "local" else b.control_handle
    return out


def w_senders(state, args, ranks, handles, timeout=30):
    from llamarl.weight_sync import WeightSender

    plan = _plan(args)
    state["senders"] = {t: WeightSender(plan, t, handles, num_threads=2, quantizer="torch", timeout=timeout)
                        for t in ranks}


def w_hold(state, hold):
    """Hold (acquire) the newest version of generator rank 0 as a reader, or release it."""
    from llamarl.weight_sync import WeightReceiver

    r = state.setdefault("receivers", {}).get(0) or WeightReceiver(state["buckets"][0])
    state["receivers"][0] = r
    if hold:
        return r.acquire(timeout=30)
    r.release()


def w_sync_expecting_timeout(state, args, version):
    from llamarl.weight_sync import SyncTimeout

    with pytest.raises(SyncTimeout):
        w_sync(state, args, version)


def w_sync(state, args, version):
    plan = _plan(args)
    full = full_weights(plan.specs, args["seed"], version)
    for t, s in sorted(state["senders"].items()):  # rank 0 (the slot leader) first
        s.sync({sp.name: plan.trainer.shard(full[sp.name], sp, t) for sp in plan.specs}, version)


def w_dist_setup(state, args, trainer_ranks, generator_ranks):
    from llamarl.weight_sync import DistInbox, DistSender, DistTopology

    plan = _plan(args)
    topo = DistTopology(tuple(trainer_ranks), tuple(generator_ranks))
    me = int(os.environ["LLAMARL_TEST_WORKER"])
    state["dist_senders"] = {t: DistSender(plan, t, topo, quantizer="torch", timeout=30)
                             for t, r in enumerate(trainer_ranks) if r == me}
    state["inboxes"] = {g: DistInbox(plan, state["buckets"][g], topo, timeout=30)
                        for g in state.get("buckets", {})}


def w_dist_sync(state, args, version):
    plan = _plan(args)
    full = full_weights(plan.specs, args["seed"], version)
    senders = sorted(state.get("dist_senders", {}).items())
    for t, s in senders:
        s.start({sp.name: plan.trainer.shard(full[sp.name], sp, t) for sp in plan.specs}, version)
    # TP leaders first: a peer's inbox waits for its leader's claim
    for g, inbox in sorted(state.get("inboxes", {}).items(), key=lambda kv: (plan.generator.tp_rank(kv[0]), kv[0])):
        assert inbox.receive() == version
    for _, s in senders:
        s.wait()


def w_dist_sync_failing_copy(state, args, version):
    """``w_dist_sync`` with this worker's inbox copies failing: every receive must raise and give its claim up.
    Returns the claims left in the inboxes' control blocks (-1: none)."""
    from llamarl import _native

    real = _native.copy_indexed
    _native.copy_indexed = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected copy failure"))
    try:
        with pytest.raises(RuntimeError, match="injected copy failure"):
            w_dist_sync(state, args, version)
    finally:
        _native.copy_indexed = real
    return [b.control.snapshot()["claim_version"] for b in state.get("buckets", {}).values()]


def w_verify(state, args, version):
    """Acquire the newest version on every owned generator rank and diff it against the reference."""
    from llamarl.weight_sync import WeightReceiver
    from llamarl_kernels.reference import quantize_ref

    plan = _plan(args)
    full = full_weights(plan.specs, args["seed"], version)
    problems = []
    for g, b in sorted(state.get("buckets", {}).items()):
        r = state.setdefault("receivers", {}).get(g) or WeightReceiver(b)
        state["receivers"][g] = r
        v = r.acquire(version=version, timeout=30)
        try:
            got = r.named_tensors()
            for tensor in plan.tensors:
                w = full[tensor.param]
                if tensor.kind != "param":
                    w = quantize_ref(w, plan.generator.quant)[0 if tensor.kind == "qweight" else 1]
                exp = plan.generator.shard(w, tensor, g).contiguous()
                if not got[tensor.name].cpu().view(torch.uint8).equal(exp.view(torch.uint8)):
                    problems.append(f"rank {g} version {v}: {tensor.name} differs")
        finally:
            r.release()
    return problems


def w_receive_expecting_failure(state, args):
    """Block in DistInbox.receive while the trainer process is killed; return the error text."""
    try:
        for inbox in state["inboxes"].values():
            inbox.receive(timeout=60)
    except (RuntimeError, TimeoutError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def w_close(state):
    for key in ("receivers", "senders", "inboxes"):
        for obj in state.pop(key, {}).values():
            obj.close()
    state.pop("dist_senders", None)
    for b in state.pop("buckets", {}).values():
        b.close()
    from llamarl.weight_sync import cleanup

    return sorted(cleanup.owned())


def worker_main(conn, rank, world, init_file):
    os.environ["LLAMARL_TEST_WORKER"] = str(rank)
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    state = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, kwargs = msg
        try:
            conn.send((True, globals()[fn](state, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            conn.send((False, traceback.format_exc()))
    dist.destroy_process_group()


class Workers:
    def __init__(self, n):
        ctx = mp.get_context("spawn")
        self.init_file = tempfile.mktemp(prefix="llamarl-gloo-")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(child, i, n, self.init_file), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, calls, timeout=90):
        """calls: [(worker, fn, kwargs)] sent together, then answered; raises the first remote error."""
        for w, fn, kw in calls:
            self.conns[w].send((fn, kw))
        results, errors = [], []
        for w, fn, _ in calls:
            if not self.conns[w].poll(timeout):
                raise TimeoutError(f"worker {w} did not answer {fn} within {timeout} s")
            ok, val = self.conns[w].recv()
            (results if ok else errors).append(val if ok else f"worker {w} {fn}:\n{val}")
        if errors:
            raise AssertionError("\n".join(errors))
        return results

    def close(self):
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                c.send(None)
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
        if os.path.exists(self.init_file):
            os.unlink(self.init_file)


@pytest.fixture(scope="module")
def workers():
    w = Workers(N_WORKERS)
    yield w
    w.close()


@st.composite
def layouts(draw):
    from llamarl.weight_sync import GeneratorLayout, ParamSpec, TrainerLayout, llama_tp_split

    k = draw(st.integers(1, 4))
    chosen = draw(st.permutations(LLAMA_NAMES))[:k]
    specs = []
    for name, ndim in chosen:
        shape = (draw(st.integers(1, 17)),) + ((draw(st.integers(1, 13)),) if ndim == 2 else ())
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
        specs.append(ParamSpec(name, shape, dtype, llama_tp_split(name)))
    tp, replicas = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    return dict(
        specs=specs,
        trainer=TrainerLayout(draw(st.integers(1, 4)), replicated=draw(st.booleans())),
        generator=GeneratorLayout(tp_size=tp, replicas=replicas if tp * replicas <= 4 else 1,
                                  quant=draw(st.sampled_from([None, None, "int8", "fp8"]))),
        slots=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 10_000)),
    )


def create_generators(workers, args, storage, owner_of):
    gen = args["generator"]
    handles = {}
    # TP leaders first; their control blocks are then given to the other TP ranks of the replica
    leaders = [g for g in range(gen.world_size) if gen.tp_rank(g) == 0]
    calls = [(owner_of(g), "w_create", dict(args=args, ranks=[g], storage=storage, controls={})) for g in leaders]
    for res in workers.run(calls):
        handles.update(res)
    controls = {gen.replica(g): (h.control if storage != "local" else h) for g, h in handles.items()}  # -> ControlHandle
    peers = [g for g in range(gen.world_size) if gen.tp_rank(g) != 0]
    calls = [(owner_of(g), "w_create", dict(args=args, ranks=[g], storage=storage, controls=controls)) for g in peers]
    for res in workers.run(calls):
        handles.update(res)
    return handles


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=layouts())
def test_shared_memory_sync_across_processes_is_byte_exact(workers, args):
    gen, tr = args["generator"], args["trainer"]
    handles = create_generators(workers, args, "shm", owner_of=lambda g: g % N_WORKERS)
    try:
        hlist = [handles[g] for g in range(gen.world_size)]
        trainer_workers = {}
        for t in range(tr.world_size):
            trainer_workers.setdefault((t + 1) % N_WORKERS, []).append(t)  # not the owner of rank 0
        workers.run([(w, "w_senders", dict(args=args, ranks=ranks, handles=hlist))
                     for w, ranks in trainer_workers.items()])
        for version in (1, 2, 3):  # more versions than slots: slots get reused
            workers.run([(w, "w_sync", dict(args=args, version=version)) for w in trainer_workers])
            problems = workers.run([(w, "w_verify", dict(args=args, version=version)) for w in range(N_WORKERS)])
            assert [p for ps in problems for p in ps] == []
    finally:
        leftovers = workers.run([(w, "w_close", {}) for w in range(N_WORKERS)])
    assert leftovers == [[]] * N_WORKERS


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=layouts())
def test_gloo_send_recv_sync_across_processes_is_byte_exact(workers, args):
    gen, tr = args["generator"], args["trainer"]
    # worker 0 hosts every trainer rank, workers 1..2 the generator ranks: every byte crosses gloo
    owner_of = lambda g: 1 + g % (N_WORKERS - 1)  # noqa: E731
    create_generators(workers, args, "local", owner_of)
    try:
        trainer_ranks = [0] * tr.world_size
        generator_ranks = [owner_of(g) for g in range(gen.world_size)]
        workers.run([(w, "w_dist_setup", dict(args=args, trainer_ranks=trainer_ranks, generator_ranks=generator_ranks))
                     for w in range(N_WORKERS)])
        for version in (1, 2):
            workers.run([(w, "w_dist_sync", dict(args=args, version=version)) for w in range(N_WORKERS)])
            problems = workers.run([(w, "w_verify", dict(args=args, version=version)) for w in range(1, N_WORKERS)])
            assert [p for ps in problems for p in ps] == []
    finally:
        leftovers = workers.run([(w, "w_close", {}) for w in range(N_WORKERS)])
    assert leftovers == [[]] * N_WORKERS


def test_a_receive_that_fails_after_its_claim_gives_it_up_and_the_next_version_arrives(workers):
    from llamarl.weight_sync import GeneratorLayout, ParamSpec, TrainerLayout

    args = dict(specs=[ParamSpec("model.layers.0.mlp.up_proj.weight", (6, 4), torch.float32, 0),
                       ParamSpec("model.norm.weight", (4,), torch.float32, None)],
                trainer=TrainerLayout(1), generator=GeneratorLayout(), slots=2, seed=5)
    create_generators(workers, args, "local", owner_of=lambda g: 1)
    try:
        workers.run([(w, "w_dist_setup", dict(args=args, trainer_ranks=[0], generator_ranks=[1])) for w in (0, 1)])
        workers.run([(w, "w_dist_sync", dict(args=args, version=1)) for w in (0, 1)])
        sender, inbox = workers.run([(0, "w_dist_sync", dict(args=args, version=2)),
                                     (1, "w_dist_sync_failing_copy", dict(args=args, version=2))])
        assert inbox == [-1]  # the failed write's claim was given up, not left for the next version to hit
        workers.run([(w, "w_dist_sync", dict(args=args, version=3)) for w in (0, 1)])
        assert workers.run([(1, "w_verify", dict(args=args, version=3))]) == [[]]
    finally:
        leftovers = workers.run([(w, "w_close", {}) for w in range(N_WORKERS)])
    assert leftovers == [[]] * N_WORKERS


def test_a_rank_whose_wait_for_the_claim_timed_out_gives_the_half_written_version_up_at_its_next_sync(workers):
    """Two trainer ranks (in workers 0 and 1), one slot held by a reader: rank 1 times out waiting for rank 0's
    claim of version 2; once the reader lets go, rank 0 claims it and writes its half (never published). Rank 1's
    next sync must give version 2 up, or no version could ever be claimed again."""
    from llamarl.weight_sync import GeneratorLayout, ParamSpec, TrainerLayout

    args = dict(specs=[ParamSpec("model.layers.0.mlp.up_proj.weight", (6, 4), torch.float32, 0)],
                trainer=TrainerLayout(2), generator=GeneratorLayout(), slots=1, seed=9)
    handles = create_generators(workers, args, "shm", owner_of=lambda g: 2)
    try:
        workers.run([(w, "w_senders", dict(args=args, ranks=[w], handles=[handles[0]], timeout=2)) for w in (0, 1)])
        workers.run([(w, "w_sync", dict(args=args, version=1)) for w in (0, 1)])
        assert workers.run([(2, "w_hold", dict(hold=True))]) == [1]
        workers.run([(1, "w_sync_expecting_timeout", dict(args=args, version=2))])
        workers.run([(2, "w_hold", dict(hold=False))])
        workers.run([(0, "w_sync", dict(args=args, version=2))])  # rank 0's half; rank 1 has given up
        workers.run([(w, "w_sync", dict(args=args, version=3)) for w in (0, 1)])
        assert workers.run([(2, "w_verify", dict(args=args, version=3))]) == [[]]
    finally:
        leftovers = workers.run([(w, "w_close", {}) for w in range(N_WORKERS)])
    assert leftovers == [[]] * N_WORKERS


@pytest.mark.gpu
@pytest.mark.parametrize("quant,engine", [(None, "memcpy"), ("int8", "memcpy"), (None, "kernel"), ("int8", "kernel")])
def test_cuda_ipc_sync_into_another_process_is_byte_exact(workers, quant, engine):
    from llamarl.weight_sync import GeneratorLayout, ParamSpec, TrainerLayout, WeightSender

    specs = [ParamSpec("model.embed_tokens.weight", (1000, 96), torch.bfloat16, 0),
             ParamSpec("model.layers.0.mlp.down_proj.weight", (96, 257), torch.bfloat16, 1),
             ParamSpec("model.layers.0.mlp.up_proj.weight", (257, 96), torch.bfloat16, 0),
             ParamSpec("model.norm.weight", (96,), torch.float32, None)]
    args = dict(specs=specs, trainer=TrainerLayout(2), generator=GeneratorLayout(tp_size=2, quant=quant), slots=2,
                seed=5)
    handles = create_generators(workers, args, "cuda", owner_of=lambda g: 1 + g)
    try:
        plan = _plan(args)
        senders = [WeightSender(plan, t, [handles[0], handles[1]], device="cuda:0", cuda_engine=engine)
                   for t in range(2)]
        for version in (1, 2, 3):
            full = full_weights(specs, args["seed"], version)
            for t, s in enumerate(senders):
                s.sync({sp.name: plan.trainer.shard(full[sp.name], sp, t).cuda() for sp in specs}, version)
            problems = workers.run([(w, "w_verify", dict(args=args, version=version)) for w in (1, 2)])
            assert [p for ps in problems for p in ps] == []
        for s in senders:
            s.close()
    finally:
        workers.run([(w, "w_close", {}) for w in range(N_WORKERS)])


def test_a_trainer_dying_mid_sync_is_a_clear_error_on_the_generator(workers):
    """Runs last: it kills worker 0, the process group is gone afterwards."""
    from llamarl.weight_sync import GeneratorLayout, ParamSpec, TrainerLayout

    args = dict(specs=[ParamSpec("model.norm.weight", (64,), torch.float32)], trainer=TrainerLayout(1),
                generator=GeneratorLayout(), slots=2, seed=0)
    create_generators(workers, args, "local", owner_of=lambda g: 1)
    workers.run([(w, "w_dist_setup", dict(args=args, trainer_ranks=[0], generator_ranks=[1])) for w in (0, 1)])
    workers.conns[1].send(("w_receive_expecting_failure", dict(args=args)))
    workers.procs[0].kill()  # the trainer dies before it sends anything
    workers.procs[0].join(10)
    assert workers.conns[1].poll(60), "the generator hung on a dead trainer"
    ok, msg = workers.conns[1].recv()
    assert ok, msg
    assert "trainer rank 0 (global rank 0)" in msg and "peer process probably died" in msg, msg
