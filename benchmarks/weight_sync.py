"""DDMA weight sync between two processes vs. the memcpy ceiling and two baselines, in one run.

The main process is the trainer (one rank, the full bf16 weights as separate tensors); a spawned process
is the generator. Rows (bytes moved once; GB/s = bytes / seconds):

    memcpy ceiling          one flat copy of the same bytes inside one process: the faster of torch
                            ``dst.copy_(src)`` and the native engine (same thread count / device)
    ddma (ours)             WeightSender.sync into the generator's flat buckets (shared memory on CPU,
                            CUDA IPC on GPU), every tensor a strided/indexed op of one schedule
    ddma fp8 quantize       the same with GeneratorLayout(quant="fp8"): the trainer quantizes and writes
                            q + scales into the generator's buckets (Triton kernel on GPU, eager on CPU)
    per-tensor state_dict   generator tensors shared one by one (torch.multiprocessing: one shm
                            segment / CUDA IPC handle per tensor); trainer loops ``dst[n].copy_(src[n])``
    gather + broadcast      pack the shards into one flat buffer on rank 0 (the gather), then
                            ``dist.broadcast`` to the generator, which unpacks per tensor. gloo on CPU;
                            on a single GPU NCCL cannot put two ranks on one device, so it goes through
                            host memory (GPU -> host -> gloo -> host -> GPU), as a 1-GPU deployment would

Targets (issue #3): CPU: ddma >= 0.8x the memcpy ceiling's GB/s. Full mode (H200): Llama-8B-shaped bf16
(16.06 GB): ddma time <= 1.15x the flat device copy time; fp8 quantize-on-sync time <= the bf16 flat copy.

    python -m benchmarks.weight_sync --quick          # ~120 MB on CPU, < 1 minute
    python -m benchmarks.weight_sync                  # Llama-3-8B shapes on cuda (needs ~90 GB)
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
import time
import traceback

import torch

from benchmarks.harness import Report, measure, positive_int, synchronize

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8)
BROADCAST_CHUNK = 1 << 30  # the baseline broadcasts in 1 GiB pieces (gloo and NCCL limits stay far away)
QUICK = dict(vocab_size=16000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4)


def checksum(t: torch.Tensor) -> int:
    """Sum of the tensor's bytes as int32 words (uint8 if unaligned): a cheap identity check."""
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    if raw.numel() % 4 == 0:
        raw = raw.view(torch.int32)
    return int(torch.sum(raw, dtype=torch.int64))


def make_weights(specs, device, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g, device=device, dtype=torch.float32).to(s.dtype)
            for s in specs}


# ---- the generator process ------------------------------------------------------------------------
class Generator:
    """Commands the generator process runs (see generator_main)."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.buckets = {}
        self.state_dict = None
        self.flat = None

    def create(self, key, specs, trainer, generator, storage, slots):
        from llamarl.weight_sync import GeneratorBuckets, plan_sync

        plan = plan_sync(specs, trainer, generator)
        self.buckets[key] = GeneratorBuckets.create(plan, 0, storage=storage, device=self.device, slots=slots)
        return self.buckets[key].handle()

    def checksums(self, key):
        from llamarl.weight_sync import WeightReceiver

        r = WeightReceiver(self.buckets[key])
        with r.reading(timeout=120) as v:
            sums = {n: checksum(t) for n, t in r.named_tensors().items()}
        r.close()
        return v, sums

    def zero(self, key):
        """Clear every tensor of the (one-slot) buckets, so the next sync's bytes can be checked on their own."""
        for t in self.buckets[key].tensors(0).values():
            t.zero_()
        synchronize(self.device)

    def drop(self, key):
        self.buckets.pop(key).close()

    def share_state_dict(self, specs):
        self.state_dict = {s.name: torch.zeros(s.shape, dtype=s.dtype, device=self.device) for s in specs}
        if self.device.type == "cpu":
            for t in self.state_dict.values():
                t.share_memory_()  # one segment per tensor
        return self.state_dict  # pickled by ForkingPickler: CUDA IPC handle / fd per tensor

    def state_dict_checksums(self):
        synchronize(self.device)
        return {n: checksum(t) for n, t in self.state_dict.items()}

    def drop_state_dict(self):
        self.state_dict = None
        self.flat = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def dist_init(self, init_file, backend):
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=1, world_size=2)

    def broadcast_recv(self, nbytes, host):
        import torch.distributed as dist

        dev = torch.device("cpu") if host else self.device
        if self.flat is None or self.flat.numel() != nbytes:
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        for lo in range(0, nbytes, BROADCAST_CHUNK):
            dist.broadcast(self.flat[lo:lo + BROADCAST_CHUNK], src=0)
        flat = self.flat.to(self.device, non_blocking=False) if host and self.device.type == "cuda" else self.flat
        offset = 0
        for t in self.state_dict.values():  # unpack into the per-tensor state dict
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(flat[offset:offset + n])
            offset += n
        synchronize(self.device)
        return True


def generator_main(conn, device):
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    gen = Generator(device)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args = msg
        try:
            conn.send((True, getattr(gen, fn)(*args)))
        except BaseException:  # noqa: BLE001 - report to the benchmark process
            conn.send((False, traceback.format_exc()))
    for b in gen.buckets.values():
        b.close()


class Remote:
    def __init__(self, device: str):
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=generator_main, args=(child, device), daemon=True)
        self.proc.start()

    def send(self, fn, *args):
        self.conn.send((fn, args))

    def recv(self, timeout=600):
        if not self.conn.poll(timeout):
            raise TimeoutError("the generator process did not answer")
        ok, val = self.conn.recv()
        if not ok:
            raise RuntimeError("generator process failed:\n" + val)
        return val

    def __call__(self, fn, *args):
        self.send(fn, *args)
        return self.recv()

    def close(self):
        self.conn.send(None)
        self.proc.join(60)


# ---- the benchmark --------------------------------------------------------------------------------
_T0 = time.perf_counter()


def phase(name: str) -> None:
    """Progress on stdout, so that a run cut off by a time limit shows where it was."""
    print(f"[weight_sync {time.perf_counter() - _T0:6.1f}s] {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~120 MB Llama-shaped set (CPU, < 1 minute)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--threads", type=positive_int, default=None, help="CPU copy threads (default: all cores, max 8)")
    ap.add_argument("--streams", type=positive_int, default=4, help="CUDA copy streams")
    ap.add_argument("--more-streams", type=positive_int, nargs="*", default=[1, 8],
                    help="CUDA: also time the DDMA sync with these stream counts")
    ap.add_argument("--engine", default="memcpy", choices=("memcpy", "kernel"),
                    help="CUDA copy engine of the main DDMA rows (the other one is timed too)")
    ap.add_argument("--iters", type=positive_int, default=None)
    ap.add_argument("--no-baselines", action="store_true", help="skip the two baselines")
    args = ap.parse_args()

    from llamarl import _native
    from llamarl.weight_sync import GeneratorLayout, TrainerLayout, WeightSender, llama_param_specs, plan_sync
    from llamarl.weight_sync.quantize_on_sync import TrainerSources

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not args.quick and device.type == "cpu":
        raise SystemExit("full mode moves 16 GB Llama-8B-shaped weights and is meant for a GPU; use --quick on CPU "
                         "(or pass --device cpu --quick)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    threads = args.threads or max(1, min(8, os.cpu_count() or 1))
    torch.set_num_threads(threads)
    iters = args.iters or (5 if args.quick else 10)
    storage = "cuda" if device.type == "cuda" else "shm"
    cfg = QUICK if args.quick else LLAMA_8B
    specs = llama_param_specs(cfg, torch.bfloat16)
    nbytes = sum(s.rows * s.cols * s.element_size for s in specs)
    report = Report("weight_sync", f"DDMA weight sync, {'quick' if args.quick else 'Llama-8B'} bf16 set, "
                                   f"{nbytes / 1e9:.3f} GB, {device.type}")
    report.note(f"{len(specs)} tensors; {'threads' if device.type == 'cpu' else 'streams'}="
                f"{threads if device.type == 'cpu' else args.streams}; GB/s = bytes moved once / seconds")

    def row(name, m, nbytes_moved, ref_s=None, ceiling_s=None):
        r = dict(path=name, bytes=nbytes_moved, median_ms=m.median_s * 1e3, p20_ms=m.p20_s * 1e3,
                 p80_ms=m.p80_s * 1e3, GBps=nbytes_moved / m.median_s / 1e9, peak_mem_MiB=m.peak_mem_bytes / 2**20)
        if ceiling_s is not None:
            r["time_vs_flat_copy"] = m.median_s / ceiling_s
        if ref_s is not None:
            r["time_vs_ddma"] = m.median_s / ref_s
        return report.add(**r)

    # 1. memcpy ceiling: one flat copy of the same bytes in this process
    src = torch.randint(-128, 127, (nbytes,), dtype=torch.int8, device=device).view(torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)

    def checked_copy(name, fn):
        """Time ``fn`` (a copy of src into dst) from a zeroed dst, then check every byte arrived: a copy that
        wrote nothing or part would otherwise pass, and look fast enough to become the ceiling."""
        dst.zero_()
        m = measure(fn, warmup=2, iters=iters, device=device)
        if not torch.equal(dst, src):
            raise RuntimeError(f"the flat copy by {name} produced wrong bytes")
        return m

    one_op = _native.as_ops([(0, 0, 1, nbytes, nbytes, nbytes)])
    m_torch = checked_copy("torch copy_", lambda: dst.copy_(src))
    m_native = checked_copy("the native engine", lambda: _native.copy_ops(dst, src, one_op, num_threads=threads,
                                                                          num_streams=args.streams))
    flat = [m_torch, m_native]
    row("flat copy, torch copy_", m_torch, nbytes)
    row("flat copy, native engine", m_native, nbytes)
    if device.type == "cuda":
        m_kernel = checked_copy("the SM copy kernel", lambda: _native.copy_ops(dst, src, one_op, engine="kernel"))
        flat.append(m_kernel)
        row("flat copy, native SM copy kernel", m_kernel, nbytes)
    ceiling = min(flat, key=lambda m: m.median_s)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()

    phase("weights + generator process")
    weights = make_weights(specs, device)
    gen = Remote(str(device))
    want = {n: checksum(t) for n, t in weights.items()}  # every path's result is checked against these

    def verify(sums: dict, what: str) -> None:
        bad = [n for n in weights if sums[n] != want[n]]
        if bad:
            raise RuntimeError(f"{what} produced wrong bytes for {bad[:3]}")

    def verify_bf16(what: str) -> None:
        verify(gen("checksums", "bf16")[1], f"DDMA sync ({what})")
    version = itertools.count(1)
    try:
        # 2. ours: DDMA into the generator's flat buckets
        phase("ddma")
        trainer, layout = TrainerLayout(1), GeneratorLayout()
        plan = plan_sync(specs, trainer, layout)
        handle = gen("create", "bf16", specs, trainer, layout, storage, 1)
        with WeightSender(plan, 0, [handle], device=device, num_threads=threads, num_streams=args.streams,
                          cuda_engine=args.engine, timeout=300) as sender:
            m_ours = measure(lambda: sender.sync(weights, next(version)), warmup=2, iters=iters, device=device)
            st = sender.sync(weights, next(version))
            verify_bf16(args.engine)  # the headline row's bytes
            report.note(f"ddma, one more sync's own split: {st.seconds * 1e3:.3f} ms wall = slot claim wait "
                        f"{st.wait_seconds * 1e3:.3f} ms + quantize/copy (+stream sync) {st.copy_seconds * 1e3:.3f} ms "
                        f"+ publish and bookkeeping {(st.seconds - st.wait_seconds - st.copy_seconds) * 1e3:.3f} ms")
            variants, other = [], None
            if device.type == "cuda":
                variants = [("memcpy", n) for n in args.more_streams] if args.engine == "memcpy" else []
                variants.append(("kernel" if args.engine == "memcpy" else "memcpy", args.streams))
            for engine, streams in variants:  # each variant's bytes are checked from cleared buckets
                sender.cuda_engine, sender.num_streams = engine, streams
                gen("zero", "bf16")
                m_s = measure(lambda: sender.sync(weights, next(version)), warmup=1, iters=iters, device=device)
                label = "SM copy kernel" if engine == "kernel" else f"{streams} stream{'s' if streams > 1 else ''}"
                verify_bf16(label)
                row(f"ddma (ours), {label}", m_s, nbytes, ceiling_s=ceiling.median_s)
                if engine != args.engine:
                    other = (engine, m_s)
        gen("drop", "bf16")
        ours = row(f"ddma (ours){', ' + args.engine if device.type == 'cuda' else ''}", m_ours, nbytes,
                   ceiling_s=ceiling.median_s)

        # 3. quantize-on-sync to fp8
        phase("ddma fp8 quantize-on-sync")
        qlayout = GeneratorLayout(quant="fp8")
        qplan = plan_sync(specs, trainer, qlayout)
        qhandle = gen("create", "fp8", specs, trainer, qlayout, storage, 1)
        with WeightSender(qplan, 0, [qhandle], device=device, num_threads=threads, num_streams=args.streams,
                          cuda_engine=args.engine, timeout=300) as qsender:
            m_q = measure(lambda: qsender.sync(weights, next(version)), warmup=1, iters=max(2, iters // 2),
                          device=device)
            qbytes = qsender.bytes_per_sync
            quantizer = qsender.sources.quantizer
        _, qsums = gen("checksums", "fp8")
        ref = TrainerSources(qplan, 0, device, quantizer).assemble(weights)
        bad = [t.name for t, s in zip(qplan.tensors, ref) if qsums[t.name] != checksum(s)]
        if bad:
            raise RuntimeError(f"fp8 quantize-on-sync produced wrong bytes for {bad[:3]}")
        del ref
        gen("drop", "fp8")
        row(f"ddma fp8 quantize-on-sync ({quantizer})", m_q, qbytes, ceiling_s=ceiling.median_s)
        report.note(f"fp8 quantize-on-sync: its GB/s counts the bytes written (codes + scales, "
                    f"{qbytes / 1e9:.3f} GB); it reads the {nbytes / 1e9:.3f} GB bf16 set, i.e. "
                    f"{nbytes / m_q.median_s / 1e9:.1f} GB/s of input")

        if not args.no_baselines:
            # 4. per-tensor state_dict copy into tensors shared one by one
            phase("per-tensor baseline")
            shared = gen("share_state_dict", specs)

            def per_tensor():
                for n, t in weights.items():
                    shared[n].copy_(t)
                synchronize(device)

            m_pt = measure(per_tensor, warmup=1, iters=iters, device=device)
            verify(gen("state_dict_checksums"), "per-tensor baseline")
            del shared
            row("per-tensor state_dict copy", m_pt, nbytes, ref_s=m_ours.median_s, ceiling_s=ceiling.median_s)

            # 5. gather to rank 0 + broadcast with torch.distributed
            import torch.distributed as dist

            host = device.type == "cuda" and torch.cuda.device_count() < 2
            backend = "nccl" if device.type == "cuda" and not host else "gloo"
            init_file = tempfile.mktemp(prefix="llamarl-bench-")
            gen.send("dist_init", init_file, backend)
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=0, world_size=2)
            gen.recv()

            def gather_broadcast():
                flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in weights.values()])  # the gather
                if host:
                    flat = flat.cpu()
                gen.send("broadcast_recv", nbytes, host)
                for lo in range(0, nbytes, BROADCAST_CHUNK):
                    dist.broadcast(flat[lo:lo + BROADCAST_CHUNK], src=0)
                gen.recv()

            phase("gather + broadcast baseline")
            # full mode: one timed pass (16 GB through host memory and gloo takes seconds, ~100x ours)
            m_gb = measure(gather_broadcast, warmup=1 if args.quick else 0, iters=2 if args.quick else 1, device=device)
            verify(gen("state_dict_checksums"), "gather+broadcast baseline")
            dist.destroy_process_group()
            os.unlink(init_file)
            gen("drop_state_dict")
            cold = "" if args.quick else ", one cold pass: first gloo use and first touch of the host buffers included"
            row(f"gather to rank 0 + broadcast ({backend}{', via host' if host else ''}{cold})", m_gb, nbytes,
                ref_s=m_ours.median_s, ceiling_s=ceiling.median_s)
    finally:
        gen.close()

    ratio_bw = ours["GBps"] / (nbytes / ceiling.median_s / 1e9)
    if device.type == "cpu":
        report.note(f"host load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (an "
                    "oversubscribed host penalises every torch call that wakes its thread pool, i.e. the "
                    "per-tensor baseline most)")
        report.note(f"target CPU: ddma >= 0.8x memcpy GB/s: {ratio_bw:.3f}x -> {'PASS' if ratio_bw >= 0.8 else 'FAIL'}")
    else:
        t_ratio = m_ours.median_s / ceiling.median_s
        q_ratio = m_q.median_s / ceiling.median_s
        report.note(f"target GPU: ddma time <= 1.15x flat copy: {t_ratio:.3f}x -> "
                    f"{'PASS' if t_ratio <= 1.15 else 'FAIL'} (engine {args.engine}; with the {other[0]} engine "
                    f"{other[1].median_s / ceiling.median_s:.3f}x)")
        report.note(f"target GPU: fp8 quantize-on-sync time <= bf16 flat copy: {q_ratio:.3f}x -> "
                    f"{'PASS' if q_ratio <= 1.0 else 'FAIL'}")
    report.save()


if __name__ == "__main__":
    main()
