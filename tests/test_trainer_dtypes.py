"""A float32 trainer feeding a bfloat16 generator (trainer.dtype=float32, policy.dtype=bfloat16): the push casts
the trainer's weights to the generator's dtype (round to nearest even, the bytes of ``Tensor.to``), so the
float32 weights keep updates below a bfloat16 ulp that a bfloat16 trainer rounds away (warned)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dist_harness import random_model
from llamarl.config import TrainerConfig
from llamarl.config_cli import load_config
from llamarl.executors.generator import GeneratorExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.models import LlamaConfig
from llamarl.run_warnings import config_warnings
from llamarl.runtime import RankInfo
from llamarl.train import train

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


@pytest.fixture
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))


def test_a_run_with_a_bfloat16_generator_and_a_float32_trainer(tmp_path, _cache):
    out = tmp_path / "run"
    summary = train(load_config(["--preset", "smoke", "--set", "warm_start.steps=3", "--max-steps", "2",
                                 "--set", "policy.dtype=bfloat16", "--out", str(out)]))
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" not in r]
    assert [r["step"] for r in rows] == [1, 2]
    saved = json.loads((out / "checkpoints" / "step_000002" / "policy" / "config.json").read_text())
    assert saved["torch_dtype"] == "float32"  # the trainer's weights: a resume continues them exactly
