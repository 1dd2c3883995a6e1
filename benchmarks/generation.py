"""Generation throughput: llamarl's engine vs transformers' ``generate`` on the same model and batch.

Both run greedy decoding of exactly ``new_tokens`` tokens (no EOS) from the same random prompts on the
same random-weight model, in one process; the table gives tokens/s (batch * new_tokens / median wall
time of one full generate call, prefill included), the ratio ours / transformers, the effective weight
bandwidth of our decode (parameter bytes * new_tokens / time: the memory-bound ceiling at small batch)
and how many generated tokens agree between the two implementations.

    python -m benchmarks.generation --quick           # CPU, "small" (~22M) fp32 model, < 1 minute
    python -m benchmarks.generation --quick --config base   # CPU, the ~100M model, about 1 minute
    python -m benchmarks.generation                   # GPU: Llama-3.2-1B-shaped bf16, batch 1/16/64,
                                                      #      prompt 64, 128 new tokens
On the CPU our engine's decode products run in the native kernel of llamarl.models.linear
(``LLAMARL_CPU_LINEAR=0`` measures it with torch's instead). On CUDA our engine is measured with CUDA graphs (the default) and, at the first batch size, also eagerly
(for reference); `--profile` adds the kernel count and top kernels of batch-1 decode steps.

A last row, "rl", is the generator's real workload: max(1, B/8) prompts x n=8 samples, temperature 1
(no top-k/top-p), stopping at EOS, with B the largest batch. Our engine prefills each prompt once and
compacts finished rows; transformers uses num_return_sequences. tok/s counts the tokens each actually
generated (up to and including EOS); with random weights EOS is rare, so this mainly shows prefill
sharing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import Measurement, Report, measure, positive_int, quantile
from llamarl.generation import GenerationEngine, SamplingParams
from llamarl.models import LLAMA_CONFIGS, Llama
from llamarl.models.packing import cpu_buffer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small CPU run (< 1 minute)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    ap.add_argument("--config", default=None, help="preset name from LLAMA_CONFIGS")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    ap.add_argument("--batch", default=None, help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=positive_int, default=None)
    ap.add_argument("--new-tokens", type=positive_int, default=None)
    ap.add_argument("--iters", type=positive_int, default=None)
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch intra-op threads on CPU (default 1 with --quick: stable numbers on a shared CPU)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--profile", action="store_true", help="CUDA: note the top kernels of batch-1 decode steps")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    full = not args.quick
    defaults = dict(
        config="llama-3.2-1b" if full else "small",
        dtype="bf16" if full else "fp32",
        batch="1,16,64" if full else "1,8",
        prompt_len=64 if full else 32,
        new_tokens=128 if full else 32,
        iters=3,
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.device = device
    if args.threads is None and args.quick and device == "cpu":
        args.threads = 1
    args.batches = [int(b) for b in args.batch.split(",")]
    return args


def build_models(args):
    cfg = LLAMA_CONFIGS[args.config]
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    torch.manual_seed(0)
    with device:
        ours = Llama(cfg)
    ours = ours.to(dtype).eval()
    hf = None
    if not args.no_transformers:
        import transformers

        hf_cfg = transformers.LlamaConfig(
            **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
        )
        with device:
            hf = transformers.LlamaForCausalLM(hf_cfg)
        hf = hf.to(dtype).eval()
        missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
        if missing or unexpected:
            raise RuntimeError(f"weights do not map onto transformers' Llama: missing={missing} unexpected={unexpected}")
    return cfg, ours, hf


def interleaved(fns: dict, iters: int, device: torch.device) -> dict:
    """Time each callable ``iters`` times, alternating between them, so that all see the same machine
    load (shared CPUs drift by tens of percent within a run); returns a Measurement per name."""
    single: dict[str, list[Measurement]] = {k: [] for k in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            single[name].append(measure(fn, warmup=0, iters=1, device=device))
    out = {}
    for name, ms in single.items():
        times = sorted(m.median_s for m in ms)
        out[name] = Measurement(
            median_s=statistics.median(times),
            p20_s=quantile(times, 0.2),
            p80_s=quantile(times, 0.8),
            peak_mem_bytes=max(m.peak_mem_bytes for m in ms),
            iters=len(ms),
        )
    return out


def hf_generate(hf, inp: torch.Tensor, **kw) -> torch.Tensor:
    with torch.inference_mode():
        return hf.generate(input_ids=inp, attention_mask=torch.ones_like(inp), pad_token_id=0, **kw)


def fixed_length_row(args, cfg, ours, hf, device, B: int, param_bytes: int, eager: bool) -> dict:
    """Greedy, exactly new_tokens tokens per row, no EOS: the same work for both implementations
    (``eager``: also time our engine without CUDA graphs, for reference)."""
    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(3, cfg.vocab_size, (B, args.prompt_len), generator=g)
    prompt_lists = prompts.tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    fns, first, resident, engines = {}, {}, {}, {}
    if device.type == "cuda":  # cuBLAS's workspace is the process's, not the first engine's: allocate it first
        torch.ones(8, 8, device=device, dtype=torch.bfloat16) @ torch.ones(8, 8, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize(device)
    variants = [("ours", dict())]
    if eager and device.type == "cuda":  # the eager decode, and 8 greedy steps per graph replay (opt-in)
        variants += [("ours_eager", dict(cuda_graphs=False)), ("ours_graph8", dict(graph_steps=8))]
    for name, kw in variants:
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        engine = GenerationEngine(ours, max_batch_size=B, max_seq_len=args.prompt_len + args.new_tokens, **kw)
        engines[name] = engine
        fns[name] = lambda e=engine: e.generate(prompt_lists, params, eos_token_id=())
        try:
            first[name] = torch.tensor([o.token_ids for o in fns[name]()])  # warm-up, CUDA-graph capture
            # what the engine holds between calls (its preallocated KV cache, graph pools): transformers
            # allocates its cache inside generate(), so its per-call peak already includes it
            resident[name] = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else 0
        except Exception as e:  # an opt-in variant that fails is reported in the row, the others still run
            if name == "ours":
                raise
            fns.pop(name)
            first[name + "_error"] = f"{type(e).__name__}: {e}"[:200]
    if hf is not None:
        inp = prompts.to(device)
        n = args.new_tokens
        fns["hf"] = lambda: hf_generate(hf, inp, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        first["hf"] = fns["hf"]()[:, args.prompt_len :].cpu()  # warm-up
    m = interleaved(fns, args.iters, device)
    row = dict(batch=B, prompt=args.prompt_len, new=args.new_tokens)
    for name in fns:
        row[f"{name}_tok_s"] = B * args.new_tokens / m[name].median_s
    row["ours_p20_p80_s"] = f"{m['ours'].p20_s:.3f}-{m['ours'].p80_s:.3f}"
    row["ours_weight_GB_s"] = param_bytes * args.new_tokens / m["ours"].median_s / 1e9
    row["ours_peak_MiB"] = (resident["ours"] + m["ours"].peak_mem_bytes) / 2**20  # KV cache included
    row["ours_kv_cache_MiB"] = engines["ours"].cache.nbytes / 2**20
    if hf is not None:
        row["hf_peak_MiB"] = m["hf"].peak_mem_bytes / 2**20
        row["ratio_ours_vs_hf"] = row["ours_tok_s"] / row["hf_tok_s"]
        row["same_tokens"] = f"{(first['hf'] == first['ours']).float().mean().item():.1%}"
        row["same_first_token"] = f"{(first['hf'][:, 0] == first['ours'][:, 0]).float().mean().item():.1%}"
    if "ours_eager" in first:
        row["graph_vs_eager_same"] = f"{(first['ours_eager'] == first['ours']).float().mean().item():.1%}"
    if "ours_graph8" in first:
        row["graph8_vs_graph_same"] = f"{(first['ours_graph8'] == first['ours']).float().mean().item():.1%}"
    for name in [k for k in first if k.endswith("_error")]:
        row[name] = first[name]
    return row


def rl_row(args, cfg, ours, hf, device) -> dict:
    """n=8 samples per prompt, temperature 1, EOS stops: tok/s over the tokens each actually generated."""
    n = 8
    prompts_n = max(1, max(args.batches) // n)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, cfg.vocab_size, (prompts_n, args.prompt_len), generator=g)
    prompt_lists, inp = prompts.tolist(), prompts.to(device)
    eos = cfg.eos_token_ids[0]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, n=n, seed=0)
    engine = GenerationEngine(ours, max_batch_size=prompts_n * n, max_seq_len=args.prompt_len + args.new_tokens)
    counts: dict[str, list[int]] = {"ours": [], "hf": []}

    def run_ours():
        counts["ours"].append(sum(len(o.token_ids) for o in engine.generate(prompt_lists, params, eos_token_id=eos)))

    def run_hf():
        out = hf_generate(
            hf, inp, max_new_tokens=args.new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            num_return_sequences=n, eos_token_id=eos,
        )[:, args.prompt_len :].tolist()
        counts["hf"].append(sum(row.index(eos) + 1 if eos in row else len(row) for row in out))

    run_ours()  # warm-up (and CUDA-graph capture)
    run_hf()
    m = interleaved({"ours": run_ours, "hf": run_hf}, args.iters, device)
    tokens = {k: statistics.mean(v[1:]) for k, v in counts.items()}
    row = dict(
        batch=f"rl {prompts_n}x{n}", prompt=args.prompt_len, new=args.new_tokens,
        ours_tok_s=tokens["ours"] / m["ours"].median_s, hf_tok_s=tokens["hf"] / m["hf"].median_s,
    )
    row["ratio_ours_vs_hf"] = row["ours_tok_s"] / row["hf_tok_s"]
    return row


def profile_decode(args, cfg, ours, device, steps: int = 16, top: int = 12) -> str:
    """Where a batch-1 generate call (CUDA graphs) spends its time: wall time against the GPU's busy time
    (the sum of kernel times: the rest is the GPU waiting for the host), the CUDA runtime calls the host
    made (launches, copies, synchronisations: count and host time) and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine = GenerationEngine(ours, max_batch_size=1, max_seq_len=args.prompt_len + steps + 1)
    prompt = [list(range(3, 3 + args.prompt_len))]
    params = SamplingParams(max_new_tokens=steps, temperature=0.0)
    engine.generate(prompt, params, eos_token_id=())  # capture outside the profile
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompt, params, eos_token_id=())
        torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    launches = sum(e.count for e in kernels)
    runtime = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("cuda")),
                     key=lambda e: e.cpu_time_total, reverse=True)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    lines = [f"profile, batch 1, {steps} tokens (prefill included, under the profiler): wall {wall_ms:.2f} ms, "
             f"GPU busy {busy_ms:.2f} ms ({busy_ms / wall_ms:.0%}), {launches} kernel runs",
             "host CUDA calls (count, host ms): " + ", ".join(
                 f"{e.key} ({e.count}, {e.cpu_time_total / 1e3:.2f})" for e in runtime[:8]),
             "top kernels (count, ms): " + ", ".join(
                 f"{e.key[:70]} ({e.count}, {e.self_device_time_total / 1e3:.3f})" for e in kernels[:top])]
    return "; ".join(lines)


def cpu_read_ceiling_GBps(nbytes: int = 256 << 20, iters: int = 5, hugepages: bool = False) -> float:
    """The memory read bandwidth torch's threads get right now: median GB/s of torch.sum over nbytes of
    fp32 (the ceiling of a batch-1 decode, which streams every weight once; on a shared host it moves),
    from torch's own allocation (4 KiB pages) or, with ``hugepages``, from a buffer allocated the way the
    engine packs its weights (llamarl.models.packing: advised for 2 MiB pages)."""
    if hugepages:
        x = cpu_buffer(nbytes)[0].view(torch.float32)
        x.fill_(1.0)
    else:
        x = torch.ones(nbytes // 4)
    times = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


def _ceilings() -> tuple[float, float]:
    return cpu_read_ceiling_GBps(), cpu_read_ceiling_GBps(hugepages=True)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, ours, hf = build_models(args)
    device = torch.device(args.device)
    param_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    title = f"Generation throughput: llamarl engine vs transformers generate ({args.config}, {args.dtype}, {args.device})"
    report = Report("generation", title)
    report.note(
        f"model {args.config}: {ours.num_parameters() / 1e6:.1f}M parameters, {param_bytes / 2**30:.2f} GiB, random "
        f"weights; numeric rows: greedy, prompt {args.prompt_len}, {args.new_tokens} new tokens, no EOS; tok/s = "
        f"batch*new / median time of a whole generate call (prefill included), contenders timed alternately; "
        f"threads={torch.get_num_threads()}"
    )
    ceiling = [_ceilings()] if device.type == "cpu" else []
    rows = [report.add(**fixed_length_row(args, cfg, ours, hf, device, B, param_bytes, eager=B == args.batches[0]))
            for B in args.batches]
    if hf is not None:
        report.add(**rl_row(args, cfg, ours, hf, device))
    if ceiling:
        ceiling.append(_ceilings())
        small, huge = max(c[0] for c in ceiling), max(c[1] for c in ceiling)
        report.note(f"memory read ceiling, {torch.get_num_threads()} thread(s) (torch.sum of 256 MiB, before / after "
                    f"the rows): {ceiling[0][1]:.1f} / {ceiling[1][1]:.1f} GB/s on 2 MiB pages (where the engine "
                    f"packs its weights), {ceiling[0][0]:.1f} / {ceiling[1][0]:.1f} GB/s on torch's 4 KiB pages "
                    f"(where transformers' weights are); batch {rows[0]['batch']} decoded at "
                    f"{rows[0]['ours_weight_GB_s']:.1f} GB/s of weights, {rows[0]['ours_weight_GB_s'] / huge:.0%} of "
                    f"the higher 2 MiB figure (prefill included; {small:.1f} on 4 KiB pages). Batch-1 decode streams "
                    "every weight once per token, so on a shared host our tok/s follows this ceiling; transformers' "
                    "GEMV reads ~10 GB/s and moves less.")
    if args.profile and device.type == "cuda":
        report.note(profile_decode(args, cfg, ours, device))
    if device.type == "cpu":
        report.note("CPU peak memory: the resident set sampled every 0.5 ms during one untimed call, above its size before it.")
    report.note("same_tokens: share of generated tokens identical between the two (bf16 greedy may diverge after a near-tie).")
    report.save()


if __name__ == "__main__":
    main()
