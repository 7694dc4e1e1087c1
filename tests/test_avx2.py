"""The AVX2 kernels (csrc/cpu/gemm_avx2.c, gemm_avx2_panel.c) at their boundaries, on any CPU
with AVX2, under the avx2 variant and (where the CPU has AVX-512) the avx512 one, which runs
the same kernels: the dot kernel (rows in blocks of 4, K in steps of 32 and blocks of 128; M <= 20 for
e4m3fn weights against fp8 activations, M <= 16 otherwise) and the panel kernel (above;
panels of 256 k x 16 weight rows, blocks of 6 rows, tiles of 256 rows); both routes of the
widening (every code, NaN, subnormals with denormals flushed): the float32 route with its factors 2^100 and 2^20 and its NaN rows,
the float16 route with its factor 256 multiplied back."""
import itertools

import pytest
import torch

import fp8linear
from fp8linear import reference
from fp8linear._native import native
from conftest import FLOAT_DTYPES, FP8_DTYPES, forced, forced_cpu_variant, relative_error

pytestmark = pytest.mark.skipif("avx2" not in native().cpu_variants_supported(), reason="needs AVX2")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DOT_ROWS = [1, 2, 3, 4, 5, 16, 20]  # row blocks of 4 with 1-3 row tails; 16 and 20 the last dot sizes
PANEL_ROWS = [17, 21, 23, 40, 257]  # blocks of 6 with tails (e4m3fn against fp8 from 21); 257: two tiles of rows


AVX2_KERNEL_VARIANTS = [v for v in ("avx2", "avx512") if v in native().cpu_variants_supported()]


@pytest.fixture(autouse=True, params=AVX2_KERNEL_VARIANTS)
def _avx2(request):
    with forced_cpu_variant(request.param):
        yield


def _activations(m, k, kind, fmt):
    x = torch.randn(m, k)
    if kind == "fp8":
        return fp8linear.quantize_fp8(x, dtype=fmt, granularity="row")
    return x.to(kind), torch.ones(())


@pytest.mark.parametrize("m", DOT_ROWS + PANEL_ROWS)
@pytest.mark.parametrize("k, n", [(1, 3), (31, 17), (33, 1), (255, 15), (257, 33), (600, 40)])
@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_shapes_against_the_reference(m, k, n, fmt):
    a, scale_a = _activations(m, k, "fp8", fmt)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), dtype=fmt, granularity="row")
    bias = torch.randn(n)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), bias=bias, out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t(), bias=bias)
    assert relative_error(out, exact) <= 1e-5


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_activation_kinds_and_outputs(m, kind, out_dtype, fmt):
    # fp8 activations carry e4m3fn weights' factor 256; float ones have it multiplied back
    k, n = 300, 37  # 37: two full panels of 16 columns and a tail of 5
    a, scale_a = _activations(m, k, kind, fmt)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), dtype=fmt)
    bias = torch.randn(n).to(out_dtype)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w, bias=bias, out_dtype=out_dtype)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w, bias=bias)
    assert relative_error(out, exact) <= TOLERANCE[out_dtype]
    # 16-bit outputs: the float32 result rounded once
    if out_dtype != torch.float32:
        wide = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w, bias=bias, out_dtype=torch.float32)
        assert torch.equal(out, wide.to(out_dtype))


def _every_code(fmt, k, rows):
    codes = torch.arange(256, dtype=torch.uint8).repeat(-(-k // 256))[:k]
    return torch.stack([codes[torch.randperm(k)] for _ in range(rows)]).view(fmt)


@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16])
@pytest.mark.parametrize("fmt", FP8_DTYPES)
def test_every_weight_code_and_nan(m, kind, fmt):
    w = _every_code(fmt, 700, 21)
    a, scale_a = _activations(m, 700, kind, fmt)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, torch.ones(()), out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, torch.ones(()))
    assert torch.equal(out.isnan(), exact.isnan()) and out.isnan().all()  # each row holds NaN codes
    finite = w.float().isfinite()
    w_finite = torch.where(finite, w.view(torch.uint8), torch.zeros((), dtype=torch.uint8)).view(fmt)
    out = fp8linear.scaled_mm(a, w_finite.t(), scale_a, torch.ones(()), out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w_finite.t(), scale_a, torch.ones(()))) <= 1e-6


@pytest.mark.parametrize("m", [1, 3, 40])
@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16])
@pytest.mark.parametrize("fmt", FP8_DTYPES)
@pytest.mark.parametrize("flush", [False, True])
def test_subnormal_weights_with_denormals_flushed(m, kind, fmt, flush):
    # weights of subnormal codes only: the dot kernel's float32 route (e4m3fn weights, fp8
    # activations) widens them to float32 denormals, which it must keep when torch flushes
    # denormals (it clears DAZ while it runs); the float16 route never forms one
    mantissa_bits = 3 if fmt == torch.float8_e4m3fn else 2
    subnormal = [code | sign for code in range(1, 1 << mantissa_bits) for sign in (0, 0x80)]
    codes = torch.tensor(subnormal * 50, dtype=torch.uint8)
    w = torch.stack([codes[torch.randperm(codes.numel())] for _ in range(19)]).view(fmt)
    a, scale_a = _activations(m, codes.numel(), kind, fmt)
    one = torch.ones(())
    assert torch.set_flush_denormal(flush) or not flush  # True: the CPU flushes from here on
    try:
        out = fp8linear.scaled_mm(a, w.t(), scale_a, one, out_dtype=torch.float32)
        # DAZ restored: a denormal input (2^-149) still reads as zero after the call
        smallest_denormal = torch.tensor([1], dtype=torch.int32).view(torch.float32)
        flushed_after = (smallest_denormal * 2.0**40).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert flushed_after or not flush  # the kernel restored the thread's MXCSR
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, one)) <= 1e-6


@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("k", [31, 64, 300])
@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16])
def test_nan_codes_in_some_weight_rows(m, k, kind):
    # the float32 route widens NaN codes to finite values and makes the outputs of the
    # weight rows that hold one NaN afterwards: only those, wherever the code sits (first
    # k, last k of a 32-k tail, a row between clean ones)
    fmt = torch.float8_e4m3fn
    w, scale_w = fp8linear.quantize_fp8(torch.randn(23, k), dtype=fmt, granularity="row")
    codes = w.view(torch.uint8).clone()
    for row, column, code in [(0, 0, 0x7F), (5, k - 1, 0xFF), (6, k // 2, 0x7F), (22, k - 1, 0x7F)]:
        codes[row, column] = code
    w = codes.view(fmt)
    a, scale_a = _activations(m, k, kind, fmt)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())
    nan_columns = torch.zeros(23, dtype=torch.bool)
    nan_columns[[0, 5, 6, 22]] = True
    assert torch.equal(exact.isnan(), nan_columns.expand(m, 23))
    assert torch.equal(out.isnan(), exact.isnan())
    assert relative_error(out[:, ~nan_columns], exact[:, ~nan_columns]) <= 1e-5


@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("blocked", [False, True])
def test_weight_chunks(m, blocked):
    # K = 4096: the dot kernel walks 64 weight rows (256 KiB) at a time against all rows;
    # 130 rows = two whole chunks and a partial one of 2 (a remainder of its 4-row groups)
    k, n = 4096, 130
    granularity = ("group", "block") if blocked else ("row", "row")
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity=granularity[0])
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity=granularity[1])
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5
    assert relative_error(out[:, 128:], reference.scaled_mm_float64(a, w[128:].t(), scale_a,
                                                                    scale_w[1:].t() if blocked else scale_w[128:].t())) <= 1e-5


@pytest.mark.parametrize("m", [3, 40])  # the dot kernel's float32 route; the panel kernel
def test_block_scales_far_below_one(m):
    # the float32 route's block sums carry 2^-20 until folded: tiny scales (a checkpoint's)
    # must not push the scaled sums into float32's denormals
    k, n = 256, 40
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block")
    scale_a, scale_w = torch.full_like(scale_a, 2.0**-70), torch.full_like(scale_w, 2.0**-70)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())
    # the largest results near 2^-120, normal floats; a block sum still carrying 2^-20 when
    # scaled would be near 2^-140, a denormal with ~9 bits left
    assert 2.0**-126 < exact.abs().max() < 2.0**-115
    assert relative_error(out, exact) <= 1e-5


@pytest.mark.parametrize("m", [1, 4, 20, 40])  # 40: the panel kernel's float16 route
@pytest.mark.parametrize("activation_fmt", FP8_DTYPES)
@pytest.mark.parametrize("magnitude", ["smallest", "largest"])
def test_extreme_products(m, activation_fmt, magnitude):
    # every product at the fp8 formats' ends: the float32 route's factors (activations
    # times 2^100, weights times 2^-120, sums times 2^20) keep the smallest products
    # (2^-16 * 2^-9 = 2^-25 with e5m2 activations) clear of denormals and the largest
    # (57344 * 448) clear of overflow
    k = 300
    smallest = {torch.float8_e4m3fn: 0x01, torch.float8_e5m2: 0x01}
    largest = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}
    def codes(fmt, rows):
        code = smallest[fmt] if magnitude == "smallest" else largest[fmt]
        signs = torch.randint(0, 2, (rows, k), dtype=torch.uint8) * 0x80
        return (signs | code).view(fmt)
    a, w = codes(activation_fmt, m), codes(torch.float8_e4m3fn, 21)
    one = torch.ones(())
    out = fp8linear.scaled_mm(a, w.t(), one, one, out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, w.t(), one, one)
    assert out.isfinite().all() and (exact != 0).any()
    assert relative_error(out, exact) <= 1e-6


# m = 1, 2, 3, 4 (6 and 7 end in 2 and 3) rows per dot block; N = 141 leaves a last
# column for each block of rows, so every dot block shape runs block-wise
@pytest.mark.parametrize("m", [1, 3, 6, 7, 20, 40, 257])
@pytest.mark.parametrize("k", [300, 400, 600])  # 400: a last panel of two blocks, the second partial; 600: blocks across panels
@pytest.mark.parametrize("fmt", FP8_DTYPES)  # the panel kernel at M = 40 and 257 (and e5m2 at 20)
def test_block_wise_scales(m, k, fmt):
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group", dtype=fmt)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(141, k), granularity="block", dtype=fmt)
    scale_w, scale_a = scale_w.clone(), scale_a.clone()
    scale_w[:, 1] *= 2.0**10  # a kernel applying one scale to all of K is far off
    # one row's scale of one block, another's of the last (partial) block: a kernel that
    # takes a row's or a block's scale from its neighbour is far off (257 rows: the
    # second tile of rows starts at 256)
    scale_a[m // 2, 1] *= 2.0**8
    scale_a[m - 1, -1] *= 2.0**-6
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())
    assert relative_error(out, exact) <= 1e-5


@pytest.mark.parametrize("m", [1, 9, 40, 300])
def test_threads_do_not_change_any_output(m):
    # each output is summed by one thread in a fixed order, however the tiles are shared
    a, scale_a = _activations(m, 333, "fp8", torch.float8_e4m3fn)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(200, 333))
    results = []
    for threads in (1, 2):
        with forced(torch.get_num_threads, torch.set_num_threads, threads):
            results.append(fp8linear.scaled_mm(a, w.t(), scale_a, scale_w, out_dtype=torch.float32))
    assert torch.equal(results[0], results[1])
    assert relative_error(results[0], reference.scaled_mm_float64(a, w.t(), scale_a, scale_w)) <= 1e-5


@pytest.mark.parametrize("weights", ["channel", "block"])
def test_weight_only_layer_with_bf16_activations(weights):
    # float activations: the float16 route (dot kernel up to 16 rows, panel kernel above)
    layer = fp8linear.FP8Linear.from_linear(torch.nn.Linear(300, 170), activations="none", weight_granularity=weights)
    for m in (1, 30):
        x = torch.randn(m, 300, dtype=torch.bfloat16)
        out = layer(x)
        exact = reference.scaled_mm_float64(x, layer.weight.t(), torch.ones(()), layer.weight_scale.t(),
                                            bias=layer.bias)
        assert relative_error(out, exact) <= 1e-2


@pytest.mark.skipif("avx512" not in AVX2_KERNEL_VARIANTS, reason="needs AVX-512")
@pytest.mark.parametrize("m", [17, 23, 24, 25, 40, 257])  # blocks of 12 rows (AVX-512) and 6 (AVX2), with tails
@pytest.mark.parametrize("scheme", ["tensor", "block", "float"])
def test_avx512_panel_blocks_give_the_avx2_bits(m, scheme):
    # the avx512 variant's panel kernel takes 12 rows per block in zmm registers, the avx2
    # variant's 6 in ymm pairs: each output is the same float32 chain, so the same bits
    k, n = 600, 150  # two blocks of 128 weight rows, the second partial
    if scheme == "float":  # weight-only: float32 activations, e5m2 weights (the float16 route)
        a, scale_a = torch.randn(m, k), torch.ones(())
        w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), dtype=torch.float8_e5m2, granularity="row")
    else:
        granularity = ("group", "block") if scheme == "block" else ("tensor", "tensor")
        a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity=granularity[0])
        w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity=granularity[1])
    outputs = []
    for variant in ("avx2", "avx512"):
        with forced_cpu_variant(variant):
            outputs.append(fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32))
    assert torch.equal(outputs[0], outputs[1])
    assert relative_error(outputs[1], reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5
