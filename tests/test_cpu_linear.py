"""The native CPU decode linear (csrc/linear_cpu.cpp) and the model's ``Linear`` that dispatches to it.

Reference: the same product in float64. fp32 results may differ from it by summation-order rounding,
bounded by ~K·eps·Σ|w·x|; every instruction-set path (AVX-512, AVX2, portable) is run in a subprocess
with LLAMARL_CPU_ISA capping the choice.
"""

from __future__ import annotations

import json

import pytest
import torch

from llamarl._native import linear_f32_cpu, native
from llamarl.models.linear import Linear
from native_harness import run_with_cpu_isa

SHAPES = [(1, 1, 1), (1, 7, 5), (2, 15, 4), (3, 16, 13), (4, 17, 64), (5, 33, 3), (8, 384, 1001), (16, 1000, 37),
          (13, 130, 257),
          # four-row tiles (AVX-512, M >= 5 and K >= 512, or M = 4 and K >= 2048): input remainders of 1, 2
          # and 3, leftover rows, K tails
          (5, 512, 9), (7, 513, 6), (6, 527, 4), (8, 768, 3), (4, 2048, 7), (4, 2049, 5)]


def _check(M: int, K: int, N: int, threads: int = 1, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    w[N // 2] = 0.0  # a zero row
    if N - 1 != N // 2:
        w[N - 1, 0] = 3e4  # a large entry
    ref = x.double() @ w.double().T
    bound = 4 * K * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T) + 1e-30
    torch.set_num_threads(threads)
    y = linear_f32_cpu(x, w)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"M={M} K={K} N={N}: error {float((err / bound).max()):.3g}x the bound"
    assert bool((y[:, N // 2] == 0).all())


@pytest.mark.parametrize("M, K, N", SHAPES)
def test_matches_fp64_on_odd_shapes(M, K, N):
    _check(M, K, N)


@pytest.mark.parametrize("M, K", [(3, 512), (4, 2048), (8, 768)])
def test_threads_split_the_rows_without_changing_a_bit(M, K):
    x, w = torch.randn(M, K), torch.randn(4099, K)  # 2 threads: the split falls inside a block of four rows
    torch.set_num_threads(1)
    one = linear_f32_cpu(x, w)
    torch.set_num_threads(2)
    try:
        two = linear_f32_cpu(x, w)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(one, two)  # each output is one dot product, summed in the same order by any thread
    # ... and by any tile: a row's result does not depend on the batch around it
    assert all(torch.equal(linear_f32_cpu(x[m:m + 1], w), one[m:m + 1]) for m in range(M))


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_every_instruction_set_path(isa):
    code = ("import json, torch; from tests.test_cpu_linear import SHAPES, _check; from llamarl._native import native\n"
            "for s in SHAPES: _check(*s)\n"
            "print(json.dumps(native().linear_cpu_isa()))")
    got = json.loads(run_with_cpu_isa(code, isa))
    want = {"avx2": "avx2+fma", "scalar": "scalar"}[isa]
    assert got == want or (isa == "avx2" and got == "scalar"), got  # a host without AVX2 runs the portable path


def test_isa_is_reported():
    assert native().linear_cpu_isa() in ("avx512f", "avx2+fma", "scalar")


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="float32"):
        linear_f32_cpu(torch.randn(1, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="do not multiply"):
        linear_f32_cpu(torch.randn(1, 4), torch.randn(3, 5))


def test_linear_uses_the_kernel_only_for_small_no_grad_fp32_inputs(monkeypatch):
    import llamarl.models.linear as mod

    calls = []
    monkeypatch.setattr(mod, "linear_f32_cpu_unchecked", lambda x, w: calls.append(x.shape) or linear_f32_cpu(x, w))
    lin = Linear(24, 40, bias=False)
    x = torch.randn(2, 3, 24)
    with torch.no_grad():
        y = lin(x)  # 6 rows: native
        torch.testing.assert_close(y, x @ lin.weight.T, rtol=1e-5, atol=1e-5)
        lin(torch.randn(9, 24))  # more rows than a decode step: F.linear
        lin(torch.randn(24, 2).T)  # not contiguous: F.linear
        lin.double()(torch.randn(2, 24, dtype=torch.float64))  # fp64: F.linear
    assert calls == [(2, 3, 24)]
    lin.float()
    out = lin(torch.randn(2, 24))  # autograd on: F.linear, and the gradient flows
    out.sum().backward()
    assert lin.weight.grad is not None and calls == [(2, 3, 24)]
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == {"weight"}
