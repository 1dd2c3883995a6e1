"""What int8 / fp8 generator weights cost in quality, and what they buy in decode speed, on a whole model.

    python -m benchmarks.quant_quality            # GPU: Llama-3.2-1B-shaped model, bf16
    python -m benchmarks.quant_quality --quick    # CPU: the 'tiny' model in fp32 (< 1 min)
    python -m benchmarks.quant_quality --model DIR   # a real local HF checkpoint instead of random init

Quality, on a fixed prompt set (seeded random token ids, or the checkpoint's own vocabulary): with p the
unquantized and q the quantized next-token distribution at every prompt position (teacher forcing),

    mean KL = mean_t sum_v p_t(v) (log p_t(v) - log q_t(v))      top-1 agreement = mean_t [argmax p_t = argmax q_t]

and greedy agreement: the quantized engine's greedy continuation compared token by token with the
unquantized one (fraction of positions equal, and the mean common-prefix fraction).

Speed: ``GenerationEngine(model, quantization=...)`` (CUDA graphs on GPU) generating ``new`` tokens
after a ``prompt``-token prompt at several batch sizes; tokens/s counts generated tokens over the whole
call (prefill included), ratio against the unquantized engine in the same run. On CPU the Triton
kernels are interpreted, so the "triton" rows only show that the path runs; the "eager" rows use the
explicit eager backend (llamarl.models.quantize backend='eager').
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.harness import Report, measure, positive_int  # noqa: E402
from llamarl.generation import GenerationEngine, SamplingParams  # noqa: E402
from llamarl.models import LLAMA_CONFIGS, Llama  # noqa: E402
from llamarl.models.quantize import quantize_model  # noqa: E402

MODES = ("int8", "fp8")


def load_model(args, device: torch.device, dtype: torch.dtype) -> Llama:
    if args.model:
        return Llama.from_pretrained(args.model, dtype=dtype, device=device).eval()
    if args.config not in LLAMA_CONFIGS:
        raise SystemExit(f"--config must be one of {sorted(LLAMA_CONFIGS)}, got {args.config!r}")
    torch.manual_seed(0)
    config = LLAMA_CONFIGS[args.config]
    if args.layers:
        config = config.replace(num_hidden_layers=args.layers)
    with torch.device(device):  # built and initialised where it runs: a 1B init on the CPU takes ~25 s
        model = Llama(config)
        model.reset_parameters(std=args.init_std)
    return model.to(dtype=dtype).eval()


def fixed_prompts(vocab: int, count: int, length: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (count, length), generator=g).to(device)


@torch.no_grad()
def teacher_forced(base: Llama, qmodel: Llama, ids: torch.Tensor, chunk: int) -> tuple[float, float, float]:
    """(mean KL(p || q), max KL, top-1 agreement) over every position of ``ids``."""
    kls, agree = [], []
    for i in range(0, ids.shape[0], chunk):
        lp = torch.log_softmax(base(ids[i : i + chunk]).float(), dim=-1)
        lq = torch.log_softmax(qmodel(ids[i : i + chunk]).float(), dim=-1)
        kls.append((lp.exp() * (lp - lq)).sum(-1).flatten())
        agree.append((lp.argmax(-1) == lq.argmax(-1)).flatten().float())
    kl = torch.cat(kls)
    return kl.mean().item(), kl.max().item(), torch.cat(agree).mean().item()


def greedy(model: Llama, prompts: list[list[int]], new: int, quantization: str) -> list[list[int]]:
    engine = GenerationEngine(model, max_batch_size=len(prompts), max_seq_len=len(prompts[0]) + new,
                              quantization=quantization)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0), eos_token_id=())
    return [o.token_ids for o in outs]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    prefix = []
    for ra, rb in zip(a, b):
        n = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra))
        prefix.append(n / len(ra))
    return same, sum(prefix) / len(prefix)


def decode_speed(base: Llama, variants: list[tuple[str, str]], batches: list[int], prompt: int, new: int,
                 device: torch.device, report: Report, iters: int) -> None:
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    prompts_all = fixed_prompts(base.config.vocab_size, max(batches), prompt, device).tolist()
    for batch in batches:
        prompts = prompts_all[:batch]
        base_tps = None
        for label, mode in variants:
            backend = "eager" if label.endswith("eager") else "triton"
            model = base if mode == "none" else copy.deepcopy(base)
            if backend == "eager":  # quantized up front with the explicit eager backend
                quantize_model(model, mode, backend="eager")
                mode_for_engine = "none"
            else:
                mode_for_engine = mode
            engine = GenerationEngine(model, max_batch_size=batch, max_seq_len=prompt + new,
                                      quantization=mode_for_engine)
            run = lambda: engine.generate(prompts, params, eos_token_id=())  # noqa: E731
            m = measure(run, warmup=1, iters=iters, device=device)
            tps = batch * new / m.median_s
            base_tps = base_tps or tps
            # what the engine holds (the model's tensors as it runs them: quantized in place; its KV cache) and,
            # apart, the transient memory of one call (measured after the warm-up, so graphs are captured)
            held = engine.cache.nbytes + sum(t.numel() * t.element_size()
                                             for t in (*model.parameters(), *model.buffers()))
            report.add(batch=batch, weights=label, prompt=prompt, new_tokens=new, s=m.median_s,
                       tok_per_s=tps, vs_unquantized=tps / base_tps, held_MiB=held / 2**20,
                       call_peak_MiB=m.peak_mem_bytes / 2**20)
            del engine, model
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, short prompts (default on CPU)")
    ap.add_argument("--model", default=None, help="local Hugging Face Llama directory (default: random init)")
    ap.add_argument("--config", default=None, help="LLAMA_CONFIGS preset for random init")
    ap.add_argument("--init-std", type=float, default=0.02, help="std of the random init (HF default 0.02)")
    ap.add_argument("--layers", type=positive_int, default=None, help="override the preset's layer count (quick: 2)")
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    args.config = args.config or ("tiny" if quick else "llama-3.2-1b")
    if quick and args.layers is None and args.model is None:
        args.layers = 2
    dtype = torch.bfloat16 if cuda else torch.float32
    if quick:
        n_prompts, length, new, chunk = 8, 24, 6, 8
        batches, sp_prompt, sp_new, iters = [4], 8, 4, 1
    else:
        n_prompts, length, new, chunk = 32, 64, 32, 8
        batches, sp_prompt, sp_new, iters = [1, 16, 64], 64, 128, 3

    base = load_model(args, device, dtype)
    source = args.model or f"random {args.config} ({base.config.num_hidden_layers} layers, init std {args.init_std})"
    quality = Report("quant_quality", "Quantized vs unquantized generator: next-token KL and greedy agreement")
    quality.note(f"model: {source}, dtype {dtype}; {n_prompts} fixed prompts x {length} tokens (seeded); "
                 f"greedy continuation of {new} tokens")
    ids = fixed_prompts(base.config.vocab_size, n_prompts, length, device)
    ref_tokens = greedy(copy.deepcopy(base), ids.tolist(), new, "none")
    for mode in MODES:
        qmodel = quantize_model(copy.deepcopy(base), mode)
        kl_mean, kl_max, top1 = teacher_forced(base, qmodel, ids, chunk)
        del qmodel
        same, prefix = greedy_agreement(ref_tokens, greedy(copy.deepcopy(base), ids.tolist(), new, mode))
        quality.add(weights=mode, mean_KL=kl_mean, max_KL=kl_max, top1_agreement=top1,
                    greedy_token_agreement=same, greedy_prefix_fraction=prefix)
    quality.save()

    if args.skip_speed:
        return
    speed = Report("quant_decode", "Generation engine decode throughput: int8 / fp8 weights vs unquantized")
    speed.note(f"model: {source}, dtype {dtype}; greedy, {sp_prompt}-token prompts, {sp_new} new tokens; "
               "tok/s = generated tokens / whole generate() call (prefill included)")
    variants = [("bf16" if cuda else "fp32", "none"), ("int8", "int8"), ("fp8", "fp8")]
    if not cuda:
        variants += [("int8 eager", "int8"), ("fp8 eager", "fp8")]
        speed.note("CPU: 'int8'/'fp8' rows run interpreted Triton (correct, not fast); the 'eager' rows use "
                   "quantize_model(..., backend='eager')")
    decode_speed(base, variants, batches, sp_prompt, sp_new, device, speed, iters)
    speed.save()


if __name__ == "__main__":
    main()
