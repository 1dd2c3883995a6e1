"""A preallocated, static KV cache for batched decoding with left-padded ragged prompts.

Layout: per layer one K and one V tensor [max_batch_size, num_kv_heads, max_seq_len, head_dim] in the
model dtype, zero-initialised (masked slots are multiplied by zero attention weights, so they must hold
finite values). Separate tensors per layer keep ``k[:rows]`` contiguous, so the engine can run on the
first ``rows`` rows (batch compaction, CUDA-graph buckets) without copies.

Addressing: all rows share the slot index of the token being decoded. Row b is left-padded: its first
real token lives at slot ``start[b]`` and a token at slot s has RoPE position ``s - start[b]``. Slots below
``start[b]`` and above the current slot are masked by the model (see llamarl.models.llama).

``has_padding`` (host bool) is False only when every live row starts at slot 0; the model then skips
the attention mask for decode steps and for a prefill from slot 0.

Invariants: a slot is written before any query can see it; ``start`` and the K/V rows are permuted
together (``compact``) so a row's history always travels with it.
"""

from __future__ import annotations

import torch

from llamarl.models.config import LlamaConfig


class KVCache:
    def __init__(
        self,
        config: LlamaConfig,
        max_batch_size: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError(
                f"KVCache needs max_batch_size >= 1 and max_seq_len >= 1, got {max_batch_size}, {max_seq_len}"
            )
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        shape = (max_batch_size, config.num_key_value_heads, max_seq_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.start = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.has_padding = False  # host-side: False guarantees start[:rows] == 0 (no attention mask needed)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def rows(self, layer: int, B: int, T: int, input_pos: int | torch.Tensor):
        """(K rows [:B], V rows [:B], end) of ``layer`` for writing T tokens at ``input_pos``: end = input_pos
        + T, the slots attention then reads, for an int input_pos (checked: [input_pos, end) lies in [0,
        max_seq_len)); None for a slot tensor (attention reads them all; its slots are not checked, which would
        cost a host sync: the CUDA-graph decode step that passes one keeps them in range)."""
        kc, vc = self.k[layer][:B], self.v[layer][:B]
        if not isinstance(input_pos, int):
            return kc, vc, None
        end = input_pos + T
        if input_pos < 0:
            raise ValueError(f"KV cache write at a negative slot {input_pos}; positions start at 0")
        if end > self.max_seq_len:
            raise ValueError(f"KV cache overflow: writing slots up to {end} but max_seq_len={self.max_seq_len}")
        return kc, vc, end

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, input_pos: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, Dh] at slots input_pos.. and return the K/V the new queries attend to.

        int input_pos: returns slots [0, input_pos + T); tensor input_pos [T]: returns all slots.
        """
        kc, vc, end = self.rows(layer, k.shape[0], k.shape[2], input_pos)
        if end is None:
            kc.index_copy_(2, input_pos, k)
            vc.index_copy_(2, input_pos, v)
            return kc, vc
        kc[:, :, input_pos:end] = k
        vc[:, :, input_pos:end] = v
        return kc[:, :, :end], vc[:, :, :end]

    def update_rope(
        self, layer: int, ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
        signed_sin: torch.Tensor, input_pos: int | torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE and ``update`` in one op: q, k, v [B, T, heads, Dh] (pre-RoPE, any token strides); ``ops`` is a
        fused-op module with ``rope_kv`` (llamarl.models.cpu_fused or llamarl_kernels.fused_ops), which
        writes rotated k and v straight into this layer's cache. Returns (rotated q [B, T, H, Dh], K, V)
        with K, V as ``update`` returns them."""
        kc, vc, end = self.rows(layer, k.shape[0], k.shape[1], input_pos)
        q = ops.rope_kv(q, k, v, cos, signed_sin, kc, vc, input_pos)
        return (q, kc, vc) if end is None else (q, kc[:, :, :end], vc[:, :, :end])

    def set_start(self, start: torch.Tensor) -> None:
        """Left-pad offsets of rows [0, len(start)) (a CPU tensor: the padding flag is computed on the host)."""
        self.has_padding = bool((start > 0).any())
        self.start[: start.numel()] = start.to(self.start.device)

    def repeat_rows(self, rows: int, n: int, upto: int) -> None:
        """Rows [0, rows) -> rows [0, rows*n) with row i copied to i*n .. i*n+n-1 (slots [0, upto))."""
        if n == 1:
            return
        if rows * n > self.max_batch_size:
            raise ValueError(f"repeat_rows: {rows}*{n} rows exceed the cache's max_batch_size={self.max_batch_size}")
        for t in self.k + self.v:
            t[: rows * n, :, :upto] = t[:rows, :, :upto].repeat_interleave(n, dim=0)
        self.start[: rows * n] = self.start[:rows].repeat_interleave(n)

    def compact(self, keep: torch.Tensor, upto: int | None = None) -> None:
        """Move rows ``keep`` (LongTensor, any order) to the front, in that order (slots [0, upto))."""
        m, upto = keep.numel(), self.max_seq_len if upto is None else upto
        for t in self.k + self.v:
            t[:m, :, :upto] = t[:, :, :upto].index_select(0, keep)
        self.start[:m] = self.start.index_select(0, keep)
