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

``capture=False`` runs the very same static-shape step (static buffers, buckets, whole-cache masked
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
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (bucket, weights_key)
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest CUDA-graph bucket {self.buckets[-1]}")

    def _step(self, b: int) -> torch.Tensor:
        h = self.model.hidden_states(self.tokens[:b], self.slot, self.cache)
        return self.model.lm_head(h[:, -1])

    def _capture(self, b: int, key: tuple) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: allocator, cuBLAS/Triton autotuning (idempotent step)
                self._step(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(b)
        self._graphs[key] = (graph, logits)

    def decode(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [rows, V] (model dtype; a view of a static buffer valid until the next call)."""
        rows = tokens.shape[0]
        b = self.bucket(rows)
        self.tokens[:rows, 0].copy_(tokens)
        self.slot.fill_(slot)
        if not self.capture:
            return self._step(b)[:rows]
        key = (b, getattr(self.model, "weights_key", None))
        if key not in self._graphs:
            self._capture(b, key)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:rows]
