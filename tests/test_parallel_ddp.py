"""llamarl.parallel.ddp on 2 gloo ranks: gradients summed exactly over ranks (across buckets and dtypes,
missing gradients as zeros), and the replica check sees a divergence."""

from __future__ import annotations

import torch
from torch import nn

import llamarl.parallel.ddp as ddp
from dist_harness import launch


def _ddp_worker(rank: int, world: int) -> dict:
    ddp.BUCKET_ELEMENTS = 7  # several buckets per dtype, split between tensors
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(4, 2).double(), "unused": nn.Linear(2, 2)})
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 + rank))
    model["b"](model["a"](x).double()).square().sum().backward()  # "unused" gets no gradient here
    local = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ddp.allreduce_gradients(model)
    summed = {n: p.grad.clone() for n, p in model.named_parameters()}
    agree = ddp.replicas_agree(model)
    if rank == 1:
        with torch.no_grad():
            model["a"].weight[0, 0] += 1e-7
    return {"local": local, "summed": summed, "agree": agree, "agree_after": ddp.replicas_agree(model)}


def test_allreduce_sums_gradients_and_the_replica_check_sees_divergence(tmp_path):
    results = launch(_ddp_worker, 2, tmp_path)
    for r in results:
        assert r["agree"] and not r["agree_after"]
        assert set(r["summed"]) == set(r["local"]) | {"unused.weight", "unused.bias"}
        for name, g in r["summed"].items():
            want = sum(x["local"].get(name, torch.zeros_like(g)) for x in results)
            assert g.dtype == want.dtype and torch.equal(g, want), name  # two summands: exact in any order
