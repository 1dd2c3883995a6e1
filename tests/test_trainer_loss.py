"""The trainer's loss over micro-batches: exact for both normalisations, and the fused kernel's step
equals the eager reference's.

A step's loss is the AIPO loss of the whole batch (``llamarl.algorithms.aipo_loss`` on [B, T], the
specification) whatever ``micro_batch_size`` cuts it into: each micro-batch's loss is weighted by its
share of the batch's denominator (tokens, or non-empty sequences for ``norm="sequence"``). The fused
Triton loss (interpreted on CPU) must give the same step as the reference for both normalisations.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dist_harness import assert_same_step, random_model, single_process_train_step
from llamarl.algorithms import aipo_loss, token_logprobs
from llamarl.config import TrainerConfig
from llamarl.models import Llama
from llamarl.rollouts import Rollout, collate
from test_zero_advantage import ADV, CFG, _rollouts

TRAINER = dataclasses.asdict(TrainerConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, micro_batch_size=3,
                                           loss="reference", kl_coef=0.05, entropy_coef=0.01))


def _batch_rollouts() -> list[Rollout]:
    """3 groups of 4 samples of 1-6 tokens, each group on one prompt, and one sample whose completion is
    empty (it must not count as a sequence)."""
    rollouts = [dataclasses.replace(r, prompt_ids=_rollouts(len(ADV))[r.group * 4].prompt_ids)
                for r in _rollouts(len(ADV))]
    rollouts[5] = dataclasses.replace(rollouts[5], completion_ids=[], logprobs=[], versions=[])
    return rollouts


MAX_NEW_TOKENS = 7  # the generation limit of norm="constant" (Dr. GRPO): C = sequences x 7


def _spec_loss(model_dir, batch: dict, norm: str) -> float:
    """The specification on the whole batch at once, in fp64."""
    model = Llama.from_pretrained(model_dir).double()
    constant = batch["mask"].shape[0] * MAX_NEW_TOKENS if norm == "constant" else None
    with torch.no_grad():
        logits = model(batch["input_ids"])[:, :-1]
        logprobs, entropy = token_logprobs(logits, batch["targets"], 1.0)
        loss, _ = aipo_loss(logprobs, batch["behavior_logprobs"].double(), batch["advantages"].double(),
                            batch["mask"], rho=TRAINER["rho"], norm=norm, norm_constant=constant, ref_logprobs=logprobs,
                            kl_coef=TRAINER["kl_coef"], entropy=entropy, entropy_coef=TRAINER["entropy_coef"])
    return float(loss)


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
def test_micro_batches_give_the_whole_batch_loss_and_update(tmp_path, norm):
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0)
    cfg = dict(TRAINER, norm=norm)
    split_stats, split_w = single_process_train_step(tmp_path / "model", CFG, batch, cfg,
                                                     max_new_tokens=MAX_NEW_TOKENS)
    whole_stats, whole_w = single_process_train_step(tmp_path / "model", CFG, batch,
                                                     dict(cfg, micro_batch_size=len(ADV)),
                                                     max_new_tokens=MAX_NEW_TOKENS)
    assert split_stats["applied"] and whole_stats["applied"]
    # at the start the policy is its own reference, so the KL term is 0 and the loss is the AIPO loss
    assert whole_stats["loss"] == pytest.approx(_spec_loss(tmp_path / "model", batch, norm), rel=1e-5, abs=1e-7)
    assert split_stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5, abs=1e-7)
    assert split_stats["grad_norm"] == pytest.approx(whole_stats["grad_norm"], rel=1e-5)
    for name, w in whole_w.items():
        torch.testing.assert_close(split_w[name], w, rtol=0, atol=2e-6, msg=name)
    other = single_process_train_step(tmp_path / "model", CFG, batch,
                                      dict(cfg, norm="token" if norm != "token" else "sequence"))[0]
    assert abs(other["loss"] - whole_stats["loss"]) > 1e-4  # the normalisations really differ here


@pytest.mark.parametrize("norm", ["token", "sequence", "constant"])
@pytest.mark.parametrize("share_prompts", [False, True])
def test_fused_loss_step_equals_the_reference_step(tmp_path, norm, share_prompts):
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0, share_prompts=share_prompts)
    cfg = dict(TRAINER, norm=norm)
    ref_stats, ref_w = single_process_train_step(tmp_path / "model", CFG, batch, cfg, max_new_tokens=MAX_NEW_TOKENS)
    fused_stats, fused_w = single_process_train_step(tmp_path / "model", CFG, batch, dict(cfg, loss="fused"),
                                                     max_new_tokens=MAX_NEW_TOKENS)
    # measured: 2 of 1696 embedding entries moved by 8e-6 of a 1e-3 step, all else <= 7e-7
    assert_same_step(fused_stats, fused_w, ref_stats, ref_w, atol=2e-5)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_sequence_level_ratios_step_the_same_in_micro_batches_and_in_the_fused_kernel(tmp_path, share_prompts):
    """trainer.ratio_level=sequence: a sequence never spans micro-batches, so the micro-batched step equals
    the whole batch's, and the fused kernel's step equals the reference loss's; the step is not the
    token-level one."""
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0, share_prompts=share_prompts)
    cfg = dict(TRAINER, ratio_level="sequence", norm="sequence")
    whole = single_process_train_step(tmp_path / "model", CFG, batch, dict(cfg, micro_batch_size=len(ADV)))
    split = single_process_train_step(tmp_path / "model", CFG, batch, cfg)
    assert_same_step(*split, *whole, atol=4e-6)  # measured 0.3e-6 flat, 2.6e-6 shared (token level: 1.2e-6, 2.5e-6)
    fused = single_process_train_step(tmp_path / "model", CFG, batch, dict(cfg, loss="fused"))
    assert_same_step(*fused, *whole, atol=2e-5)
    token = single_process_train_step(tmp_path / "model", CFG, batch, dict(cfg, ratio_level="token"))
    assert max(float((token[1][n] - w).abs().max()) for n, w in whole[1].items()) > 1e-5


def test_the_uncorrected_ablation_keeps_the_kl_term_and_the_kl_estimator_reaches_the_loss(tmp_path):
    """correction="none" is AIPO with μ := π. On samples of the current policy (μ = π: every ratio is 1)
    it is the corrected loss exactly, including the KL to a reference policy that differs from π.
    trainer.kl_estimator=k2 swaps the KL term's k3 for ½ (log π − log π_ref)² (token mean, kl_coef 0.5)."""
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.runtime import RankInfo
    from llamarl.weight_sync import GeneratorBuckets, GeneratorLayout, TrainerLayout, llama_param_specs, plan_sync

    random_model(CFG).save_pretrained(tmp_path / "model")
    buckets = GeneratorBuckets.create(plan_sync(llama_param_specs(CFG), TrainerLayout(world_size=1),
                                                GeneratorLayout()), 0, storage="shm")
    ex = TrainerExecutor(model_path=str(tmp_path / "model"), trainer=dict(TRAINER, kl_coef=0.5),
                         temperature=1.0, generator_handles=[buckets.handle()],
                         rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, "cpu", "gloo"))
    try:
        with torch.no_grad():
            for p in ex.ref.parameters():  # a reference policy away from π
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        batch = collate(_batch_rollouts(), ADV, 0)
        with torch.no_grad():
            pi, _ = token_logprobs(ex.model(batch["input_ids"])[:, :-1], batch["targets"], 1.0)
        batch["behavior_logprobs"] = torch.where(batch["mask"] > 0, pi, 0.0)  # μ = π
        part = {k: v for k, v in batch.items() if not k.startswith("total_")}
        results = {}
        for correction in ("aipo", "none"):
            ex.cfg = dict(ex.cfg, correction=correction)
            loss, metrics = ex._loss(part)
            results[correction] = (float(loss.detach()), {k: float(v) for k, v in metrics.items()})
        assert results["aipo"][1]["kl_ref"] > 1e-3  # the KL term is really there
        assert results["none"][0] == pytest.approx(results["aipo"][0], rel=1e-6)
        assert results["none"][1] == pytest.approx(results["aipo"][1], rel=1e-6)
        ex.cfg = dict(ex.cfg, correction="aipo", kl_estimator="k2")
        loss_k2, metrics_k2 = ex._loss(part)
        with torch.no_grad():
            ref, _ = token_logprobs(ex.ref(batch["input_ids"])[:, :-1], batch["targets"], 1.0)
        d = (pi - ref).double()[batch["mask"] > 0]
        k2, k3 = (0.5 * d**2).mean().item(), (torch.exp(-d) + d - 1).mean().item()
        assert float(metrics_k2["kl_ref"]) == pytest.approx(k3, rel=1e-4)  # the metric stays k3
        assert float(loss_k2.detach()) - results["aipo"][0] == pytest.approx(0.5 * (k2 - k3), rel=1e-3)
        assert abs(k2 - k3) > 1e-2 * k3
    finally:
        ex.close()
        buckets.close()


def test_learning_rate_schedule():
    from llamarl.algorithms import lr_at

    cfg = dict(TRAINER, lr=1.0, lr_warmup_steps=4, min_lr_ratio=0.1)
    warm = [lr_at(k, dict(cfg, lr_schedule=s), 14) for s in ("constant", "cosine", "linear") for k in range(4)]
    assert warm == [0.25, 0.5, 0.75, 1.0] * 3  # linear warm-up, the same for every schedule
    assert [lr_at(k, dict(cfg, lr_schedule="constant"), 14) for k in (4, 9, 20)] == [1.0, 1.0, 1.0]
    # decay over the 10 steps after the warm-up: t = (k - 4) / 10
    assert lr_at(9, dict(cfg, lr_schedule="linear"), 14) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(9, dict(cfg, lr_schedule="cosine"), 14) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(6, dict(cfg, lr_schedule="cosine"), 14) == pytest.approx(0.1 + 0.9 * (1 + math.cos(0.2 * math.pi)) / 2)
    for s in ("cosine", "linear"):
        assert lr_at(14, dict(cfg, lr_schedule=s), 14) == pytest.approx(0.1)  # the floor, and it stays there
        assert lr_at(99, dict(cfg, lr_schedule=s), 14) == pytest.approx(0.1)
        assert lr_at(9, dict(cfg, lr_schedule=s), None) == 1.0  # no horizon: no decay
    assert lr_at(0, dict(cfg, lr_warmup_steps=0, lr_schedule="linear"), 10) == 1.0
    with pytest.raises(ValueError, match=r"lr_schedule must be one of \('constant', .*\), got 'Cosine'"):
        lr_at(9, dict(cfg, lr_schedule="Cosine"), 14)  # (it decayed linearly)


def test_trainer_steps_at_the_scheduled_learning_rate(tmp_path):
    """The rate of each step is the schedule's at the optimizer's step count; AdamW's first step moves
    each weight by about lr, so the update scales with it."""
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0)
    base = dict(TRAINER, lr=1e-3, kl_coef=0.0)
    full_stats, full_w = single_process_train_step(tmp_path / "model", CFG, batch, base)
    warm_stats, warm_w = single_process_train_step(tmp_path / "model", CFG, batch, dict(base, lr_warmup_steps=4))
    assert full_stats["lr"] == 1e-3 and warm_stats["lr"] == 0.25e-3
    start = dict(random_model(CFG).named_parameters())
    for name, w in full_w.items():
        torch.testing.assert_close(warm_w[name] - start[name], 0.25 * (w - start[name]), rtol=1e-3, atol=1e-7)


def test_a_resumed_trainer_uses_this_runs_optimizer_settings(tmp_path):
    """The checkpoint's optimizer state restores its moments and step count, but betas and weight decay
    are the resumed run's (loading the saved param groups used to put the old ones back silently)."""
    from dist_harness import single_process_trainer

    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0)
    with single_process_trainer(tmp_path / "model", CFG, TRAINER) as ex:
        ex.train_step(batch)
        path = ex.save_checkpoint(str(tmp_path / "run"), 1, 1, 0)
        saved = {k: v.clone() for k, v in ex.opt.state[next(iter(ex.model.parameters()))].items()}
    changed = dict(TRAINER, betas=(0.8, 0.99), weight_decay=0.3)
    with single_process_trainer(tmp_path / "model", CFG, changed, resume=path) as ex:
        assert all(g["betas"] == (0.8, 0.99) and g["weight_decay"] == 0.3 for g in ex.opt.param_groups)
        state = ex.opt.state[next(iter(ex.model.parameters()))]
        assert all(torch.equal(state[k], v) for k, v in saved.items())  # the moments and step are the checkpoint's



@pytest.mark.parametrize("norm", ["constant", "token"])
def test_micro_batches_without_trained_tokens_are_skipped_on_every_path(tmp_path, norm):
    """Row 5's completion is empty: in micro-batches of one row it is a micro-batch without a trained
    token (under norm="constant" its row still counts in the denominator). The fused loss, the KL
    reference's log-probs and the old-log-prob forward of a clipped second update must skip it, not fail
    on zero rows; the fused step equals the reference step."""
    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts = _batch_rollouts()
    parts = [collate(rollouts[6:], ADV[6:], 0), collate(rollouts[:6], ADV[:6], 0)]  # row 5 in the second update
    cfg = dict(TRAINER, norm=norm, micro_batch_size=1, mini_batches=2)
    ref_stats, ref_w = single_process_train_step(tmp_path / "model", CFG, parts, cfg, max_new_tokens=MAX_NEW_TOKENS)
    fused_stats, fused_w = single_process_train_step(tmp_path / "model", CFG, parts, dict(cfg, loss="fused"),
                                                     max_new_tokens=MAX_NEW_TOKENS)
    assert ref_stats["updates"] == 2
    assert_same_step(fused_stats, fused_w, ref_stats, ref_w, atol=4e-5)


def test_a_trainer_started_before_its_generators_connects_later_and_pushes_exact_weights(tmp_path):
    """The controller starts the trainer alongside the generators and hands it their buckets afterwards
    (``connect``): a push before that is refused with what to do, a second connect too, and after it the
    pushed version's slot holds the trainer's parameters byte for byte."""
    from llamarl.executors.trainer import TrainerExecutor
    from llamarl.runtime import RankInfo
    from llamarl.weight_sync import GeneratorBuckets, GeneratorLayout, TrainerLayout, llama_param_specs, plan_sync

    random_model(CFG).save_pretrained(tmp_path / "model")
    buckets = GeneratorBuckets.create(plan_sync(llama_param_specs(CFG), TrainerLayout(world_size=1),
                                                GeneratorLayout()), 0, storage="shm")
    ex = TrainerExecutor(model_path=str(tmp_path / "model"), trainer=TRAINER, temperature=1.0,
                         rank_info=RankInfo("trainer", "trainer", 0, 1, 1, 0, "cpu", "gloo"))
    try:
        with pytest.raises(RuntimeError, match=r"before connect\(\).*call connect\(generator_handles\)"):
            ex.push_weights(1)
        ex.connect([buckets.handle()])
        with pytest.raises(RuntimeError, match="already connected"):
            ex.connect([buckets.handle()])
        ex.push_weights(1)
        slot, version = buckets.control.acquire(1, timeout=5.0)
        try:
            assert version == 1
            pushed = buckets.tensors(slot)
            for name, p in ex.model.named_parameters():
                assert pushed[name].view(torch.uint8).equal(p.detach().contiguous().view(torch.uint8)), name
        finally:
            buckets.control.release(slot)
    finally:
        ex.close()
        buckets.close()


@pytest.mark.parametrize("trainer", [dict(loss="reference"), dict(loss="fused", mini_batches=2)],
                         ids=["reference", "fused-two-updates"])
def test_diverged_weights_skip_the_update_instead_of_failing_the_step(tmp_path, trainer):
    """Logits that overflow (one lm_head row at 1e38) make log π non-finite: the step is skipped (applied False),
    weights and AdamW state untouched; neither the eager loss's input scan nor the fused kernel's refusal of a
    non-finite π_old (two updates: the second one's π_old) may turn it into an error."""
    from dist_harness import single_process_trainer

    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts = _batch_rollouts()
    half = len(ADV) // 2
    batch = (collate(rollouts, ADV, 0) if trainer.get("mini_batches", 1) == 1 else
             [collate(rollouts[:half], ADV[:half], 0), collate(rollouts[half:], ADV[half:], 0)])
    with single_process_trainer(tmp_path / "model", CFG, dict(TRAINER, **trainer)) as ex:
        assert ex.train_step(batch, step=0)["applied"]
        with torch.no_grad():
            ex.model.lm_head.weight[7].fill_(1e38)
        before = {n: p.detach().clone() for n, p in ex.model.named_parameters()}
        def adam_state():
            return [(i, k, v.clone()) for i, s in enumerate(ex.opt.state.values()) for k, v in sorted(s.items())]

        state = adam_state()
        stats = ex.train_step(batch, step=1)
        assert not stats["applied"] and not math.isfinite(stats["loss"])
        assert all(torch.equal(p.detach(), before[n]) for n, p in ex.model.named_parameters())
        after = adam_state()
        assert len(after) == len(state) > 0
        assert all(a[:2] == b[:2] and torch.equal(torch.as_tensor(a[2]), torch.as_tensor(b[2]))
                   for a, b in zip(after, state))


def test_the_trainer_scores_tokens_at_the_sampling_temperature(tmp_path):
    """On-policy samples drawn by the generation engine at T = 0.6 (μ = log_softmax(z / 0.6)), trained by a
    trainer told T = 0.6: π = μ, so every ratio is 1 (at T = 1 it is not)."""
    from llamarl.generation import SamplingParams, generate

    model = random_model(CFG)
    model.save_pretrained(tmp_path / "model")
    outs = generate(model, [[3, 4, 5], [6, 7], [8, 9, 10, 11]],
                    SamplingParams(max_new_tokens=6, temperature=0.6, n=2, seed=1), eos_token_id=())
    rollouts = [Rollout(f"s{i}", i // 2, o.prompt_token_ids, o.token_ids, o.logprobs, [0] * len(o.token_ids), "",
                        "length") for i, o in enumerate(outs)]
    batch = collate(rollouts, torch.tensor([1.0, -1.0] * 3), 0)
    stats = {t: single_process_train_step(tmp_path / "model", CFG, batch, dict(TRAINER, kl_coef=0.0),
                                          temperature=t)[0] for t in (0.6, 1.0)}
    assert stats[0.6]["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and stats[0.6]["mismatch_kl"] < 1e-6
    assert abs(stats[1.0]["ratio_mean"] - 1.0) > 1e-2
