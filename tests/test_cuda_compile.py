"""The CUDA sources compile for every target architecture, and the conversions the
kernels share with the host agree with csrc/fp8.h. Needs nvcc, not a GPU: this runs
in CI on GPU-less machines, so a compile error (or a wrong conversion on the sm_80
path, which a Hopper test run never executes) cannot land.
"""
import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
# The -gencode forms TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0a" produces, and sm_75: not in the
# default list, but what a Turing GPU (T4) needs added to run the `generic` kernel, the
# oldest CUDA 13 compiles for (the sm_80 kernels compile to traps there).
ARCHITECTURES = {
    "sm_75": "arch=compute_75,code=sm_75",
    "sm_80": "arch=compute_80,code=sm_80",
    "sm_89": "arch=compute_89,code=sm_89",
    "sm_90a": "arch=compute_90a,code=sm_90a",
}
NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr"]


def _find_nvcc():
    candidates = [shutil.which("nvcc")]
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            candidates.append(os.path.join(os.environ[variable], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    return next((c for c in candidates if c and os.path.exists(c)), None)


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA sources are compile-checked only with it)")


def _cublaslt_include_dir():
    """Where cublasLt.h is: the toolkit, or the nvidia wheel torch's CUDA builds install."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if NVCC:
        roots.append(str(pathlib.Path(NVCC).resolve().parents[1]))
    candidates = [os.path.join(root, "include") for root in roots if root]
    # `make test` unpacks the headers of the nvidia-cublas wheel here when the toolkit lacks them
    candidates.append(os.environ.get("FP8LINEAR_CUBLAS_INCLUDE", ""))
    try:
        import nvidia  # noqa: PLC0415 (optional: only torch's CUDA wheels install it)

        candidates += [os.path.join(base, sub, "include") for base in nvidia.__path__ for sub in ("cu13", "cublas")]
    except ImportError:
        pass
    return next((c for c in candidates if os.path.exists(os.path.join(c, "cublasLt.h"))), None)


CUBLASLT_INCLUDE = _cublaslt_include_dir()


def _needs_cublaslt(source):
    return "#include <cublasLt.h>" in source.read_text()


def _compile(source, architecture, out_dir):
    # -Xptxas -v: ptxas reports each kernel's registers and spills (test_no_register_spills)
    command = [NVCC, *NVCC_FLAGS, "-Xptxas", "-v", f"-gencode={ARCHITECTURES[architecture]}", "-c", str(source),
               "-o", str(out_dir / f"{source.stem}.{architecture}.o")]
    if _needs_cublaslt(source):
        # after the toolkit's own headers, as setup.py does
        command[1:1] = ["-isystem", CUBLASLT_INCLUDE]
    result = subprocess.run(command, capture_output=True, text=True)
    return result.returncode, " ".join(command) + "\n" + result.stdout + result.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every (source, architecture) compiled once, all in parallel: ~1 minute on 2 cores."""
    out_dir = tmp_path_factory.mktemp("cuda_objects")
    jobs = [(source, architecture) for source in CUDA_SOURCES for architecture in ARCHITECTURES
            if CUBLASLT_INCLUDE or not _needs_cublaslt(source)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {job: pool.submit(_compile, *job, out_dir) for job in jobs}
        return {job: future.result() for job, future in futures.items()}


def test_there_are_cuda_sources():
    names = {source.name for source in CUDA_SOURCES}
    assert {"quantize.cu", "gemv.cu", "gemm.cu", "generic.cu", "cublaslt.cu", "scaled_mm.cu"} <= names


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_cuda_sources_compile(compiled, architecture):
    failures = [f"{source.name} for {arch}:\n{output}" for (source, arch), (code, output) in compiled.items()
                if arch == architecture and code != 0]
    assert not failures, "\n\n".join(failures)
    built = {source.name for (source, arch) in compiled if arch == architecture}
    assert built == {s.name for s in CUDA_SOURCES if CUBLASLT_INCLUDE or not _needs_cublaslt(s)}


# ptxas -v: "Compiling entry function '<mangled>' for 'sm_90a'" ... "N bytes spill stores, M bytes spill loads"
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _spilling_kernels(output):
    """(kernel, architecture, stores, loads) of every kernel that ptxas says spills."""
    found, entry = [], None
    for line in output.splitlines():
        if (match := _ENTRY.search(line)):
            entry = match.groups()
        elif entry and (match := _SPILLS.search(line)):
            stores, loads = map(int, match.groups())
            if stores or loads:
                found.append((*entry, stores, loads))
            entry = None
    return found


def test_spill_report_is_parsed():
    sample = ("ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'\n"
              "ptxas info    : Function properties for _Z1kv\n"
              "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
              "ptxas info    : Compiling entry function '_Z1jv' for 'sm_90a'\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")
    assert _spilling_kernels(sample) == [("_Z1kv", "sm_90a", 4, 4)]


def test_no_register_spills(compiled):
    """A kernel that spills its accumulators to local memory runs at a fraction of its
    speed: every kernel, every default architecture, keeps them in registers (the register
    counts are in the same report: the GEMM's 128-row fp8 tile takes ~150)."""
    reports = [output for (code, output) in compiled.values() if code == 0]
    assert any(_ENTRY.search(output) for output in reports), "ptxas -v printed no kernel report"
    # sm_75 only has to build: nothing there is tuned (ptxas spills 12 bytes of the
    # float32 row quantizer there, none at sm_80 from the same source)
    spills = [found for output in reports for found in _spilling_kernels(output) if found[1] != "sm_75"]
    assert not spills, spills


def test_cublaslt_source_was_compiled(compiled):
    if CUBLASLT_INCLUDE is None:
        pytest.skip("cublasLt.h not found (toolkit or nvidia-cublas wheel): cublaslt.cu was not compile-checked")
    assert any(_needs_cublaslt(source) for (source, _) in compiled)


# A host program: csrc/cuda/fp8_device.cuh's __host__ __device__ conversions (the ones
# sm_80 runs; sm_89+ swaps in hardware conversions) against csrc/fp8.h.
CONVERSION_CHECK = r"""
#include <stdio.h>
#include <stdlib.h>
#include "fp8.h"
#include "cuda/fp8_device.cuh"

static int failures = 0;

template <fp8_format F>
static void check_encode(uint32_t bits) {
  const float x = fp8_bits_float(bits);
  const uint8_t expected = fp8_from_float(x, F), got = fp8cuda::encode_fp8_portable<F>(x);
  if (expected != got && failures++ < 20) {
    printf("encode format %d of %08x: fp8.h gives %02x, the device encoder %02x\n", (int)F, bits, expected, got);
  }
}

template <fp8_format F>
static void check_format() {
  // every code, the midpoints between neighbours (ties) and one float ulp around them
  for (int code = 0; code < 0x7F; ++code) {
    const float value = fp8_to_float((uint8_t)code, F), next = fp8_to_float((uint8_t)(code + 1), F);
    if (value != value) continue;
    const float mid = next == next && next < 1e30f ? (value + next) / 2 : value * 1.0625f;
    const float points[] = {value, mid};
    for (float point : points) {
      for (int delta = -2; delta <= 2; ++delta) {
        const uint32_t bits = fp8_float_bits(point) + (uint32_t)delta;
        check_encode<F>(bits);
        check_encode<F>(bits | 0x80000000u);
      }
    }
  }
  // a stride over every bit pattern (all exponents, NaN, inf, subnormals) and random ones
  for (uint64_t bits = 0; bits < (1ull << 32); bits += 4099) check_encode<F>((uint32_t)bits);
  srand(1234);
  for (int i = 0; i < 2000000; ++i) check_encode<F>(((uint32_t)rand() << 16) ^ (uint32_t)rand());
  for (int code = 0; code < 256; ++code) {
    const float expected = fp8_to_float((uint8_t)code, F), got = fp8cuda::decode_fp8<F>((uint32_t)code);
    const bool same = expected != expected ? got != got : fp8_float_bits(expected) == fp8_float_bits(got);
    if (!same && failures++ < 20) printf("decode format %d of %02x: %g vs %g\n", (int)F, code, expected, got);
  }
  // float16 widening of every pair of codes: exact, NaN and sign kept
  for (uint32_t pair = 0; pair < 65536; ++pair) {
    const uint32_t half2 = fp8cuda::widen_fp8x2_to_f16x2_portable<F>(pair);
    for (int lane = 0; lane < 2; ++lane) {
      const float expected = fp8_to_float((uint8_t)(pair >> (8 * lane)), F);
      const float got = fp8_half_to_float((uint16_t)(half2 >> (16 * lane)));
      const bool same = expected != expected ? got != got && (fp8_float_bits(got) >> 31) == (fp8_float_bits(expected) >> 31)
                                             : fp8_float_bits(expected) == fp8_float_bits(got);
      if (!same && failures++ < 20) printf("widen format %d of pair %04x lane %d: %g vs %g\n", (int)F, pair, lane, expected, got);
    }
  }
}

int main() {
  check_format<FP8_E4M3FN>();
  check_format<FP8_E5M2>();
  if (failures) {
    printf("%d mismatches\n", failures);
    return 1;
  }
  printf("conversions agree\n");
  return 0;
}
"""


def test_device_conversions_match_fp8_h(tmp_path):
    source = tmp_path / "conversion_check.cu"
    source.write_text(CONVERSION_CHECK)
    program = tmp_path / "conversion_check"
    build = subprocess.run([NVCC, *NVCC_FLAGS, "-I", str(ROOT / "csrc"), str(source), "-o", str(program)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "conversions agree" in run.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
