"""Eager PyTorch specification of every Triton kernel in llamarl_kernels, except the fused inference ops of
fused_ops.py (rms_norm, rope, rope_kv, silu_mul), whose specification is the eager code they replace in
llamarl.models.llama (tests/test_fused_ops.py compares them with it).

Each function here has the same signature as the kernel it specifies and is written to be read next
to the math. Tests compare kernel and reference against float64 evaluations of these functions.
Kernel authors: add your reference below, in its own section; never rewrite other sections.
"""

import torch  # noqa: F401  (used by the sections below)


# ----------------------------------------------------------------------------------------------------
# int8 / fp8 weight-only quantization (kernels: llamarl_kernels/quant.py and qlinear.py)
#   scale_r = max_k |W[r, k]| / QMAX (1.0 where that is 0); p_r = 2**64 if scale_r < 2**-64 else 1
#   inv_r = 1 / (scale_r * p_r); q = RNE(clamp((W * p_r) * inv_r, -QMAX, QMAX)), all fp32, IEEE rounding
#   QMAX = 127 for int8 (round half to even to an integer), 448 for fp8 e4m3fn (RNE onto its grid).
# ----------------------------------------------------------------------------------------------------
QUANT_QMAX = {"int8": 127.0, "fp8": 448.0}


def quantize_ref(w: "torch.Tensor", mode: str) -> "tuple[torch.Tensor, torch.Tensor]":
    """Per-row symmetric quantization of W[R, K] -> (q[R, K] int8 | float8_e4m3fn, scale[R] float32)."""
    if mode not in QUANT_QMAX:
        raise ValueError(f"quantization mode must be one of {sorted(QUANT_QMAX)}, got {mode!r}")
    qmax = QUANT_QMAX[mode]
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    # tensor operands in both divisions, not Python scalars: CUDA turns `t / scalar` into t * (1/scalar),
    # which is not the correctly rounded quotient the kernel (and the CPU) computes
    scale = amax / torch.full_like(amax, qmax)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # p_r (exact power of two) keeps 1 / (scale_r * p_r) finite where 1 / scale_r would overflow fp32
    pre = torch.where(scale < 2.0**-64, torch.full_like(scale, 2.0**64), torch.ones_like(scale))
    inv = torch.ones_like(scale) / (scale * pre)
    v = ((wf * pre[:, None]) * inv[:, None]).clamp(-qmax, qmax)
    q = torch.round(v).to(torch.int8) if mode == "int8" else v.to(torch.float8_e4m3fn)
    return q, scale


def dequantize_ref(q: "torch.Tensor", scale: "torch.Tensor", dtype: "torch.dtype" = torch.float32) -> "torch.Tensor":
    """float(q[r, k]) * scale[r], rounded once to ``dtype``."""
    return (q.float() * scale[:, None]).to(dtype)


def quantized_linear_ref(
    x: "torch.Tensor", q: "torch.Tensor", scale: "torch.Tensor", bias: "torch.Tensor | None" = None
) -> "torch.Tensor":
    """y = (x @ float(q).T) * scale (+ bias) in fp32, rounded once to x's dtype."""
    y = (x.float() @ q.float().t()) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# AIPO loss and token log-probs from hidden states (kernels: llamarl_kernels/aipo_loss.py, logprobs.py)
#   z = hidden @ weightᵀ (input dtype), logπ = log_softmax(z.float() / T)[y], H = −Σ p log p
#   w = min(exp(logπ − logμ), ρ) detached; k3 = exp(ref − logπ) − (ref − logπ) − 1
#   ℓ = −w·A·logπ + β·k3 − γ·H;  loss = Σ m·ℓ / max(Σ m, 1)                        norm="token"
#   loss = mean over sequences b with Σ_b m > 0 of Σ_b m·ℓ / Σ_b m                 norm="sequence"
#   loss = Σ m·ℓ / C, C = norm_constant                                             norm="constant"
#   metrics: means over m of r, r > ρ, r − 1 − log r (k3 of KL(μ‖π)), H, k3; max of r; Σ m.
#   with clip = (ε_l, ε_h) and old = logπ_old (default logπ detached):  w = min(exp(old − logμ), ρ),
#   q = exp(logπ − old), −w·A·logπ becomes −w·min(q·A, clamp(q, 1 − ε_l, 1 + ε_h)·A); "r > ρ" is then
#   exp(old − logμ) > ρ, and clip_frac = mean over m of [(A > 0 and q > 1 + ε_h) or (A < 0 and q < 1 − ε_l)].
# ----------------------------------------------------------------------------------------------------
def logprobs_from_hidden_ref(
    hidden: "torch.Tensor", weight: "torch.Tensor", targets: "torch.Tensor", temperature: float = 1.0
) -> "tuple[torch.Tensor, torch.Tensor]":
    """(logπ [N], entropy [N]) of ``targets`` under softmax(hidden @ weightᵀ / T), at ≥ fp32 precision."""
    logits = hidden @ weight.t()
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    logprobs = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, entropy


def aipo_loss_from_hidden_ref(
    hidden: "torch.Tensor",
    weight: "torch.Tensor",
    targets: "torch.Tensor",
    behavior_logprobs: "torch.Tensor",
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    rho: float = 2.0,
    temperature: float = 1.0,
    *,
    ref_logprobs: "torch.Tensor | None" = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    norm: str = "token",
    sequence_ids: "torch.Tensor | None" = None,
    norm_constant: "float | None" = None,
    old_logprobs: "torch.Tensor | None" = None,
    clip: "tuple[float, float] | None" = None,
    level: str = "token",
    kl_estimator: str = "k3",
) -> "tuple[torch.Tensor, dict[str, torch.Tensor]]":
    """AIPO loss (differentiable in hidden and weight) and its metrics, as in the header; with
    norm="sequence" or level="sequence", rows with equal ``sequence_ids`` form one sequence; with ``clip``,
    the decoupled PPO policy term; with level="sequence", the ratios are the sequences' geometric means;
    kl_estimator="k2": the KL term is β · ½ (logπ − logπ_ref)² (the metric kl_ref stays k3)."""
    logprobs, entropy = logprobs_from_hidden_ref(hidden, weight, targets, temperature)
    dtype = logprobs.dtype
    m = mask.to(dtype)
    on = m > 0
    tokens = m.sum()

    def mean(x: "torch.Tensor") -> "torch.Tensor":
        return torch.where(on, x, torch.zeros_like(x)).sum() / tokens.clamp(min=1.0)

    def odds(x: "torch.Tensor") -> "torch.Tensor":  # per row, or its sequence's mean over its masked rows
        x = torch.where(on, x, torch.zeros_like(x))
        if level == "token":
            return x
        out = torch.zeros_like(x)
        for b in sequence_ids.unique():
            rows = sequence_ids == b
            out = torch.where(rows, x[rows].sum() / m[rows].sum().clamp(min=1.0), out)
        return out

    log_ratio = logprobs.detach() - behavior_logprobs.to(dtype)
    ratio = log_ratio.exp()
    adv = advantages.to(dtype)
    metrics = {}
    if clip is None:
        weighted = odds(log_ratio).exp()
        truncated = weighted > rho
        per_token = -weighted.clamp(max=rho) * adv * logprobs
    else:
        old = logprobs.detach() if old_logprobs is None else old_logprobs.to(dtype)
        old_ratio = odds(old - behavior_logprobs.to(dtype)).exp()
        truncated = old_ratio > rho
        q = odds(logprobs - old).exp()  # masked rows: exp(0), never inf
        per_token = -old_ratio.clamp(max=rho) * torch.minimum(q * adv, q.clamp(1 - clip[0], 1 + clip[1]) * adv)
        clipped = ((adv > 0) & (q.detach() > 1 + clip[1])) | ((adv < 0) & (q.detach() < 1 - clip[0]))
        metrics["clip_frac"] = mean(clipped.to(dtype))
    per_token = per_token - entropy_coef * entropy
    if ref_logprobs is not None:
        ref_diff = torch.where(on, ref_logprobs.to(dtype) - logprobs, torch.zeros_like(logprobs))  # masked: 0
        k3 = ref_diff.exp() - ref_diff - 1.0
        per_token = per_token + kl_coef * (k3 if kl_estimator == "k3" else 0.5 * ref_diff**2)
        metrics["kl_ref"] = mean(k3.detach())
    if norm == "token":
        loss = (per_token * m).sum() / tokens.clamp(min=1.0)
    elif norm == "constant":
        loss = (per_token * m).sum() / norm_constant
    else:
        means = [(per_token[rows] * m[rows]).sum() / m[rows].sum()
                 for rows in (sequence_ids == b for b in sequence_ids.unique()) if m[rows].sum() > 0]
        loss = torch.stack(means).mean() if means else (per_token * m).sum()
    metrics.update(
        ratio_mean=mean(ratio),
        ratio_max=torch.where(on, ratio, torch.zeros_like(ratio)).amax(),
        truncated_frac=mean(truncated.to(dtype)),
        mismatch_kl=mean(ratio - 1.0 - log_ratio),
        entropy=mean(entropy.detach()),
        tokens=tokens,
    )
    return loss, metrics
