"""The AVX512-BF16 kernels' dot-product loops (and the avx512_fma variant's FMA tiles) keep their accumulators in registers.

Bit-exact tests cannot see where the compiler keeps a sum. Twice GCC kept some of the
accumulators of an innermost `vdpbf16ps` loop on the stack as well: in the skinny kernel
for 3-4 row groups every second dot product then waited on a store and a load (FP8Linear
4096 x 4096 at M = 64 took 10.3 ms per call instead of 5.8 on one thread), and in the dot
kernel for M = 2-4 half the accumulators were stored in every 64-k step. This reads the
built extension's machine code (objdump) and fails when an innermost loop that runs
`vdpbf16ps` also stores a zmm register to the stack. It says nothing about speed itself;
the benchmarks do that.
"""
import platform
import re
import shutil
import subprocess

import pytest

import fp8linear

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("objdump") is None,
                                reason="reads x86-64 machine code with objdump")

FUNCTION = re.compile(r"^[0-9a-f]+ <(.+)>:$")
INSTRUCTION = re.compile(r"^\s*([0-9a-f]+):\t(.*)$")
JUMP = re.compile(r"^j\w+\s+([0-9a-f]+)\b")
STACK_STORE = re.compile(r"^v\S+\s+%zmm\d+,-?(0x[0-9a-f]+)?\(%r[bs]p[^)]*\)")


def innermost_loops(path):
    """(function, instructions) of each innermost loop: the code from a backward jump's target
    to the jump, with no other backward jump inside."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True,
                             check=True).stdout
    functions, name = {}, None
    for line in listing.splitlines():
        header = FUNCTION.match(line)
        if header:
            name = header.group(1)
            functions[name] = []
            continue
        instruction = INSTRUCTION.match(line)
        if name is not None and instruction:
            functions[name].append((int(instruction.group(1), 16), instruction.group(2).strip()))
    loops = []
    for name, code in functions.items():
        index = {address: i for i, (address, _) in enumerate(code)}
        for end, (address, text) in enumerate(code):
            jump = JUMP.match(text)
            target = int(jump.group(1), 16) if jump else None
            if target is None or target >= address or target not in index:
                continue
            body = code[index[target]:end + 1]
            inner = [b for b in body[:-1] if JUMP.match(b[1]) and int(JUMP.match(b[1]).group(1), 16) < b[0]]
            if not inner:
                loops.append((name, [text for _, text in body]))
    return loops


def test_dot_product_loops_keep_their_sums_in_registers():
    loops = [(name, body) for name, body in innermost_loops(fp8linear.ops.native().__file__)
             if any(text.startswith("vdpbf16ps") for text in body)]
    # the dot, eight-row, skinny and tile kernels, each compiled for several shapes: dozens of loops
    assert len(loops) >= 20, f"found only {len(loops)} innermost vdpbf16ps loops: is the listing parsed?"
    stores = [(name, [text for text in body if STACK_STORE.match(text)]) for name, body in loops]
    stores = [(name, found) for name, found in stores if found]
    assert not stores, ("innermost vdpbf16ps loops that store zmm registers to the stack (an accumulator "
                        f"the compiler kept in memory): {[(name, found[:3]) for name, found in stores]}")


def test_fma_tile_loops_keep_their_sums_in_registers():
    # the avx512_fma variant's register tiles (gemm_avx512_fma.c: panel_tiles_V_B, 1-4 vectors,
    # K-blocked or not), float32 FMAs on zmm registers
    loops = [(name, body) for name, body in innermost_loops(fp8linear.ops.native().__file__)
             if "panel_tiles_" in name and any(text.startswith("vfmadd231ps") and "zmm" in text for text in body)]
    assert len(loops) >= 8, f"found only {len(loops)} innermost FMA loops of the FMA tile kernel"
    stores = [(name, [text for text in body if STACK_STORE.match(text)]) for name, body in loops]
    stores = [(name, found) for name, found in stores if found]
    assert not stores, f"FMA tile loops that store zmm registers to the stack: {stores}"
