"""`make sanitize` itself: the tests it runs use the instrumented build, and an out-of-bounds
read in our C kernels does fail that run. Skipped outside it (scripts/sanitize.sh sets
FP8LINEAR_SANITIZE_BUILD to the build's directory)."""
import os
import pathlib
import subprocess
import sys

import pytest

import fp8linear._C

BUILD = os.environ.get("FP8LINEAR_SANITIZE_BUILD")

pytestmark = pytest.mark.skipif(not BUILD, reason="runs under make sanitize only")


def test_the_instrumented_build_is_the_one_imported():
    assert pathlib.Path(fp8linear._C.__file__).resolve().is_relative_to(pathlib.Path(BUILD).resolve())
    libraries = pathlib.Path("/proc/self/maps").read_text()
    assert "libasan" in libraries and "libubsan" in libraries


# A uint8 tensor that claims 4096 + 64 bytes of a 4096-byte malloc (ASan's redzone follows
# it): quantize_fp8's scalar amax loop reads the 64 bytes past the end.
OVER_READ = """
import ctypes, sys, torch
import fp8linear
from fp8linear._native import native
native().set_cpu_variant("scalar")
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
address = libc.malloc(4096)
ctypes.memset(address, 0, 4096)
x = torch.frombuffer((ctypes.c_uint8 * (4096 + 64)).from_address(address), dtype=torch.uint8).view(torch.float32)
fp8linear.quantize_fp8(x)
print("not reached", flush=True)
"""


def test_an_out_of_bounds_read_in_the_kernels_fails_the_run():
    result = subprocess.run([sys.executable, "-c", OVER_READ], capture_output=True, text=True, timeout=300)
    assert "not reached" not in result.stdout
    assert result.returncode != 0
    assert "heap-buffer-overflow" in result.stderr and "READ of size" in result.stderr
    assert "fp8_span_amax_scalar" in result.stderr and "csrc/cpu/quantize.c" in result.stderr, result.stderr[-3000:]
