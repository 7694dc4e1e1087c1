"""Shared fixtures: each CPU kernel variant forced in turn, seeded randomness."""
import contextlib

import pytest
import torch

import fp8linear
from fp8linear._native import native

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@contextlib.contextmanager
def forced(get, set_, value):
    """A native setting (read with get(), written with set_(value)) at `value` while the
    block runs, back to what it was after."""
    previous = get()
    set_(value)
    try:
        yield value
    finally:
        set_(previous)


def forced_cpu_variant(name):
    """The CPU kernel variant `name` while the block runs, the previous one after."""
    module = native()
    return forced(module.cpu_variant, module.set_cpu_variant, name)


def scaled_mm_on_1_and_2_threads(a, b, scale_a, scale_b):
    """fp8linear.scaled_mm (float32 out) on one thread and on two, the thread count restored after."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
        torch.set_num_threads(2)
        double = fp8linear.scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.float32)
    finally:
        torch.set_num_threads(previous)
    return single, double


@pytest.fixture(params=native().cpu_variants_supported())
def cpu_variant(request):
    """Run the test once per CPU kernel variant this machine supports."""
    with forced_cpu_variant(request.param):
        yield request.param


def bytes_of(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_same_fp8(q: torch.Tensor, expected: torch.Tensor) -> None:
    """Byte-for-byte equal, except that a NaN may carry either sign (torch's own
    conversions are not consistent about the sign of NaN)."""
    assert q.dtype == expected.dtype and q.shape == expected.shape
    nan = torch.isnan(expected.float())
    assert torch.equal(torch.isnan(q.float()), nan)
    assert torch.equal(bytes_of(q)[~nan], bytes_of(expected)[~nan])


def relative_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    """Relative Frobenius error of out against a float64 reference; NaN never passes."""
    out = out.double()
    if torch.isnan(out).any():
        return float("inf")
    denominator = exact.norm().item()
    difference = (out - exact).norm().item()
    return difference / denominator if denominator else difference


def bf16_gemm_kernel(m: int, n: int, threads: int | None = None) -> str:
    """The kernel cpu_scaled_mm_plan names on the avx512_bf16 variant for M = m > 4 rows and
    N = n: the skinny kernel (and the eight-row one, M = 5-8) up to 48 padded rows, the
    register tiles above 64, and at 49-64 (padded to 64) the tiles where their 64-column tiles share out
    among the threads with the busiest at most 1/8 over an even share (gemm.c's
    bf16_skinny)."""
    threads = torch.get_num_threads() if threads is None else threads
    m_padded = -(-m // 16) * 16
    if m_padded != 64:
        return "bf16_skinny" if m_padded < 64 else "bf16_tile"
    tiles = -(-n // 64)
    busiest = -(-tiles // threads)
    return "bf16_skinny" if busiest * threads * 8 > tiles * 9 else "bf16_tile"
