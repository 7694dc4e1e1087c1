"""quantize_fp8 on CUDA, compared bit for bit with the reference computed on the CPU
(torch's own CUDA arithmetic is not what the reference means: it may drop a NaN's sign):
per tensor, per row, static scales, edge values, strides, groups and 128 x 128 blocks.
Marked `cuda`: skipped without a GPU (conftest.py). scaled_mm's CUDA tests are in
test_cuda.py."""
import pytest
import torch

import fp8linear
from conftest import FLOAT_DTYPES, FP8_DTYPES, assert_same_fp8
from fp8linear import reference

pytestmark = pytest.mark.cuda

E4M3 = torch.float8_e4m3fn


def _data(shape, dtype):
    # wide dynamic range: subnormal, normal and saturated codes all occur
    x = torch.randn(shape) * torch.exp2(torch.randint(-24, 12, shape).float())
    return x.to(dtype)


def _assert_quantize_matches(x, scale=None, dtype=E4M3, granularity="tensor"):
    q, s = fp8linear.quantize_fp8(x, scale, dtype=dtype, granularity=granularity)
    q_ref, s_ref = reference.quantize_fp8(x.cpu(), None if scale is None else scale.cpu(), dtype=dtype,
                                          granularity=granularity)
    assert q.device == x.device and s.device == x.device
    assert q.dtype == dtype and q.shape == x.shape and s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref)
    assert_same_fp8(q.cpu(), q_ref)


# (1, 65536) is the largest single-block per-tensor case; (1, 65537) and (300, 1000)
# take the amax kernel + quantize kernel path.
QUANTIZE_SHAPES = [(1,), (3,), (17,), (4097,), (3, 17), (17, 1025), (2, 3, 33), (5, 1), (1, 65536), (1, 65537),
                   (300, 1000), (64, 4096)]


@pytest.mark.parametrize("shape", QUANTIZE_SHAPES)
@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_quantize_dynamic(shape, x_dtype, dtype, granularity):
    _assert_quantize_matches(_data(shape, x_dtype).cuda(), dtype=dtype, granularity=granularity)


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_static(x_dtype, dtype):
    x = _data((7, 300), x_dtype).cuda()
    _assert_quantize_matches(x, torch.tensor(0.37, device="cuda"), dtype=dtype)
    _assert_quantize_matches(x, torch.tensor([[0.37]], device="cuda"), dtype=dtype)
    _assert_quantize_matches(x, torch.rand(7, 1, device="cuda") + 0.01, dtype=dtype, granularity="row")


@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_edge_values(x_dtype, dtype):
    fmax = torch.finfo(dtype).max
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2**-9, 2**-10, 3 * 2**-10, 2**-16, 2**-17, fmax, -fmax,
                           fmax * 1.5, float("inf"), float("-inf"), float("nan"), -float("nan"), 1.0, -3.5])
    for repeats in (1, 3, 1000):  # scalar tails, vector chunks, and the multi-block path for 'tensor'
        x = values.to(x_dtype).repeat(repeats).cuda()
        for granularity in ("tensor", "row"):
            _assert_quantize_matches(x, dtype=dtype, granularity=granularity)
        _assert_quantize_matches(x, torch.ones((), device="cuda"), dtype=dtype)
        q, _ = fp8linear.quantize_fp8(x, torch.ones((), device="cuda"), dtype=dtype)
        codes = q.view(torch.uint8).cpu()
        assert codes[1] == 0x80  # -0 keeps its sign
        max_code = 0x7E if dtype == E4M3 else 0x7B
        assert codes[12] == max_code and codes[13] == 0x80 | max_code  # inf saturates
        assert torch.isnan(q[14].float()) and torch.isnan(q[15].float())


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_sweeps_float32_bit_patterns(dtype):
    # sm_89+ quantizes with the hardware's cvt.rn.satfinite, which the CPU emulator never
    # runs: a stride over all 2^32 float32 bit patterns (every sign, exponent, subnormal,
    # inf and NaN; about a million values) against the reference, bit for bit
    bits = torch.arange(0, 2**32, 4093, dtype=torch.int64)
    x = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32).view(torch.float32)
    x = torch.cat([x, torch.tensor([float("inf"), float("-inf")])])  # (the stride misses them)
    for scale in (1.0, 0.37, 2.0**-20):
        _assert_quantize_matches(x.cuda(), torch.tensor(scale, device="cuda"), dtype=dtype)


def test_quantize_rounds_once_to_nearest_even():
    # Every e4m3 midpoint (ties go to the even code) and one float32 ulp either side.
    codes = torch.arange(0, 0x7E, dtype=torch.uint8).view(E4M3).float()
    mid = (codes[:-1] + codes[1:]) / 2
    ulp = torch.nextafter(mid, torch.full_like(mid, float("inf")))
    below = torch.nextafter(mid, torch.zeros_like(mid))
    x = torch.cat([mid, ulp, below, -mid, -ulp, -below, torch.tensor([464.0, 464.0001, 1.0625 + 2**-20])])
    for x_cuda in (x.cuda(), x.cuda().view(1, -1)):
        _assert_quantize_matches(x_cuda, torch.ones((), device="cuda"))


def test_quantize_one_inf_and_all_zero():
    x = torch.randn(100000, device="cuda")
    x[10] = float("inf")
    _, scale = fp8linear.quantize_fp8(x)
    finite = x[torch.isfinite(x)]
    assert scale.item() == pytest.approx(finite.abs().max().item() / 448, rel=1e-6)
    for shape in [(7,), (100000,), (3, 5)]:
        _, scale = fp8linear.quantize_fp8(torch.zeros(shape, device="cuda"))
        assert scale.item() == pytest.approx(1 / (448 * 512))
    _, scale = fp8linear.quantize_fp8(torch.zeros(3, 5, device="cuda"), granularity="row")
    assert torch.all(scale == torch.tensor(1 / (448 * 512), dtype=torch.float32))


def test_quantize_strided_and_empty():
    base = _data((40, 130), torch.bfloat16).cuda()
    for x in [base[:, ::2], base.t(), base[::3], base[:, 1:], base.unsqueeze(0).expand(2, 40, 130)]:
        for granularity in ("tensor", "row"):
            _assert_quantize_matches(x, granularity=granularity)
    for shape in [(0,), (0, 5), (5, 0)]:
        for granularity in ("tensor", "row"):
            _assert_quantize_matches(torch.zeros(shape, device="cuda"), granularity=granularity)


def test_quantize_never_waits_for_the_gpu():
    x = torch.randn(300, 1000, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(0.5, device="cuda")
    a, w = fp8linear.quantize_fp8(x)[0], fp8linear.quantize_fp8(torch.randn(64, 1000, device="cuda"))[0]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call now raises
    try:
        fp8linear.quantize_fp8(x)
        fp8linear.quantize_fp8(x[:1])
        fp8linear.quantize_fp8(x, granularity="row")
        fp8linear.quantize_fp8(x, scale)
        fp8linear.scaled_mm(a, w.t(), scale, scale, out_dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---- block-wise: groups and blocks -------------------------------------------------

# whole groups per row (the per-row kernels) and partial ones (ATen operations)
@pytest.mark.parametrize("shape", [(5, 300), (2, 3, 257), (1, 128), (7, 1), (4, 512), (2, 3, 256), (300, 4096)])
@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
def test_quantize_groups(shape, x_dtype):
    x = _data(shape, x_dtype).cuda()
    q, s = fp8linear.quantize_fp8(x, granularity="group")
    q_ref, s_ref = reference.quantize_fp8(x.cpu(), granularity="group")
    assert s.shape == s_ref.shape and torch.equal(s.cpu(), s_ref)
    assert_same_fp8(q.cpu(), q_ref)
    static = s_ref.cuda() * 2
    q, s = fp8linear.quantize_fp8(x, static, granularity="group")
    assert torch.equal(s, static) and s.data_ptr() != static.data_ptr()
    assert_same_fp8(q.cpu(), reference.quantize_fp8(x.cpu(), static.cpu(), granularity="group")[0])
    strided = x.transpose(-1, -2) if x.dim() >= 2 else x
    q, s = fp8linear.quantize_fp8(strided, granularity="group")
    assert_same_fp8(q.cpu(), reference.quantize_fp8(strided.cpu(), granularity="group")[0])


@pytest.mark.parametrize("shape", [(300, 260), (576, 1536), (129, 1)])
def test_quantize_blocks(shape):
    x = _data(shape, torch.bfloat16).cuda()
    q, s = fp8linear.quantize_fp8(x, granularity="block")
    q_ref, s_ref = reference.quantize_fp8(x.cpu(), granularity="block")
    assert torch.equal(s.cpu(), s_ref)
    assert_same_fp8(q.cpu(), q_ref)


# scale_fmt "ue8m0": whole groups through the per-row kernel (its scales rounded up to
# powers of two in the kernel), partial groups and weight blocks through ATen operations
@pytest.mark.parametrize("shape, granularity", [((5, 300), "group"), ((4, 512), "group"), ((300, 4096), "group"),
                                                ((2, 3, 256), "group"), ((300, 260), "block"), ((129, 1), "block")])
@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_ue8m0(shape, granularity, dtype):
    x = _data(shape, torch.bfloat16).cuda()
    q, s = fp8linear.quantize_fp8(x, dtype=dtype, granularity=granularity, scale_fmt="ue8m0")
    q_ref, s_ref = reference.quantize_fp8(x.cpu(), dtype=dtype, granularity=granularity, scale_fmt="ue8m0")
    assert s.shape == s_ref.shape and torch.equal(s.cpu(), s_ref)
    assert_same_fp8(q.cpu(), q_ref)
