"""CUDA benchmark: fp8linear against what a user would pick instead, in one run.

    python benchmarks/bench_cuda.py            # full run (about 2-3 minutes on an H200)
    python benchmarks/bench_cuda.py --smoke    # seconds; without a GPU it says so and exits 0

For each weight shape (Llama-3-8B's, SmolLM2-135M's, and unaligned neighbours with
N or K = 4097 / 4095 / 14335) and each M, times F.linear in bf16, torch._scaled_mm
on the same fp8 data (aligned shapes only: it refuses the others), fp8linear's
scaled_mm (pre-quantized input, like _scaled_mm), FP8Linear (its activation
quantization included) and, for M <= 16, scaled_mm forced onto the up-conversion
path (what a GPU below sm_89 runs). Every contender is captured once per pass in a
CUDA graph (launch overhead out of the numbers) and timed with CUDA events; the
median over replays is reported. Each pass cycles through enough copies of the layer
that >= 256 MB of weights per format are read, five times the 50 MB L2: one layer in
a loop would measure the cache, where an fp8 layer fits and its bf16 twin doesn't.
The ceilings are measured in the same run: device copy bandwidth (read + write) and
dense bf16 / fp8 matmul TFLOP/s.

Writes benchmarks/results/cuda.md and cuda.png (speedup over bf16 vs M).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import pathlib
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also when loaded by file path (tests)
from common import MODEL_SHAPES, RESULTS, plot_speedup, select_shapes  # noqa: E402

SHAPES = {
    **MODEL_SHAPES,
    "SmolLM2 k/v 192x576": (192, 576),
    "unaligned N 4097x4096": (4097, 4096),
    "unaligned K 4096x4095": (4096, 4095),
    "unaligned N 14335x4096": (14335, 4096),
    "unaligned K 4096x14335": (4096, 14335),
}
# The aligned shape each unaligned one is compared with, per FLOP.
NEIGHBOURS = {
    "unaligned N 4097x4096": "Llama-3-8B q/o 4096x4096",
    "unaligned K 4096x4095": "Llama-3-8B q/o 4096x4096",
    "unaligned N 14335x4096": "Llama-3-8B up/gate 14336x4096",
    "unaligned K 4096x14335": "Llama-3-8B down 4096x14336",
}
ROWS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
DECODE_ROWS = 16
WEIGHT_BYTES_PER_PASS = 256 << 20  # five times the 50 MB L2 of an H100/H200
MAX_COPIES = 2048


_capture_stream = None


def time_pass(calls, repeats: int) -> float:
    """Median seconds per call: the calls (one pass over the layer copies) are captured
    in one CUDA graph, which is replayed `repeats` times between CUDA events."""
    global _capture_stream
    if _capture_stream is None:  # one stream: cuBLASLt keeps a workspace per stream
        _capture_stream = torch.cuda.Stream()
    stream = _capture_stream
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # warm-up on the capture stream: workspaces and algorithm choices happen here
        for call in calls[:2]:
            call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def copy_bandwidth(gigabytes: float, repeats: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read and written."""
    source = torch.ones(int(gigabytes * 1e9), dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    seconds = time_pass([lambda: target.copy_(source)], repeats)
    return 2 * source.numel() / seconds / 1e9


def matmul_ceilings(size: int, repeats: int, fp8: bool) -> tuple[float, float | None]:
    """Dense bf16 and (on FP8 GPUs) fp8 torch._scaled_mm TFLOP/s on size^3."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    flops = 2 * size**3
    bf16 = flops / time_pass([lambda: a @ b], repeats) / 1e12
    if not fp8:
        return bf16, None
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    seconds = time_pass([lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)], repeats)
    return bf16, flops / seconds / 1e12


def copies_for(n: int, k: int, element_bytes: int, smoke: bool) -> int:
    if smoke:
        return 2
    return max(2, min(MAX_COPIES, -(-WEIGHT_BYTES_PER_PASS // (n * k * element_bytes))))


def bench_shape(name, n, k, rows_list, repeats, smoke, table):
    import fp8linear
    from fp8linear._native import native

    module = native()
    fp8_gpu = torch.cuda.get_device_capability() >= (8, 9)
    aligned = n % 16 == 0 and k % 16 == 0
    torch.manual_seed(0)
    source = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = fp8linear.FP8Linear.from_linear(source)
    fp8_layers = [layer] + [copy.deepcopy(layer) for _ in range(copies_for(n, k, 1, smoke) - 1)]
    bf16_weights = [source.weight.detach().clone() for _ in range(copies_for(n, k, 2, smoke))]
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        xq, sx = fp8linear.quantize_fp8(x)
        contenders = {
            "bf16": [lambda w=w: F.linear(x, w) for w in bf16_weights],
            "scaled_mm": [lambda l=l: fp8linear.scaled_mm(xq, l.weight.t(), sx, l.weight_scale, out_dtype=torch.bfloat16)
                          for l in fp8_layers],
            "FP8Linear": [lambda l=l: l(x) for l in fp8_layers],
        }
        if fp8_gpu and aligned:
            contenders["_scaled_mm"] = [
                lambda l=l: torch._scaled_mm(xq, l.weight.t(), sx, l.weight_scale, out_dtype=torch.bfloat16)
                for l in fp8_layers]
        result = {}
        fp8linear.scaled_mm(xq, layer.weight.t(), sx, layer.weight_scale, out_dtype=torch.bfloat16)
        result["path"] = module.cuda_last_path()
        for key, calls in contenders.items():
            result[key] = time_pass(calls, repeats)
        if rows <= DECODE_ROWS:
            module.set_cuda_path("upconvert")
            try:
                result["upconvert"] = time_pass(contenders["scaled_mm"], repeats)
            finally:
                module.set_cuda_path("auto")
        table.append((name, n, k, rows, result))
        print(format_row(table[-1]), flush=True)


def format_row(entry, ceilings=None):
    name, n, k, rows, t = entry
    ours = t["scaled_mm"]
    weight_gbs = n * k / ours / 1e9
    tflops = 2 * rows * n * k / ours / 1e12

    def ratio(key, against):
        return f"{t[key] / t[against]:.2f}x" if key in t and against in t else "n/a"

    cells = [name, str(rows), t["path"], f"{ours * 1e6:.1f}", f"{t['FP8Linear'] * 1e6:.1f}", f"{t['bf16'] * 1e6:.1f}",
             ratio("bf16", "scaled_mm"), ratio("bf16", "FP8Linear"), ratio("_scaled_mm", "scaled_mm"),
             ratio("bf16", "upconvert"), f"{weight_gbs:.0f}", f"{tflops:.1f}"]
    if ceilings:
        copy_gbs, _, fp8_tflops = ceilings
        cells.append(f"{100 * weight_gbs / copy_gbs:.0f}%" if rows <= DECODE_ROWS else "")
        cells.append(f"{100 * tflops / fp8_tflops:.0f}%" if fp8_tflops and rows > DECODE_ROWS else "")
    return "| " + " | ".join(cells) + " |"


def bench_quantize(elements: int, repeats: int):
    """quantize_fp8 of bf16, dynamic per-tensor and per-token: GB/s of the bytes that move.

    Per token, each row is read once and written once: 2 + 1 bytes per element. Per tensor,
    the amax kernel reads the whole input before the quantize kernel reads it again (the
    input, 128 MiB, is larger than an H100 or H200 L2 of 50-60 MB): 2 + 2 + 1 bytes per element."""
    import fp8linear

    x = torch.randn(elements // 4096, 4096, device="cuda", dtype=torch.bfloat16)
    per_tensor = time_pass([lambda: fp8linear.quantize_fp8(x)], repeats)
    per_token = time_pass([lambda: fp8linear.quantize_fp8(x, granularity="row")], repeats)
    return {"tensor": 5 * elements / per_tensor / 1e9, "token": 3 * elements / per_token / 1e9}


def targets(table, copy_gbs):
    """The issue's targets, each with the measured value and whether it is met."""
    rows = {(e[0], e[3]): e[4] for e in table}
    lines = []

    def add(what, value, goal, met):
        lines.append(f"| {what} | {value} | {goal} | {'met' if met else 'MISSED'} |")

    for name in ("Llama-3-8B up/gate 14336x4096", "Llama-3-8B down 4096x14336"):
        t = rows.get((name, 1))
        if t:
            speedup = t["bf16"] / t["FP8Linear"]
            add(f"M=1 {name}: FP8Linear vs bf16", f"{speedup:.2f}x", ">= 1.8x", speedup >= 1.8)
            share = SHAPES[name][0] * SHAPES[name][1] / t["scaled_mm"] / 1e9 / copy_gbs
            add(f"M=1 {name}: fp8 weight stream / copy bandwidth", f"{100 * share:.0f}%", ">= 70%", share >= 0.7)
            if "upconvert" in t:
                speedup = t["bf16"] / t["upconvert"]
                add(f"M=1 {name}: up-conversion path vs bf16", f"{speedup:.2f}x", ">= 1.5x", speedup >= 1.5)
    for (name, m), t in rows.items():
        if m >= 1024 and not name.startswith("unaligned") and not name.startswith("SmolLM2"):
            speedup = t["bf16"] / t["FP8Linear"]
            add(f"M={m} {name}: FP8Linear vs bf16", f"{speedup:.2f}x", ">= 1.5x", speedup >= 1.5)
            if "_scaled_mm" in t:
                share = t["_scaled_mm"] / t["scaled_mm"]
                add(f"M={m} {name}: scaled_mm vs torch._scaled_mm", f"{share:.2f}x", ">= 0.95x", share >= 0.95)
    for name, neighbour in NEIGHBOURS.items():
        ratios = []  # (time per FLOP relative to the aligned neighbour, M)
        for (entry_name, m), t in rows.items():
            if entry_name == name and (neighbour, m) in rows:
                (n, k), (n_aligned, k_aligned) = SHAPES[name], SHAPES[neighbour]
                aligned_time = rows[(neighbour, m)]["scaled_mm"]
                ratios.append(((t["scaled_mm"] / (n * k)) / (aligned_time / (n_aligned * k_aligned)), m))
        if ratios:
            worst, m = max(ratios)
            add(f"{name} vs {neighbour}, time per FLOP (worst M={m})", f"{worst:.2f}x", "<= 1.15x", worst <= 1.15)
    return lines


def write_results(args, table, ceilings, quantize, elapsed):
    from fp8linear._native import native

    copy_gbs, bf16_tflops, fp8_tflops = ceilings
    args.output_dir.mkdir(parents=True, exist_ok=True)
    header = ("| layer (N x K) | M | path | scaled_mm us | FP8Linear us | bf16 us | bf16/scaled_mm | bf16/FP8Linear "
              "| _scaled_mm/scaled_mm | bf16/upconvert | fp8 weight GB/s | TFLOP/s | % copy BW | % fp8 peak |")
    properties = torch.cuda.get_device_properties(0)
    lines = [
        "# CUDA benchmark: fp8linear vs F.linear (bf16) and torch._scaled_mm",
        "",
        f"Command: `{' '.join([pathlib.Path(sys.executable).name, *sys.argv])}`  ",
        f"Date: {datetime.date.today()}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"{properties.name}, compute capability {properties.major}.{properties.minor}, "
        f"{properties.multi_processor_count} SMs; default path: {native().cuda_device_path(0)}; "
        f"run took {elapsed / 60:.1f} min.  ",
        f"Measured ceilings: copy **{copy_gbs:.0f} GB/s** (read + write), bf16 matmul **{bf16_tflops:.0f} TFLOP/s**"
        + (f", fp8 torch._scaled_mm **{fp8_tflops:.0f} TFLOP/s**" if fp8_tflops else "") + ".",
        "",
        "Times are medians over CUDA-graph replays of one pass over the layer copies (>= 256 MB of weights per "
        "format, 5x the L2), per call. Ratios > 1 mean fp8linear is faster. `scaled_mm` is given pre-quantized "
        "input, as `_scaled_mm` is (per-tensor scales, bf16 output); FP8Linear includes quantizing its bf16 input. "
        "`path` is the kernel family scaled_mm chose; `upconvert` forces the widening kernels (sm_80 path). "
        "GB/s counts fp8 weight bytes only; % copy BW compares it with the copy's read + write rate.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    lines += [format_row(entry, ceilings) for entry in table]
    lines += [
        "",
        f"quantize_fp8 of {args.quantize_elements / 2**20:.0f} Mi bf16 elements: dynamic per-tensor "
        f"{quantize['tensor']:.0f} GB/s (5 bytes per element: an amax pass, then the quantize pass), "
        f"per-token {quantize['token']:.0f} GB/s (3 bytes per element: one pass) = "
        f"{100 * quantize['tensor'] / copy_gbs:.0f}% / {100 * quantize['token'] / copy_gbs:.0f}% of the copy rate.",
        "",
        "## Targets (issue 4)",
        "",
        "| target | measured | goal | |",
        "|---|---|---|---|",
        *targets(table, copy_gbs),
    ]
    path = (args.output_dir / args.name).with_suffix(".md")
    path.write_text("\n".join(lines) + "\n")
    plot_speedup(table, path.with_suffix(".png"), fp8_key="FP8Linear", title=f"fp8linear on {properties.name}",
                 baseline_name="F.linear")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few repetitions: checks the script runs")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to keep")
    parser.add_argument("--name", default="cuda", help="results file name (without suffix)")
    parser.add_argument("--output-dir", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA GPU here; nothing to measure (skipped).")
        return 0
    import fp8linear
    from fp8linear._native import native

    if not native().cuda_built():
        print("bench_cuda: fp8linear was built without its CUDA kernels; rebuild with a CUDA torch and nvcc.")
        return 1
    warnings.simplefilter("ignore", fp8linear.FP8PathWarning)
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = select_shapes(SHAPES, args.shapes)
    if args.smoke:
        shapes = {"smoke 256x192": (256, 192), "unaligned smoke 130x97": (130, 97)}
        rows_list = [1, 17]
        args.repeats = 2
        args.name = "cuda-smoke"
    args.quantize_elements = (1 << 16) if args.smoke else (64 << 20)
    start = time.perf_counter()
    fp8_gpu = torch.cuda.get_device_capability() >= (8, 9)
    copy_gbs = copy_bandwidth(0.05 if args.smoke else 2.0, args.repeats)
    bf16_tflops, fp8_tflops = matmul_ceilings(1024 if args.smoke else 8192, args.repeats, fp8_gpu)
    ceilings = (copy_gbs, bf16_tflops, fp8_tflops)
    print(f"ceilings: copy {copy_gbs:.0f} GB/s, bf16 {bf16_tflops:.0f} TFLOP/s, fp8 {fp8_tflops or 0:.0f} TFLOP/s",
          flush=True)
    table = []
    for name, (n, k) in shapes.items():
        bench_shape(name, n, k, rows_list, args.repeats, args.smoke, table)
        torch.cuda.empty_cache()
    quantize = bench_quantize(args.quantize_elements, args.repeats)
    path = write_results(args, table, ceilings, quantize, time.perf_counter() - start)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
