"""Skipping zero-advantage samples: collate's row dropping and the trainer's unchanged update.

A sample with A = 0 adds exactly nothing to the AIPO policy-gradient term, so a trainer step on the rows
that remain (with the whole batch's token or sequence count as the denominator) must give the same loss,
gradient norm and updated weights as the step on the full batch - up to fp32 summation order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_harness import random_model, single_process_train_step
from llamarl.config import TrainerConfig
from llamarl.models import LlamaConfig
from llamarl.rollouts import Rollout, collate

CFG = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
TRAINER = dataclasses.asdict(TrainerConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, micro_batch_size=3,
                                           loss="reference"))


def _rollouts(rows: int, seed: int = 3) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(rows):
        p, c = 2 + int(torch.randint(0, 4, (), generator=g)), 1 + int(torch.randint(0, 6, (), generator=g))
        tokens = torch.randint(3, CFG.vocab_size, (p + c,), generator=g).tolist()
        logprobs = (-3.9 + 0.5 * torch.randn(c, generator=g)).tolist()
        out.append(Rollout(f"s{i}", i // 4, tokens[:p], tokens[p:], logprobs, [0] * c, "", "length"))
    return out


ADV = torch.tensor([0.0, 0.75, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, -0.5, 0.0])  # 3 groups of 4


def test_collate_keeps_nonzero_rows_and_the_whole_token_count():
    rollouts = _rollouts(len(ADV))
    full = collate(rollouts, ADV, pad_id=0)
    kept = collate(rollouts, ADV, pad_id=0, drop_zero_advantage=True)
    nonzero = [i for i in range(len(ADV)) if ADV[i] != 0]
    assert kept["advantages"].tolist() == ADV[nonzero].tolist()
    assert float(kept["total_tokens"]) == float(full["total_tokens"]) == float(full["mask"].sum())
    assert float(kept["total_sequences"]) == float(full["total_sequences"]) == len(ADV)
    for i, j in enumerate(nonzero):  # the kept rows are the full batch's rows (up to the shorter padding)
        n = kept["input_ids"].shape[1]
        assert torch.equal(kept["input_ids"][i], full["input_ids"][j, :n]) and full["input_ids"][j, n:].eq(0).all()
    # a sharded trainer needs a multiple of its ranks: zero rows fill up, in batch order
    three = collate(rollouts, ADV, pad_id=0, drop_zero_advantage=True, row_multiple=3)
    assert three["advantages"].tolist() == [0.0, 0.75, -0.25, 0.0, 0.5, -0.5]  # rows 0 and 3 fill up
    # nothing to learn from: still row_multiple rows, so the optimizer step runs as on the full batch
    none = collate(rollouts, torch.zeros(len(ADV)), pad_id=0, drop_zero_advantage=True, row_multiple=2)
    assert none["advantages"].shape[0] == 2 and float(none["total_tokens"]) == float(full["total_tokens"])
    with pytest.raises(ValueError, match="row_multiple"):
        collate(rollouts, ADV, pad_id=0, drop_zero_advantage=True, row_multiple=0)


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_trainer_update_is_the_same_without_zero_advantage_rows(tmp_path, norm):
    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts = _rollouts(len(ADV))
    cfg = dict(TRAINER, norm=norm)
    full_stats, full_w = single_process_train_step(tmp_path / "model", CFG, collate(rollouts, ADV, 0), cfg,
                                                   max_new_tokens=9)
    kept = collate(rollouts, ADV, 0, drop_zero_advantage=True)
    kept_stats, kept_w = single_process_train_step(tmp_path / "model", CFG, kept, cfg, max_new_tokens=9)
    assert kept_stats["applied"] and full_stats["applied"]
    assert kept_stats["loss"] == pytest.approx(full_stats["loss"], rel=1e-5, abs=1e-7)
    assert kept_stats["grad_norm"] == pytest.approx(full_stats["grad_norm"], rel=1e-5)
    for n, w in full_w.items():
        torch.testing.assert_close(kept_w[n], w, rtol=0, atol=2e-6, msg=n)
    # and the update is not trivially zero: the weights moved
    assert any(not torch.equal(w, full_w[n]) for n, w in random_model(CFG).named_parameters())
