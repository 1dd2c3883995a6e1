"""A learned reward model as a reward term: the score a Llama sequence classifier gives prompt + completion.

``reward.model=DIR`` (a Hugging Face ``LlamaForSequenceClassification`` with one label, as TRL's
RewardTrainer writes; llamarl.models.reward_model) adds the term "model" to every sample's reward (TRL's
``reward_funcs=<model>``, OpenRLHF's ``--reward_pretrain``):

    r = Σ_i w_i · r_i  (+ the overlong term)  +  reward.model_weight · s,    s = score(prompt ⧺ completion)

where the r_i are the reward functions' (the verifier first, which alone decides correctness: held-out
accuracy never reads s). A sample whose verifier failed has no reward and is not scored here.

What the reward model reads (``sequence``):
  * The reward model's directory has no tokenizer, or one equal to the policy's (same vocabulary, merges,
    specials): the policy's ids as they are, prompt ids (template, few-shot prefix, chat format) followed by
    the sampled completion ids (with the EOS token when one was sampled).
  * Another tokenizer (a reward model of another family): with chat-formatted data (``data.chat``), as TRL's
    GRPOTrainer presents it, the conversation (``PromptFormatter.messages``, the few-shot turns included) plus
    the completion as the assistant's turn, rendered by the reward model's own chat template; otherwise, in
    the form TRL's RewardTrainer trains on, the prompt's and the completion's text, decoded without the
    policy's special tokens, encoded by the reward model's tokenizer as it encodes a text (with the prefix
    its post-processor adds, if any), and its EOS appended when the completion ended in one of the policy's
    (``eos_ids``). (GRPOTrainer adds neither; a reward model trained on text + EOS scores at its EOS.)
The scored position is transformers' (``LlamaForSequenceClassification`` and so TRL's RewardTrainer): the last
token that is not the reward model's ``pad_token_id``, so where pad == eos a completion that ends in eos is
scored at the token before it, as the model was trained. A sequence longer than the reward model's context,
or holding an id beyond its vocabulary (a policy whose embedding has more rows than its tokenizer has ids can
sample one), costs that sample (its reward is an error, counted like a failed verifier, kept out of its
group's advantages), not the run. What can be known before the run (the checkpoint, the tokenizer it reads
with against its vocabulary, a chat template for chat data) is checked by ``check_reader`` up front.

Batching: the sequences are sorted by length and scored ``batch_size`` at a time, each batch right-padded
(causal attention: a row's last real token never sees the padding after it), so padding stays small; the
scores come back in input order, as fp32 values. The forward runs in a thread of the controller process
(``score_rollouts``: torch releases the GIL in its kernels), beside the verifier's worker processes, so the
event loop keeps serving the generator and trainer meanwhile. On CPU it uses ``threads`` torch threads; a
failure of the forward itself (out of memory, ...) is raised: it is not one sample's fault.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any, Sequence

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TERM_NAME = "model"


def same_tokenizer(a: Any, b: Any) -> bool:
    """Whether two llamarl tokenizers map every text to the same ids (same class and, for a Hugging Face
    tokenizer, the same serialised tokenizer and the same special tokens)."""
    from llamarl.models.tokenizer import CharTokenizer, HFTokenizer

    if isinstance(a, CharTokenizer) and isinstance(b, CharTokenizer):
        return True
    if isinstance(a, HFTokenizer) and isinstance(b, HFTokenizer):
        return (a._tok.to_str() == b._tok.to_str() and a.prefix_ids == b.prefix_ids
                and (a.bos_id, a.eos_id, a.pad_id) == (b.bos_id, b.eos_id, b.pad_id))
    return False


def _own_tokenizer(path: Path) -> Any:
    """The reward model directory's tokenizer, or None when it has none."""
    from llamarl.models.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, load_tokenizer

    if not ((path / TOKENIZER_JSON).is_file() or (path / TOKENIZER_CONFIG).is_file()):
        return None
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"its tokenizer cannot be read: {e}") from None


def check_reader(path: str | Path, policy_tokenizer: Any, *, chat: bool = False,
                 messages: Sequence[dict] | None = None) -> tuple[Any, Any]:
    """(the reward model's LlamaConfig, the tokenizer it reads with or None for the policy's ids), after the
    checks that need no weights: the checkpoint (config.json and tensor headers), its own tokenizer if it has
    one, that tokenizer's ids (or the policy tokenizer's, when it reads the policy's ids) within its embedding,
    and, for chat data read through its own tokenizer, a chat template that renders a conversation (``messages``,
    a prompt's as the run renders them, system message and few-shot turns included, plus an answer; by default
    one user turn). Raises ValueError saying what to change."""
    from llamarl.models.reward_model import check_reward_model

    path = Path(path)
    config = check_reward_model(path)
    own = _own_tokenizer(path)
    tokenizer = None if own is None or same_tokenizer(own, policy_tokenizer) else own
    reads = policy_tokenizer if tokenizer is None else tokenizer
    if reads.vocab_size > config.vocab_size:
        raise ValueError(
            f"its embedding has {config.vocab_size} rows but the tokenizer it reads with ("
            + ("the policy's: the directory has none of its own" if own is None else "its own")
            + f") has {reads.vocab_size} ids; " + ("save the reward model's own tokenizer in its directory"
                                                   if own is None else "its tokenizer does not fit its embedding"))
    if tokenizer is not None and chat:
        try:
            probe = list(messages) if messages is not None else [{"role": "user", "content": "1+1="}]
            tokenizer.apply_chat_template([*probe, {"role": "assistant", "content": "2"}], add_generation_prompt=False)
        except Exception as e:  # no template, or a template error of any kind
            raise ValueError(f"the data is chat-formatted (data.chat) and the reward model reads it through its own "
                             f"tokenizer, whose chat template cannot render a conversation: {e}") from None
    return config, tokenizer


class RewardModelScorer:
    """A loaded reward model and the rule that turns a rollout into the ids it reads (module docstring)."""

    def __init__(self, path: str | Path, *, policy_tokenizer: Any, eos_ids: Sequence[int] = (), chat: bool = False,
                 dtype: str = "float32", device: str | torch.device = "cpu", batch_size: int = 16,
                 threads: int | None = None):
        from llamarl.models.reward_model import load_reward_model

        if batch_size < 1:
            raise ValueError(f"reward model batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size, self.threads = Path(path), batch_size, threads
        self.policy_tokenizer, self.chat = policy_tokenizer, chat
        self.eos_ids = frozenset(eos_ids) | {policy_tokenizer.eos_id}
        _, self.tokenizer = check_reader(self.path, policy_tokenizer, chat=chat)
        self.device = torch.device(device)
        self.model = load_reward_model(self.path, dtype=DTYPES[dtype], device=self.device)
        config = self.model.config  # (a pad_token_id outside the vocabulary is None there: it matches no id either)
        self.context, self.vocab_size = config.max_position_embeddings, config.vocab_size
        self.pad_id = config.pad_token_id

    @property
    def wants_messages(self) -> bool:
        """Whether ``sequence`` renders chat messages (chat data read through the reward model's tokenizer)."""
        return self.chat and self.tokenizer is not None

    def sequence(self, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                 messages: Sequence[dict] | None = None) -> list[int]:
        """The ids the reward model reads for one rollout (module docstring); ``messages``: the prompt's chat
        messages, used when ``wants_messages``."""
        if self.tokenizer is None:
            return [*prompt_ids, *completion_ids]
        rm, policy = self.tokenizer, self.policy_tokenizer
        completion = policy.decode(completion_ids, skip_special_tokens=True)
        if self.wants_messages:
            if messages is None:
                raise ValueError("the reward model renders chat data with its own template: pass the messages")
            text = rm.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                          add_generation_prompt=False)
            return rm.encode(text)  # (the template writes its special tokens, BOS included, as text)
        ids = rm.encode(policy.decode(prompt_ids, skip_special_tokens=True) + completion,
                        add_bos=bool(rm.prefix_ids))  # what its tokenizer puts before a text, if anything
        if completion_ids and completion_ids[-1] in self.eos_ids:
            ids.append(rm.eos_id)
        return ids

    def _scored_length(self, ids: Sequence[int]) -> int:
        """1 + the position whose hidden state is scored: transformers' choice, the last token that is not the
        config's pad_token_id (the first token if all are), which the reward model was trained with; a
        sequence that ends in eos where pad == eos is scored at the token before its trailing eos tokens."""
        if self.pad_id is None:
            return len(ids)
        last = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] != self.pad_id), 0)
        return last + 1

    def score(self, sequences: Sequence[Sequence[int]]) -> list[float | str]:
        """The score of each sequence, or the reason it has none (empty, too long, a non-finite score), in input
        order."""
        out: list[float | str] = [0.0] * len(sequences)
        fit = []
        for i, ids in enumerate(sequences):
            if not ids:
                out[i] = "reward model: empty sequence"
            elif len(ids) > self.context:
                out[i] = (f"reward model: the sequence has {len(ids)} tokens, more than the reward model's context "
                          f"of {self.context}")
            elif max(ids) >= self.vocab_size or min(ids) < 0:
                out[i] = (f"reward model: token id {max(ids) if max(ids) >= self.vocab_size else min(ids)} lies "
                          f"outside its vocabulary [0, {self.vocab_size})")
            else:
                fit.append(i)
        fit.sort(key=lambda i: len(sequences[i]))
        previous = torch.get_num_threads()
        if self.threads and self.device.type == "cpu":
            torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                for start in range(0, len(fit), self.batch_size):
                    rows = fit[start:start + self.batch_size]
                    lengths = [len(sequences[i]) for i in rows]
                    scored = [self._scored_length(sequences[i]) for i in rows]
                    batch = torch.zeros(len(rows), max(lengths), dtype=torch.long)
                    for b, i in enumerate(rows):
                        batch[b, :lengths[b]] = torch.as_tensor(list(sequences[i]), dtype=torch.long)
                    scores = self.model.scores(batch.to(self.device), torch.tensor(scored, device=self.device))
                    for i, s in zip(rows, scores.float().cpu().tolist()):
                        out[i] = s if math.isfinite(s) else f"reward model: non-finite score {s}"
        finally:
            torch.set_num_threads(previous)
        return out

    def score_pairs(self, pairs: Sequence[tuple]) -> list[float | str]:
        """``score`` of the sequences of (prompt ids, completion ids[, chat messages]) tuples; a pair whose
        sequence cannot be built (its chat template raises on those messages) gets the reason instead."""
        sequences: list[Any] = []
        for p in pairs:
            try:
                sequences.append(self.sequence(*p))
            except Exception as e:  # noqa: BLE001 - jinja2's or raise_exception's: that sample's, not the run's
                sequences.append(f"reward model: its chat template cannot render this conversation: {e}")
        built = [i for i, q in enumerate(sequences) if not isinstance(q, str)]
        out: list[float | str] = list(sequences)
        for i, s in zip(built, self.score([sequences[i] for i in built])):
            out[i] = s
        return out

    async def score_rollouts(self, pairs: Sequence[tuple]) -> list[float | str]:
        """``score_pairs`` in a worker thread (re-tokenising included): the event loop runs on meanwhile."""
        return await asyncio.to_thread(self.score_pairs, pairs)
