"""The AMX kernels (csrc/cpu/gemm_amx*.c): detection, every sub-kernel against the
reference, the C model of the tile instructions against the hardware, and tile state
shared with oneDNN.

The amx_emulated variant runs the same kernel code with each tile instruction replaced
by a C model of it, so all of this except the hardware comparisons runs on any CPU with
AVX512-BF16 (AMD Zen 4/5 included); where the CPU and OS allow AMX, the amx variant runs
the same tests on the real instructions.
"""
import concurrent.futures
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fp8linear
from fp8linear import reference
from fp8linear._native import native
from conftest import forced_cpu_variant, relative_error, scaled_mm_on_1_and_2_threads

SUPPORTED = native().cpu_variants_supported()
AMX_VARIANTS = [v for v in ("amx", "amx_emulated") if v in SUPPORTED]
HAS_AMX = "amx" in SUPPORTED
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

pytestmark = pytest.mark.skipif(not AMX_VARIANTS, reason="needs AVX512-BF16 (for amx_emulated) or AMX")


@pytest.fixture(params=AMX_VARIANTS)
def amx_variant(request):
    with forced_cpu_variant(request.param):
        yield request.param


def _operands(m, k, n, dtype=torch.float8_e4m3fn, per_row=False):
    granularity = "row" if per_row else "tensor"
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), dtype=dtype, granularity=granularity)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), dtype=dtype, granularity=granularity)
    return a, w.t(), scale_a, scale_w.t() if per_row else scale_w


def _check(a, b, scale_a, scale_b, bias=None, out_dtype=torch.float32):
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == out_dtype
    assert relative_error(out, reference.scaled_mm_float64(a, b, scale_a, scale_b, bias=bias)) <= TOLERANCE[out_dtype]
    return out


def _cpu_flags():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_detection_agrees_with_the_variant_list():
    module = native()
    status = module.cpu_amx_status()
    assert (status == "") == HAS_AMX
    if "avx512_bf16" in SUPPORTED:
        assert "amx_emulated" in SUPPORTED  # the model runs wherever the AVX512-BF16 kernels do
    flags = _cpu_flags()
    if flags is not None and "amx_tile" not in flags:
        assert not HAS_AMX and status  # and it says why
    # a fresh process picks AMX by itself exactly when it is usable (never the emulation)
    default = subprocess.run([sys.executable, "-c", "from fp8linear._native import native; print(native().cpu_variant())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert default != "amx_emulated"
    assert (default == "amx") == HAS_AMX


@pytest.mark.skipif(HAS_AMX, reason="this CPU can run AMX")
def test_amx_refused_where_unusable():
    with pytest.raises(ValueError, match="not supported by this CPU"):
        native().set_cpu_variant("amx")


# Each sub-kernel and its edges: M = 1 and small M * N * K keep the dot kernel; M <= 64 is
# the stream kernel (1-4 groups of 16 rows); larger M the full-K kernel up to K = 2048
# (panels of 32 rows, row chunks of 512 rows or 1 MiB of packed K: 256 rows at K = 2000)
# and the panel kernel above (row chunks of 512, weight-row blocks of 512, panels of
# 64 rows x 256 k).
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 32, 33, 48, 49, 64, 65, 100, 513])
@pytest.mark.parametrize("k, n", [(1, 17), (63, 70), (130, 33), (576, 65), (1025, 9), (2000, 33), (2049, 20)])
def test_sub_kernels_and_tails(m, k, n, amx_variant):
    _check(*_operands(m, k, n), out_dtype=torch.bfloat16)


@pytest.mark.parametrize("m, k, n", [(20, 300, 1100), (70, 520, 530), (600, 64, 130), (70, 2100, 530),
                                     (600, 2100, 70)])
def test_column_blocks_row_chunks_and_k_blocks(m, k, n, amx_variant):
    # N past one 512-row block and not a multiple of 64 or 32; K past one 256 block (the
    # panel kernel: K > 2048); M past a chunk
    _check(*_operands(m, k, n))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("m", [7, 40, 90])  # stream (1 and 3 groups), panel
def test_formats_scales_and_bias(dtype, out_dtype, per_row, m, amx_variant):
    bias = torch.randn(45).to(out_dtype)
    _check(*_operands(m, 200, 45, dtype, per_row), bias=bias, out_dtype=out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n", [(90, 45), (600, 70), (130, 530)])
def test_panel_kernel_epilogue_bias_and_dtypes(m, n, out_dtype, amx_variant):
    # K > 2048: the panel kernel, whose last K block finishes each 32 x 32 block among the
    # next block's products (a block pending across panels, column blocks and row chunks)
    bias = torch.randn(n).to(out_dtype)
    _check(*_operands(m, 2100, n, per_row=True), bias=bias, out_dtype=out_dtype)


@pytest.mark.parametrize("m", [9, 40, 70])
def test_weight_only_bf16_activations(m, amx_variant):
    x = torch.randn(m, 150, dtype=torch.bfloat16)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(70, 150))
    out = fp8linear.scaled_mm(x, w.t(), torch.ones(()), scale_w, out_dtype=torch.float32)
    exact = x.double() @ (w.double() * scale_w.double()).t()
    assert relative_error(out, exact) <= 1e-5


def test_subnormal_bf16_activations_are_taken_as_zero(amx_variant):
    # TDPBF16PS treats bf16 denormals as zero (widened fp8 values never are: the smallest,
    # 2^-16, is a normal bf16); weight-only activations can be, and the model must agree
    x = torch.full((16, 64), 1e-39, dtype=torch.bfloat16)
    assert x[0, 0].item() != 0  # a bf16 subnormal
    w, scale_w = fp8linear.quantize_fp8(torch.ones(32, 64))
    bias = torch.randn(32)
    out = fp8linear.scaled_mm(x, w.t(), torch.ones(()), scale_w, bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(16, 32))


@pytest.mark.parametrize("m, k, n", [(40, 300, 200), (600, 300, 200), (300, 2100, 130)])
def test_block_wise_one_and_two_threads_agree_bit_for_bit(m, k, n, amx_variant):
    # with two threads the second one's weight rows start past 0 (n_begin > 0), in the
    # stream, full-K (two row chunks at M = 600) and panel kernels; block-wise scales
    # are looked up by absolute row and column, so both splits must give the same bits
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block")
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
        torch.set_num_threads(2)
        double = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w.t(), out_dtype=torch.float32)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(single, double)
    assert relative_error(single, reference.scaled_mm_float64(a, w.t(), scale_a, scale_w.t())) <= 1e-5


@pytest.mark.parametrize("m", [3, 16, 40, 300, 700])
def test_one_and_two_threads_agree_bit_for_bit(m, amx_variant):
    a, b, scale_a, scale_b = _operands(m, 450, 200)
    single, double = scaled_mm_on_1_and_2_threads(a, b, scale_a, scale_b)
    assert torch.equal(single, double)
    assert relative_error(single, reference.scaled_mm_float64(a, b, scale_a, scale_b)) <= 1e-5


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX hardware")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("m, k, n", [(5, 64, 16), (16, 577, 100), (40, 1025, 70), (64, 300, 513), (200, 700, 130),
                                     (600, 260, 600)])
def test_model_matches_hardware_bit_for_bit(dtype, m, k, n):
    a, b, scale_a, scale_b = _operands(m, k, n, dtype)
    x = torch.randn(m, k, dtype=torch.bfloat16)  # weight-only: bf16 activations, normal values
    results = {}
    for variant in ("amx", "amx_emulated"):
        with forced_cpu_variant(variant):
            results[variant] = (fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32),
                                fp8linear.scaled_mm(x, b, torch.ones(()), scale_b, out_dtype=torch.float32))
    for hardware, model in zip(results["amx"], results["amx_emulated"]):
        assert torch.equal(hardware, model)


@pytest.mark.skipif(not HAS_AMX, reason="needs AMX hardware")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("m", [16, 100])  # stream and panel kernels
def test_model_matches_hardware_near_the_denormal_range(dtype, m):
    # bf16 activations ~2^-118 times fp8 weights (2^-16 .. 57344): products and partial
    # sums fall on both sides of float32's smallest normal, where TDPBF16PS takes inputs
    # as zero and flushes results; some activations are bf16 denormals themselves
    x = (torch.randn(m, 640) * 2.0**-118).to(torch.bfloat16)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(48, 640), dtype=dtype)
    results = {}
    for variant in ("amx", "amx_emulated"):
        with forced_cpu_variant(variant):
            results[variant] = fp8linear.scaled_mm(x, w.t(), torch.ones(()), torch.ones(()), out_dtype=torch.float32)
    hardware = results["amx"]
    assert torch.count_nonzero(hardware) > hardware.numel() // 2
    assert torch.equal(hardware.view(torch.int32), results["amx_emulated"].view(torch.int32))


def test_tiles_shared_with_onednn_and_other_threads(amx_variant):
    # torch's bf16 linear runs oneDNN, which uses AMX on these CPUs and keeps its tile
    # configuration between calls: fp8linear restores what it finds, on every thread
    x = torch.randn(300, 512, dtype=torch.bfloat16)
    w16 = torch.randn(384, 512, dtype=torch.bfloat16)
    bf16_before = F.linear(x, w16)
    cases = [_operands(m, 512, 384) for m in (8, 40, 300)]
    ours_before = [fp8linear.scaled_mm(*case, out_dtype=torch.float32) for case in cases]
    for _ in range(3):
        for case, expected in zip(cases, ours_before):
            assert torch.equal(F.linear(x, w16), bf16_before)
            assert torch.equal(fp8linear.scaled_mm(*case, out_dtype=torch.float32), expected)
    # concurrent calls from several Python threads: each has its own tiles and scratch
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fp8linear.scaled_mm, *case, out_dtype=torch.float32) for case in cases * 4]
        for future, expected in zip(futures, ours_before * 4):
            assert torch.equal(future.result(), expected)
    assert torch.equal(F.linear(x, w16), bf16_before)
