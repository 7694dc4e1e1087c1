#!/usr/bin/env bash
# The one GPU check: on a bare machine with torch (CUDA), nvcc and a GPU but no
# network, build fp8linear's extension for this GPU, run the CUDA tests and a cut-down
# CUDA benchmark (and, with the time left, compute-sanitizer's memcheck over the tail and
# stride tests), and print a summary last, all within one deadline.
#
#   benchmarks/gpu_check.sh              # from the repository root (or anywhere)
#   OUT=/some/dir GPU_CHECK_SECONDS=540 benchmarks/gpu_check.sh
#
# The device tool allows 600 s per command and brings back at most 8 files from $OUT,
# so: the whole script runs against GPU_CHECK_SECONDS (default 540), each step's
# timeout is what is left of it minus what the later steps need, nothing is retried,
# and $OUT holds five files: log.txt (environment, wheels, build, tests and benchmark
# output, in that order), junit.xml, cuda.md, cuda.png and summary.txt (also printed
# last). Python packages the tests and fp8linear import (pytest, tqdm, safetensors)
# and the build's ninja, where missing, are installed from a wheel directory .whl/ in
# the repository root if one was brought along (pip download ... -d .whl; pytest-timeout
# there adds a per-test timeout).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
DEADLINE=${GPU_CHECK_SECONDS:-540}
mkdir -p "$OUT"
cd "$ROOT"
LOG="$OUT/log.txt"
: > "$LOG"
START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }
# The timeout of a step: at most `budget` seconds, and never so long that the steps
# after it (which need `reserve` seconds) would run past the deadline.
step_timeout() {
  local budget=$1 reserve=$2
  local left=$(( DEADLINE - ($(date +%s) - START) - reserve ))
  (( left < budget )) && budget=$left
  (( budget < 1 )) && budget=1
  echo "$budget"
}
section() { echo "== $1 ($(elapsed) of ${DEADLINE}s)" | tee -a "$LOG"; }
status_build=skipped status_tests=skipped status_bench=skipped status_memcheck=skipped tests_summary=

# torch looks for the toolkit through CUDA_HOME or the nvcc on PATH; a wrapper
# script outside the toolkit would point it at the wrong directory.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc > /dev/null; then
  for candidate in "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")" /usr/local/cuda /usr/local/cuda-*; do
    if [ -f "$candidate/include/cuda_runtime_api.h" ]; then
      export CUDA_HOME=$candidate
      break
    fi
  done
fi

section "environment"
{
  date -u
  timeout 20 nvidia-smi 2>&1 || echo "nvidia-smi not found"
  command -v nvcc && nvcc --version
  echo "CUDA_HOME=${CUDA_HOME:-unset} cores=$(nproc)"
  timeout 60 "$PYTHON" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'capability', torch.cuda.get_device_capability() if torch.cuda.is_available() else None)"
} >> "$LOG" 2>&1

# Missing pure-Python dependencies (and ninja, for a parallel build), from .whl/.
missing=$(timeout 30 "$PYTHON" - << 'EOF'
import importlib.util
print(" ".join(name.replace("_", "-") for name in ("pytest", "tqdm", "safetensors", "ninja", "pytest_timeout")
               if importlib.util.find_spec(name) is None))
EOF
)
if [ -n "$missing" ]; then
  if [ -d "$ROOT/.whl" ]; then
    section "installing $missing from .whl/"
    timeout "$(step_timeout 60 400)" "$PYTHON" -m pip install --no-index --find-links "$ROOT/.whl" $missing >> "$LOG" 2>&1 \
      || echo "could not install all of $missing from .whl/ (see log.txt)" | tee -a "$LOG"
  else
    echo "!! missing Python packages: $missing (no network: bring wheels in .whl/)" | tee -a "$LOG"
  fi
fi
export PATH="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2> /dev/null):$PATH"  # ninja's script

# Build for this GPU only: 9.0 -> 9.0a (the arch-specific target), else major.minor;
# ninja and MAX_JOBS = cores compile the files in parallel.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(timeout 60 "$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); \
print(f'{major}.{minor}' + ('a' if (major, minor) == (9, 0) else ''))" 2> /dev/null || echo "9.0a")
fi
export TORCH_CUDA_ARCH_LIST FP8LINEAR_CUDA=1 FP8LINEAR_NINJA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
section "build for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS"
if timeout "$(step_timeout 300 210)" "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -v -e . >> "$LOG" 2>&1; then
  status_build=ok
else
  status_build=FAILED
fi
grep -E "^fp8linear: building" "$LOG" | tail -1
section "build: $status_build"

if [ "$status_build" = ok ]; then
  timeout 60 "$PYTHON" -c "import fp8linear._C as c; print('cuda_built', c.cuda_built(), 'device path', c.cuda_device_path(0), 'kernel arch', c.cuda_kernel_arch(0))" \
    2>&1 | tee -a "$LOG"
  section "tests"
  per_test=()
  "$PYTHON" -c "import pytest_timeout" 2> /dev/null && per_test=(--timeout=60)
  # no early stop: tests run path by path, so stopping at the first failures would hide the later paths
  if timeout "$(step_timeout 240 120)" "$PYTHON" -m pytest -q -rfE -p no:cacheprovider "${per_test[@]}" tests/test_cuda.py \
      tests/test_cuda_quantize.py --junitxml="$OUT/junit.xml" > "$OUT/tests.tmp" 2>&1; then
    status_tests=ok
  else
    status_tests=FAILED
  fi
  cat "$OUT/tests.tmp" >> "$LOG"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.tmp" | head -n 20
  tests_summary=$(tail -n 1 "$OUT/tests.tmp")
  echo "$tests_summary"
  rm -f "$OUT/tests.tmp"
  section "benchmark"
  # cut down to what the targets need: decode, prefill, aligned and unaligned Llama shapes
  if timeout "$(step_timeout 240 10)" "$PYTHON" benchmarks/bench_cuda.py --rows 1,16,1024,4096 \
      --shapes "Llama-3-8B,unaligned" --repeats 5 --output-dir "$OUT" >> "$LOG" 2>&1; then
    status_bench=ok
  else
    status_bench=FAILED
    tail -n 20 "$LOG"
  fi
  # With what is left (at least a minute): compute-sanitizer's memcheck over the tests of
  # tails, strides and empty shapes, the caching allocator off so that it sees each buffer.
  left=$(step_timeout 150 10)
  if command -v compute-sanitizer > /dev/null && (( left >= 60 )); then
    section "memcheck (${left}s)"
    if PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$left" compute-sanitizer --tool memcheck --error-exitcode 99 \
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_cuda_quantize.py \
        -k "single_row or k_zero or empty or strides or nan_propagates" >> "$LOG" 2>&1; then
      status_memcheck=ok
    else
      status_memcheck=FAILED
    fi
  fi
fi

{
  echo
  echo "== fp8linear GPU check: build $status_build, tests $status_tests, benchmark $status_bench, memcheck $status_memcheck ($(elapsed) of ${DEADLINE}s)"
  echo "tests: ${tests_summary:-not run}"
  if [ -f "$OUT/cuda.md" ]; then
    grep -E "^Measured ceilings" "$OUT/cuda.md"
    # The decode and prefill rows, then the targets.
    grep -E "^\| (layer|Llama-3-8B|unaligned)" "$OUT/cuda.md" | cut -d'|' -f2-10
    sed -n '/^## Targets/,$p' "$OUT/cuda.md" | tail -n +3
  fi
} | tee "$OUT/summary.txt"
[ "$status_build" = ok ] && [ "$status_tests" = ok ] && [ "$status_bench" = ok ]
