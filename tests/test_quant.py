"""int8 / fp8 weight-only quantization kernels against the eager reference and float64 math.

quantize / dequantize must reproduce the reference's bytes exactly (the rounding is specified bit for
bit); quantized_linear is checked against dequantize-then-matmul in float64 with an error bound
derived from fp32 accumulation plus one rounding to the output dtype, and against twice the eager
same-dtype error. Shapes are small and odd so every kernel loop (K tails, N/M tails, split-K with a
short or empty last split, several M tiles) runs under TRITON_INTERPRET=1 on CPU.
"""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llamarl_kernels.qlinear import QLinearConfig, quantized_linear
from llamarl_kernels.quant import QuantizeConfig, dequantize, quantize
from llamarl_kernels.reference import dequantize_ref, quantize_ref, quantized_linear_ref
from native_harness import run_sm90_compile

MODES = ["int8", "fp8"]
QMAX = {"int8": 127.0, "fp8": 448.0}
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # eps / 2
SMALL_TILES = QuantizeConfig(block_r=16, block_k=64)  # runs the row tail and the K loop on small shapes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = (_bytes(a.cpu()) != _bytes(b.cpu())).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def _roundtrip_bound(w64: torch.Tensor, scale64: torch.Tensor, mode: str) -> torch.Tensor:
    """|w - q * scale| bound: half a quantization step, plus the relative error of v = fl(w * fl(1 / scale))
    against w / scale: below 2^-23 (two fp32 roundings; p_r is an exact power of two), and 2^-4 * 2^-23
    more where e4m3's half-step is taken at v rather than at w / scale. The 2^-22 allowance, first
    written for one correctly rounded division, covers both unchanged."""
    v = (w64 / scale64[:, None]).abs()
    if mode == "int8":
        step = torch.full_like(v, 0.5)
    else:  # e4m3: 3 mantissa bits -> half ulp <= 2^-4 |v| for normals, 2^-10 in the subnormal range
        step = torch.maximum(v * 2.0**-4, torch.full_like(v, 2.0**-10))
    return scale64[:, None] * (step + v * 2.0**-22)


# ----------------------------------------------------------------------------------------------------
# quantize / dequantize
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (37, 129), (64, 130)])
@pytest.mark.parametrize("config", [SMALL_TILES, None], ids=["small_tiles", "default"])
def test_quantize_matches_reference_and_fp64_bounds(mode, dtype, shape, config, device):
    torch.manual_seed(sum(shape))
    w = (torch.randn(shape) * torch.logspace(-3, 2, shape[0])[:, None]).to(dtype).to(device)
    q, scale = quantize(w, mode, config=config)
    q_ref, scale_ref = quantize_ref(w, mode)
    _assert_same_bytes(scale, scale_ref)
    _assert_same_bytes(q, q_ref)

    w64, s64, q64 = w.double().cpu(), scale.double().cpu(), q.double().cpu()
    absmax = w64.abs().amax(dim=1)
    torch.testing.assert_close(s64, absmax / QMAX[mode], rtol=2.0**-23, atol=0)
    assert torch.equal(q64.abs().amax(dim=1), torch.full_like(absmax, QMAX[mode])), "row max must map to QMAX"
    assert ((w64 - q64 * s64[:, None]).abs() <= _roundtrip_bound(w64, s64, mode)).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_dequantize_matches_reference(mode, dtype, device):
    torch.manual_seed(1)
    w = torch.randn(19, 77, device=device) * 3
    w[4] *= 1e5  # fp16 output overflows to inf on this row, exactly as torch's cast does
    q, scale = quantize(w, mode)
    out = dequantize(q, scale, dtype)
    _assert_same_bytes(out, dequantize_ref(q, scale, dtype))
    if dtype == torch.float16:
        assert torch.isinf(out[4]).any()


@pytest.mark.parametrize("mode", MODES)
def test_row_slice_gives_same_bytes_as_full_matrix(mode, device):
    torch.manual_seed(2)
    big = torch.randn(40, 90, device=device, dtype=torch.bfloat16)
    w = big[:, :77]  # rows strided by 90: a block of a wider buffer
    q_full, s_full = quantize(w.contiguous(), mode)
    for a, b in [(0, 13), (13, 40), (7, 8), (39, 40)]:
        q, s = quantize(w[a:b], mode, config=SMALL_TILES)
        _assert_same_bytes(q, q_full[a:b])
        _assert_same_bytes(s, s_full[a:b])
    # shard by shard straight into a generator-style buffer (out=), as the weight sync does
    q_buf = torch.empty_like(q_full)
    s_buf = torch.empty_like(s_full)
    ptr = q_buf.data_ptr()
    for a, b in [(0, 16), (16, 32), (32, 40)]:
        quantize(w[a:b], mode, out=(q_buf[a:b], s_buf[a:b]))
    assert q_buf.data_ptr() == ptr
    _assert_same_bytes(q_buf, q_full)
    _assert_same_bytes(s_buf, s_full)


@pytest.mark.parametrize("mode", MODES)
def test_zero_and_underflowing_rows(mode, device):
    w = torch.randn(6, 45, device=device)
    w[1] = 0.0
    w[3] = 0.0
    w[3, 7] = -1e-45  # smallest subnormal: absmax / QMAX underflows to 0
    w[5] = -0.0
    q, scale = quantize(w, mode, config=SMALL_TILES)
    _assert_same_bytes(q, quantize_ref(w, mode)[0])
    for r in (1, 3, 5):
        assert scale[r].item() == 1.0, "a zero scale would divide by zero; the rule is scale = 1"
        assert (q[r].float() == 0).all()
        assert (dequantize(q, scale)[r] == 0).all()
    assert torch.isfinite(scale).all() and torch.isfinite(q.float()).all()
    x = torch.randn(3, 45, device=device)
    y = quantized_linear(x, q, scale, config=QLinearConfig(4, 16, 16))
    assert (y[:, [1, 3, 5]] == 0).all()


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_rounds_ties_to_even_with_subnormals_and_signed_zero(dev):
    """Exact e4m3 ties, independent of torch: a row with absmax 448 has scale 1 and v = w exactly, so each
    value's code is known by hand. On the GPU this checks the hardware conversion the kernel rounds with
    (HW_ROUND); on the CPU the interpreter's software rounding."""
    if dev == "cpu" and torch.cuda.is_available():
        pytest.skip("the kernels run on CUDA in this process (TRITON_INTERPRET is off)")
    s = 2.0**-9  # e4m3fn's smallest subnormal
    cases = [  # (w, expected code value)
        (448.0, 448.0),  # the row's absmax: scale = 448 / 448 = 1
        (432.0, 448.0), (400.0, 384.0),  # ties between 416|448 and 384|416: to the even mantissa
        (1.0625, 1.0), (1.1875, 1.25), (-1.0625, -1.0), (-1.1875, -1.25),  # ties at ulp 1/8
        (1.0625 + 2.0**-20, 1.125),  # just above a tie
        (0.5 * s, 0.0), (1.5 * s, 2 * s), (2.5 * s, 2 * s), (3.5 * s, 4 * s), (7.5 * s, 8 * s),  # subnormal ties
        (0.75 * s, s), (0.25 * s, 0.0),
        (-0.25 * s, -0.0), (-0.0, -0.0), (-1e-30, -0.0),  # negative values that round to zero keep the sign
    ]
    w = torch.tensor([[c[0] for c in cases]], dtype=torch.float32, device=dev)
    q, scale = quantize(w, "fp8")
    assert scale.item() == 1.0
    want = torch.tensor([[c[1] for c in cases]], dtype=torch.float32).to(torch.float8_e4m3fn)
    _assert_same_bytes(q, want)  # bytes, so -0.0 vs +0.0 counts
    _assert_same_bytes(q, quantize_ref(w.cpu(), "fp8")[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_values(mode, dtype, device):
    finfo = torch.finfo(dtype)
    rows = [
        [finfo.max, -finfo.max, 1.0, -1.0, 0.0],  # scale near max / QMAX, tiny values round to 0
        [finfo.tiny, -finfo.tiny * 3, finfo.tiny / 2, 0.0, 0.0],  # normals at the bottom of the range
        [1e-40, -3e-41, 1e-45, 0.0, 0.0],  # subnormals: the scale is subnormal too
        [1e30, 1.0, 1e-30, -7.0, 2.0],  # one outlier dominates the row
        [448.0, 464.0, 480.0, -479.0, 1e-3],  # around e4m3's saturation point
    ]
    w = torch.tensor(rows, dtype=torch.float32).to(dtype).repeat(3, 7)[:, :33].contiguous().to(device)
    q, scale = quantize(w, mode, config=SMALL_TILES)
    q_ref, scale_ref = quantize_ref(w, mode)
    _assert_same_bytes(scale, scale_ref)
    _assert_same_bytes(q, q_ref)
    assert torch.isfinite(scale).all()
    if mode == "fp8":  # the only e4m3fn NaN encodings are 0x7F and 0xFF
        assert not ((q.view(torch.uint8) & 0x7F) == 0x7F).any()
    else:
        assert q.min() >= -127
    w64, s64 = w.double().cpu(), scale.double().cpu()
    assert ((w64 - q.double().cpu() * s64[:, None]).abs() <= _roundtrip_bound(w64, s64, mode)).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", [SMALL_TILES, None], ids=["two_pass", "single_tile"])
def test_a_nan_weight_makes_its_row_scale_nan(mode, config, device):
    """A diverged (NaN) weight must not become finite codes: its row's scale is NaN, as in the reference,
    so the generator's outputs turn NaN; the other rows are untouched."""
    torch.manual_seed(4)
    w = torch.randn(5, 100, device=device)
    w[1, 77] = float("nan")
    w[3, 0] = float("nan")
    q, scale = quantize(w, mode, config=config)
    q_ref, scale_ref = quantize_ref(w, mode)
    assert torch.isnan(scale[[1, 3]]).all() and torch.isnan(scale_ref[[1, 3]]).all()
    ok = [0, 2, 4]
    _assert_same_bytes(scale[ok], scale_ref[ok])
    _assert_same_bytes(q[ok], q_ref[ok])
    assert torch.isnan(dequantize(q, scale)[[1, 3]]).all()


def _reciprocal_spec_codes(w: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """The codes of clamp(fl32(W * rho_r)), rho_r = 1 / scale_r rounded to 24 bits with an unbounded
    exponent, from exact rationals: no fp32 reciprocal and no p_r, so it checks the range guard."""
    rho = []
    for s in scale.tolist():
        x = Fraction(1) / Fraction(s)
        e = x.numerator.bit_length() - x.denominator.bit_length() - 23  # x / 2^e in (2^22, 2^24)
        e -= x / Fraction(2) ** e < 2**23  # now in [2^23, 2^24): 24 significant bits
        rho.append(float(round(x / Fraction(2) ** e)) * 2.0**e)  # Fraction round: half to even
    # w (24 bits) * rho (24 bits) is exact in float64; .float() then rounds once, subnormals included
    v = (w.double().cpu() * torch.tensor(rho, dtype=torch.float64)[:, None]).float()
    v = v.clamp(-QMAX[mode], QMAX[mode])
    return torch.round(v).to(torch.int8) if mode == "int8" else v.to(torch.float8_e4m3fn)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "config",
    [SMALL_TILES, QuantizeConfig(block_r=4, block_k=128), QuantizeConfig(block_r=4, block_k=32)],
    ids=["two_pass_16_rows", "one_tile_4_rows", "two_pass_4_rows"],
)
def test_reciprocal_at_extreme_scales(mode, dtype, config, device):
    """Rows whose absmax puts 1 / scale_r at fp32's edges: v = fl(W * rho_r) with no inf or NaN anywhere."""
    qmax, finfo = QMAX[mode], torch.finfo(dtype)
    below = lambda x: torch.nextafter(torch.tensor(x, dtype=dtype), torch.tensor(0.0, dtype=dtype)).item()
    absmax = [
        finfo.max,  # inv_r at its smallest, ~2^-121 for int8
        3e38,
        qmax,  # scale 1, inv 1: v = W
        qmax * 2.0**-64,  # scale exactly 2^-64: p_r = 1, inv_r = 2^64
        below(qmax * 2.0**-64),  # the largest absmax with p_r = 2^64
        qmax * 2.0**-128,  # 1 / scale_r = 2^128 overflows fp32 without p_r
        2.0**-126,  # smallest normal
        1e-40,  # subnormal: the scale is subnormal, with few significant bits
        qmax * 2.0**-149,  # scale 2^-149, the smallest positive: inv_r = 2^85
        round(1.6 * qmax) * 2.0**-149,  # scale 2^-148, rounded up from 1.6 * 2^-149: max -> ~QMAX / 1.25
        1e-45,  # absmax / QMAX underflows to 0: the zero-row rule
        0.0,
    ] + [1.0] * 5  # with 4-row blocks, rows 0-3 and 12-16 have p_r = 1: those blocks skip its multiply
    K = 70  # two passes over K with block_k 64 or 32, one tile with 128
    g = torch.Generator().manual_seed(5)
    u = torch.rand(len(absmax), K, generator=g, dtype=torch.float64) * 2 - 1
    u[:, 1], u[:, 2], u[:, 3], u[:, 4] = -1.0, 0.0, -0.0, 2.0**-30
    w = (u * torch.tensor(absmax, dtype=torch.float64)[:, None]).to(dtype)
    w[:, 0] = torch.tensor(absmax, dtype=torch.float64).to(dtype)  # |W| <= absmax: it is the row max
    w = w.to(device)
    q, scale = quantize(w, mode, config=config)
    q_ref, scale_ref = quantize_ref(w, mode)
    _assert_same_bytes(scale, scale_ref)
    _assert_same_bytes(q, q_ref)
    _assert_same_bytes(q, _reciprocal_spec_codes(w, scale, mode))

    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.isfinite(q.float()).all()
    if mode == "fp8":
        assert not ((q.view(torch.uint8) & 0x7F) == 0x7F).any()
    else:
        assert q.min() >= -127
    assert (scale[10:12] == 1.0).all() and (q[10:12].float() == 0).all()
    assert (q[:5, 0].float() == qmax).all(), "the row max maps to QMAX where the scale is normal"
    w64, s64 = w.double().cpu(), scale.double().cpu()
    assert ((w64 - q.double().cpu() * s64[:, None]).abs() <= _roundtrip_bound(w64, s64, mode)).all()


def test_int8_rounds_half_to_even(device):
    # absmax 127 -> scale exactly 1.0, so q = round(w) with ties to even
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, 3.5, -0.5, -2.5, 126.5, -126.5, 0.49999997]], device=device)
    q, scale = quantize(w, "int8")
    assert scale.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 4, 0, -2, 126, -126, 0]]


def test_fp8_rounds_half_to_even_onto_e4m3_grid(device):
    # absmax 448 -> scale 1.0. e4m3 has 3 mantissa bits: spacing 0.125 on [1, 2), 2^-9 below 2^-6.
    vals = [448.0, 1.0625, 1.1875, 1.9375, 0.0009765625, 0.0029296875, -1.0625, 432.0, 447.0]
    want = [448.0, 1.0, 1.25, 2.0, 0.0, 0.00390625, -1.0, 448.0, 448.0]
    q, scale = quantize(torch.tensor([vals], device=device), "fp8")
    assert scale.item() == 1.0
    assert q.float().tolist() == [want]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 70),
    log_mag=st.floats(-30, 30),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_quantize_property(rows, cols, log_mag, mode, seed):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, cols, generator=g) * 10.0**log_mag).to(device)
    q, scale = quantize(w, mode, config=SMALL_TILES)
    q_ref, scale_ref = quantize_ref(w, mode)
    _assert_same_bytes(q, q_ref)
    _assert_same_bytes(scale, scale_ref)
    w64, s64 = w.double().cpu(), scale.double().cpu()
    assert ((w64 - q.double().cpu() * s64[:, None]).abs() <= _roundtrip_bound(w64, s64, mode)).all()


# ----------------------------------------------------------------------------------------------------
# quantized_linear
# ----------------------------------------------------------------------------------------------------
def _check_linear(x, q, scale, bias, y):
    """y vs float64 dequantize-then-matmul: fp32-accumulation bound + one output rounding, and <= 2x eager.
    The float64 products run on the tensors' device (on the GPU the large model shapes take milliseconds)."""
    x64, q64, s64 = x.double(), q.double(), scale.double()
    K = q.shape[1]
    y64 = (x64 @ q64.t()) * s64
    absdot = (x64.abs() @ q64.abs().t()) * s64
    if bias is not None:
        y64 = y64 + bias.double()
        absdot = absdot + bias.double().abs()
    acc_err = (K + 3) * 2.0**-24 * absdot
    bound = acc_err + UNIT_ROUNDOFF[x.dtype] * (y64.abs() + acc_err) + 1e-37
    err = (y.double() - y64).abs()
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.shape[0])
    assert (err <= bound).all(), f"max error {err.max().item():.3g} over the bound at {(err > bound).nonzero()[0]}"
    ref_err = (quantized_linear_ref(x, q, scale, bias).double() - y64).abs()
    assert err.max() <= 2 * ref_err.max() + acc_err.max()


LINEAR_CASES = [  # (M, N, K, config): every loop and tail of both paths
    (1, 37, 129, QLinearConfig(1, 16, 32)),  # GEMV, K and N tails
    (1, 37, 300, QLinearConfig(1, 16, 64, prefetch=1)),  # one-row GEMV loading a tile ahead, K tail
    (1, 50, 129, QLinearConfig(1, 8, 32, split_k=3, prefetch=2)),  # two tiles ahead, split-K, short last split
    (3, 70, 130, QLinearConfig(4, 32, 64, split_k=2, prefetch=2)),  # multi-row GEMV, two tiles ahead
    (2, 20, 40, QLinearConfig(2, 16, 16, split_k=4, prefetch=1)),  # empty last split, a tile ahead
    (3, 70, 130, QLinearConfig(4, 32, 64, split_k=2)),  # GEMV with an M tail, split-K
    (5, 33, 100, QLinearConfig(8, 16, 16, split_k=3)),  # short last split
    (2, 20, 40, QLinearConfig(2, 16, 16, split_k=4)),  # empty last split
    (17, 70, 129, QLinearConfig(16, 32, 32)),  # tl.dot path, M tail
    (17, 37, 130, QLinearConfig(16, 16, 64, split_k=2, group_m=2)),  # two M tiles, grouped order, split
    (9, 45, 67, None),  # default config
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("M,N,K,config", LINEAR_CASES, ids=lambda c: str(c) if isinstance(c, int) else None)
def test_quantized_linear_against_fp64(mode, dtype, M, N, K, config, device):
    torch.manual_seed(M * 1000 + N + K)
    w = torch.randn(N, K, device=device) * torch.logspace(-2, 1, N, device=device)[:, None]
    q, scale = quantize(w, mode)
    x = torch.randn(M, K, device=device).to(dtype)
    bias = torch.randn(N, device=device).to(dtype) if M % 2 else None
    y = quantized_linear(x, q, scale, bias, config=config)
    _check_linear(x, q, scale, bias, y)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_batched_and_strided_input(mode, device):
    torch.manual_seed(3)
    q, scale = quantize(torch.randn(21, 50, device=device), mode)
    x = torch.randn(2, 3, 50, device=device, dtype=torch.bfloat16)
    y = quantized_linear(x, q, scale)
    _check_linear(x.reshape(6, 50), q, scale, None, y.reshape(6, 21))
    assert y.shape == (2, 3, 21)
    xt = torch.randn(50, 4, device=device).t()  # last dim not contiguous
    _check_linear(xt, q, scale, None, quantized_linear(xt, q, scale))


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_extreme_weights_and_inputs(mode, device):
    torch.manual_seed(4)
    w = torch.randn(24, 40, device=device)
    w[0] = 0.0
    w[1, 3] = 1e30  # outlier row: everything else rounds to 0
    w[2] *= 1e-30
    w[3] = torch.finfo(torch.float32).max / 1e9  # huge row; outputs stay below fp32 max
    q, scale = quantize(w, mode)
    x = torch.randn(5, 40, device=device) * torch.logspace(-20, 5, 5, device=device)[:, None]
    for cfg in (QLinearConfig(4, 16, 16), QLinearConfig(16, 16, 16, split_k=2)):
        y = quantized_linear(x, q, scale, config=cfg)
        assert not torch.isnan(y).any()
        _check_linear(x, q, scale, None, y)


def test_empty_inputs(device):
    q, scale = quantize(torch.empty(0, 8, device=device), "int8")
    assert q.shape == (0, 8) and scale.shape == (0,)
    q, scale = quantize(torch.randn(4, 8, device=device), "fp8")
    assert quantized_linear(torch.empty(0, 8, device=device), q, scale).shape == (0, 4)


def test_a_single_column_weight_may_have_any_column_stride(device):
    """A [R, 1] view of a [1, R] row has column stride R; torch calls it contiguous (a size-1 dim's stride is
    moot) and so does the weight sync, so the kernels must take it (they refused it, and .contiguous() too)."""
    w = torch.tensor([[0.5, -1.0, 2.0, 0.25, -0.125]], device=device).t()
    assert w.is_contiguous() and w.stride(1) != 1
    q, scale = quantize(w, "int8")
    ref_q, ref_scale = quantize_ref(w, "int8")
    _assert_same_bytes(q, ref_q)
    _assert_same_bytes(scale, ref_scale)
    x = torch.tensor([[3.0]], device=device)
    y = quantized_linear(x, q.t().contiguous().t(), scale)
    torch.testing.assert_close(y, quantized_linear_ref(x, q, scale), rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_passes_gradients_to_x_and_bias(mode, device):
    """Like the eager reference (the kernel has no backward of its own; it cut the graph silently: in a
    residual block x + ql(x), x's gradient came out as ones)."""
    torch.manual_seed(0)
    q, scale = quantize(torch.randn(6, 10, device=device), mode)
    grads = []
    for op in (quantized_linear, quantized_linear_ref):
        x = torch.randn(3, 10, device=device, generator=torch.Generator(device).manual_seed(1), requires_grad=True)
        bias = torch.linspace(-1, 1, 6, device=device, requires_grad=True)
        y = op(x, q, scale, bias)
        ((y * torch.arange(6.0, device=device)).sum() + x.sum()).backward()
        grads.append((x.grad, bias.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)
    with torch.no_grad():  # and no autograd node where none is needed
        assert quantized_linear(torch.randn(2, 10, device=device, requires_grad=True), q, scale).grad_fn is None


# ----------------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------------
def test_bad_inputs_raise_clear_errors(device):
    w = torch.randn(6, 10, device=device)
    q, scale = quantize(w, "int8")
    x = torch.randn(2, 10, device=device)
    with pytest.raises(ValueError, match="mode must be one of"):
        quantize(w, "int4")
    with pytest.raises(ValueError, match="2-D weight"):
        quantize(w[0], "int8")
    with pytest.raises(TypeError, match="float32/bfloat16/float16"):
        quantize(w.to(torch.int32), "int8")
    with pytest.raises(ValueError, match="unit stride along K"):
        quantize(torch.randn(10, 6, device=device).t(), "int8")
    with pytest.raises(ValueError, match="K >= 1"):
        quantize(torch.empty(3, 0, device=device), "fp8")
    with pytest.raises(ValueError, match="out=...\\): q must be"):
        quantize(w, "fp8", out=(torch.empty_like(q), torch.empty_like(scale)))
    with pytest.raises(ValueError, match="scale must be contiguous float32 of shape \\[6\\]"):
        quantize(w, "int8", out=(torch.empty_like(q), torch.empty(5, device=device)))
    with pytest.raises(TypeError, match="q must be int8 or float8_e4m3fn"):
        quantized_linear(x, w, scale)
    with pytest.raises(ValueError, match="scale must be contiguous float32 of shape \\[6\\]"):
        quantized_linear(x, q, scale.double())
    with pytest.raises(ValueError, match="last dim must equal q's K=10"):
        quantized_linear(torch.randn(2, 11, device=device), q, scale)
    with pytest.raises(TypeError, match="x must be float32"):
        quantized_linear(x.to(torch.int64), q, scale)
    with pytest.raises(ValueError, match="bias must be a contiguous float tensor of shape \\[6\\]"):
        quantized_linear(x, q, scale, torch.randn(5, device=device))
    with pytest.raises(TypeError, match="dtype must be float32"):
        dequantize(q, scale, torch.int8)
    with pytest.raises(ValueError, match="power of two"):
        QLinearConfig(3, 16, 16)
    with pytest.raises(ValueError, match="prefetch must be 0, 1 or 2"):
        QLinearConfig(1, 16, 16, prefetch=3)
    if device.type == "cuda":
        with pytest.raises(ValueError, match="one device"):
            quantized_linear(x.cpu(), q, scale)


# ----------------------------------------------------------------------------------------------------
# GPU-only: decode / prefill shapes with the default (heuristic) configs
# ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M", [1, 16, 256])  # decode, the split-K/tile switch, prefill (each launch config compiles)
@pytest.mark.parametrize("N,K", [(14336, 4096), (4096, 14336), (1000, 4000)])
def test_gpu_model_shapes_against_fp64(mode, M, N, K):
    torch.manual_seed(M + N)
    w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    q, scale = quantize(w, mode)
    q_ref, scale_ref = quantize_ref(w, mode)
    _assert_same_bytes(q, q_ref)
    _assert_same_bytes(scale, scale_ref)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    _check_linear(x, q, scale, None, quantized_linear(x, q, scale))
    xf = x.float()
    _check_linear(xf, q, scale, None, quantized_linear(xf, q, scale))



# ----------------------------------------------------------------------------------------------------
# GPU lowering without a GPU: compile the kernels for sm_90 (H100/H200) ahead of time
# ----------------------------------------------------------------------------------------------------
_AOT_SCRIPT = r"""
import llamarl_kernels.qlinear as QL
import llamarl_kernels.quant as Q

sig = {"w_ptr": "*i16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "R": "i32", "K": "i32", "stride_w": "i32",
       "stride_q": "i32", "QMAX_": "constexpr", "IS_FP8": "constexpr", "W_BF16_BITS": "constexpr",
       "HW_ROUND": "constexpr", "BLOCK_R": "constexpr", "BLOCK_K": "constexpr", "SINGLE_TILE": "constexpr"}
for single, (br, bk, warps) in [(False, (8, 512, 4)), (True, (2, 4096, 8))]:
    n_instr = {}
    for hw in (True, False):
        ptx = build(Q._quantize_kernel, sig, dict(QMAX_=448.0, IS_FP8=True, W_BF16_BITS=True, HW_ROUND=hw, BLOCK_R=br,
                    BLOCK_K=bk, SINGLE_TILE=single), ["w_ptr", "q_ptr", "scale_ptr", "K", "stride_w", "stride_q"],
                    num_warps=warps)
        divs = ptx.count("div.rn.f32")  # per row: scale and reciprocal; each thread holds at most br rows
        assert 0 < divs <= 2 * br and "div.full" not in ptx, "quantize divides per element, or not correctly rounded"
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, "the e4m3 cast is not the round-to-nearest-even conversion"
        n_instr[hw] = sum(1 for line in ptx.split("\n") if line.startswith("\t") and not line.strip().startswith("//"))
    # the GPU build rounds with the conversion alone: the software RNE (a dozen instructions a value) is gone
    assert n_instr[True] < 0.7 * n_instr[False], f"fp8 quantize instructions hw/sw: {n_instr}"
for qty, (bm, bn, bk, split, prefetch) in [("*i8", (1, 8, 512, 1, 1)), ("*fp8e4nv", (1, 16, 256, 2, 2)),
                                           ("*fp8e4nv", (16, 64, 128, 2, 0))]:
    sig = {"x_ptr": "*bf16", "q_ptr": qty, "scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_qn": "i32",
           "stride_om": "i32", "HAS_BIAS": "constexpr", "OUT_KIND": "constexpr", "DOT_FP32": "constexpr",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "SPLIT_K": "constexpr",
           "GROUP_M": "constexpr", "PREFETCH": "constexpr"}
    ptx = build(QL._qlinear_kernel, sig, dict(HAS_BIAS=False, OUT_KIND=1, DOT_FP32=False, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, SPLIT_K=split, GROUP_M=8, PREFETCH=prefetch),
                ["x_ptr", "q_ptr", "scale_ptr", "bias_ptr", "out_ptr", "ws_ptr", "N", "K", "stride_xm",
                 "stride_qn", "stride_om"], num_warps=4, num_stages=4)
    if bm == 1:
        loop, = loops(ptx)
        # one register layout for codes and activations: nothing moves through shared memory per tile
        assert not any(s in loop for s in ("bar.sync", ".shared", "ldmatrix")), "GEMV loop converts layouts"
        assert "ld.global.v2" in loop and "ld.global.v4" in loop, "GEMV loads are not 8-byte codes / 16-byte x"
        assert "cvt.rn.f32.s8" not in ptx, "int8 upcast fell back to the slow conversion"
    else:
        assert "mma" in ptx, "tl.dot path did not use tensor cores"
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter does not type-check GPU lowering (bitcast widths, fp8 casts, dot operand types)."""
    run_sm90_compile(_AOT_SCRIPT, tmp_path)
