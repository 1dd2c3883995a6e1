"""Fused AIPO loss from the last hidden states and the lm_head weight, never holding the [N, V] logits.

Math (the same objective as ``llamarl.algorithms.aipo_loss``). Row i has hidden h_i [D], sampled token
y_i, behaviour log-prob logμ_i, advantage A_i, mask m_i ∈ {0, 1}; with z_i = h_i · Wᵀ, T the temperature,
p_i = softmax(z_i / T), lse_i its log-normaliser:

    logπ_i = z_{i,y_i} / T − lse_i,       H_i = −Σ_j p_ij log p_ij
    w_i    = min(exp(logπ_i − logμ_i), ρ)                                    (detached)
    loss   = Σ_i s_i [ −w_i A_i logπ_i + β·k3_i − γ·H_i ],
             k3_i = exp(logπ_ref,i − logπ_i) − (logπ_ref,i − logπ_i) − 1       (β, ref optional)
             (k2_i = ½ (logπ_i − logπ_ref,i)² in place of k3_i with ``kl_estimator="k2"``)

or, with ``clip=(ε_l, ε_h)`` (the decoupled PPO form of ``llamarl.algorithms.aipo_loss``; logπ_old,i the
step's starting policy, default logπ_i detached):

    w_i = min(exp(logπ_old,i − logμ_i), ρ),   q_i = exp(logπ_i − logπ_old,i),
    policy term −w_i · min(q_i A_i, clip(q_i, 1 − ε_l, 1 + ε_h) A_i)   in place of −w_i A_i logπ_i

or, with ``level="sequence"`` (GSPO's ratio), the same terms with the ratios replaced by their geometric
means over each sequence b's masked rows (L_b of them): w_b = min(exp(Σ_{i∈b} m_i (logπ_i − logμ_i) / L_b),
ρ) and q_b likewise: one weight per sequence, and a row clipped where A_i (q_b − 1) leaves the range.
Then a row's dloss/dlogπ depends on the other rows of its sequence, so a first pass (``fused_logprobs``,
no gradients) computes logπ, and the policy term's coefficient of each row (``_sequence_policy``) is
handed to the kernel instead of computed in it: about one GEMM more, no [N, V] memory more.

with the row weights s_i of the normalisation (all 0 when no row is masked in):

    norm="token":     s_i = m_i / M,              M = Σ_i m_i                      (token mean)
    norm="sequence":  s_i = m_i / (L_b · S),      b = sequence_ids[i], L_b = Σ_{i∈b} m_i,
                                                  S = #{b : L_b > 0}            (mean of sequence means)
    norm="constant":  s_i = m_i / C,              C = norm_constant               (Dr. GRPO)

Because w is detached, dloss/dlogπ_i is a per-row scalar known in the forward pass:

    c_i = s_i · ( −w_i A_i [· q_i · 1(not clipped), with clip] + β (1 − exp(logπ_ref,i − logπ_i)) )
          (the KL part β (logπ_i − logπ_ref,i) with k2)
    e_i = s_i · γ
    ∂loss/∂z_ij = ( c_i (1[j = y_i] − p_ij) + e_i p_ij (log p_ij + H_i) ) / T      =: g_ij

(the second term is the gradient of −γ H through dH/dz'_j = −p_j (log p_j + H)). So, like Liger's fused
linear cross-entropy, the gradients are produced during the forward pass, chunk by chunk:

    for each chunk of C rows:   Z = h_c Wᵀ                         (cuBLAS, into one reused [C, V] buffer)
                                 Triton, one program per row:       pass 1 online softmax → lse, logπ, H;
                                                                    pass 2 overwrite Z with g in place
                                 grad_h[c] = G W,  grad_W += Gᵀ h_c  (cuBLAS)

three GEMMs in all, the floor of any exact method, and no recomputation of the logits. The forward
saves only grad_h [N, D] and grad_W [V, D] (the outputs backward must return anyway); backward scales
them by the incoming gradient in place, so it can run once per forward. Extra memory beyond the two
gradients: the [C, V] chunk buffer (at most ``LOGITS_CHUNK_BYTES`` = 768 MiB, chunks balanced, and
rounded up to 128 rows when there are several of >= 256 rows) and a few fp32 vectors [N]. For the GPU
target N = 16384, D = 4096, V = 128256 in bf16 that is 6 chunks of 2816 rows: 0.67 GiB of buffer +
1.1 GiB of gradients. grad_W accumulates in the weight's dtype across chunks (fp32 inside each GEMM,
one rounding per chunk). grad_h and grad_W are only computed for the inputs that require grad, and not
at all under ``torch.no_grad()``.

Numerics: logits are produced in the inputs' dtype (as the eager path does), every value is upcast to
fp32 right after ``tl.load``; the gradient tile is rounded once to the input dtype for the two
backward GEMMs (eager autograd does the same). Row offsets are int64.

Metrics (detached 0-d fp32 tensors, means over masked rows; all 0 if M = 0): ratio_mean, ratio_max,
truncated_frac (weight truncated), clip_frac (with clip), mismatch_kl = mean(r − 1 − log r), the k3 estimate
of KL(μ‖π), entropy, kl_ref (with ``ref_logprobs``), tokens. An all-zero mask gives loss 0 and zero gradients.

Rows with m_i = 0 cost full compute: pass only the rows you train on (e.g. completion tokens).
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from llamarl_kernels.logprobs import (
    check_hidden_weight_targets,
    chunk_rows,
    fused_logprobs,
    row_launch,
    softmax_row_stats,
)
from llamarl_kernels.shapes import check_clip, check_kl_estimator, check_norm


@triton.jit
def _aipo_rows_kernel(
    logits_ptr, stride_row, targets_ptr, behavior_ptr, adv_ptr, scale_ptr, ref_ptr, old_ptr, coef_ptr,
    logprobs_ptr, entropy_ptr,
    V, temperature, rho, kl_coef, entropy_coef, clip_lo, clip_hi,
    HAS_REF: tl.constexpr, CLIP: tl.constexpr, HAS_OLD: tl.constexpr, HAS_COEF: tl.constexpr,
    KL_K2: tl.constexpr, WRITE_GRAD: tl.constexpr, ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Per row: logπ and H into the [N] outputs; with WRITE_GRAD, overwrite the logits row by g. HAS_COEF:
    the policy term's dloss/dlogπ (before s_i) is given per row (sequence-level ratios), not computed here."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    lse, logprob, entropy = softmax_row_stats(row_ptr, target, V, temperature, BLOCK_V)
    tl.store(logprobs_ptr + row, logprob)
    tl.store(entropy_ptr + row, entropy)
    if WRITE_GRAD:
        s = tl.load(scale_ptr + row)  # the row's weight s_i in the loss; 0 for masked rows
        if HAS_COEF:
            c = tl.load(coef_ptr + row)
        elif CLIP:  # decoupled PPO: w at π_old, gradient of the clipped surrogate (0 where the clip holds)
            a = tl.load(adv_ptr + row)
            old = logprob
            if HAS_OLD:
                old = tl.load(old_ptr + row)
            w = tl.minimum(tl.exp(old - tl.load(behavior_ptr + row)), rho)
            q = tl.exp(logprob - old)
            clipped = ((a > 0) & (q > clip_hi)) | ((a < 0) & (q < clip_lo))
            c = tl.where(clipped, 0.0, -w * a * q)
        else:
            w = tl.minimum(tl.exp(logprob - tl.load(behavior_ptr + row)), rho)
            c = -w * tl.load(adv_ptr + row)
        if HAS_REF:
            if KL_K2:
                c += kl_coef * (logprob - tl.load(ref_ptr + row))
            else:
                c += kl_coef * (1.0 - tl.exp(tl.load(ref_ptr + row) - logprob))
        c = tl.where(s > 0, c * s, 0.0)  # dloss/dlogπ; masked rows get exactly 0
        e = s * entropy_coef
        offs = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            valid = cols < V
            z = tl.load(row_ptr + cols, mask=valid, other=0.0).to(tl.float32) / temperature
            logp = z - lse
            p = tl.exp(logp)
            g = tl.where(cols == target, c, 0.0) - c * p
            if ENTROPY_GRAD:
                g += e * p * (logp + entropy)
            g = g / temperature
            tl.store(row_ptr + cols, g.to(logits_ptr.dtype.element_ty), mask=valid)


def _check_row_shape(where: str, name: str, t: torch.Tensor, n_rows: int, device: torch.device) -> None:
    """A per-row input is ``[N]`` on hidden's device."""
    if tuple(t.shape) != (n_rows,):
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected [N] = ({n_rows},) like hidden rows")
    if t.device != device:
        raise ValueError(f"{where}: {name} is on {t.device} but hidden is on {device}")


def _row_vector(where: str, name: str, t: torch.Tensor, n_rows: int, device: torch.device) -> torch.Tensor:
    """Check a per-row input and return it as a contiguous fp32 vector."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    _check_row_shape(where, name, t, n_rows, device)
    if name == "mask":
        if t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"{where}: mask must be boolean or hold only 0 and 1")
    else:
        if not t.is_floating_point():
            raise ValueError(f"{where}: {name} must be floating point, got {t.dtype}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} contains NaN or inf; fill masked rows with 0")
    return t.detach().to(torch.float32).contiguous()


def _sequence_ids(where: str, ids, n_rows: int, device: torch.device, why: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{where}: {why} needs sequence_ids, an integer tensor [N] naming the "
                         f"sequence of each row (e.g. the batch row the token came from); got {type(ids).__name__}")
    _check_row_shape(where, "sequence_ids", ids, n_rows, device)
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{where}: sequence_ids must be an integer tensor, got {ids.dtype}")
    return ids


def _sequences(sequence_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq [N], lengths [S]): each row's sequence as an index in [0, S), and each sequence's masked rows
    L_b; found once per call, for the norm and the level alike."""
    names, seq = torch.unique(sequence_ids, return_inverse=True)
    return seq, torch.zeros(names.numel(), dtype=mask.dtype, device=mask.device).index_add_(0, seq, mask)


def _row_weights(mask: torch.Tensor, norm: str = "token", sequences: tuple[torch.Tensor, torch.Tensor] | None = None,
                 constant: float | None = None) -> torch.Tensor:
    """The weights s_i of the module docstring (fp32 [N]): loss = Σ_i s_i ℓ_i; all 0 if no row is masked in.
    ``sequences``: ``_sequences`` of the rows (norm="sequence")."""
    if norm == "token":
        return mask / mask.sum().clamp(min=1.0)
    if norm == "constant":
        return mask / constant
    seq, lengths = sequences
    count = (lengths > 0).sum().clamp(min=1).to(mask.dtype)  # S, the sequences with a trained row
    return mask / (lengths[seq].clamp(min=1.0) * count)


def _run_chunks(hidden, weight, targets, behavior, adv, scale, ref, old, clip, rho, temperature, kl_coef,
                entropy_coef, chunk_size, need_grad_hidden, need_grad_weight, coef=None, kl_estimator="k3"):
    """The chunk loop: returns logπ [N], H [N] (fp32) and grad_hidden / grad_weight (or None). ``coef`` [N]:
    the policy term's per-row dloss/dlogπ before s_i (``_sequence_policy``), else computed per row."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    rows = chunk_rows(n_rows, vocab, hidden.dtype, chunk_size)
    launch = row_launch(vocab)
    write_grad = need_grad_hidden or need_grad_weight

    logprobs = torch.empty(n_rows, dtype=torch.float32, device=device)
    entropy = torch.empty(n_rows, dtype=torch.float32, device=device)
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if need_grad_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if need_grad_weight else None
    buffer = torch.empty((rows, vocab), dtype=hidden.dtype, device=device)
    ref_arg = ref if ref is not None else behavior  # never read when HAS_REF is False
    old_arg = old if old is not None else behavior  # never read when HAS_OLD is False
    coef_arg = coef if coef is not None else behavior  # never read when HAS_COEF is False
    clip_lo, clip_hi = (1.0 - clip[0], 1.0 + clip[1]) if clip is not None else (0.0, 0.0)

    for start in range(0, n_rows, rows):
        stop = min(start + rows, n_rows)
        h_chunk = hidden[start:stop]
        logits = buffer[: stop - start]
        torch.matmul(h_chunk, weight.t(), out=logits)
        _aipo_rows_kernel[(stop - start,)](
            logits, logits.stride(0), targets[start:stop], behavior[start:stop], adv[start:stop],
            scale[start:stop], ref_arg[start:stop], old_arg[start:stop], coef_arg[start:stop], logprobs[start:stop],
            entropy[start:stop], vocab, float(temperature), float(rho), float(kl_coef), float(entropy_coef),
            float(clip_lo), float(clip_hi), HAS_REF=ref is not None, CLIP=clip is not None, HAS_OLD=old is not None,
            HAS_COEF=coef is not None, KL_K2=kl_estimator == "k2", WRITE_GRAD=write_grad,
            ENTROPY_GRAD=entropy_coef != 0.0, BLOCK_V=launch.block_v, num_warps=launch.num_warps,
        )
        if need_grad_hidden:
            torch.matmul(logits, weight, out=grad_hidden[start:stop])
        if need_grad_weight:
            if start == 0:
                torch.matmul(logits.t(), h_chunk, out=grad_weight)
            else:
                grad_weight.addmm_(logits.t(), h_chunk)
    return logprobs, entropy, grad_hidden, grad_weight


def _sequence_policy(logprobs, behavior, adv, mask, old, clip, rho, sequences):
    """level="sequence" (module docstring), from logπ [N] of a first pass: per row (the policy term's
    dloss/dlogπ before s_i, its loss value, the ratio its weight truncates, clipped or None).

    The ratios are each sequence's geometric means over its masked rows, as ``llamarl.algorithms.aipo_loss``
    takes them. s_i is the same for the masked rows of a sequence under every norm, so the clipped form's
    dloss/dlogπ_i = −w_b q_b Σ_{t∈b} s_t A_t 1(t not clipped) / L_b is s_i times the coefficient below."""
    on = mask > 0
    zero = torch.zeros_like(logprobs)
    seq, lengths = sequences  # ``_sequences`` of the rows

    def seq_mean(x: torch.Tensor) -> torch.Tensor:
        sums = torch.zeros_like(lengths).index_add_(0, seq, torch.where(on, x, zero))
        return (sums / lengths.clamp(min=1.0))[seq]

    if clip is None:
        weighted = seq_mean(logprobs - behavior).exp()
        w = weighted.clamp(max=rho)
        return -w * adv, -w * adv * logprobs, weighted, None
    old = logprobs if old is None else old
    weighted = seq_mean(old - behavior).exp()
    w = weighted.clamp(max=rho)
    q = seq_mean(logprobs - old).exp()
    clipped = ((adv > 0) & (q > 1.0 + clip[1])) | ((adv < 0) & (q < 1.0 - clip[0]))
    surrogate = torch.minimum(q * adv, q.clamp(1.0 - clip[0], 1.0 + clip[1]) * adv)
    return -w * q * seq_mean(torch.where(clipped, zero, adv)), -w * surrogate, weighted, clipped


def _loss_and_metrics(logprobs, entropy, behavior, adv, mask, scale, ref, old, clip, rho, kl_coef, entropy_coef,
                      policy=None, kl_estimator="k3"):
    """Loss value (Σ s_i ℓ_i) and metrics (token means) from the per-row fp32 vectors (cheap [N] arithmetic);
    ``policy``: ``_sequence_policy``'s terms in place of the per-token ones."""
    tokens = mask.sum()
    denom = tokens.clamp(min=1.0)
    on = mask > 0
    zero = torch.zeros_like(logprobs)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(on, x, zero).sum() / denom

    log_ratio = logprobs - behavior
    ratio = log_ratio.exp()
    metrics = {}
    if policy is not None:
        _, per_row, weighted_ratio, clipped = policy
        if clip is not None:
            metrics["clip_frac"] = mean(clipped.float())
    elif clip is None:
        weighted_ratio = ratio
        per_row = -ratio.clamp(max=rho) * adv * logprobs
    else:
        old = logprobs if old is None else old
        weighted_ratio = (old - behavior).exp()
        q = torch.where(on, logprobs - old, zero).exp()
        surrogate = torch.minimum(q * adv, q.clamp(1.0 - clip[0], 1.0 + clip[1]) * adv)
        per_row = -weighted_ratio.clamp(max=rho) * surrogate
        metrics["clip_frac"] = mean((((adv > 0) & (q > 1.0 + clip[1])) | ((adv < 0) & (q < 1.0 - clip[0]))).float())
    per_row = per_row - entropy_coef * entropy
    if ref is not None:
        ref_diff = ref - logprobs
        k3 = ref_diff.exp() - ref_diff - 1.0
        per_row = per_row + kl_coef * (k3 if kl_estimator == "k3" else 0.5 * ref_diff.square())
        metrics["kl_ref"] = mean(k3)
    loss = torch.where(on, per_row * scale, zero).sum()
    metrics.update(
        ratio_mean=mean(ratio),
        ratio_max=torch.where(on, ratio, zero).amax(),
        truncated_frac=mean((weighted_ratio > rho).float()),
        mismatch_kl=mean(ratio - 1.0 - log_ratio),
        entropy=mean(entropy),
        tokens=tokens,
    )
    return loss, metrics


class _FusedAIPOLoss(torch.autograd.Function):
    """Forward computes loss, per-row logπ/H and both gradients; backward only scales the gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, behavior, adv, mask, scale, ref, old, clip, rho, temperature,
                kl_coef, entropy_coef, chunk_size, sequences, kl_estimator):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        policy = None
        if sequences is not None:  # level="sequence": a first pass for logπ, whose sequences set the weights
            first, _ = fused_logprobs(hidden, weight, targets, temperature, chunk_size=chunk_size)
            policy = _sequence_policy(first, behavior, adv, mask, old, clip, rho, sequences)
        logprobs, entropy, grad_h, grad_w = _run_chunks(
            hidden, weight, targets, behavior, adv, scale, ref, old, clip, rho, temperature, kl_coef,
            entropy_coef, chunk_size, need_h, need_w, coef=None if policy is None else policy[0],
            kl_estimator=kl_estimator,
        )
        loss, metrics = _loss_and_metrics(logprobs, entropy, behavior, adv, mask, scale, ref, old, clip, rho,
                                          kl_coef, entropy_coef, policy, kl_estimator)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.backward_done = False
        packed = torch.stack([metrics[k] for k in _metric_keys(ref is not None, clip is not None)])
        ctx.mark_non_differentiable(packed)
        return loss, packed

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_packed):
        if ctx.backward_done:
            raise RuntimeError(
                "fused_aipo_loss: backward ran twice on one forward (retain_graph=True); the fused loss "
                "stores its gradients once — call fused_aipo_loss again for a second backward"
            )
        ctx.backward_done = True
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h.mul_(grad_loss)
        if grad_w is not None:
            grad_w.mul_(grad_loss)
        return (grad_h, grad_w) + (None,) * 15


def _metric_keys(has_ref: bool, has_clip: bool) -> tuple[str, ...]:
    """The order of the metrics packed into the autograd function's second output."""
    keys = ("ratio_mean", "ratio_max", "truncated_frac", "mismatch_kl", "entropy", "tokens")
    return keys + (("kl_ref",) if has_ref else ()) + (("clip_frac",) if has_clip else ())


def fused_aipo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rho: float = 2.0,
    temperature: float = 1.0,
    *,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_coef: float = 0.0,
    norm: str = "token",
    sequence_ids: torch.Tensor | None = None,
    norm_constant: float | None = None,
    old_logprobs: torch.Tensor | None = None,
    clip: tuple[float, float] | None = None,
    level: str = "token",
    kl_estimator: str = "k3",
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AIPO loss from ``hidden [N, D]`` and lm_head ``weight [V, D]``; see the module docstring.

    ``targets [N]`` are the sampled ids, ``behavior_logprobs``/``advantages``/``mask``/``ref_logprobs``
    are per row ``[N]``. ``norm="token"`` (default) averages over the masked-in rows; ``norm="sequence"``
    averages per sequence first and needs ``sequence_ids [N]`` (any integers; rows with equal ids form one
    sequence, in any order), as ``llamarl.algorithms.aipo_loss(norm="sequence")`` does on [B, T] inputs.
    ``norm="constant"`` divides the sum by ``norm_constant`` (Dr. GRPO).
    ``clip=(ε_low, ε_high)`` selects the decoupled PPO form, with ``old_logprobs [N]`` (default: logπ).
    ``level="sequence"`` takes the ratios per sequence of ``sequence_ids`` (module docstring; one more
    pass over the logits, without gradients, for the sequences' logπ). ``kl_estimator="k2"``: the KL term is
    β · ½ (logπ − logπ_ref)² instead of k3 (``llamarl.algorithms.aipo_loss``).
    Differentiable in ``hidden`` and ``weight``. Returns ``(loss, metrics)`` with a 0-d fp32 loss.
    ``chunk_size`` overrides the rows per chunk (default: ``LOGITS_CHUNK_BYTES`` of logits).
    """
    where = "fused_aipo_loss"
    check_hidden_weight_targets(where, hidden, weight, targets, temperature)
    if isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not (rho > 0):
        raise ValueError(f"{where}: rho (the truncation of pi/mu) must be > 0, e.g. 2.0; got {rho!r}")
    if not (isinstance(kl_coef, numbers.Real) and math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"{where}: kl_coef must be a finite number >= 0, got {kl_coef!r}")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"{where}: kl_coef={kl_coef} needs ref_logprobs (see fused_logprobs)")
    if not (isinstance(entropy_coef, numbers.Real) and math.isfinite(entropy_coef)):
        raise ValueError(f"{where}: entropy_coef must be a finite number, got {entropy_coef!r}")
    check_clip(where, clip)
    if old_logprobs is not None and clip is None:
        raise ValueError(f"{where}: old_logprobs is only read with clip=(eps_low, eps_high); pass clip too, "
                         "or drop old_logprobs")
    check_norm(where, norm, norm_constant)
    if level not in ("token", "sequence"):
        raise ValueError(f"{where}: level must be 'token' or 'sequence', got {level!r}")
    check_kl_estimator(where, kl_estimator)
    n_rows, device = hidden.shape[0], hidden.device
    if norm == "sequence" or level == "sequence":
        why = "norm='sequence'" if norm == "sequence" else "level='sequence'"
        sequence_ids = _sequence_ids(where, sequence_ids, n_rows, device, why)
    elif sequence_ids is not None:
        raise ValueError(f"{where}: sequence_ids is only read with norm='sequence' or level='sequence' (norm is "
                         f"{norm!r}, level {level!r}); drop it or pass one of them")
    chunk_rows(n_rows, weight.shape[0], hidden.dtype, chunk_size)  # validates chunk_size early
    behavior = _row_vector(where, "behavior_logprobs", behavior_logprobs, n_rows, device)
    adv = _row_vector(where, "advantages", advantages, n_rows, device)
    mask_f = _row_vector(where, "mask", mask, n_rows, device)
    ref = None if ref_logprobs is None else _row_vector(where, "ref_logprobs", ref_logprobs, n_rows, device)
    old = None if old_logprobs is None else _row_vector(where, "old_logprobs", old_logprobs, n_rows, device)
    clip = None if clip is None else (float(clip[0]), float(clip[1]))
    targets = targets.contiguous()
    sequences = None if sequence_ids is None else _sequences(sequence_ids, mask_f)
    scale = _row_weights(mask_f, norm, sequences, None if norm_constant is None else float(norm_constant))

    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, packed = _FusedAIPOLoss.apply(
            hidden, weight, targets, behavior, adv, mask_f, scale, ref, old, clip, rho, temperature, kl_coef,
            entropy_coef, chunk_size, sequences if level == "sequence" else None, kl_estimator,
        )
        return loss, dict(zip(_metric_keys(ref is not None, clip is not None), packed.unbind()))
    with torch.no_grad():
        logprobs, entropy, _, _ = _run_chunks(
            hidden, weight, targets, behavior, adv, scale, ref, old, clip, rho, temperature, kl_coef,
            entropy_coef, chunk_size, False, False, kl_estimator=kl_estimator,
        )
        policy = None if level == "token" else _sequence_policy(logprobs, behavior, adv, mask_f, old, clip, rho,
                                                                 sequences)
        return _loss_and_metrics(logprobs, entropy, behavior, adv, mask_f, scale, ref, old, clip, rho, kl_coef,
                                 entropy_coef, policy, kl_estimator)
