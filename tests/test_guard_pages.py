"""Both ops on operands that end right before (or start right after) a PROT_NONE page.

Reading one byte past an operand's end (or before its start) faults at once, with or
without AddressSanitizer: the vector loads, masked loads and AMX tile loads that ASan
does not see (it checks neither masks nor tiles) are covered too. Every CPU variant,
over the tails of their blocks (16 rows, 16/32/64 k, 16/64 weight rows).
"""
import ctypes
import math
import mmap
import pathlib
import subprocess
import sys

import pytest
import torch

import fp8linear
from fp8linear import reference
from conftest import FLOAT_DTYPES, FP8_DTYPES, assert_same_fp8, relative_error
from test_scaled_mm import TOLERANCE

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's mmap and mprotect")

PAGE = mmap.PAGESIZE
PROT_NONE = 0  # (the mmap module names only PROT_READ, PROT_WRITE and PROT_EXEC)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int


def _protect(address, protection):
    if _libc.mprotect(ctypes.c_void_p(address), PAGE, protection) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")


class GuardedMemory:
    """Anonymous mappings with a PROT_NONE page on each side of the data; the mapping
    lives as long as the tensors made from it (torch.frombuffer keeps it referenced)."""

    def __init__(self):
        self._maps = []

    def tensor(self, values: torch.Tensor, side: str) -> torch.Tensor:
        """A contiguous copy of `values` whose last byte (side="end") is followed by, or whose
        first byte (side="start") follows, an inaccessible page."""
        nbytes = values.numel() * values.element_size()
        assert nbytes > 0
        data_pages = math.ceil(nbytes / PAGE)
        memory = mmap.mmap(-1, (data_pages + 2) * PAGE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(memory)
        base = ctypes.addressof(anchor)
        del anchor  # (a ctypes view would keep the mapping exported)
        _protect(base, PROT_NONE)
        _protect(base + (data_pages + 1) * PAGE, PROT_NONE)
        offset = PAGE + (data_pages * PAGE - nbytes if side == "end" else 0)
        raw = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset)
        guarded = raw.view(values.dtype).view(values.shape)
        guarded.copy_(values)
        self._maps.append(memory)
        return guarded


@pytest.fixture
def guarded():
    return GuardedMemory()


@pytest.fixture(params=["end", "start"])
def side(request):
    return request.param


# M: 1 (dot), 2-4 (dot), 5-8 (eight-row; AMX: stream), 9 (8 + 1 apart), 10-64 (skinny; AMX: 17-64 stream),
# more (tiles/panels), and tails (17, 33, 65, 100: the last rows apart);
# K and N: around 16, 32, 64 and 256.
MM_SHAPES = [(1, 1, 1), (1, 17, 3), (1, 63, 65), (1, 300, 17), (2, 100, 17), (3, 1, 33), (4, 65, 16), (5, 129, 7),
             (7, 1, 33), (8, 64, 15), (9, 33, 15), (13, 257, 31), (16, 64, 1), (17, 31, 65), (33, 255, 17), (48, 129, 17),
             (64, 200, 63), (65, 513, 9), (100, 129, 70)]


def _fp8(shape, dtype):
    return fp8linear.quantize_fp8(torch.randn(shape), dtype=dtype)[0]


@pytest.mark.parametrize("m, k, n", MM_SHAPES)
def test_scaled_mm_stays_inside_its_operands(m, k, n, side, guarded, cpu_variant):
    for a_dtype, b_dtype, out_dtype in [(torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32),
                                        (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16),
                                        (torch.bfloat16, torch.float8_e5m2, torch.float32),  # weight-only
                                        (torch.float16, torch.float8_e4m3fn, torch.float16)]:
        a_values = _fp8((m, k), a_dtype) if a_dtype in FP8_DTYPES else torch.randn(m, k).to(a_dtype)
        w = guarded.tensor(_fp8((n, k), b_dtype), side)            # a Linear weight [N, K]: b = w.t()
        scale_a = guarded.tensor(torch.rand(m, 1) + 0.5, side)
        scale_b = guarded.tensor(torch.rand(1, n) + 0.5, side)
        one_scale_a, one_scale_b = guarded.tensor(torch.tensor(0.75), side), guarded.tensor(torch.tensor(1.25), side)
        bias = guarded.tensor(torch.randn(n).to(out_dtype), side)
        operands = [
            (guarded.tensor(a_values, side), w.t()),                          # the fast kernels' layout
            (guarded.tensor(a_values.t().contiguous(), side).t(), w.t()),     # a column-major
            (guarded.tensor(a_values, side), guarded.tensor(w.t().contiguous(), side)),  # b [K, N] row-major
        ]
        for a, b in operands:
            for sa, sb, bias_ in [(scale_a, scale_b, bias), (one_scale_a, one_scale_b, None)]:
                out = fp8linear.scaled_mm(a, b, sa, sb, bias=bias_, out_dtype=out_dtype)
                exact = reference.scaled_mm_float64(a, b, sa, sb, bias=bias_)
                assert relative_error(out, exact) <= TOLERANCE[out_dtype]


# block-wise scales (per token and 128 k, per 128 x 128 weight block): the dot, eight-row,
# skinny (one group, two in turn, three and four per step, a last group of one row) and tile kernels, K tails inside and across
# 128-k blocks and 256-k panels; float scales (summed per block) and powers of two (folded)
BLOCK_SHAPES = [(3, 129, 17), (5, 300, 140), (8, 257, 31), (16, 129, 17), (33, 300, 140), (47, 300, 140), (60, 300, 140),
                (64, 200, 63), (70, 300, 140), (100, 700, 130)]


@pytest.mark.parametrize("m, k, n", BLOCK_SHAPES)
def test_blockwise_scaled_mm_stays_inside_its_operands(m, k, n, side, guarded, cpu_variant):
    a_values, scale_a = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group")
    w_values, scale_w = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block")
    _, scale_a2 = fp8linear.quantize_fp8(torch.randn(m, k), granularity="group", scale_fmt="ue8m0")
    _, scale_w2 = fp8linear.quantize_fp8(torch.randn(n, k), granularity="block", scale_fmt="ue8m0")
    a = guarded.tensor(a_values, side)
    w = guarded.tensor(w_values, side)
    bias = guarded.tensor(torch.randn(n).to(torch.bfloat16), side)
    for sa, sw in [(scale_a, scale_w), (scale_a2, scale_w2)]:
        sa, sw = guarded.tensor(sa, side), guarded.tensor(sw, side)
        out = fp8linear.scaled_mm(a, w.t(), sa, sw.t(), bias=bias, out_dtype=torch.bfloat16)
        exact = reference.scaled_mm_float64(a, w.t(), sa, sw.t(), bias=bias)
        assert relative_error(out, exact) <= TOLERANCE[torch.bfloat16]


QUANTIZE_SHAPES = [(1,), (3,), (15,), (16,), (17,), (31,), (33,), (63,), (65,), (129,), (1023,), (4097,), (1, 1),
                   (3, 17), (5, 1), (17, 33), (2, 3, 65), (1, 4099)]


@pytest.mark.parametrize("shape", QUANTIZE_SHAPES)
@pytest.mark.parametrize("x_dtype", FLOAT_DTYPES)
def test_quantize_stays_inside_its_input(shape, x_dtype, side, guarded, cpu_variant):
    values = (torch.randn(shape) * 3).to(x_dtype)
    x = guarded.tensor(values, side)
    transposed = guarded.tensor(values.t().contiguous(), side).t() if values.dim() == 2 else x
    row_scale = guarded.tensor(torch.rand(*shape[:-1], 1) + 0.1, side)
    tensor_scale = guarded.tensor(torch.tensor([0.37]), side).view(())
    for dtype in FP8_DTYPES:
        for x_ in (x, transposed):
            for scale, granularity in [(None, "tensor"), (None, "row"), (tensor_scale, "tensor"), (row_scale, "row")]:
                q, s = fp8linear.quantize_fp8(x_, scale, dtype=dtype, granularity=granularity)
                q_ref, s_ref = reference.quantize_fp8(x_, scale, dtype=dtype, granularity=granularity)
                assert torch.equal(s, s_ref)
                assert_same_fp8(q, q_ref)


def test_the_guard_page_faults():
    # the premise of this file: touching the byte after a guarded tensor kills the process
    code = (
        "import ctypes, torch, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from test_guard_pages import GuardedMemory\n"
        "t = GuardedMemory().tensor(torch.arange(10, dtype=torch.uint8), 'end')\n"
        "print(ctypes.c_uint8.from_address(t.data_ptr() + 9).value, flush=True)\n"
        "ctypes.c_uint8.from_address(t.data_ptr() + 10).value\n"
        "print('not reached', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(pathlib.Path(__file__).parent)], capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.startswith("9") and "not reached" not in result.stdout
    assert result.returncode != 0
