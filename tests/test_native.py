"""The native copy engine (llamarl._C) against numpy slicing, byte for byte."""

import numpy as np
import pytest
import torch

from llamarl._native import as_ops, build_info, copy_ops, native


def reference_copy(dst: np.ndarray, src: np.ndarray, ops: np.ndarray) -> None:
    for so, do, rows, rb, ss, ds in ops.tolist():
        for r in range(rows):
            dst[do + r * ds : do + r * ds + rb] = src[so + r * ss : so + r * ss + rb]


def random_schedule(rng, n_ops, src_nbytes, dst_nbytes):
    """Ops with disjoint destinations: the destination is cut into one strided block per op."""
    ops, cursor = [], 0
    for _ in range(n_ops):
        rows = int(rng.integers(1, 9))
        rb = int(rng.integers(1, 300))
        ds = rb + int(rng.integers(0, 5))
        ss = rb + int(rng.integers(0, 7))
        need_dst = (rows - 1) * ds + rb
        need_src = (rows - 1) * ss + rb
        if cursor + need_dst > dst_nbytes:
            break
        so = int(rng.integers(0, src_nbytes - need_src + 1))
        ops.append((so, cursor, rows, rb, ss, ds))
        cursor += need_dst
    return as_ops(ops)


def test_build_info_reports_what_was_compiled():
    info = build_info()
    assert set(info) >= {"cuda", "cuda_version", "compiler"}
    assert isinstance(info["cuda"], bool)
    assert (info["cuda_version"] is None) == (not info["cuda"])


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_strided_copy_matches_numpy(threads, seed):
    rng = np.random.default_rng(seed)
    src = torch.from_numpy(rng.integers(0, 256, size=50_000, dtype=np.uint8))
    dst = torch.zeros(40_000, dtype=torch.uint8)
    ops = random_schedule(rng, 200, src.numel(), dst.numel())
    expected = dst.numpy().copy()
    reference_copy(expected, src.numpy(), ops)
    copy_ops(dst, src, ops, num_threads=threads)
    assert np.array_equal(dst.numpy(), expected)


def test_large_multithreaded_copy_splits_ops_and_is_exact():
    # One 24 MiB op plus strided ones: big enough that every thread gets a share of a split op.
    src = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    ops = as_ops([(0, 0, 3 << 10, 8 << 10, 8 << 10, 8 << 10)])  # 3072 rows of 8 KiB, contiguous
    copy_ops(dst, src, ops, num_threads=4)
    assert torch.equal(dst, src)
    # transposed-ish gather: every other 4 KiB block of src into a dense dst
    dst2 = torch.zeros(12 << 20, dtype=torch.uint8)
    ops2 = as_ops([(0, 0, 3 << 10, 4 << 10, 8 << 10, 4 << 10)])
    copy_ops(dst2, src, ops2, num_threads=3)
    assert torch.equal(dst2.view(-1, 4 << 10), src.view(-1, 8 << 10)[:, : 4 << 10])


@pytest.mark.parametrize(
    "op, message",
    [
        ((0, 0, 2, 10, 10, 10), "reads past the end of the source"),
        ((0, 15, 1, 10, 10, 10), "writes past the end of the destination"),
        ((0, 0, 2, 10, 5, 10), "stride smaller than row_bytes"),
        ((-1, 0, 1, 1, 1, 1), "negative offset"),
    ],
)
def test_out_of_bounds_ops_raise_before_copying(op, message):
    src = torch.arange(15, dtype=torch.uint8)
    dst = torch.zeros(20, dtype=torch.uint8)
    ok = (0, 0, 1, 5, 5, 5)
    with pytest.raises(ValueError, match=message):
        copy_ops(dst, src, [ok, op])
    assert int(dst.sum()) == 0  # validation happens before any byte moves


def test_bad_schedule_shape_and_devices_are_rejected():
    with pytest.raises(ValueError, match=r"shape \[n, 6\]"):
        as_ops([[1, 2, 3]])
    with pytest.raises(ValueError, match="contiguous"):
        copy_ops(torch.zeros(4, 4).t(), torch.zeros(16), [])


@pytest.mark.skipif(build_info()["cuda"] and native().cuda_device_count() > 0, reason="a CUDA device is present")
def test_cuda_entry_points_raise_clearly_without_cuda():
    if not build_info()["cuda"]:
        with pytest.raises(RuntimeError, match="built without CUDA"):
            native().copy_ops_cuda(1, 1, 1, 1, as_ops([]))
    else:
        assert native().cuda_device_count() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("engine,streams", [("memcpy", 1), ("memcpy", 4), ("kernel", 1)])
def test_cuda_copy_moves_bytes_exactly(engine, streams):
    assert build_info()["cuda"], "llamarl._C was built without CUDA on a CUDA machine"
    rng = np.random.default_rng(7)
    src_h = torch.from_numpy(rng.integers(0, 256, size=1 << 20, dtype=np.uint8))
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    ops = random_schedule(rng, 300, src_h.numel(), dst.numel())
    expected = np.zeros(1 << 20, dtype=np.uint8)
    reference_copy(expected, src_h.numpy(), ops)
    copy_ops(dst, src_h.cuda(), ops, num_streams=streams, engine=engine)
    torch.cuda.synchronize()
    assert np.array_equal(dst.cpu().numpy(), expected)


@pytest.mark.gpu
def test_cuda_copy_kernel_covers_chunks_alignments_and_many_launches():
    """The SM copy kernel's paths: rows longer than a 256 KB chunk (ragged last chunk), contiguous 2-D ops
    flattened to one row, strided rows grouped into units, every access width (addresses and lengths
    that are multiples of 16, 8, 4, 2 and 1), and > 384 segments (several launches)."""
    src = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(40 << 20, dtype=torch.uint8, device="cuda")
    rng = np.random.default_rng(3)
    ops, cursor = [], 0

    def add(so, rows, rb, ss, ds, gap=0):
        nonlocal cursor
        ops.append((so, cursor, rows, rb, ss, ds))
        cursor += (rows - 1) * ds + rb + gap

    add(0, 1, (5 << 20) + 4096 + 48, 0, 0, gap=16)             # 21 chunks, the last one short
    add(16, 37, 65536, 65536, 65536, gap=16)                    # contiguous 2-D -> one 2.3 MB row
    add(4096, 300, 4096, 8192, 6144, gap=16)                    # strided, 64 rows per unit, 16-byte access
    add(1 << 20, 50, 1000, 3000, 1000, gap=8)                   # 8-byte access
    add(3 << 20, 20, 300_004, 300_004 + 12, 300_004 + 4, gap=4)  # rows > one chunk, 4-byte access
    add(6, 9, 2 * 777, 2 * 800, 2 * 777 + 2, gap=2)             # 2-byte access
    add(7, 3, 1001, 1001, 1003, gap=1)                          # 1-byte access
    for _ in range(800):                                        # many small ops: three launches
        rows, rb = int(rng.integers(1, 4)), int(rng.integers(1, 600))
        ss = rb + int(rng.integers(0, 9))
        add(int(rng.integers(0, (20 << 20))), rows, rb, ss, rb + int(rng.integers(0, 9)), gap=int(rng.integers(0, 3)))
    assert cursor <= dst.numel()
    ops = as_ops(ops)

    def width(so, do, rows, rb, ss, ds):  # the kernel's rule (cuda_copy_kernel.cu: access_width)
        bits = (src.data_ptr() + so) | (dst.data_ptr() + do) | rb | ((ss | ds) if rows > 1 else 0)
        return next(w for w in (16, 8, 4, 2, 1) if bits % w == 0)

    assert {width(*op) for op in ops[:7].tolist()} == {16, 8, 4, 2, 1}
    expected = np.zeros(dst.numel(), dtype=np.uint8)
    reference_copy(expected, src.cpu().numpy(), ops)
    copy_ops(dst, src, ops, engine="kernel")
    torch.cuda.synchronize()
    assert np.array_equal(dst.cpu().numpy(), expected)
    with pytest.raises(ValueError, match="'memcpy' or 'kernel'"):
        copy_ops(dst, src, ops, engine="dma")


@pytest.mark.parametrize("threads", [1, 3])
def test_indexed_copy_between_buffer_tables_matches_numpy(threads):
    from llamarl._native import BufferTable, copy_indexed

    rng = np.random.default_rng(11)
    srcs = [torch.from_numpy(rng.integers(0, 256, size=n, dtype=np.uint8)) for n in (5000, 123, 40_000, 7)]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in (30_000, 2_000, 9_000)]
    ops, expected = [], [d.numpy().copy() for d in dsts]
    for d, dst in enumerate(dsts):
        cursor = 0
        for _ in range(20):  # consecutive, disjoint destination blocks, each from a random source buffer
            s = int(rng.integers(0, len(srcs)))
            n_src = srcs[s].numel()
            rb = int(rng.integers(1, min(64, n_src) + 1))
            ss, ds = rb + int(rng.integers(0, 3)), rb + int(rng.integers(0, 3))
            rows = int(rng.integers(1, 6)) if 4 * ss + rb <= n_src else 1
            need_src, need_dst = (rows - 1) * ss + rb, (rows - 1) * ds + rb
            if cursor + need_dst > dst.numel():
                break
            op = (s, d, int(rng.integers(0, n_src - need_src + 1)), cursor, rows, rb, ss, ds)
            ops.append(op)
            reference_copy(expected[d], srcs[s].numpy(), np.asarray([op[2:]]))
            cursor += need_dst + int(rng.integers(0, 4))
    copy_indexed(BufferTable.of(dsts), BufferTable.of(srcs), ops, num_threads=threads)
    for d in range(len(dsts)):
        assert np.array_equal(dsts[d].numpy(), expected[d])


def test_shared_memory_segments_map_the_same_bytes_and_unlink():
    import os

    from llamarl._native import as_tensor, pid_alive, shm_attach, shm_create, shm_unlink

    name = f"/llamarl-test-native-{os.getpid()}"
    owner = shm_create(name, 1 << 16)
    peer = shm_attach(name, 1 << 16)
    a, b = as_tensor(owner), as_tensor(peer)
    assert owner.owner and not peer.owner and a.numel() == 1 << 16 and int(a.sum()) == 0
    b[100:200] = 7
    assert int(a[100:200].sum()) == 700 and a.data_ptr() != b.data_ptr()
    owner.unlink()
    assert not os.path.exists("/dev/shm" + name) and not shm_unlink(name)
    a[0] = 1  # mappings outlive the name
    assert int(b[0]) == 1
    assert pid_alive(os.getpid()) and not pid_alive(0)


def test_a_large_contiguous_copy_split_over_threads_copies_every_byte():
    """A contiguous copy over the multi-thread threshold is cut into chunks per thread: the tail that is not a
    whole chunk must be copied too (2 MiB + 100 bytes, as a real model's buckets are)."""
    n = (2 << 20) + 100
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for threads in (2, 4):
        dst = torch.zeros(n, dtype=torch.uint8)
        copy_ops(dst, src, [(0, 0, 1, n, n, n)], num_threads=threads)
        assert torch.equal(dst, src), threads
