"""scaled_mm: against a float64 reference of the dequantized operands, every CPU variant."""
import itertools

import pytest
import torch

import fp8linear
from fp8linear import reference
from conftest import (FLOAT_DTYPES, FP8_DTYPES, bf16_gemm_kernel, forced_cpu_variant, relative_error,
                      scaled_mm_on_1_and_2_threads)

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
ODD_SIZES = [1, 3, 17, 64, 1025]


def _operands(m, k, n, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn, per_row=False):
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), dtype=a_dtype, granularity="row" if per_row else "tensor")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), dtype=b_dtype, granularity="row" if per_row else "tensor")
    scale_b = scale_w.t() if per_row else scale_w
    return a, w.t(), scale_a, scale_b  # b = w.t(): a Linear weight's layout


def _check(a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32):
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b, bias=bias)
    assert relative_error(out, exact) <= TOLERANCE[out_dtype]
    return out


@pytest.mark.parametrize("m, k, n", [(m, k, n) for m, k, n in itertools.product(ODD_SIZES, ODD_SIZES, ODD_SIZES)
                                     if m * k * n <= 17 * 1025 * 1025])
def test_odd_shapes(m, k, n, cpu_variant):
    _check(*_operands(m, k, n))


@pytest.mark.parametrize("m", [10, 16, 41, 48, 60, 64])
@pytest.mark.parametrize("k", [1, 63, 64, 65, 129, 256, 1025])
@pytest.mark.parametrize("n", [1, 15, 17, 33])
def test_skinny_kernel_tails(m, k, n, cpu_variant):
    # 10..64 rows take the skinny kernel (with AVX512-BF16): N in blocks of 16; 1-2 groups of
    # 16 rows each in turn over K in steps of 64, 3-4 groups (41, 48, 60, 64) all per step of
    # 128 k (K <= 64, 129, 1025: a last step of 64 k); 10, 41, 60: a last group of 10, 9 and
    # 12 rows (9 and 16q + 1..8 rows run their last rows apart, test_tail_rows_run_apart)
    _check(*_operands(m, k, n))


@pytest.mark.parametrize("m", [5, 6, 7, 8])
@pytest.mark.parametrize("k", [1, 63, 64, 65, 129, 1025])
@pytest.mark.parametrize("n", [1, 15, 17, 33])
def test_eight_row_kernel_tails(m, k, n, cpu_variant):
    # 5..8 rows take the eight-row kernel (with AVX512-BF16): rows padded to 8, two k-pairs
    # per lane pair, N in blocks of 16, K in steps of 64 (K-blocked: per 128)
    _check(*_operands(m, k, n))
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block")
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5


@pytest.mark.parametrize("m", [100, 400])
@pytest.mark.parametrize("k", [2048, 2049])
def test_tile_kernel_panel_and_chunk_bounds(m, k, cpu_variant):
    # the AVX512-BF16 tile kernel widens all of K into one panel up to K = 2048 (padded to 64)
    # and 256 k at a time beyond; 400 rows: more than one chunk of rows on one thread
    _check(*_operands(m, k, 70))
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(70, k), granularity="block")
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5


def _tail_operands(m, k, n, scheme, strided):
    """a, b, scale_a, scale_b of one scheme; strided: a (and a per-row scale_a) every other
    row of a larger tensor."""
    x = torch.randn(2 * m if strided else m, k)
    pick = (lambda t: t[::2]) if strided else (lambda t: t)
    if scheme == "weight_only":
        w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k))
        return pick(x.to(torch.bfloat16)), w.t(), torch.ones(()), scale_w
    if scheme in ("block", "ue8m0"):
        fmt = {"scale_fmt": "ue8m0"} if scheme == "ue8m0" else {}
        a, scale_a = fp8linear.quantize_fp8(x, granularity="group", **fmt)
        w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block", **fmt)
        return pick(a), w.t(), pick(scale_a), scale_w.t()
    per_row = scheme == "row"
    a, scale_a = fp8linear.quantize_fp8(x, granularity="row" if per_row else "tensor")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="row" if per_row else "tensor")
    return pick(a), w.t(), pick(scale_a) if per_row else scale_a, scale_w.t() if per_row else scale_w


FMA_VARIANT = "avx512_fma" in fp8linear.ops.native().cpu_variants_supported()


@pytest.mark.skipif(not FMA_VARIANT, reason="the avx512_fma variant needs AVX512-BF16 and VBMI")
@pytest.mark.parametrize("m", [10, 16, 17, 32, 48, 64, 80, 96, 112, 144, 200, 400])
@pytest.mark.parametrize("k", [1, 64, 127, 128, 129, 300, 1025])
@pytest.mark.parametrize("scheme", ["tensor", "row", "block", "ue8m0", "weight_only"])
def test_fma_tile_kernel(m, k, scheme):
    # the avx512_fma variant's float32 FMA tile kernel (M >= 10): register tiles of 1, 2, 3
    # and 4 groups of 16 rows (10, 16: one group; 80: 3 + 2; 112: 3 + 4), chunks of up
    # to 192 rows (200, 400), panels of 128 k (partial ones at K's end) and of 64 weight
    # rows (N = 70: a partial one); 1 and 2 threads give the same bits
    a, b, scale_a, scale_b = _tail_operands(m, k, 70, scheme, strided=False)
    with forced_cpu_variant("avx512_fma"):
        assert fp8linear.ops.native().cpu_scaled_mm_plan(a, b, scale_a, scale_b)[0] == "fma_tile"
        single, double = scaled_mm_on_1_and_2_threads(a, b, scale_a, scale_b)
    assert torch.equal(single, double)
    assert relative_error(single, reference.scaled_mm_float64(a, b, scale_a, scale_b)) <= 1e-5


@pytest.mark.skipif(not FMA_VARIANT, reason="the avx512_fma variant needs AVX512-BF16 and VBMI")
@pytest.mark.parametrize("m", [1, 4, 5, 8, 9, 10, 17])
def test_fma_variant_keeps_the_bf16_kernels_up_to_9_rows(m):
    # (M = 9 runs as 8 + 1 rows on the eight-row and dot kernels, test_tail_rows_run_apart)
    a, b, scale_a, scale_b = _operands(m, 300, 70)
    with forced_cpu_variant("avx512_fma"):
        expected = "bf16_dot" if m <= 4 else bf16_gemm_kernel(m, 70) if m <= 9 else "fma_tile"
        assert fp8linear.ops.native().cpu_scaled_mm_plan(a, b, scale_a, scale_b)[0] == expected
        _check(a, b, scale_a, scale_b)


def _assert_parts_as_alone(out, parts, a, b, scale_a, scale_b, bias=None):
    """out (float32, from one call) holds, for each (begin, end) in parts, bit for bit what a
    call of rows [begin, end) alone gives (a per-row scale_a sliced with them)."""
    m = a.shape[0]
    for begin, end in parts:
        rows_scale_a = scale_a[begin:end] if scale_a.dim() > 0 and scale_a.shape[0] == m else scale_a
        part = fp8linear.scaled_mm(a[begin:end], b, rows_scale_a, scale_b, bias=bias, out_dtype=torch.float32)
        assert torch.equal(out[begin:end], part), (begin, end)


# 16q + r, 8 + 1 (56: 48 + 8, three groups per step and the eight-row kernel); 25: r = 9 stays in the padded group
@pytest.mark.parametrize("m", [9, 17, 24, 56, 65, 72, 129, 264, 25])
@pytest.mark.parametrize("scheme", ["tensor", "row", "block", "ue8m0", "weight_only"])
@pytest.mark.parametrize("strided", [False, True])
def test_tail_rows_run_apart(m, scheme, strided, cpu_variant):
    # On AVX512-BF16 the skinny and tile kernels work on groups of 16 rows; M = 16q + r
    # with r <= 8 runs its last r rows as a call of their own (the dot or eight-row
    # kernel), and M = 9 runs 8 + 1: each part's rows, scales and output found at the right
    # offsets
    k, n = 300, 70
    a, b, scale_a, scale_b = _tail_operands(m, k, n, scheme, strided)
    assert a.is_contiguous() != strided
    bias = torch.randn(n)
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b, bias=bias)  # (weight-only: scale_a is 1)
    assert relative_error(out, exact) <= 1e-5
    main = 8 if m == 9 else m // 16 * 16
    whole_plan = fp8linear.ops.native().cpu_scaled_mm_plan(a, b, scale_a, scale_b)[0]
    if whole_plan not in ("bf16_skinny", "bf16_tile", "fma_tile") or m - main > 8:
        return
    # the split: each part is exactly that part's rows called alone
    _assert_parts_as_alone(out, ((0, main), (main, m)), a, b, scale_a, scale_b, bias=bias)
    for out_dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype),
                           out.to(out_dtype))


@pytest.mark.parametrize("m", [48, 60, 64])
@pytest.mark.parametrize("scheme", ["tensor", "row", "block", "ue8m0", "weight_only"])
@pytest.mark.parametrize("strided", [False, True])
def test_skinny_groups_sum_as_each_group_alone(m, scheme, strided, cpu_variant):
    # On AVX512-BF16, 3-4 groups of 16 rows share each step of K (skinny_groups) where a call
    # of one group runs over all of K on its own (skinny_columns): the same sums in the same
    # order, so each group's rows come out bit for bit as when called alone (N = 40: one
    # tile of 64 columns, which at 64 rows keeps the skinny kernel on more than one thread)
    if cpu_variant != "avx512_bf16":
        pytest.skip("the skinny kernels are the avx512_bf16 variant's (others may sum a row group apart otherwise)")
    a, b, scale_a, scale_b = _tail_operands(m, 300, 40, scheme, strided)
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    _assert_parts_as_alone(out, [(begin, min(begin + 16, m)) for begin in range(0, m, 16)], a, b, scale_a, scale_b)


@pytest.mark.parametrize("m", [57, 60, 64])
@pytest.mark.parametrize("n", [17, 192, 576])
@pytest.mark.parametrize("k", [300, 2500])
@pytest.mark.parametrize("scheme", ["tensor", "row", "block", "ue8m0", "weight_only"])
def test_skinny_or_tile_kernel_at_64_rows(m, n, k, scheme, cpu_variant):
    # On AVX512-BF16 M = 57-64 (four groups of 16 rows; 49-56 run as 48 + their last rows)
    # runs the tile kernel's 4 x 16-row by 6-column register tiles where its 64-column
    # tiles share out evenly among the threads (one thread: always; two: 576 columns, nine
    # tiles, but not 17 or 192), else the skinny kernel; both sum each output in the same
    # order, so the bits are the same either way. K = 2500: the tile kernel's 256-k panels
    # (the last one ending inside K) and its prefetch of the panels ahead across K blocks
    # and column panels.
    a, b, scale_a, scale_b = _tail_operands(m, k, n, scheme, strided=False)
    outs, kernels = [], set()
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            kernel = fp8linear.ops.native().cpu_scaled_mm_plan(a, b, scale_a, scale_b)[0]
            if cpu_variant == "avx512_bf16":
                assert kernel == bf16_gemm_kernel(m, n, threads)
                kernels.add(kernel)
            outs.append(fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32))
    finally:
        torch.set_num_threads(previous)
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b)  # (weight-only: scale_a is 1)
    assert relative_error(outs[0], exact) <= 1e-5
    assert torch.equal(outs[0], outs[1])
    if cpu_variant == "avx512_bf16":
        assert kernels == ({"bf16_tile"} if n == 576 else {"bf16_tile", "bf16_skinny"})


@pytest.mark.parametrize("m", [1, 2, 4, 8, 13, 16, 33, 256, 777])  # dot | eight-row | skinny (<= 64) | tile; 777: row chunks
@pytest.mark.parametrize("k, n", [(4097, 3), (96, 4097), (576, 1536), (7000, 9)])
def test_decode_and_prefill_sizes(m, k, n, cpu_variant):
    _check(*_operands(m, k, n), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("a_dtype, b_dtype", list(itertools.product(FP8_DTYPES, FP8_DTYPES)))
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("m", [13, 19, 70])  # the skinny kernel (one group, two) and the tile kernel
def test_formats_dtypes_and_scales(a_dtype, b_dtype, out_dtype, per_row, m, cpu_variant):
    _check(*_operands(m, 130, 37, a_dtype, b_dtype, per_row), out_dtype=out_dtype)


@pytest.mark.parametrize("bias_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m", [3, 5, 13, 70])  # the dot, eight-row, skinny and tile kernels
def test_bias(bias_dtype, out_dtype, m, cpu_variant):
    bias = torch.randn(37).to(bias_dtype)
    _check(*_operands(m, 64, 37), bias=bias, out_dtype=out_dtype)


@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 33, 65, 100, 513])  # dot, skinny/stream, tile/full-K; odd row groups
@pytest.mark.parametrize("k, n", [(64, 70), (576, 45), (2100, 33)])  # partial column groups; the AMX panel kernel
@pytest.mark.parametrize("scheme", ["tensor", "row", "block"])
def test_16bit_outputs_are_the_float32_result_rounded_once(m, k, n, scheme, cpu_variant):
    # every element, not a matrix norm: the 16-bit epilogues (scaled, biased and rounded
    # by column, then transposed as 16-bit values) must give exactly the float32 path's
    # values rounded once, so a misplaced, swapped or unwritten element fails
    if scheme == "block":
        a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
        w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block")
        b, scale_b = w.t(), scale_w.t()
    else:
        a, b, scale_a, scale_b = _operands(m, k, n, per_row=scheme == "row")
    bias = torch.randn(n).to(torch.bfloat16)
    full = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=torch.float32)
    for out_dtype in (torch.bfloat16, torch.float16):
        out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
        assert torch.equal(out, full.to(out_dtype)), (out_dtype, (out != full.to(out_dtype)).nonzero()[:5].tolist())


def test_any_strides(cpu_variant):
    a, b, scale_a, scale_b = _operands(20, 70, 30)
    big_a = torch.zeros(40, 140, dtype=a.dtype)
    big_a[::2, ::2] = a
    strided_a = big_a[::2, ::2]
    row_major_b = b.contiguous()  # [K, N] row-major rather than w.t()
    expanded_scale = torch.full((1, 1), scale_a.item()).expand(20, 1)
    for a_, b_, sa in [(strided_a, b, scale_a), (a, row_major_b, scale_a), (a.t().contiguous().t(), b, scale_a),
                       (strided_a, row_major_b[:, :], expanded_scale)]:
        _check(a_, b_, sa, scale_b)


@pytest.mark.parametrize("m, k, n", [(0, 5, 7), (4, 5, 0), (0, 0, 0), (4, 0, 7)])
def test_empty_and_k_zero(m, k, n):
    a = torch.zeros(m, k).to(torch.float8_e4m3fn)
    b = torch.zeros(k, n).to(torch.float8_e4m3fn)
    one = torch.ones(())
    out = fp8linear.scaled_mm(a, b, one, one, out_dtype=torch.float32)
    assert out.shape == (m, n) and torch.all(out == 0)
    bias = torch.randn(n)
    out = fp8linear.scaled_mm(a, b, one, one, bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(m, n))


@pytest.mark.parametrize("scale", [1e30, 1e-30, float(torch.finfo(torch.float32).max)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_k_zero_is_exactly_the_bias_whatever_the_scales(scale, with_bias):
    # an empty sum is zero: 0 * scale must not turn a huge scale into anything but the bias
    a = torch.zeros(4, 0).to(torch.float8_e4m3fn)
    b = torch.zeros(0, 7).to(torch.float8_e4m3fn)
    bias = torch.randn(7) if with_bias else None
    for scale_a, scale_b in [(torch.tensor(scale), torch.ones(())), (torch.ones(4, 1), torch.full((1, 7), scale))]:
        out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=torch.float32)
        expected = bias.expand(4, 7) if with_bias else torch.zeros(4, 7)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, -1.0])
@pytest.mark.parametrize("k", [0, 5])
def test_non_positive_or_non_finite_cpu_scales_are_refused(bad, k):
    # a CPU scale costs nothing to read: a 0, negative, inf or NaN one is an error, not NaN outputs
    a = torch.zeros(3, k).to(torch.float8_e4m3fn)
    b = torch.zeros(k, 6).to(torch.float8_e4m3fn)
    one = torch.ones(())
    per_row = torch.ones(3, 1)
    per_row[2, 0] = bad
    per_col = torch.ones(1, 6)
    per_col[0, 4] = bad
    cases = [("scale_a", torch.tensor(bad), one), ("scale_a", per_row, one),
             ("scale_b", one, torch.tensor(bad)), ("scale_b", one, per_col)]
    for name, scale_a, scale_b in cases:
        with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
            fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        fp8linear.quantize_fp8(x, torch.tensor(bad))
    row_scale = torch.ones(3, 1)
    row_scale[1, 0] = bad
    with pytest.raises(ValueError, match="scale must be finite and > 0.*index 1"):
        fp8linear.quantize_fp8(x, row_scale, granularity="row")


def test_nan_and_extremes_propagate(cpu_variant):
    a, b, scale_a, scale_b = _operands(3, 40, 5)
    a = a.clone()
    a.view(torch.uint8)[1, 7] = 0x7F  # NaN in row 1
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


@pytest.mark.parametrize("m", [3, 7, 10, 40, 90])  # the dot (M <= 4), eight-row, skinny (10..64) and tile kernels
# (K mod 64 = 13, 36, 32: rows widened 64 k at a time, the last ones partly)
@pytest.mark.parametrize("k", [77, 100, 96])
@pytest.mark.parametrize("strided", [False, True])
def test_weight_only_float_activations(m, k, strided, cpu_variant):
    x = torch.randn(k, m).t() if strided else torch.randn(m, k)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(33, k))
    for dtype in FLOAT_DTYPES:
        xd = x.to(dtype) if not strided else x.t().to(dtype).t()
        assert xd.is_contiguous() != strided
        out = fp8linear.scaled_mm(xd, w.t(), torch.ones(()), scale_w, out_dtype=dtype)
        exact = xd.double() @ (w.double() * scale_w.double()).t()
        assert relative_error(out, exact) <= TOLERANCE[dtype]


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_scaled_mm(per_row, out_dtype):
    a, b, scale_a, scale_b = _operands(17, 128, 48, per_row=per_row)
    ours = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
    theirs = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b)
    assert relative_error(theirs, exact) <= TOLERANCE[out_dtype]  # torch agrees with the reference
    assert relative_error(ours, theirs.double()) <= TOLERANCE[out_dtype]


def test_reference_float32_matches_float64():
    a, b, scale_a, scale_b = _operands(7, 300, 11, per_row=True)
    out = reference.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, b, scale_a, scale_b)) <= 1e-6


F8 = torch.float8_e4m3fn


def _fp8(*shape):
    return torch.zeros(shape).to(F8)


ONE = torch.ones(())


@pytest.mark.parametrize(
    "args, message",
    [
        ((_fp8(2, 3, 4), _fp8(4, 5), ONE, ONE), "a must be 2-D"),
        ((_fp8(2, 4), _fp8(4), ONE, ONE), "b must be 2-D"),
        ((_fp8(2, 4), _fp8(5, 3), ONE, ONE), "must share K"),
        ((torch.zeros(2, 4, dtype=torch.int8), _fp8(4, 3), ONE, ONE), "a must be torch.float8"),
        ((_fp8(2, 4), torch.zeros(4, 3), ONE, ONE), "b must be torch.float8"),
        ((_fp8(2, 4), _fp8(4, 3), ONE.double(), ONE), "scale_a must be torch.float32"),
        ((_fp8(2, 4), _fp8(4, 3), ONE, torch.ones(3)), r"scale_b must have shape \(\) \(per tensor\), \[1, N\] = \[1, 3\] \(per column\)"),
        ((_fp8(2, 4), _fp8(4, 3), torch.ones(3, 1), ONE), r"scale_a must have shape \(\) \(per tensor\), \[M, 1\] = \[2, 1\] \(per row\)"),
    ],
)
def test_bad_arguments_raise_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        fp8linear.scaled_mm(*args)


def test_bad_bias_and_out_dtype():
    a, b = _fp8(2, 4), _fp8(4, 3)
    with pytest.raises(ValueError, match=r"bias must have shape \[N\] = \[3\]"):
        fp8linear.scaled_mm(a, b, ONE, ONE, bias=torch.zeros(4))
    with pytest.raises(ValueError, match="bias must be torch.float32"):
        fp8linear.scaled_mm(a, b, ONE, ONE, bias=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="out_dtype must be"):
        fp8linear.scaled_mm(a, b, ONE, ONE, out_dtype=torch.int32)


# opcheck's test_schema compares inputs before and after the call with arithmetic
# that torch does not implement for fp8 on the CPU, so scaled_mm (whose b is always
# fp8) runs the other three checks.
OPCHECK_FP8_TESTS = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")


def test_opcheck():
    op = torch.ops.fp8linear.scaled_mm.default
    a, b, scale_a, scale_b = _operands(5, 40, 7, per_row=True)
    torch.library.opcheck(op, (a, b, scale_a, scale_b, torch.randn(7), torch.bfloat16), test_utils=OPCHECK_FP8_TESTS)
    a, b, scale_a, scale_b = _operands(3, 16, 9)
    torch.library.opcheck(op, (a, b, scale_a, scale_b, None, torch.float32), test_utils=OPCHECK_FP8_TESTS)
    torch.library.opcheck(op, (torch.randn(3, 16), b, torch.ones(()), scale_b, None, torch.float32),
                          test_utils=OPCHECK_FP8_TESTS)


@pytest.mark.parametrize("m", [1, 7, 13, 16, 50, 300, 800])
def test_thread_count_does_not_change_results(m):
    # work is split over torch's intra-op pool; each output is computed by one thread in
    # a fixed order, so 1 and 2 threads must agree bit for bit
    a, b, scale_a, scale_b = _operands(m, 700, 130)
    x = torch.randn(m, 700)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = (fp8linear.scaled_mm(a, b, scale_a, scale_b), fp8linear.quantize_fp8(x))
        torch.set_num_threads(2)
        double = (fp8linear.scaled_mm(a, b, scale_a, scale_b), fp8linear.quantize_fp8(x))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(single[0], double[0])
    assert torch.equal(single[1][0].view(torch.uint8), double[1][0].view(torch.uint8))
    assert torch.equal(single[1][1], double[1][1])
