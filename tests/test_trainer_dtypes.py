"""A float32 trainer feeding a bfloat16 generator (trainer.dtype=float32, policy.dtype=bfloat16): the push casts
the trainer's weights to the generator's dtype (round to nearest even, the bytes of ``Tensor.to``), so the
float32 weights keep updates below a bfloat16 ulp that a bfloat16 trainer rounds away (warned).

Mixed precision (trainer.compute_dtype=bfloat16 over trainer.dtype=float32): the gradient is the fp64
gradient of the step's AIPO loss up to bfloat16 rounding (and not the float32 trainer's: the compute really
is bf16), while weights, gradients and AdamW state stay float32; on one rank (autocast), and on two (FSDP's
mixed-precision policy, DDP with autocast)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dist_harness import random_model, single_process_train_step
from llamarl.algorithms import aipo_loss, token_logprobs
from llamarl.config import TrainerConfig
from llamarl.config_cli import load_config
from llamarl.executors.generator import GeneratorExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models import Llama, LlamaConfig
from llamarl.rollouts import collate
from llamarl.run_warnings import config_warnings
from llamarl.runtime import Layout, RankInfo, Runtime
from llamarl.train import train
from test_trainer_loss import TRAINER, _batch_rollouts
from test_zero_advantage import ADV, CFG as LOSS_CFG

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_a_float32_trainer_pushes_its_weights_rounded_to_bfloat16(tmp_path):
    random_model(CFG).save_pretrained(tmp_path / "model")  # float32 weights, most not bfloat16 numbers
    gen = GeneratorExecutor(model_config=CFG.to_hf_dict(), dtype="bfloat16", trainer_ranks=1, max_batch_size=4,
                            rank_info=RankInfo("generator", "generator", 0, 1, 1, 0, "cpu", "gloo"))
    trainer = TrainerExecutor(model_path=str(tmp_path / "model"), trainer=dataclasses.asdict(TrainerConfig()),
                              temperature=1.0, generator_handles=[gen.handle()], sync_dtype="bfloat16",
                              rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, "cpu", "gloo"))
    try:
        for version in (1, 2):
            if version == 2:  # an update far below a bfloat16 ulp: kept by the float32 weights
                with torch.no_grad():
                    for p in trainer.model.parameters():
                        p.add_(1e-4 * p.abs().clamp(min=1e-3))
            trainer.push_weights(version)
            weights = {n: p.detach() for n, p in trainer.model.named_parameters()}
            assert all(w.dtype == torch.float32 for w in weights.values())
            with gen.receiver.reading() as got:
                assert got == version
                params = dict(gen.model.named_parameters())
                assert params.keys() == weights.keys()
                for name, p in params.items():
                    assert p.dtype == torch.bfloat16, name
                    assert torch.equal(_bytes(p.detach()), _bytes(weights[name].to(torch.bfloat16))), name
    finally:
        trainer.close()
        gen.close()


def test_dtype_combinations():
    assert load_config(["--set", "policy.dtype=bfloat16"]).trainer.dtype == "float32"  # the default combination
    bf16 = load_config(["--set", "policy.dtype=bfloat16", "--set", "trainer.dtype=bfloat16"])
    warned = [w for w in config_warnings(bf16) if w.startswith("trainer.dtype=bfloat16")]
    assert len(warned) == 1 and "--set trainer.dtype=float32" in warned[0] and "at trainer.lr=" in warned[0]
    assert not [w for w in config_warnings(load_config([])) if w.startswith("trainer.dtype")]
    mixed = load_config(["--set", "policy.dtype=bfloat16", "--set", "trainer.compute_dtype=bfloat16"]).trainer
    assert (mixed.dtype, mixed.compute_dtype) == ("float32", "bfloat16")
    with pytest.raises(ValueError, match="^trainer.compute_dtype: float32 with trainer.dtype=bfloat16"):
        load_config(["--set", "policy.dtype=bfloat16", "--set", "trainer.dtype=bfloat16",
                     "--set", "trainer.compute_dtype=float32"])


UNCLIPPED = dict(TRAINER, grad_clip=1e9)  # the gradient the optimizer sees is the loss's own


def _spec_gradient(model_dir, batch) -> tuple[float, dict[str, torch.Tensor]]:
    """The step's AIPO loss (KL to the starting policy, entropy bonus) and its gradient, in fp64."""
    model = Llama.from_pretrained(model_dir).double()
    logprobs, entropy = token_logprobs(model(batch["input_ids"])[:, :-1], batch["targets"], 1.0)
    loss, _ = aipo_loss(logprobs, batch["behavior_logprobs"].double(), batch["advantages"].double(), batch["mask"],
                        rho=TRAINER["rho"], ref_logprobs=logprobs.detach(), kl_coef=TRAINER["kl_coef"],
                        entropy=entropy, entropy_coef=TRAINER["entropy_coef"])
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _relative_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    err = sum(float((grads[n].double() - g).norm()) ** 2 for n, g in ref.items()) ** 0.5
    return err / sum(float(g.norm()) ** 2 for g in ref.values()) ** 0.5


def _trainer_step(model_dir, trainer: dict, batch, device: str) -> tuple[dict, dict, TrainerExecutor]:
    """One train_step of a one-rank trainer on ``device`` (never pushed): its stats, the gradient AdamW
    stepped with, and the trainer."""
    ex = TrainerExecutor(model_path=str(model_dir), trainer=trainer, temperature=1.0,
                         rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, device, "gloo"))
    seen = {}
    step = ex.opt.step
    ex.opt.step = lambda: (seen.update({n: p.grad.cpu() for n, p in ex.model.named_parameters()}), step())
    return ex.train_step(batch), seen, ex


@pytest.mark.parametrize("loss, device, rows", [("reference", "cpu", 3), ("fused", "cpu", 3), ("reference", "cpu", 1),
                                                pytest.param("fused", "cuda", 3, marks=pytest.mark.gpu)])
def test_mixed_precision_steps_float32_weights_with_a_bfloat16_gradient(tmp_path, loss, device, rows):
    """``rows`` sequences per micro-batch; 1 gives forwards of <= 8 positions, which the no-grad forwards (the KL
    reference) would otherwise run through the native fp32 CPU linear (llamarl.models.linear), past autocast."""
    random_model(LOSS_CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0)
    spec_loss, spec_grads = _spec_gradient(tmp_path / "model", batch)
    errors = {}
    for compute in (None, "bfloat16"):
        cfg = dict(UNCLIPPED, compute_dtype=compute, loss=loss, micro_batch_size=rows)
        stats, grads, ex = _trainer_step(tmp_path / "model", cfg, batch, device)
        assert stats["applied"] and stats["loss"] == pytest.approx(spec_loss, rel=2e-3)
        assert stats["kl_ref"] == 0.0  # the reference runs in the same precision: KL 0 at the start
        errors[compute] = _relative_error(grads, spec_grads)
        assert {g.dtype for g in grads.values()} == {p.dtype for p in ex.model.parameters()} == {torch.float32}
        assert {v.dtype for st in ex.opt.state.values() for v in st.values() if v.dim()} == {torch.float32}
    # measured on the CPU: 2.3e-7 (float32) and 3.6e-3 (bfloat16 matmuls; bfloat16's unit roundoff is 3.9e-3);
    # fused: 2.3e-7, 4.5e-3
    assert errors[None] <= (1e-5 if device == "cpu" else 1e-4) and 1e-4 <= errors["bfloat16"] <= 2e-2, errors


@pytest.mark.parametrize("parallel, loss", [("fsdp", "reference"), ("ddp", "reference"), ("fsdp", "fused")])
def test_mixed_precision_on_two_trainer_ranks(tmp_path, parallel, loss):
    """Two ranks: the step's loss and (global, unclipped) gradient norm are the fp64 specification's up to
    bfloat16 rounding, and differ from the float32 trainer's; every rank reports the same numbers; the
    checkpoint holds the float32 master weights. FSDP with the fused loss is the GPU recipe: the kernel
    multiplies by FSDP's gathered bf16 lm_head."""
    model_dir = tmp_path / "model"
    random_model(LOSS_CFG).save_pretrained(model_dir)
    batch = collate(_batch_rollouts(), ADV, 0)
    spec_loss, spec_grads = _spec_gradient(model_dir, batch)
    spec_norm = sum(float(g.norm()) ** 2 for g in spec_grads.values()) ** 0.5
    fp32 = single_process_train_step(model_dir, LOSS_CFG, batch, dict(UNCLIPPED, parallel=parallel, loss=loss))[0]
    cfg = dict(UNCLIPPED, parallel=parallel, compute_dtype="bfloat16", loss=loss)
    with Runtime(Layout.parse("trainer=2,generator=1x1,reward=0")) as rt:
        gen, = rt.spawn_role("generator", "llamarl.executors.generator:GeneratorExecutor", init_kwargs=dict(
            model_config=LOSS_CFG.to_hf_dict(), dtype="float32", trainer_ranks=2, max_batch_size=8, threads=1))
        trainer, = rt.spawn_role("trainer", "llamarl.executors.trainer:TrainerExecutor", init_kwargs=dict(
            model_path=str(model_dir), trainer=cfg, temperature=1.0, generator_handles=gen.call("handle").result(),
            threads=1))
        trainer.call("push_weights", 0).result()
        per_rank = trainer.call("train_step", batch).result(timeout=120)
        paths = trainer.call("save_checkpoint", str(tmp_path / "run"), 1, 1, 0).result()
    stats = per_rank[0]
    assert stats["applied"] and all(s["loss"] == stats["loss"] and s["grad_norm"] == stats["grad_norm"]
                                    for s in per_rank)
    assert stats["loss"] == pytest.approx(spec_loss, rel=2e-3)
    assert stats["grad_norm"] == pytest.approx(spec_norm, rel=2e-3)  # measured 1.5e-4 (fsdp), 2.2e-4 (ddp)
    assert abs(stats["grad_norm"] - fp32["grad_norm"]) > 1e-5 * fp32["grad_norm"]  # the compute really is bf16
    assert fp32["grad_norm"] == pytest.approx(spec_norm, rel=1e-5)
    saved = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "policy" / "config.json").read_text())
    assert len(set(paths)) == 1 and saved["torch_dtype"] == "float32"


@pytest.fixture
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


def test_a_run_with_a_bfloat16_generator_and_a_mixed_precision_trainer(tmp_path, _cache, capsys):
    out = tmp_path / "run"
    summary = train(load_config(["--preset", "smoke", "--set", "warm_start.steps=3", "--max-steps", "2",
                                 "--set", "policy.dtype=bfloat16", "--set", "trainer.compute_dtype=bfloat16",
                                 "--out", str(out)]))
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    saved = json.loads((out / "checkpoints" / "step_000002" / "policy" / "config.json").read_text())
    assert saved["torch_dtype"] == "float32"  # the trainer's weights: a resume continues them exactly
    assert "warning: trainer.compute_dtype=bfloat16 on the CPU" in capsys.readouterr().err
