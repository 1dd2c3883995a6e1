"""The eager AIPO specification (llamarl.algorithms.aipo): hand-computed values, gradients, options,
estimators and input errors; token_logprobs against torch's cross-entropy and Categorical entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from llamarl.algorithms import aipo_loss, token_logprobs

# five flat tokens; token 0 has ratio e^1.5 > rho = 2, token 3 is masked out
LP = [-1.0, -2.0, -0.5, -3.0, -0.1]
BLP = [-2.5, -1.0, -0.5, -0.2, -0.3]
ADV = [1.0, -2.0, 0.5, 3.0, -1.0]
MASK = [1, 1, 1, 0, 1]
RHO = 2.0


def _flat_inputs(dtype=torch.float64):
    lp = torch.tensor(LP, dtype=dtype, requires_grad=True)
    return lp, torch.tensor(BLP, dtype=dtype), torch.tensor(ADV, dtype=dtype), torch.tensor(MASK)


def test_hand_computed_loss_metrics_and_gradient():
    lp, blp, adv, mask = _flat_inputs()
    loss, metrics = aipo_loss(lp, blp, adv, mask, rho=RHO)
    on = [i for i in range(5) if MASK[i]]
    ratios = {i: math.exp(LP[i] - BLP[i]) for i in on}
    w = {i: min(ratios[i], RHO) for i in on}
    expected = sum(-w[i] * ADV[i] * LP[i] for i in on) / len(on)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(ratios.values()) / 4, rel=1e-12)
    assert metrics["ratio_max"].item() == pytest.approx(math.exp(1.5), rel=1e-12)
    assert metrics["truncated_frac"].item() == pytest.approx(0.25)
    k3 = sum(r - 1 - math.log(r) for r in ratios.values()) / 4
    assert metrics["mismatch_kl"].item() == pytest.approx(k3, rel=1e-12)
    assert metrics["tokens"].item() == 4
    assert "entropy" not in metrics and "kl_ref" not in metrics
    loss.backward()
    grad = [-w[i] * ADV[i] / 4 if MASK[i] else 0.0 for i in range(5)]  # w is a constant
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=0)


# π_old for the clip test: q = π/π_old = e^0.5 (token 0, A > 0: above 1 + ε_high, clipped), e^-0.5
# (token 1, A < 0: below 1 − ε_low, clipped), 1 (token 2), e^-0.5 (token 4, A < 0 ... clipped), masked 3
OLD = [-1.5, -1.5, -0.5, -3.0, 0.4]


def test_decoupled_clip_hand_computed():
    """ℓ_t = −min(π_old/μ, ρ) · min(q A, clip(q, 1 − ε_l, 1 + ε_h) A), q = π/π_old: value, gradient
    (0 where the clip holds, −w A q / M elsewhere) and clip_frac, computed by hand."""
    lp, blp, adv, mask = _flat_inputs()
    eps_low, eps_high = 0.2, 0.28
    old = torch.tensor(OLD, dtype=torch.float64)
    loss, metrics = aipo_loss(lp, blp, adv, mask, rho=RHO, old_logprobs=old, clip=(eps_low, eps_high))
    on = [i for i in range(5) if MASK[i]]
    w = {i: min(math.exp(OLD[i] - BLP[i]), RHO) for i in on}
    q = {i: math.exp(LP[i] - OLD[i]) for i in on}
    clipped = {i: (ADV[i] > 0 and q[i] > 1 + eps_high) or (ADV[i] < 0 and q[i] < 1 - eps_low) for i in on}
    assert [i for i in on if clipped[i]] == [0, 1, 4] and not clipped[2]
    surrogate = {i: min(q[i] * ADV[i], min(max(q[i], 1 - eps_low), 1 + eps_high) * ADV[i]) for i in on}
    assert loss.item() == pytest.approx(sum(-w[i] * surrogate[i] for i in on) / 4, rel=1e-12)
    assert metrics["clip_frac"].item() == pytest.approx(0.75)
    assert metrics["truncated_frac"].item() == pytest.approx(sum(math.exp(OLD[i] - BLP[i]) > RHO for i in on) / 4)
    assert metrics["ratio_mean"].item() == pytest.approx(sum(math.exp(LP[i] - BLP[i]) for i in on) / 4)
    loss.backward()
    grad = [0.0 if (not MASK[i] or clipped[i]) else -w[i] * ADV[i] * q[i] / 4 for i in range(5)]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_clip_without_old_logprobs_has_aipos_gradient(norm):
    """The first update of a step (π_old = π): q = 1, nothing is clipped, and the gradient is AIPO's exactly."""
    g = torch.Generator().manual_seed(0)
    lp0 = torch.randn(3, 6, generator=g, dtype=torch.float64) - 2.0
    blp = lp0 + 0.7 * torch.randn(3, 6, generator=g, dtype=torch.float64)
    adv, mask = torch.randn(3, generator=g, dtype=torch.float64), torch.rand(3, 6, generator=g) > 0.3
    grads, metrics = [], []
    for clip in (None, (0.2, 0.28)):
        lp = lp0.clone().requires_grad_()
        loss, m = aipo_loss(lp, blp, adv, mask, rho=RHO, norm=norm, clip=clip)
        loss.backward()
        grads.append(lp.grad)
        metrics.append(m)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-14, atol=0)
    assert metrics[1]["clip_frac"].item() == 0.0 and "clip_frac" not in metrics[0]
    for key in ("ratio_mean", "truncated_frac", "mismatch_kl"):
        assert metrics[1][key].item() == pytest.approx(metrics[0][key].item(), rel=1e-14)


@pytest.mark.parametrize("shape", ["flat", "2d"])
def test_constant_norm_divides_the_sum_by_the_given_constant(shape):
    """norm="constant" (Dr. GRPO): Σ_t m_t ℓ_t / C, the same for flat and [B, T] inputs; value and gradient."""
    lp, blp, adv, mask = _flat_inputs()
    args = (lp, blp, adv, mask) if shape == "flat" else (lp.view(1, 5), blp.view(1, 5), adv.view(1, 5), mask.view(1, 5))
    loss, metrics = aipo_loss(*args, rho=RHO, norm="constant", norm_constant=40.0)
    on = [i for i in range(5) if MASK[i]]
    w = {i: min(math.exp(LP[i] - BLP[i]), RHO) for i in on}
    assert loss.item() == pytest.approx(sum(-w[i] * ADV[i] * LP[i] for i in on) / 40.0, rel=1e-12)
    assert metrics["tokens"].item() == 4  # metrics stay token means
    loss.backward()
    grad = [-w[i] * ADV[i] / 40.0 if MASK[i] else 0.0 for i in range(5)]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-12, atol=0)


def test_unbounded_rho_is_plain_importance_weighting():
    lp, blp, adv, mask = _flat_inputs()
    loss, metrics = aipo_loss(lp, blp, adv, mask, rho=math.inf)
    expected = sum(-math.exp(LP[i] - BLP[i]) * ADV[i] * LP[i] for i in range(5) if MASK[i]) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["truncated_frac"].item() == 0.0


def test_kl_to_reference_and_entropy_bonus():
    lp, blp, adv, mask = _flat_inputs()
    ref = torch.tensor([-1.2, -1.7, -0.9, -2.0, -0.2], dtype=torch.float64)
    ent = torch.tensor([2.0, 1.5, 0.3, 4.0, 1.0], dtype=torch.float64, requires_grad=True)
    beta, gamma = 0.1, 0.01
    loss, metrics = aipo_loss(lp, blp, adv, mask, RHO, ref_logprobs=ref, kl_coef=beta, entropy=ent,
                              entropy_coef=gamma)
    base, _ = aipo_loss(lp.detach(), blp, adv, mask, RHO)
    on = [i for i in range(5) if MASK[i]]
    k3 = [math.exp(ref[i].item() - LP[i]) - (ref[i].item() - LP[i]) - 1 for i in range(5)]
    assert metrics["kl_ref"].item() == pytest.approx(sum(k3[i] for i in on) / 4, rel=1e-12)
    assert metrics["entropy"].item() == pytest.approx(sum(ent[i].item() for i in on) / 4, rel=1e-12)
    expected = base.item() + beta * metrics["kl_ref"].item() - gamma * metrics["entropy"].item()
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    grad_lp = [
        (-min(math.exp(LP[i] - BLP[i]), RHO) * ADV[i] + beta * (1 - math.exp(ref[i].item() - LP[i]))) / 4
        if MASK[i] else 0.0
        for i in range(5)
    ]
    torch.testing.assert_close(lp.grad, torch.tensor(grad_lp, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ent.grad, torch.tensor([-gamma / 4 if MASK[i] else 0.0 for i in range(5)],
                                                      dtype=torch.float64), rtol=1e-12, atol=0)


def test_k2_kl_estimator_loss_and_gradient():
    """kl_estimator="k2": the term β ½ (logπ − logπ_ref)², gradient β (logπ − logπ_ref); kl_ref stays k3."""
    lp, blp, adv, mask = _flat_inputs()
    ref = torch.tensor([-1.2, -1.7, -0.9, -2.0, -0.2], dtype=torch.float64)
    beta = 0.3
    loss, metrics = aipo_loss(lp, blp, adv, mask, RHO, ref_logprobs=ref, kl_coef=beta, kl_estimator="k2")
    base, _ = aipo_loss(lp.detach(), blp, adv, mask, RHO)
    on = [i for i in range(5) if MASK[i]]
    k2 = sum(0.5 * (LP[i] - ref[i].item()) ** 2 for i in on) / 4
    k3 = sum(math.exp(ref[i].item() - LP[i]) - (ref[i].item() - LP[i]) - 1 for i in on) / 4
    assert loss.item() == pytest.approx(base.item() + beta * k2, rel=1e-12)
    assert metrics["kl_ref"].item() == pytest.approx(k3, rel=1e-12)
    loss.backward()
    grad_lp = [(-min(math.exp(LP[i] - BLP[i]), RHO) * ADV[i] + beta * (LP[i] - ref[i].item())) / 4 if MASK[i] else 0.0
               for i in range(5)]
    torch.testing.assert_close(lp.grad, torch.tensor(grad_lp, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match=r"kl_estimator must be one of \('k3', 'k2'\), got 'k1'"):
        aipo_loss(lp, blp, adv, mask, RHO, ref_logprobs=ref, kl_coef=beta, kl_estimator="k1")


def test_sequence_norm_skips_empty_rows_and_broadcasts_sequence_advantages():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.4, -0.6], [-1.5, -0.2, -0.7]], dtype=torch.float64)
    blp = lp - 0.1
    adv_seq = torch.tensor([1.0, 5.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    w = math.exp(0.1)
    row0 = -w * 1.0 * (-1.0 - 2.0) / 2
    row2 = -w * -2.0 * (-1.5 - 0.2 - 0.7) / 3
    loss, _ = aipo_loss(lp, blp, adv_seq, mask, RHO, norm="sequence")
    assert loss.item() == pytest.approx((row0 + row2) / 2, rel=1e-12)  # the empty row does not count
    per_token_adv = adv_seq[:, None].expand(3, 3)
    same, _ = aipo_loss(lp, blp, per_token_adv, mask, RHO, norm="sequence")
    assert same.item() == loss.item()
    tok, _ = aipo_loss(lp, blp, adv_seq, mask, RHO, norm="token")
    assert tok.item() == pytest.approx((row0 * 2 + row2 * 3) / 5, rel=1e-12)


def test_masked_entries_do_not_matter_and_all_masked_is_zero():
    torch.manual_seed(0)
    lp = torch.randn(4, 6, dtype=torch.float64) - 2
    blp, adv = lp + 0.2 * torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.4
    lp2 = torch.where(mask, lp, lp - 50.0)  # masked entries changed wildly (ratio e^-50 there)
    l1, m1 = aipo_loss(lp.requires_grad_(), blp, adv, mask)
    l2, m2 = aipo_loss(lp2.requires_grad_(), blp, adv, mask)
    assert l1.item() == pytest.approx(l2.item(), rel=1e-12)
    for key in m1:
        assert m1[key].item() == pytest.approx(m2[key].item(), rel=1e-12)
    lp.grad = None
    zero_loss, metrics = aipo_loss(lp, blp, adv, torch.zeros(4, 6, dtype=torch.bool))
    assert zero_loss.item() == 0.0 and zero_loss.requires_grad
    zero_loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert all(v.item() == 0.0 for v in metrics.values())


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_overflowing_ratio_and_kl_term_stay_out_of_loss_and_gradient(norm, dtype):
    """rho = inf with a masked ratio that overflows (and a masked exp(ref - logπ) that does): the loss and
    the gradient are those of the same inputs with the masked entries made harmless (was NaN)."""
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.5, -0.7]], dtype=dtype)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    adv, blp, ref = torch.tensor([1.0, -0.5], dtype=dtype), lp - 0.1, lp + 0.2
    wild_blp, wild_ref = blp.clone(), ref.clone()
    wild_blp[0, 2] = wild_ref[1, 1] = -1e4 if dtype == torch.float64 else -200.0  # ratio overflows there
    wild_ref[0, 2] = wild_blp[1, 1] = 1e4 if dtype == torch.float64 else 200.0  # exp(ref - logπ) overflows
    results = []
    for b, r in ((blp, ref), (wild_blp, wild_ref)):
        x = lp.clone().requires_grad_()
        loss, metrics = aipo_loss(x, b, adv, mask, rho=math.inf, ref_logprobs=r, kl_coef=0.1, norm=norm)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    (loss, grad, metrics), (wild_loss, wild_grad, wild_metrics) = results
    assert torch.isfinite(wild_loss) and torch.equal(wild_loss, loss)
    assert torch.equal(wild_grad, grad) and torch.equal(grad[mask == 0], torch.zeros(2, dtype=dtype))
    assert all(torch.equal(wild_metrics[k], metrics[k]) for k in metrics)


def test_mismatch_kl_estimates_kl_of_mu_from_pi():
    """On tokens sampled from μ, mean(r − 1 − log r) with r = π/μ is an unbiased estimate of KL(μ‖π)."""
    gen = torch.Generator().manual_seed(1)
    mu = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    pi = torch.softmax(mu.log() + 0.4 * torch.randn(6, generator=gen, dtype=torch.float64), 0)
    y = torch.multinomial(mu, 200_000, replacement=True, generator=gen)
    lp, blp = pi.log()[y], mu.log()[y]
    _, metrics = aipo_loss(lp, blp, torch.zeros_like(lp), torch.ones_like(lp), rho=10.0)
    exact = (mu * (mu.log() - pi.log())).sum().item()
    r = (lp - blp).exp()
    stderr = (r - 1 - (lp - blp)).std().item() / math.sqrt(len(y))
    assert abs(metrics["mismatch_kl"].item() - exact) < 5 * stderr
    _, on_policy = aipo_loss(lp, lp.clone(), torch.zeros_like(lp), torch.ones_like(lp))
    assert on_policy["mismatch_kl"].item() == 0.0 and on_policy["ratio_mean"].item() == 1.0


def test_bf16_inputs_give_fp32_loss_and_validate_false_matches():
    lp, blp, adv, mask = _flat_inputs(torch.bfloat16)
    loss, metrics = aipo_loss(lp, blp, adv, mask, RHO)
    assert loss.dtype == torch.float32 and metrics["ratio_mean"].dtype == torch.float32
    loss_nv, _ = aipo_loss(lp, blp, adv, mask, RHO, validate=False)
    assert loss.item() == loss_nv.item()


def test_token_logprobs_matches_cross_entropy_and_categorical_entropy():
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 3, 11, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, 11, (2, 3))
    for temperature in (1.0, 0.7):
        lp, ent = token_logprobs(logits, targets, temperature)
        ce = F.cross_entropy((logits / temperature).reshape(-1, 11), targets.reshape(-1), reduction="none")
        torch.testing.assert_close(lp, -ce.view(2, 3), rtol=1e-12, atol=1e-12)
        cat = torch.distributions.Categorical(logits=logits / temperature)
        torch.testing.assert_close(ent, cat.entropy(), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, 0.7), (logits,))
    lp16, ent16 = token_logprobs(logits.detach().bfloat16(), targets)
    assert lp16.dtype == torch.float32 and ent16.dtype == torch.float32


@pytest.mark.parametrize(
    "logits, targets, temperature, match",
    [
        (torch.zeros(3, 5), torch.tensor([0, 5, 1]), 1.0, r"\[0, 5\)"),
        (torch.zeros(3, 5), torch.tensor([0, -1, 1]), 1.0, r"\[0, 5\)"),
        (torch.zeros(3, 5), torch.tensor([0, 1]), 1.0, "shape"),
        (torch.zeros(3, 5), torch.zeros(3), 1.0, "integer"),
        (torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), 0.0, "temperature"),
        (torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long), 1.0, "floating-point"),
    ],
)
def test_token_logprobs_bad_input(logits, targets, temperature, match):
    with pytest.raises(ValueError, match=match):
        token_logprobs(logits, targets, temperature)


def _bad(**overrides):
    args = dict(logprobs=torch.zeros(2, 3), behavior_logprobs=torch.zeros(2, 3), advantages=torch.zeros(2),
                mask=torch.ones(2, 3), rho=2.0)
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "args, match",
    [
        (_bad(behavior_logprobs=torch.zeros(2, 4)), r"behavior_logprobs has shape \(2, 4\)"),
        (_bad(mask=torch.ones(3, 3)), r"mask has shape"),
        (_bad(advantages=torch.zeros(3)), r"advantages has shape \(3,\)"),
        (_bad(logprobs=torch.zeros(2, 3, 1), behavior_logprobs=torch.zeros(2, 3, 1)), r"\[B, T\] or flat"),
        (_bad(behavior_logprobs=torch.zeros(2, 3, device="meta")), "meta"),
        (_bad(behavior_logprobs=torch.tensor([[0.0, float("nan"), 0.0]] * 2)), "behavior_logprobs contains NaN"),
        (_bad(advantages=torch.tensor([float("inf"), 0.0])), "advantages contains NaN or inf"),
        (_bad(rho=0.0), "rho"),
        (_bad(rho=-1.0), "rho"),
        (_bad(rho=float("nan")), "rho"),
        (_bad(mask=torch.full((2, 3), 2.0)), "mask must be boolean"),
        (_bad(norm="batch"), "norm"),
        (_bad(kl_coef=0.1), "needs ref_logprobs"),
        (_bad(kl_coef=-0.1, ref_logprobs=torch.zeros(2, 3)), "kl_coef"),
        (_bad(entropy_coef=0.1), "needs entropy"),
        (_bad(logprobs=torch.zeros(2, 3, requires_grad=True), entropy_coef=0.1, entropy=torch.ones(2, 3)),
         "entropy that carries no gradient"),  # the bonus would reach the loss's value, not its gradient
        (_bad(ref_logprobs=torch.zeros(2, 2)), "ref_logprobs has shape"),
        (_bad(logprobs=torch.zeros(6), behavior_logprobs=torch.zeros(6), advantages=torch.zeros(6),
              mask=torch.ones(6), norm="sequence"), "norm='sequence' needs"),
        (_bad(logprobs=torch.zeros(2, 3, dtype=torch.long)), "floating-point"),
        (_bad(norm="constant"), r"norm='constant' needs norm_constant"),
        (_bad(norm="constant", norm_constant=0.0), r"norm='constant' needs norm_constant"),
        (_bad(norm_constant=10.0), r"norm_constant is only read with norm='constant'"),
        (_bad(clip=(1.0, 0.2)), r"clip must be None or \(eps_low, eps_high\)"),
        (_bad(clip=(0.2, -0.1)), "clip must be"),
        (_bad(clip=0.2), "clip must be"),
        (_bad(clip=(0.2, float("inf"))), "clip must be"),
        (_bad(old_logprobs=torch.zeros(2, 3)), "old_logprobs is only read with clip"),
        (_bad(old_logprobs=torch.zeros(3, 2), clip=(0.2, 0.2)), "old_logprobs has shape"),
    ],
)
def test_aipo_loss_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        aipo_loss(**args)


def test_token_logprobs_entropy_modes():
    """"detached" is the same entropy outside autograd (a metric: no [..., V] tensor saved for backward),
    "none" skips it; the log-probs and their gradient are the same in every mode."""
    logits = torch.randn(3, 5, 37, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (3, 5))
    results = {}
    for mode in ("grad", "detached", "none"):
        lp, ent = token_logprobs(logits, targets, 0.7, entropy=mode)
        (grad,) = torch.autograd.grad(lp.sum(), logits)
        results[mode] = (lp.detach(), ent, grad)
    ref = torch.log_softmax(logits.detach() / 0.7, -1)
    assert torch.allclose(results["grad"][0], ref.gather(-1, targets[..., None]).squeeze(-1), atol=1e-12)
    assert results["grad"][1].requires_grad and not results["detached"][1].requires_grad
    assert torch.equal(results["grad"][1].detach(), results["detached"][1]) and results["none"][1] is None
    for mode in ("detached", "none"):
        assert torch.equal(results[mode][0], results["grad"][0]) and torch.equal(results[mode][2], results["grad"][2])
    with pytest.raises(ValueError, match="entropy must be one of"):
        token_logprobs(logits, targets, entropy="yes")
