"""The model's linear layer: ``nn.Linear`` with a decode fast path on the CPU.

A decode step multiplies a few rows by every weight matrix, so it runs at the speed the weights stream
from memory; torch's CPU GEMM/GEMV at 1-8 rows reads them well below the memory bandwidth (on the
2-core benchmark machine, one thread, a 32000x384 weight: 9.8 GB/s where one sequential stream reads at
25 GB/s). ``Linear`` sends

    y = x Wᵀ    with x, W fp32 and contiguous on the CPU, no bias, no gradient needed, at most
                CPU_DECODE_MAX_ROWS rows

to the native kernel ``llamarl._C.linear_f32_cpu`` (csrc/linear_cpu.cpp: one sequential pass over the
weights, register-tiled fused multiply-adds, AVX-512 / AVX2 picked at load time; 2.6x torch for that
weight at 1 row, 1.1-5x across the benchmark's shapes at 1-8 rows), and everything else — prefill,
training, other dtypes and devices — to ``F.linear``. Results differ from torch's only by fp32
summation order. ``LLAMARL_CPU_LINEAR=0`` in the environment (read once, at import) turns the native
path off, for A/B measurements.

It is an ``nn.Linear`` (same parameters, state-dict keys and ``isinstance``), so checkpoints, FSDP,
tensor parallelism and quantization treat it as one.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from llamarl._native import linear_f32_cpu_unchecked

CPU_DECODE_MAX_ROWS = 8
CPU_LINEAR = os.environ.get("LLAMARL_CPU_LINEAR", "1") != "0"
_FP32 = torch.float32


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through the native CPU decode kernel when the conditions above hold."""
    # cheapest tests first: this runs ~40 times per decode step
    if (CPU_LINEAR and x.is_cpu and x.dtype is _FP32 and w.dtype is _FP32 and w.is_cpu and bias is None
            and x.shape[-1] == w.shape[1] and x.numel() <= CPU_DECODE_MAX_ROWS * w.shape[1]
            and x.is_contiguous() and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
            and not torch.is_autocast_enabled("cpu")):  # autocast casts inside F.linear: mixed precision
        return linear_f32_cpu_unchecked(x, w)
    return F.linear(x, w, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    # the stacked-projection protocol (llamarl.models.stacked)
    def stack_tensors(self) -> tuple[torch.Tensor, ...] | None:
        """The tensors that projections stack along dim 0 to run as one product (None: cannot stack)."""
        params = self._parameters  # direct lookups: this runs once per projection per decode step
        return (params["weight"],) if params.get("bias") is None else None

    def stacked_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return linear(x, weight)
