"""RoPE numerics vs transformers at long positions.

The angle of rotary pair i at position p is p * inv_freq_i, so a 1-ulp difference in an fp32 inv_freq_i
becomes an angle error that grows linearly with p: invisible at the ~100 positions of the other model
tests, ~2e-3 rad at 32k. These tests pin llamarl's inv_freq (default, linear, llama3) and the cos/sin
tables to transformers' bitwise, and then check a Llama-3.1-shaped attention (head_dim 128, theta 5e5,
llama3 scaling) at positions 6000-30200 against LlamaForCausalLM built from the same weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llamarl.models import Llama, LlamaConfig  # noqa: E402
from llamarl.models.llama import rope_inv_freq  # noqa: E402

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128, max_position_embeddings=16384, rms_norm_eps=1e-5)
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA31}


def hf_config(theta: float, scaling: dict | None, head_dim: int = 128) -> "transformers.LlamaConfig":
    kw = dict(SHAPE, head_dim=head_dim, rope_theta=theta)
    if scaling is not None:
        kw["rope_scaling"] = copy.deepcopy(scaling)  # transformers edits rope dicts in place
    return transformers.LlamaConfig(**kw)


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("theta, head_dim", [(5e5, 128), (1e4, 128), (5e5, 64)])
def test_inv_freq_and_cos_sin_are_bitwise_transformers(scaling, theta, head_dim):
    hc = hf_config(theta, SCALINGS[scaling], head_dim)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hc)
    ours = LlamaConfig.from_hf_dict(hc.to_dict())
    inv = rope_inv_freq(ours)
    assert torch.equal(inv.to(torch.float32), rotary.inv_freq) and inv.dtype == torch.float32
    model = Llama(ours.replace(num_hidden_layers=1, hidden_size=64, intermediate_size=8, vocab_size=8))
    pos = torch.tensor([[0, 1, 777, 8191, 8192, 32_000, 131_071]])
    for dtype in (torch.float32, torch.bfloat16):
        cos_hf, sin_hf = rotary(torch.empty(0, dtype=dtype), pos)
        cos, signed_sin = model._rope(pos, dtype)  # [B, T, 1, Dh]; signed_sin = (-sin_lo, sin_hi)
        half = head_dim // 2
        assert torch.equal(cos[:, :, 0], cos_hf)
        assert torch.equal(signed_sin[:, :, 0, half:], sin_hf[..., half:])
        assert torch.equal(-signed_sin[:, :, 0, :half], sin_hf[..., :half])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_transformers_at_long_positions(tmp_path, dtype):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config(5e5, LLAMA31)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)  # large enough that attention depends on the rotation angles
    hf.save_pretrained(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    model = Llama.from_pretrained(tmp_path, dtype=dtype)
    x = torch.randint(0, SHAPE["vocab_size"], (2, 96))
    pos = torch.stack([torch.arange(6000, 6096), torch.arange(30000, 30192, 2)])  # high positions, one row strided
    with torch.no_grad():
        ref = hf(x, position_ids=pos).logits
        out = model(x, positions=pos)
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)  # every op of the model rounds as transformers' does
    else:
        # same inv_freq/cos/sin: only summation orders differ (2.2e-6 measured); an inv_freq computed in
        # fp64 and rounded to fp32 moved these logits (max |logit| 3.1) by 2.7e-4
        assert (out - ref).abs().max().item() < 2e-5
