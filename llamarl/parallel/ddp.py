"""Data parallelism for the trainer (``trainer.parallel=ddp``): whole replicas, gradients summed once.

Every one of the R_t ranks holds the whole model and its own AdamW state; rank r trains on its rows of
the step's batch (micro-batches m), and after the last backward the gradients are summed over ranks:

    g = Σ_r Σ_m ∇ loss_fn(b_rm)          (loss_fn normalises by the global denominator, as with FSDP's "sum")

``allreduce_gradients`` does this with one ``all_reduce`` per bucket of up to ``BUCKET_ELEMENTS``
gradient elements of one dtype (flattened, so a model of hundreds of tensors costs a few collectives,
and the extra memory is one bucket; a larger gradient is a bucket of its own, reduced in place). A
parameter without a gradient on some rank contributes zeros, so every rank joins the same collectives.
Afterwards every rank holds the same gradient and takes the same AdamW step: the replicas stay bitwise
equal (the ops are the same on the same values), which ``replicas_agree`` checks cheaply.

Compared with FSDP (llamarl.parallel.fsdp) this keeps R_t copies of the weights and optimizer state but
needs no all-gather per layer and micro-batch: the better choice when the model fits on one device.
The weight sync's source layout is ``TrainerLayout(world_size=R_t, replicated=True)``: rank t copies the
t-th dim-0 chunk of every parameter out of its full copy, so the copy work is split over the ranks and
nothing is gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BUCKET_ELEMENTS = 1 << 25  # 32M elements: 128 MiB of fp32 per all-reduce


def allreduce_gradients(model: nn.Module, group: Any = None) -> None:
    """Sum every trainable parameter's gradient over the ranks of ``group`` (a collective: call it on every
    rank with the same model). Missing gradients become zeros first, so they join the sum."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for p in params:
        per_dtype = buckets.setdefault(p.grad.dtype, [[]])
        if per_dtype[-1] and sum(g.numel() for g in per_dtype[-1]) + p.grad.numel() > BUCKET_ELEMENTS:
            per_dtype.append([])
        per_dtype[-1].append(p.grad)
    for per_dtype in buckets.values():
        for grads in per_dtype:
            if len(grads) == 1:  # one tensor (e.g. a bucket-sized embedding): reduce it in place, no copy
                dist.all_reduce(grads[0], group=group)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
            del flat  # before the next bucket is packed: one bucket of extra memory at a time


def replicas_agree(model: nn.Module, group: Any = None) -> bool:
    """Whether every rank holds bitwise the same parameters (a collective; compares one fp64 checksum per
    tensor, so a difference anywhere shows up unless it cancels exactly)."""
    # summed in chunks, so the fp64 copy is at most 16M elements (not 4x the largest bf16 tensor)
    sums = [sum(float(c.double().sum()) for c in p.detach().reshape(-1).split(1 << 24)) for p in model.parameters()]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sums, group=group)  # objects: any backend, any device
    return all(g == sums for g in gathered)
