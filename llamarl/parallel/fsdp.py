"""FSDP2 sharding of the trainer's Llama, gradient accumulation, and the weight sync's source shards.

``apply_fsdp(model, group, config)`` calls ``torch.distributed.fsdp.fully_shard`` on every decoder layer
and then on the root (embeddings, final norm, lm_head), over a 1-D mesh of the trainer's process group
(R_t ranks). Every parameter becomes a DTensor with placement ``Shard(0)``: rank t holds rows
``[t*c, min((t+1)*c, rows))`` with ``c = ceil(rows / R_t)`` (``torch.chunk``; trailing shards may be
shorter or empty). That is exactly ``weight_sync.TrainerLayout`` (sharded), so ``local_shards(model)``
hands the DDMA planner this rank's rows with no copy and no gather: ``DTensor.to_local()``.

Math of one optimizer step over R_t ranks and M micro-batches per rank (loss_fn(b) on micro-batch b):

    grad_reduce="mean":  g = 1/(R_t M) * sum_r sum_m grad loss_fn(b_rm)      (DDP convention)
    grad_reduce="sum":   g =            sum_r sum_m grad loss_fn(b_rm)      (loss_fn normalises itself,
                                                                             e.g. by the global token count)
With "mean" and equal-sized micro-batches of a mean loss, g is the gradient of the mean loss over the
global batch, i.e. what a single process computes on the whole batch. ``accumulate_gradients`` skips
the reduce-scatter on all but the last micro-batch (``set_requires_gradient_sync(False)``): unsharded
gradients accumulate locally and are reduced once.

Mixed precision (``FSDPConfig(mixed_precision=True)``): ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the sharded (master) parameters and the optimizer stay fp32, the all-gathered
parameters and the forward/backward compute are bf16, gradients are cast to fp32 before the
reduce-scatter, so the sharded gradients and updates are fp32. The shards handed to the weight sync are
the fp32 master rows (``local_shards(model, dtype=torch.bfloat16)`` casts them for a bf16 generator).

``model.hidden_states`` is registered as an FSDP forward method, so the fused loss path (hidden states
+ lm_head weight) works: after it, the root's parameters (lm_head) stay unsharded until backward.

The training loop's helpers around the sharded step (llamarl.executors.trainer): ``clip_grad_norm_``
(the global norm of the unsharded gradient, reduced over the mesh, so every rank clips by the same
factor), ``full_optimizer_state`` / ``load_full_optimizer_state`` (AdamW state gathered into, and cut back
out of, the unsharded optimizer's ``state_dict`` format, so checkpoints move between any numbers of ranks).

Works on CPU with gloo (torch 2.13): sharding, bf16 mixed precision, mean and sum reductions (sum uses
FSDP's "force sum" reductions because gloo lacks PREMUL_SUM), gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from llamarl.models import Llama
from llamarl.parallel.grads import clip_grad_norm_  # noqa: F401 - part of this module's API
from llamarl.weight_sync.layout import chunk_bounds

GRAD_REDUCE = ("mean", "sum")
T = TypeVar("T")


@dataclass(frozen=True)
class FSDPConfig:
    """How the trainer shards: mixed precision (bf16 compute, fp32 reduce), resharding, gradient reduction."""

    mixed_precision: bool = False
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: bool = True  # decoder layers; the root never reshards after forward
    grad_reduce: str = "mean"

    def __post_init__(self) -> None:
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"FSDPConfig.grad_reduce must be one of {GRAD_REDUCE}, got {self.grad_reduce!r}")
        for name in ("param_dtype", "reduce_dtype"):
            if not isinstance(getattr(self, name), torch.dtype) or not getattr(self, name).is_floating_point:
                raise ValueError(f"FSDPConfig.{name} must be a floating torch.dtype, got {getattr(self, name)!r}")

    def policy(self) -> MixedPrecisionPolicy:
        if not self.mixed_precision:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


@dataclass(frozen=True)
class LocalShard:
    """This rank's rows [row_offset, row_offset + tensor.shape[0]) of a parameter of ``global_shape``."""

    tensor: torch.Tensor
    row_offset: int
    global_shape: tuple[int, ...]


def _mesh(group: Any, device_type: str) -> DeviceMesh:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("apply_fsdp needs torch.distributed: call dist.init_process_group (gloo on CPU, nccl on "
                           "GPU) first, even for a single trainer rank")
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"apply_fsdp shards over a 1-D mesh (FSDP dim-0 shards are the weight sync's source "
                             f"layout); got a {group.ndim}-D mesh")
        return group
    if group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(group, device_type)


def apply_fsdp(model: Llama, group: Any = None, config: FSDPConfig = FSDPConfig()) -> Llama:
    """Shard ``model`` in place with FSDP2 (per decoder layer, then the root); returns it.

    group: the trainer's process group (None = WORLD) or a 1-D DeviceMesh. The mesh's device type
    follows the model (cpu -> gloo, cuda -> nccl); move the model to its GPU before calling.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"apply_fsdp needs a llamarl Llama, got {type(model).__name__}")
    if isinstance(model, FSDPModule):
        raise ValueError("this model is already sharded (apply_fsdp was applied before)")
    if not isinstance(config, FSDPConfig):
        raise TypeError(f"config must be an FSDPConfig, got {type(config).__name__}")
    dev = model.device
    if dev.type == "meta":
        raise ValueError("apply_fsdp needs materialised weights (the model is on the meta device); load or "
                         "initialise them first")
    mesh = _mesh(group, dev.type)
    policy = config.policy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    # The root (embeddings, final norm, lm_head) stays unsharded from forward to backward: it is needed
    # again at once, and ``forward`` calls the registered ``hidden_states`` (a nested FSDP forward).
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    register_fsdp_forward_method(model, "hidden_states")
    if config.grad_reduce == "sum":  # both setters act on one FSDP unit only: apply them to every unit
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)
    return model


def _check_sharded(name: str, p: torch.Tensor) -> DTensor:
    if not isinstance(p, DTensor):
        raise ValueError(f"parameter {name!r} is not a DTensor: call apply_fsdp(model, ...) first")
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"parameter {name!r} has placements {p.placements} on a {p.device_mesh.ndim}-D mesh; the "
                         "weight sync expects FSDP dim-0 shards on a 1-D mesh (Shard(0))")
    return p


def local_shards(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, LocalShard]:
    """name -> this rank's dim-0 shard (a view of FSDP's storage, no copy unless ``dtype`` casts).

    Shards follow ``torch.chunk`` (= ``TrainerLayout(world_size=R_t).rows``); a tensor that does not is
    rejected with its name rather than silently re-cut. Tied weights appear once, under their first name.
    """
    out: dict[str, LocalShard] = {}
    for name, p in model.named_parameters():
        d = _check_sharded(name, p)
        local = d.to_local()
        world, rank = d.device_mesh.size(), d.device_mesh.get_local_rank()
        a, b = chunk_bounds(d.shape[0], world, rank)
        if tuple(local.shape) != (b - a, *d.shape[1:]):
            raise RuntimeError(f"FSDP shard of {name!r} on rank {rank}/{world} has shape {tuple(local.shape)}, "
                               f"expected "
                               f"rows [{a}, {b}) of {tuple(d.shape)} (torch.chunk); this torch version shards "
                               "differently from the weight sync's TrainerLayout")
        t = local.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        out[name] = LocalShard(t.contiguous(), a, tuple(d.shape))
    return out


def sync_sources(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """name -> local shard tensor: the argument of ``WeightSender.sync`` / ``DistSender.sync``."""
    return {n: s.tensor for n, s in local_shards(model, dtype).items()}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> full tensor, all-gathered over the trainer group (a collective: call it on every rank).

    For checkpoints and tests only; the weight sync never gathers.
    """
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded (DTensor) state tensor gathered whole, on the CPU.

    A collective (call it on every rank, in the same order). The result has exactly the format of the
    unsharded optimizer's ``state_dict()`` (integer parameter ids in ``param_groups`` order), so a
    checkpoint written by R_t ranks loads into 1 rank and vice versa (``load_full_optimizer_state``).
    """
    sd = optimizer.state_dict()
    state = {i: {k: (v.full_tensor().cpu() if isinstance(v, DTensor) else v) for k, v in s.items()}
             for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a full (unsharded) optimizer state into an optimizer over FSDP parameters, on every rank.

    Each state tensor shaped like its (global) parameter is cut to this rank's ``Shard(0)`` rows locally
    (no communication: every rank holds the full state); other entries (``step``) load as they are.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in state["param_groups"] for i in group["params"]]
    if len(ids) != len(params):
        raise ValueError(f"the optimizer state has {len(ids)} parameters but this optimizer has {len(params)}; "
                         "it belongs to another model")
    out = {}
    for i, p in zip(ids, params):
        if i not in state["state"]:
            continue
        entry = {}
        for k, v in state["state"][i].items():
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) \
                    and v.dim() > 0:
                v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            entry[k] = v
        out[i] = entry
    optimizer.load_state_dict({"state": out, "param_groups": state["param_groups"]})


def accumulate_gradients(model: nn.Module, micro_batches: Sequence[T] | Iterable[T],
                         loss_fn: Callable[[T], torch.Tensor], *, average: bool = True) -> list[float]:
    """Forward + backward over ``micro_batches``, reducing gradients across ranks once, after the last.

    Each micro-batch's loss is divided by the number of micro-batches when ``average`` (so "mean"
    reduction gives the mean over ranks and micro-batches); returns the undivided losses. Every rank
    must pass the same number of micro-batches (the reduce-scatter is a collective).
    """
    batches = list(micro_batches)
    if not batches:
        raise ValueError("accumulate_gradients needs at least one micro-batch")
    if not isinstance(model, FSDPModule):
        raise TypeError("accumulate_gradients expects a model sharded by apply_fsdp (an FSDPModule)")
    n = len(batches)
    losses = []
    try:
        for i, mb in enumerate(batches):
            model.set_requires_gradient_sync(i == n - 1)
            loss = loss_fn(mb)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)}")
            (loss / n if average else loss).backward()
            losses.append(float(loss.detach()))
    finally:
        model.set_requires_gradient_sync(True)
    return losses
