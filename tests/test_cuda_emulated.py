"""fp8linear's CUDA kernels run on the CPU under a SIMT emulator (tests/cuda_emulator,
built by tests/cuda_emulation.py), against the reference: every kernel family, on
emulated devices of each generation, with the launchers' path choices and refusals.

What this checks without a GPU: the kernels' indexing, tiling and edge handling, their
warp collectives and barriers, the k-permutation the tensor-core kernels share with
their mma.sync fragments (the emulated mma follows the PTX ISA's fragment layouts), the
block-wise scales, and the launchers' choices. What it cannot: cuBLASLt, timing, memory
coherence between threads, and whether real tensor cores read their fragments as the
PTX ISA says (tests/test_cuda.py on a GPU, benchmarks/gpu_check.sh).
"""
import functools
import itertools

import pytest
import torch

import cuda_emulation
import fp8linear
from conftest import FLOAT_DTYPES, FP8_DTYPES, relative_error
from fp8linear import reference
import test_cuda
from test_cuda import TOLERANCE, _assert_each_element_close, _k_contiguous  # the GPU tests' bounds and rules
from test_guard_pages import GuardedMemory

pytestmark = pytest.mark.skipif(cuda_emulation.cuda_home() is None, reason="needs the CUDA toolkit's headers")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# emulated devices (tests/cuda_emulator/emulator.cpp): index -> (capability, what our kernels run as)
H100, ADA, A100, T4, H100_SM80_BUILD, ADA_NO_CODE = range(6)
PATHS = ("auto", "gemm", "gemv", "upconvert", "generic")


@pytest.fixture(scope="module")
def emulated():
    return cuda_emulation.build()


@pytest.fixture(autouse=True)
def _no_undefined_behaviour():
    """The emulated kernels run under UBSan: a report (a misaligned access, which faults on
    a GPU; an out-of-range shift; an overflow) fails the test that made it."""
    cuda_emulation.ubsan_reports()
    yield
    reports = cuda_emulation.ubsan_reports()
    assert not reports, reports


# the GPU tests' operands, on the CPU
_operands = functools.partial(test_cuda._operands, device="cpu")
_blockwise_operands = functools.partial(test_cuda._blockwise_operands, device="cpu")


def _kernel_capability(emulated, device):
    major, minor, _, arch = emulated.device(device)
    return min(10 * major + minor, arch)


def _can_run(emulated, device, path, a, b, out_dtype):
    """Whether a forced path takes this call (csrc/cuda/scaled_mm.cu's rules)."""
    k = a.shape[1]
    if path in ("auto", "generic") or k == 0:
        return True
    capability = _kernel_capability(emulated, device)
    if path in ("gemm", "gemv"):
        return capability >= 89 and a.dtype in FP8_DTYPES and _k_contiguous(a, b)
    return capability >= 80 and a.dtype != torch.float32 and _k_contiguous(a, b)  # upconvert


def _expected_path(path, a, b, rows=None):
    """The family that runs a call `path` takes on H100/Ada (cuBLASLt is not emulated,
    so 'auto' takes our kernels: the GEMV up to 64 rows, the GEMM above); `rows`: those
    of the call's last launch, if it is launched in parts."""
    if path != "auto":
        return path
    if a.dtype == torch.float32 or not _k_contiguous(a, b):
        return "generic"
    if a.dtype not in FP8_DTYPES:
        return "upconvert"
    return "gemv" if (a.shape[0] if rows is None else rows) <= 64 else "gemm"


def _check(emulated, path, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, device=H100, last_rows=None):
    what = f"path {path}, device {device}, a {tuple(a.shape)} {a.dtype}, out {out_dtype}"
    if not _can_run(emulated, device, path, a, b, out_dtype):
        with pytest.raises(RuntimeError, match=f"forced path '{path}' cannot run this call"):
            emulated.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, path, device)
        return None
    out, used = emulated.scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, path, device)
    assert out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    if a.shape[1] > 0 and out.numel() and device in (H100, ADA):
        assert used == _expected_path(path, a, b, last_rows), what
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b, bias=bias)
    if out.numel():
        error = relative_error(out, exact)
        assert error <= TOLERANCE[out_dtype], f"relative error {error:.2e}: {what}"
        _assert_each_element_close(out, exact, out_dtype, what)
    return out


@pytest.fixture(params=PATHS)
def path(request):
    return request.param


# ---- the emulator itself ------------------------------------------------------------

def test_emulator_shuffles_and_shared_memory(emulated):
    lanes = torch.arange(64, dtype=torch.float32)
    assert torch.equal(emulated.probe("shuffle")[0], (lanes.int() ^ 5).float())
    # width 16: a source in a later segment gives the lane its own value, an earlier one its value
    lane = lanes.int() % 32
    expected = torch.where(lane < 16, lanes.int(), lanes.int() ^ 17).float()
    assert torch.equal(emulated.probe("shuffle_width")[0], expected)
    out = emulated.probe("shared", blocks=3)
    for block in range(3):
        assert torch.equal(out[block], lanes.flip(0) + 1000 * block)


def test_emulator_shows_unwritten_shared_memory_and_missing_barriers(emulated):
    # shared memory holds NaN until written, whatever an earlier block left there
    out = emulated.probe("shared_unwritten", blocks=2)
    assert torch.isnan(out[:, :32]).all() and torch.equal(out[:, 32:], torch.ones(2, 32))
    # a read of another thread's write with no barrier between: ascending order (block 0)
    # reads the later thread's value before it is written, descending order (block 1) the earlier's
    out = emulated.probe("missing_barrier", blocks=2)
    lanes = torch.arange(64)
    assert torch.isnan(out[0, lanes % 2 == 0]).all() and torch.isnan(out[1, lanes % 2 == 1]).all()


@pytest.mark.parametrize("probe, message", [("shuffle_after_exit", "waits for a lane that has exited"),
                                            ("deadlock", "deadlock"),
                                            ("divergent_barrier", "different __syncthreads"),
                                            ("too_many_threads", "invalid launch configuration")])
def test_emulator_reports_faults(emulated, probe, message):
    with pytest.raises(RuntimeError, match=message):
        emulated.probe(probe)
    assert torch.equal(emulated.probe("shuffle")[0], (torch.arange(64) ^ 5).float())  # and runs on after one


def test_an_earlier_pending_error_is_not_blamed_on_our_kernels(emulated):
    emulated.probe("leave_pending")  # a failed launch whose error nobody read
    a, b, scale_a, scale_b = _operands(4, 64, 32)
    with pytest.raises(RuntimeError, match="a CUDA error raised before this call was pending"):
        emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "auto", H100)
    _check(emulated, "auto", a, b, scale_a, scale_b)  # cleared: the next call runs


def test_rewrite_of_launches_and_shared_declarations():
    text = ("x;\n  k<A, B<C>, true><<<dim3(f(a), 2), kThreads, 0, stream>>>(*p, g(1), 2);\n  plain<<<1, 2>>>();\n"
            "  __shared__ __align__(16) uint8_t tile[2][kM * S::kPitch];\n  __shared__ float sums[kWarps / 32];\n")
    assert cuda_emulation.rewrite(text) == (
        "x;\n  fp8emu::launch(dim3(f(a), 2), kThreads, 0, stream, [&] { k<A, B<C>, true>(*p, g(1), 2); });\n"
        "  fp8emu::launch(1, 2, [&] { plain(); });\n"
        "  __shared__ __align__(16) uint8_t tile[2][kM * S::kPitch]; fp8emu::shared_declared(tile, sizeof tile);\n"
        "  __shared__ float sums[kWarps / 32]; fp8emu::shared_declared(sums, sizeof sums);\n")
    with pytest.raises(ValueError, match="launch"):
        cuda_emulation.rewrite("k<<<1, 2>>>(unterminated")
    with pytest.raises(ValueError, match="__shared__"):
        cuda_emulation.rewrite("__shared__ float scalar;")


# ---- scaled_mm: every path on an emulated H100 ----------------------------------------

# every GEMV token tiling (M 1-8, 9-16, 17-64) and the GEMM above; K and N aligned,
# unaligned, smaller than one tile, and one row or column
MM_SHAPES = [(1, 512, 256), (2, 256, 512), (8, 255, 64), (16, 1024, 1025), (17, 64, 48), (33, 1025, 96),
             (64, 576, 136), (65, 136, 576), (130, 257, 33), (200, 512, 264), (3, 1, 5), (19, 130, 37), (1, 16, 1)]


@pytest.mark.parametrize("m, k, n", MM_SHAPES)
def test_paths_over_shapes(emulated, path, m, k, n):
    _check(emulated, path, *_operands(m, k, n))
    _check(emulated, path, *_operands(m, k, n, per_row=True), out_dtype=torch.float32)


@pytest.mark.parametrize("a_dtype, b_dtype", list(itertools.product(FP8_DTYPES, FP8_DTYPES)))
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("per_row, per_column", [(False, False), (True, True), (True, False), (False, True)])
@pytest.mark.parametrize("m, k, n", [(5, 160, 48), (100, 130, 37)])
def test_paths_formats_dtypes_and_scales(emulated, path, a_dtype, b_dtype, out_dtype, per_row, per_column, m, k, n):
    _check(emulated, path, *_operands(m, k, n, a_dtype, b_dtype, per_row, per_column), out_dtype=out_dtype)


@pytest.mark.parametrize("bias_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m", [3, 70])
def test_paths_bias(emulated, path, bias_dtype, out_dtype, m):
    _check(emulated, path, *_operands(m, 256, 64), bias=torch.randn(64).to(bias_dtype), out_dtype=out_dtype)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 1024, 96), (16, 77, 33), (40, 512, 96), (100, 255, 130)])
def test_paths_weight_only(emulated, path, x_dtype, m, k, n):
    x = torch.randn(m, k).to(x_dtype)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k))
    for scale_b in (scale_w, scale_w.expand(1, n).contiguous() * torch.rand(1, n)):
        _check(emulated, path, x, w.t(), torch.ones(()), scale_b, out_dtype=x_dtype)


def test_paths_strides(emulated, path):
    a, b, scale_a, scale_b = _operands(20, 70, 30)
    big_a = torch.zeros(40, 140, dtype=a.dtype)
    big_a[::2, ::2] = a
    unaligned = torch.zeros(20 * 70 + 1, dtype=torch.uint8)
    unaligned_a = unaligned[1:].view(a.dtype).view(20, 70)  # rows at odd addresses
    unaligned_a.copy_(a)
    expanded_scale = scale_a.reshape(1, 1).expand(20, 1)
    for a_, b_, sa in [(big_a[::2, ::2], b, scale_a), (a, b.contiguous(), scale_a), (a.t().contiguous().t(), b, scale_a),
                       (unaligned_a, b, scale_a), (a, b, expanded_scale), (big_a[::2, :70], b, scale_a)]:
        _check(emulated, path, a_, b_, sa, scale_b)


@pytest.mark.parametrize("m", [17, 64, 80])
def test_paths_expanded_rows(emulated, path, m):
    a, w, scale_a, scale_w = _operands(1, 256, 128)
    _check(emulated, path, a.expand(m, 256), w, scale_a, scale_w)


@pytest.mark.parametrize("m, n", [(1, 48), (20, 1), (1, 1)])
def test_paths_single_row_with_strided_k(emulated, path, m, n):
    a, b, scale_a, scale_b = _operands(m, 64, n)
    spread_a = torch.zeros(m, 128, dtype=a.dtype)
    spread_a[:, ::2] = a
    spread_w = torch.zeros(n, 128, dtype=b.dtype)
    spread_w[:, ::2] = b.t()
    for a_, b_ in [(spread_a[:, ::2], b), (a, spread_w[:, ::2].t()), (spread_a[:, ::2], spread_w[:, ::2].t())]:
        _check(emulated, path, a_, b_, scale_a, scale_b)


@pytest.mark.parametrize("m, k, n", [(4, 0, 16), (33, 0, 16), (0, 5, 7), (4, 5, 0), (0, 0, 0)])
def test_paths_empty_and_k_zero(emulated, path, m, k, n):
    a = torch.zeros(m, k).to(E4M3)
    b = torch.zeros(k, n).to(E4M3)
    one = torch.ones(())
    out, _ = emulated.scaled_mm(a, b, one, one, None, torch.float32, path, H100)
    assert out.shape == (m, n) and torch.all(out == 0)
    bias = torch.randn(n)
    for scale in (1.0, float("inf"), float("nan")):  # K = 0: the bias, whatever the scales
        out, _ = emulated.scaled_mm(a, b, torch.tensor(scale) if k == 0 else one, one, bias, torch.float32, path, H100)
        assert out.shape == (m, n) and torch.equal(out, bias.expand(m, n))


def test_paths_unaligned_scale_vectors(emulated, path):
    # per-row and per-column scales 4 bytes into a larger tensor, read in place
    a, b, scale_a, scale_b = _operands(32, 256, 64, per_row=True)
    padded_a = torch.zeros(33, 1)
    padded_a[1:] = scale_a
    padded_b = torch.zeros(1, 65)
    padded_b[:, 1:] = scale_b
    assert padded_a[1:].data_ptr() % 16 == 4 and padded_b[:, 1:].is_contiguous()
    _check(emulated, path, a, b, padded_a[1:], padded_b[:, 1:])


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_paths_nan_propagates(emulated, path, out_dtype):
    a, b, scale_a, scale_b = _operands(20, 96, 48)
    a = a.clone()
    a.view(torch.uint8)[1, 7] = 0x7F  # NaN in row 1
    w = b.t().clone()
    w.view(torch.uint8)[5, 50] = 0xFF  # NaN in column 5
    out, _ = emulated.scaled_mm(a, w.t(), scale_a, scale_b, None, out_dtype, path, H100)
    nan = torch.zeros(20, 48, dtype=torch.bool)
    nan[1, :] = True
    nan[:, 5] = True
    assert torch.equal(torch.isnan(out), nan)


@pytest.mark.parametrize("scheme", ["per-row", "block", "weight-only"])
def test_paths_more_rows_than_one_launch(emulated, path, scheme):
    # above 2^20 rows a call is launched in parts (scaled_mm.cu), each with its rows of a,
    # scale_a and out; here the limit is lowered to 96 rows, so that M = 250 takes three
    # (96, 96, 58: auto takes the GEMM for the first two and the GEMV for the last)
    m, k, n = 250, 160, 48
    previous = emulated.set_max_launch_rows(96)
    try:
        if scheme == "per-row":
            _check(emulated, path, *_operands(m, k, n, per_row=True), last_rows=58)
        elif scheme == "block":
            _check(emulated, path, *_blockwise_operands(m, k, n), last_rows=58)
        else:
            w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="row")
            _check(emulated, path, torch.randn(m, k).to(torch.bfloat16), w.t(), torch.ones(()), scale_w.t(),
                   out_dtype=torch.float32, last_rows=58)
    finally:
        emulated.set_max_launch_rows(previous)


# Operands that end right before (or start right after) a PROT_NONE page: a kernel reading
# past a row's end, or before its start, faults at once (the tests of the CPU kernels'
# test_guard_pages.py; here the emulated kernels read the CPU tensors themselves).
@pytest.mark.parametrize("side", ["end", "start"])
@pytest.mark.parametrize("m, k, n", [(1, 17, 3), (3, 63, 65), (9, 33, 15), (17, 129, 31), (65, 255, 17), (70, 130, 40)])
def test_paths_on_guarded_operands(emulated, path, side, m, k, n):
    memory = GuardedMemory()
    a, b, scale_a, scale_b = _operands(m, k, n, per_row=True)
    weight = memory.tensor(b.t().contiguous(), side)
    _check(emulated, path, memory.tensor(a, side), weight.t(), memory.tensor(scale_a, side),
           memory.tensor(scale_b.contiguous(), side), bias=memory.tensor(torch.randn(n), side))
    x = memory.tensor(torch.randn(m, k, dtype=torch.bfloat16), side)
    _check(emulated, path, x, weight.t(), torch.ones(()), scale_b)
    a, b, scale_a, scale_b = _blockwise_operands(m, k, n)
    _check(emulated, path, memory.tensor(a, side), memory.tensor(b.t().contiguous(), side).t(),
           memory.tensor(scale_a, side), memory.tensor(scale_b.t().contiguous(), side).t())


@pytest.mark.parametrize("side", ["end", "start"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 130), (33, 1000)])
def test_quantize_on_guarded_inputs(emulated, side, shape):
    memory = GuardedMemory()
    for x_dtype in FLOAT_DTYPES:
        x = memory.tensor(_inputs(shape, x_dtype), side)
        _same(emulated.quantize_fp8(x, None, E4M3, False, H100), fp8linear.quantize_fp8(x))
        _same(emulated.quantize_fp8(x, None, E4M3, True, H100), fp8linear.quantize_fp8(x, granularity="row"))
        scale = memory.tensor(torch.tensor([0.5]), side).reshape(())
        _same(emulated.quantize_fp8(x, scale, E4M3, False, H100), fp8linear.quantize_fp8(x, scale=scale))


# ---- block-wise 128 x 128 weights with per-token groups of 128 --------------------------

@pytest.mark.parametrize("m, k, n", [(1, 300, 260), (9, 256, 130), (16, 1024, 256), (40, 1000, 200),
                                     (70, 576, 264), (130, 640, 136)])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_paths_blockwise(emulated, path, m, k, n, out_dtype):
    a, b, scale_a, scale_b = _blockwise_operands(m, k, n)
    _check(emulated, path, a, b, scale_a, scale_b, bias=torch.randn(n), out_dtype=out_dtype)
    x = torch.randn(m, k, dtype=torch.bfloat16)  # weight-only
    _check(emulated, path, x, b, torch.ones(()), scale_b, out_dtype=out_dtype)


@pytest.mark.parametrize("m", [20, 68])
def test_paths_blockwise_row_slices_and_e5m2(emulated, path, m):
    k, n = 640, 256
    _, b, _, scale_b = _blockwise_operands(m, k, n)
    wide, wide_scale = fp8linear.quantize_fp8(torch.randn(m, k + 256), granularity="group")
    _check(emulated, path, wide[:, :k], b, wide_scale[:, :k // 128], scale_b)  # scales with their own row stride
    a5, _, scale_a5, _ = _blockwise_operands(m, k, n, a_dtype=E5M2)
    _check(emulated, path, a5, b, scale_a5, scale_b, out_dtype=torch.float16)


# ---- devices of each generation: choices and refusals -------------------------------------

@pytest.mark.parametrize("device", [ADA, A100, T4, H100_SM80_BUILD])
@pytest.mark.parametrize("m", [3, 40, 100])
def test_paths_on_older_devices(emulated, path, device, m):
    _check(emulated, path, *_operands(m, 200, 72), device=device)
    x = torch.randn(m, 200, dtype=torch.float16)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(72, 200))
    _check(emulated, path, x, w.t(), torch.ones(()), scale_w, device=device)
    _check(emulated, path, *_blockwise_operands(m, 200, 72), device=device)


@pytest.mark.parametrize("device, fp8, widened", [(H100, "gemv", "upconvert"), (ADA, "gemv", "upconvert"),
                                                  (A100, "upconvert", "upconvert"), (T4, "generic", "generic"),
                                                  (H100_SM80_BUILD, "upconvert", "upconvert")])
def test_auto_picks_the_documented_path(emulated, device, fp8, widened):
    a, b, scale_a, scale_b = _operands(8, 128, 64)
    assert emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "auto", device)[1] == fp8
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    assert emulated.scaled_mm(x, b, torch.ones(()), scale_b, None, torch.bfloat16, "auto", device)[1] == widened
    x32 = torch.randn(8, 128)
    assert emulated.scaled_mm(x32, b, torch.ones(()), scale_b, None, torch.float32, "auto", device)[1] == "generic"


@pytest.mark.parametrize("m, fallback", [(32, "gemv"), (100, "gemm")])
def test_auto_falls_back_when_cublaslt_declines_at_run_time(emulated, m, fallback):
    # an emulated cuBLASLt that takes every call and then has no algorithm for it
    a, b, scale_a, scale_b = _operands(m, 256, 128)
    emulated.set_cublaslt_accepts(True)
    try:
        out, used = emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "auto", H100)
        assert used == fallback
        assert relative_error(out, reference.scaled_mm_float64(a, b, scale_a, scale_b)) <= TOLERANCE[torch.bfloat16]
        with pytest.raises(RuntimeError, match="forced path 'cublaslt' cannot run this call: the emulated cuBLASLt"):
            emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "cublaslt", H100)
    finally:
        emulated.set_cublaslt_accepts(False)


def test_refusals_name_the_reason(emulated):
    a, b, scale_a, scale_b = _operands(8, 128, 64)
    with pytest.raises(RuntimeError, match="rebuild with it"):
        emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "gemv", H100_SM80_BUILD)
    with pytest.raises(RuntimeError, match="no code for this device's architecture"):
        emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "gemm", ADA_NO_CODE)
    # auto there, and a call with no products (which the generic kernel would answer): said
    # before anything is launched (the GPU has no image of any of our kernels), with the fix
    for k in (64, 0):
        with pytest.raises(RuntimeError, match=r"no code for this device's architecture \(compute capability 8\.9.*"
                                               r"add \"8\.9\" to TORCH_CUDA_ARCH_LIST"):
            emulated.scaled_mm(a[:, :k], b[:k], scale_a, scale_b, None, torch.bfloat16, "auto", ADA_NO_CODE)
    with pytest.raises(RuntimeError, match="cannot run this call"):
        emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "cublaslt", H100)
    out, used = emulated.scaled_mm(a, b, scale_a, scale_b, None, torch.bfloat16, "auto", H100)  # and on after
    assert used == "gemv" and not torch.isnan(out).any()


# ---- quantize_fp8: bit for bit what the CPU op gives ----------------------------------------

def _same(got, expected):
    q, scale = got
    q_expected, scale_expected = expected
    assert q.dtype == q_expected.dtype and torch.equal(q.view(torch.uint8), q_expected.view(torch.uint8))
    assert torch.equal(scale.reshape(scale_expected.shape), scale_expected)


def _inputs(shape, x_dtype):
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])
    return x.to(x_dtype)


@pytest.mark.parametrize("shape", [(1, 1), (3, 1000), (64, 4096), (257, 33), (5000,), (2, 3, 130)])
@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_dynamic_and_static(emulated, shape, x_dtype, dtype):
    x = _inputs(shape, x_dtype)
    _same(emulated.quantize_fp8(x, None, dtype, False, H100), fp8linear.quantize_fp8(x, dtype=dtype))
    if len(shape) > 1:
        _same(emulated.quantize_fp8(x, None, dtype, True, H100), fp8linear.quantize_fp8(x, dtype=dtype, granularity="row"))
        rows = torch.rand(*shape[:-1], 1) + 0.01
        _same(emulated.quantize_fp8(x, rows, dtype, True, H100),
              fp8linear.quantize_fp8(x, dtype=dtype, granularity="row", scale=rows))
    scale = torch.tensor(0.37)
    _same(emulated.quantize_fp8(x, scale, dtype, False, H100), fp8linear.quantize_fp8(x, dtype=dtype, scale=scale))


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_edge_values(emulated, x_dtype, dtype):
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e30, -1e30, float("inf"), float("-inf"), float("nan"), 448.0,
                            464.0, 57344.0, 61440.0, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 3.0 * 2.0**-10])
    x = torch.cat([special, torch.randn(300)]).reshape(2, -1).to(x_dtype)
    for scale in (torch.tensor(1.0), torch.tensor(2.0**-8), torch.tensor(1000.0)):
        _same(emulated.quantize_fp8(x, scale, dtype, False, H100), fp8linear.quantize_fp8(x, dtype=dtype, scale=scale))
    _same(emulated.quantize_fp8(x, None, dtype, True, H100), fp8linear.quantize_fp8(x, dtype=dtype, granularity="row"))
    _same(emulated.quantize_fp8(x, None, dtype, False, H100), fp8linear.quantize_fp8(x, dtype=dtype))
    zeros = torch.zeros(3, 40, dtype=x_dtype)  # all zero: the floor scale, never 0 or NaN
    _same(emulated.quantize_fp8(zeros, None, dtype, False, H100), fp8linear.quantize_fp8(zeros, dtype=dtype))
    _same(emulated.quantize_fp8(zeros, None, dtype, True, H100),
          fp8linear.quantize_fp8(zeros, dtype=dtype, granularity="row"))


def test_quantize_strided(emulated):
    x = torch.randn(40, 300)
    for view in (x[:, ::3], x.t(), x[5:9, 7:200], x[::2]):
        _same(emulated.quantize_fp8(view, None, E4M3, False, H100), fp8linear.quantize_fp8(view))
        _same(emulated.quantize_fp8(view, None, E4M3, True, H100), fp8linear.quantize_fp8(view, granularity="row"))


@pytest.mark.parametrize("shape", [(4, 128), (33, 1024), (1, 7168)])
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_ue8m0_groups(emulated, shape, dtype):
    x = _inputs(shape, torch.bfloat16)
    q, scale = emulated.quantize_rows_power_of_two(x.reshape(-1, 128), dtype)
    _same((q.reshape(shape), scale.reshape(shape[0], -1)),
          fp8linear.quantize_fp8(x, dtype=dtype, granularity="group", scale_fmt="ue8m0"))
