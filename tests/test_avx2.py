"""The avx2 variant's kernels (csrc/cpu/gemm_avx2.c) at their boundaries, on any CPU with
AVX2: the dot kernel (M <= 16; rows in blocks of 4, K in steps of 32) and the panel
kernel (M > 16; panels of 256 k x 16 weight rows, blocks of 6 rows, tiles of 256 rows),
the float16 route of the widening (every code, NaN, subnormals with denormals flushed),
the factor 256 carried by fp8 activations or multiplied back for float ones."""
import itertools

import pytest
import torch

import fp8linear
from fp8linear import reference
from fp8linear._native import native
from conftest import FLOAT_DTYPES, FP8_DTYPES, forced, forced_cpu_variant, relative_error

pytestmark = pytest.mark.skipif("avx2" not in native().cpu_variants_supported(), reason="needs AVX2")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DOT_ROWS = [1, 2, 3, 4, 5, 16]  # row blocks of 4 with 1-3 row tails; 16 the last dot size
PANEL_ROWS = [17, 23, 40, 257]  # blocks of 6 with tails; 257: two tiles of rows


@pytest.fixture(autouse=True)
def _avx2():
    with forced_cpu_variant("avx2"):
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


@pytest.mark.parametrize("m", [1, 40])
@pytest.mark.parametrize("fmt", FP8_DTYPES)
@pytest.mark.parametrize("flush", [False, True])
def test_subnormal_weights_with_denormals_flushed(m, fmt, flush):
    # weights of subnormal codes only: a widening that formed float32 subnormals would
    # lose them all when the FPU flushes denormals
    mantissa_bits = 3 if fmt == torch.float8_e4m3fn else 2
    subnormal = [code | sign for code in range(1, 1 << mantissa_bits) for sign in (0, 0x80)]
    codes = torch.tensor(subnormal * 50, dtype=torch.uint8)
    w = torch.stack([codes[torch.randperm(codes.numel())] for _ in range(19)]).view(fmt)
    a = torch.randn(m, codes.numel()).bfloat16()
    one = torch.ones(())
    assert torch.set_flush_denormal(flush) or not flush  # True: the CPU flushes from here on
    try:
        out = fp8linear.scaled_mm(a, w.t(), one, one, out_dtype=torch.float32)
    finally:
        torch.set_flush_denormal(False)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), one, one)) <= 1e-6


@pytest.mark.parametrize("m", [1, 6, 20, 40])
@pytest.mark.parametrize("k", [300, 600])  # 600: panels of 256 k, blocks of 128 across them
def test_block_wise_scales(m, k):
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(140, k), granularity="block")
    scale_w = scale_w.clone()
    scale_w[:, 1] *= 2.0**10  # a kernel applying one scale to all of K is far off
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


def test_weight_only_layer_with_bf16_activations():
    layer = fp8linear.FP8Linear.from_linear(torch.nn.Linear(300, 70), activations="none")
    for m in (1, 30):
        x = torch.randn(m, 300, dtype=torch.bfloat16)
        out = layer(x)
        exact = reference.scaled_mm_float64(x, layer.weight.t(), torch.ones(()), layer.weight_scale,
                                            bias=layer.bias)
        assert relative_error(out, exact) <= 1e-2
