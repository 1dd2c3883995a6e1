"""Training forward with shared prompts: the n samples of a prompt reuse one pass over the prompt.

GRPO/AIPO batches hold G prompts with n completions each. A causal model's states at a prompt's
positions do not depend on what follows them, so the ``G * n`` rows of a flat batch recompute each prompt
n times. This forward runs every prompt once and every completion once (the generation engine already
prefills a prompt once for its n samples, llamarl.generation.engine):

1. Prompt pass: ``prompt_ids`` [G, P], left-padded (prompt g occupies slots [start_g, P)), through the
   model with a recording cache: every layer's K/V [G, Hkv, P, Dh] is kept, with its autograd history.
2. Completion pass: row b (of prompt ``group[b]``) feeds its completion tokens y_0 .. y_{C-2} at slots
   P .. P+C-2 with RoPE positions ``len_g + j``; at every layer its queries attend to the recorded
   prompt K/V of its group (gathered per row) followed by its own causal K/V, with the model's
   left-padding mask (slots below ``start_g`` hidden). Exactly the context of the flat row x_g ‖ y_b.

The hidden state that predicts completion token c is the prompt's last position (slot P-1, shared by
the group) for c = 0 and the completion pass's position c-1 for c >= 1. Returned as [B, C, D]: the same
numbers as the flat forward's positions |x|-1 .. |x|+C-2, up to floating-point reassociation (the
prompt's gradient is the sum of its rows' contributions, accumulated by the gather's backward instead
of by the parameters' gradient accumulation).

Cost: G·P + B·(C-1) token positions instead of B·(P+C-1); attention reads B·C·(P+C) keys as before.
Padded completion slots (rows shorter than C) compute finite garbage that the loss masks out.
"""

from __future__ import annotations

import torch

from llamarl.models.llama import Llama


class _PromptPass:
    """Cache protocol for pass 1: left-padded prompts at slots [0, P); records each layer's K/V."""

    has_padding = True  # forces the model's start-aware mask and positions

    def __init__(self, start: torch.Tensor, length: int, layers: int):
        self.start, self.max_seq_len = start, length
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, input_pos: int):
        self.k[layer], self.v[layer] = k, v
        return k, v


class _CompletionPass:
    """Cache protocol for pass 2: completions at slots [P, P+T) after their group's recorded prompt."""

    has_padding = True

    def __init__(self, prompts: _PromptPass, group: torch.Tensor, length: int):
        self.prompts, self.group = prompts, group
        self.start = prompts.start.index_select(0, group)
        self.max_seq_len = length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, input_pos: int):
        pk = self.prompts.k[layer].index_select(0, self.group)
        pv = self.prompts.v[layer].index_select(0, self.group)
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)


def shared_prefix_hidden_states(model: Llama, prompt_ids: torch.Tensor, prompt_start: torch.Tensor,
                                group: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [B, C, D]; position c predicts ``completions[:, c]`` (module docstring).

    prompt_ids [G, P] left-padded, prompt_start [G] (first real slot of each prompt, < P),
    group [B] (the prompt of each row, in [0, G)), completions [B, C] (right-padded with any token id).
    """
    if prompt_ids.dim() != 2 or completions.dim() != 2:
        raise ValueError(f"prompt_ids and completions must be [rows, len], got {tuple(prompt_ids.shape)} and "
                         f"{tuple(completions.shape)}")
    G, P = prompt_ids.shape
    B, C = completions.shape
    if prompt_start.shape != (G,) or group.shape != (B,):
        raise ValueError(f"prompt_start must be [{G}] and group [{B}], got {tuple(prompt_start.shape)} and "
                         f"{tuple(group.shape)}")
    if P < 1 or C < 1:
        raise ValueError(f"need at least one prompt token and one completion token, got P={P}, C={C}")
    if B and (int(group.min()) < 0 or int(group.max()) >= G):
        raise ValueError(f"group indices must lie in [0, {G}), got [{int(group.min())}, {int(group.max())}]")
    if G and int(prompt_start.max()) >= P:
        raise ValueError("every prompt needs at least one token (prompt_start < P)")
    prompts = _PromptPass(prompt_start, P, model.config.num_hidden_layers)
    last = model.hidden_states(prompt_ids, 0, prompts)[:, -1:]  # [G, 1, D], slot P-1 of every prompt
    first = last.index_select(0, group)
    if C == 1:
        return first
    rest = model.hidden_states(completions[:, :-1], P, _CompletionPass(prompts, group, P + C - 1))
    return torch.cat([first, rest], dim=1)
