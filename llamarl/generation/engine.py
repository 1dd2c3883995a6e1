"""Batched generation over a preallocated KV cache: prefill, decode, sample, stop.

Log-prob convention (shared with AIPO; μ is the generator's policy):

    logprob_t = log_softmax(logits_t.float() / T)[y_t],   T = temperature if temperature > 0 else 1,

over the full vocabulary, in fp32, computed from the logits that produced y_t. With top-k/top-p it is the
log-prob of the truncated, renormalised distribution y_t was drawn from (``logprobs_mode="processed"``, the
default), or the one above (``"raw"``): llamarl.generation.sampling. ``policy_versions[t]`` is
``model.policy_version`` read just before the forward pass whose logits gave y_t.

Algorithm for one batch of prompts (``generate`` splits larger inputs into batches of at most
``max_batch_size // n`` prompts):

1. Prefill: the B distinct prompts are left-padded to the longest length P (pad id ``pad_token_id``,
   masked) and run once; row b's tokens occupy cache slots [P - len_b, P). Only the last position goes
   through lm_head.
2. n samples per prompt: the prompt rows of the cache are copied to rows i*n .. i*n+n-1 (prompt-major,
   the output order), so a prompt is prefilled once however many samples it gets.
3. Decode: at step t every live row feeds the token sampled at step t-1 at the shared slot P + t - 1.
   A row finishes when it samples a stop token (``stop_token_ids`` ∪ EOS; the stop token is kept in
   the output), when its text holds a stop string (``params.stop``, matched on ``decode`` of its tokens
   at each host synchronisation and cut exactly at the end: llamarl.generation.stop), or when it reaches
   its budget min(max_new_tokens, max_position_embeddings - len_b, max_seq_len - P) (finish_reason
   "length"). When at most half the rows are live the batch is
   compacted (cache rows moved to the front), so finished rows stop costing compute.

EOS: ``eos_token_id=None`` means the model config's ``eos_token_id`` (int or several); pass ``()`` to
generate without an EOS stop. Prompts must be non-empty and shorter than the context.

``GenerationEngine(model, max_batch_size, max_seq_len, quantization)`` allocates the KV cache
(max_batch_size rows x max_seq_len slots; default min(max_position_embeddings, 4096)) once and reuses it
for every call (size it with ``cache_slots`` for the prompts at hand: rows are left-padded to the longest
prompt of their batch, so a too-small cache cuts short rows too, with a warning);
``quantization="int8"|"fp8"`` converts the decoder linears in place at construction
(llamarl.models.quantize.quantize_model; ``quantization_backend="eager"`` runs them as torch ops instead
of the Triton kernels, which on a CPU run only interpreted), and then, unless ``pack_weights=False``,
moves the weights into one flat buffer (llamarl.models.packing: q|k|v and gate|up then run as one product
each, and CPU weights sit on huge pages; skipped for weights that already live in the weight sync's
buckets).
``generate(model, ...)`` is a one-shot engine sized to the call.
Seeds: a seed fixes the output of an identical call on an identical engine (same prompts in the same
order, ``max_batch_size``, ``sync_every``, device): the sampler consumes the generator's stream per live
row per step (one uniform per row on the CPU, V exponentials per row on CUDA), so the other prompts of a
call, and when finished rows are compacted away, change which numbers a row gets (never the distribution
it samples from).
Weights may be updated between calls or between steps (weight sync copies into the parameters in
place; the version read at each step tags the tokens), never during a forward pass.

Devices: everything runs where the model lives. On CUDA the engine replays the decode step as CUDA
graphs (llamarl.generation.cuda_graphs) unless ``cuda_graphs=False``; the eager path is the reference
(the one-shot ``generate`` is always eager). Host synchronisation happens once per step on CPU and
every ``sync_every`` steps on CUDA (to check whether all rows are done and to compact). With
``graph_steps=k > 1`` greedy requests on CUDA graphs run k steps per replay (sampling inside the graph,
``CUDAGraphDecoder.decode_greedy``), with the check after each replay; same tokens and log-probs, one
host round trip per k tokens. It is opt-in until the H200 shows it pays (benchmarks/generation times it).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from llamarl.generation.kv_cache import KVCache
from llamarl.generation.sampling import SamplingParams, make_generator, sample_tokens, token_ids
from llamarl.generation.stop import Decode, StopStrings, TailScanner
from llamarl.models.packing import pack_parameters_

QUANTIZATION_MODES = ("none", "int8", "fp8")
DEFAULT_MAX_SEQ_LEN = 4096


@dataclass(frozen=True)
class GenerationOutput:
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, including the stop/EOS token that ended the sample
    logprobs: list[float]  # one per generated token, under μ (see module docstring)
    policy_versions: list[int]  # model.policy_version that produced each token
    finish_reason: str  # "stop" | "length"


def _as_token_list(prompt: Any, i: int) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got shape {tuple(prompt.shape)}")
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise ValueError(f"prompt {i} must hold integer token ids, got a {prompt.dtype} tensor")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"prompt {i} is a string; encode it with the tokenizer first (generate takes token ids)")
    try:  # operator.index: ints (and numpy ints) only, so 1.5 is an error rather than token 1
        if any(isinstance(t, bool) for t in prompt):
            raise TypeError
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise ValueError(f"prompt {i} must be a sequence of int token ids, got {prompt!r:.200}") from None


class GenerationEngine:
    """A reusable generator: the KV cache (and CUDA graphs) are allocated once and reused by every call.

    The engine takes over ``model`` (a ``llamarl.models.Llama``; transformers' models load with
    ``Llama.from_pretrained``): its weights are packed in place, and ``quantization`` int8/fp8 replaces its
    linears' weights by quantized buffers in place, so a model that is also trained must be given as a copy
    (``GenerationEngine(copy.deepcopy(model), quantization="int8")``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch_size: int = 64,
        max_seq_len: int | None = None,
        quantization: str = "none",
        *,
        cuda_graphs: bool | None = None,
        sync_every: int | None = None,
        pack_weights: bool = True,
        graph_steps: int = 1,
        quantization_backend: str = "triton",
    ) -> None:
        from llamarl.models import Llama

        if not isinstance(model, Llama):  # e.g. a transformers LlamaForCausalLM: it has none of what is used here
            raise TypeError(f"GenerationEngine takes a llamarl.models.Llama, got {type(model).__name__}; load a "
                            "Hugging Face checkpoint with llamarl.models.Llama.from_pretrained(path)")
        if quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        config = model.config
        if max_seq_len is None:
            max_seq_len = min(config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
        embed = model.model.embed_tokens.weight  # never quantized: the model's device and compute dtype
        device = embed.device
        use_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if use_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device, it is on {device}")
        sync_every = sync_every if sync_every is not None else (8 if device.type == "cuda" else 1)
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(graph_steps, int) or graph_steps < 1:
            raise ValueError(f"graph_steps must be an int >= 1, got {graph_steps!r}")
        if graph_steps > 1 and not use_graphs:
            raise ValueError(f"graph_steps={graph_steps} replays several decode steps as one CUDA graph: it needs the "
                             f"model on a CUDA device and cuda_graphs on (model on {device}, cuda_graphs="
                             f"{cuda_graphs}); leave graph_steps=1 otherwise")
        # everything is checked: from here on the model is changed (quantized, packed)
        if quantization != "none":
            from llamarl.models.quantize import quantize_model

            quantize_model(model, quantization, backend=quantization_backend)
        self.packed = pack_parameters_(model) if pack_weights else False
        self.model, self.config = model, config
        self.quantization = quantization
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self._warned_cache_cut = False
        self.device = device
        self.cache = KVCache(config, max_batch_size, max_seq_len, dtype=embed.dtype, device=device)
        self.graphs = None
        if use_graphs:
            from llamarl.generation.cuda_graphs import CUDAGraphDecoder

            self.graphs = CUDAGraphDecoder(model, self.cache, max_batch_size)
        self.sync_every, self.graph_steps = sync_every, graph_steps

    # ------------------------------------------------------------------ public
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        decode: Decode | None = None,
    ) -> list[GenerationOutput]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and decode is None:
            raise ValueError(f"SamplingParams.stop={list(params.stop)!r} is matched against text: pass the tokenizer's "
                             "decode (generate(..., decode=tokenizer.decode); a GeneratorExecutor takes tokenizer=)")
        vocab, context = self.config.vocab_size, self.config.max_position_embeddings
        if isinstance(prompts, torch.Tensor):
            prompts = list(prompts)
        if len(prompts) == 0:
            raise ValueError("generate got no prompts (an empty list); pass at least one prompt")
        token_lists = [_as_token_list(p, i) for i, p in enumerate(prompts)]
        for i, toks in enumerate(token_lists):
            if len(toks) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
            if len(toks) >= min(context, self.max_seq_len):
                if context <= self.max_seq_len:
                    what, fix = f"model context (max_position_embeddings) is {context}", "shorten the prompt"
                else:
                    what = f"engine max_seq_len is {self.max_seq_len}"
                    fix = "shorten the prompt or build the engine with a larger max_seq_len"
                raise ValueError(f"prompt {i} has {len(toks)} tokens but the {what}: no room to generate; {fix}")
        if eos_token_id is None:
            eos = self.config.eos_token_ids
        else:  # one id (an int, a 0-d tensor) or several (token_ids refuses a str)
            one = not isinstance(eos_token_id, Iterable) or getattr(eos_token_id, "ndim", None) == 0
            eos = token_ids("eos_token_id", (eos_token_id,) if one else eos_token_id)
        (pad_token_id,) = token_ids("pad_token_id", (pad_token_id,))  # an int (None, a float: ValueError)
        stops = tuple(sorted(set(params.stop_token_ids) | set(eos)))
        bad = [t for t in stops if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop/eos token id(s) {bad} outside the vocabulary [0, {vocab})")
        if not 0 <= pad_token_id < vocab:
            raise ValueError(f"pad_token_id={pad_token_id} outside the vocabulary [0, {vocab})")
        per_batch = self.max_batch_size // params.n
        if per_batch < 1:
            raise ValueError(
                f"n={params.n} samples per prompt exceed the engine's max_batch_size={self.max_batch_size}"
            )

        generator = None if params.greedy else make_generator(params.seed, self.device)
        stop_t = torch.tensor(stops, dtype=torch.long, device=self.device) if stops else None
        stop_strings = StopStrings(params.stop, decode) if params.stop else None
        outputs: list[GenerationOutput] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for lo in range(0, len(token_lists), per_batch):
                    batch = token_lists[lo : lo + per_batch]
                    outputs += self._generate_batch(batch, lo, params, stop_t, stop_strings, pad_token_id, generator)
        finally:
            self.model.train(was_training)
        return outputs

    # ------------------------------------------------------------------ one batch
    def _logits_last(self, tokens: torch.Tensor, input_pos: int) -> torch.Tensor:
        h = self.model.hidden_states(tokens, input_pos, self.cache)
        return self.model.lm_head(h[:, -1])

    def _decode(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs.decode(tokens, slot).float()
        return self._logits_last(tokens[:, None], slot).float()

    def _generate_batch(
        self,
        prompts: list[list[int]],
        offset: int,
        params: SamplingParams,
        stop_t: torch.Tensor | None,
        stop_strings: StopStrings | None,
        pad_token_id: int,
        generator: torch.Generator | None,
    ) -> list[GenerationOutput]:
        dev, n = self.device, params.n
        B = len(prompts)
        lens = [len(p) for p in prompts]
        P = max(lens)
        context = self.config.max_position_embeddings
        budgets = [min(params.max_new_tokens, context - L, self.max_seq_len - P) for L in lens]
        cut = [b for b, L in zip(budgets, lens) if b < min(params.max_new_tokens, context - L)]
        if cut and not self._warned_cache_cut:
            self._warned_cache_cut = True
            warnings.warn(f"the engine's KV cache ({self.max_seq_len} slots) cuts {len(cut)} completion(s) of a batch "
                          f"whose longest prompt has {P} tokens to {min(cut)} tokens (finish_reason 'length'); build "
                          f"the engine with max_seq_len=cache_slots(prompt_lengths, max_new_tokens, config)",
                          stacklevel=3)
        steps = max(budgets)

        # 1. prefill the distinct prompts, left-padded
        tokens = torch.full((B, P), pad_token_id, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, P - len(p) :] = torch.tensor(p, dtype=torch.long)
        self.cache.set_start(torch.tensor([P - L for L in lens], dtype=torch.long))
        version = int(self.model.policy_version)
        logits = self._logits_last(tokens.to(dev), 0).float()  # [B, V]

        # 2. n samples per prompt share the prefill
        N = B * n
        if n > 1:
            self.cache.repeat_rows(B, n, P)
            logits = logits.repeat_interleave(n, dim=0)
        row_budget = torch.tensor(budgets, dtype=torch.long, device=dev).repeat_interleave(n)
        out_row = torch.arange(N, device=dev)  # live row -> output index
        out_tokens = torch.zeros(N, steps, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros(N, steps, dtype=torch.float32, device=dev)
        done = torch.zeros(N, dtype=torch.bool, device=dev)
        versions: list[int] = []
        rows = N
        scanner = TailScanner(stop_strings, N) if stop_strings is not None else None
        scanned = 0  # steps whose tokens the scanner has seen

        # 3. decode: sample step t from ``logits``, then decode that token at slot P + t for step t + 1
        chunk = self.graph_steps if self.graphs is not None and params.greedy else 1
        t = 0
        while t < steps:
            pending = None  # a sampled token still to be decoded (at slot P + t - 1)
            if chunk > 1 and t + chunk < steps:  # `chunk` greedy steps in one CUDA-graph replay
                new_version = int(self.model.policy_version)
                y, lp, logits = self.graphs.decode_greedy(logits, P + t, chunk)
                out_tokens[out_row, t : t + chunk] = y
                out_logprobs[out_row, t : t + chunk] = lp
                versions += [version] + [new_version] * (chunk - 1)
                version = new_version
                finished = t + chunk >= row_budget
                if stop_t is not None:
                    finished |= torch.isin(y, stop_t).any(dim=1)
                t += chunk
            else:
                y, lp = sample_tokens(logits, params, generator)
                out_tokens[out_row, t] = y
                out_logprobs[out_row, t] = lp
                versions.append(version)
                finished = t + 1 >= row_budget
                if stop_t is not None:
                    finished |= torch.isin(y, stop_t)
                t, pending = t + 1, y
            done |= finished
            if t == steps:
                break
            if pending is None or t % self.sync_every == 0:
                if scanner is not None:  # stop strings: end the rows whose text now holds one
                    hits = scanner.scan(out_tokens[out_row, scanned:t].tolist(), out_row.tolist(), done.tolist())
                    if hits:
                        done[hits] = True
                    scanned = t
                live = int((~done).sum())
                if live == 0:
                    break
                if live <= rows // 2:
                    keep = (~done).nonzero().squeeze(1)
                    self.cache.compact(keep, upto=P + t - (pending is not None))
                    out_row, row_budget, done = out_row[keep], row_budget[keep], done[keep]
                    if pending is None:
                        logits = logits[keep]
                    else:
                        pending = pending[keep]
                    rows = live
            if pending is not None:
                version = int(self.model.policy_version)
                logits = self._decode(pending, P + t - 1)

        # 4. cut each sample at its stop token or budget
        tok_host = out_tokens.cpu().tolist()
        lp_host = out_logprobs.cpu().tolist()
        stop_set = set(stop_t.tolist()) if stop_t is not None else set()
        results = []
        for r in range(N):
            b = r // n
            budget, toks = budgets[b], tok_host[r]
            end, reason = budget, "length"
            for j in range(budget):
                if toks[j] in stop_set:
                    end, reason = j + 1, "stop"
                    break
            if stop_strings is not None:  # exact, whatever the scanner saw
                first = stop_strings.first_end(toks[:end])
                if first is not None:
                    end, reason = first, "stop"
            results.append(
                GenerationOutput(
                    prompt_index=offset + b,
                    sample_index=r % n,
                    prompt_token_ids=list(prompts[b]),
                    token_ids=toks[:end],
                    logprobs=lp_host[r][:end],
                    policy_versions=versions[:end],
                    finish_reason=reason,
                )
            )
        return results


def cache_slots(prompt_lens: Sequence[int], max_new_tokens: int, config) -> int:
    """KV-cache slots a batch of prompts needs: the longest prompt plus the most tokens any row can add.
    Slots, not positions: with left padding a short row may run past the longest prompt's context limit
    in slot terms while its own positions stay below max_position_embeddings. A row stops at the
    context, so a huge ``max_new_tokens`` costs no more than the context allows."""
    longest, shortest = max(prompt_lens, default=1), min(prompt_lens, default=1)
    room = max(1, config.max_position_embeddings - shortest)
    return max(2, longest + min(max_new_tokens, room))


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    decode: Decode | None = None,
) -> list[GenerationOutput]:
    """Generate ``params.n`` samples per prompt; outputs in prompt-major order (prompt i, sample j at i*n+j).

    A one-shot engine sized to this call (eager decode, the model's weights left where they are); for
    repeated calls build a GenerationEngine.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    token_lists = [_as_token_list(p, i) for i, p in enumerate(prompts)]
    max_seq_len = cache_slots([len(p) for p in token_lists], params.max_new_tokens, model.config)
    rows = max(1, len(token_lists)) * params.n
    engine = GenerationEngine(model, max_batch_size=rows, max_seq_len=max_seq_len, cuda_graphs=False,
                              pack_weights=False)
    return engine.generate(token_lists, params, eos_token_id=eos_token_id, pad_token_id=pad_token_id, decode=decode)
