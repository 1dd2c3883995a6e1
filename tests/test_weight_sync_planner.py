"""The DDMA planner: specs from Llama names, shard bounds, plan validation, byte-exact execution.

Execution here is in one process (plain tensors as buckets, the native indexed copy), so every random
layout is checked against slices of the full weights; tests/test_weight_sync_multiproc.py runs the same
plans across processes through the real transports.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llamarl import _native
from llamarl.weight_sync import GeneratorLayout, ParamSpec, SyncPlan, TrainerLayout, llama_param_specs, plan_sync
from llamarl.weight_sync.layout import balanced_bounds, chunk_bounds, llama_tp_split
from llamarl.weight_sync.quantize_on_sync import TrainerSources
from llamarl_kernels.reference import quantize_ref

LLAMA_NAMES = [
    ("model.embed_tokens.weight", 2), ("model.layers.0.self_attn.q_proj.weight", 2),
    ("model.layers.0.self_attn.k_proj.weight", 2), ("model.layers.0.self_attn.o_proj.weight", 2),
    ("model.layers.0.mlp.up_proj.weight", 2), ("model.layers.0.mlp.down_proj.weight", 2),
    ("model.layers.0.input_layernorm.weight", 1), ("model.norm.weight", 1), ("lm_head.weight", 2),
    ("model.layers.1.mlp.gate_proj.weight", 2), ("model.layers.1.self_attn.v_proj.weight", 2),
]


def random_full(specs, seed):
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(s.dtype) for s in specs}


def expected_tensor(plan, tensor, full, g):
    """Independent reference: slice the full (quantized) weight with plain indexing."""
    w = full[tensor.param]
    if tensor.kind != "param":
        q, scale = quantize_ref(w, plan.generator.quant)
        w = q if tensor.kind == "qweight" else scale
    r0, r1, c0, c1 = plan.generator.region(tensor, g)
    w2 = w.reshape(w.shape[0], -1)[r0:r1, c0:c1]
    return w2.contiguous()


def run_plan_in_process(plan, full, slots=1):
    """Execute every (t, g) schedule with the native engine into plain byte buckets."""
    gen = plan.generator
    buckets = [[torch.full((n * slots,), 0xAB, dtype=torch.uint8) for n in plan.buckets[g].slot_nbytes]
               for g in range(gen.world_size)]
    for t in range(plan.trainer.world_size):
        shards = {s.name: plan.trainer.shard(full[s.name], s, t) for s in plan.specs}
        sources = TrainerSources(plan, t, "cpu", "torch").assemble(shards)
        src = _native.BufferTable.of(sources)
        for g in range(gen.world_size):
            _native.copy_indexed(_native.BufferTable.of(buckets[g]), src, plan.ops(t, g), num_threads=2)
    return buckets


def views(plan, buckets, g):
    out = {}
    for p in plan.buckets[g].placements:
        raw = buckets[g][p.bucket][p.offset:p.offset + p.nbytes]
        out[p.name] = raw.view(p.dtype).view(p.shape)
    return out


@st.composite
def plans(draw):
    k = draw(st.integers(1, 5))
    chosen = draw(st.permutations(LLAMA_NAMES))[:k]
    specs = []
    for name, ndim in chosen:
        shape = (draw(st.integers(1, 13)),) + ((draw(st.integers(1, 11)),) if ndim == 2 else ())
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
        specs.append(ParamSpec(name, shape, dtype, llama_tp_split(name)))
    trainer = TrainerLayout(draw(st.integers(1, 4)), replicated=draw(st.booleans()))
    generator = GeneratorLayout(tp_size=draw(st.integers(1, 4)), replicas=draw(st.integers(1, 2)),
                                quant=draw(st.sampled_from([None, None, "int8", "fp8"])),
                                quantize_lm_head=draw(st.booleans()))
    return plan_sync(specs, trainer, generator)


@settings(max_examples=40, deadline=None)
@given(plan=plans(), seed=st.integers(0, 2**16))
def test_random_plans_reproduce_every_generator_shard_byte_for_byte(plan, seed):
    full = random_full(plan.specs, seed)
    buckets = run_plan_in_process(plan, full)
    for g in range(plan.generator.world_size):
        got = views(plan, buckets, g)
        for tensor in plan.tensors:
            exp = expected_tensor(plan, tensor, full, g)
            assert got[tensor.name].reshape(exp.shape).view(torch.uint8).equal(exp.view(torch.uint8)), \
                (tensor.name, g, plan.trainer, plan.generator)
    # each replica receives every byte exactly once; trainer ranks split the work
    per_replica = sum(p.nbytes for g in range(plan.generator.tp_size) for p in plan.buckets[g].placements)
    assert plan.bytes_moved() == per_replica * plan.generator.replicas


def test_specs_from_config_match_transformers_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    sd = model.state_dict()
    ours = llama_param_specs(cfg.to_dict())
    assert [(s.name, s.shape) for s in ours] == [(n, tuple(t.shape)) for n, t in sd.items()]
    from_sd = llama_param_specs(sd)
    assert [(s.name, s.shape, s.dtype, s.tp_split) for s in from_sd] == [(s.name, s.shape, s.dtype, s.tp_split)
                                                                         for s in ours]
    # a state dict has no head counts: with head_dim it gives the config's specs exactly, split units too
    assert llama_param_specs(sd, head_dim=8) == ours
    assert all(s.tp_unit == 1 for s in from_sd)
    units = {s.name: s.tp_unit for s in ours}
    assert units["model.layers.0.self_attn.q_proj.weight"] == units["model.layers.1.self_attn.o_proj.weight"] == 8
    assert units["model.layers.0.self_attn.k_proj.weight"] == units["model.layers.0.self_attn.v_proj.weight"] == 8
    assert units["model.layers.0.mlp.gate_proj.weight"] == units["model.layers.0.mlp.down_proj.weight"] == 1
    assert units["lm_head.weight"] == units["model.embed_tokens.weight"] == units["model.norm.weight"] == 1
    splits = {s.name: s.tp_split for s in ours}
    assert splits["model.layers.1.self_attn.o_proj.weight"] == 1
    assert splits["model.layers.1.mlp.down_proj.weight"] == 1
    assert splits["model.layers.0.self_attn.k_proj.weight"] == 0
    assert splits["lm_head.weight"] == 0 and splits["model.embed_tokens.weight"] == 0
    assert splits["model.norm.weight"] is None
    tied = llama_param_specs({**cfg.to_dict(), "tie_word_embeddings": True})
    assert "lm_head.weight" not in {s.name for s in tied}
    # a tied model's state_dict lists the shared embedding twice: one parameter, as from its config
    tied_cfg = transformers.LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": True})
    tied_model = transformers.LlamaForCausalLM(tied_cfg)
    tied_sd = tied_model.state_dict()
    assert "lm_head.weight" in tied_sd
    assert [(s.name, s.shape) for s in llama_param_specs(tied_sd)] == [(s.name, s.shape) for s in tied]
    meta = {n: torch.empty(t.shape, device="meta") for n, t in sd.items()}  # no memory: nothing is "tied"
    assert len(llama_param_specs(meta)) == len(sd)


def test_unknown_names_and_bad_specs_raise_clearly():
    with pytest.raises(ValueError, match="not a Hugging Face Llama parameter name"):
        llama_param_specs({"model.layers.0.attn.c_attn.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="lacks"):
        llama_param_specs({"hidden_size": 4})
    with pytest.raises(ValueError, match="row-parallel"):
        ParamSpec("x", (4,), torch.float32, 1)
    with pytest.raises(ValueError, match="positive"):
        ParamSpec("x", (0, 3), torch.float32, 0)
    with pytest.raises(ValueError, match="unique"):
        plan_sync([ParamSpec("model.norm.weight", (3,), torch.float32)] * 2, TrainerLayout(), GeneratorLayout())
    with pytest.raises(ValueError, match="quant"):
        GeneratorLayout(quant="int4")


@pytest.mark.parametrize("make, field", [(lambda v: TrainerLayout(v), "TrainerLayout.world_size"),
                                         (lambda v: GeneratorLayout(v), "GeneratorLayout.tp_size"),
                                         (lambda v: GeneratorLayout(1, v), "GeneratorLayout.replicas")])
@pytest.mark.parametrize("value", [True, 2.5, 1.0, "2", None, 0, -1])
def test_layout_sizes_must_be_plain_positive_ints(make, field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got {value!r}".replace(".", r"\.")):
        make(value)
    assert make(3) == make(3)  # a plain int is fine


# 8 attention heads, 4 key/value heads of 8; vocab 67 and intermediate 84 split unevenly over 3 or 8 ranks
GQA = dict(vocab_size=67, hidden_size=64, intermediate_size=84, num_hidden_layers=2, num_attention_heads=8,
           num_key_value_heads=4)


@pytest.mark.parametrize("tp, counts", [(3, "8 attention heads .* or the model's 4 key/value heads"),
                                        (8, "4 key/value heads"), (5, "8 attention heads")])
@pytest.mark.parametrize("quant", [None, "int8"])
def test_tp_that_splits_inside_a_head_is_refused_with_the_valid_sizes(tp, counts, quant):
    specs = llama_param_specs(GQA)
    with pytest.raises(ValueError, match=rf"GeneratorLayout\.tp_size={tp} does not divide the model's {counts}"
                                         r".*split a head.*use tp_size in \{1, 2, 4\}$"):
        plan_sync(specs, TrainerLayout(2), GeneratorLayout(tp_size=tp, replicas=2, quant=quant))
    with pytest.raises(ValueError, match="k_proj.weight and 3 more"):  # one line per head count, not per layer
        plan_sync(specs, TrainerLayout(1), GeneratorLayout(tp_size=8))
    with pytest.raises(ValueError, match="does not divide"):  # the plan class itself refuses too
        SyncPlan(specs, TrainerLayout(1), GeneratorLayout(tp_size=tp))
    sd = {s.name: torch.zeros(s.shape) for s in specs}  # a state dict, told its head_dim
    with pytest.raises(ValueError, match=f"tp_size={tp} does not divide"):
        plan_sync(llama_param_specs(sd, head_dim=8), TrainerLayout(1), GeneratorLayout(tp_size=tp))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_that_divides_the_heads_plans_on_head_boundaries_with_uneven_vocab_and_mlp(tp):
    specs = llama_param_specs(GQA)
    plan = plan_sync(specs, TrainerLayout(3), GeneratorLayout(tp_size=tp, quant="fp8"))
    for s in specs:
        for g in range(tp):
            r0, r1, c0, c1 = plan.generator.region(s, g)
            lo, hi = (r0, r1) if s.tp_split == 0 else (c0, c1)
            assert lo % s.tp_unit == 0 and hi % s.tp_unit == 0, (s.name, g)
            if s.tp_unit > 1:
                assert hi - lo == s.shape[s.tp_split] // tp, (s.name, g)  # whole heads, the same count per rank
    # the uneven splits stay allowed: 67 vocab rows and 84 intermediate rows over 8 or 3 ranks
    for tp_uneven in (3, 8):
        plain = [s for s in specs if s.tp_unit == 1]
        plan = plan_sync(plain, TrainerLayout(2), GeneratorLayout(tp_size=tp_uneven))
        full = random_full(plain, tp_uneven)
        buckets = run_plan_in_process(plan, full)
        for g in range(tp_uneven):
            got = views(plan, buckets, g)
            for tensor in plan.tensors:
                assert got[tensor.name].equal(plan.generator.shard(full[tensor.name], tensor, g)), (tensor.name, g)


@settings(max_examples=60, deadline=None)
@given(kv=st.integers(1, 6), group=st.integers(1, 4), head_dim=st.sampled_from([2, 4, 6]), tp=st.integers(1, 12))
def test_head_split_refusal_is_exactly_tp_not_dividing_both_head_counts(kv, group, head_dim, tp):
    heads = kv * group
    cfg = dict(vocab_size=11, hidden_size=heads * head_dim, intermediate_size=7, num_hidden_layers=1,
               num_attention_heads=heads, num_key_value_heads=kv)
    specs = llama_param_specs(cfg)
    layout = GeneratorLayout(tp_size=tp)
    if heads % tp == 0 and kv % tp == 0:
        plan_sync(specs, TrainerLayout(1), layout)
    else:
        with pytest.raises(ValueError, match=f"tp_size={tp} does not divide") as err:
            plan_sync(specs, TrainerLayout(1), layout)
        valid = [r for r in range(1, kv + 1) if kv % r == 0 and heads % r == 0]
        assert str(err.value).endswith("{" + ", ".join(map(str, valid)) + "}")


def test_bad_split_units_raise_clearly():
    with pytest.raises(ValueError, match=r"tp_unit=3 does not divide dim 0 .*\(8\).*check head_dim"):
        ParamSpec("model.layers.0.self_attn.q_proj.weight", (8, 4), torch.float32, 0, 3)
    with pytest.raises(ValueError, match=r"tp_unit=4 does not divide dim 1"):
        ParamSpec("model.layers.0.self_attn.o_proj.weight", (8, 6), torch.float32, 1, 4)
    with pytest.raises(ValueError, match="replicated .* takes tp_unit=1"):
        ParamSpec("model.norm.weight", (8,), torch.float32, None, 2)
    with pytest.raises(ValueError, match="tp_unit must be an int >= 1"):
        ParamSpec("model.layers.0.self_attn.q_proj.weight", (8, 4), torch.float32, 0, 0)
    with pytest.raises(ValueError, match=r"head_dim=4 contradicts the config's head_dim 8"):
        llama_param_specs(GQA, head_dim=4)
    with pytest.raises(ValueError, match="tp_unit=3 does not divide"):  # a state dict with the wrong head_dim
        llama_param_specs({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 4)}, head_dim=3)
    # a generic (non-Llama) unit is named by its size
    spec = ParamSpec("experts.w", (12, 4), torch.float32, 0, 4)
    with pytest.raises(ValueError, match=r"3 units of 4 \(experts\.w\).*use tp_size in \{1, 3\}"):
        plan_sync([spec], TrainerLayout(1), GeneratorLayout(tp_size=2))
    assert plan_sync([spec], TrainerLayout(1), GeneratorLayout(tp_size=3)).generator.local_shape(spec, 2) == (4, 4)


@pytest.mark.parametrize("n", [1, 2, 5, 7, 13, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shard_bounds_match_torch_chunk_and_array_split(n, world):
    x = torch.arange(n)
    chunks = torch.chunk(x, world)
    for r in range(world):
        a, b = chunk_bounds(n, world, r)
        ref = chunks[r] if r < len(chunks) else x[:0]
        assert x[a:b].tolist() == ref.tolist()
        a, b = balanced_bounds(n, world, r)
        assert x[a:b].tolist() == np.array_split(np.arange(n), world)[r].tolist()


def test_plans_are_cached_and_buckets_aligned_per_dtype():
    specs = llama_param_specs(dict(vocab_size=11, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                                   num_attention_heads=2), torch.bfloat16)
    a = plan_sync(specs, TrainerLayout(2), GeneratorLayout(tp_size=2, quant="fp8"))
    b = plan_sync(list(specs), TrainerLayout(2), GeneratorLayout(tp_size=2, quant="fp8"))
    assert a is b
    layout = a.buckets[0]
    assert layout.dtypes == (torch.bfloat16, torch.float8_e4m3fn, torch.float32)
    assert all(p.offset % 256 == 0 for p in layout.placements)
    assert all(n % 4096 == 0 for n in layout.slot_nbytes)
    names = {p.name: p for p in layout.placements}
    # row-parallel o_proj: the q half is column-split, its scales are replicated on every TP rank
    assert names["model.layers.0.self_attn.o_proj.weight"].shape == (8, 4)
    assert names["model.layers.0.self_attn.o_proj.weight_scale"].shape == (8,)
    assert names["model.layers.0.self_attn.q_proj.weight_scale"].shape == (4,)
    assert names["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings stay unquantized


def test_validation_rejects_double_writes_gaps_and_out_of_bounds():
    specs = [ParamSpec("model.layers.0.mlp.down_proj.weight", (5, 7), torch.float32, 1),
             ParamSpec("model.norm.weight", (5,), torch.float32, None)]
    plan = plan_sync(specs, TrainerLayout(2), GeneratorLayout(tp_size=2))
    plan.validate()
    original = plan._ops[(0, 0)].copy()
    try:
        plan._ops[(0, 0)] = np.concatenate([original, original[:1]])
        with pytest.raises(ValueError, match="more than once"):
            plan.validate()
        plan._ops[(0, 0)] = original[1:]
        with pytest.raises(ValueError, match="does not cover"):
            plan.validate()
        shifted = original.copy()
        shifted[0, 3] += 4096 * 4
        plan._ops[(0, 0)] = shifted
        with pytest.raises(ValueError, match="outside any tensor"):
            plan.validate()
        reading = original.copy()
        reading[0, 2] += 10_000
        plan._ops[(0, 0)] = reading
        with pytest.raises(ValueError, match="reads bytes"):
            plan.validate()
    finally:
        plan._ops[(0, 0)] = original
    plan.validate()


def test_quantize_on_sync_with_the_triton_kernel_matches_the_kernel_on_full_weights():
    from llamarl_kernels import quantize

    specs = [ParamSpec("model.layers.0.mlp.down_proj.weight", (6, 10), torch.float32, 1),
             ParamSpec("model.layers.0.mlp.up_proj.weight", (5, 8), torch.bfloat16, 0)]
    plan = plan_sync(specs, TrainerLayout(3), GeneratorLayout(tp_size=2, quant="int8"))
    full = random_full(specs, 3)
    gen = plan.generator
    buckets = [[torch.zeros(n, dtype=torch.uint8) for n in plan.buckets[g].slot_nbytes] for g in range(gen.world_size)]
    for t in range(3):
        shards = {s.name: plan.trainer.shard(full[s.name], s, t) for s in specs}
        src = _native.BufferTable.of(TrainerSources(plan, t, "cpu", "kernel").assemble(shards))
        for g in range(gen.world_size):
            _native.copy_indexed(_native.BufferTable.of(buckets[g]), src, plan.ops(t, g))
    for g in range(gen.world_size):
        got = views(plan, buckets, g)
        for tensor in plan.tensors:
            q, scale = quantize(full[tensor.param], "int8")
            w = q if tensor.kind == "qweight" else scale
            assert got[tensor.name].equal(gen.shard(w, tensor, g)), tensor.name
