"""The native boundary refuses what it cannot do safely (STYLE habit 4: native code raises, it never
clamps, skips or writes where it was not asked to). Each case here once crashed the process, wrote out of
bounds or returned a wrong result; now it raises a clear error and leaves memory untouched."""

import threading
import time

import numpy as np
import pytest
import torch

from llamarl._native import copy_ops, native, shm_create
from llamarl.generation import SamplingParams, sample_tokens
from llamarl.generation.sampling import sample_native_cpu

C = native()


@pytest.mark.parametrize("op", [(0, 2**63 - 4, 1, 8, 8, 8),  # offset + row_bytes wraps to a small number
                                (0, 0, 5, 8, 8, 2**62),  # (rows - 1) * stride wraps to 0
                                (0, 0, 2**61 + 1, 8, 8, 8)])
def test_copy_ops_whose_footprint_overflows_are_refused(op):
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overflows int64"):
        C.validate_ops(np.array([op], dtype=np.int64), 64, 64)
    with pytest.raises(ValueError, match="overflows int64"):
        copy_ops(dst, src, [op])
    assert int(dst.sum()) == 0


def test_copy_schedules_must_hold_integers():
    with pytest.raises(ValueError, match="must hold integers"):
        copy_ops(torch.zeros(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8), [[0, 0, 1, 8.9, 8, 8]])


def _published_block(n_writers: int = 1) -> bytearray:
    """A one-slot control block in a bytearray (64-byte aligned view), version 1 published."""
    raw = bytearray(C.CTL_NBYTES + 64)
    off = (-np.frombuffer(raw, dtype=np.uint8).ctypes.data) % 64
    block = memoryview(raw)[off:off + C.CTL_NBYTES]
    C.ctl_init(block, 1, n_writers, 1)
    for w in range(n_writers):
        C.ctl_register(block, True, w, 0)
    slot = C.ctl_claim(block, 1, 1.0)
    for w in range(n_writers):
        C.ctl_finish(block, w, slot, 1)
    return raw, block


def test_a_writer_finishing_twice_does_not_publish_for_the_others():
    _, block = _published_block(n_writers=2)
    slot = C.ctl_claim(block, 2, 1.0)
    assert not C.ctl_finish(block, 0, slot, 2)
    with pytest.raises(RuntimeError, match="writer 0 already finished version 2"):
        C.ctl_finish(block, 0, slot, 2)
    assert C.ctl_snapshot(block)["latest_version"] == 1  # readers still get the last complete version
    assert C.ctl_finish(block, 1, slot, 2) and C.ctl_snapshot(block)["latest_version"] == 2


def test_a_waiting_call_pins_its_buffer():
    """A claim waits (GIL released) for a reader to leave; meanwhile the bytearray under the block cannot be
    resized (it would move, and the wait would write into freed memory)."""
    raw, block = _published_block()
    slot, _ = C.ctl_acquire(block, -1, 1.0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(C.ctl_claim(block, 2, 30.0)))
    waiter.start()
    time.sleep(0.5)  # the claim is now waiting for the reader
    with pytest.raises(BufferError):
        raw.extend(b"\0" * 200_000)
    C.ctl_release(block, slot)
    waiter.join(30)
    assert got == [0]


def test_control_blocks_must_be_contiguous():
    raw = np.zeros(4 * C.CTL_NBYTES, dtype=np.uint8)
    off = (-raw.ctypes.data) % 64
    with pytest.raises(ValueError, match="C-contiguous"):
        C.ctl_init(raw[off:off + 2 * C.CTL_NBYTES:2], 1, 1, 1)
    assert not raw.any()


def test_a_corrupt_control_block_is_refused_not_followed():
    _, block = _published_block()
    np.frombuffer(block, dtype=np.int64)[1] = 2**40  # nslots, right after the magic
    with pytest.raises(RuntimeError, match="corrupt"):
        C.ctl_snapshot(block)


def test_timeouts_nan_is_refused_and_huge_waits_like_inf():
    _, block = _published_block()
    with pytest.raises(ValueError, match="nan"):
        C.ctl_wait_version(block, 5, float("nan"))
    slot, _ = C.ctl_acquire(block, -1, 1.0)
    threading.Timer(0.3, lambda: C.ctl_release(block, slot)).start()
    assert C.ctl_claim(block, 2, 1e12) == 0  # waited for the reader instead of timing out at once


def test_shared_memory_names_with_a_nul_are_refused():
    with pytest.raises(ValueError, match="NUL"):
        shm_create("/llamarl-test-a\x00b", 4096)


def test_raw_kernels_refuse_null_pointers_and_overflowing_sizes():
    y = torch.zeros(4)
    with pytest.raises(ValueError, match="x is a null pointer"):
        C.rms_norm_f32_cpu(0, 0, y.data_ptr(), y.data_ptr(), 0, 1, 4, 1e-6)
    with pytest.raises(ValueError, match="fit in int64"):
        C.linear_f32_cpu(0, y.data_ptr(), 0, 2**62, 1, 1, 1)
    with pytest.raises(ValueError, match="must be >= 1"):
        C.linear_f32_cpu(y.data_ptr(), y.data_ptr(), y.data_ptr(), -1, 4, 1, 1)


def test_rows_without_a_distribution_sample_a_valid_token_with_a_nan_logprob():
    """A fully masked row (all -inf) or a +inf logit: the native sampler returned token -1 and read the float
    before the row. Now: the first maximal index, log-prob NaN (the NaN policy of the torch path)."""
    logits = torch.zeros(2, 40)
    logits[0] = float("-inf")
    logits[1, 7] = float("inf")
    tokens, logprobs = sample_tokens(logits, SamplingParams(temperature=1.0, seed=0), torch.Generator().manual_seed(0))
    assert tokens.tolist() == [0, 7] and torch.isnan(logprobs).all()


def test_the_native_sampler_checks_its_inputs():
    logits = torch.zeros(2, 8)
    tokens, logprobs, u = torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.tensor([0.5, 1.5], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"u\[1\] = 1.5"):
        C.sample_f32_cpu(logits.data_ptr(), 2, 8, 1.0, u.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), 1)
    with pytest.raises(ValueError, match="empty vocabulary"):
        sample_native_cpu(torch.zeros(3, 0), 0.0, None)


def test_a_bad_cache_slot_leaves_the_kv_cache_untouched():
    from llamarl.models import cpu_fused

    B, T, H, Dh, S = 1, 2, 2, 4, 4
    q, k, v = (torch.randn(B, T, H, Dh) for _ in range(3))
    cos, sin = torch.ones(B, T, 1, Dh), torch.zeros(B, T, 1, Dh)
    k_cache, v_cache = torch.zeros(B, H, S, Dh), torch.zeros(B, H, S, Dh)
    with pytest.raises(ValueError, match="slot 99"):
        cpu_fused.rope_kv(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([0, 99]))
    assert not k_cache.any() and not v_cache.any()


def test_a_v_cache_with_fewer_slots_than_the_k_cache_is_refused():
    """The kernels bound the slots by k_cache alone: a shorter v_cache was written past its end."""
    from llamarl.models import cpu_fused

    B, T, H, Dh = 1, 1, 2, 4
    q, k, v = (torch.randn(B, T, H, Dh) for _ in range(3))
    cos, sin = torch.ones(B, T, 1, Dh), torch.zeros(B, T, 1, Dh)
    store = torch.zeros(2 * B * H * 4 * Dh)
    k_cache, v_cache = torch.zeros(B, H, 4, Dh), store[:B * H * 2 * Dh].view(B, H, 2, Dh)
    with pytest.raises(ValueError, match="v_cache"):
        cpu_fused.rope_kv(q, k, v, cos, sin, k_cache, v_cache, 3)
    assert not store.any()


def test_overlapping_copies_are_refused():
    """Rows are copied concurrently (memcpy): overlapping src and dst gave silent garbage with threads."""
    buf = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    before = buf.clone()
    with pytest.raises(ValueError, match="overlap"):
        copy_ops(buf[1000:], buf[:-1000], [(0, 0, 1, 8000, 8000, 8000)], num_threads=2)
    assert torch.equal(buf, before)


def test_a_buffer_table_of_a_generator_keeps_its_tensors_alive():
    from llamarl._native import BufferTable

    table = BufferTable.of(torch.full((8,), i, dtype=torch.uint8) for i in range(3))
    assert len(table._keep) == 3 and [int(t[0]) for t in table._keep] == [0, 1, 2]


@pytest.mark.parametrize("k,n", [(0, 4), (4, 0)])
def test_empty_products_give_what_f_linear_gives(k, n):
    from llamarl.models.linear import linear

    x, w = torch.randn(2, k), torch.randn(n, k)
    with torch.no_grad():
        got = linear(x, w)
    assert torch.equal(got, torch.nn.functional.linear(x, w))


def test_cuda_copies_refuse_unbounded_stream_counts():
    from llamarl._native import as_ops

    with pytest.raises(ValueError, match=r"num_streams must be in \[1, 64\]"):
        C.copy_ops_cuda(1, 1, 1, 1, as_ops([]), num_streams=1000)
