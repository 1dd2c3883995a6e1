"""A Llama reward model: Hugging Face's ``LlamaForSequenceClassification`` with one label.

A reward model here maps a whole sequence (prompt + completion, token ids) to one real number, the score
a learned reward gives it; TRL's RewardTrainer, OpenRLHF and veRL save such models as a
``LlamaForSequenceClassification`` with ``num_labels=1``, which this module loads, scores with and saves.

    h        = norm(x_L)                      final-normed hidden states [B, T, D] (``Llama.hidden_states``)
    h_last_b = h[b, lengths[b] - 1]           the hidden state of row b's last real token
    r_b      = w_score . h_last_b             w_score = score.weight[0], [D]; no bias (HF's head has none)

computed in the model dtype (as transformers does), returned as fp32 [B].

Padding invariant: rows are right-padded and the trunk is causal, so the hidden state at a position
depends only on the tokens at and before it; r_b depends only on ``input_ids[b, :lengths[b]]``, never on
the pad ids, the padded length T or the other rows. transformers finds the last token itself, as the
rightmost one that differs from ``pad_token_id``; ``lengths`` gives the same position unless a real
sequence ends with the pad id (a tokenizer whose pad token is its eos token, and a completion ending in
eos): transformers then scores the token before those trailing pads, this model the eos itself. A caller
that must match that choice passes lengths = 1 + (index of the last token != pad_token_id).

Checkpoint layout (hf_io's, with another head): config.json with ``architectures:
["LlamaForSequenceClassification"]`` and ``id2label: {"0": "LABEL_0"}`` (how transformers stores
num_labels=1) + model.safetensors or a sharded index, keys

    model.embed_tokens.weight, model.layers.{i}.*, model.norm.weight   as in a LlamaForCausalLM
    score.weight                                                       [1, hidden_size]

and no ``lm_head.weight`` (``tie_word_embeddings`` is kept for config.json round trips; with no output
head it means nothing). Loading refuses what ``Llama.from_pretrained`` refuses (missing and extra keys,
shapes and dtypes from the headers before any tensor is read, shards named in the index but absent) and
what is not a scalar reward model: ``num_labels != 1``, a LlamaForCausalLM (``architectures``, or an
``lm_head.weight`` without ``score.weight``). ``check_reward_model`` runs every one of these checks from
config.json and the headers alone, so a training config can validate ``reward.model`` before it starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from llamarl.models import hf_io
from llamarl.models.config import SEQ_CLS, LlamaConfig
from llamarl.models.llama import Llama, _building_on_meta

SCORE_KEY = "score.weight"
HF_ONE_LABEL = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}  # num_labels=1 as transformers saves it


def reward_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a reward-model checkpoint of ``config``, by HF name: the trunk's, then the score head."""
    shapes = {k: s for k, s in hf_io.expected_shapes(config).items() if k != hf_io.HEAD_KEY}
    shapes[SCORE_KEY] = (1, config.hidden_size)
    return shapes


class LlamaRewardModel(Llama):
    """The Llama trunk (``model.*``, built and run by ``Llama``) with a score head instead of lm_head.

    Only the head differs: ``hidden_states`` is the policy's, and the trunk is built with tied embeddings
    so that ``Llama`` allocates no output matrix, which is then removed: ``lm_head`` is in no state dict,
    parameter list or checkpoint. ``config`` is kept as given."""

    def __init__(self, config: LlamaConfig):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"LlamaRewardModel(config) needs a LlamaConfig, got {type(config).__name__}")
        super().__init__(config.replace(tie_word_embeddings=True))  # lm_head = the embedding: nothing allocated
        del self.lm_head
        self.config = config
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        if not _building_on_meta():
            with torch.no_grad():
                self.score.weight.normal_(0.0, 0.02)  # HF's initialisation, like every other linear here

    # ---------------------------------------------------------------- scoring
    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Rewards [B], fp32, with autograd when it is on: r_b = score(h[b, lengths[b] - 1]) (module docstring).

        ``input_ids`` [B, T] right-padded token ids; ``lengths`` [B] the real tokens of each row, in 1..T."""
        last = self._last_positions(input_ids, lengths)
        h = self.hidden_states(input_ids)  # no mask needed: right padding never reaches a real token
        h_last = h[torch.arange(h.shape[0], device=h.device), last]  # [B, D]
        return self.score(h_last).squeeze(-1).float()

    @torch.no_grad()
    def scores(self, input_ids: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """``forward`` without autograd: the rewards [B] (fp32) of a right-padded batch."""
        return self(input_ids, lengths)

    def _last_positions(self, input_ids: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """lengths - 1 as a LongTensor [B] on ``input_ids``' device, after checking both arguments."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
                torch.long, torch.int32):
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"reward model: input_ids must be an integer tensor [batch, seq] of right-padded "
                             f"token ids, got {getattr(input_ids, 'dtype', '')} {shape}")
        B, T = input_ids.shape
        if isinstance(lengths, torch.Tensor):
            if lengths.dtype.is_floating_point or lengths.dtype == torch.bool or lengths.dim() != 1:
                raise ValueError(f"reward model: lengths must be an integer tensor [batch], got {lengths.dtype} "
                                 f"{tuple(lengths.shape)}")
        elif not (isinstance(lengths, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool)
                                                              for n in lengths)):
            raise ValueError(f"reward model: lengths must be a list of ints (real tokens per row), got {lengths!r}")
        n = torch.as_tensor(lengths, dtype=torch.long).to(input_ids.device)
        if n.shape != (B,):
            raise ValueError(f"reward model: lengths has {n.numel()} entries for a batch of {B} rows; give one "
                             "length (count of real tokens) per row of input_ids")
        bad = ((n < 1) | (n > T)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"reward model: lengths must lie in 1..{T} (the padded length), but row {bad[0]} has "
                             f"{n[bad[0]].item()}; every row needs at least one real token")
        lo, hi = input_ids.min().item(), input_ids.max().item()
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"reward model: token ids must lie in [0, {self.config.vocab_size}) (the reward "
                             f"model's vocabulary), got ids in [{lo}, {hi}]: is the batch from another tokenizer?")
        return n - 1

    # ---------------------------------------------------------------- checkpoints
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> "LlamaRewardModel":
        """Load a local LlamaForSequenceClassification directory (see ``load_reward_model``)."""
        return load_reward_model(path, dtype=dtype, device=device)

    def save_pretrained(self, path: str | os.PathLike, max_shard_bytes: int | None = None) -> None:
        """Write config.json + safetensors (atomically, per file) that transformers'
        LlamaForSequenceClassification loads with num_labels=1."""
        hf_config = {**self.config.to_hf_dict(), "architectures": [SEQ_CLS], **HF_ONE_LABEL}
        hf_io.save_checkpoint(self, path, reward_shapes(self.config), hf_config, max_shard_bytes)

    def extra_repr(self) -> str:
        c = self.config
        return (f"layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}/"
                f"{c.num_key_value_heads}, vocab={c.vocab_size}, head=score[1, {c.hidden_size}]")


def _check_reward_keys(d: Path, where: dict[str, Path], config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The expected shapes, after refusing a checkpoint without a score head and any missing or extra key."""
    if SCORE_KEY not in where:
        if hf_io.HEAD_KEY in where:
            raise ValueError(f"{d}: the checkpoint has {hf_io.HEAD_KEY!r} and no {SCORE_KEY!r}: a causal LM has no "
                             f"score head, so it is no reward model; reward.model needs a {SEQ_CLS} with "
                             "num_labels=1 (what TRL's RewardTrainer saves)")
        raise ValueError(f"{d}: the checkpoint has no {SCORE_KEY!r} (the reward head, [1, hidden_size]); a reward "
                         f"model is a {SEQ_CLS} checkpoint with num_labels=1")
    return hf_io._check_keys(d, where, config, reward_shapes(config))


def check_reward_model(path: str | os.PathLike) -> LlamaConfig:
    """Everything ``load_reward_model`` refuses in a directory, found from config.json and the safetensors
    headers (keys, shapes, dtypes, shards) without reading a tensor; returns the trunk's config."""
    d = Path(path)
    config = hf_io.load_config(d, architecture=SEQ_CLS)
    where = hf_io._weight_files(d)
    hf_io._check_headers(where, _check_reward_keys(d, where, config))
    return config


def load_reward_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaRewardModel:
    """Load a local LlamaForSequenceClassification (num_labels=1) directory: ``check_reward_model``, then
    build on the meta device, materialise in ``dtype`` on ``device`` and copy the tensors. In eval mode."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"load_reward_model dtype must be a floating torch.dtype, got {dtype!r}")
    config = check_reward_model(path)
    tensors = hf_io.load_state_dict(path, config, reward_shapes(config))
    with torch.device("meta"):
        model = LlamaRewardModel(config)
    return hf_io.fill(model.to(dtype=dtype).to_empty(device=torch.device(device)), tensors)
