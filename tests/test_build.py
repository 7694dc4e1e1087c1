"""The build rules of DESIGN.md section 5 that a compiler can check."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
C_SOURCES = sorted((ROOT / "csrc" / "cpu").glob("*.c"))


@pytest.mark.parametrize("compiler, flags", [("gcc", ["-std=c11"]), ("g++", ["-x", "c++", "-std=c++17"])])
def test_c_kernels_compile_as_c_and_as_cpp(compiler, flags):
    # torch's ninja build compiles .c files with the C++ compiler; setup.py uses the C one
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not found")
    for source in C_SOURCES:
        result = subprocess.run([compiler, *flags, "-O1", "-Wall", "-Werror", "-fsyntax-only", str(source)],
                                capture_output=True, text=True)
        assert result.returncode == 0, f"{source.name} with {compiler}:\n{result.stderr}"



# On CPUs other than x86-64 (aarch64: AWS Graviton, Ampere, Apple silicon under Linux) the
# extension builds with the scalar kernels alone: the x86 files compile to nothing
# (FP8_X86_KERNELS in cpu_internal.h) and the dispatch leaves them out. zig (the ziglang
# wheel, in requirements-dev.txt) cross-compiles for aarch64 with its own libc headers.
AARCH64 = "aarch64-linux-gnu"


def zig_command():
    pytest.importorskip("ziglang", reason="the aarch64 build check needs zig: pip install ziglang")
    return [sys.executable, "-m", "ziglang"]


def run_zig(args, what):
    result = subprocess.run([*zig_command(), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{what}:\n{result.stderr[-4000:]}"


def elf_symbols(path, *options):
    # GNU nm reads the symbol table of any ELF file, aarch64 included
    if shutil.which("nm") is None:
        pytest.skip("nm not found")
    result = subprocess.run(["nm", *options, str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in result.stdout.splitlines() if line.strip()}


def test_extension_builds_for_aarch64(tmp_path):
    from torch.utils import cpp_extension
    import sysconfig

    kernels = []
    for source in C_SOURCES:
        kernels.append(tmp_path / f"{source.stem}.o")
        run_zig(["cc", "-target", AARCH64, "-std=c11", "-O1", "-g0", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                 "-fno-strict-aliasing", "-I", ROOT / "csrc", "-c", source, "-o", kernels[-1]], f"{source.name} for aarch64")
    library = tmp_path / "libkernels.so"
    # -z defs: every symbol the kernels use is defined (no call into an x86 file left behind)
    run_zig(["cc", "-target", AARCH64, "-shared", "-Wl,-z,defs", "-o", library, *kernels, "-lm"], "linking for aarch64")
    assert library.read_bytes()[18:20] == (183).to_bytes(2, "little")  # ELF e_machine: EM_AARCH64
    defined = elf_symbols(library, "-D", "--defined-only")
    # the x86 kernels are absent, not stubbed
    assert not {name for name in defined if name.startswith(("fp8_bf16_", "fp8_amx_", "fp8_avx2_"))
                or name.endswith(("_avx2", "_avx512", "_vbmi"))}, defined

    # The bindings have no ISA-specific code; this keeps it so. torch's headers are the same
    # on every CPU; Python's pyconfig.h is this machine's (x86-64, also LP64), unless it is a
    # multiarch wrapper that picks a per-architecture file (Debian's system Python).
    python_include = sysconfig.get_paths()["include"]
    probe = tmp_path / "probe.c"
    probe.write_text("#include <Python.h>\n")
    result = subprocess.run([*zig_command(), "cc", "-target", AARCH64, f"-I{python_include}", "-c", str(probe), "-o",
                             str(tmp_path / "probe.o")], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.skip(f"this Python's headers do not compile for aarch64 ({python_include}): the bindings are not checked")
    includes = [f"-I{path}" for path in [*cpp_extension.include_paths(), python_include, ROOT / "csrc"]]
    needed = set()
    for source in sorted((ROOT / "csrc" / "bindings").glob("*.cpp")):
        if source.name.endswith("_cuda.cpp"):
            continue
        obj = tmp_path / f"{source.stem}.bindings.o"
        run_zig(["c++", "-target", AARCH64, "-std=c++17", "-O0", "-Wno-unknown-pragmas", "-DTORCH_EXTENSION_NAME=_C",
                 "-DTORCH_API_INCLUDE_EXTENSION_H", *includes, "-c", source, "-o", obj], f"{source.name} for aarch64")
        needed |= {name for name in elf_symbols(obj, "-u") if name.startswith("fp8_")}
    # every kernel entry point the bindings call is in the aarch64 kernel library
    assert "fp8_cpu_scaled_mm" in needed and needed <= defined, sorted(needed - defined)


def test_no_native_arch_flags():
    for path in [ROOT / "setup.py", *ROOT.glob("csrc/**/*")]:
        if path.is_file():
            assert "-march=native" not in path.read_text(errors="ignore"), path


def test_kernels_do_not_include_torch():
    for path in [*ROOT.glob("csrc/cpu/*"), *ROOT.glob("csrc/cuda/*"), ROOT / "csrc" / "fp8.h", ROOT / "csrc" / "kernels.h"]:
        text = path.read_text()
        assert "#include <torch" not in text and "#include <ATen" not in text, path


def _run_setup(fake_packages, unset=(), **env):
    """`python setup.py --name` with the packages in `fake_packages` first on the path (a
    stand-in torch), without the environment's Python settings and preloads (and `unset`)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTHON", "LD_PRELOAD", *unset))} | env
    env["PYTHONPATH"] = str(fake_packages)
    return subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_setup_without_torch_says_how_to_install_it(tmp_path):
    # a `torch` that fails to import, first on the path: what setup.py sees where torch is not
    # installed, e.g. in pip's isolated build environment (pip install . without
    # --no-build-isolation)
    (tmp_path / "torch").mkdir()
    fake = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')"
    (tmp_path / "torch" / "__init__.py").write_text(fake)
    result = _run_setup(tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert "needs PyTorch installed first" in result.stderr
    assert "pip install torch" in result.stderr and "pip install --no-build-isolation ." in result.stderr


def test_default_cuda_architectures_embed_portable_ptx():
    # newer GPUs than the build knows (sm_100, sm_120) need PTX to JIT: without it they
    # have no kernel image while backend() still reports the fp8 path
    source = (ROOT / "setup.py").read_text()
    match = re.search(r'^DEFAULT_CUDA_ARCHS = "([^"]+)"', source, re.MULTILINE)
    assert match is not None
    architectures = match.group(1).split(";")
    assert any(arch.endswith("+PTX") and not arch.split("+")[0].endswith("a") for arch in architectures)
    assert {"8.0", "9.0a"} <= {arch.split("+")[0] for arch in architectures}


def test_every_software_prefetch_survives_compilation(tmp_path):
    # A prefetch has no effect a compiler can see, so a helper holding nothing else can be
    # split off as a function "without side effects" and its calls deleted: GCC did that to
    # quantize_avx512.c's and to the AVX512-BF16 tile kernel's, silently. Each _mm_prefetch
    # in the kernels must still be behind some prefetch instruction of an -O3 build (as
    # setup.py compiles them), found through the debug info's inline chains.
    for tool in ("gcc", "objdump", "addr2line"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found")
    wanted = {}
    for path in sorted((ROOT / "csrc" / "cpu").glob("*.[ch]")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if "_mm_prefetch(" in line and not line.lstrip().startswith(("/*", "*")):
                wanted[(path.name, number)] = line.strip()
    assert wanted, "no _mm_prefetch found in csrc/cpu"
    found = set()
    # the files that hold a prefetch, and those that include a header holding one
    headers = {name for name, _ in wanted if name.endswith(".h")}
    sources = {path.name for path in C_SOURCES
               if path.name in {name for name, _ in wanted}
               or any(f'#include "{header}"' in path.read_text() for header in headers)}
    for name in sorted(sources):
        obj = tmp_path / f"{name}.o"
        subprocess.run(["gcc", "-std=c11", "-O3", "-g", "-fno-strict-aliasing", "-fwrapv", "-fPIC", "-fopenmp",
                        "-I", str(ROOT / "csrc"), "-c", str(ROOT / "csrc" / "cpu" / name), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                                     capture_output=True, text=True).stdout
        addresses = [m.group(1) for m in re.finditer(r"^\s*([0-9a-f]+):\s+prefetch", disassembly, re.M)]
        if not addresses:
            continue
        chains = subprocess.run(["addr2line", "-i", "-e", str(obj), *addresses], check=True,
                                capture_output=True, text=True).stdout
        for m in re.finditer(r"([\w.]+):(\d+)", chains):
            found.add((m.group(1), int(m.group(2))))
    missing = [f"{name}:{number}: {text}" for (name, number), text in wanted.items() if (name, number) not in found]
    assert not missing, "prefetches the compiler dropped:\n" + "\n".join(missing)


def _fake_cuda_torch(root, nvcc_release):
    """A `torch` package whose CUDA is 12.x and whose CUDA_HOME holds an nvcc that prints
    `nvcc_release`: what setup.py asks of them, without a CUDA torch or toolkit."""
    package = root / "torch"
    (package / "utils").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import version, utils\n")
    (package / "version.py").write_text("cuda = '12.6'\n")
    (package / "utils" / "__init__.py").write_text("from . import cpp_extension\n")
    (package / "utils" / "cpp_extension.py").write_text(
        "import setuptools\n"
        "from setuptools.command.build_ext import build_ext\n"
        f"CUDA_HOME = {str(root / 'cuda')!r}\n"
        "class BuildExtension(build_ext):\n"
        "    @classmethod\n"
        "    def with_options(cls, **options):\n"
        "        return cls\n"
        "def CppExtension(name, sources, **options):\n"
        "    return setuptools.Extension(name, sources)\n"
        "CUDAExtension = CppExtension\n")
    nvcc = root / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.99'\n")
    nvcc.chmod(0o755)


@pytest.mark.parametrize("setting", ["1", "auto"])
def test_setup_refuses_an_nvcc_older_than_12_4(tmp_path, setting):
    # fp8 mma.sync (the GEMV and GEMM for sm_89 / sm_90) needs CUDA 12.4's ptxas: an older
    # nvcc would fail the whole build in ptxas; auto builds the CPU kernels instead
    _fake_cuda_torch(tmp_path, "12.2")
    result = _run_setup(tmp_path, FP8LINEAR_CUDA=setting)
    if setting == "1":
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert "FP8LINEAR_CUDA=1 but nvcc 12.2" in result.stderr and "older than 12.4" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert "building CPU kernels only (no CUDA: nvcc 12.2" in result.stdout


def test_setup_takes_an_nvcc_of_12_4(tmp_path):
    _fake_cuda_torch(tmp_path, "12.4")
    result = _run_setup(tmp_path, unset=("CUDA_HOME",), FP8LINEAR_CUDA="1")
    # past the version check: it goes on to look for cuBLASLt, which the fake toolkit lacks
    assert "older than 12.4" not in result.stderr + result.stdout
    assert "cuBLASLt" in result.stderr or "building CPU + CUDA kernels" in result.stdout, result.stderr
