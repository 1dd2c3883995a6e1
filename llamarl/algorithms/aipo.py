"""AIPO — asynchronous importance-weighted policy optimisation: the eager specification of the loss.

Every generated token t carries logπ_t (the trainer's log-prob of the sampled token, differentiable),
logμ_t (the log-prob under the generator that sampled it, possibly several policy versions old),
an advantage A_t and a mask m_t ∈ {0, 1} (1 = a generated token that is trained on). Then

    r_t   = exp(logπ_t − logμ_t)                      importance ratio π/μ
    w_t   = min(r_t, ρ)                               one-sided truncation, detached (no gradient)
    ℓ_t   = − w_t · A_t · logπ_t                      so ∇ℓ_t = − w_t · A_t · ∇logπ_t
          + β · k3_t,   k3_t = exp(logπ_ref,t − logπ_t) − (logπ_ref,t − logπ_t) − 1   (optional KL)
            (or β · k2_t, k2_t = ½ (logπ_t − logπ_ref,t)²,  with ``kl_estimator="k2"``)
          − γ · H_t                                   (optional entropy bonus, H_t = entropy of π at t)
    loss  = Σ_t m_t ℓ_t / Σ_t m_t                                     norm="token"  (default)
          = mean over non-empty rows b of Σ_t m_bt ℓ_bt / Σ_t m_bt      norm="sequence"
          = Σ_t m_t ℓ_t / C                                                norm="constant"

norm="constant" is Dr. GRPO's normalisation (TRL's loss_type="dr_grpo", veRL's "seq-mean-token-sum-norm"):
with C = (number of sequences) × (the generation length limit), passed as ``norm_constant``, every token
weighs the same whatever the length of its sequence, and the loss has no length bias (the token mean
favours long wrong answers over short ones within a batch; the sequence mean favours short ones).

k3 (Schulman's estimator) is a non-negative estimate of KL(π‖π_ref), unbiased for tokens sampled from
π. Here the tokens come from μ and the term is not importance-weighted (GRPO's convention), so ``kl_ref``
is its value under μ ≈ π; and its gradient is not that of KL(π‖π_ref): differentiated through logπ
at the sampled tokens, E_π[∇k3] = −E_π[(π_ref/π) ∇logπ] = ∇KL(π_ref‖π), the reverse KL. Both pull π
toward π_ref; the reverse KL penalises π missing π_ref's mass rather than putting mass where π_ref has little.
``kl_estimator="k2"`` (veRL's "mse") differentiates to (logπ_t − logπ_ref,t) ∇logπ_t, whose expectation under π
is ∇KL(π‖π_ref) itself (E_π[∇logπ] = 0 removes the +1 of ∇ log(π/π_ref)): the forward KL's gradient, exact
for tokens sampled from π. ``kl_ref`` stays the k3 estimate of the value either way (non-negative, low
variance). (k1 = logπ − logπ_ref has E_π[∇k1] = 0: no use as a loss term, so it is not offered.)
``rho`` may be ``math.inf`` (no truncation); β ≥ 0; γ is any finite number.

Several updates per batch (decoupled PPO clip, ``clip=(ε_low, ε_high)``). When one batch of samples
feeds several optimizer updates (mini-batches, epochs), π moves away from the policy π_old the step
started from, and a step may overshoot. With ``clip`` the policy term becomes AReaL's decoupled PPO
objective (TRL's GRPO with importance-sampling correction): the truncated weight is taken at π_old and
PPO's clipped surrogate bounds the move from π_old,

    w_t = min(exp(logπ_old,t − logμ_t), ρ)                          (detached)
    q_t = exp(logπ_t − logπ_old,t)                                  (differentiable)
    ℓ_t = − w_t · min(q_t A_t, clip(q_t, 1 − ε_low, 1 + ε_high) A_t)  [+ the KL and entropy terms]

so ∇ℓ_t = − w_t A_t q_t ∇logπ_t, or 0 where the clip holds (A_t > 0 and q_t > 1 + ε_high, or A_t < 0
and q_t < 1 − ε_low). ``old_logprobs`` defaults to logπ detached (the first update of a step, where
π = π_old): then q_t = 1, nothing is clipped and the gradient is exactly AIPO's; only the loss value
differs (−w_t A_t instead of −w_t A_t logπ_t; both are surrogates whose gradients matter). 0 ≤ ε_low < 1,
ε_high ≥ 0 (DAPO's clip-higher sets ε_high > ε_low).

Sequence-level ratios (``level="sequence"``: TRL's importance_sampling_level="sequence", GSPO's ratio):
the ratios are geometric means over each sequence b's masked tokens (L_b of them), shared by its tokens,

    w_b = min(exp(Σ_t m_bt (logπ_bt − logμ_bt) / L_b), ρ)                         (detached)
    ℓ_bt = − w_b · A_bt · logπ_bt                                                  (no clip)
    q_b = exp(Σ_t m_bt (logπ_bt − logπ_old,bt) / L_b)
    ℓ_bt = − w_b · min(q_b A_bt, clip(q_b, 1 − ε_low, 1 + ε_high) A_bt)            (clip)

with w_b at π_old under ``clip``. One token's odds no longer scale its own gradient: a sequence is weighted
and truncated as a whole, and clipped wherever A_bt (q_b − 1) leaves the range (with one advantage per
sequence, as the trainer has, that is the whole sequence); with clip, ∇ℓ_bt = −w_b A_bt q_b Σ_t' m_bt'
∇logπ_bt' / L_b, or 0 where token t is clipped. Needs [B, T] inputs. The metrics ratio_mean, ratio_max and
mismatch_kl stay per token (they measure the rollout/trainer mismatch); truncated_frac and clip_frac count
the tokens truncated (of truncated sequences) and clipped.

Layouts: ``logprobs``, ``behavior_logprobs``, ``mask``, ``ref_logprobs``, ``entropy`` are all ``[B, T]``
(or all ``[N]`` flat: token or constant normalisation); ``advantages`` is ``[B, T]`` per token or ``[B]`` per
sequence (broadcast over T), or ``[N]`` with flat inputs. Arithmetic runs in float32 (float64 inputs
stay float64); the loss is a 0-d tensor of that dtype.

Log-prob convention, shared with the generation engine and the fused kernels in ``llamarl_kernels``:
``logπ_t = log_softmax(logits_t.float() / T)[y_t]`` over the full vocabulary, T the sampling
temperature (1.0 for greedy). ``token_logprobs`` computes exactly this, plus the entropy of that
distribution. π is always the full softmax; μ is whatever the sampler drew from: with top-k/top-p the engine
reports the truncated distribution's log-prob (llamarl.generation.sampling), so r_t = π/μ is the exact
importance weight of the sample.

Metrics (detached 0-d tensors, always token means over the masked tokens, whatever ``norm`` is):
``ratio_mean``, ``ratio_max`` (of r_t, before truncation), ``truncated_frac`` (fraction whose weight
is truncated: r_t > ρ, or π_old/μ > ρ with ``clip``), ``clip_frac`` (with ``clip``: fraction clipped),
``mismatch_kl`` = mean_t (r_t − 1 − log r_t), the k3 estimate of KL(μ‖π) from the tokens μ sampled
(it is ≥ 0 and 0 exactly when π = μ on the sampled tokens), ``entropy`` (if given), ``kl_ref`` (mean
k3, if ``ref_logprobs`` given), ``tokens`` = Σ m_t (``trained_tokens`` in a run's metrics.jsonl).

Invariants: masked positions never affect the loss or receive gradient, even where their ratio or
exp(ref − logπ) overflows (as in the fused kernel). An all-zero mask is defined:
loss 0 (still attached to the graph, so ``backward()`` works and yields zero gradients) and all
metrics 0.
"""

from __future__ import annotations

import math
import numbers

import torch

from llamarl_kernels.shapes import check_clip, check_kl_estimator, check_norm
ENTROPY_MODES = ("grad", "detached", "none")
LEVELS = ("token", "sequence")  # where the importance ratios are taken


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, validate: bool = True,
    entropy: str = "grad",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and entropy under ``softmax(logits / temperature)``.

    ``logits [..., V]`` (any float dtype, computed in at least float32), ``targets [...]`` integer ids
    in ``[0, V)``. Returns ``(logprobs [...], entropy [...])`` in the compute dtype; the log-probs are
    differentiable. ``entropy``: "grad" (differentiable, for an entropy term), "detached" (a metric only:
    computed outside autograd, so it saves no [..., V] tensor for the backward pass) or "none" (returns
    None; the plain log-softmax-and-gather). ``validate=False`` skips the target range check (a device
    sync; out-of-range ids then fail inside ``gather``).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("token_logprobs: logits must be a floating-point tensor [..., V]")
    if not isinstance(targets, torch.Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError("token_logprobs: targets must be an integer tensor of token ids")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"token_logprobs: targets shape {tuple(targets.shape)} must equal logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])}"
        )
    if targets.device != logits.device:
        raise ValueError(f"token_logprobs: targets on {targets.device} but logits on {logits.device}")
    _check_temperature("token_logprobs", temperature)
    if entropy not in ENTROPY_MODES:
        raise ValueError(f"token_logprobs: entropy must be one of {ENTROPY_MODES}, got {entropy!r}")
    vocab = logits.shape[-1]
    if validate and targets.numel() > 0 and bool((targets < 0).any() | (targets >= vocab).any()):
        raise ValueError(
            f"token_logprobs: targets must lie in [0, {vocab}) (the vocabulary of logits); got values in "
            f"[{targets.min().item()}, {targets.max().item()}] — give padding positions any valid id and mask them"
        )
    compute = torch.promote_types(logits.dtype, torch.float32)
    scaled = logits.to(compute) / temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    logprobs = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if entropy == "none":
        return logprobs, None
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return logprobs, -(logp_all.exp() * logp_all).sum(-1)


def aipo_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rho: float = 2.0,
    *,
    norm: str = "token",
    norm_constant: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    old_logprobs: torch.Tensor | None = None,
    clip: tuple[float, float] | None = None,
    level: str = "token",
    kl_estimator: str = "k3",
    validate: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AIPO loss (see the module docstring) and its metrics.

    Gradient flows through ``logprobs`` (and ``entropy`` when ``entropy_coef != 0``); the truncated
    weight, ``behavior_logprobs``, ``advantages``, ``ref_logprobs`` and ``old_logprobs`` are treated as
    constants. ``clip=(ε_low, ε_high)`` selects the decoupled PPO form, with ``old_logprobs`` (same
    shape as ``logprobs``; default ``logprobs`` detached) the log-probs under the step's starting policy.
    ``level="sequence"`` takes the ratios per sequence, ``kl_estimator`` ("k3" or "k2") picks the KL term's
    estimator (module docstring). ``validate=False`` skips the
    data-dependent checks that need a device sync (finite values, mask in {0, 1}); shape, device and option
    checks always run.
    """
    check_norm("aipo_loss", norm, norm_constant)
    if level not in LEVELS:
        raise ValueError(f"aipo_loss: level must be one of {LEVELS}, got {level!r}")
    check_kl_estimator("aipo_loss", kl_estimator)
    if level == "sequence" and logprobs.dim() != 2:
        raise ValueError("aipo_loss: level='sequence' needs [B, T] inputs; flat [N] inputs have no sequences")
    _check_inputs(logprobs, behavior_logprobs, advantages, mask, rho, norm, ref_logprobs, kl_coef,
                  entropy, entropy_coef, old_logprobs, clip, validate)
    rho, kl_coef, entropy_coef = float(rho), float(kl_coef), float(entropy_coef)  # numpy scalars too
    compute = torch.promote_types(logprobs.dtype, torch.float32)
    logp = logprobs.to(compute)
    m = mask.to(compute)
    adv = advantages.detach().to(compute)
    if adv.dim() == 1 and logp.dim() == 2:
        adv = adv.unsqueeze(1)  # per-sequence advantage, broadcast over the tokens of the row

    live = m > 0
    zero = torch.zeros((), dtype=compute, device=logp.device)
    behavior = behavior_logprobs.detach().to(compute)
    log_ratio = logp.detach() - behavior
    ratio = log_ratio.exp()
    metrics: dict[str, torch.Tensor] = {}

    def per_level(log_odds: torch.Tensor) -> torch.Tensor:
        """Per token, or the mean over each sequence's masked tokens broadcast to them (level="sequence");
        masked entries are selected out (0), so an overflowing masked value cannot reach the mean."""
        log_odds = torch.where(live, log_odds, zero)
        if level == "token":
            return log_odds
        return (log_odds.sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1.0)).expand_as(logp)

    if clip is None:
        weighted_ratio = ratio if level == "token" else per_level(log_ratio).exp()
        # w_t = min(r_t, rho), a constant for autograd; 0 where masked, so that a masked ratio that
        # overflows (rho = inf) cannot turn the zero gradient there into inf * 0 = NaN
        weight = torch.where(live, weighted_ratio.clamp(max=rho), zero)
        per_token = -weight * adv * logp
    else:
        old = logp.detach() if old_logprobs is None else old_logprobs.detach().to(compute)
        weighted_ratio = per_level(old - behavior).exp()
        weight = torch.where(live, weighted_ratio.clamp(max=rho), zero)
        # q_t = π/π_old (or its sequence's geometric mean), exp() of 0 where masked (no overflow into the graph)
        q = per_level(logp - old).exp()
        surrogate = torch.minimum(q * adv, q.clamp(1.0 - clip[0], 1.0 + clip[1]) * adv)
        per_token = -weight * surrogate
        clipped = ((adv > 0) & (q.detach() > 1.0 + clip[1])) | ((adv < 0) & (q.detach() < 1.0 - clip[0]))
        metrics["clip_frac"] = _token_mean(clipped.to(compute), m)

    if ref_logprobs is not None:
        ref_diff = torch.where(live, ref_logprobs.detach().to(compute) - logp, zero)  # exp() stays finite where masked
        k3_ref = ref_diff.exp() - ref_diff - 1.0
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * (k3_ref if kl_estimator == "k3" else 0.5 * ref_diff.square())
        metrics["kl_ref"] = _token_mean(k3_ref.detach(), m)
    if entropy is not None:
        ent = entropy.to(compute)
        if entropy_coef != 0.0:
            per_token = per_token - entropy_coef * ent
        metrics["entropy"] = _token_mean(ent.detach(), m)

    loss = _masked_mean(per_token, m, norm, norm_constant)

    tokens = m.sum()
    metrics["ratio_mean"] = _token_mean(ratio, m)
    metrics["ratio_max"] = torch.where(m > 0, ratio, torch.zeros_like(ratio)).amax() if m.numel() else tokens
    metrics["truncated_frac"] = _token_mean((weighted_ratio > rho).to(compute), m)
    metrics["mismatch_kl"] = _token_mean(ratio - 1.0 - log_ratio, m)
    metrics["tokens"] = tokens
    return loss, {k: v.detach() for k, v in metrics.items()}


def _token_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Metric mean Σ_{m=1} x / Σ m (0 for an empty mask); masked entries are ignored even if inf."""
    return torch.where(m > 0, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1.0)


def _masked_mean(per_token: torch.Tensor, m: torch.Tensor, norm: str, constant: float | None = None) -> torch.Tensor:
    """The loss reduction over Σ m_t x_t. Masked entries are selected out (``where``, not a product with
    m, which would give inf * 0 = NaN), so they add neither value nor gradient even when not finite; they
    stay in the graph, so an all-masked batch still backpropagates (zeros)."""
    weighted = torch.where(m > 0, per_token * m, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if norm == "token":
        return weighted.sum() / m.sum().clamp(min=1.0)
    if norm == "constant":
        return weighted.sum() / constant
    row_tokens = m.sum(dim=-1)
    row_means = weighted.sum(dim=-1) / row_tokens.clamp(min=1.0)
    rows = (row_tokens > 0).sum().clamp(min=1).to(per_token.dtype)
    return row_means.sum() / rows


def _real(value) -> bool:
    """A real number (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_temperature(where: str, temperature: float) -> None:
    if not (_real(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"{where}: temperature must be a finite number > 0 (use 1.0 for greedy decoding), got {temperature!r}"
        )


def _check_inputs(logprobs, behavior_logprobs, advantages, mask, rho, norm, ref_logprobs, kl_coef,
                  entropy, entropy_coef, old_logprobs, clip, validate) -> None:
    named = {"logprobs": logprobs, "behavior_logprobs": behavior_logprobs, "advantages": advantages,
             "mask": mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    if entropy is not None:
        named["entropy"] = entropy
    if old_logprobs is not None:
        named["old_logprobs"] = old_logprobs
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"aipo_loss: {name} must be a torch.Tensor, got {type(t).__name__}")
        if name != "mask" and not t.is_floating_point():
            raise ValueError(f"aipo_loss: {name} must be a floating-point tensor, got {t.dtype}")
        if t.device != logprobs.device:
            raise ValueError(f"aipo_loss: {name} is on {t.device} but logprobs is on {logprobs.device}; "
                             "move all inputs to one device")

    if logprobs.dim() not in (1, 2):
        raise ValueError(f"aipo_loss: logprobs must be [B, T] or flat [N], got shape {tuple(logprobs.shape)}")
    if logprobs.dim() == 1 and norm == "sequence":
        raise ValueError("aipo_loss: norm='sequence' needs [B, T] inputs; flat [N] inputs have no sequences")
    shape = tuple(logprobs.shape)
    for name, t in named.items():
        if name == "advantages":
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"aipo_loss: {name} has shape {tuple(t.shape)}, expected {shape} like logprobs")
    adv_shape = tuple(advantages.shape)
    if adv_shape != shape and not (len(shape) == 2 and adv_shape == shape[:1]):
        allowed = f"{shape} or {shape[:1]}" if len(shape) == 2 else f"{shape}"
        raise ValueError(f"aipo_loss: advantages has shape {adv_shape}, expected {allowed} "
                         "(per token, or per sequence broadcast over T)")

    if not _real(rho) or not (rho > 0):
        raise ValueError(f"aipo_loss: rho (the truncation of pi/mu) must be > 0, e.g. 2.0; got {rho!r}")
    if not (_real(kl_coef) and math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"aipo_loss: kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"aipo_loss: kl_coef={kl_coef} needs ref_logprobs (log-probs under the reference policy)")
    if not (_real(entropy_coef) and math.isfinite(entropy_coef)):
        raise ValueError(f"aipo_loss: entropy_coef must be a finite number, got {entropy_coef!r}")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"aipo_loss: entropy_coef={entropy_coef} needs entropy (see token_logprobs)")
    if (entropy_coef != 0.0 and torch.is_grad_enabled() and isinstance(logprobs, torch.Tensor)
            and logprobs.requires_grad and isinstance(entropy, torch.Tensor) and not entropy.requires_grad):
        raise ValueError(f"aipo_loss: entropy_coef={entropy_coef} with an entropy that carries no gradient (e.g. "
                         "token_logprobs(..., entropy='detached')): the bonus would change the loss value but not the "
                         "update; compute it with entropy='grad'")
    check_clip("aipo_loss", clip)
    if old_logprobs is not None and clip is None:
        raise ValueError("aipo_loss: old_logprobs is only read with clip=(eps_low, eps_high), the decoupled PPO "
                         "form; pass clip too, or drop old_logprobs")

    if not validate:
        return
    for name, t in named.items():
        if name != "mask" and not bool(torch.isfinite(t).all()):
            raise ValueError(f"aipo_loss: {name} contains NaN or inf; every entry must be finite "
                             "(fill padded positions with 0 and mask them out)")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("aipo_loss: mask must be boolean or hold only 0 and 1")
