"""Activation checkpointing (``Llama.activation_checkpointing``, ``trainer.activation_checkpointing``):
the same gradients as the plain forward, for the flat and the shared-prompt layouts, with far fewer
activations kept for backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_harness import random_model, single_process_train_step
from llamarl.config import TrainerConfig
from llamarl.models import LlamaConfig
from llamarl.models.shared_prefix import shared_prefix_hidden_states
from llamarl.rollouts import collate
from test_trainer_loss import ADV, _batch_rollouts

CFG = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _forward(model, layout: str) -> torch.Tensor:
    g, dev = torch.Generator().manual_seed(1), model.lm_head.weight.device
    if layout == "flat":
        return model.hidden_states(torch.randint(0, 53, (3, 11), generator=g).to(dev))
    prompts, completions = torch.randint(1, 53, (2, 5), generator=g), torch.randint(1, 53, (5, 4), generator=g)
    return shared_prefix_hidden_states(model, prompts.to(dev), torch.tensor([0, 2], device=dev),
                                       torch.tensor([0, 0, 1, 1, 1], device=dev), completions.to(dev))


def _run(model, layout: str, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(output, parameter gradients, bytes autograd kept for backward outside checkpointed regions)."""
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing = checkpointing
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(model, layout)
    out.sin().sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, sum(saved)


@pytest.mark.parametrize("layout", ["flat", "shared"])
def test_gradients_equal_the_plain_forward_with_a_fraction_of_the_activations(layout):
    model = random_model(CFG).double().train()
    out, grads, kept = _run(model, layout, False)
    out_ac, grads_ac, kept_ac = _run(model, layout, True)
    assert torch.equal(out_ac, out)
    assert grads_ac.keys() == grads.keys() and len(grads) > 4 * CFG.num_hidden_layers
    for name, g in grads.items():  # the same ops recomputed in the same order: bitwise equal in fp64
        assert torch.equal(grads_ac[name], g), name
    assert kept_ac < kept / 3, (kept_ac, kept)  # only each layer's inputs stay, not its activations
    model.eval()  # inference never checkpoints
    with torch.no_grad():
        assert torch.equal(_forward(model, layout), out)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_trainer_step_with_activation_checkpointing_equals_the_plain_step(tmp_path, share_prompts):
    random_model(CFG).save_pretrained(tmp_path / "model")
    batch = collate(_batch_rollouts(), ADV, 0, share_prompts=share_prompts)
    cfg = dataclasses.asdict(TrainerConfig(lr=1e-3, micro_batch_size=5, loss="reference", kl_coef=0.05,
                                           entropy_coef=0.01))
    plain_stats, plain_w = single_process_train_step(tmp_path / "model", CFG, batch, cfg)
    ac_stats, ac_w = single_process_train_step(tmp_path / "model", CFG, batch, dict(cfg, activation_checkpointing=True))
    assert {k: v for k, v in ac_stats.items() if k != "train_s"} == \
        {k: v for k, v in plain_stats.items() if k != "train_s"}
    for name, w in plain_w.items():
        assert torch.equal(ac_w[name], w), name


@pytest.mark.gpu
def test_cuda_bf16_gradients_match_the_plain_forward():
    """On the GPU trainer's path (CUDA, bf16, autograd on): recomputation may pick other attention backward
    kernels' summation order, so the gradients agree to bf16 rounding rather than bitwise."""
    model = random_model(CFG).to("cuda", torch.bfloat16).train()
    for layout in ("flat", "shared"):
        out, grads, _ = _run(model, layout, False)
        out_ac, grads_ac, _ = _run(model, layout, True)
        torch.testing.assert_close(out_ac, out, rtol=0, atol=0)
        for name, g in grads.items():
            rel = float((grads_ac[name].float() - g.float()).norm() / g.float().norm().clamp(min=1e-12))
            assert rel < 1e-2, (layout, name, rel)
