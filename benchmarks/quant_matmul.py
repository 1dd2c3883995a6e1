"""Weight-only int8 / fp8 matmul (decode and prefill shapes) against bf16 and two quantized baselines.

    python -m benchmarks.quant_matmul            # GPU: K->N = 4096->14336, 14336->4096, 4096->4096,
                                                 #      M = 1, 4, 16, 64, 256
    python -m benchmarks.quant_matmul --quick    # small shapes; on CPU Triton runs interpreted (< 1 min)
    python -m benchmarks.quant_matmul --sweep    # also time a grid of launch configs (M in --sweep-m)

Every row is timed in the same process (on CUDA from CUDA-graph replays cycling over enough weight
copies to defeat the L2 cache, see ``time_op``): ``bf16`` is ``F.linear(x, w)``, ``int8pack`` is
``torch._weight_int8pack_mm`` (int8 weight, bf16 per-channel scales), ``naive_int8`` is eager
dequantize-then-``F.linear``, ``ours_int8`` / ``ours_fp8`` are ``llamarl_kernels.quantized_linear``.
Columns: median µs (p20-p80), ``vs_bf16`` = bf16 time / this time (> 1 is faster), achieved GB/s
over the bytes the op must move (weights + scales + x + y), and ``of_floor`` = weight-byte floor / time,
where the floor is weight bytes at the device-copy bandwidth measured in this run (1.0 = streaming the
weights at copy speed; the ceiling for decode). Each quantized result is checked against a float64
dequantize-then-matmul before timing (max error relative to max |y|, printed in the notes).
A second table times ``quantize`` itself (bf16 weight -> codes + scales, as quantize-on-sync runs it)
against the eager reference.

GPU targets (issue #8, checked and printed as notes, not asserted): int8 and fp8 <= 35 µs at M=1 for
4096->14336 (>= 1.75x bf16), and never slower than bf16 for M <= 16.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

if not torch.cuda.is_available():  # must precede the first kernel import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from benchmarks.harness import Measurement, Report, measure, measure_graph, positive_int  # noqa: E402
from llamarl_kernels.qlinear import QLinearConfig, default_qlinear_config, quantized_linear  # noqa: E402
from llamarl_kernels.quant import quantize  # noqa: E402
from llamarl_kernels.reference import dequantize_ref, quantize_ref  # noqa: E402

FULL_SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096)]  # (K, N)
FULL_MS = [1, 4, 16, 64, 256]
QUICK_SHAPES = [(256, 768), (768, 256)]
QUICK_MS = [1, 4, 16]
TARGET_US_M1 = 35.0


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    m = measure(lambda: dst.copy_(src), warmup=2, iters=10, device=device)
    return 2 * nbytes / m.median_s


def sweep_configs(M: int) -> list[QLinearConfig]:
    """Candidate launch configs for --sweep (GPU only)."""
    out = []
    if M == 1:  # one-row GEMV: tile shape x codes loaded ahead x split-K (tiles sized for ~4 programs/SM)
        for bn, bk, warps in ((4, 1024, 4), (8, 512, 4), (16, 256, 4), (8, 1024, 8)):
            for prefetch, split in ((0, 1), (1, 1), (2, 1), (1, 2)):
                out.append(QLinearConfig(1, bn, bk, split_k=split, num_warps=warps, num_stages=4, prefetch=prefetch))
    else:
        bms = [16] if M <= 16 else [32, 64] if M <= 64 else [64, 128]
        for bm in bms:
            for bn in (64, 128):
                for bk in (64, 128):
                    for split in (1, 2, 4):
                        out.append(QLinearConfig(bm, bn, bk, split_k=split, num_warps=4 if bm * bn <= 4096 else 8,
                                                 num_stages=4 if bm <= 64 else 3))
    return out


def sweep(report: Report, K: int, N: int, M: int, x: torch.Tensor, weights: dict, bf16_s: float,
          device: torch.device) -> None:
    """Time every ``sweep_configs(M)`` config on each mode's weight copies; one row per config, each
    result checked against the float64 reference first (a config that computes wrong never wins)."""
    for mode, qs in weights.items():
        best = None
        for c in sweep_configs(M):
            row = dict(K=K, N=N, M=M, mode=mode, block_n=c.block_n, block_k=c.block_k, warps=c.num_warps,
                       split_k=c.split_k, prefetch=c.prefetch)
            try:
                err = check(quantized_linear(x, *qs[0], config=c), x, *qs[0])
                t = time_op([lambda q=q, s=s: quantized_linear(x, q, s, config=c) for q, s in qs], 3, 10,
                            device).median_s
            except Exception as e:  # a config the compiler rejects (e.g. out of registers or shared memory)
                report.add(**row, error=f"{type(e).__name__}: {str(e)[:80]}")
                continue
            nbytes = N * K + 4 * N + 2 * M * (K + N)
            report.add(**row, us=t * 1e6, vs_bf16=bf16_s / t, GBps=nbytes / t / 1e9, max_rel_err=err)
            if err < 1e-2 and (best is None or t < best[0]):
                best = (t, c)
        if best is not None:
            report.note(f"best K={K} N={N} M={M} {mode}: {best[0] * 1e6:.1f} µs ({bf16_s / best[0]:.2f}x bf16) "
                        f"with {best[1]}")


def time_op(fns, warmup: int, iters: int, device: torch.device) -> Measurement:
    """CPU: plain timing of fns[0]. CUDA: per-call time from ``iters`` CUDA-graph replays over all weight
    copies (harness.measure_graph: no launch overhead, weights streamed from HBM, as in a graph-captured
    decode step); ops slower than 0.5 ms (launch overhead irrelevant) are timed plainly, ``iters`` calls
    cycling over the weight copies."""
    if device.type != "cuda":
        return measure(fns[0], warmup=warmup, iters=iters, device=device)
    rough = measure(fns[0], warmup=warmup, iters=3, device=device)
    if rough.median_s > 5e-4:
        calls = itertools.cycle(fns)
        return measure(lambda: next(calls)(), warmup=0, iters=iters, device=device)
    reps = max(1, min(20, int(2e-3 / (rough.median_s * len(fns)))))
    return measure_graph(fns, reps=reps, iters=iters)


def check(y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    y64 = (x.double() @ q.double().t()) * scale.double()
    return ((y.double() - y64).abs().max() / y64.abs().max().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (default on CPU)")
    ap.add_argument("--sweep", action="store_true", help="GPU: time a grid of launch configs for ours")
    ap.add_argument("--sweep-m", type=positive_int, nargs="+", default=[1], help="the M values --sweep tunes")
    ap.add_argument("--iters", type=positive_int, default=None)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    shapes, ms = (QUICK_SHAPES, QUICK_MS) if quick else (FULL_SHAPES, FULL_MS)
    iters = args.iters or (10 if cuda else 3)  # CUDA: graph replays of up to 20 calls per weight copy
    warmup = 10 if cuda else 1

    report = Report("quant_matmul", "Weight-only int8/fp8 matmul vs bf16 F.linear")
    sweep_report = Report("quant_matmul_sweep", "quantized_linear launch configs (--sweep)") if args.sweep else None
    bw = copy_bandwidth(device, (1 << 30) if cuda else (64 << 20))
    report.note(f"device copy bandwidth (read+write): {bw / 1e9:.1f} GB/s")
    if not cuda:
        report.note("CPU: Triton runs under TRITON_INTERPRET=1 -- 'ours' timings measure the interpreter, "
                    "not the kernel; only the GPU numbers mean anything")
        if sweep_report is not None:
            sweep_report.note("CPU: interpreted, so this only checks that every config runs and computes right")
    torch.manual_seed(0)
    targets: list[str] = []
    pending_sweeps: list[tuple] = []  # run after the main and quantize tables are written
    for K, N in shapes:
        # on CUDA, enough weight copies that one timed pass touches > 256 MB (5x the H200's L2)
        n_copies = max(1, -(-(256 << 20) // (N * K))) if cuda else 1
        ws = [(torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16) for _ in range(n_copies)]
        q8s, qfs = [quantize(c, "int8") for c in ws], [quantize(c, "fp8") for c in ws]
        q8, s8 = q8s[0]
        qf, sf = qfs[0]
        s8_bf16s = [s.to(torch.bfloat16) for _, s in q8s]
        w_bytes = {"bf16": 2 * N * K, "int8pack": N * K + 2 * N, "naive_int8": N * K + 4 * N,
                   "ours_int8": N * K + 4 * N, "ours_fp8": N * K + 4 * N}
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            per_copy = {  # name -> one callable per weight copy
                "bf16": [lambda c=c: F.linear(x, c) for c in ws],
                "int8pack": [lambda q=q, s=s: torch._weight_int8pack_mm(x, q, s) for (q, _), s in zip(q8s, s8_bf16s)],
                "naive_int8": [lambda q=q, s=s: F.linear(x, dequantize_ref(q, s, torch.bfloat16)) for q, s in q8s],
                "ours_int8": [lambda q=q, s=s: quantized_linear(x, q, s) for q, s in q8s],
                "ours_fp8": [lambda q=q, s=s: quantized_linear(x, q, s) for q, s in qfs],
            }
            fns = {name: fs[0] for name, fs in per_copy.items()}
            err8, errf = check(fns["ours_int8"](), x, q8, s8), check(fns["ours_fp8"](), x, qf, sf)
            cfg = default_qlinear_config(M, N, K, device)
            report.note(f"K={K} N={N} M={M}: config {cfg}; max rel error int8 {err8:.2e}, fp8 {errf:.2e}")
            base = None
            times = {}
            for name, fn in fns.items():
                m = time_op(per_copy[name], warmup, iters, device)
                times[name] = m.median_s
                base = base or m.median_s
                moved = w_bytes[name] + 2 * M * (K + N)
                floor_s = w_bytes[name] / bw
                report.add(K=K, N=N, M=M, impl=name, us=m.median_s * 1e6, p20_us=m.p20_s * 1e6,
                           p80_us=m.p80_s * 1e6, vs_bf16=base / m.median_s, GBps=moved / m.median_s / 1e9,
                           of_floor=floor_s / m.median_s, peak_MiB=m.peak_mem_bytes / 2**20)
            if cuda:
                for name in ("ours_int8", "ours_fp8"):
                    us, ratio = times[name] * 1e6, times["bf16"] / times[name]
                    if (K, N) == (4096, 14336) and M == 1:
                        ok = us <= TARGET_US_M1 and ratio >= 1.75
                        targets.append(f"{'PASS' if ok else 'FAIL'} {name} M=1 4096->14336: {us:.1f} µs, "
                                       f"{ratio:.2f}x bf16 (target <= {TARGET_US_M1} µs, >= 1.75x)")
                    if M <= 16:
                        targets.append(f"{'PASS' if ratio >= 1.0 else 'FAIL'} {name} M={M} {K}->{N}: "
                                       f"{ratio:.2f}x bf16 (target >= 1.0x)")
            if args.sweep and M in args.sweep_m:
                pending_sweeps.append((K, N, M, x, {"int8": q8s, "fp8": qfs}, times["bf16"]))
    for t in targets:
        report.note(t)
    report.save()
    # the quantize table, then the (long) sweep: a time limit that cuts the sweep keeps both tables above
    quantize_throughput(shapes, device, bw, warmup, iters)
    for K, N, M, x, weights, bf16_s in pending_sweeps:
        sweep(sweep_report, K, N, M, x, weights, bf16_s, device)
        sweep_report.save()


def quantize_throughput(shapes, device: torch.device, bw: float, warmup: int, iters: int) -> None:
    """quantize() of a bf16 weight (what quantize-on-sync runs per shard) vs the eager reference."""
    report = Report("quant_quantize", "Per-channel quantization of a bf16 weight: Triton kernel vs eager torch")
    report.note("bytes moved = bf16 weight read + 1-byte codes + fp32 scales written; of_copy = vs device copy")
    for K, N in shapes:
        n_copies = max(1, -(-(256 << 20) // (2 * N * K))) if device.type == "cuda" else 1
        ws = [(torch.randn(N, K, device=device) * 0.02).to(torch.bfloat16) for _ in range(n_copies)]
        moved = 2 * N * K + N * K + 4 * N
        for mode in ("int8", "fp8"):
            base = None
            for impl, f in (("eager", quantize_ref), ("ours", quantize)):
                m = time_op([lambda w=w, f=f: f(w, mode) for w in ws], warmup, iters, device)
                base = base or m.median_s
                report.add(K=K, N=N, mode=mode, impl=impl, us=m.median_s * 1e6, vs_eager=base / m.median_s,
                           GBps=moved / m.median_s / 1e9, of_copy=moved / m.median_s / bw,
                           peak_MiB=m.peak_mem_bytes / 2**20)
    report.save()


if __name__ == "__main__":
    main()
