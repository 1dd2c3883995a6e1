"""CUDA-graph replay of the decode step (GPU only).

One decode step, for the first ``b`` rows of the static KV cache, is

    logits[b, V] = lm_head(model.hidden_states(tokens[b, 1], input_pos=slot[1], cache))[:, -1]

With ``input_pos`` a device tensor the model uses only static shapes (the attention reads all
``max_seq_len`` slots under a mask) and never synchronises with the host, so the step is captured once
per batch bucket ``b`` (powers of two up to the engine's max batch, captured lazily) and replayed with a
single launch. Inputs are copied into static buffers before each replay; rows ``[rows, b)`` of a bucket
compute garbage that is never read (their cache rows are dead).

Capture is safe in the middle of a generation: the warm-up runs execute the *real* step with the real
inputs, and a decode step is idempotent (it rewrites the same K/V at the same slot), so the replay that
follows produces exactly the eager result.

``decode_greedy`` captures k greedy steps in one graph (the argmax, the log-prob and the next step's
decode inside it): the engine's ``graph_steps`` option, one replay and one host round trip per k tokens.

``capture=False`` runs the very same static-shape steps (static buffers, buckets, whole-cache masked
attention) eagerly, on any device; the CPU tests use it to check everything but the capture itself.

Weights: a graph reads the parameter addresses it was captured with. Copying new values into the same
tensors (``param.copy_``) needs nothing; code that re-points the parameters at other storage (the weight
sync's double-buffered slots: llamarl.weight_sync.buckets.load_views does it) must set
``model.weights_key`` to a hashable identity of that storage: graphs are kept per (batch bucket,
weights_key), so each slot gets its own.
Invariants the caller keeps: the cache tensors are never re-allocated after a capture, parameters are
never re-pointed without a new ``weights_key``, and quantization happens before the first capture.
"""

from __future__ import annotations

import torch

from llamarl.generation.kv_cache import KVCache


def _buckets(max_batch_size: int) -> list[int]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 2
    return out + [max_batch_size]


class CUDAGraphDecoder:
    def __init__(self, model: torch.nn.Module, cache: KVCache, max_batch_size: int, *, capture: bool = True) -> None:
        device = cache.start.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model and cache on a CUDA device, got {device}")
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = _buckets(max_batch_size)
        self.tokens = torch.zeros(max_batch_size, 1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self._graphs: dict[tuple, tuple] = {}  # (bucket, weights_key) or ("greedy", k, bucket, weights_key)
        self._chunk_in: torch.Tensor | None = None  # decode_greedy's static input logits [max rows, V] fp32
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest CUDA-graph bucket {self.buckets[-1]}")

    def _step(self, b: int) -> torch.Tensor:
        h = self.model.hidden_states(self.tokens[:b], self.slot, self.cache)
        return self.model.lm_head(h[:, -1])

    def _greedy_chunk(self, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k greedy steps from the static logits: per step y = argmax z, logprob = log_softmax(z)[y] (the
        engine's greedy rule, llamarl.generation.sampling), then y is decoded at slot ``slot + i``."""
        logits = self._chunk_in[:b]
        tokens, logprobs = [], []
        for i in range(k):
            y = logits.argmax(dim=-1)
            logprobs.append(torch.log_softmax(logits, dim=-1).gather(-1, y[:, None]).squeeze(-1))
            tokens.append(y)
            self.tokens[:b, 0].copy_(y)
            h = self.model.hidden_states(self.tokens[:b], self.slot + i, self.cache)
            logits = self.model.lm_head(h[:, -1]).float()
        return torch.stack(tokens, 1), torch.stack(logprobs, 1), logits

    def _capture(self, key: tuple, fn) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: allocator, cuBLAS/Triton autotuning (idempotent step)
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        self._graphs[key] = (graph, out)

    def _run(self, key: tuple, fn):
        """fn() eagerly (capture=False), else the replay of its graph (captured on first use)."""
        if not self.capture:
            return fn()
        if key not in self._graphs:
            self._capture(key, fn)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def decode(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [rows, V] (model dtype; a view of a static buffer valid until the next call)."""
        rows = tokens.shape[0]
        b = self.bucket(rows)
        self.tokens[:rows, 0].copy_(tokens)
        self.slot.fill_(slot)
        return self._run((b, getattr(self.model, "weights_key", None)), lambda: self._step(b))[:rows]

    def decode_greedy(self, logits: torch.Tensor, slot: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k greedy steps in one replay, from fp32 ``logits`` [rows, V] (the step's): the tokens and their
        log-probs [rows, k] and the fp32 logits [rows, V] of the step after them; the tokens are decoded at
        slots ``slot .. slot + k - 1``. Views of static buffers, valid until the next call. The same ops as
        k rounds of greedy ``sample_tokens`` and ``decode``, so the same tokens and log-probs."""
        rows = logits.shape[0]
        b = self.bucket(rows)
        if self._chunk_in is None or self._chunk_in.shape[1] != logits.shape[1]:
            self._chunk_in = torch.zeros(self.buckets[-1], logits.shape[1], dtype=torch.float32,
                                         device=self.tokens.device)
        self._chunk_in[:rows].copy_(logits)
        self.slot.fill_(slot)
        key = ("greedy", k, b, getattr(self.model, "weights_key", None))
        tokens, logprobs, nxt = self._run(key, lambda: self._greedy_chunk(b, k))
        return tokens[:rows], logprobs[:rows], nxt[:rows]
