"""benchmarks/quality.py --smoke: the real SmolLM2-135M model through every scheme.

A few dozen tokens say nothing about the targets (the committed table does, over
~24k tokens), but a broken conversion shows at once: its perplexity explodes."""
import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py"


def test_quality_smoke(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    output = tmp_path / "quality.md"
    # one thread: on a busy 2-core machine two OpenMP threads can be 50x slower
    subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--output", str(output)],
                   check=True, capture_output=True, text=True, timeout=600)
    text = output.read_text()
    assert text.startswith("# FP8 quality on SmolLM2-135M")
    assert f"Command: `python benchmarks/quality.py --smoke --threads 1 --output {output}`" in text
    rows = {}  # scheme -> (perplexity, top-1 agreement %)
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"[\d.]+", cells[2]):
            rows[cells[0]] = (float(cells[2]), float(cells[4].rstrip("%")))
    assert set(rows) == {"original (bf16)", "per-tensor", "per-channel", "static", "weight-only", "block", "block-ue8m0",
                         "per-channel, last 2 layers bf16", "original (float32)"}
    reference = rows["original (bf16)"][0]
    assert 5 < reference < 200
    for scheme, (perplexity, agreement) in rows.items():
        assert abs(perplexity / reference - 1) < 0.15, scheme
        assert agreement > 70, scheme
