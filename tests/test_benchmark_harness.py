"""benchmarks.harness.measure on the CPU: the peak memory a call adds is seen after the warm-up calls
(it read 0 for every repeatable call while it was the growth of ru_maxrss, the process's high-water mark)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness import measure  # noqa: E402

MIB = 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="the CPU sampler reads /proc/self/statm")
def test_cpu_peak_memory_counts_what_each_call_allocates():
    def holds_64_mib():
        x = torch.ones(16 * MIB)  # 64 MiB of fp32, touched
        for _ in range(20):  # held for ~20 sampling intervals
            x.add_(1.0)
        return x.sum()

    assert 48 * MIB <= measure(holds_64_mib, warmup=2, iters=3, device="cpu").peak_mem_bytes <= 80 * MIB
    assert measure(lambda: torch.ones(8).sum(), warmup=2, iters=3, device="cpu").peak_mem_bytes < 8 * MIB
