"""benchmarks/gpu_check.sh keeps within the device tool's limits: one deadline for the
whole script (600 s per command there) and at most 7 files under $OUT (8 come back).

On a machine without a GPU the script's build fails at once (FP8LINEAR_CUDA=1 with a torch
without CUDA, or no nvcc), which is enough to check what it leaves behind and that it
ends by its deadline with a summary."""
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the script does the real check")


def _run(tmp_path, deadline):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_SECONDS": str(deadline)}
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=deadline + 120)
    return result, out, time.monotonic() - start


def test_without_a_gpu_it_fails_fast_with_few_files_and_a_summary(tmp_path):
    result, out, seconds = _run(tmp_path, deadline=120)
    assert result.returncode != 0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 7, files
    assert "summary.txt" in files and "log.txt" in files
    summary = (out / "summary.txt").read_text()
    assert "fp8linear GPU check: build FAILED, tests skipped, benchmark skipped, memcheck skipped" in summary
    assert result.stdout.rstrip().endswith(summary.rstrip())  # the summary is printed last
    assert seconds < 120


def test_a_short_deadline_is_kept(tmp_path):
    # every step's timeout comes out of the one deadline: with 8 s the build is cut off
    # (or fails sooner) and the script still ends near the deadline, with its summary
    result, out, seconds = _run(tmp_path, deadline=8)
    assert result.returncode != 0
    assert (out / "summary.txt").exists()
    assert seconds < 8 + 30  # the environment probe's python start-up is outside the steps' timeouts
