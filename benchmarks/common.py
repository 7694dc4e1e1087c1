"""What the CPU and CUDA benchmarks share: the model shapes and the speedup plot."""
from __future__ import annotations

import argparse
import pathlib
import platform

RESULTS = pathlib.Path(__file__).resolve().parent / "results"

MODEL_SHAPES = {  # name: (out_features N, in_features K)
    "Llama-3-8B q/o 4096x4096": (4096, 4096),
    "Llama-3-8B up/gate 14336x4096": (14336, 4096),
    "Llama-3-8B down 4096x14336": (4096, 14336),
    "SmolLM2 up/gate 1536x576": (1536, 576),
    "SmolLM2 down 576x1536": (576, 1536),
    "SmolLM2 q/o 576x576": (576, 576),
}


# The CPU flags that decide which fp8linear kernels can run, in the order printed.
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512vbmi", "avx512_fp16", "amx_tile", "amx_bf16",
                         "amx_int8")


def cpu_description() -> dict:
    """The CPU as /proc/cpuinfo names it: ``model``, ``vendor``, ``flags`` (those of
    CPU_FLAGS_OF_INTEREST it has) and ``family``, a short name for the results file:
    ``intel-amx``, ``intel-avx512``, ``intel-avx2``, ``amd-zen1``, ``amd-zen2``, ``amd-zen-avx2`` (Zen 3),
    ``amd-zen4``, ``amd-zen5``
    or the machine type. Results of different families are kept side by side (their
    bandwidth and multiply units differ 2-3x)."""
    model, vendor, flags, cpu_family, model_number = platform.processor() or platform.machine(), "", set(), None, None
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and model in ("", platform.processor(), platform.machine()):
                model = value
            elif key == "vendor_id":
                vendor = value
            elif key == "flags" and not flags:
                flags = set(value.split())
            elif key == "cpu family" and cpu_family is None and value.isdigit():
                cpu_family = int(value)
            elif key == "model" and model_number is None and value.isdigit():
                model_number = int(value)
    except OSError:  # not Linux: the family falls back to the machine type
        pass
    # The vector width decides which kernels run, so it splits a vendor's CPUs: a Zen 3
    # (family 0x19, AVX2 only) is amd-zen-avx2. Family 0x17 runs each 256-bit operation as
    # two 128-bit halves on Zen 1 (models below 0x30), which makes its AVX2 kernels about
    # 2.5x slower per clock than a Zen 3's: amd-zen1, and amd-zen2 for the later models.
    # Zen 4 (family 0x19 with AVX-512) runs each 512-bit operation as two 256-bit halves
    # and Zen 5 (family 0x1A) does not, so they are kept apart too: amd-zen4, amd-zen5
    # (amd-zen for a later AVX-512 family).
    if vendor == "GenuineIntel":
        family = "intel-amx" if "amx_tile" in flags else "intel-avx512" if "avx512f" in flags else "intel-avx2"
    elif vendor == "AuthenticAMD":
        if cpu_family == 0x17:
            family = "amd-zen1" if (model_number or 0) < 0x30 else "amd-zen2"
        elif "avx512f" not in flags:
            family = "amd-zen-avx2"
        else:
            family = {0x19: "amd-zen4", 0x1A: "amd-zen5"}.get(cpu_family, "amd-zen")
    else:
        family = platform.machine().lower() or "cpu"
    return {"model": model, "vendor": vendor, "family": family, "cpuid": (cpu_family, model_number),
            "flags": [flag for flag in CPU_FLAGS_OF_INTEREST if flag in flags]}


def cpu_benchmark_parser(doc: str, prefix: str, smoke_help: str) -> argparse.ArgumentParser:
    """The options the CPU benchmarks share: --smoke, --threads, --name (default
    PREFIX-FAMILY) and --output-dir; each script adds its own."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--name", default=None,
                        help=f"results file name without suffix (default: {prefix}-FAMILY, e.g. {prefix}-intel-amx, "
                             f"{prefix}-amd-zen5)")
    parser.add_argument("--output-dir", type=pathlib.Path, default=RESULTS)
    return parser


def setup_cpu_benchmark(args, prefix: str) -> None:
    """After parsing: args.cpu (cpu_description), args.name (PREFIX-smoke with --smoke,
    else --name or PREFIX-FAMILY), the thread count, and FP8Linear's path warning off."""
    import warnings

    import torch

    import fp8linear

    args.cpu = cpu_description()
    args.name = f"{prefix}-smoke" if args.smoke else args.name or f"{prefix}-{args.cpu['family']}"
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", fp8linear.FP8PathWarning)


def cpu_results_header(args, elapsed: float, command: str | None = None) -> list[str]:
    """The first lines of a CPU benchmark's results file: the command (default: this
    process's), the CPU (args.cpu from setup_cpu_benchmark) and the date, torch, threads,
    kernel variant and run time."""
    import datetime
    import sys

    import torch

    from fp8linear.backend import cpu_kernel_variant

    cpu = args.cpu
    # "cpu family" and "model" as /proc/cpuinfo gives them: a VM may show a generic model
    # name ("AMD EPYC") whatever the host's core, so these numbers tell runs apart
    cpu_family, model_number = cpu["cpuid"]
    cpuid = f", cpu family {cpu_family} model {model_number}" if cpu_family is not None else ""
    command = command or " ".join([pathlib.Path(sys.executable).name, *sys.argv])
    return [
        f"Command: `{command}`  ",
        f"CPU: {cpu['model']} ({cpu['vendor'] or 'unknown vendor'}{cpuid}; flags: "
        f"{' '.join(cpu['flags']) or 'none of ' + ', '.join(CPU_FLAGS_OF_INTEREST)}); results family "
        f"`{cpu['family']}`.  ",
        f"Date: {datetime.date.today()}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
        f"fp8linear CPU kernels: {cpu_kernel_variant()}; run took {elapsed / 60:.1f} min.  ",
    ]


def select_shapes(shapes: dict, keep: str | None) -> dict:
    """The shapes whose name contains one of the comma-separated parts of ``keep`` (all if None)."""
    if not keep:
        return dict(shapes)
    parts = keep.split(",")
    return {name: shape for name, shape in shapes.items() if any(part in name for part in parts)}


def plot_speedup(table, path, *, fp8_key: str, title: str, baseline_name: str, marker_size: float = 6) -> None:
    """Speedup of fp8linear over bf16 against M, one line per shape (dashed: unaligned).

    table rows are (shape name, N, K, M, {contender: seconds}); without matplotlib the
    plot is skipped with a message (a bare GPU machine may lack it)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot at {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 5.5))
    for name in dict.fromkeys(entry[0] for entry in table):
        entries = [e for e in table if e[0] == name]
        axis.plot([e[3] for e in entries], [e[4]["bf16"] / e[4][fp8_key] for e in entries], marker="o",
                  markersize=marker_size, label=name, linestyle="--" if name.startswith("unaligned") else "-")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("rows M (tokens in the batch)")
    axis.set_ylabel(f"speedup of FP8Linear over bf16 {baseline_name}")
    axis.set_title(title)
    axis.legend(fontsize=7)
    axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
