"""scaled_mm on CUDA against fp8linear.reference and torch._scaled_mm, with each path
forced in turn; FP8Linear on CUDA. Marked `cuda`: skipped without a GPU (conftest.py).
quantize_fp8's CUDA tests are in test_cuda_quantize.py.

scaled_mm is compared with the float64 product of the dequantized operands, computed
on the GPU so that Llama-sized shapes stay fast.
"""
import itertools

import pytest
import torch

import fp8linear
from conftest import FLOAT_DTYPES, FP8_DTYPES, forced, relative_error
from fp8linear import reference
from fp8linear._native import native

pytestmark = pytest.mark.cuda

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
PATHS = ("auto", "cublaslt", "gemm", "gemv", "upconvert", "generic")


def _device_capability():
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def _capability():
    """What our kernels can use on this GPU: its capability, or less where the build's
    TORCH_CUDA_ARCH_LIST has no code that new for it (cuda_kernel_arch)."""
    if not torch.cuda.is_available() or not native().cuda_built():
        return (0, 0)
    arch = native().cuda_kernel_arch(torch.cuda.current_device())
    return min(_device_capability(), divmod(arch, 10))


def _forced(path):
    """The scaled_mm CUDA path `path` while the block runs, the previous one after."""
    module = native()
    return forced(module.cuda_path, module.set_cuda_path, path)


@pytest.fixture(params=PATHS)
def path(request):
    """Each scaled_mm path in turn; those this GPU generation lacks are skipped."""
    needs = {"cublaslt": (8, 9), "gemm": (8, 9), "gemv": (8, 9), "upconvert": (8, 0)}.get(request.param, (0, 0))
    # cuBLASLt goes by the GPU, our kernels by the code this build has for it
    have = _device_capability() if request.param == "cublaslt" else _capability()
    if have < needs:
        pytest.skip(f"path '{request.param}' needs compute capability {needs}, this GPU (build) gives {have}")
    with _forced(request.param):
        yield request.param


def _k_contiguous(a, b):
    """Whether a's rows and b's columns (w's rows) are K-contiguous, as the tensor-core kernels need."""
    return a.shape[1] <= 1 or (a.stride(1) == 1 and b.stride(0) == 1)


def _can_run(path, a, b, scale_a, scale_b, bias, out_dtype):
    """Whether a forced path takes this call (the rules of csrc/cuda/scaled_mm.cu and
    cublaslt.cu); when it does not, the op must raise rather than fall back."""
    m, k = a.shape
    n = b.shape[1]
    if path in ("auto", "generic") or k == 0 or m == 0 or n == 0:
        return True
    k_blocks = -(-k // 128)
    a_blocked = scale_a.dim() == 2 and scale_a.shape[1] == k_blocks != 1
    b_blocked = scale_b.dim() == 2 and scale_b.numel() != 1 and tuple(scale_b.shape) != (1, n)
    blocked = a_blocked or b_blocked
    k_contiguous = _k_contiguous(a, b)
    a_fp8 = a.dtype in FP8_DTYPES
    if path in ("gemm", "gemv"):
        return a_fp8 and k_contiguous
    if path == "upconvert":
        return a.dtype != torch.float32 and k_contiguous
    lda = k if m == 1 else a.stride(0)
    ldb = k if n == 1 else b.stride(1)
    aligned = all(t.data_ptr() % 16 == 0 for t in (a, b)) and (bias is None or bias.data_ptr() % 16 == 0)
    vectors = scale_a.numel() != 1 or scale_b.numel() != 1
    # float32 output is refused: the fp8 tensor cores' 13-bit partial sums inside
    # cuBLASLt miss float32 accuracy (see csrc/cuda/cublaslt.cu)
    layout_ok = (a_fp8 and not (a.dtype == b.dtype == E5M2) and out_dtype != torch.float32
                 and a.stride(1) == 1 and b.stride(0) == 1 and k % 16 == 0 and n % 16 == 0
                 and lda % 16 == 0 and ldb % 16 == 0 and lda >= k and ldb >= k and aligned)
    if blocked:
        # cuBLASLt's block scaling (sm_90): per-token groups with 128 x 128 weight blocks,
        # whole blocks, e4m3, M a multiple of 4, no bias
        return (layout_ok and a_blocked and b_blocked and _device_capability()[0] == 9 and a.dtype == b.dtype == E4M3
                and k % 128 == 0 and n % 128 == 0 and m % 4 == 0 and bias is None)
    # per-row/column scale vectors are handed to cuBLASLt only 16-byte aligned
    vectors_aligned = all(s.numel() == 1 or s.data_ptr() % 16 == 0 for s in (scale_a, scale_b))
    return (layout_ok and (not vectors or (_device_capability()[0] == 9 and vectors_aligned))
            and (bias is None or bias.dtype == out_dtype))


def _operands(m, k, n, a_dtype=E4M3, b_dtype=E4M3, per_row=False, per_column=None, device="cuda"):
    """a [M, K] and b = w.t() for a weight w [N, K], quantized on `device` (the GPU; the
    CPU for test_cuda_emulated.py)."""
    per_column = per_row if per_column is None else per_column
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k, device=device), dtype=a_dtype,
                                        granularity="row" if per_row else "tensor")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k, device=device), dtype=b_dtype,
                                        granularity="row" if per_column else "tensor")
    return a, w.t(), scale_a, scale_w.t() if per_column else scale_w


def _check(path, a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16):
    """scaled_mm on the forced path against the float64 reference (or the refusal)."""
    if not _can_run(path, a, b, scale_a, scale_b, bias, out_dtype):
        with pytest.raises(RuntimeError, match=f"forced path '{path}' cannot run this call"):
            fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
        return None
    _poison_next_output(a.shape[0], b.shape[1], out_dtype)
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
    assert out.device == a.device and out.dtype == out_dtype and out.shape == (a.shape[0], b.shape[1])
    if path != "auto" and a.shape[1] > 0 and out.numel():
        assert native().cuda_last_path() == path
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b, bias=bias)
    error = relative_error(out, exact)
    assert error <= TOLERANCE[out_dtype], f"relative error {error:.2e} on path {path}"
    _assert_each_element_close(out, exact, out_dtype, path)
    return out


# Per element: the output dtype's rounding of the element itself, plus a floor scaled by
# its row's magnitude (sums of many products cancel, so an element can be far smaller
# than the terms it was summed from). A whole-matrix error of 1e-2 lets a few wrong or
# unwritten elements of a large output pass; this does not.
ELEMENT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}


def _assert_each_element_close(out, exact, out_dtype, path):
    if not out.numel():
        return
    out = out.double()
    assert not torch.isnan(out).any(), f"NaN (unwritten?) elements on path {path}"
    tolerance = ELEMENT_TOLERANCE[out_dtype]
    row_rms = exact.pow(2).mean(dim=1, keepdim=True).sqrt()
    bound = tolerance * exact.abs() + 4 * tolerance * row_rms + 1e-30
    worst = ((out - exact).abs() / bound).max().item()
    assert worst <= 1.0, f"an element is {worst:.1f}x its bound on path {path}"


def _poison_next_output(m, n, out_dtype):
    """Fill a block of the output's size with NaN and free it: torch's caching allocator
    hands that block to the next allocation of the same size, so an element the kernel
    does not write stays NaN instead of holding an earlier call's correct result."""
    if m * n:
        torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")


# ---- scaled_mm: every path --------------------------------------------------------

# Aligned (cuBLASLt's), unaligned K or N (4095, 4097), tiny and odd; M from 1 to 4096.
MM_SHAPES = [(1, 4096, 4096), (2, 256, 512), (8, 4095, 64), (16, 4096, 4097), (17, 64, 48), (33, 4097, 96),
             (64, 576, 1536), (65, 1536, 576), (257, 4095, 33), (1024, 1024, 1024), (3, 1, 5), (19, 130, 37),
             (4096, 4096, 4096), (4096, 4095, 4097)]


@pytest.mark.parametrize("m, k, n", MM_SHAPES)
def test_paths_over_shapes(path, m, k, n):
    _check(path, *_operands(m, k, n))


@pytest.mark.parametrize("a_dtype, b_dtype", list(itertools.product(FP8_DTYPES, FP8_DTYPES)))
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("per_row, per_column", [(False, False), (True, True), (True, False), (False, True)])
@pytest.mark.parametrize("m, k, n", [(5, 160, 48), (100, 130, 37)])
def test_paths_formats_dtypes_and_scales(path, a_dtype, b_dtype, out_dtype, per_row, per_column, m, k, n):
    _check(path, *_operands(m, k, n, a_dtype, b_dtype, per_row, per_column), out_dtype=out_dtype)


@pytest.mark.parametrize("bias_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m", [3, 200])
@pytest.mark.parametrize("per_row", [False, True])
def test_paths_bias(path, bias_dtype, out_dtype, m, per_row):
    # per_row: outer-vector scales with the bias epilogue on sm_90's cuBLASLt, a combination
    # its documentation neither allows nor rules out (a forced 'cublaslt' that it refuses
    # fails here: then _can_run and the acceptance rule in cublaslt.cu must learn it)
    bias = torch.randn(64, device="cuda").to(bias_dtype)
    _check(path, *_operands(m, 256, 64, per_row=per_row), bias=bias, out_dtype=out_dtype)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 4096, 512), (16, 77, 33), (40, 1024, 96), (300, 4095, 130)])
def test_paths_weight_only(path, x_dtype, m, k, n):
    x = torch.randn(m, k, device="cuda").to(x_dtype)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k, device="cuda"))
    for scale_b in (scale_w, scale_w.expand(1, n).contiguous() * torch.rand(1, n, device="cuda")):
        _check(path, x, w.t(), torch.ones((), device="cuda"), scale_b, out_dtype=x_dtype)


def test_paths_strides(path):
    a, b, scale_a, scale_b = _operands(20, 70, 30)
    big_a = torch.zeros(40, 140, dtype=a.dtype, device="cuda")
    big_a[::2, ::2] = a
    unaligned = torch.zeros(20 * 70 + 1, dtype=torch.uint8, device="cuda")
    unaligned_a = unaligned[1:].view(a.dtype).view(20, 70)  # rows at odd addresses
    unaligned_a.copy_(a)
    expanded_scale = scale_a.reshape(1, 1).expand(20, 1)
    for a_, b_, sa in [(big_a[::2, ::2], b, scale_a), (a, b.contiguous(), scale_a), (a.t().contiguous().t(), b, scale_a),
                       (unaligned_a, b, scale_a), (a, b, expanded_scale), (big_a[::2, :70], b, scale_a)]:
        _check(path, a_, b_, sa, scale_b)


def test_paths_unaligned_scale_vectors(path):
    # per-row and per-column scales 4 bytes into a larger tensor (contiguous, so passed
    # as they are): cuBLASLt is not given them, the other paths read them in place
    a, b, scale_a, scale_b = _operands(32, 256, 64, per_row=True)
    padded_a = torch.zeros(33, 1, device="cuda")
    padded_a[1:] = scale_a
    padded_b = torch.zeros(1, 65, device="cuda")
    padded_b[:, 1:] = scale_b
    assert padded_a[1:].data_ptr() % 16 == 4 and padded_b[:, 1:].is_contiguous()
    _check(path, a, b, padded_a[1:], padded_b[:, 1:])


@pytest.mark.parametrize("scheme", ["per-row", "block", "weight-only"])
def test_paths_more_rows_than_one_launch(path, scheme):
    # above 2^20 rows a call is launched in parts (scaled_mm.cu, kMaxLaunchRows), each with
    # its rows of a, scale_a and out: every kernel keeps its row tiles in gridDim.y
    m, k, n = (1 << 20) + 37, 160, 16
    if scheme == "per-row":
        _check(path, *_operands(m, k, n, per_row=True))
    elif scheme == "block":
        _check(path, *_blockwise_operands(m, k, n))
    else:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k, device="cuda"), granularity="row")
        _check(path, x, w.t(), torch.ones((), device="cuda"), scale_w.t(), out_dtype=torch.float32)


@pytest.mark.parametrize("m, n", [(1, 48), (20, 1), (1, 1)])
def test_paths_single_row_with_strided_k(path, m, n):
    # one row of a (or column of b) whose K values are not adjacent: its leading dimension
    # does not matter, its K stride does (cuBLASLt reads K contiguous bytes)
    a, b, scale_a, scale_b = _operands(m, 64, n)
    spread_a = torch.zeros(m, 128, dtype=a.dtype, device="cuda")
    spread_a[:, ::2] = a
    w = b.t()
    spread_w = torch.zeros(n, 128, dtype=w.dtype, device="cuda")
    spread_w[:, ::2] = w
    for a_, b_ in [(spread_a[:, ::2], b), (a, spread_w[:, ::2].t()), (spread_a[:, ::2], spread_w[:, ::2].t())]:
        assert a_.stride(1) != 1 or b_.stride(0) != 1
        _check(path, a_, b_, scale_a, scale_b, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_paths_k_zero_is_the_bias_whatever_the_scales(path, scale):
    a = torch.zeros(4, 0, device="cuda").to(E4M3)
    b = torch.zeros(0, 16, device="cuda").to(E4M3)
    bias = torch.randn(16, device="cuda")
    out = fp8linear.scaled_mm(a, b, torch.tensor(scale, device="cuda"), torch.ones((), device="cuda"), bias=bias,
                              out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(4, 16))


@pytest.mark.parametrize("m, k, n", [(0, 5, 7), (4, 5, 0), (0, 0, 0), (4, 0, 7), (33, 0, 16)])
def test_paths_empty_and_k_zero(path, m, k, n):
    a = torch.zeros(m, k, device="cuda").to(E4M3)
    b = torch.zeros(k, n, device="cuda").to(E4M3)
    one = torch.ones((), device="cuda")
    out = fp8linear.scaled_mm(a, b, one, one, out_dtype=torch.float32)
    assert out.shape == (m, n) and torch.all(out == 0)
    bias = torch.randn(n, device="cuda")
    out = fp8linear.scaled_mm(a, b, one, one, bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(m, n))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_paths_nan_propagates(path, out_dtype):
    a, b, scale_a, scale_b = _operands(20, 96, 48)
    a = a.clone()
    a.view(torch.uint8)[1, 7] = 0x7F  # NaN in row 1
    w = b.t().clone()
    w.view(torch.uint8)[5, 50] = 0xFF  # NaN in column 5
    if not _can_run(path, a, w.t(), scale_a, scale_b, None, out_dtype):
        pytest.skip(f"path '{path}' does not take this call")
    out = fp8linear.scaled_mm(a, w.t(), scale_a, scale_b, out_dtype=out_dtype)
    nan = torch.zeros(20, 48, dtype=torch.bool, device="cuda")
    nan[1, :] = True
    nan[:, 5] = True
    assert torch.equal(torch.isnan(out), nan)


# ---- scaled_mm: against torch._scaled_mm, the choice of path, errors ----------------

# torch._scaled_mm's fp8 accumulation keeps 13-bit partial sums between float32
# promotions (~1e-4 relative error): the same semantics, not float32 sums.
TORCH_SCALED_MM_TOLERANCE = 2e-3


@pytest.mark.skipif(_device_capability() < (8, 9), reason="torch._scaled_mm needs FP8 tensor cores")
@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (16, 4096, 14336), (256, 14336, 4096), (4096, 4096, 4096)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_scaled_mm(m, k, n, per_row, out_dtype):
    if per_row and (out_dtype != torch.bfloat16 or _device_capability()[0] != 9 or m == 1):
        pytest.skip("torch._scaled_mm takes row-wise scales with bfloat16 output on sm_90 only (and reads "
                    "a single row's scale as per-tensor)")
    a, b, scale_a, scale_b = _operands(m, k, n, per_row=per_row)
    exact = reference.scaled_mm_float64(a, b, scale_a, scale_b)
    theirs = torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
    tolerance = max(TOLERANCE[out_dtype], TORCH_SCALED_MM_TOLERANCE)
    assert relative_error(theirs, exact) <= tolerance  # torch agrees with the reference
    for path in ("auto", "cublaslt", "gemm", "gemv"):
        if not _can_run(path, a, b, scale_a, scale_b, None, out_dtype):
            continue
        with _forced(path):
            ours = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
        assert relative_error(ours, exact) <= TOLERANCE[out_dtype], path
        assert relative_error(ours, theirs.double()) <= tolerance, path


@pytest.mark.skipif(_capability() < (8, 9), reason="the automatic choice described is for FP8 tensor cores")
def test_auto_picks_the_documented_path():
    def used(a, b, scale_a, scale_b, **kwargs):
        fp8linear.scaled_mm(a, b, scale_a, scale_b, **kwargs)
        return native().cuda_last_path()

    assert used(*_operands(1, 4096, 4096)) == "gemv"
    assert used(*_operands(16, 4096, 4096)) == "gemv"
    assert used(*_operands(256, 4096, 4096)) == "cublaslt"
    assert used(*_operands(256, 4096, 4096), out_dtype=torch.float32) == "gemm"  # float32 sums
    assert used(*_operands(256, 4095, 4096)) == "gemm"
    assert used(*_operands(256, 4096, 4097)) == "gemm"
    assert used(*_operands(40, 4096, 4097)) == "gemv"
    assert used(*_operands(256, 512, 512, E5M2, E5M2)) == "gemm"
    a, b, scale_a, scale_b = _operands(8, 64, 32)
    assert used(a, b.contiguous(), scale_a, scale_b) == "generic"
    x = torch.randn(8, 64, device="cuda")
    assert used(x.bfloat16(), b, torch.ones((), device="cuda"), scale_b) == "upconvert"
    assert used(x, b, torch.ones((), device="cuda"), scale_b) == "generic"
    assert used(*_operands(0, 64, 32)) == "none"
    # block-wise: cuBLASLt's block scaling on sm_90 where it applies, our GEMM otherwise
    a, b, scale_a, scale_b = _blockwise_operands(256, 4096, 4096)
    assert used(a, b, scale_a, scale_b) == ("cublaslt" if _device_capability()[0] == 9 else "gemm")
    assert used(a, b, scale_a, scale_b, bias=torch.randn(4096, device="cuda")) == "gemm"
    assert used(a[:18], b, scale_a[:18], scale_b) == "gemv"


def test_device_path_and_path_names():
    module = native()
    assert module.cuda_paths() == list(PATHS)
    device = torch.cuda.current_device()
    arch = module.cuda_kernel_arch(device)
    major, minor = _device_capability()
    # the build's code for this device: the device's own architecture or an older one
    assert 0 < arch <= major * 10 + minor
    usable = min(arch, major * 10 + minor)
    expected = "fp8" if usable >= 89 else "upconvert" if usable >= 80 else "generic"
    assert module.cuda_device_path(device) == expected
    assert fp8linear.backend("cuda") == ("cuda-fp8" if expected == "fp8" else "cuda-upconvert")
    # an index this process does not see: refused before CUDA is asked, nothing left pending
    with pytest.raises(ValueError, match="out of range"):
        fp8linear.backend(f"cuda:{torch.cuda.device_count()}")
    fp8linear.scaled_mm(*_operands(4, 32, 16))
    with pytest.raises(ValueError, match="unknown CUDA path 'fast'"):
        module.set_cuda_path("fast")
    assert module.cuda_path() == "auto"


def test_mixed_devices_raise():
    a, b, scale_a, scale_b = _operands(4, 32, 16)
    with pytest.raises(RuntimeError, match="b must be on a's device"):
        fp8linear.scaled_mm(a.cpu(), b, scale_a.cpu(), scale_b)
    with pytest.raises(RuntimeError, match="scale_b must be on a's device"):
        fp8linear.scaled_mm(a, b, scale_a, scale_b.cpu())
    with pytest.raises(RuntimeError, match="bias must be on a's device"):
        fp8linear.scaled_mm(a, b, scale_a, scale_b, bias=torch.zeros(16))
    x = torch.randn(4, 32, device="cuda")
    with pytest.raises(RuntimeError, match="scale must be on x's device"):
        fp8linear.quantize_fp8(x, torch.ones(()))
    with pytest.raises(RuntimeError, match="scale must be on x's device"):
        fp8linear.quantize_fp8(x.cpu(), torch.ones((), device="cuda"))
    if torch.cuda.device_count() > 1:
        with pytest.raises(RuntimeError, match="must be on a's device"):
            fp8linear.scaled_mm(a, b.to("cuda:1"), scale_a, scale_b)


def test_bad_arguments_raise_on_cuda():
    f8 = torch.zeros(2, 4, device="cuda").to(E4M3)
    one = torch.ones((), device="cuda")
    with pytest.raises(ValueError, match="must share K"):
        fp8linear.scaled_mm(f8, torch.zeros(5, 3, device="cuda").to(E4M3), one, one)
    with pytest.raises(ValueError, match="b must be torch.float8"):
        fp8linear.scaled_mm(f8, torch.zeros(4, 3, device="cuda"), one, one)
    with pytest.raises(ValueError, match=r"scale_a must have shape"):
        fp8linear.scaled_mm(f8, torch.zeros(4, 3, device="cuda").to(E4M3), torch.ones(3, 1, device="cuda"), one)
    with pytest.raises(ValueError, match="x must be torch.float32"):
        fp8linear.quantize_fp8(torch.zeros(3, device="cuda", dtype=torch.float64))


def _cudart_of_extension():
    """The CUDA runtime functions as our extension resolves them (dlsym on its handle
    searches it, then the libraries it was linked to): the runtime whose last error
    fp8linear's ops read, even where several are loaded."""
    import ctypes

    return ctypes.CDLL(native().__file__)


def test_an_earlier_pending_cuda_error_is_not_blamed_on_our_kernels():
    import ctypes

    cudart = _cudart_of_extension()
    a, b, scale_a, scale_b = _operands(4, 32, 16)
    x = torch.randn(4, 32, device="cuda")
    for call, op in ((lambda: fp8linear.scaled_mm(a, b, scale_a, scale_b), "scaled_mm"),
                     (lambda: fp8linear.quantize_fp8(x), "quantize_fp8")):
        pointer = ctypes.c_void_p()
        # an allocation no GPU has: cudaErrorMemoryAllocation, left pending on this thread
        assert cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(1 << 62)) != 0
        with pytest.raises(RuntimeError, match=rf"{op}: a CUDA error raised before this call was pending"):
            call()
        call()  # the error was not sticky: reported once, then cleared
    torch.cuda.synchronize()


def test_second_gpu_uses_its_own_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    a, b, scale_a, scale_b = (t.to("cuda:1") for t in _operands(33, 256, 64))
    out = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    assert out.device == torch.device("cuda:1")
    assert relative_error(out, reference.scaled_mm_float64(a, b, scale_a, scale_b)) <= 1e-5


def test_cuda_graph_replay():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    w, scale_w = fp8linear.quantize_fp8(torch.randn(4096, 4096, device="cuda"))

    def step():
        a, scale_a = fp8linear.quantize_fp8(x)
        small = fp8linear.scaled_mm(a, w.t(), scale_a, scale_w, out_dtype=torch.bfloat16)
        big_a, big_scale = fp8linear.quantize_fp8(x.repeat(16, 1), granularity="row")
        big = fp8linear.scaled_mm(big_a, w.t(), big_scale, scale_w, out_dtype=torch.bfloat16)
        return small, big

    # Warm-up on the capture stream: first-call work (cuBLASLt workspace, algorithm
    # choice) happens outside the capture, as a user's warm-up would do it.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        expected = step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    x.copy_(torch.randn_like(x))
    graph.replay()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fresh = step()
    torch.cuda.synchronize()
    for got, want in zip(captured, fresh):
        assert relative_error(got, want.double()) <= 1e-3  # same kernels; cuBLASLt may split K differently
    assert relative_error(captured[0], expected[0].double()) > 0.1  # the replay saw the new input


def test_opcheck_on_cuda():
    tests = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    a, b, scale_a, scale_b = _operands(5, 48, 16, per_row=True)
    op = torch.ops.fp8linear.scaled_mm.default
    torch.library.opcheck(op, (a, b, scale_a, scale_b, torch.randn(16, device="cuda"), torch.bfloat16), test_utils=tests)
    x = torch.randn(4, 48, device="cuda")
    torch.library.opcheck(torch.ops.fp8linear.quantize_fp8.default, (x, None, E4M3, True), test_utils=tests)
    torch.library.opcheck(torch.ops.fp8linear.quantize_fp8.default, (x, torch.ones((), device="cuda"), E5M2, False),
                          test_utils=tests)


def test_fp8linear_on_cuda_matches_cpu():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4095, 333).bfloat16()
    layer = fp8linear.FP8Linear.from_linear(linear)
    x = torch.randn(3, 7, 4095, dtype=torch.bfloat16)
    out_cpu = layer(x)
    out_cuda = layer.cuda()(x.cuda())
    assert out_cuda.dtype == torch.bfloat16 and out_cuda.shape == (3, 7, 333)
    assert relative_error(out_cuda.cpu(), out_cpu.double()) <= 1e-2


# ---- block-wise scales (quantization: test_cuda_quantize.py) ---------------------

def _blockwise_operands(m, k, n, a_dtype=E4M3, device="cuda"):
    """a [M, K] per token and group of 128, b = w.t() for a weight w [N, K] per 128 x 128 block."""
    a, scale_a = fp8linear.quantize_fp8(torch.randn(m, k, device=device), dtype=a_dtype, granularity="group")
    w, scale_w = fp8linear.quantize_fp8(torch.randn(n, k, device=device), granularity="block")
    return a, w.t(), scale_a, scale_w.t()


# every gemv token tiling (M 1-8, 9-16, 17-64), gemm above; K and N with partial blocks
@pytest.mark.parametrize("m, k, n", [(1, 300, 260), (9, 256, 130), (16, 4096, 4096), (40, 1000, 200),
                                     (70, 576, 1536), (300, 7168, 576)])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_paths_blockwise(path, m, k, n, out_dtype):
    a, b, scale_a, scale_b = _blockwise_operands(m, k, n)
    _check(path, a, b, scale_a, scale_b, bias=torch.randn(n, device="cuda"), out_dtype=out_dtype)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # weight-only
    _check(path, x, b, torch.ones((), device="cuda"), scale_b, out_dtype=out_dtype)


# shapes cuBLASLt's block scaling takes on sm_90 (whole blocks, M a multiple of 4; K / 128
# = 5 and 3 pad the weight scales' K blocks to 8 and 4), and ones it refuses (M = 18, N =
# 576, e5m2 activations, a bias); every path against the reference
@pytest.mark.parametrize("m, k, n", [(20, 640, 256), (64, 384, 128), (256, 4096, 4096), (132, 7168, 1536),
                                     (18, 512, 256), (68, 1024, 576)])
@pytest.mark.parametrize("out_dtype", FLOAT_DTYPES)
def test_paths_blockwise_whole_blocks(path, m, k, n, out_dtype):
    a, b, scale_a, scale_b = _blockwise_operands(m, k, n)
    _check(path, a, b, scale_a, scale_b, out_dtype=out_dtype)
    # row-sliced activations (row stride above K): their scales keep their own row stride
    wide, wide_scale = fp8linear.quantize_fp8(torch.randn(m, k + 256, device="cuda"), granularity="group")
    _check(path, wide[:, :k], b, wide_scale[:, :k // 128], scale_b, out_dtype=out_dtype)
    if m == 20:
        _check(path, a, b, scale_a, scale_b, bias=torch.randn(n, device="cuda", dtype=out_dtype), out_dtype=out_dtype)
        a5, _, scale_a5, _ = _blockwise_operands(m, k, n, a_dtype=E5M2)
        _check(path, a5, b, scale_a5, scale_b, out_dtype=out_dtype)


@pytest.mark.parametrize("m", [17, 64])
def test_paths_expanded_rows(path, m):
    # x.expand(M, K): every row is the same memory (row stride 0); cuBLASLt, whose leading
    # dimension must be at least K, refuses it, the other paths read it as it is
    a, w, scale_a, scale_w = _operands(1, 256, 128)
    expanded = a.expand(m, 256)
    assert expanded.stride(0) == 0
    _check(path, expanded, w, torch.ones((), device="cuda") * scale_a, scale_w)
