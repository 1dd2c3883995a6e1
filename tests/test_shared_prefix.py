"""The shared-prompt training forward (llamarl.models.shared_prefix) and its batch layout.

Reference: the plain forward of each flat row x_g ‖ y_b, one row at a time, in float64, so hidden states
and parameter gradients must agree to fp64 rounding; the trainer step on the shared layout must equal
the step on the flat layout of the same rollouts (fp32).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_harness import assert_same_step, random_model, single_process_train_step
from llamarl.config import TrainerConfig
from llamarl.models import Llama, LlamaConfig
from llamarl.micro_batches import take_rows
from llamarl.models.shared_prefix import shared_prefix_hidden_states
from llamarl.rollouts import Rollout, collate

CFG = LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
PAD = 0


def _rollouts(prompt_lens, completion_lens, n, seed=0) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, c in enumerate(completion_lens):
        if i % n == 0:
            prompt = torch.randint(1, CFG.vocab_size, (prompt_lens[i // n],), generator=g).tolist()
        completion = torch.randint(1, CFG.vocab_size, (c,), generator=g).tolist()
        logprobs = (-4.0 + 0.5 * torch.randn(c, generator=g)).tolist()
        out.append(Rollout(f"s{i}", i // n, prompt, completion, logprobs, [0] * c, "", "length"))
    return out


def _flat_reference(model: Llama, rollouts: list[Rollout], weights: torch.Tensor):
    """Per row: hidden states at the positions predicting y (plain forward of x ‖ y), and the gradient of
    Σ weights · hidden over all rows (summed in fp32, or fp64 for an fp64 model), on weights' device."""
    model.zero_grad(set_to_none=True)
    hidden = []
    for b, r in enumerate(rollouts):
        ids = torch.tensor([r.prompt_ids + r.completion_ids], device=weights.device)
        p, c = len(r.prompt_ids), len(r.completion_ids)
        h = model.hidden_states(ids)[0, p - 1:p - 1 + c]
        acc = torch.promote_types(h.dtype, torch.float32)
        (h.to(acc) * weights[b, :c].to(acc)).sum().backward()
        hidden.append(h.detach())
    return hidden, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prompt_lens, completion_lens, n", [
    ([5, 1, 9], [3, 1, 4, 2, 5, 5, 1, 2, 3], 3),   # ragged both ways, a 1-token prompt
    ([4, 4], [1, 1, 1, 1], 2),                      # one completion token each: the prompt pass alone
    ([7], [6, 2, 3, 6, 1], 5),                      # one group
])
def test_hidden_states_and_gradients_equal_the_flat_forward_in_fp64(prompt_lens, completion_lens, n):
    model = random_model(CFG).double()
    rollouts = _rollouts(prompt_lens, completion_lens, n)
    batch = collate(rollouts, torch.zeros(len(rollouts)), PAD, share_prompts=True)
    weights = torch.randn(len(rollouts), max(completion_lens), CFG.hidden_size, dtype=torch.float64)
    ref_hidden, ref_grads = _flat_reference(model, rollouts, weights)

    model.zero_grad(set_to_none=True)
    h = shared_prefix_hidden_states(model, batch["prompt_ids"], batch["prompt_start"], batch["group"],
                                    batch["targets"])
    assert h.shape == (len(rollouts), max(completion_lens), CFG.hidden_size)
    (h * weights * batch["mask"][..., None]).sum().backward()
    for b, want in enumerate(ref_hidden):
        torch.testing.assert_close(h[b, :len(want)].detach(), want, rtol=0, atol=1e-12)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads)
    for name, want in ref_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-10, atol=1e-12, msg=name)


def test_collate_lays_out_each_prompt_once_left_padded():
    rollouts = _rollouts([3, 1], [2, 4, 1, 3], n=2)
    batch = collate(rollouts, torch.tensor([0.5, -0.5, 1.0, -1.0]), PAD, share_prompts=True)
    assert batch["prompt_ids"].tolist() == [rollouts[0].prompt_ids, [PAD, PAD] + rollouts[2].prompt_ids]
    assert batch["prompt_start"].tolist() == [0, 2]
    assert batch["group"].tolist() == [0, 0, 1, 1]
    assert batch["targets"][1].tolist() == rollouts[1].completion_ids
    assert batch["targets"][0].tolist() == rollouts[0].completion_ids + [PAD, PAD]
    assert batch["mask"].sum(1).tolist() == [2, 4, 1, 3]
    assert batch["behavior_logprobs"][3, :3].tolist() == pytest.approx(rollouts[3].logprobs)
    assert float(batch["total_tokens"]) == 10
    # dropping zero-advantage rows drops their prompt when no sample of it is left
    kept = collate(rollouts, torch.tensor([0.0, 0.0, 1.0, -1.0]), PAD, share_prompts=True, drop_zero_advantage=True)
    assert kept["prompt_ids"].tolist() == [rollouts[2].prompt_ids] and kept["group"].tolist() == [0, 0]
    assert float(kept["total_tokens"]) == 10


def test_take_rows_keeps_only_the_prompts_of_its_rows():
    rollouts = _rollouts([2, 5, 3], [1, 2, 3, 4, 5, 6], n=2)
    batch = collate(rollouts, torch.zeros(6), PAD, share_prompts=True)
    part = take_rows(batch, [1, 2], trim=False)  # the second sample of prompt 0 and the first of prompt 1
    assert part["group"].tolist() == [0, 1]
    assert part["prompt_ids"].tolist() == [[PAD, PAD, PAD] + rollouts[0].prompt_ids, rollouts[2].prompt_ids]
    assert part["prompt_start"].tolist() == [3, 0]
    assert torch.equal(part["targets"], batch["targets"][1:3]) and "total_tokens" not in part
    last = take_rows(batch, [4, 5], trim=False)  # prompt 2 alone: its padding columns go
    assert last["prompt_ids"].tolist() == [rollouts[4].prompt_ids] and last["prompt_start"].tolist() == [0]


def test_collate_rejects_a_group_with_two_prompts_and_empty_inputs():
    rollouts = _rollouts([3, 2], [1, 1, 1, 1], n=2)
    rollouts[1] = dataclasses.replace(rollouts[1], prompt_ids=[7, 8])
    with pytest.raises(ValueError, match="two different prompts"):
        collate(rollouts, torch.zeros(4), PAD, share_prompts=True)
    empty = _rollouts([3], [0, 0], n=2)  # no completion token at all (all truncated away): laid out flat
    flat = collate(empty, torch.zeros(2), PAD, share_prompts=True)
    assert "group" not in flat and flat["mask"].sum() == 0 and flat["input_ids"].shape == (2, 3)
    no_prompt = [dataclasses.replace(r, prompt_ids=[]) for r in _rollouts([3], [1, 1], n=2)]
    for share in (True, False):  # the flat layout crashed on it with a tensor-size error
        with pytest.raises(ValueError, match="empty prompt"):
            collate(no_prompt, torch.zeros(2), PAD, share_prompts=share)


def test_forward_rejects_inconsistent_inputs():
    model = random_model(CFG)
    ids, start, comp = torch.ones(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.ones(3, 2,
                                                                                                       dtype=torch.long)
    with pytest.raises(ValueError, match="group indices"):
        shared_prefix_hidden_states(model, ids, start, torch.tensor([0, 1, 2]), comp)
    with pytest.raises(ValueError, match="prompt_start"):
        shared_prefix_hidden_states(model, ids, start[:1], torch.tensor([0, 1, 1]), comp)
    with pytest.raises(ValueError, match="at least one token"):
        shared_prefix_hidden_states(model, ids, torch.tensor([0, 4]), torch.tensor([0, 1, 1]), comp)


# micro-batches of 4 rows over groups of 3: ragged prompts share micro-batches and a group spans two
TRAINER = dataclasses.asdict(TrainerConfig(lr=1e-3, weight_decay=0.1, grad_clip=0.5, micro_batch_size=4,
                                           loss="reference", kl_coef=0.05, entropy_coef=0.01))


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_trainer_step_on_shared_prompts_equals_the_flat_step(tmp_path, norm):
    cfg = dict(TRAINER, norm=norm)
    random_model(CFG).save_pretrained(tmp_path / "model")
    rollouts = _rollouts([4, 2, 6], [3, 1, 5, 2, 4, 4, 2, 1, 3], n=3, seed=1)
    adv = torch.randn(len(rollouts), generator=torch.Generator().manual_seed(2))
    flat_stats, flat_w = single_process_train_step(tmp_path / "model", CFG, collate(rollouts, adv, PAD), cfg)
    shared_stats, shared_w = single_process_train_step(
        tmp_path / "model", CFG, collate(rollouts, adv, PAD, share_prompts=True), cfg)
    assert_same_step(shared_stats, shared_w, flat_stats, flat_w, atol=1e-5)


@pytest.mark.gpu
def test_cuda_bf16_shared_prompts_match_the_flat_forward():
    """On the GPU trainer's path (CUDA, bf16, autograd on: the masked SDPA with K/V repeated for GQA):
    hidden states and gradients of the shared layout against the flat per-row forward of the same model."""
    model = random_model(CFG).to("cuda", torch.bfloat16)
    rollouts = _rollouts([5, 1, 9], [3, 1, 4, 2, 5, 5, 1, 2, 3], n=3)
    batch = {k: v.cuda() for k, v in collate(rollouts, torch.zeros(9), PAD, share_prompts=True).items()}
    weights = torch.randn(9, 5, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    ref_hidden, ref_grads = _flat_reference(model, rollouts, weights)
    model.zero_grad(set_to_none=True)
    h = shared_prefix_hidden_states(model, batch["prompt_ids"], batch["prompt_start"], batch["group"],
                                    batch["targets"])
    (h.float() * weights.float() * batch["mask"][..., None]).sum().backward()
    worst = max(float((h[b, :len(want)].detach().float() - want.float()).abs().max() / want.float().abs().max())
                for b, want in enumerate(ref_hidden))
    assert worst < 2e-2, worst  # bf16: a few ulps of the largest activation
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for name, want in ref_grads.items():
        rel = float((grads[name].float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))
        assert rel < 3e-2, (name, rel)
