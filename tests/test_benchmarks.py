"""The benchmark scripts run (--smoke) and write their table and plot."""
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_cpu_smoke(tmp_path):
    load_script("bench_cpu").main(["--smoke", "--output-dir", str(tmp_path)])
    table = (tmp_path / "cpu-smoke.md").read_text()
    assert "read bandwidth" in table and "quantize_fp8" in table
    rows = [line for line in table.splitlines() if line.startswith("| smoke")]
    assert len(rows) == 4  # two shapes x two row counts
    assert (tmp_path / "cpu-smoke.png").stat().st_size > 1000


def test_bench_rows_smoke(tmp_path):
    load_script("bench_rows").main(["--smoke", "--output-dir", str(tmp_path)])
    table = (tmp_path / "rows-smoke.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| smoke")]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "17", "24"]
    for row in rows:  # every time and ratio a positive number; TFLOP/s (last) a number, which a
        # 96 x 80 layer at M = 1 can round to 0.000 when the host is slow
        cells = [float(cell.strip().strip("*").rstrip("x")) for cell in row.strip("|").split("|")[2:]]
        assert all(cell > 0 for cell in cells[:-1]) and cells[-1] >= 0, row
    assert "slower than bf16" in table
    assert (tmp_path / "rows-smoke.png").stat().st_size > 1000


def test_bench_e2e_smoke(tmp_path):
    load_script("bench_e2e").main(["--smoke", "--output-dir", str(tmp_path)])
    table = (tmp_path / "e2e-smoke.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| per-tensor |", "| per-channel |"))
            and line.count("|") == 8]
    assert len(rows) == 2 and "fp8linear CPU kernels" in table
    for row in rows:  # every figure a positive number
        cells = [cell.strip().rstrip("x") for cell in row.strip("|").split("|")[1:]]
        assert all(float(cell) > 0 for cell in cells)
    # the decode breakdown: a row per model whose parts add up to its token time
    parts = {line.split("|")[1].strip(): [float(cell) for cell in line.strip("|").split("|")[1:]]
             for line in table.splitlines() if line.startswith(("| bf16 |", "| per-tensor |", "| per-channel |"))
             and line.count("|") == 6}
    assert set(parts) == {"bf16", "per-tensor", "per-channel"}
    for token, linear, lm_head, rest in parts.values():
        assert token > 0 and linear > 0 and lm_head > 0 and token > linear + lm_head
        assert rest == pytest.approx(token - linear - lm_head, abs=0.02)
