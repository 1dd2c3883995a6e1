"""Generation engine: greedy equals transformers' generate, log-probs equal an fp32 recomputation, the
sampler draws from the right distribution, stops/lengths/n/seed/policy versions behave, bad input raises."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llamarl.generation import GenerationEngine, SamplingParams, generate, sample_tokens  # noqa: E402
from llamarl.models import LLAMA_CONFIGS, Llama  # noqa: E402

VOCAB = 89
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24], [30]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, our model loaded from its save_pretrained directory)."""
    torch.manual_seed(7)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=48, rope_theta=1000.0, initializer_range=0.25,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("gen_model")
    hf.save_pretrained(path)
    return hf, Llama.from_pretrained(path)


def truncated_probs(p, top_k, top_p, min_p=0.0):
    """Probabilities p [..., V] cut to those at least min_p times the largest, then to the top_k largest, then to
    the smallest most-likely prefix whose mass reaches top_p, renormalised (vLLM's order; float64, written
    independently of llamarl.generation.sampling)."""
    if min_p:
        p = torch.where(p >= min_p * p.max(dim=-1, keepdim=True).values, p, 0.0)
    if top_k:
        p = torch.where(p >= p.topk(top_k, dim=-1).values[..., -1:], p, 0.0)
    if top_p < 1.0:
        srt, order = p.sort(dim=-1, descending=True)
        keep = (srt.cumsum(-1) - srt) < top_p * srt.sum(-1, keepdim=True)
        p = torch.zeros_like(p).scatter(-1, order, srt * keep)
    return p / p.sum(-1, keepdim=True)


def recompute_logprobs(model, prompt, tokens, params):
    """float64 log-probs of ``tokens`` after ``prompt`` under the distribution ``params`` says they come from."""
    seq = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(seq)[0, len(prompt) - 1 : -1].double()
    t = params.temperature if params.temperature > 0 else 1.0
    p = torch.softmax(logits / t, dim=-1)
    if params.temperature > 0 and params.logprobs_mode == "processed":
        p = truncated_probs(p, params.top_k, params.top_p, params.min_p)
    return p.log().gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_greedy_matches_transformers_generate(models):
    hf, model = models
    outs = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0), eos_token_id=())
    assert [o.prompt_index for o in outs] == [0, 1, 2, 3]
    for p, o in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o.token_ids == ref[0, len(p) :].tolist()
        assert o.finish_reason == "length" and o.prompt_token_ids == p
    # with an EOS that the greedy continuation hits, both stop right after it (EOS included)
    eos = outs[0].token_ids[4]
    stopped = generate(model, PROMPTS[:1], SamplingParams(max_new_tokens=12, temperature=0.0), eos_token_id=eos)[0]
    ref = hf.generate(torch.tensor(PROMPTS[:1]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert stopped.token_ids == ref[0, len(PROMPTS[0]) :].tolist() == outs[0].token_ids[: outs[0].token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10, temperature=0.0),
        SamplingParams(max_new_tokens=10, temperature=0.7, n=2, seed=3),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_k=5, seed=4),
        SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.8, seed=5),
        SamplingParams(max_new_tokens=10, temperature=1.3, top_k=5, seed=4, logprobs_mode="raw"),
        SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.8, seed=5, logprobs_mode="raw"),
        SamplingParams(max_new_tokens=10, temperature=1.0, min_p=0.1, seed=6),
        SamplingParams(max_new_tokens=10, temperature=1.2, min_p=0.05, top_k=8, top_p=0.9, seed=7),
    ],
)
def test_logprobs_equal_fp32_recomputation(models, params):
    _, model = models
    outs = generate(model, PROMPTS, params, eos_token_id=())
    assert len(outs) == len(PROMPTS) * params.n
    worst = 0.0
    for o in outs:
        assert len(o.logprobs) == len(o.token_ids) == len(o.policy_versions) == 10
        ref = recompute_logprobs(model, o.prompt_token_ids, o.token_ids, params)
        worst = max(worst, (ref - torch.tensor(o.logprobs, dtype=torch.float64)).abs().max().item())
    print(f"max |logprob - fp32 recompute| = {worst:.2e}")
    assert worst < 5e-5


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=10, temperature=0.7, n=2, seed=3),
                                    SamplingParams(max_new_tokens=10, temperature=0.0)])
def test_the_torch_samplers_logprobs_equal_fp32_recomputation(models, params, monkeypatch):
    """The torch sampling path (what CUDA runs; the CPU takes the native sampler when there is no top-k/top-p)
    reports log_softmax(z / T)[y] too."""
    import llamarl.generation.sampling as sampling

    monkeypatch.setattr(sampling, "NATIVE_CPU", False)
    _, model = models
    outs = generate(model, PROMPTS, params, eos_token_id=())
    worst = max((recompute_logprobs(model, o.prompt_token_ids, o.token_ids, params)
                 - torch.tensor(o.logprobs, dtype=torch.float64)).abs().max().item() for o in outs)
    assert worst < 5e-5


def test_inverse_cdf_sampler_matches_the_distribution_and_skips_zeros():
    from llamarl.generation.sampling import sample_inverse_cdf

    p = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0])  # zeros first, inside and last
    rows = 200_000
    g = torch.Generator().manual_seed(7)
    y = sample_inverse_cdf((p * 3).expand(rows, 7), g)  # unnormalised rows are fine
    freq = torch.bincount(y, minlength=7).double() / rows
    assert (freq[p == 0] == 0).all()
    assert (freq - p.double()).abs().max().item() < 0.005  # binomial std <= 0.0011
    one_hot = torch.zeros(3, 5)
    one_hot[0, 0], one_hot[1, 4], one_hot[2, 2] = 1.0, 2.0, 1e-30
    assert sample_inverse_cdf(one_hot, g).tolist() == [0, 4, 2]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(sample_inverse_cdf(p.expand(50, 7), g1), sample_inverse_cdf(p.expand(50, 7), g2))


def test_sampler_draws_from_the_truncated_distribution():
    torch.manual_seed(0)
    z = torch.randn(8) * 1.5
    rows = 40000
    for params in (
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.2, top_k=3, seed=2),
        SamplingParams(temperature=1.0, top_p=0.6, seed=3),
        SamplingParams(temperature=1.0, min_p=0.2, seed=4),
        SamplingParams(temperature=1.1, min_p=0.1, top_k=5, top_p=0.8, seed=5),
    ):
        g = torch.Generator().manual_seed(params.seed)
        tokens, lps = sample_tokens(z.expand(rows, 8).clone(), params, g)
        scaled = z.double() / params.temperature
        p = truncated_probs(torch.softmax(scaled, -1), params.top_k, params.top_p, params.min_p)
        freq = torch.bincount(tokens, minlength=8).double() / rows
        assert (p == 0).any() == (params.top_k > 0 or params.top_p < 1 or params.min_p > 0)  # truncated as asked
        assert (freq[p == 0] == 0).all()  # never outside the min-p / top-k / top-p set
        assert 0.5 * (freq - p).abs().sum().item() < 0.015
        # the reported log-prob is the sampler's own (processed); "raw" is the untruncated temperature-scaled one
        torch.testing.assert_close(lps.double(), p.log()[tokens], rtol=0, atol=1e-5)
        raw = dataclasses.replace(params, logprobs_mode="raw")
        tokens_raw, lps_raw = sample_tokens(z.expand(rows, 8).clone(), raw, torch.Generator().manual_seed(params.seed))
        assert torch.equal(tokens_raw, tokens)
        torch.testing.assert_close(lps_raw.double(), torch.log_softmax(scaled, -1)[tokens], rtol=0, atol=1e-5)


def test_top_k_one_and_tiny_top_p_are_greedy(models):
    _, model = models
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0), eos_token_id=())
    for params in (SamplingParams(max_new_tokens=6, top_k=1, seed=0), SamplingParams(max_new_tokens=6, top_p=1e-6, seed=0)):
        outs = generate(model, PROMPTS, params, eos_token_id=())
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]


def test_n_samples_order_and_seed(models):
    _, model = models
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=11)
    a = generate(model, PROMPTS, params, eos_token_id=())
    assert [(o.prompt_index, o.sample_index) for o in a] == [(i, j) for i in range(4) for j in range(3)]
    assert all(o.prompt_token_ids == PROMPTS[o.prompt_index] for o in a)
    b = generate(model, PROMPTS, params, eos_token_id=())
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # same seed, same samples
    c = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=12), eos_token_id=())
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert len({tuple(o.token_ids) for o in a}) > 6  # samples of one prompt differ
    g = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0, n=2), eos_token_id=())
    assert all(g[2 * i].token_ids == g[2 * i + 1].token_ids for i in range(4))


def count_compactions(monkeypatch) -> list:
    from llamarl.generation.kv_cache import KVCache

    calls, orig = [], KVCache.compact
    monkeypatch.setattr(KVCache, "compact", lambda self, keep, upto=None: (calls.append(keep.numel()), orig(self, keep, upto))[1])
    return calls


def test_stops_and_compaction_match_single_prompt_runs(models, monkeypatch):
    """Rows that stop early are compacted away; every row must equal its own unbatched run."""
    _, model = models
    compactions = count_compactions(monkeypatch)
    base = SamplingParams(max_new_tokens=14, temperature=0.0)
    alone = [generate(model, [p], base, eos_token_id=())[0].token_ids for p in PROMPTS]
    stops = (alone[0][1], alone[2][3])  # two rows stop early, the others run to the length limit
    params = SamplingParams(max_new_tokens=14, temperature=0.0, stop_token_ids=stops)
    batched = generate(model, PROMPTS, params, eos_token_id=())
    for o, ref in zip(batched, alone):
        cut = next((j + 1 for j, t in enumerate(ref) if t in stops), len(ref))
        assert o.token_ids == ref[:cut]
        assert o.finish_reason == ("stop" if cut < len(ref) or ref[-1] in stops else "length")
        ref_lp = recompute_logprobs(model, o.prompt_token_ids, o.token_ids, params)
        assert (ref_lp - torch.tensor(o.logprobs, dtype=torch.float64)).abs().max().item() < 5e-5
    assert batched[0].finish_reason == "stop" and len(batched[0].token_ids) == 2
    assert compactions[0] == 2  # rows 0 and 2 stopped first: the batch shrank from 4 to 2 rows
    # the model config's EOS is used when eos_token_id is None
    cfg_eos = model.config.eos_token_id
    outs = generate(model, PROMPTS, SamplingParams(max_new_tokens=30, temperature=1.0, seed=0, n=4))
    for o in outs:
        assert (o.finish_reason == "stop") == (o.token_ids[-1] == cfg_eos)
        assert cfg_eos not in o.token_ids[:-1]


def test_a_row_with_one_pad_slot_equals_its_own_run(models):
    """Prompts one token apart: the shorter row has exactly one pad slot, which must stay masked."""
    _, model = models
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    prompts = [[5, 6, 7], [12, 13]]
    for o, p in zip(generate(model, prompts, params, eos_token_id=()), prompts):
        alone = generate(model, [p], params, eos_token_id=())[0]
        assert o.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, alone.logprobs)) < 1e-5


def test_an_eos_drawn_as_the_last_allowed_token_is_a_stop(models):
    """The EOS ended the completion, whatever the budget (vLLM, transformers): "stop", not "length", which
    rollouts.without_truncated would drop as cut."""
    _, model = models
    for p in PROMPTS:
        free = generate(model, [p], SamplingParams(max_new_tokens=4, temperature=0.0), eos_token_id=())[0].token_ids
        if free[-1] not in free[:-1]:  # an EOS first drawn at the fourth token
            out = generate(model, [p], SamplingParams(max_new_tokens=4, temperature=0.0), eos_token_id=free[-1])[0]
            assert out.token_ids == free and out.finish_reason == "stop"
            return
    pytest.fail("no prompt whose fourth greedy token is new")


def test_context_limit_and_policy_versions(models):
    _, model = models
    ctx = model.config.max_position_embeddings  # 48
    prompt = list(range(3, 3 + ctx - 4))
    o = generate(model, [prompt, [5]], SamplingParams(max_new_tokens=10, temperature=0.0), eos_token_id=())
    assert len(o[0].token_ids) == 4 and o[0].finish_reason == "length"  # clamped by the context
    assert len(o[1].token_ids) == 10
    # bump the version after every lm_head call: token t must carry version t
    handle = model.lm_head.register_forward_hook(lambda *_: setattr(model, "policy_version", model.policy_version + 1))
    try:
        model.policy_version = 0
        o = generate(model, PROMPTS, SamplingParams(max_new_tokens=7, temperature=1.0, seed=1), eos_token_id=())
    finally:
        handle.remove()
        model.policy_version = 0
    assert all(x.policy_versions == list(range(7)) for x in o)


def test_engine_reuse_and_chunking(models):
    _, model = models
    params = SamplingParams(max_new_tokens=9, temperature=0.0, n=2)
    ref = generate(model, PROMPTS + [[40, 41, 42]], params, eos_token_id=())
    engine = GenerationEngine(model, max_batch_size=4, max_seq_len=32)  # 2 prompts x 2 samples per batch
    for _ in range(2):  # the cache is reused across calls
        outs = engine.generate(PROMPTS + [[40, 41, 42]], params, eos_token_id=())
        assert [(o.prompt_index, o.sample_index, o.token_ids) for o in outs] == [
            (o.prompt_index, o.sample_index, o.token_ids) for o in ref
        ]
    model.train()
    engine.generate(PROMPTS[:1], params, eos_token_id=())
    assert model.training  # generate restores the train/eval mode
    model.eval()


def test_tiny_preset_bf16_generation():
    torch.manual_seed(0)
    model = Llama(LLAMA_CONFIGS["tiny"]).to(torch.bfloat16)
    outs = generate(model, [[1, 20, 30], [1, 40]], SamplingParams(max_new_tokens=5, temperature=1.0, n=2, seed=0))
    assert len(outs) == 4 and all(torch.isfinite(torch.tensor(o.logprobs)).all() for o in outs)
    assert all(1 <= len(o.token_ids) <= 5 for o in outs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(min_p="0.1"), "min_p must be a number"),
        (dict(logprobs_mode="processed_logprobs"), "logprobs_mode must be one of"),
        (dict(n=0), "n"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(stop_token_ids="12"), "stop_token_ids must be a sequence of token ids, got '12'"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be an int"),
        (dict(temperature=1e-50), r"temperature must be 0 \(greedy\) or a finite number >= 0.0001"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**64), r"seed must be None or an int in \[0, 2\*\*63\)"),
        (dict(n=2.0), "n must be an int"),
        (dict(top_k=True), "top_k must be an int"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_numbers_are_accepted_as_python_ones():
    np = pytest.importorskip("numpy")
    p = SamplingParams(max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_p=np.float32(0.75),
                       stop_token_ids=np.array([4, 7]), seed=np.int64(5), n=np.int32(2))
    assert (p.max_new_tokens, p.temperature, p.top_p, p.stop_token_ids, p.seed, p.n) == (3, 0.5, 0.75, (4, 7), 5, 2)
    assert all(type(v) in (int, float) for v in (p.max_new_tokens, p.temperature, p.top_p, p.seed, p.n))


def test_the_sampler_temperature_floor_is_the_configs():
    from llamarl import config
    from llamarl.generation import sampling

    assert config.MIN_TEMPERATURE == sampling.MIN_TEMPERATURE


def test_a_cache_too_small_for_the_batch_warns_once(models):
    _, model = models
    engine = GenerationEngine(model, max_batch_size=2, max_seq_len=24)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    alone, = engine.generate([[3, 4]], greedy, eos_token_id=())
    assert len(alone.token_ids) == 12
    with pytest.warns(UserWarning, match=r"KV cache \(24 slots\) cuts 2 completion\(s\) .* longest prompt has 20 "
                                         r"tokens to 4 tokens"):
        short, long = engine.generate([[3, 4], list(range(3, 23))], greedy, eos_token_id=())
    assert [len(short.token_ids), len(long.token_ids)] == [4, 4] and short.finish_reason == "length"
    assert short.token_ids == alone.token_ids[:4]
    # an eos given as a numpy integer stops like an int
    first = alone.token_ids[0]
    np = pytest.importorskip("numpy")
    stopped, = engine.generate([[3, 4]], greedy, eos_token_id=np.int64(first))
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"


def test_bad_prompts_raise(models):
    hf, model = models
    p = SamplingParams(max_new_tokens=4)
    with pytest.raises(TypeError, match="takes a llamarl.models.Llama, got LlamaForCausalLM; load"):
        generate(hf, [[3, 4]], p)  # before anything is done to its weights
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[3], []], p)
    with pytest.raises(ValueError, match="no prompts"):
        generate(model, [], p)
    with pytest.raises(ValueError, match="prompt 0 has 48 tokens but the model context"):
        generate(model, [list(range(3, 51))], p)
    with pytest.raises(ValueError, match=r"prompt 0 has token id\(s\) \[89\] outside"):
        generate(model, [[3, VOCAB]], p)
    with pytest.raises(ValueError, match="string"):
        generate(model, ["hello"], p)
    with pytest.raises(ValueError, match="prompt 0 must be a sequence of int token ids"):
        generate(model, [[3, 1.5]], p)  # not silently token 1
    with pytest.raises(ValueError, match="prompt 0 must be a sequence of int token ids"):
        generate(model, [[True, False]], p)
    with pytest.raises(ValueError, match="prompt 0 must hold integer token ids"):
        generate(model, [torch.tensor([3.0, 4.0])], p)
    with pytest.raises(ValueError, match="stop/eos"):
        generate(model, [[3]], SamplingParams(stop_token_ids=(VOCAB,)))
    with pytest.raises(ValueError, match="pad_token_id must be an int, got None"):
        generate(model, [[3]], p, pad_token_id=None)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)  # a 0-d tensor is one eos id, like an int
    one = generate(model, [[3]], greedy, eos_token_id=2)
    assert generate(model, [[3]], greedy, eos_token_id=torch.tensor(2)) == one
    engine = GenerationEngine(model, max_batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match="n=3 samples per prompt exceed the engine's max_batch_size=2"):
        engine.generate([[3]], SamplingParams(n=3))
    with pytest.raises(ValueError, match="engine max_seq_len is 16"):
        engine.generate([list(range(3, 20))], p)
    with pytest.raises(ValueError, match="quantization"):
        GenerationEngine(model, quantization="int4")
    with pytest.raises(ValueError, match="quantization backend must be one of"):
        GenerationEngine(copy.deepcopy(model), quantization="int8", quantization_backend="cuda")
    # a huge budget is capped by the context: the one-shot engine does not size its cache by it
    out, = generate(model, [[3, 4]], SamplingParams(max_new_tokens=10**9, temperature=0.0), eos_token_id=())
    assert len(out.token_ids) == model.config.max_position_embeddings - 2 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        GenerationEngine(model, cuda_graphs=True)  # the model is on the CPU
    with pytest.raises(ValueError, match="graph_steps=8 replays several decode steps as one CUDA graph"):
        GenerationEngine(model, graph_steps=8)
    with pytest.raises(ValueError, match="graph_steps must be an int >= 1"):
        GenerationEngine(model, graph_steps=0)


def test_static_decode_step_matches_eager(models, monkeypatch):
    """The CUDA-graph decode step without the capture (static buffers, batch buckets, whole-cache masked
    attention, tensor input_pos), run eagerly on the CPU, gives the eager engine's tokens and log-probs."""
    from llamarl.generation.cuda_graphs import CUDAGraphDecoder

    _, model = models
    prompts = PROMPTS * 3  # 12 rows -> bucket 16; compaction moves to smaller buckets
    eager = GenerationEngine(model, max_batch_size=16, max_seq_len=40)
    static = GenerationEngine(model, max_batch_size=16, max_seq_len=40)
    static.graphs = CUDAGraphDecoder(model, static.cache, 16, capture=False)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    ref = eager.generate(prompts, greedy, eos_token_id=())
    # stop prompts 0 and 2 early (6 of 12 rows): compaction to 6 rows, i.e. from bucket 16 to bucket 8
    others = set(ref[1].token_ids + ref[3].token_ids)
    stops = tuple(next(t for t in ref[i].token_ids[:8] if t not in others) for i in (0, 2))
    buckets, orig_step = [], static.graphs._step
    monkeypatch.setattr(static.graphs, "_step", lambda b: (buckets.append(b), orig_step(b))[1])
    compactions = count_compactions(monkeypatch)
    for params in (greedy, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stops),
                   SamplingParams(max_new_tokens=20, temperature=1.0, n=2, seed=5)):
        x = eager.generate(prompts, params, eos_token_id=())
        y = static.generate(prompts, params, eos_token_id=())
        assert [o.token_ids for o in x] == [o.token_ids for o in y]
        assert max(abs(u - v) for ox, oy in zip(x, y) for u, v in zip(ox.logprobs, oy.logprobs)) < 1e-4
    assert 6 in compactions and {16, 8} <= set(buckets)


def test_greedy_graph_chunks_match_single_steps(models, monkeypatch):
    """``graph_steps=4``: greedy steps four at a time through ``decode_greedy`` (run without the capture,
    on the CPU) give the eager engine's tokens and log-probs, with stops, compaction to a smaller bucket
    and the single steps after the last whole chunk; a policy version that moves between replays tags
    the tokens as the step-by-step rule says (a token carries the version that computed its logits)."""
    from llamarl.generation.cuda_graphs import CUDAGraphDecoder

    _, model = models
    prompts = PROMPTS * 3
    eager = GenerationEngine(model, max_batch_size=16, max_seq_len=40)
    chunked = GenerationEngine(model, max_batch_size=16, max_seq_len=40)
    chunked.graphs = CUDAGraphDecoder(model, chunked.cache, 16, capture=False)
    chunked.graph_steps = 4
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    ref = eager.generate(prompts, greedy, eos_token_id=())
    others = set(ref[1].token_ids + ref[3].token_ids)
    stops = tuple(next(t for t in ref[i].token_ids[:8] if t not in others) for i in (0, 2))
    chunks, orig = [], chunked.graphs.decode_greedy
    monkeypatch.setattr(chunked.graphs, "decode_greedy",
                        lambda logits, slot, k: (chunks.append((logits.shape[0], slot, k)), orig(logits, slot, k))[1])
    compactions = count_compactions(monkeypatch)
    for params in (greedy, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stops)):
        x = eager.generate(prompts, params, eos_token_id=())
        y = chunked.generate(prompts, params, eos_token_id=())
        assert [o.token_ids for o in x] == [o.token_ids for o in y]
        assert [o.finish_reason for o in x] == [o.finish_reason for o in y]
        assert max(abs(u - v) for ox, oy in zip(x, y) for u, v in zip(ox.logprobs, oy.logprobs)) < 1e-5
    assert {k for _, _, k in chunks} == {4} and 6 in compactions and {r for r, _, _ in chunks} >= {12, 6}

    # versions: bump the policy version after every replay
    def bumping(logits, slot, k):
        out = orig(logits, slot, k)
        model.policy_version += 1
        return out

    monkeypatch.setattr(chunked.graphs, "decode_greedy", bumping)
    model.policy_version = 0
    try:
        out = chunked.generate([PROMPTS[0]], greedy, eos_token_id=())[0]
    finally:
        model.policy_version = 0
    # chunks at steps 0, 4, 8, 12 (4 replays), then single steps 16..19
    assert out.policy_versions == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4]


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(models):
    """GPU only: the CUDA-graph decode path gives the eager path's tokens and log-probs."""
    _, cpu_model = models
    model = Llama(cpu_model.config).cuda().eval()
    model.load_state_dict(cpu_model.state_dict())
    prompts = PROMPTS * 3  # 12 rows -> buckets 16, then 8/4/... after compaction
    eager = GenerationEngine(model, max_batch_size=16, max_seq_len=40, cuda_graphs=False)
    graphs = GenerationEngine(model, max_batch_size=16, max_seq_len=40, cuda_graphs=True)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    a = eager.generate(prompts, greedy, eos_token_id=())
    others = set(a[1].token_ids + a[3].token_ids)  # prompts 0 and 2 stop early: compaction 16 -> 8 bucket
    stops = tuple(next(t for t in a[i].token_ids[:8] if t not in others) for i in (0, 2))
    for params in (greedy, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stops),
                   SamplingParams(max_new_tokens=20, temperature=1.0, n=2, seed=5)):
        x = eager.generate(prompts, params, eos_token_id=())
        y = graphs.generate(prompts, params, eos_token_id=())
        assert [o.token_ids for o in x] == [o.token_ids for o in y]
        for ox, oy in zip(x, y):
            assert max(abs(u - v) for u, v in zip(ox.logprobs, oy.logprobs)) < 1e-4
    assert {16, 8} <= {b for b, _ in graphs.graphs._graphs}  # graphs were captured for both buckets
    # and the CUDA result agrees with the CPU reference
    c = generate(cpu_model, prompts, greedy, eos_token_id=())
    assert [o.token_ids for o in c] == [o.token_ids for o in graphs.generate(prompts, greedy, eos_token_id=())]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_greedy_chunks_match_eager(models, dtype):
    """GPU only: ``graph_steps=4`` (four greedy steps captured in one graph) gives the eager engine's
    tokens and log-probs, with stops and compaction to a smaller bucket. In bf16 this is the path the
    H200 benchmark runs: fused Triton RMSNorm / rope_kv / SiLU kernels, packed weights, stacked products."""
    _, cpu_model = models
    model = Llama(cpu_model.config).cuda().eval()
    model.load_state_dict(cpu_model.state_dict())
    model.to(dtype)
    prompts = PROMPTS * 3
    eager = GenerationEngine(model, max_batch_size=16, max_seq_len=40, cuda_graphs=False)
    chunked = GenerationEngine(model, max_batch_size=16, max_seq_len=40, graph_steps=4)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    a = eager.generate(prompts, greedy, eos_token_id=())
    others = set(a[1].token_ids + a[3].token_ids)
    stops = tuple(next(t for t in a[i].token_ids[:8] if t not in others) for i in (0, 2))
    for params in (greedy, SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stops)):
        x = eager.generate(prompts, params, eos_token_id=())
        y = chunked.generate(prompts, params, eos_token_id=())
        assert [o.token_ids for o in x] == [o.token_ids for o in y]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert max(abs(u - v) for ox, oy in zip(x, y) for u, v in zip(ox.logprobs, oy.logprobs)) < tol
    assert any(key[0] == "greedy" for key in chunked.graphs._graphs)


@pytest.mark.gpu
def test_cuda_graphs_follow_weights_repointed_to_other_storage(models):
    """The weight sync re-points parameters at another slot's storage (``load_views``, which sets
    ``model.weights_key``): the graphs must then read the new storage, not the slot they were captured on."""
    from llamarl.weight_sync.buckets import load_views

    _, cpu_model = models
    model = Llama(cpu_model.config).cuda().eval()
    model.load_state_dict(cpu_model.state_dict())
    engine = GenerationEngine(model, max_batch_size=4, max_seq_len=40, cuda_graphs=True)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = [o.token_ids for o in engine.generate(PROMPTS, greedy, eos_token_id=())]
    g = torch.Generator(device="cuda").manual_seed(3)
    slot_b = {n: p.detach() + 0.5 * torch.randn(p.shape, generator=g, device="cuda", dtype=p.dtype)
              for n, p in model.named_parameters()}
    load_views(model, slot_b, strict=True, where="test slot b")  # what WeightReceiver does on a slot change
    after = [o.token_ids for o in engine.generate(PROMPTS, greedy, eos_token_id=())]
    # pack_weights=False: packing slot b here would switch the products to stacked ones, other kernels
    eager = GenerationEngine(model, max_batch_size=4, max_seq_len=40, cuda_graphs=False, pack_weights=False)
    assert after == [o.token_ids for o in eager.generate(PROMPTS, greedy, eos_token_id=())]
    assert after != before  # the new weights really changed the samples
