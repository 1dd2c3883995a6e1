"""AIPO loss from hidden states, forward + backward: fused Triton kernel vs eager, torch.compile, Liger.

Every method computes the same token-mean policy-gradient loss over N = B·T tokens from the last hidden
states h [N, D] and the lm_head weight W [V, D], and back-propagates into both:

- eager:    logits = h @ Wᵀ, log-softmax + gather (``token_logprobs(entropy="none")``) + ``aipo_loss``
            (llamarl.algorithms), autograd: only what the loss needs
- compile:  ``torch.compile`` of that same eager function
- liger:    Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (PPO-style clipping rather than AIPO's one-sided
            truncation, no KL term; same GEMM work), only if ``liger_kernel`` is importable
- ours:     ``llamarl_kernels.fused_aipo_loss`` (chunked logits, gradients produced in the forward)

and the floor: the three GEMMs any exact method needs (h Wᵀ, G W, Gᵀ h) timed alone. Columns: median
and 20/80 % quantiles in ms, ``TFLOPs`` = the 3 GEMMs' 6·N·D·V flops / time (the achieved rate if the
GEMMs were all the work), extra peak memory, speed-up vs eager, % of the 3-GEMM floor (floor / time),
|loss − eager loss|.

    python -m benchmarks.aipo_loss            # full: N = 2048, 4096, 16384, D = 4096, V = 128256, bf16 (GPU)
    python -m benchmarks.aipo_loss --quick    # tiny fp32 shapes; on CPU the kernel runs interpreted (< 1 min)
    options: --sizes N [N ...], --iters K, --no-compile, --no-liger, --compile (also compile on CPU: minutes),
             --sequence-level (also ours with level="sequence")

On CPU the Triton kernel runs in the interpreter, so --quick timings only show that everything runs;
speed figures come from GPU runs.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel import

from benchmarks.harness import Report, measure, positive_int  # noqa: E402
from llamarl.algorithms import aipo_loss, token_logprobs  # noqa: E402
from llamarl_kernels import fused_aipo_loss, fused_logprobs  # noqa: E402

RHO = 2.0
TEMPERATURE = 1.0
SEQ_LEN = 1024  # tokens per sequence in full mode (B = N / SEQ_LEN)


def eager_loss(hidden, weight, targets, behavior, advantages, mask):
    logits = hidden @ weight.t()
    logprobs, _ = token_logprobs(logits, targets, TEMPERATURE, validate=False, entropy="none")
    loss, _ = aipo_loss(logprobs, behavior, advantages, mask, RHO, validate=False)
    return loss


def fused_loss(hidden, weight, targets, behavior, advantages, mask):
    loss, _ = fused_aipo_loss(hidden, weight, targets, behavior, advantages, mask, RHO, TEMPERATURE)
    return loss


def fused_sequence_level_loss(seq_len: int):
    """ours with level="sequence" (GSPO's ratio; one more no-grad pass over the logits), sequences of seq_len."""
    def loss_fn(hidden, weight, targets, behavior, advantages, mask):
        ids = torch.arange(hidden.shape[0], device=hidden.device) // seq_len
        loss, _ = fused_aipo_loss(hidden, weight, targets, behavior, advantages, mask, RHO, TEMPERATURE,
                                  level="sequence", sequence_ids=ids)
        return loss
    return loss_fn


def liger_loss_fn(seq_len: int):
    """Liger's fused linear GRPO loss on [B, T, D] inputs, or the reason it is unavailable."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None, "not installed"
    try:
        module = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, temperature=TEMPERATURE)
    except TypeError as exc:  # constructor arguments differ between Liger releases
        return None, f"unsupported version ({exc})"

    def loss_fn(hidden, weight, targets, behavior, advantages, mask):
        b = hidden.shape[0] // seq_len
        out = module(hidden.view(b, seq_len, -1), weight, targets.view(b, seq_len), mask.view(b, seq_len).float(),
                     advantages.view(b, seq_len)[:, 0], old_per_token_logps=behavior.view(b, seq_len))
        return out[0] if isinstance(out, tuple) else out

    return loss_fn, "ok"


def make_inputs(n, d, v, seq_len, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, device=device) * d**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    with torch.no_grad():
        logprobs, _ = fused_logprobs(hidden.detach(), weight.detach(), targets, TEMPERATURE)
    # the generator's log-probs: the trainer's plus noise, so that some ratios exceed rho
    behavior = logprobs + 0.5 * torch.randn(n, generator=g, device=device)
    advantages = torch.randn(n // seq_len, generator=g, device=device).repeat_interleave(seq_len)
    mask = torch.rand(n, generator=g, device=device) > 0.1  # 10 % of the tokens are not trained on
    return hidden, weight, targets, behavior, advantages, mask


def gemm_floor(hidden, weight):
    """The three GEMMs of forward + backward, at full size, nothing else."""
    with torch.no_grad():
        logits = hidden @ weight.t()
        hidden_grad = logits @ weight
        weight_grad = logits.t() @ hidden
    return hidden_grad, weight_grad


def step_fn(loss_fn, inputs, losses: list):
    hidden, weight = inputs[0], inputs[1]

    def step():
        loss = loss_fn(*inputs)
        loss.backward()
        losses.append(loss.detach())
        hidden.grad = None  # freed after each call, so each call's peak counts its own gradients
        weight.grad = None

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny fp32 shapes (the default without CUDA)")
    parser.add_argument("--sizes", type=positive_int, nargs="*", help="token counts N (default: full 2048 4096 16384)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--compile", action="store_true", help="run torch.compile on CPU too (slow to compile)")
    parser.add_argument("--no-liger", action="store_true",
                        help="skip the Liger-Kernel baseline (about a second per call at N=16384 on an H200)")
    parser.add_argument("--iters", type=positive_int, default=None)
    parser.add_argument("--sequence-level", action="store_true",
                        help="also time ours with level='sequence' (GSPO's ratio: one more pass over the logits)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    if not cuda:
        torch.set_num_threads(1)  # tiny GEMMs on a shared CPU: threads only add synchronisation noise
    if quick:
        sizes, d, v, seq_len, dtype = args.sizes or [64], 64, 1024, 16, torch.float32
        iters, warmup = args.iters or 3, 1
    else:
        sizes, d, v, seq_len, dtype = args.sizes or [2048, 4096, 16384], 4096, 128256, SEQ_LEN, torch.bfloat16
        iters, warmup = args.iters or 10, 3
    # inductor on a CPU spends minutes compiling C++: there it runs only with --compile
    use_compile = not args.no_compile and (cuda or args.compile)

    report = Report("aipo_loss", "AIPO loss from hidden states, fwd+bwd: fused Triton vs eager / compile / Liger")
    report.note(f"D={d}, V={v}, dtype={str(dtype).removeprefix('torch.')}, rho={RHO}, T={TEMPERATURE}, "
                f"seq_len={seq_len}, device={device.type}{' (Triton interpreted, 1 thread)' if not cuda else ''}")
    liger_fn, liger_status = (None, "skipped (--no-liger)") if args.no_liger else liger_loss_fn(seq_len)
    report.note(f"liger_kernel: {liger_status}")
    if not use_compile:
        report.note("torch.compile: skipped (--no-compile, or CPU without --compile)")

    for n in sizes:
        if n % seq_len:
            raise SystemExit(f"--sizes: N={n} must be a multiple of the sequence length {seq_len}")
        inputs = make_inputs(n, d, v, seq_len, dtype, device)
        floor = measure(lambda: gemm_floor(inputs[0], inputs[1]), warmup=warmup, iters=iters, device=device)
        flops = 6.0 * n * d * v
        report.add(method="3-GEMM floor", N=n, median_ms=floor.median_ms, p20_ms=floor.p20_s * 1e3,
                   p80_ms=floor.p80_s * 1e3, TFLOPs=flops / floor.median_s / 1e12,
                   extra_peak_GiB=floor.peak_mem_bytes / 2**30)
        methods = [("eager", eager_loss)]
        if use_compile:
            # a fresh static-shape compile per size: with dynamo's automatic dynamic shapes the second
            # size recompiled with a symbolic N and torch 2.11 failed building its guards on the H200
            torch._dynamo.reset()
            methods.append(("torch.compile", torch.compile(eager_loss, dynamic=False)))
        if liger_fn is not None:
            methods.append(("liger", liger_fn))
        methods.append(("ours (fused)", fused_loss))
        if args.sequence_level:
            methods.append(("ours, sequence-level ratios", fused_sequence_level_loss(seq_len)))
        eager_ms, eager_loss_value = None, None
        for name, fn in methods:
            losses: list = []
            try:
                m = measure(step_fn(fn, inputs, losses), warmup=warmup, iters=iters, device=device)
            except Exception as exc:  # a baseline that breaks must not take the other rows with it
                if name in ("ours (fused)", "eager"):
                    raise
                report.note(f"N={n} {name}: failed with {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            loss_value = losses[-1].float().item()
            if name == "eager":
                eager_ms, eager_loss_value = m.median_ms, loss_value
            report.add(method=name, N=n, median_ms=m.median_ms, p20_ms=m.p20_s * 1e3, p80_ms=m.p80_s * 1e3,
                       TFLOPs=flops / m.median_s / 1e12, extra_peak_GiB=m.peak_mem_bytes / 2**30,
                       speedup_vs_eager=eager_ms / m.median_ms,
                       floor_pct=100.0 * floor.median_ms / m.median_ms,
                       loss_diff=("n/a (other loss)" if name == "liger" else "n/a (other ratios)"
                                  if name.startswith("ours, sequence") else abs(loss_value - eager_loss_value)))
        del inputs
        if cuda:
            torch.cuda.empty_cache()
    report.save()


if __name__ == "__main__":
    main()
