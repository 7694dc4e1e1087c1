"""FP8Linear against bf16 nn.Linear at every batch size, not only powers of two.

    python benchmarks/bench_rows.py            # full run (~5 minutes on 2 cores)
    python benchmarks/bench_rows.py --smoke    # seconds; part of the tests

bench_cpu.py times M = 1, 2, 4, ..., 2048, where the kernels' row blocks (groups of 16
rows) are full. A batch of 17 or 65 rows is not: this sweep times every M from 1 to 40
and the M on both sides of each multiple of 16 up to 520, for one Llama-3-8B and one
SmolLM2 shape, so that a cliff at some M (a kernel padding its rows, a kernel switch)
shows. FP8Linear in its default (per-tensor) and per-channel schemes against
F.linear in bf16, timed in turn within each repetition, medians. Up to M = 64 each format
cycles through >= 1 GB of weight copies (from DRAM, as in decode and small batches);
larger M use two copies.

Writes benchmarks/results/rows-FAMILY.md and .png (one pair per CPU family, as
bench_cpu.py).
"""
from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fp8linear
from fp8linear._native import native

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also when loaded by file path (tests)
from bench_cpu import MIN_SAMPLE_SECONDS, median_time  # noqa: E402
from common import (MODEL_SHAPES, cpu_benchmark_parser, cpu_results_header, plot_speedup,  # noqa: E402
                    select_shapes, setup_cpu_benchmark)

SHAPES = {name: MODEL_SHAPES[name] for name in ("Llama-3-8B q/o 4096x4096", "SmolLM2 up/gate 1536x576")}
ROWS = sorted(set(range(1, 41)) | {r + d for r in range(48, 521, 16) for d in (-1, 0, 1, 8)})
CYCLED_ROWS = 64            # up to here each format cycles >= WEIGHT_BYTES_PER_PASS of copies
WEIGHT_BYTES_PER_PASS = 1 << 30
CONTENDERS = ("bf16", "fp8linear", "per-channel")


def bench_shape(name, n, k, rows_list, repeats, smoke, table):
    torch.manual_seed(0)
    source = torch.nn.Linear(k, n, bias=False)
    copies = 2 if smoke else max(2, -(-WEIGHT_BYTES_PER_PASS // (n * k)))  # fp8 bytes; bf16 twice that
    bf16_weights = [source.weight.detach().bfloat16().clone() for _ in range(copies)]
    layers = {
        "fp8linear": [fp8linear.FP8Linear.from_linear(source) for _ in range(copies)],
        "per-channel": [fp8linear.FP8Linear.from_linear(source, **fp8linear.SCHEMES["per-channel"])
                        for _ in range(copies)],
    }
    for rows in rows_list:
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        with torch.inference_mode():
            x_own = x.clone()  # never reused by the layers' quantization: every call quantizes (as bench_cpu.py)
        used = copies if rows <= CYCLED_ROWS else 2
        contenders = {
            "bf16": (lambda w: F.linear(x, w), bf16_weights[:used]),
            "fp8linear": (lambda layer: layer(x_own), layers["fp8linear"][:used]),
            "per-channel": (lambda layer: layer(x_own), layers["per-channel"][:used]),
        }
        for fn, items in contenders.values():
            fn(items[0])  # warm up
        times = {key: [] for key in contenders}
        for _ in range(repeats):
            for key, (fn, items) in contenders.items():
                times[key].append(median_time(fn, items, 1, 0.0 if smoke else MIN_SAMPLE_SECONDS))
        # ratios per repetition, then their median: both sides of a ratio ran in the same moments
        result = {key: statistics.median(values) for key, values in times.items()}
        ratios = {key: statistics.median(b / f for b, f in zip(times["bf16"], times[key]))
                  for key in ("fp8linear", "per-channel")}
        table.append((name, n, k, rows, result, ratios))
        print(format_row(table[-1]), flush=True)


def format_row(entry):
    name, n, k, rows, t, ratios = entry
    return (f"| {name} | {rows} | {t['bf16'] * 1e3:.3f} | {t['fp8linear'] * 1e3:.3f} | "
            f"**{ratios['fp8linear']:.2f}x** | {t['per-channel'] * 1e3:.3f} | {ratios['per-channel']:.2f}x | "
            f"{2 * rows * n * k / t['fp8linear'] / 1e12:.3f} |")


def write_results(args, table, elapsed):
    args.output_dir.mkdir(parents=True, exist_ok=True)
    header = ("| layer (N x K) | M | bf16 ms | fp8linear ms | vs bf16 | per-channel ms | per-channel vs bf16 "
              "| fp8linear TFLOP/s |")
    below = [f"{e[0].split()[0]} M = {e[3]}: {e[5]['fp8linear']:.2f}x" for e in table if e[5]["fp8linear"] < 1.0]
    lines = [
        "# CPU benchmark: FP8Linear vs bf16 nn.Linear at every batch size",
        "",
        *cpu_results_header(args, elapsed),
        "",
        f"Each repetition times the contenders in turn (passes over the layer copies, each at least "
        f"{MIN_SAMPLE_SECONDS * 1e3:.0f} ms); times are medians of {args.repeats} repetitions, ratios the "
        f"medians of the per-repetition ratios (> 1: FP8Linear faster). Up to M = {CYCLED_ROWS} each format "
        f"cycles through >= {WEIGHT_BYTES_PER_PASS >> 30} GB of weight copies (from DRAM); larger M use two "
        "copies. FP8Linear quantizes its bf16 input at every call (included).",
        "",
        f"Rows where FP8Linear (per-tensor) is slower than bf16: {'; '.join(below) if below else 'none'}.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
        *[format_row(entry) for entry in table],
    ]
    (args.output_dir / args.name).with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot_speedup([(e[0], e[1], e[2], e[3], e[4]) for e in table], (args.output_dir / args.name).with_suffix(".png"),
                 fp8_key="fp8linear", title=f"fp8linear at every M on {args.cpu['model']} ({args.cpu['family']}, "
                                            f"{native().cpu_variant()} kernels, {torch.get_num_threads()} threads)",
                 baseline_name="nn.Linear", marker_size=3)


def main(argv=None):
    parser = cpu_benchmark_parser(__doc__, "rows", "tiny sizes, one repetition: checks the script runs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", default=None, help="comma-separated M (default: 1-40 and around each 16 to 520)")
    parser.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to keep")
    args = parser.parse_args(argv)
    setup_cpu_benchmark(args, "rows")
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else ROWS
    shapes = select_shapes(SHAPES, args.shapes)
    if args.smoke:
        shapes = {"smoke 96x80": (96, 80)}
        rows_list = [1, 17, 24]
        args.repeats = 1
    start = time.perf_counter()
    table = []
    for name, (n, k) in shapes.items():
        bench_shape(name, n, k, rows_list, args.repeats, args.smoke, table)
    write_results(args, table, time.perf_counter() - start)
    print((args.output_dir / args.name).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
