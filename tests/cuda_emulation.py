"""Builds fp8linear's CUDA kernels for the CPU under tests/cuda_emulator (a SIMT
emulator; see emulator.h) into a torch extension, for tests/test_cuda_emulated.py.

Each .cu file of csrc/cuda but cublaslt.cu (cuBLASLt itself cannot run here) is copied
with its kernel launches rewritten, `kernel<<<grid, block, shared, stream>>>(args);`
becoming `fp8emu::launch(grid, block, shared, stream, [&] { kernel(args); });`, each
`__shared__` array declaration followed by `fp8emu::shared_declared(name, sizeof name);`,
and compiled by the host compiler as C++ with the emulator's header in front. Nothing else
in the sources changes: the kernels' code is the code nvcc compiles, apart from the
`FP8LINEAR_CUDA_EMULATION` branches of the mma.sync and cp.async wrappers and the rows per
launch of scaled_mm.cu, a variable the tests can lower.
"""
import concurrent.futures
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EMULATOR = ROOT / "tests" / "cuda_emulator"
CUDA_SOURCES = ("device.cu", "scaled_mm.cu", "gemm.cu", "gemv.cu", "generic.cu", "quantize.cu")
BINDING_SOURCES = ("checks.cpp", "params.cpp")
MODULE = "fp8linear_cuda_emulated"
# UBSan: on a GPU a misaligned access faults (x86 would load it), and shifts or overflows
# the C++ standard leaves undefined differ between the compilers. Its reports go to a file
# that ubsan_reports() reads (tests/test_cuda_emulated.py fails the test that made one);
# each place in the code is reported once per process.
SANITIZE = ["-fsanitize=undefined"]
CACHE = pathlib.Path(tempfile.gettempdir()) / f"fp8linear-cuda-emulator-{os.getuid()}"
UBSAN_LOG = CACHE / f"ubsan-{os.getpid()}"


def ubsan_reports():
    """The UBSan reports written since the last call (and removes them)."""
    text = ""
    for log in sorted(UBSAN_LOG.parent.glob(UBSAN_LOG.name + ".*")):
        text += log.read_text()
        log.unlink()
    return text

# a kernel name (with template arguments), <<<configuration>>>, (arguments);
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;{}]*?>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)


def cuda_home():
    """The CUDA toolkit whose headers (cuda_runtime_api.h, cuda_fp16.h, ...) the
    emulation compiles against, or None."""
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", "/usr/local/cuda-13.0"):
        if candidate and (pathlib.Path(candidate) / "include" / "cuda_fp8.h").exists():
            return pathlib.Path(candidate)
    return None


# __shared__ [__align__(n)] type name[dims]...;
SHARED = re.compile(r"__shared__\s+((?:__align__\(\d+\)\s+)?[\w:]+\s+(\w+)\s*(?:\[[^\];]+\])+\s*;)")


def rewrite(text):
    """The source for the emulator: every <<<...>>> launch turned into fp8emu::launch, and
    every __shared__ array declaration followed by fp8emu::shared_declared (which fills
    it with 0xFF once per block); raises if a launch or a declaration was left unmatched."""
    rewritten, launches = LAUNCH.subn(lambda m: f"fp8emu::launch({m[2]}, [&] {{ {m[1]}({m[3]}); }});", text)
    if "<<<" in rewritten or launches != text.count("<<<"):
        raise ValueError("a kernel launch the rewrite does not understand")
    rewritten, declarations = SHARED.subn(lambda m: f"__shared__ {m[1]} fp8emu::shared_declared({m[2]}, sizeof {m[2]});",
                                          rewritten)
    if declarations != text.count("__shared__"):
        raise ValueError("a __shared__ declaration the rewrite does not understand")
    return rewritten


def _build_digest(compiler, home):
    """What the module depends on: the sources, the compiler, torch, Python, CUDA's headers."""
    import torch

    digest = hashlib.sha256()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    for part in (version, torch.__version__, sys.version, str(home), " ".join(SANITIZE)):
        digest.update(part.encode())
    for path in sorted((ROOT / "csrc").rglob("*")) + sorted(EMULATOR.rglob("*")) + [pathlib.Path(__file__)]:
        if path.is_file():
            digest.update(str(path.relative_to(ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _compile(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}\n{result.stdout}{result.stderr}")


def build():
    """The emulation module, built once per version of the sources, compiler, torch and
    Python (kept in the temp dir) with the host compiler, two files at a time (about a
    minute on 2 cores)."""
    home = cuda_home()
    if home is None:
        raise RuntimeError("no CUDA toolkit headers found (set CUDA_HOME)")
    compiler = os.environ.get("CXX", "g++")
    directory = CACHE / _build_digest(compiler, home)
    library = directory / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not library.exists():
        for old in CACHE.glob("*"):  # earlier versions' builds, unused for an hour
            if old.is_dir() and old != directory and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
        # each process builds in its own folder and moves the finished module in place
        work = directory / f"work-{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        try:
            _build_in(work, library, home, compiler)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    # read by the module's __ubsan_default_options when it loads (UBSAN_OPTIONS set now
    # would not be: the sanitizer reads the environment the process started with)
    os.environ["FP8LINEAR_EMULATOR_UBSAN"] = f"print_stacktrace=1:log_path={UBSAN_LOG}"
    spec = importlib.util.spec_from_file_location(MODULE, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_in(work, library, home, compiler):
    """Compiles the module in `work` and moves it to `library`."""
    import torch
    from torch.utils import cpp_extension

    sources = []
    for name in CUDA_SOURCES:
        original = ROOT / "csrc" / "cuda" / name
        target = work / (name[:-3] + "_emulated.cpp")
        # #line: compiler messages name the original file
        target.write_text(f'#line 1 "{original}"\n' + rewrite(original.read_text()))
        sources.append(target)
    sources += [ROOT / "csrc" / "bindings" / name for name in BINDING_SOURCES]
    sources += [EMULATOR / "emulator.cpp", EMULATOR / "bindings.cpp"]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-O2", "-std=c++17", "-fPIC", "-DFP8LINEAR_CUDA_EMULATION", "-Wno-unknown-pragmas", *SANITIZE,
             "-ffp-contract=off", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={MODULE}",
             "-DTORCH_API_INCLUDE_EXTENSION_H", "-include", str(EMULATOR / "emulator.h"),
             f"-I{ROOT / 'csrc' / 'cuda'}", f"-I{ROOT / 'csrc'}", f"-I{home / 'include'}",
             f"-I{sysconfig.get_paths()['include']}"]
    flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    objects = [work / (source.stem + ".o") for source in sources]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_compile, [[compiler, *flags, "-c", str(source), "-o", str(target)]
                                 for source, target in zip(sources, objects)]))
    # -Bsymbolic: the module's own CUDA runtime functions, even where a CUDA build of
    # torch has loaded the real libcudart
    _compile([compiler, "-shared", "-Wl,-Bsymbolic", *SANITIZE, *map(str, objects), "-o", str(work / library.name),
              *[f"-L{path}" for path in cpp_extension.library_paths()],
              "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"])
    os.replace(work / library.name, library)
