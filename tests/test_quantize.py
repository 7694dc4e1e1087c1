"""quantize_fp8: bit-exact against fp8linear.reference, for every CPU variant."""
import pytest
import torch

import fp8linear
from fp8linear import reference
from conftest import FLOAT_DTYPES, FP8_DTYPES, assert_same_fp8

ODD_SHAPES = [(1,), (3,), (17,), (1025,), (4097,), (3, 17), (17, 1025), (2, 3, 33), (1, 1), (5, 1)]


def _data(shape, dtype):
    # a wide dynamic range so that subnormals, normals and saturation all occur
    x = torch.randn(shape) * torch.exp2(torch.randint(-24, 12, shape).float())
    return x.to(dtype)


def _assert_matches_reference(x, scale=None, dtype=torch.float8_e4m3fn, granularity="tensor"):
    q, s = fp8linear.quantize_fp8(x, scale, dtype=dtype, granularity=granularity)
    q_ref, s_ref = reference.quantize_fp8(x, scale, dtype=dtype, granularity=granularity)
    assert q.dtype == dtype and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert_same_fp8(q, q_ref)


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_dynamic_matches_reference(shape, x_dtype, dtype, granularity, cpu_variant):
    _assert_matches_reference(_data(shape, x_dtype), dtype=dtype, granularity=granularity)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", [None, 1.0, 0.37, 3e-5, 1234.5])
def test_every_bf16_value(dtype, scale, cpu_variant):
    # all 65536 bit patterns (NaN, inf, subnormals, -0 among them), shuffled so that each
    # kind lands in every lane of the vector loops
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    _assert_matches_reference(x, None if scale is None else torch.tensor(scale), dtype=dtype)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 31, 32, 33, 63, 64, 65, 127, 129, 4097])
def test_dynamic_scale_finds_the_largest_finite_value_anywhere(x_dtype, n, cpu_variant):
    # the amax pass: its main loop, its two accumulators and its tail, with an inf and a
    # NaN (larger bit patterns than any finite value) beside the largest finite one
    generator = torch.Generator().manual_seed(n)
    positions = range(n) if n <= 65 else torch.randint(0, n, (16,), generator=generator).tolist()
    for position in positions:
        x = (torch.rand(n, generator=generator) * 2 - 1).to(x_dtype)
        x[position] = -7.25 if position % 2 else 7.25
        if n > 2:
            x[(position + 1) % n] = float("inf")
            x[(position + 2) % n] = float("nan")
        _assert_matches_reference(x)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_every_fp16_value(dtype, cpu_variant):
    # all 65536 fp16 bit patterns, dynamic scale: the largest finite (65504) sets it
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    _assert_matches_reference(x, dtype=dtype)


def _scale_sweep():
    # powers of two on both sides of the table kernel's range (2^-84 .. 2^100), the values
    # just below them (mantissa all ones), the dynamic floors, and log-uniform scales
    powers = [2.0**e for e in (-100, -85, -84, -83, -17, -1, 0, 1, 99, 100, 101, 110)]
    below = [torch.nextafter(torch.tensor(p), torch.tensor(0.0)).item() for p in powers]
    floors = [1 / (448 * 512), 1 / (57344 * 512)]
    generator = torch.Generator().manual_seed(1)
    spread = torch.exp2(torch.empty(40).uniform_(-90, 105, generator=generator)).tolist()
    return powers + below + floors + spread


def _every_bf16_value():
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_every_bf16_value_over_many_scales(dtype, cpu_variant):
    # the bf16 table kernel (csrc/cpu/quantize_vbmi.c: avx512_bf16 and the AMX variants)
    # builds one code table per scale, from the scale's mantissa and exponent: every bf16
    # value against the reference over scales that vary both, and past the exponent range
    # it takes (outside, the division kernel runs)
    x = _every_bf16_value()
    for scale in _scale_sweep():
        _assert_matches_reference(x, torch.tensor(scale), dtype=dtype)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_bf16_rows_with_scales_of_their_own(dtype, cpu_variant):
    # per-row scales: a table per row (rows of 640 >= the 512 elements that pay for one),
    # each row a slice of all bf16 values (subnormal results, NaN, inf and zeros spread
    # over the 32-element steps), and the rows' scales alternate, so each row's table
    # replaces the previous row's
    scales = torch.tensor(_scale_sweep()).repeat(2)[:100]
    x = _every_bf16_value()[:100 * 640].reshape(100, 640)
    _assert_matches_reference(x, scales.reshape(-1, 1), dtype=dtype, granularity="row")
    # and groups of 128 (shorter than a table is worth: the division kernel)
    _assert_matches_reference(x, dtype=dtype, granularity="group")


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_bf16_groups_with_power_of_two_scales(dtype, cpu_variant):
    # rows whose group scales are all powers of two in the table's exponent range (scale_fmt
    # "ue8m0") share one code table on the VBMI variants, whatever their exponents; rows
    # with a scale past that range or not a power of two take the division kernel: every
    # bf16 value, in rows of 740 (a last group of 100, whose tail of 4 is divided)
    x = _every_bf16_value()[:88 * 740].reshape(88, 740)
    groups = -(-740 // 128)
    inside = [2.0**e for e in (-84, -83, -40, -17, -1, 0, 1, 7, 60, 99, 100)]
    scales = torch.tensor(inside).repeat(88 * groups)[:88 * groups].reshape(88, groups)
    scales[40:60, 2] = 2.0**-85  # past the range
    scales[60:80, 5] = 2.0**101
    scales[80:, 1] = 0.37  # not a power of two
    _assert_matches_reference(x, scales, dtype=dtype, granularity="group")
    q, s = fp8linear.quantize_fp8(x, dtype=dtype, granularity="group", scale_fmt="ue8m0")
    q_ref, s_ref = reference.quantize_fp8(x, dtype=dtype, granularity="group", scale_fmt="ue8m0")
    assert torch.equal(s, s_ref)
    assert_same_fp8(q, q_ref)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_static_scale_matches_reference(x_dtype, dtype, cpu_variant):
    x = _data((7, 300), x_dtype)
    _assert_matches_reference(x, torch.tensor(0.37), dtype=dtype)
    _assert_matches_reference(x, torch.rand(7, 1) + 0.01, dtype=dtype, granularity="row")


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_edge_values(x_dtype, dtype, cpu_variant):
    fmax = torch.finfo(dtype).max
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2**-9, 2**-10, 3 * 2**-10, 2**-16, 2**-17, fmax, -fmax,
                           fmax * 1.5, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0, -3.5])
    x = values.to(x_dtype).repeat(3)  # long enough to use the vector loop and its tail
    _assert_matches_reference(x, torch.ones(()), dtype=dtype)
    _assert_matches_reference(x, dtype=dtype)
    q, _ = fp8linear.quantize_fp8(x, torch.ones(()), dtype=dtype)
    assert torch.signbit(q[1].float())  # -0 keeps its sign
    assert q[12].float() == fmax and q[13].float() == -fmax  # inf saturates


def test_one_inf_does_not_zero_the_rest(cpu_variant):
    x = torch.randn(1000)
    x[10] = float("inf")
    q, scale = fp8linear.quantize_fp8(x)
    assert scale.item() == pytest.approx(x[torch.isfinite(x)].abs().max().item() / 448, rel=1e-6)
    assert (q.float()[torch.isfinite(x)] != 0).sum() > 900


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_all_zero_and_all_nan_get_the_floor(granularity, cpu_variant):
    floor = torch.tensor(1 / (448 * 512), dtype=torch.float64).float()
    for x in (torch.zeros(4, 33), torch.full((4, 33), float("nan"))):
        q, scale = fp8linear.quantize_fp8(x, granularity=granularity)
        assert torch.all(scale == floor)
        _assert_matches_reference(x, granularity=granularity)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
def test_non_contiguous_inputs(x_dtype, cpu_variant):
    base = _data((40, 66), x_dtype)
    for x in (base.t(), base[:, ::2], base[::3], base.reshape(4, 10, 66).permute(1, 0, 2), base[:, 5:40]):
        assert not x.is_contiguous()
        for granularity in ("tensor", "row"):
            _assert_matches_reference(x, granularity=granularity)


def test_expanded_input_with_zero_strides(cpu_variant):
    x = torch.randn(1, 33).expand(5, 33)
    _assert_matches_reference(x, granularity="row")


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (2, 0, 3)])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_empty_inputs(shape, granularity):
    x = torch.randn(shape)
    q, scale = fp8linear.quantize_fp8(x, granularity=granularity)
    assert q.shape == x.shape
    _assert_matches_reference(x, granularity=granularity)


def test_zero_dim_input():
    _assert_matches_reference(torch.tensor(3.7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_single_row_splits_across_threads(dtype, cpu_variant):
    # chunks of at most 2^18 elements (the cap applies from 2 Mi elements with 2 threads)
    # and a partial one; the quantize pass runs them backwards
    x = torch.randn((3 << 20) + 4099) * 3
    x[2_777_777] = 1e4
    _assert_matches_reference(x.to(dtype))


@pytest.mark.parametrize("elements", [36_864, 98_303, 98_305, 147_456 + 7, 1_179_648 + 63])
def test_per_tensor_split_around_thread_thresholds(elements):
    # contiguous inputs are cut into equal chunks, multiples of 64 elements, for the
    # threads worth waking (at least 48K elements each): one thread, two, and several
    # chunks each with a short last one; the largest value sits in the last chunk so
    # that the amax pass must combine every chunk's
    x = torch.randn(elements, dtype=torch.bfloat16)
    x[-5] = 300.0
    _assert_matches_reference(x)


def test_dequantize_round_trip():
    x = torch.randn(64, 64)
    q, scale = fp8linear.quantize_fp8(x, granularity="row")
    restored = fp8linear.dequantize_fp8(q, scale)
    assert torch.allclose(restored, x, rtol=2**-3, atol=scale.max().item() * 2**-9)
    assert fp8linear.dequantize_fp8(q, scale, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fp8linear.quantize_fp8(torch.randn(4).double()), "x must be torch.float32"),
        (lambda: fp8linear.quantize_fp8(torch.randint(0, 3, (4,))), "x must be torch.float32"),
        (lambda: fp8linear.quantize_fp8(torch.randn(4), dtype=torch.int8), "dtype must be torch.float8"),
        (lambda: fp8linear.quantize_fp8(torch.randn(4), torch.ones(2)), "one element"),
        (lambda: fp8linear.quantize_fp8(torch.randn(4), torch.ones((), dtype=torch.float64)), "scale must be torch.float32"),
        (lambda: fp8linear.quantize_fp8(torch.randn(3, 4), torch.ones(3), granularity="row"), r"shape \[3, 1\]"),
        (lambda: fp8linear.quantize_fp8(torch.tensor(1.0), granularity="row"), "0-d"),
        (lambda: fp8linear.quantize_fp8(torch.randn(4), granularity="channel"), "granularity must be one of"),
        (lambda: fp8linear.dequantize_fp8(torch.randn(4), torch.ones(())), "q must be"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_opcheck():
    for args in [
        (torch.randn(5, 17), None, torch.float8_e4m3fn, False),
        (torch.randn(5, 17, dtype=torch.bfloat16), None, torch.float8_e5m2, True),
        (torch.randn(5, 17), torch.tensor(0.5), torch.float8_e4m3fn, False),
        (torch.randn(3, 5, 17, dtype=torch.float16), torch.rand(3, 5, 1) + 0.1, torch.float8_e4m3fn, True),
    ]:
        torch.library.opcheck(torch.ops.fp8linear.quantize_fp8.default, args)
