"""Tensor parallelism (Megatron style) for the generator's Llama, over one TP process group.

Notation: R ranks in the TP group, this rank p; every split uses the balanced bounds of the weight
sync (``llamarl.weight_sync.layout.balanced_bounds``): for n = q*R + r, rank p owns [p*q + min(p, r),
... + q + (p < r)). So every local parameter is *exactly* the slice the DDMA planner writes into this
rank, under its Hugging Face name, and weights arrive with no resharding at all.

Layers (X replicated [.., in], W [out, in] row-major as in ``nn.Linear``):

    column-parallel   Y_p = X W_p^T,           W_p = W[b_p(out), :]    q, k, v, gate, up
    row-parallel      Y   = sum_p X_p W_p^T,   W_p = W[:, b_p(in)]     o, down  (all-reduce SUM)
    vocab embedding   E(x) = sum_p [x in b_p(V)] E_p[x - start_p]        (all-reduce SUM, one non-zero term)
    vocab lm_head     Z_p = H W_p^T, W_p = W[b_p(V), :]; gathered -> Z [.., V] (all-gather, exact), or
                      log-softmax across shards without gathering:
                          m = max_p max_v Z_p (all-reduce MAX),  s = sum_p sum_v exp(Z_p - m) (SUM),
                          log pi(y) = Z[y] - m - log s,  Z[y] taken from the shard that owns y (SUM).

Attention: rank p holds query heads [p H/R, (p+1) H/R) and kv heads [p Hkv/R, (p+1) Hkv/R); this needs
R | H and R | Hkv (checked, with a clear error, by ``check_tp_size`` here and by the weight sync's
``plan_sync``, whose Llama specs carry ``tp_unit = head_dim``). Since H/R = G * Hkv/R (G = H/Hkv), the GQA
map h -> h // G stays inside the rank, and the q/k/v row splits fall on head boundaries. The attention
module itself is llamarl's, run with local head counts; its KV cache must be sized with
``tp_local_config(config, R)``. MLP: gate/up rows and down columns use the same bounds of the
intermediate size, which may be uneven. Norm weights are replicated; the residual stream [B, T, D] is
replicated on every TP rank.

Autograd: column-parallel inputs pass through f (forward identity, backward all-reduce) and row-parallel
outputs / embeddings through g (forward all-reduce, backward identity), gathered logits through an
all-gather whose backward keeps the local slice - so gradients are right too, although the generator
only runs forward. The cross-shard log-softmax is inference only (no autograd).

Numerics: column-parallel matmuls, the embedding lookup and the logit gather are bit-exact against a
single process; a row-parallel all-reduce sums R partial products, so its result differs only by fp
rounding (summation order). All ranks receive identical bytes from every collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llamarl.models import Llama, LlamaConfig
from llamarl.models import linear as dense
from llamarl.weight_sync.layout import balanced_bounds, llama_tp_split


# ------------------------------------------------------------------------------------ the group
@dataclass(frozen=True)
class TPGroup:
    """One tensor-parallel group: its process group (None = WORLD), this rank and the group size."""

    group: Any = field(default=None, compare=False, repr=False)
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank {self.rank} is not in [0, size={self.size})")

    @classmethod
    def of(cls, group: Any = None) -> "TPGroup":
        """The TP group of a torch.distributed process group (WORLD if None; size 1 without dist)."""
        if isinstance(group, TPGroup):
            return group
        if not dist.is_available() or not dist.is_initialized():
            if group is not None:
                raise RuntimeError("a process group was given but torch.distributed is not initialized; call "
                                   "dist.init_process_group first")
            return cls(None, 0, 1)
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def bounds(self, n: int) -> tuple[int, int]:
        """This rank's part [start, end) of a dimension of size n (balanced, the weight sync's bounds)."""
        return balanced_bounds(n, self.size, self.rank)

    def all_bounds(self, n: int) -> list[tuple[int, int]]:
        return [balanced_bounds(n, self.size, p) for p in range(self.size)]


def _all_reduce(x: torch.Tensor, tp: TPGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(x, op=op, group=tp.group)
    return x


def _all_gather_last(x: torch.Tensor, tp: TPGroup, n_total: int) -> torch.Tensor:
    """Concatenate every rank's [.., n_p] slice (balanced bounds of n_total) along the last dim."""
    if tp.size == 1:
        return x
    width = max(b - a for a, b in tp.all_bounds(n_total))
    padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(parts, padded, group=tp.group)
    return torch.cat([part[..., : b - a] for part, (a, b) in zip(parts, tp.all_bounds(n_total))], dim=-1)


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the input gradient backward (inputs of column-parallel layers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.contiguous().clone(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce SUM forward; identity backward (outputs of row-parallel layers and embeddings)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return _all_reduce(x.contiguous().clone(), tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; the local slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPGroup, n_total: int) -> torch.Tensor:
        ctx.bounds = tp.bounds(n_total)
        return _all_gather_last(x, tp, n_total)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.bounds
        return grad[..., a:b].contiguous(), None, None


def _local_param(full: torch.Tensor, index: tuple, device: torch.device | str | None) -> nn.Parameter:
    """The slice ``full[index]`` as a new contiguous parameter (uninitialised when ``full`` is on meta)."""
    part = full[index]
    local = torch.empty(part.shape, dtype=part.dtype, device=device or ("cpu" if part.is_meta else part.device))
    if not part.is_meta:
        local.copy_(part.detach())
    return nn.Parameter(local)


def _check_local(owner: str, weight: torch.Tensor, expected: tuple[int, int], tp: TPGroup, full: tuple[int, int],
                 what: str = "weight") -> None:
    """Raise unless ``weight`` has the shape ``expected`` of this TP rank's part of a ``full``-shaped tensor."""
    if tuple(weight.shape) != expected:
        noun = "table" if what == "table" else "weight"
        raise ValueError(f"{owner}: local {noun} has shape {tuple(weight.shape)}, TP rank {tp.rank}/{tp.size} of a "
                         f"[{full[0]}, {full[1]}] {what} needs {expected}")


# ------------------------------------------------------------------------------------ layers
class ColumnParallelLinear(nn.Module):
    """y_p = x W_p^T with W_p = W[b_p(out_features)]: the local output features, no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, weight: nn.Parameter):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.out_start, self.out_end = tp.bounds(out_features)
        _check_local("ColumnParallelLinear", weight, (self.out_end - self.out_start, in_features), tp,
                     (out_features, in_features))
        self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, device: torch.device | str | None = None):
        if linear.bias is not None:
            raise ValueError("ColumnParallelLinear supports bias-free linears only (Llama has no biases)")
        a, b = tp.bounds(linear.out_features)
        return cls(linear.in_features, linear.out_features, tp, _local_param(linear.weight, (slice(a, b),), device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.tp.size > 1:
            x = _CopyToTP.apply(x, self.tp)
        return dense.linear(x, self.weight)

    # the stacked-projection protocol (llamarl.models.stacked): without autograd the forward is a plain
    # product with the local rows, so a rank's q|k|v (gate|up) shards stack like unsharded weights
    def stack_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self._parameters["weight"],)

    def stacked_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, weight)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local rows [{self.out_start}, {self.out_end})), "
                f"tp={self.tp.rank}/{self.tp.size}")


class RowParallelLinear(nn.Module):
    """y = sum_p x_p W_p^T with W_p = W[:, b_p(in_features)]: x is the local input slice; all-reduce SUM."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, weight: nn.Parameter):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.in_start, self.in_end = tp.bounds(in_features)
        _check_local("RowParallelLinear", weight, (out_features, self.in_end - self.in_start), tp,
                     (out_features, in_features))
        self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, device: torch.device | str | None = None):
        if linear.bias is not None:
            raise ValueError("RowParallelLinear supports bias-free linears only (Llama has no biases)")
        a, b = tp.bounds(linear.in_features)
        return cls(linear.in_features, linear.out_features, tp,
                   _local_param(linear.weight, (slice(None), slice(a, b)), device))

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        n = self.in_end - self.in_start
        if x_local.shape[-1] != n:
            raise ValueError(f"RowParallelLinear on TP rank {self.tp.rank}: input has {x_local.shape[-1]} features, "
                             f"this rank's input slice [{self.in_start}, {self.in_end}) has {n}")
        y = dense.linear(x_local, self.weight)
        return _ReduceFromTP.apply(y, self.tp) if self.tp.size > 1 else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local cols [{self.in_start}, {self.in_end})), out={self.out_features}, "
                f"tp={self.tp.rank}/{self.tp.size}")


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_end) of the embedding table; lookups outside them give 0, then all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup, weight: nn.Parameter):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.vocab_start, self.vocab_end = tp.bounds(num_embeddings)
        _check_local("VocabParallelEmbedding", weight, (self.vocab_end - self.vocab_start, embedding_dim), tp,
                     (num_embeddings, embedding_dim), what="table")
        self.weight = weight

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tp: TPGroup, device: torch.device | str | None = None):
        a, b = tp.bounds(emb.num_embeddings)
        return cls(emb.num_embeddings, emb.embedding_dim, tp, _local_param(emb.weight, (slice(a, b),), device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return _ReduceFromTP.apply(out, self.tp)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (local rows [{self.vocab_start}, {self.vocab_end})), "
                f"tp={self.tp.rank}/{self.tp.size}")


class VocabParallelLMHead(nn.Module):
    """Logits of vocab rows [vocab_start, vocab_end); ``forward`` gathers them to [.., V] if gather_output."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup, weight: nn.Parameter,
                 gather_output: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.tp = hidden_size, vocab_size, tp
        self.vocab_start, self.vocab_end = tp.bounds(vocab_size)
        self.gather_output = gather_output
        _check_local("VocabParallelLMHead", weight, (self.vocab_end - self.vocab_start, hidden_size), tp,
                     (vocab_size, hidden_size), what="lm_head")
        self.weight = weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TPGroup, gather_output: bool = True,
                    device: torch.device | str | None = None):
        a, b = tp.bounds(linear.out_features)
        return cls(linear.in_features, linear.out_features, tp, _local_param(linear.weight, (slice(a, b),), device),
                   gather_output)

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., vocab_end - vocab_start]: this rank's columns of the logits."""
        if torch.is_grad_enabled() and self.tp.size > 1:
            h = _CopyToTP.apply(h, self.tp)
        return dense.linear(h, self.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = self.local_logits(h)
        if not self.gather_output or self.tp.size == 1:
            return z
        return _GatherFromTP.apply(z, self.tp, self.out_features)

    @torch.no_grad()
    def logprobs(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """log softmax(h W^T)[targets] in float32 without gathering the logits (inference only)."""
        if targets.shape != h.shape[:-1]:
            raise ValueError(f"targets must have shape {tuple(h.shape[:-1])} (h without its last dim), "
                             f"got {tuple(targets.shape)}")
        return vocab_parallel_logprobs(self.local_logits(h), targets, self.vocab_start, self.tp)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, vocab={self.out_features} (local rows [{self.vocab_start}, "
                f"{self.vocab_end})), gather_output={self.gather_output}, tp={self.tp.rank}/{self.tp.size}")


@torch.no_grad()
def vocab_parallel_logprobs(local_logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                            tp: TPGroup) -> torch.Tensor:
    """log softmax over the full vocabulary at ``targets``, from each rank's logit columns (float32).

    local_logits [.., n_p] are the columns [vocab_start, vocab_start + n_p); targets [..] are global ids.
    """
    z = local_logits.float()
    n = z.shape[-1]
    m = z.amax(dim=-1) if n else torch.full(z.shape[:-1], -math.inf, device=z.device)
    m = _all_reduce(m.contiguous(), tp, dist.ReduceOp.MAX)
    s = _all_reduce((z - m.unsqueeze(-1)).exp().sum(dim=-1), tp)
    mine = (targets >= vocab_start) & (targets < vocab_start + n)
    idx = torch.where(mine, targets - vocab_start, torch.zeros_like(targets)).unsqueeze(-1)
    zt = torch.where(mine, z.gather(-1, idx).squeeze(-1) if n else torch.zeros_like(m), torch.zeros_like(m))
    zt = _all_reduce(zt.contiguous(), tp)
    return zt - m - s.log()


# ------------------------------------------------------------------------------------ the model
def check_tp_size(config: LlamaConfig, tp_size: int) -> None:
    """Raise unless attention heads split evenly over ``tp_size`` ranks (R | H and R | Hkv).

    The weight sync refuses exactly the same sizes: ``plan_sync(llama_param_specs(config), ..,
    GeneratorLayout(tp_size))`` raises iff this does. Vocabulary and intermediate size may split unevenly."""
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    if tp_size < 1 or h % tp_size or hkv % tp_size:
        ok = [r for r in range(1, hkv + 1) if hkv % r == 0 and h % r == 0]
        raise ValueError(f"tensor parallelism over {tp_size} ranks splits attention by heads, so it needs "
                         f"num_attention_heads={h} and num_key_value_heads={hkv} to be divisible by {tp_size}; "
                         f"valid TP sizes for this model: {ok}")


def tp_local_config(config: LlamaConfig, tp_size: int) -> LlamaConfig:
    """The config of one TP rank's attention: local head counts (same head_dim); use it to size KV caches."""
    check_tp_size(config, tp_size)
    return config.replace(num_attention_heads=config.num_attention_heads // tp_size,
                          num_key_value_heads=config.num_key_value_heads // tp_size, head_dim=config.head_dim)


def parallelize_llama(model: Llama, group: Any = None, *, gather_logits: bool = True,
                      device: torch.device | str | None = None) -> Llama:
    """Make ``model`` (a full ``Llama``) this rank's tensor-parallel shard, in place; returns it.

    group: the TP process group (None = WORLD), or a ``TPGroup``. Every linear, the embedding and the
    lm_head keep their HF names; their weights become this rank's slices (``GeneratorLayout.shard``
    of the full weights). A model built on the meta device (``with torch.device("meta"): Llama(cfg)``)
    gets uninitialised local tensors on ``device`` (default cpu), to be filled by the weight sync, so a
    generator rank never materialises the full model. ``model(ids)`` returns gathered logits [B, T, V]
    (``gather_logits=False``: the local columns); ``model.lm_head.logprobs(h, targets)`` gives
    log-probabilities without a gather. ``model.tp`` is the TPGroup and ``model.tp_config`` the local
    config: size KV caches with it (``KVCache(model.tp_config, ...)``; a cache sized from the global
    config fails on the first write). ``model.lm_head_weight`` is the local [V_p, D] shard.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_llama needs a llamarl Llama, got {type(model).__name__}")
    if isinstance(model.lm_head, VocabParallelLMHead):
        raise ValueError("this model is already tensor parallel (parallelize_llama was applied before)")
    tp = TPGroup.of(group)
    cfg = model.config
    check_tp_size(cfg, tp.size)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear.from_linear(getattr(attn, name), tp, device))
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, tp, device)
        attn.n_heads, attn.n_kv = cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size
        mlp.gate_proj = ColumnParallelLinear.from_linear(mlp.gate_proj, tp, device)
        mlp.up_proj = ColumnParallelLinear.from_linear(mlp.up_proj, tp, device)
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, tp, device)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    model.model.embed_tokens = VocabParallelEmbedding.from_embedding(model.model.embed_tokens, tp, device)
    head = VocabParallelLMHead.from_linear(model.lm_head, tp, gather_logits, device) if not tied else \
        VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp, model.model.embed_tokens.weight, gather_logits)
    model.lm_head = head
    for name, p in list(model.named_parameters()):  # the replicated norms: allocated (meta-built) or moved
        if p.is_meta or (device is not None and p.device != torch.device(device)):
            mod_name, _, attr = name.rpartition(".")
            data = torch.empty(p.shape, dtype=p.dtype, device=device or "cpu") if p.is_meta else p.detach().to(device)
            setattr(model.get_submodule(mod_name), attr, nn.Parameter(data, requires_grad=p.requires_grad))
    model.tp = tp
    model.tp_config = tp_local_config(cfg, tp.size)
    return model


def tp_shard(name: str, full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of a full HF Llama parameter (what ``parallelize_llama`` keeps under ``name``)."""
    split = llama_tp_split(name)
    if split is None:
        return full
    a, b = tp.bounds(full.shape[split])
    return full[a:b] if split == 0 else full[:, a:b]
