"""fused_logprobs (Triton, interpreted on CPU) against float64 references.

Rule: our max error vs the fp64 reference is at most 2x the eager same-dtype error (plus a few ulps of
the value scale, so that an eager error of exactly 0 does not demand bit equality).
"""

import math

import pytest
import torch

from llamarl.algorithms import token_logprobs
from llamarl_kernels import fused_logprobs
from llamarl_kernels.reference import logprobs_from_hidden_ref


def assert_within_2x_eager(ours, eager, exact, what, ulps=4):
    ours, eager, exact = (t.detach().double().cpu() for t in (ours, eager, exact))
    err_ours = (ours - exact).abs().max().item()
    err_eager = (eager - exact).abs().max().item()
    floor = ulps * torch.finfo(torch.float32).eps * exact.abs().max().item()
    message = f"{what}: ours {err_ours:.3e} vs eager {err_eager:.3e} (floor {floor:.1e})"
    assert err_ours <= 2 * err_eager + floor, message


def _inputs(n, d, v, seed, logit_scale=2.0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = torch.randn(v, d, generator=g) * (logit_scale / math.sqrt(d))
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden.to(device, dtype), weight.to(device, dtype), targets.to(device)


@pytest.mark.parametrize(
    "n, d, v, chunk, temperature",
    [
        (37, 48, 1000, 16, 1.0),  # three chunks, the last one partial; V not a multiple of the block
        (37, 48, 1031, None, 0.7),  # default chunking (one chunk), prime-ish V, temperature < 1
        (5, 16, 100, 2, 1.6),  # V smaller than one block
    ],
)
def test_matches_fp64_reference(n, d, v, chunk, temperature):
    hidden, weight, targets = _inputs(n, d, v, seed=n + v)
    lp, ent = fused_logprobs(hidden, weight, targets, temperature, chunk_size=chunk)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (n,)
    exact_lp, exact_ent = logprobs_from_hidden_ref(hidden.double(), weight.double(), targets, temperature)
    eager_lp, eager_ent = logprobs_from_hidden_ref(hidden, weight, targets, temperature)
    assert_within_2x_eager(lp, eager_lp, exact_lp, "logprobs")
    assert_within_2x_eager(ent, eager_ent, exact_ent, "entropy")
    # the reference is the same convention as the framework's token_logprobs
    spec_lp, spec_ent = token_logprobs(hidden.double() @ weight.double().t(), targets, temperature)
    torch.testing.assert_close(exact_lp, spec_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(exact_ent, spec_ent, rtol=1e-12, atol=1e-12)


def test_peaked_distributions_and_strided_hidden():
    """Logits of magnitude ~100 (entropy near 0) stay accurate; a non-contiguous hidden view works."""
    hidden, weight, targets = _inputs(24, 32, 700, seed=3, logit_scale=60.0)
    targets[:12] = (hidden[:12] @ weight.t()).argmax(-1)  # half the rows ask for the top token
    wide = torch.zeros(24, 64)
    wide[:, ::2] = hidden
    strided = wide[:, ::2]
    assert not strided.is_contiguous()
    lp, ent = fused_logprobs(strided, weight, targets, 1.0, chunk_size=10)
    exact_lp, exact_ent = logprobs_from_hidden_ref(hidden.double(), weight.double(), targets)
    eager_lp, eager_ent = logprobs_from_hidden_ref(hidden, weight, targets)
    assert exact_ent.min() < 1e-3 and torch.all(ent >= 0)
    assert_within_2x_eager(lp, eager_lp, exact_lp, "logprobs")
    assert_within_2x_eager(ent, eager_ent, exact_ent, "entropy")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=torch.zeros(4, 8, 2)), r"hidden must be \[N, D\]"),
        (dict(weight=torch.zeros(10, 9)), "hidden size must match"),
        (dict(weight=torch.zeros(10, 8, dtype=torch.float64)), "dtype"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.float64), weight=torch.zeros(10, 8, dtype=torch.float64)),
         "not supported"),
        (dict(targets=torch.tensor([0, 1, 2, 10])), r"\[0, V=10\)"),
        (dict(targets=torch.tensor([0, 1, -1, 2])), r"\[0, V=10\)"),
        (dict(targets=torch.tensor([0, 1, 2])), r"targets has shape \(3,\)"),
        (dict(targets=torch.zeros(4)), "int64 or int32"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(weight=torch.zeros(10, 8, device="meta")), "one device"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(hidden=torch.zeros(4, 8), weight=torch.zeros(10, 8), targets=torch.tensor([0, 1, 2, 3]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fused_logprobs(**args)


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    import llamarl_kernels.logprobs as mod

    monkeypatch.setattr(mod, "INTERPRETING", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_logprobs(torch.zeros(4, 8), torch.zeros(10, 8), torch.tensor([0, 1, 2, 3]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_fp64_reference(dtype):
    hidden, weight, targets = _inputs(1000, 256, 32011, seed=7, device="cuda", dtype=dtype)
    lp, ent = fused_logprobs(hidden, weight, targets, 0.9, chunk_size=384)
    exact_lp, exact_ent = logprobs_from_hidden_ref(hidden.double(), weight.double(), targets, 0.9)
    eager_lp, eager_ent = logprobs_from_hidden_ref(hidden, weight, targets, 0.9)
    assert_within_2x_eager(lp, eager_lp, exact_lp, f"logprobs {dtype}")
    assert_within_2x_eager(ent, eager_ent, exact_ent, f"entropy {dtype}")
