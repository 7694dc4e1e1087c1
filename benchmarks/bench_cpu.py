"""CPU benchmark: FP8Linear against what a user would pick instead, in one run.

    python benchmarks/bench_cpu.py            # full run (5-7 minutes on 2 cores)
    python benchmarks/bench_cpu.py --smoke    # seconds; part of the tests

For each weight shape (Llama-3-8B's and SmolLM2-135M's) and each number of rows M,
times nn.Linear in bf16 and fp32, torch._scaled_mm on the same fp8 data, torchao's
float8 linear where it runs, and FP8Linear (its activation quantization included).
Decode-sized cases (M <= 16) cycle through enough copies of the layer that each
format reads >= 1 GB of weights per pass: one layer timed in a loop would measure
the cache, where an fp8 layer fits and its bf16 twin doesn't. Contenders are timed
in turn within each repetition (so drifting machine load hits all of them) and the
median is reported. The machine's read bandwidth is measured in the same run, and
a plain read loop runs alternately with each M = 1 layer over the same weight bytes
(and with quantize_fp8 over a buffer 8x its input): the percentages compare the two
in the same moments.

Writes benchmarks/results/cpu-FAMILY.md and .png (speedup over bf16 vs M), one pair per
CPU family (cpu-intel-amx, cpu-amd-zen5, ...: the header names the CPU model and flags),
so that a run on one CPU never overwrites another's results. A contender whose one
call takes more than a few seconds (torch._scaled_mm on an Intel Xeon) is skipped
with a note, so the run finishes on any CPU.
"""
from __future__ import annotations

import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fp8linear
from fp8linear import reference
from fp8linear._native import native

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # also when loaded by file path (tests)
from common import (MODEL_SHAPES, cpu_benchmark_parser, cpu_results_header, plot_speedup,  # noqa: E402
                    select_shapes, setup_cpu_benchmark)

SHAPES = MODEL_SHAPES
ROWS = (1, 2, 4, 8, 16, 64, 256, 2048)
DECODE_ROWS = 16            # up to here weights are cycled from DRAM
WEIGHT_BYTES_PER_PASS = 1 << 30
# A contender whose one call takes longer than this is not put in the timing loop
# (torch._scaled_mm on an Intel Xeon: > 80 s for one M = 16 call of 14336 x 4096).
SKIP_CALL_SECONDS = 3.0
# ... and one whose call takes longer than this is sampled only FEW_SAMPLES times.
SLOW_CALL_SECONDS = 0.3
FEW_SAMPLES = 3


# A sample repeats its pass over the items until it has run this long: a pass over two
# copies of a small layer takes ~0.1 ms, short enough for one page fault or interrupt to
# triple a sample (SmolLM2 at M = 64 once showed bf16 and FP8Linear both 3x slower).
MIN_SAMPLE_SECONDS = 0.02


def median_time(fn, items, repeats: int, min_seconds: float = 0.0) -> float:
    """Median over repeats of the mean time of fn over items (seconds per call); each
    sample makes whole passes over the items until min_seconds have passed."""
    times = []
    for _ in range(repeats):
        calls = 0
        start = time.perf_counter()
        while True:
            for item in items:
                fn(item)
            calls += len(items)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def read_bandwidth(gigabytes: float, repeats: int) -> float:
    """GB/s of reading a buffer far larger than the last-level cache, all threads."""
    # random bytes: pages of one repeated value can be merged by the kernel (KSM) and
    # then read from cache, which once showed twice the real bandwidth here
    buffer = torch.randint(0, 256, (int(gigabytes * 1e9),), dtype=torch.uint8)
    native().read_bandwidth_probe(buffer)
    seconds = median_time(native().read_bandwidth_probe, [buffer], repeats)
    return buffer.numel() / seconds / 1e9


def try_torchao(extra_path=None):
    """(quantize function, None) if torchao's float8 linear runs on the CPU, else (None, why not)."""
    if extra_path is not None and extra_path.is_dir():
        sys.path.insert(0, str(extra_path))
    try:
        import torchao
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor, quantize_
    except Exception as error:  # not installed, or does not import beside this torch
        return None, f"torchao not importable ({type(error).__name__}: {error})"
    probe = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False).bfloat16())
    try:
        quantize_(probe, Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()))
        probe(torch.randn(2, 64, dtype=torch.bfloat16))
    except Exception as error:
        return None, f"torchao {torchao.__version__} refuses the CPU: {str(error).splitlines()[0].rstrip('.')}"

    def make(linear):
        model = torch.nn.Sequential(linear)
        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()))
        return model

    return make, None


def layer_copies(n: int, k: int, rows: int, element_bytes: int, smoke: bool) -> int:
    if smoke:
        return 2
    if rows > DECODE_ROWS:
        return 2  # compute-bound: the cache does not flatter anyone
    return max(2, -(-WEIGHT_BYTES_PER_PASS // (n * k * element_bytes)))


# Never skipped, however slow: what the table is about (bf16 nn.Linear on an AVX2-only
# CPU takes ~13 s for one M = 2048 call of 14336 x 4096).
ALWAYS_TIMED = ("bf16", "fp8linear", "per-channel", "block", "block ue8m0")


def first_call_seconds(key, fn, item, rows, history, notes, layer=""):
    """Time one call of a contender (its warm-up), or skip it without calling when the
    call at a smaller M, scaled by M (the work grows with M), predicts more than
    SKIP_CALL_SECONDS. Returns the seconds, or None if it is skipped (with a note).
    The contenders in ALWAYS_TIMED are only timed."""
    if key in ALWAYS_TIMED:
        start = time.perf_counter()
        fn(item)
        return time.perf_counter() - start
    if key in history:
        last_rows, last_seconds = history[key]
        predicted = last_seconds * rows / last_rows
        if predicted > SKIP_CALL_SECONDS:
            notes.append(f"{key} on {layer} at M = {rows}: skipped, one call would take ~{predicted:.0f} s "
                         f"(M = {last_rows}: {last_seconds:.1f} s)")
            return None
    start = time.perf_counter()
    fn(item)
    seconds = time.perf_counter() - start
    history[key] = (rows, seconds)
    if seconds > SKIP_CALL_SECONDS:
        notes.append(f"{key} on {layer} at M = {rows}: skipped, one call took {seconds:.0f} s")
        return None
    return seconds


def bench_shape(name, n, k, rows_list, repeats, smoke, torchao_make, table, notes):
    history = {}  # contender -> (rows, seconds of one call): predicts the next M's call
    for rows in rows_list:
        torch.manual_seed(0)
        source = torch.nn.Linear(k, n, bias=False)
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        copies8 = layer_copies(n, k, rows, 1, smoke)
        fp8_layers = [fp8linear.FP8Linear.from_linear(source) for _ in range(copies8)]
        # the block-wise scheme (DeepSeek-V3 / Qwen3 checkpoints) beside the per-channel one it is held to
        channel_layers = [fp8linear.FP8Linear.from_linear(source, **fp8linear.SCHEMES["per-channel"])
                          for _ in range(copies8)]
        block_layers = [fp8linear.FP8Linear.from_linear(source, **fp8linear.SCHEMES["block"]) for _ in range(copies8)]
        # and with power-of-two scales (scale_fmt "ue8m0", DeepSeek-V3.1): the AMX and AVX512-BF16 kernels fold them
        ue8m0_layers = [fp8linear.FP8Linear.from_linear(source, **fp8linear.SCHEMES["block"], scale_fmt="ue8m0")
                        for _ in range(copies8)]
        bf16_weights = [source.weight.detach().bfloat16().clone() for _ in range(layer_copies(n, k, rows, 2, smoke))]
        fp32_weights = [source.weight.detach().clone() for _ in range(layer_copies(n, k, rows, 4, smoke))]
        x32 = x.float()
        qx, sx = fp8linear.quantize_fp8(x)
        # FP8Linear layers fed one tensor reuse its dynamic quantization (a model's q, k and v
        # share it), which here would leave the quantization out of every call but a pass's
        # first: they get an inference-mode copy, which is never reused, so that each call
        # quantizes its input (results before 2026-12-05 at M > 16 left it out: see the README)
        with torch.inference_mode():
            x_own = x.clone()
        contenders = {
            "bf16": (lambda w: F.linear(x, w), bf16_weights),
            "fp32": (lambda w: F.linear(x32, w), fp32_weights),
            "fp8linear": (lambda layer: layer(x_own), fp8_layers),
            "per-channel": (lambda layer: layer(x_own), channel_layers),
            "block": (lambda layer: layer(x_own), block_layers),
            "block ue8m0": (lambda layer: layer(x_own), ue8m0_layers),
            # torch's CPU fp8 GEMM is slow enough that one layer per pass is plenty
            "_scaled_mm": (lambda layer: torch._scaled_mm(qx, layer.weight.t(), sx, layer.weight_scale,
                                                          out_dtype=torch.bfloat16), fp8_layers[:1]),
        }
        if rows == 1:
            # the memory's read speed on the very bytes FP8Linear reads, measured in the same
            # repetitions: this host's bandwidth changes by up to 2x from one minute to the next
            contenders["read probe"] = (lambda layer: native().read_bandwidth_probe(layer.weight), fp8_layers)
        if torchao_make is not None:
            contenders["torchao"] = (lambda model: model(x), [torchao_make(torch.nn.Linear(k, n, bias=False).bfloat16())])
        if "_scaled_mm" not in history and rows > 1:
            # no smaller M has run (a --rows list that starts large): one row first, to
            # predict this M's call (on an Intel Xeon one call at M = 2048 would take 0.5-2 hours);
            # its own note is dropped: the skip at this M says what it measured
            first_call_seconds("_scaled_mm", lambda layer: torch._scaled_mm(
                qx[:1], layer.weight.t(), sx, layer.weight_scale, out_dtype=torch.bfloat16), fp8_layers[0], 1,
                history, [])
        first_call, skipped = {}, []  # warm up (first-call costs stay out of the numbers), timing that call
        for key, (fn, items) in list(contenders.items()):
            seconds = first_call_seconds(key, fn, items[0], rows, history, notes, name)
            if seconds is None:
                del contenders[key]
                skipped.append(key)
            else:
                first_call[key] = seconds
        times = {key: [] for key in contenders}
        for repeat in range(repeats):
            for key, (fn, items) in contenders.items():
                if first_call[key] * len(items) > SLOW_CALL_SECONDS and repeat >= FEW_SAMPLES:
                    continue  # a pass of a second or more: a few samples are enough
                times[key].append(median_time(fn, items, 1, 0.0 if smoke else MIN_SAMPLE_SECONDS))
        result = {key: statistics.median(values) for key, values in times.items()}
        result.update(dict.fromkeys(skipped))
        table.append((name, n, k, rows, result))
        print(format_row(table[-1]), flush=True)


def format_row(entry):
    name, n, k, rows, t = entry
    fp8 = t["fp8linear"]
    gbs = n * k / fp8 / 1e9
    def ratio(key, digits=2):  # None: the contender was skipped (too slow); absent: not run at all
        if key not in t:
            return "n/a"
        return "skipped" if t[key] is None else f"{t[key] / fp8:.{digits}f}x"

    cells = [name, str(rows), f"{fp8 * 1e3:.3f}", f"{t['bf16'] * 1e3:.3f}", ratio("bf16"), ratio("fp32"),
             ratio("_scaled_mm", 1), ratio("torchao"), f"{gbs:.1f}",
             f"{2 * rows * n * k / fp8 / 1e12:.3f}"]
    probe = t.get("read probe")
    cells.append(f"{100 * probe / fp8:.0f}% of {n * k / probe / 1e9:.1f}" if probe else "")
    channel, block, ue8m0 = t.get("per-channel"), t.get("block"), t.get("block ue8m0")
    cells += [f"{channel * 1e3:.3f}" if channel else "n/a", f"{block * 1e3:.3f}" if block else "n/a",
              f"{block / channel:.2f}" if channel and block else "n/a",
              f"{ue8m0 / channel:.2f}" if channel and ue8m0 else "n/a"]
    return "| " + " | ".join(cells) + " |"


def bench_quantize(elements: int, repeats: int):
    """quantize_fp8 on bf16, dynamic per-tensor: ours vs the eager reference."""
    x = torch.randn(elements, dtype=torch.bfloat16)
    # alternated with the read probe (on a buffer far larger than the cache, unlike x):
    # both are measured in the same memory conditions
    buffer = torch.randint(0, 256, (max(1 << 20, 8 * elements),), dtype=torch.uint8)
    fp8linear.quantize_fp8(x)
    native().read_bandwidth_probe(buffer)
    ours, probe = [], []
    for _ in range(repeats):
        ours.append(median_time(lambda t: fp8linear.quantize_fp8(t), [x], 1))
        probe.append(median_time(native().read_bandwidth_probe, [buffer], 1))
    eager = median_time(lambda t: reference.quantize_fp8(t), [x], max(1, repeats // 2))
    read_gbs = buffer.numel() / statistics.median(probe) / 1e9
    return statistics.median(ours), eager, elements * 3, read_gbs  # bytes: 2 read + 1 written per element


def write_results(args, table, bandwidth, quantize, torchao_note, notes, elapsed):
    args.output_dir.mkdir(parents=True, exist_ok=True)
    header = ("| layer (N x K) | M | fp8linear ms | bf16 ms | vs bf16 | vs fp32 | vs _scaled_mm | vs torchao "
              "| fp8 weight GB/s | TFLOP/s | % of read probe (GB/s) | per-channel ms | block ms | block / per-channel "
              "| block ue8m0 / per-channel |")
    lines = [
        "# CPU benchmark: FP8Linear vs nn.Linear (bf16, fp32), torch._scaled_mm, torchao",
        "",
        *cpu_results_header(args, elapsed),
        f"Measured read bandwidth (all threads, {args.probe_gb:g} GB of random bytes, median of {args.probe_repeats} passes): "
        f"**{bandwidth:.1f} GB/s** ({args.probe_note}). This host's bandwidth changes by up to 2x from "
        "one minute to the next, so the % column compares each M = 1 layer with the same read probe run on "
        "its own fp8 weights in the same repetitions (\"95% of 49.6\": FP8Linear read at 95% of the "
        "49.6 GB/s the probe read meanwhile).  ",
        f"torchao: {torchao_note}.",
        *([f"Skipped (one call would take more than {SKIP_CALL_SECONDS:g} s): " + "; ".join(notes) + "."] if notes else []),
        "",
        f"Times are medians over repetitions of whole passes over the layer copies (each repetition at least "
        f"{MIN_SAMPLE_SECONDS * 1e3:.0f} ms); ratios > 1 mean FP8Linear is "
        f"faster. M <= {DECODE_ROWS} cycles through >= 1 GB of weights per format (from DRAM); larger M uses "
        "two copies (compute-bound). FP8Linear's time includes quantizing its bf16 input at every call (an "
        "inference-mode copy of it, whose quantization layers never reuse; in a model q, k and v share one); "
        "`_scaled_mm` is "
        "given pre-quantized input. GB/s counts fp8 weight bytes only. \"fp8linear\" is the default scheme "
        "(per-tensor); the last four columns time the per-channel scheme (per-channel weights, per-token "
        "activations) and the block scheme (128 x 128 weight blocks, activations per token and group of 128, "
        "as DeepSeek-V3 / Qwen3 FP8 checkpoints) in the same repetitions: \"block / per-channel\" > 1 means "
        "block-wise is slower; \"block ue8m0\" is the block scheme with its weight and activation scales "
        "rounded up to powers of two (scale_fmt \"ue8m0\", as DeepSeek-V3.1 checkpoints), which the AMX "
        "kernels (all but the dot kernel of M = 1) and the AVX512-BF16 ones (M > 4) fold into the operands.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    lines += [format_row(entry) for entry in table]
    ours, eager, bytes_moved, read_gbs = quantize
    lines += [
        "",
        f"quantize_fp8, {args.quantize_elements / 2**20:.0f} Mi bf16 elements, dynamic per-tensor: "
        f"{ours * 1e3:.2f} ms = {bytes_moved / ours / 1e9:.1f} GB/s counting each byte once (2 read + 1 written per "
        f"element) = {100 * bytes_moved / ours / 1e9 / read_gbs:.0f}% of the read probe run alternately with it "
        f"({read_gbs:.1f} GB/s); a dynamic per-tensor scale needs an amax pass before the "
        f"quantize pass, so 5 bytes per element actually move: {5 / 3 * bytes_moved / ours / 1e9:.1f} GB/s = "
        f"{500 / 3 * bytes_moved / ours / 1e9 / read_gbs:.0f}%. {eager / ours:.1f}x the eager reference "
        f"({eager * 1e3:.1f} ms).",
    ]
    (args.output_dir / args.name).with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot_speedup(table, (args.output_dir / args.name).with_suffix(".png"), fp8_key="fp8linear",
                 title=f"fp8linear on {args.cpu['model']} ({args.cpu['family']}, {native().cpu_variant()} kernels, "
                       f"{torch.get_num_threads()} threads)", baseline_name="nn.Linear")


def main(argv=None):
    parser = cpu_benchmark_parser(__doc__, "cpu", "tiny sizes, one repetition: checks the script runs")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to keep")
    parser.add_argument("--extra-path", type=pathlib.Path, default=None,
                        help="a folder with torchao installed (make bench puts it in .venv/bench-extras)")
    args = parser.parse_args(argv)
    setup_cpu_benchmark(args, "cpu")
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = select_shapes(SHAPES, args.shapes)
    if args.smoke:
        shapes = {"smoke 96x80": (96, 80), "smoke 40x136": (40, 136)}
        rows_list = [1, 17]
        args.repeats = 1
    args.probe_gb = 0.05 if args.smoke else 2.0
    args.quantize_elements = (1 << 16) if args.smoke else (64 << 20)
    start = time.perf_counter()
    probe_repeats = args.probe_repeats = 3 if args.smoke else 7
    bandwidth_before = read_bandwidth(args.probe_gb, probe_repeats)
    print(f"read bandwidth: {bandwidth_before:.1f} GB/s", flush=True)
    torchao_make, torchao_note = try_torchao(args.extra_path)
    torchao_note = torchao_note or "runs on the CPU (column 'vs torchao')"
    print(f"torchao: {torchao_note}", flush=True)
    table, notes = [], []
    for name, (n, k) in shapes.items():
        bench_shape(name, n, k, rows_list, args.repeats, args.smoke, torchao_make, table, notes)
    quantize = bench_quantize(args.quantize_elements, args.repeats)
    # The probe is taken before and after: on a shared host it was seen to halve for a
    # while. Percentages use the larger of the two, so they err on the low side.
    bandwidth_after = read_bandwidth(args.probe_gb, probe_repeats)
    bandwidth = max(bandwidth_before, bandwidth_after)
    args.probe_note = f"{bandwidth_before:.1f} GB/s before the layers, {bandwidth_after:.1f} GB/s after"
    write_results(args, table, bandwidth, quantize, torchao_note, notes, time.perf_counter() - start)
    print((args.output_dir / args.name).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
