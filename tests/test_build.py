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


def test_no_native_arch_flags():
    for path in [ROOT / "setup.py", *ROOT.glob("csrc/**/*")]:
        if path.is_file():
            assert "-march=native" not in path.read_text(errors="ignore"), path


def test_kernels_do_not_include_torch():
    for path in [*ROOT.glob("csrc/cpu/*"), *ROOT.glob("csrc/cuda/*"), ROOT / "csrc" / "fp8.h", ROOT / "csrc" / "kernels.h"]:
        text = path.read_text()
        assert "#include <torch" not in text and "#include <ATen" not in text, path


def test_setup_without_torch_says_how_to_install_it(tmp_path):
    # a `torch` that fails to import, first on the path: what setup.py sees where torch is not
    # installed, e.g. in pip's isolated build environment (pip install . without
    # --no-build-isolation)
    (tmp_path / "torch").mkdir()
    fake = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')"
    (tmp_path / "torch" / "__init__.py").write_text(fake)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "LD_PRELOAD"))}
    env["PYTHONPATH"] = str(tmp_path)
    result = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
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
