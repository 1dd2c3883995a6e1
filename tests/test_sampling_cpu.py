"""The native CPU sampler (csrc/sampling_cpu.cpp via llamarl.generation.sampling.sample_native_cpu) against
torch: greedy = torch.argmax (first index on ties), log-probs = float64 log_softmax(z / T) at the token,
sampled tokens follow softmax(z / T) and never take a zero-probability entry; NaN rows report NaN."""

from __future__ import annotations

import pytest
import torch

from llamarl.generation.sampling import SamplingParams, sample_native_cpu, sample_tokens
from native_harness import run_with_cpu_isa


def _ref_logprobs(z: torch.Tensor, tokens: torch.Tensor, T: float) -> torch.Tensor:
    zt = z.double() / (T if T > 0 else 1.0)
    return torch.log_softmax(zt, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize("V", [1, 15, 16, 17, 1000, 32003])
def test_greedy_is_argmax_with_the_right_logprob(V):
    g = torch.Generator().manual_seed(V)
    z = torch.randn(9, V, generator=g) * 4
    if V > 3:
        z[1, V // 2] = z[1, 1] = z[1].max() + 1  # a tie: the first index wins, as torch.argmax
        z[2, :] = 0.5  # every entry ties
        z[3, V - 1] = 1e4  # the max in the last (partial) block
    tokens, lp = sample_native_cpu(z, 0.0, None)
    assert torch.equal(tokens, z.argmax(-1))
    torch.testing.assert_close(lp.double(), _ref_logprobs(z, tokens, 0.0), rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("T", [0.7, 1.0, 1.6])
def test_sampling_follows_softmax_and_skips_impossible_tokens(T):
    V, rows = 37, 120_000
    g = torch.Generator().manual_seed(3)
    z = torch.randn(V, generator=g) * 2
    z[0], z[17], z[36] = float("-inf"), float("-inf"), float("-inf")  # first, middle, last: probability 0
    tokens, lp = sample_native_cpu(z.expand(rows, V).contiguous(), T, torch.Generator().manual_seed(11))
    p = torch.softmax(z.double() / T, -1)
    freq = torch.bincount(tokens, minlength=V).double() / rows
    assert (freq[p == 0] == 0).all()
    assert 0.5 * (freq - p).abs().sum().item() < 0.01  # total variation; its sampling noise is ~0.006
    torch.testing.assert_close(lp.double(), _ref_logprobs(z.expand(rows, V), tokens, T), rtol=1e-6, atol=2e-6)


def test_sampling_is_seeded_and_handles_large_vocabularies():
    z = torch.randn(6, 32003, generator=torch.Generator().manual_seed(0)) * 3
    a = sample_native_cpu(z, 1.0, torch.Generator().manual_seed(5))
    b = sample_native_cpu(z, 1.0, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.testing.assert_close(a[1].double(), _ref_logprobs(z, a[0], 1.0), rtol=1e-6, atol=2e-6)
    # a dominant token is drawn (u < 1 - its tiny complement), wherever it sits
    z2 = torch.zeros(3, 32003)
    z2[0, 0], z2[1, 20000], z2[2, 32002] = 60.0, 60.0, 60.0
    assert sample_native_cpu(z2, 1.0, torch.Generator().manual_seed(1))[0].tolist() == [0, 20000, 32002]


def test_nan_rows_report_nan():
    z = torch.randn(3, 40)
    z[1, 7], z[1, 30] = float("nan"), float("nan")
    for T in (0.0, 1.0):
        tokens, lp = sample_native_cpu(z, T, torch.Generator().manual_seed(0))
        assert tokens[1] == 7 and torch.isnan(lp[1]) and torch.isfinite(lp[[0, 2]]).all()


def test_portable_sampler_path():
    """Hosts without AVX-512 run the portable sampler: the same tests in a process capped at AVX2."""
    code = ("import tests.test_sampling_cpu as t\n"
            "for V in (1, 15, 16, 17, 1000): t.test_greedy_is_argmax_with_the_right_logprob(V)\n"
            "t.test_sampling_follows_softmax_and_skips_impossible_tokens(0.7)\n"
            "t.test_sampling_is_seeded_and_handles_large_vocabularies(); t.test_nan_rows_report_nan()\n"
            "from llamarl._native import native; print(native().linear_cpu_isa())")
    assert run_with_cpu_isa(code, "avx2") in ("avx2+fma", "scalar")


def test_logits_must_be_one_row_per_sequence():
    """[B, T, V] logits gave the right greedy tokens with log-probs from the wrong rows ([B, 1, T])."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    for shape in ((2, 3, 5), (5,)):
        with pytest.raises(ValueError, match=r"sample_tokens: logits must be \[N, V\]"):
            sample_tokens(torch.randn(shape), params, None)
