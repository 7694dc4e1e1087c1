"""Block-wise FP8 (DeepSeek-V3 / Qwen3 checkpoints): quantize_fp8 per group of 128 along K
(activations) and per 128 x 128 block (weights), and scaled_mm summing each block of 128 k
in float32 on its own, on every CPU kernel variant, against the reference."""
import itertools

import pytest
import torch

import fp8linear
from conftest import FLOAT_DTYPES, FP8_DTYPES, assert_same_fp8, bf16_gemm_kernel, forced_cpu_variant, relative_error
from fp8linear import reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
# partial edge blocks, one block, exactly two, and M from decode to GEMM sizes
# (on AMX: the dot kernel to M = 4, the stream kernel with 1-4 groups of 16 rows, the panel kernel)
SHAPES = [(1, 300, 260), (2, 128, 129), (5, 129, 128), (9, 513, 70), (16, 256, 17), (24, 300, 140), (33, 1, 200),
          (64, 260, 130), (70, 700, 300), (600, 300, 200),
          # AMX: the full-K kernel over row chunks of 256 (K = 2000), the panel kernel (K > 2048)
          (300, 2000, 40), (100, 2200, 70)]


def values(shape, dtype=torch.float32):
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1]).reshape(*([1] * (len(shape) - 1)), -1)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------
# quantize_fp8: group and block granularity


@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 257), (1, 128), (4, 1), (7, 0), (0, 9)])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_group_quantization_is_bit_exact(shape, dtype, fp8_dtype, cpu_variant):
    x = values(shape, dtype) if 0 not in shape else torch.zeros(shape, dtype=dtype)
    q, scale = fp8linear.quantize_fp8(x, dtype=fp8_dtype, granularity="group")
    expected_q, expected_scale = reference.quantize_fp8(x, dtype=fp8_dtype, granularity="group")
    assert scale.shape == (*shape[:-1], -(-shape[-1] // 128)) and scale.dtype == torch.float32
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(q, expected_q)


@pytest.mark.parametrize("shape", [(300, 260), (128, 128), (129, 1), (1, 1), (576, 1536), (0, 5)])
@pytest.mark.parametrize("block_size", [(128, 128), (64, 32), (3, 5)])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_block_quantization_is_bit_exact(shape, block_size, fp8_dtype, cpu_variant):
    x = values(shape, torch.bfloat16) if 0 not in shape else torch.zeros(shape, dtype=torch.bfloat16)
    q, scale = fp8linear.quantize_fp8(x, dtype=fp8_dtype, granularity="block", block_size=block_size)
    expected_q, expected_scale = reference.quantize_fp8(x, dtype=fp8_dtype, granularity="block", block_size=block_size)
    assert scale.shape == tuple(-(-s // b) for s, b in zip(shape, block_size))
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(q, expected_q)


@pytest.mark.parametrize("granularity, shape", [("group", (5, 300)), ("group", (2, 3, 257)), ("group", (0, 9)),
                                                ("block", (300, 260)), ("block", (129, 1)), ("block", (0, 5))])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_ue8m0_scales_are_the_next_power_of_two(granularity, shape, dtype, fp8_dtype, cpu_variant):
    x = values(shape, dtype) if 0 not in shape else torch.zeros(shape, dtype=dtype)
    if x.numel():
        x.view(-1)[::37] = 0  # some all-zero groups get the floor, rounded up too
        x.view(-1)[5] = float("nan")
    q, scale = fp8linear.quantize_fp8(x, dtype=fp8_dtype, granularity=granularity, scale_fmt="ue8m0")
    expected_q, expected_scale = reference.quantize_fp8(x, dtype=fp8_dtype, granularity=granularity,
                                                        scale_fmt="ue8m0")
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(q, expected_q)
    _, plain = fp8linear.quantize_fp8(x, dtype=fp8_dtype, granularity=granularity)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # powers of two
    assert (scale >= plain).all() and (scale < 2 * plain).all()  # the next one up (or the scale itself)


def test_ue8m0_of_scales_that_are_powers_of_two_already():
    x = torch.zeros(2, 256)
    x[0, 0], x[1, 200] = 448.0 * 2.0**-3, 448.0 * 2.0**-3 * (1 + 2.0**-23)  # amax / 448 = 2^-3 and just above
    _, scale = fp8linear.quantize_fp8(x, granularity="group", scale_fmt="ue8m0")
    floor = reference.power_of_two_ceil(reference.scale_from_amax(torch.zeros(()), torch.float8_e4m3fn)).item()
    assert scale.tolist() == [[2.0**-3, floor], [floor, 2.0**-2]]


def test_scale_fmt_errors():
    with pytest.raises(ValueError, match="scale_fmt must be one of"):
        fp8linear.quantize_fp8(torch.randn(4, 8), granularity="group", scale_fmt="e8m0")
    for granularity in ("tensor", "row"):
        with pytest.raises(ValueError, match="applies to granularity 'group' and 'block'"):
            fp8linear.quantize_fp8(torch.randn(4, 8), granularity=granularity, scale_fmt="ue8m0")
    given = torch.full((4, 1), 0.3)  # a given scale is used as it is
    q, scale = fp8linear.quantize_fp8(torch.randn(4, 8), given, granularity="group", scale_fmt="ue8m0")
    assert torch.equal(scale, given)


def test_a_block_of_zeros_or_non_finite_values_gets_the_floor_scale():
    w = torch.randn(200, 300)
    w[:128, 128:256] = 0.0
    w[128:, 256:] = float("nan")
    w[0, 0] = float("inf")
    q, scale = fp8linear.quantize_fp8(w, granularity="block")
    floor = 1.0 / (448.0 * 512.0)
    assert scale[0, 1] == pytest.approx(floor) and scale[1, 2] == pytest.approx(floor)
    assert torch.all(scale > 0) and torch.all(torch.isfinite(scale))
    assert q[0, 0].float() == 448.0  # inf saturates; it does not enter the block's amax
    assert torch.isnan(q[128:, 256:].float()).all()
    assert_same_fp8(q, reference.quantize_fp8(w, granularity="block")[0])


def test_strided_inputs_and_threads(cpu_variant):
    base = values((260, 600))
    for x in (base[:, ::2], base.t(), base[3:250, 7:400]):
        expected = reference.quantize_fp8(x, granularity="block")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q, scale = fp8linear.quantize_fp8(x, granularity="block")
            assert torch.equal(scale, expected[1])
            assert_same_fp8(q, expected[0])
        # groups: rows with a unit column stride run the per-row-range loop (any row
        # stride), others the per-group tasks; sizes other than 128, partial last groups
        for group_size in (128, 100, 32):
            expected = reference.quantize_fp8(x, granularity="group", group_size=group_size)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                q, scale = fp8linear.quantize_fp8(x, granularity="group", group_size=group_size)
                assert torch.equal(scale, expected[1])
                assert_same_fp8(q, expected[0])
    torch.set_num_threads(2)


@pytest.mark.parametrize("group_size", [128, 32])
def test_rows_of_more_groups_than_one_pass_takes(group_size, cpu_variant):
    # the AVX-512 kernels take the groups of a row 256 at a time (amaxes, scales, codes);
    # rows of 259 groups and more (a partial last one), dynamic and given scales
    x = values((3, 259 * group_size - 5), torch.bfloat16)
    expected_q, expected_scale = reference.quantize_fp8(x, granularity="group", group_size=group_size)
    q, scale = fp8linear.quantize_fp8(x, granularity="group", group_size=group_size)
    assert torch.equal(scale, expected_scale)
    assert_same_fp8(q, expected_q)
    given = torch.rand_like(expected_scale) + 0.01
    q, _ = fp8linear.quantize_fp8(x, given, granularity="group", group_size=group_size)
    assert_same_fp8(q, reference.quantize_fp8(x, given, granularity="group", group_size=group_size)[0])


def test_given_block_scales_are_used_as_they_are():
    w = values((300, 260))
    scale = torch.rand(3, 3) + 0.01
    q, used = fp8linear.quantize_fp8(w, scale, granularity="block")
    assert torch.equal(used, scale) and used.data_ptr() != scale.data_ptr()
    assert_same_fp8(q, reference.quantize_fp8(w, scale, granularity="block")[0])
    x = values((4, 300))
    group_scale = torch.rand(4, 3) + 0.01
    q, used = fp8linear.quantize_fp8(x, group_scale, granularity="group")
    assert_same_fp8(q, reference.quantize_fp8(x, group_scale, granularity="group")[0])


def test_block_quantization_errors():
    with pytest.raises(ValueError, match="needs a 2-D x"):
        fp8linear.quantize_fp8(torch.randn(2, 3, 4), granularity="block")
    with pytest.raises(ValueError, match="must have shape \\[3, 3\\]"):
        fp8linear.quantize_fp8(torch.randn(300, 260), torch.ones(2, 2), granularity="block")
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        fp8linear.quantize_fp8(torch.randn(3, 4), granularity="group", group_size=0)
    with pytest.raises(ValueError, match="block_size must be two positive ints"):
        fp8linear.quantize_fp8(torch.randn(3, 4), granularity="block", block_size=(128,))
    with pytest.raises(ValueError, match="use granularity='group'"):
        fp8linear.quantize_fp8(torch.randn(3, 4), granularity="block", block_size=(1, 128))
    bad = torch.ones(3, 3)
    bad[1, 2] = 0.0
    with pytest.raises(ValueError, match="scale must be finite and > 0.*index 5"):
        fp8linear.quantize_fp8(torch.randn(300, 260), bad, granularity="block")


# ---------------------------------------------------------------------------------------
# scaled_mm with block-wise scales


def blockwise_operands(m, k, n, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn):
    a, scale_a = fp8linear.quantize_fp8(values((m, k)), dtype=a_dtype, granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), dtype=b_dtype, granularity="block")
    return a, w, scale_a, scale_w


@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_group_activations_times_block_weights(m, k, n, out_dtype, cpu_variant):
    a, w, scale_a, scale_w = blockwise_operands(m, k, n)
    bias = torch.randn(n)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), bias=bias, out_dtype=out_dtype)
    assert out.shape == (m, n) and out.dtype == out_dtype
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t(), bias=bias)
    assert relative_error(out, exact) <= TOLERANCE[out_dtype]
    # the float32 reference sums each block of 128 k on its own, as the kernels do
    mirrored = reference.scaled_mm(a, w.t(), scale_a, scale_w.t(), bias=bias, out_dtype=torch.float32)
    assert relative_error(out, mirrored.double()) <= TOLERANCE[out_dtype]


@pytest.mark.parametrize("m", [3, 6, 20, 47, 100])  # 47: the skinny kernel's three groups per step
def test_block_sums_are_not_one_sum_times_one_scale(m, cpu_variant):
    # block scales that differ by 2^20 between the two k blocks: a kernel that summed all
    # of K and applied one scale would be off by orders of magnitude
    a, w, scale_a, scale_w = blockwise_operands(m, 256, 130)
    scale_w = scale_w.clone()
    scale_w[:, 1] *= 2.0**20
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    expected = (a[:, :128].double() * scale_a[:, :1].double()) @ (w[:, :128].double().t() * scale_w[:, 0].double()
                                                                  .repeat_interleave(128)[:130])
    expected += (a[:, 128:].double() * scale_a[:, 1:].double()) @ (w[:, 128:].double().t() * scale_w[:, 1].double()
                                                                   .repeat_interleave(128)[:130])
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.parametrize("a_dtype, b_dtype", list(itertools.product(FP8_DTYPES, FP8_DTYPES)))
def test_both_fp8_formats(a_dtype, b_dtype, cpu_variant):
    a, w, scale_a, scale_w = blockwise_operands(6, 300, 140, a_dtype, b_dtype)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5


@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_weight_only_with_block_weights(m, dtype, cpu_variant):
    x = values((m, 300), dtype)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(260, 300), granularity="block")
    one = torch.ones(())
    out = fp8linear.scaled_mm(x, w.t(), one, scale_w.t(), out_dtype=dtype)
    exact = reference.scaled_mm_float64(x, w.t(), one, scale_w.t())
    assert relative_error(out, exact) <= TOLERANCE[dtype]


@pytest.mark.parametrize("a_scale_kind, b_scale_kind", [("group", "tensor"), ("group", "column"),
                                                        ("tensor", "block"), ("row", "block")])
@pytest.mark.parametrize("m", [5, 100])
def test_one_blocked_scale_with_the_other_per_tensor_row_or_column(a_scale_kind, b_scale_kind, m, cpu_variant):
    k, n = 300, 140
    x, weight = values((m, k)), torch.randn(n, k)
    granularity = {"group": "group", "tensor": "tensor", "row": "row"}[a_scale_kind]
    a, scale_a = fp8linear.quantize_fp8(x, granularity=granularity)
    if b_scale_kind == "block":
        w, scale_w = fp8linear.quantize_fp8(weight, granularity="block")
        scale_b = scale_w.t()
    else:
        w, scale_w = fp8linear.quantize_fp8(weight, granularity="row" if b_scale_kind == "column" else "tensor")
        scale_b = scale_w.t() if b_scale_kind == "column" else scale_w
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, scale_b)) <= 1e-5


# ---------------------------------------------------------------------------------------
# block scales a power of two apart along K, folded into the operands (AMX kernels from
# M = 2-5, AVX512-BF16 eight-row, skinny and tile kernels from M = 5)


def power_of_two(scale, significand=1.0):
    """Each scale rounded up to a power of two ("ue8m0"), times one common significand."""
    return torch.exp2(torch.ceil(torch.log2(scale))) * significand


def folding_operands(m, k, n, a_dtype=torch.float8_e4m3fn, b_dtype=torch.float8_e4m3fn, significand=1.0):
    x, weight = values((m, k)) * 1e-3, torch.randn(n, k) * torch.logspace(-2, 2, k)  # outputs within float16
    _, scale_a = fp8linear.quantize_fp8(x, dtype=a_dtype, granularity="group")
    _, scale_w = fp8linear.quantize_fp8(weight, dtype=b_dtype, granularity="block")
    scale_a = power_of_two(scale_a, significand)
    scale_w = power_of_two(scale_w, 1.25 * significand)
    a, _ = fp8linear.quantize_fp8(x, scale_a, dtype=a_dtype, granularity="group")
    w, _ = fp8linear.quantize_fp8(weight, scale_w, dtype=b_dtype, granularity="block")
    return a, w, scale_a, scale_w


def plan(a, b, scale_a, scale_b):
    return fp8linear.ops.native().cpu_scaled_mm_plan(a, b, scale_a, scale_b)


# the variants whose kernels fold power-of-two block scales into the operands, and the
# kernel that does it (on AVX512-BF16 the eight-row and skinny kernels, bf16_skinny, and
# the tile kernel, M > 4: bf16_gemm_kernel; on avx512_fma the float32 FMA tile kernel from M = 10)
FOLDING = {"amx": lambda m, n: "amx", "amx_emulated": lambda m, n: "amx", "avx512_bf16": bf16_gemm_kernel,
           "avx512_fma": lambda m, n: "fma_tile" if m >= 10 else bf16_gemm_kernel(m, n)}


def folding_plan(variant, m, n):
    """What cpu_scaled_mm_plan says for foldable scales at M = m (m > 4), or None."""
    if variant not in FOLDING:
        return None
    return ("bf16_dot", False) if variant in ("avx512_bf16", "avx512_fma") and m <= 4 else (FOLDING[variant](m, n), True)


# AMX: the stream kernel (M <= 64), the full-K kernel (K <= 2048) and the panel kernel;
# AVX512-BF16: the eight-row kernel (M = 5-8), the skinny kernel (M <= 64) and the tile
# kernel; partial blocks of k and of weight rows
@pytest.mark.parametrize("m, k, n", [(5, 300, 200), (8, 700, 40), (40, 1000, 150), (45, 700, 150), (64, 2200, 40),
                                     (65, 300, 200), (100, 129, 128), (300, 2000, 130), (100, 2200, 70), (600, 700, 300)])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_power_of_two_block_scales_fold(m, k, n, out_dtype, cpu_variant):
    a, w, scale_a, scale_w = folding_operands(m, k, n)
    expected = folding_plan(cpu_variant, m, n)
    assert expected is None or plan(a, w.t(), scale_a, scale_w.t()) == expected
    bias = torch.randn(n)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), bias=bias, out_dtype=out_dtype)
    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t(), bias=bias)
    assert relative_error(out, exact) <= TOLERANCE[out_dtype]


@pytest.mark.parametrize("a_dtype, b_dtype", list(itertools.product(FP8_DTYPES, FP8_DTYPES)))
@pytest.mark.parametrize("significand", [1.0, 1.37])
# shifted tables per step (AMX stream; skinny: 2 groups in turn, 4 per step), per panel (full-K, tile)
@pytest.mark.parametrize("m", [40, 60, 100])
def test_folded_scales_in_both_formats_with_a_common_significand(a_dtype, b_dtype, significand, m, cpu_variant):
    a, w, scale_a, scale_w = folding_operands(m, 300, 140, a_dtype, b_dtype, significand)
    assert plan(a, w.t(), scale_a, scale_w.t())[1] == (cpu_variant in FOLDING)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    assert relative_error(out, reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5


def test_folded_scales_spanning_2_to_the_32():
    # within a row, scales 2^-32 apart still fold and stay exact (normal bf16 and float32
    # values, e5m2 included); 2^-33 apart they are summed block by block instead
    for variant in set(FOLDING) & set(fp8linear.ops.native().cpu_variants_supported()):
        with forced_cpu_variant(variant):
            for shift, folds, m in ((32, True, 80), (32, True, 48), (33, False, 80)):
                for dtype in FP8_DTYPES:
                    a, w, scale_a, scale_w = folding_operands(m, 384, 256, dtype, dtype)
                    scale_a, scale_w = scale_a.clone(), scale_w.clone()
                    scale_a[:, 1] = scale_a.amax(dim=1) * 2.0**-shift  # the row's smallest, `shift` below its largest
                    scale_w[1, 2] = scale_w[1].amin() * 2.0**shift  # this block row's largest
                    assert plan(a, w.t(), scale_a, scale_w.t()) == (FOLDING[variant](m, 256), folds)
                    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
                    exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())
                    assert relative_error(out, exact) <= 1e-5
                    # the small block alone (the others' values zero, their scales kept): its
                    # sums are not lost beside the large ones
                    only = a.clone()
                    only.view(torch.uint8)[:, :128] = 0
                    only.view(torch.uint8)[:, 256:] = 0
                    out = fp8linear.scaled_mm(only, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
                    exact = reference.scaled_mm_float64(only, w.t(), scale_a, scale_w.t())
                    assert exact.abs().max() > 0 and relative_error(out, exact) <= 1e-5


def test_common_factors_that_would_overflow_do_not_fold():
    # per row 2^100 and 2^70, per block row 2^20 and 2^50: every block's product is 2^120,
    # but the rows' largest times the columns' largest, 2^150, is not a float32
    k_blocks = 2
    a = torch.full((100, 256), 2.0**-6).to(torch.float8_e4m3fn)
    w = torch.full((128, 256), 2.0**-6).to(torch.float8_e4m3fn)
    scale_a = torch.tensor([2.0**100, 2.0**70]).repeat(100, 1)
    scale_w = torch.tensor([[2.0**20, 2.0**50]])
    assert scale_a.shape == (100, k_blocks)
    for variant in fp8linear.ops.native().cpu_variants_supported():
        with forced_cpu_variant(variant):
            if variant in FOLDING:
                assert plan(a, w.t(), scale_a, scale_w.t()) == (FOLDING[variant](100, 128), False)
            out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
            assert torch.equal(out, torch.full((100, 128), 2.0**116))  # 256 products of 2^-12, times 2^120
    with pytest.raises(ValueError, match="needs CPU tensors"):
        plan(a.to("meta"), w.t().to("meta"), scale_a.to("meta"), scale_w.t().to("meta"))


def test_scales_that_do_not_fold():
    a, w, scale_a, scale_w = folding_operands(100, 300, 140)
    mixed_a, mixed_w = scale_a.clone(), scale_w.clone()
    mixed_a[7, 2] *= 1.5  # one row's significands differ
    mixed_w[1, 0] *= 0.75  # one block row's do
    for variant in set(FOLDING) & set(fp8linear.ops.native().cpu_variants_supported()):
        with forced_cpu_variant(variant):
            method = FOLDING[variant](100, 140)
            assert plan(a, w.t(), scale_a, scale_w.t()) == (method, True)
            assert plan(a, w.t(), mixed_a, scale_w.t()) == (method, False)
            assert plan(a, w.t(), scale_a, mixed_w.t()) == (method, False)
            # the stream / skinny kernel's M
            for rows in (48, 64):
                assert plan(a[:rows], w.t(), scale_a[:rows], scale_w.t()) == (FOLDING[variant](rows, 140), True)
            assert plan(a[:1], w.t(), scale_a[:1], scale_w.t()) == ("bf16_dot", False)  # decode: the dot kernel
            for sa, sw in ((mixed_a, scale_w), (scale_a, mixed_w)):
                out = fp8linear.scaled_mm(a, w.t(), sa, sw.t(), out_dtype=torch.float32)
                assert relative_error(out, reference.scaled_mm_float64(a, w.t(), sa, sw.t())) <= 1e-5


def test_one_folded_scale_beside_a_per_token_or_per_channel_one(cpu_variant):
    a, w, scale_a, scale_w = folding_operands(100, 300, 140)
    weight_rows = torch.rand(1, 140) + 0.5
    tokens = torch.rand(100, 1) + 0.5
    x = values((100, 300), torch.bfloat16)
    one = torch.ones(())
    for args in ((a, w.t(), scale_a, weight_rows), (a, w.t(), tokens, scale_w.t()), (x, w.t(), one, scale_w.t())):
        # weight-only calls (bf16 x) keep their blocks: shifted weights would raise the
        # tiles' 2^-126 floor for products with bf16 activations
        assert plan(*args)[1] == (cpu_variant in FOLDING and args[0] is not x)
        out = fp8linear.scaled_mm(*args, out_dtype=torch.float32)
        assert relative_error(out, reference.scaled_mm_float64(*args)) <= 1e-5


@pytest.mark.parametrize("m", [40, 100])
def test_folded_scales_keep_nan_inf_and_zeros(m):
    a, w, scale_a, scale_w = folding_operands(m, 300, 140, b_dtype=torch.float8_e5m2)
    a, w = a.clone(), w.clone()
    a.view(torch.uint8)[3, 200] = 0x7F  # e4m3 NaN: row 3 is NaN everywhere
    w.view(torch.uint8)[5, 10] = 0x7C  # e5m2 +inf: column 5 is +-inf or NaN
    w.view(torch.uint8)[7, 20] = 0xFE  # e5m2 NaN: column 7 is NaN
    a.view(torch.uint8)[10] = 0  # a row of zeros
    for variant in fp8linear.ops.native().cpu_variants_supported():
        with forced_cpu_variant(variant):
            out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
            exact = reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())
            assert torch.isnan(out[3]).all() and torch.isnan(out[:, 7]).all()
            assert torch.equal(torch.isinf(out[:, 5]), torch.isinf(exact[:, 5]))
            assert torch.equal(torch.isnan(out[:, 5]), torch.isnan(exact[:, 5]))
            assert torch.equal(out[10].nan_to_num(7.0), exact[10].float().nan_to_num(7.0))  # zeros (0 * inf: NaN)
            keep = torch.ones(m, dtype=torch.bool)
            keep[3] = False
            assert relative_error(out[keep][:, 8:], exact[keep][:, 8:]) <= 1e-5


def test_transposed_and_contiguous_block_scales_agree():
    a, w, scale_a, scale_w = blockwise_operands(4, 400, 300)
    view = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    copy = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t().contiguous(), out_dtype=torch.float32)
    assert torch.equal(view, copy)


def test_thread_count_does_not_change_the_bits():
    a, w, scale_a, scale_w = blockwise_operands(20, 700, 300)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append(fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32))
    torch.set_num_threads(2)
    assert torch.equal(*results)


def test_k_zero_with_block_scales_is_the_bias():
    a, scale_a = fp8linear.quantize_fp8(torch.zeros(3, 0), granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.zeros(5, 0), granularity="block")
    bias = torch.randn(5)
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(3, 5))


def test_block_scale_shape_errors():
    a, w, scale_a, scale_w = blockwise_operands(4, 300, 260)
    with pytest.raises(ValueError, match="scale_b must have shape .* \\[ceil\\(K / 128\\), ceil\\(N / 128\\)\\] = \\[3, 3\\]"):
        fp8linear.scaled_mm(a, w.t(), scale_a, torch.ones(3, 2))
    with pytest.raises(ValueError, match="scale_a must have shape .* \\[M, ceil\\(K / 128\\)\\] = \\[4, 3\\]"):
        fp8linear.scaled_mm(a, w.t(), torch.ones(4, 2), scale_w.t())
    bad = scale_w.t().clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="scale_b must be finite and > 0"):
        fp8linear.scaled_mm(a, w.t(), scale_a, bad)


def test_meta_and_compile_see_the_block_shapes():
    x = torch.randn(4, 300, device="meta")
    q, scale = fp8linear.quantize_fp8(x, granularity="group")
    assert q.device.type == "meta" and scale.shape == (4, 3)
    w = torch.randn(260, 300, device="meta")
    qw, scale_w = fp8linear.quantize_fp8(w, granularity="block")
    assert scale_w.shape == (3, 3)
    out = fp8linear.scaled_mm(q, qw.t(), scale, scale_w.t(), out_dtype=torch.bfloat16)
    assert out.shape == (4, 260) and out.device.type == "meta"

    torch._dynamo.reset()
    w = torch.randn(260, 300)
    qw, scale_w = fp8linear.quantize_fp8(w, granularity="block")

    def f(x):
        a, s = fp8linear.quantize_fp8(x, granularity="group")
        return fp8linear.scaled_mm(a, qw.t(), s, scale_w.t(), out_dtype=torch.float32)

    x = torch.randn(5, 300)
    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(x), f(x))
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------
# FP8Linear with block-wise weights


BLOCK_CONFIGS = [dict(weight_granularity="block", activation_granularity="group"),
                 dict(weight_granularity="block", activations="none"),
                 dict(weight_granularity="block", activation_granularity="token"),
                 dict(weight_granularity="block", activation_granularity="group", scale_fmt="ue8m0"),
                 dict(weight_granularity="block", activations="none", scale_fmt="ue8m0")]


def dequantized_block_weight(layer):
    n, k = layer.weight.shape
    scale = reference.expand_block_scales(layer.weight_scale, n, k, 128, 128)
    return layer.weight.double() * scale.double()


@pytest.mark.parametrize("options", BLOCK_CONFIGS)
@pytest.mark.parametrize("shape", [(300, 260), (100, 64), (576, 1536)])  # (in, out): partial, one, 4.5 x 12 blocks
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_block_layer_matches_its_dequantized_weights(options, shape, dtype):
    in_features, out_features = shape
    linear = torch.nn.Linear(in_features, out_features).to(dtype)
    layer = fp8linear.FP8Linear.from_linear(linear, **options)
    assert layer.weight.shape == (out_features, in_features) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == (-(-out_features // 128), -(-in_features // 128))
    x = torch.randn(3, 5, in_features, dtype=dtype)
    out = layer(x)
    assert out.shape == (3, 5, out_features) and out.dtype == dtype
    # against the exact product of the layer's own quantized operands
    x2d = x.reshape(-1, in_features)
    if options.get("activations") == "none":
        a, scale_a = x2d, torch.ones(())
    else:
        granularity = {"group": "group", "token": "row"}[options["activation_granularity"]]
        a, scale_a = reference.quantize_fp8(x2d, granularity=granularity, scale_fmt=options.get("scale_fmt"))
    if options.get("scale_fmt"):  # power-of-two weight scales
        assert torch.equal(reference.power_of_two_ceil(layer.weight_scale), layer.weight_scale)
    exact = reference.scaled_mm_float64(a, layer.weight.t(), scale_a, layer.weight_scale.t(), bias=layer.bias)
    assert relative_error(out.reshape(-1, out_features), exact) <= TOLERANCE[dtype]
    # and close to the original layer
    assert relative_error(out.float(), linear(x).double()) <= 0.08


def test_ue8m0_layers_fold_and_take_every_path():
    # FP8Linear with scale_fmt "ue8m0": both the native fast path (fp8linear::linear's
    # granularity 3 and the reuse of a shared input's quantization) and the full path give
    # what the ops give; on the AMX and AVX512-BF16 variants the product folds its scales
    # (above the dot kernel's M)
    config = fp8linear.FP8Config(weight_granularity="block", activation_granularity="group", scale_fmt="ue8m0")
    assert "ue8m0" in config.describe()
    layer = fp8linear.FP8Linear.from_linear(torch.nn.Linear(300, 260), config=config)
    twin = fp8linear.FP8Linear.from_linear(torch.nn.Linear(300, 200), config=config)
    for rows in (3, 100):
        x = torch.randn(rows, 300)
        a, scale_a = fp8linear.quantize_fp8(x, granularity="group", scale_fmt="ue8m0")
        for variant in fp8linear.ops.native().cpu_variants_supported():
            with forced_cpu_variant(variant):
                expected = fp8linear.scaled_mm(a, layer.weight.t(), scale_a, layer.weight_scale.t(), bias=layer.bias,
                                               out_dtype=torch.float32)
                assert torch.equal(layer(x), expected)  # the fast path
                assert torch.equal(twin(x)[:, :1], fp8linear.scaled_mm(  # its sibling reuses x's quantization
                    a, twin.weight.t(), scale_a, twin.weight_scale.t(), bias=twin.bias, out_dtype=torch.float32)[:, :1])
                with torch.enable_grad():
                    full = layer(x.clone().requires_grad_())  # the full path (autograd)
                assert torch.equal(full.detach(), expected)
                method, folded = plan(a, layer.weight.t(), scale_a, layer.weight_scale.t())
                planned = folding_plan(variant, rows, 260) if rows > 4 else None
                assert (method, folded) == planned or (planned is None and not folded)
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0' is for block-wise weights"):
        fp8linear.FP8Config(weight_granularity="channel", scale_fmt="ue8m0")
    with pytest.raises(ValueError, match="scale_fmt must be one of"):
        fp8linear.FP8Config(weight_granularity="block", scale_fmt="ue4m3")


def test_block_layer_state_dict_and_from_fp8():
    linear = torch.nn.Linear(300, 260)
    layer = fp8linear.FP8Linear.from_linear(linear, weight_granularity="block", activation_granularity="group")
    twin = fp8linear.FP8Linear(300, 260, weight_granularity="block", activation_granularity="group")
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(4, 300)
    assert torch.equal(twin(x), layer(x))
    rebuilt = fp8linear.FP8Linear.from_fp8(layer.weight, layer.weight_scale, bias=layer.bias,
                                           weight_granularity="block", activation_granularity="group")
    assert rebuilt.weight.data_ptr() == layer.weight.data_ptr()  # no copy
    with pytest.raises(ValueError, match="must have shape \\[3, 3\\]"):
        fp8linear.FP8Linear.from_fp8(layer.weight, torch.ones(260, 1), weight_granularity="block")
    report = fp8linear.memory_report(torch.nn.Sequential(layer))
    assert report.converted_bytes == 300 * 260 + 9 * 4 + 260 * 4  # fp8 weight, 3 x 3 scales, float32 bias


@pytest.mark.parametrize("in_features", [100, 300])  # one k block (scale grid [N/128, 1]) and three
def test_block_layer_input_gradient(in_features):
    layer = fp8linear.FP8Linear.from_linear(torch.nn.Linear(in_features, 260), weight_granularity="block",
                                            activation_granularity="group")
    x = torch.randn(6, in_features, requires_grad=True)
    grad_out = torch.randn(6, 260)
    layer(x).backward(grad_out)
    expected = grad_out.double() @ dequantized_block_weight(layer)
    assert relative_error(x.grad, expected) <= 1e-5


def test_block_layer_compiles_and_runs_on_meta():
    layer = fp8linear.FP8Linear.from_linear(torch.nn.Linear(300, 260), weight_granularity="block",
                                            activation_granularity="group")
    torch._dynamo.reset()
    x = torch.randn(2, 7, 300)
    assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), layer(x))
    torch._dynamo.reset()
    meta = torch.nn.Sequential(layer).to("meta")
    assert meta(torch.randn(2, 300, device="meta")).shape == (2, 260)
