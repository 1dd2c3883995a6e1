"""Several optimizer updates per RL step (``trainer.mini_batches``, ``trainer.epochs``).

Without the clip (``clip_ratio=0``), a step cut into k mini-batches of whole prompt groups must be exactly
k successive one-batch steps on those parts (same weights, bit for bit: the same operations in the same
order), and e passes must be the one-batch step repeated e times. With it (the default), every update
after the first follows the decoupled PPO loss against the policy the step started from, on the single
rank, with the fused kernel and on FSDP ranks (tests/test_train_scaleout.py). The learning-rate schedule
must count RL steps, not updates, and the generators must get one new version per step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dist_harness import random_model, single_process_trainer, weights_of
from llamarl.algorithms import aipo_loss, token_logprobs
from llamarl.config import ConfigError, TrainConfig, TrainerConfig
from llamarl.models import Llama
from llamarl.rollouts import collate
from llamarl.train import main
from test_trainer_loss import _batch_rollouts
from test_zero_advantage import ADV, CFG

TRAINER = dataclasses.asdict(TrainerConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, micro_batch_size=3,
                                           loss="reference", clip_ratio=0.0))


def _parts(k: int) -> list[dict]:
    rollouts, size = _batch_rollouts(), len(ADV) // k
    return [collate(rollouts[lo:lo + size], ADV[lo:lo + size], 0, drop_zero_advantage=True, share_prompts=True)
            for lo in range(0, len(ADV), size)]


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_mini_batches_are_successive_updates(tmp_path):
    random_model(CFG).save_pretrained(tmp_path / "model")
    parts = _parts(3)
    with single_process_trainer(tmp_path / "model", CFG, dict(TRAINER, mini_batches=3)) as ex:
        stats = ex.train_step(parts)
        mini = weights_of(ex)
    with single_process_trainer(tmp_path / "model", CFG, TRAINER) as ex:
        one_by_one = [ex.train_step(p) for p in parts]
        sequential = weights_of(ex)
    _assert_same(mini, sequential)
    assert stats["applied"] and stats["updates"] == 3
    assert stats["loss"] == pytest.approx(sum(s["loss"] for s in one_by_one) / 3, rel=1e-12)
    assert stats["grad_norm"] == pytest.approx(sum(s["grad_norm"] for s in one_by_one) / 3, rel=1e-12)
    assert stats["tokens"] == sum(s["tokens"] for s in one_by_one)
    assert stats["ratio_max"] == max(s["ratio_max"] for s in one_by_one)
    # one update on the whole batch is another step
    with single_process_trainer(tmp_path / "model", CFG, TRAINER) as ex:
        ex.train_step(collate(_batch_rollouts(), ADV, 0, drop_zero_advantage=True, share_prompts=True))
        assert any(not torch.equal(w, mini[n]) for n, w in weights_of(ex).items())


def _decoupled_ppo_reference(model_dir, parts: list[dict], cfg: dict, epochs: int) -> tuple[dict, list[float]]:
    """The specification of a clipped step, written out: π_old from the starting weights, then one AdamW
    step per part and epoch on llamarl.algorithms.aipo_loss(old_logprobs=π_old, clip=...) over the whole
    part (the first part of the first epoch with π_old = π). Returns the weights and each update's clip_frac."""
    model = Llama.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]),
                            weight_decay=cfg["weight_decay"])
    with torch.no_grad():
        olds = [token_logprobs(model(p["input_ids"])[:, :-1], p["targets"])[0] for p in parts]
    fracs = []
    for epoch in range(epochs):
        for i, p in enumerate(parts):
            lp, _ = token_logprobs(model(p["input_ids"])[:, :-1], p["targets"])
            loss, m = aipo_loss(lp, p["behavior_logprobs"], p["advantages"], p["mask"], rho=cfg["rho"],
                                old_logprobs=olds[i] if i or epoch else None,
                                clip=(cfg["clip_ratio"], cfg["clip_ratio_high"]))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            opt.step()
            fracs.append(m["clip_frac"].item())
    return {n: p.detach() for n, p in model.named_parameters()}, fracs


def _relative_distance(weights: dict, expected: dict, initial: dict) -> float:
    """||weights - expected|| / ||expected - initial|| over all parameters: how far off the update is."""
    off = sum(float(((weights[n].double() - w.double()) ** 2).sum()) for n, w in expected.items())
    update = sum(float(((w.double() - initial[n].detach().double()) ** 2).sum()) for n, w in expected.items())
    return (off / update) ** 0.5


@pytest.mark.parametrize("mini_batches, epochs, loss", [(2, 1, "reference"), (1, 2, "reference"), (2, 1, "fused")])
def test_clipped_updates_follow_the_decoupled_ppo_loss(tmp_path, mini_batches, epochs, loss):
    """A big learning rate moves π far from π_old after the first update, so the clip acts; the trainer's
    weights equal the written-out specification, and differ clearly from the unclipped step."""
    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts, size = _batch_rollouts(), len(ADV) // mini_batches
    parts = [collate(rollouts[lo:lo + size], ADV[lo:lo + size], 0) for lo in range(0, len(ADV), size)]
    cfg = dict(TRAINER, lr=0.1, mini_batches=mini_batches, epochs=epochs, micro_batch_size=5, loss=loss,
               clip_ratio=0.2, clip_ratio_high=0.28)
    with single_process_trainer(tmp_path / "model", CFG, cfg) as ex:
        stats = ex.train_step(parts)
        ours = weights_of(ex)
    expected, fracs = _decoupled_ppo_reference(tmp_path / "model", parts, cfg, epochs)
    assert fracs[0] == 0.0 and fracs[-1] > 0.05, fracs  # nothing to clip in the first update, some in the last
    assert stats["updates"] == mini_batches * epochs and 0 < stats["clip_frac"] < 1
    # fp32 rounding only (the specification runs each part as one batch, the trainer in micro-batches of 5),
    # compared over the whole update: at lr=0.1 AdamW's first step divides each gradient by its own magnitude,
    # so the few entries whose gradient cancels to near eps turn rounding noise (which differs between CPUs'
    # kernels) into a single-entry difference of up to a few 1e-3 lr (measured 3.7e-3 lr on an AMD EPYC, one
    # entry of 18,912). Measured distance / update norm: 0 for (2, 1), 1.6e-6 for (1, 2), 1.9e-5 fused; no clip
    # is 0.47-0.50 off, rho=1.5 for 2.0 0.56-0.57, no upper bound (clip_ratio_high=10) 0.54. (The ratios the
    # upper bound clips here are all above 1.3, so 0.2, 0.28 and 0.3 give the same step; the bound's exact
    # value is tested with the loss, tests/test_aipo_loss.py and tests/test_fused_aipo.py.)
    initial = dict(random_model(CFG).named_parameters())
    assert _relative_distance(ours, expected, initial) < 1e-3
    with single_process_trainer(tmp_path / "model", CFG, dict(cfg, clip_ratio=0.0, clip_ratio_high=None)) as ex:
        ex.train_step(parts)
        unclipped = weights_of(ex)
    assert _relative_distance(unclipped, expected, initial) > 0.1
    if loss == "reference" and mini_batches == 2:  # the upper bound reaches the loss: 10 is no bound here
        with single_process_trainer(tmp_path / "model", CFG, dict(cfg, clip_ratio_high=10.0)) as ex:
            ex.train_step(parts)
            assert _relative_distance(weights_of(ex), expected, initial) > 0.1


def test_epochs_repeat_the_step_and_the_schedule_counts_rl_steps(tmp_path):
    random_model(CFG).save_pretrained(tmp_path / "model")
    parts = _parts(1)
    warm = dict(TRAINER, lr_warmup_steps=2)  # RL step 0 at lr/2, step 1 at lr
    with single_process_trainer(tmp_path / "model", CFG, dict(warm, epochs=2, mini_batches=1)) as ex:
        lrs = [ex.train_step(parts[0])["lr"], ex.train_step(parts[0])["lr"]]
        two_epochs = weights_of(ex)
    assert lrs == [TRAINER["lr"] / 2, TRAINER["lr"]]
    with single_process_trainer(tmp_path / "model", CFG, TRAINER) as ex:  # constant lr: four plain steps
        for _ in range(4):
            ex.train_step(parts[0])
        four_steps = weights_of(ex)
    with single_process_trainer(tmp_path / "model", CFG, dict(TRAINER, epochs=2)) as ex:
        first = ex.train_step(parts[0])
        ex.train_step(parts[0])
        _assert_same(weights_of(ex), four_steps)
    # a second pass trains the same tokens again: the step's trained tokens count them once (it was twice)
    assert first["updates"] == 2 and first["tokens"] == int(parts[0]["mask"].sum())
    assert any(not torch.equal(w, four_steps[n]) for n, w in two_epochs.items())  # the warm-up did matter


def test_the_learning_rate_follows_the_rl_step_it_is_given(tmp_path):
    """The controller names each step, so the schedule does not drift when an update is skipped or a resumed
    run changes mini_batches/epochs (counting optimizer updates would)."""
    random_model(CFG).save_pretrained(tmp_path / "model")
    cfg = dict(TRAINER, lr_warmup_steps=10, mini_batches=2)
    with single_process_trainer(tmp_path / "model", CFG, cfg) as ex:
        assert ex.train_step(_parts(2), step=5)["lr"] == pytest.approx(TRAINER["lr"] * 6 / 10, rel=1e-15)
        assert ex.train_step(_parts(2), step=5)["lr"] == pytest.approx(TRAINER["lr"] * 6 / 10, rel=1e-15)
        assert ex.train_step(_parts(2))["lr"] == pytest.approx(TRAINER["lr"] * 3 / 10, rel=1e-15)  # 4 updates / 2


@pytest.mark.parametrize("sets, match", [
    ({"trainer": {"mini_batches": 3}}, r"trainer.mini_batches: must divide generator.prompts_per_step=16"),
    ({"trainer": {"mini_batches": 0}}, r"trainer.mini_batches: must be > 0"),
    ({"trainer": {"epochs": 0}}, r"trainer.epochs: must be > 0"),
    ({"generator": {"prompts_per_step": 2, "samples_per_prompt": 3}, "trainer": {"ranks": 2, "mini_batches": 2}},
     r"trainer.mini_batches: each of the 2 mini-batches holds 3 sequences, which must split evenly over "
     r"trainer.ranks=2"),
    ({"trainer": {"clip_ratio": 1.0}}, r"trainer.clip_ratio: must be in \[0, 1\)"),
    ({"trainer": {"clip_ratio": -0.1}}, r"trainer.clip_ratio: must be in \[0, 1\)"),
    ({"trainer": {"clip_ratio_high": -0.1}}, r"trainer.clip_ratio_high: must be a finite number >= 0"),
    ({"trainer": {"clip_ratio_high": float("inf")}}, r"trainer.clip_ratio_high: must be a finite number >= 0"),
    ({"trainer": {"clip_ratio": 0.0, "clip_ratio_high": 0.28}}, r"trainer.clip_ratio_high: .*clip_ratio > 0"),
])
def test_mini_batch_settings_are_checked(sets, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_dict(sets)


def test_a_run_with_mini_batches_pushes_one_version_per_step(tmp_path):
    out = tmp_path / "run"
    assert main(["--preset", "smoke", "--mode", "sync", "--set", "trainer.mini_batches=2", "--set", "trainer.epochs=2",
                 "--max-steps", "3", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert all(r["updates"] == 4 for r in steps)
