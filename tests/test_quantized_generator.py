"""The training loop's quantized generator: quantize-on-sync into QuantizedLinear buffers.

In one process: a GeneratorExecutor with ``quantization`` int8 / fp8 and a TrainerExecutor whose plan
quantizes on sync. After ``push_weights`` every quantized buffer the generator computes with holds exactly
the reference quantization (llamarl_kernels.reference.quantize_ref) of the trainer's weight, the other
parameters hold the trainer's bytes, and greedy generation equals that of an independently quantized copy
of the trainer's model. End to end, ``train()`` runs with an int8 generator; int8 with tp > 1 is refused.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from dist_harness import random_model
from llamarl.config import ConfigError, TrainerConfig
from llamarl.config_cli import load_config
from llamarl.executors.generator import GeneratorExecutor
from llamarl.executors.trainer import TrainerExecutor
from llamarl.generation import SamplingParams, generate
from llamarl.models import LlamaConfig
from llamarl.models.quantize import QuantizedLinear, quantize_model
from llamarl.runtime import RankInfo
from llamarl.train import train
from llamarl_kernels.reference import quantize_ref

CFG = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
TRAINER = dataclasses.asdict(TrainerConfig(loss="reference"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_push_writes_the_reference_quantization_into_the_generators_buffers(tmp_path, mode):
    model = random_model(CFG)
    model.save_pretrained(tmp_path / "model")
    gen = GeneratorExecutor(model_config=CFG.to_hf_dict(), dtype="float32", trainer_ranks=1, max_batch_size=8,
                            quantization=mode, rank_info=RankInfo("generator", "generator", 0, 1, 1, 0, "cpu", "gloo"))
    trainer = TrainerExecutor(model_path=str(tmp_path / "model"), trainer=TRAINER, temperature=1.0,
                              generator_handles=[gen.handle()], generator_quantization=mode,
                              rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, "cpu", "gloo"))
    try:
        trainer.push_weights(1)
        weights = dict(trainer.model.named_parameters())
        quantized = 0
        with gen.receiver.reading() as version:
            assert version == 1
            for name, mod in gen.model.named_modules():
                if isinstance(mod, QuantizedLinear):
                    q, s = quantize_ref(weights[f"{name}.weight"].detach(), mode)
                    assert torch.equal(_bytes(mod.qweight), _bytes(q)), name
                    assert torch.equal(_bytes(mod.scale), _bytes(s)), name
                    quantized += 1
            for name, p in gen.model.named_parameters():  # embeddings, norms, lm_head: the trainer's bytes
                assert torch.equal(_bytes(p.detach()), _bytes(weights[name].detach())), name
        assert quantized == 7 * CFG.num_hidden_layers
        prompts = [[1, 5, 9, 13], [1, 7, 2]]
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        got = gen.generate(prompts, greedy)["samples"]
        ref_model = quantize_model(copy.deepcopy(model), mode, backend="eager")
        want = generate(ref_model, prompts, greedy, eos_token_id=())
        assert [o["token_ids"] for o in got] == [o.token_ids[:len(g["token_ids"])] for o, g in zip(want, got)]
        assert all(v == 1 for o in got for v in o["policy_versions"])
    finally:
        trainer.close()
        gen.close()


def test_train_runs_with_an_int8_generator(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(["--preset", "smoke", "--set", "warm_start.steps=3", "--set", "generator.quantization=int8",
                       "--out", str(tmp_path / "run")])
    summary = train(cfg)
    assert summary["steps"] == cfg.run.max_steps and summary["skipped_updates"] == 0


def test_quantized_tensor_parallel_generator_is_refused():
    """By the config itself, before the launcher starts anything (it was refused after the fork server started)."""
    with pytest.raises(ConfigError, match="^generator.quantization: quantized generators run with generator.tp=1"):
        load_config(["--preset", "smoke", "--set", "generator.quantization=fp8", "--set", "generator.tp=2"])
