"""The measuring helper every benchmark uses.

``measure(fn)`` runs ``fn`` a few times to warm up, then times ``iters`` calls: with CUDA events on a
GPU (so host overhead between launches is not hidden), with ``time.perf_counter`` after a full
synchronisation on the CPU. It reports the median and the 20th/80th percentiles in seconds and the
peak memory the calls added above what was allocated before (CUDA: ``max_memory_allocated``, exact;
CPU: the process's resident set, sampled every 0.5 ms by a thread during one more, untimed call, above
its size before it: an estimate that can miss a spike shorter than the sampling interval).

``Report`` collects rows and writes ``<name>.json`` and ``<name>.md`` (with hardware, versions and the
exact command) under ``$OUT`` if set, else ``benchmarks/results/local/``; GPU runs are committed by
hand as ``benchmarks/results/<bench>_h200_<yyyy-mm-dd>.md``.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from llamarl._fs import write_text_atomic


@dataclasses.dataclass(frozen=True)
class Measurement:
    median_s: float
    p20_s: float
    p80_s: float
    peak_mem_bytes: int
    iters: int

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def positive_int(text: str) -> int:
    """argparse type for counts (--iters, --sizes, ...): an int >= 1, or a one-line usage error."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def quantile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def completion_length(median: int, cap: int, g: torch.Generator) -> int:
    """One RL completion length as the benchmarks draw them: lognormal (median ``median``, sigma 0.8), rounded,
    in [1, ``cap``] (most completions end early, a few run to the budget)."""
    return max(1, min(cap, round(math.exp(math.log(median) + 0.8 * float(torch.randn((), generator=g))))))


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


class _RssSampler:
    """``base``: resident bytes on entry; ``peak``: the most seen by a thread reading /proc/self/statm every
    0.5 ms until exit (Linux; elsewhere both stay 0). ru_maxrss cannot serve: it is the process's
    high-water mark, which the warm-up calls have already set, so its growth reads 0."""

    PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def resident(cls) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * cls.PAGE
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(5e-4):
            self.peak = max(self.peak, self.resident())

    def __enter__(self) -> "_RssSampler":
        self.base = self.peak = self.resident()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.resident())


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    iters: int = 10,
    device: torch.device | str | None = None,
) -> Measurement:
    """Time ``fn()``; ``device`` picks CUDA events (cuda) or perf_counter (cpu, the default off-GPU)."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"measure needs iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        peak = torch.cuda.max_memory_allocated(dev) - base
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        with _RssSampler() as rss:  # one more call, untimed: the sampling thread would slow the timed ones
            fn()
        peak = rss.peak - rss.base
    return Measurement(
        median_s=statistics.median(times),
        p20_s=quantile(times, 0.2),
        p80_s=quantile(times, 0.8),
        peak_mem_bytes=int(max(peak, 0)),
        iters=iters,
    )


def measure_graph(fns: Sequence[Callable[[], object]], *, reps: int = 20, iters: int = 10) -> Measurement:
    """Per-call GPU time of microsecond kernels: ``reps`` rounds over ``fns`` captured in one CUDA graph.

    ``measure`` puts CUDA events around one Python call, so for a 20 µs kernel it also counts the
    tens of µs the CPU needs to launch it while the GPU idles. Decode runs as CUDA-graph replays, so
    this is how such kernels are timed here: capture ``reps`` passes over ``fns`` (e.g. the same op on
    several weight copies, so that the bytes touched exceed the L2 cache and every call streams from
    HBM), replay ``iters`` times, report replay time / (reps * len(fns)).
    """
    if not fns or reps < 1 or iters < 1:
        raise ValueError(f"measure_graph needs fns, reps >= 1 and iters >= 1, got {len(fns)}, {reps}, {iters}")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: compilation, autotuning, allocator
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    throwaway = torch.cuda.CUDAGraph()  # a first capture allocates cuBLAS's workspace for the capture stream,
    with torch.cuda.graph(throwaway):  # which would otherwise count as this op's peak memory; kept alive to
        for fn in fns:  # the end (deleting it may free that workspace again)
            fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (reps * len(fns)))
    peak = torch.cuda.max_memory_allocated() - base
    del graph, throwaway
    return Measurement(median_s=statistics.median(times), p20_s=quantile(times, 0.2), p80_s=quantile(times, 0.8),
                       peak_mem_bytes=int(max(peak, 0)), iters=iters)


def environment() -> dict:
    """Hardware and versions, recorded with every result."""
    env = {
        "date": _dt.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:  # triton is optional for some benchmarks
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["gpu"] = None
    return env


def results_dir() -> Path:
    out = os.environ.get("OUT")
    path = Path(out) if out else Path(__file__).resolve().parent / "results" / "local"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fmt(v) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.1f}"
        if abs(v) >= 1:
            return f"{v:.3f}"
        return f"{v:.4g}"
    return str(v)


class Report:
    """Rows of one benchmark, printed as a table and written as JSON + Markdown."""

    def __init__(self, name: str, title: str | None = None):
        self.name = name
        self.title = title or name
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.env = environment()

    def add(self, **row) -> dict:
        """Record a row; it is printed at once and the files are rewritten, so a benchmark cut off by a
        time limit still leaves every row it finished."""
        self.rows.append(row)
        print({k: _fmt(v) for k, v in row.items()}, flush=True)
        self._write()
        return row

    def note(self, text: str) -> None:
        self.notes.append(text)

    def markdown(self) -> str:
        lines = [f"# {self.title}", ""]
        lines += [f"- {k}: {v}" for k, v in self.env.items()]
        lines.append("")
        if self.rows:
            cols: list[str] = []
            for r in self.rows:
                cols += [c for c in r if c not in cols]
            lines.append("| " + " | ".join(cols) + " |")
            lines.append("|" + "---|" * len(cols))
            for r in self.rows:
                lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def _write(self) -> Path:
        """Both files atomically: a benchmark killed by its time limit leaves its last complete table."""
        out = results_dir()
        write_text_atomic(out / f"{self.name}.md", self.markdown())
        write_text_atomic(out / f"{self.name}.json", json.dumps(
            {"name": self.name, "env": self.env, "rows": self.rows, "notes": self.notes}, indent=2))
        return out / f"{self.name}.md"

    def save(self) -> Path:
        print(self.markdown(), flush=True)
        return self._write()
