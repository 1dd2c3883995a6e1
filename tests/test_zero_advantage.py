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


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_masked_truncated_completions_train_like_a_batch_without_them(tmp_path, norm):
    """trainer.mask_truncated: the update equals the one on the batch of the other completions alone, with the
    advantages they had in the full batch; the truncated ones only count in total_rows."""
    from llamarl.rollouts import without_truncated

    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts = [dataclasses.replace(r, finish_reason="stop" if i % 3 else "length")
                for i, r in enumerate(_rollouts(len(ADV)))]
    adv = torch.linspace(-1.0, 1.0, len(ADV))
    masked, masked_adv = without_truncated(rollouts, adv)
    cut = [i for i, r in enumerate(rollouts) if r.finish_reason == "length"]
    assert cut == [0, 3, 6, 9] and all(masked[i].completion_ids == [] for i in cut)
    assert masked_adv.tolist() == [0.0 if i in cut else a for i, a in enumerate(adv.tolist())]
    assert [masked[i] for i in range(len(ADV)) if i not in cut] == [r for i, r in enumerate(rollouts) if i not in cut]
    kept = [i for i in range(len(ADV)) if i not in cut]
    batch = collate(masked, masked_adv, 0)
    alone = collate([rollouts[i] for i in kept], adv[kept], 0)
    assert float(batch["total_tokens"]) == float(alone["total_tokens"]) == sum(len(rollouts[i].completion_ids)
                                                                                for i in kept)
    assert float(batch["total_rows"]) == len(ADV)
    cfg = dict(TRAINER, norm=norm)
    stats, weights = single_process_train_step(tmp_path / "model", CFG, batch, cfg)
    ref_stats, ref_weights = single_process_train_step(tmp_path / "model", CFG, alone, cfg)
    assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5, abs=1e-7)
    for n, w in ref_weights.items():
        torch.testing.assert_close(weights[n], w, rtol=0, atol=2e-6, msg=n)


def test_dropping_zero_rows_keeps_a_row_with_tokens_so_the_update_stays_the_same(tmp_path):
    """Every advantage 0 and the first rows truncated away (mask_truncated): the filler row must be one with
    tokens, so the trimmed batch steps AdamW (a zero-gradient step, momentum and decay still move the weights)
    exactly as the full batch does. It used to keep row 0 (empty): no update, no new version, and the step
    was counted as a skipped update."""
    from llamarl.rollouts import without_truncated

    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts = [dataclasses.replace(r, finish_reason="length" if i < 2 else "stop")
                for i, r in enumerate(_rollouts(len(ADV)))]
    masked, adv = without_truncated(rollouts, torch.zeros(len(ADV)))
    kept = collate(masked, adv, 0, drop_zero_advantage=True)
    assert kept["mask"].sum() > 0
    cfg = dict(TRAINER, norm="token")
    # a first step with real advantages, so AdamW has momentum to carry into the zero-gradient step
    first = collate(rollouts, ADV, 0)
    full_stats, full_w = single_process_train_step(tmp_path / "model", CFG, [first, collate(masked, adv, 0)], cfg)
    kept_stats, kept_w = single_process_train_step(tmp_path / "model", CFG, [first, kept], cfg)
    assert full_stats["updates"] == kept_stats["updates"] == 2 and kept_stats["empty_updates"] == 0
    for n, w in full_w.items():
        torch.testing.assert_close(kept_w[n], w, rtol=0, atol=2e-6, msg=n)
    # a batch without any token trains nothing: not applied, and counted as empty, not as a failure
    nothing = collate(without_truncated(rollouts, ADV)[0][:2], torch.zeros(2), 0)
    stats, _ = single_process_train_step(tmp_path / "model", CFG, nothing, cfg)
    assert not stats["applied"] and stats["updates"] == 0 and stats["empty_updates"] == 1
