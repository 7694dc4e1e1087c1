"""The build rules of DESIGN.md section 5 that a compiler can check."""
import pathlib
import shutil
import subprocess

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
