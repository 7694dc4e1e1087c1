#!/usr/bin/env bash
# The one GPU check: on a bare machine with torch (CUDA), nvcc and a GPU but no
# network, build fp8linear's extension for this GPU, run the CUDA tests and the CUDA
# benchmark, and print a short table last. Under 8 minutes on an H200.
#
#   benchmarks/gpu_check.sh              # from the repository root (or anywhere)
#   OUT=/some/dir benchmarks/gpu_check.sh
#
# Logs and results go to ${OUT:-/tmp/out}: build.log, tests.log, bench.log,
# junit.xml, cuda.md / cuda.png (copied from benchmarks/results/), summary.txt.
# Python packages the tests and fp8linear import (pytest, tqdm, safetensors) that
# the machine lacks are installed from a local wheel directory, .whl/ in the
# repository root, if one was brought along (pip download ... -d .whl).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-/tmp/out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$ROOT"
START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }
status_build=skipped status_tests=skipped status_bench=skipped

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

{
  echo "== $(date -u)"
  nvidia-smi 2>&1 || echo "nvidia-smi not found"
  command -v nvcc && nvcc --version
  echo "CUDA_HOME=${CUDA_HOME:-unset}"
  "$PYTHON" -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), 'capability', torch.cuda.get_device_capability() if torch.cuda.is_available() else None)"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# Missing pure-Python dependencies, from the local wheel directory if there is one.
missing=$("$PYTHON" - << 'EOF'
import importlib.util
print(" ".join(name for name in ("pytest", "tqdm", "safetensors") if importlib.util.find_spec(name) is None))
EOF
)
if [ -n "$missing" ]; then
  if [ -d "$ROOT/.whl" ]; then
    echo "== installing $missing from .whl/ ($(elapsed))"
    "$PYTHON" -m pip install --no-index --find-links "$ROOT/.whl" $missing > "$OUT/wheels.log" 2>&1 \
      || echo "could not install $missing from .whl/ (see wheels.log)"
  else
    echo "!! missing Python packages: $missing (no network: bring wheels in .whl/)"
  fi
fi

# Build for this GPU only (fast): 9.0 -> 9.0a (the arch-specific target), else major.minor.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PYTHON" -c "import torch; major, minor = torch.cuda.get_device_capability(); \
print(f'{major}.{minor}' + ('a' if (major, minor) == (9, 0) else ''))" 2> /dev/null || echo "9.0a")
fi
export TORCH_CUDA_ARCH_LIST
echo "== building for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST ($(elapsed))"
export FP8LINEAR_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
if timeout 420 "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -v -e . > "$OUT/build.log" 2>&1; then
  status_build=ok
else
  # an older pip/setuptools without editable wheels: build in place instead
  echo "pip install failed (see build.log); building in place" | tee -a "$OUT/build.log"
  if timeout 420 "$PYTHON" setup.py build_ext --inplace >> "$OUT/build.log" 2>&1; then
    status_build=ok
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  else
    status_build=FAILED
  fi
fi
grep -E "^fp8linear: building" "$OUT/build.log" | tail -1
echo "== build: $status_build ($(elapsed))"

if [ "$status_build" = ok ]; then
  "$PYTHON" -c "import fp8linear._C as c; print('cuda_built', c.cuda_built(), 'device path', c.cuda_device_path(0))" \
    2>&1 | tee -a "$OUT/build.log"
  echo "== tests ($(elapsed))"
  if timeout 240 "$PYTHON" -m pytest -q --maxfail=50 -p no:cacheprovider tests/test_cuda.py \
      --junitxml="$OUT/junit.xml" > "$OUT/tests.log" 2>&1; then
    status_tests=ok
  else
    status_tests=FAILED
  fi
  tail -n 25 "$OUT/tests.log"
  echo "== benchmark ($(elapsed))"
  if timeout 300 "$PYTHON" benchmarks/bench_cuda.py --output-dir "$OUT" > "$OUT/bench.log" 2>&1; then
    status_bench=ok
    cp "$OUT"/cuda.md "$OUT"/cuda.png benchmarks/results/ 2> /dev/null
  else
    status_bench=FAILED
    tail -n 30 "$OUT/bench.log"
  fi
fi

{
  echo
  echo "== fp8linear GPU check: build $status_build, tests $status_tests, benchmark $status_bench ($(elapsed))"
  grep -E "passed|failed|error" "$OUT/tests.log" 2> /dev/null | tail -1
  if [ -f "$OUT/cuda.md" ]; then
    grep -E "^Measured ceilings" "$OUT/cuda.md"
    # The decode and prefill rows of the Llama shapes, then the targets.
    grep -E "^\| (layer|Llama-3-8B|unaligned)" "$OUT/cuda.md" | awk -F'|' \
      'NR == 1 || $3 + 0 == 1 || $3 + 0 == 16 || $3 + 0 == 1024 || $3 + 0 == 4096' \
      | cut -d'|' -f2-10
    sed -n '/^## Targets/,$p' "$OUT/cuda.md" | tail -n +3
  fi
} | tee "$OUT/summary.txt"
[ "$status_build" = ok ] && [ "$status_tests" = ok ] && [ "$status_bench" = ok ]
