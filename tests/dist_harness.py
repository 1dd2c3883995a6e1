"""Shared harness for the multi-process gloo tests: run ``fn(rank, world)`` on ``world`` processes,
and build the seeded reference models they compare against.

Each rank joins a gloo group through a file store in ``workdir``, runs ``fn`` and saves its result;
a failing rank's traceback is collected and shown, and every wait is bounded so a hang is an error.
"""

from __future__ import annotations

import contextlib

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from llamarl.models import Llama, LlamaConfig


def _entry(fn, rank: int, world: int, workdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world)
        torch.save(result, f"{workdir}/result{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{workdir}/error{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def finish_quietly(proc, timeout: float = 300.0) -> dict[str, str]:
    """Wait for a child Python process that prints ``KEY value`` lines; it must exit 0 without any traceback
    (a KeyboardInterrupt one included). Returns its lines as a dict; the child is killed if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err
    return dict(line.split(" ", 1) for line in out.splitlines())


def launch(fn, world: int, workdir, timeout: float = 150.0) -> list[dict]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "llamarl.models", "llamarl.parallel.fsdp",
                                "llamarl.parallel.tensor_parallel"])
    procs = [ctx.Process(target=_entry, args=(fn, r, world, str(workdir)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    errors = [open(f"{workdir}/error{r}.txt").read() for r in range(world) if os.path.exists(f"{workdir}/error{r}.txt")]
    assert not errors, "rank failures:\n" + "\n".join(errors)
    assert not hung, f"ranks {hung} did not finish within {timeout} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(f"{workdir}/result{r}.pt") for r in range(world)]


def random_model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """A seeded random Llama with norm weights away from 1, so a wrongly replicated norm would show."""
    torch.manual_seed(seed)
    m = Llama(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


STEP_STATS = ("loss", "grad_norm", "ratio_mean", "ratio_max", "truncated_frac", "mismatch_kl", "entropy", "kl_ref",
              "tokens")


def assert_same_step(stats: dict, weights: dict, ref_stats: dict, ref_weights: dict, *, atol: float) -> None:
    """Two trainer steps agree: both applied, the same loss, norm and AIPO metrics (fp32 rel 1e-5), and
    updated weights within ``atol`` (AdamW's first step is ~lr * g / (|g| + eps): where |g| is near eps,
    fp32 rounding of g moves the step visibly, so atol is a fraction of lr, not of eps)."""
    assert stats["applied"] and ref_stats["applied"]
    for key in STEP_STATS:
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-5, abs=1e-6), key
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=atol, msg=name)


@contextlib.contextmanager
def single_process_trainer(model_dir, cfg: LlamaConfig, trainer: dict, **kwargs):
    """A one-rank TrainerExecutor in this process, writing into buckets of its own."""
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.runtime import RankInfo
    from llamarl.weight_sync import GeneratorBuckets, GeneratorLayout, TrainerLayout, llama_param_specs, plan_sync

    plan = plan_sync(llama_param_specs(cfg), TrainerLayout(world_size=1), GeneratorLayout())
    buckets = GeneratorBuckets.create(plan, 0, storage="shm")
    try:
        ex = TrainerExecutor(model_path=str(model_dir), trainer=trainer, temperature=kwargs.pop("temperature", 1.0),
                             generator_handles=[buckets.handle()],
                             rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, "cpu", "gloo"), **kwargs)
        try:
            yield ex
        finally:
            ex.close()
    finally:
        buckets.close()


def weights_of(ex) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in ex.model.named_parameters()}


def single_process_train_step(model_dir, cfg: LlamaConfig, batch, trainer: dict,
                              **kwargs) -> tuple[dict, dict[str, torch.Tensor]]:
    """One ``train_step`` of a one-rank TrainerExecutor in this process (the reference of the trainer
    tests): (its stats, the updated parameters)."""
    with single_process_trainer(model_dir, cfg, trainer, **kwargs) as ex:
        return ex.train_step(batch), weights_of(ex)
