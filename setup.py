"""Build of fp8linear._C: the CPU kernels always, the CUDA kernels when torch has
CUDA and nvcc is found (no GPU needed to build). Set FP8LINEAR_CUDA=0 to build
without CUDA, FP8LINEAR_CUDA=1 to fail loudly if it can't be built, FP8LINEAR_NINJA=1
to compile in parallel with ninja (MAX_JOBS at a time), FP8LINEAR_SANITIZE=1 to
instrument the CPU kernels and bindings with AddressSanitizer and UndefinedBehaviorSanitizer
(for `make sanitize`, which builds into build/sanitize/, never in place).

torch must already be installed: pip install --no-build-isolation .
"""
import glob
import os
import sys

from setuptools import setup

try:
    from torch.utils import cpp_extension
except ImportError as error:  # torch missing (or broken): say how to get a working build
    sys.exit(
        f"fp8linear: building needs PyTorch installed first ({type(error).__name__}: {error}).\n"
        "The extension is compiled against the torch that is already installed, so install it, then build\n"
        "without build isolation (an isolated build environment has no torch):\n"
        "    pip install torch    # (CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu)\n"
        "    pip install --no-build-isolation .\n"
        "or run `make install`, which does both in .venv."
    )

ROOT = os.path.dirname(os.path.abspath(__file__))
# sm_80 (A100: 16-bit tensor cores, fp8 widened), sm_89 (Ada: fp8 tensor cores) with its
# PTX embedded, which the driver compiles for GPUs newer than the build knows (sm_100,
# sm_120: without it they would find no kernel image), and sm_90a (Hopper).
DEFAULT_CUDA_ARCHS = "8.0;8.9+PTX;9.0a"


def sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def sanitize_wanted():
    return os.environ.get("FP8LINEAR_SANITIZE", "0").lower() in ("1", "on", "true", "yes")


# AddressSanitizer + UndefinedBehaviorSanitizer (CPU only): -O1 -g for readable reports,
# and undefined behaviour stops the run instead of printing a line and going on.
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined",
                  "-O1", "-g"]


def cuda_wanted():
    """(build CUDA?, reason) from the environment, torch and nvcc."""
    setting = os.environ.get("FP8LINEAR_CUDA", "auto").lower()
    if setting in ("0", "off", "false", "no"):
        return False, "FP8LINEAR_CUDA=0"
    if sanitize_wanted():
        if setting in ("1", "on", "true", "yes"):
            sys.exit("fp8linear: FP8LINEAR_SANITIZE=1 instruments the CPU kernels only; it can't build CUDA")
        return False, "FP8LINEAR_SANITIZE=1 builds the CPU kernels only"
    import torch

    missing = []
    if not torch.version.cuda:
        missing.append("this torch has no CUDA")
    if cpp_extension.CUDA_HOME is None:
        missing.append("nvcc not found (set CUDA_HOME)")
    elif torch.version.cuda:
        # (CUTLASS's arch/mma_sm89.h makes the same cut for these instructions)
        version = nvcc_version(cpp_extension.CUDA_HOME)
        if version is not None and version < (12, 4):
            missing.append(f"nvcc {version[0]}.{version[1]} (in {cpp_extension.CUDA_HOME}) is older than 12.4, the "
                           "first CUDA to compile fp8 tensor-core instructions (mma.sync on e4m3/e5m2): install "
                           "CUDA 12.4 or newer and set CUDA_HOME to it")
    if missing:
        if setting in ("1", "on", "true", "yes"):
            sys.exit("fp8linear: FP8LINEAR_CUDA=1 but " + "; ".join(missing))
        return False, "; ".join(missing)
    return True, "torch CUDA " + torch.version.cuda


def nvcc_version(cuda_home):
    """(major, minor) of CUDA_HOME's nvcc, or None where it does not say."""
    import re
    import subprocess

    try:
        text = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


class BuildExtension(cpp_extension.BuildExtension):
    """torch's BuildExtension, with the .c kernels compiled as C11 rather than
    with the C++ standard flag torch adds to every source."""

    def build_extensions(self):
        compile_one = self.compiler._compile

        def compile_c_as_c(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if src.endswith(".c"):
                flags = extra_postargs["cxx"] if isinstance(extra_postargs, dict) else extra_postargs
                flags = [f for f in flags if not f.startswith("-std=")] + ["-std=c11"]
                extra_postargs = {"cxx": flags, "nvcc": []} if isinstance(extra_postargs, dict) else flags
            return compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = compile_c_as_c
        super().build_extensions()


def extension():
    with_cuda, reason = cuda_wanted()
    cpu_sources = sources("csrc/cpu/*.c") + [
        s for s in sources("csrc/bindings/*.cpp") if not s.endswith("_cuda.cpp")
    ]
    # No native-arch flag: every ISA variant is compiled with target attributes and
    # picked at run time from the CPU's flags.
    # -fopenmp at compile time only: at::parallel_for is an inline OpenMP loop that
    # runs on one thread without it; its GOMP symbols resolve at load time to the
    # OpenMP runtime torch itself loads (linking -lgomp would load a second one).
    cxx_flags = ["-O3", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-fopenmp"]
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        cuda_sources = sources("csrc/cuda/*.cu") + sources("csrc/bindings/*_cuda.cpp")
        # cuBLASLt: the toolkit's, else the copy torch's CUDA wheels install (nvidia/cu13,
        # or nvidia/cublas for CUDA 12), which has only the versioned library: link that
        # file, and search its headers after the toolkit's (-isystem comes after -I).
        cublaslt_flags, cublaslt_link = [], []
        cuda_home = cpp_extension.CUDA_HOME
        if not (os.path.exists(os.path.join(cuda_home, "include", "cublasLt.h"))
                and glob.glob(os.path.join(cuda_home, "lib*", "libcublasLt.so"))):
            try:
                import nvidia

                roots = [os.path.join(base, sub) for base in nvidia.__path__ for sub in ("cu13", "cublas")]
            except ImportError:
                roots = []
            for root in roots:
                libraries = sorted(glob.glob(os.path.join(root, "lib", "libcublasLt.so*")), key=len)
                if os.path.exists(os.path.join(root, "include", "cublasLt.h")) and libraries:
                    cublaslt_flags = ["-isystem", os.path.join(root, "include")]
                    cublaslt_link = [libraries[0], "-Wl,-rpath," + os.path.dirname(libraries[0])]
                    break
            else:
                sys.exit(f"fp8linear: cuBLASLt (cublasLt.h, libcublasLt.so) not found in {cuda_home} "
                         "or in the nvidia-cublas wheel; install it or set FP8LINEAR_CUDA=0")
        print(
            f"fp8linear: building CPU + CUDA kernels ({reason}; "
            f"architectures {os.environ['TORCH_CUDA_ARCH_LIST']})",
            flush=True,
        )
        # --threads 0: nvcc compiles a file's architectures in parallel.
        nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "--threads", "0", *cublaslt_flags]
        return cpp_extension.CUDAExtension(
            "fp8linear._C",
            cpu_sources + cuda_sources,
            define_macros=[("FP8LINEAR_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags + cublaslt_flags, "nvcc": nvcc_flags},
            libraries=[] if cublaslt_link else ["cublasLt"],
            extra_link_args=cublaslt_link,
        )
    link_flags = []
    if sanitize_wanted():
        cxx_flags = cxx_flags + SANITIZE_FLAGS  # the later -O1 wins over -O3
        link_flags = ["-fsanitize=address,undefined"]
        reason += "; instrumented with -fsanitize=address,undefined"
    print(f"fp8linear: building CPU kernels only (no CUDA: {reason})", flush=True)
    return cpp_extension.CppExtension("fp8linear._C", cpu_sources, extra_compile_args={"cxx": cxx_flags},
                                      extra_link_args=link_flags)


# FP8LINEAR_NINJA=1 builds with ninja, MAX_JOBS files at a time (benchmarks/gpu_check.sh:
# the CUDA sources take minutes one by one); torch falls back to the serial build where
# ninja is missing. The ninja build compiles the .c kernels as C++ (they are written
# to compile as both; tests/test_build.py checks it).
setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=os.environ.get("FP8LINEAR_NINJA") == "1")},
)
