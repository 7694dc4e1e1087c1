"""End to end on the CPU: SmolLM2-135M-Instruct in bf16 against its FP8 conversions, side by side.

Times the prefill of a long prompt (time to first token: one forward pass over
--prompt-tokens tokens, where the linear layers run with that many rows) and greedy
decode (tokens/s over --new-tokens tokens, one row per step). The bf16 model and each
FP8 copy run in alternation, round after round, so that the host's drift (its memory
bandwidth moves by up to 2x within minutes) hits all of them alike; each figure is a
median over rounds, and each ratio the median of the per-round ratios.

Writes benchmarks/results/e2e-FAMILY.md (e2e-intel-amx, e2e-amd-zen4, ...): one file per
CPU family, so that a run on one CPU never replaces another's.

    python benchmarks/bench_e2e.py                # about 2 minutes on 2 cores
    python benchmarks/bench_e2e.py --smoke        # a tiny random model: checks the script runs
"""
from __future__ import annotations

import copy
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cpu_benchmark_parser, cpu_results_header, setup_cpu_benchmark  # noqa: E402

import fp8linear  # noqa: E402
from fp8linear.demo import median_ratio, prefill as prefill_pass, side_by_side  # noqa: E402

# fp8linear.SCHEMES names: the default (per-tensor weights and dynamic activations), and
# per-channel weights with dynamic per-token activations
SCHEMES = ("per-tensor", "per-channel")


def tiny_model():
    """A random 2-layer Llama (smoke runs: no model file needed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval(), "a random 2-layer Llama (smoke run)"


def decode(model, ids, new_tokens: int) -> None:
    with torch.no_grad():  # as transformers' generate; inference mode would stop FP8Linear reusing q/k/v's input
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] - ids.shape[1] == new_tokens


def run(args) -> dict:
    if args.smoke:
        base, description = tiny_model()
        long_ids = torch.randint(0, 512, (1, args.prompt_tokens))
        short_ids = torch.randint(0, 512, (1, 8))
    else:
        from fp8linear.demo import load_model, prompt_ids

        base, tokenizer, description = load_model(None, dtype=torch.bfloat16)
        long_ids = prompt_ids(tokenizer, args.prompt_tokens)
        short_ids = tokenizer("Once upon a time,", return_tensors="pt")["input_ids"]
    models = {"bf16": base}
    for scheme in SCHEMES:
        models[scheme] = fp8linear.quantize_model(copy.deepcopy(base), "fp8", **fp8linear.SCHEMES[scheme])
    # the models take turns within each round, after a warm-up pass each (the first passes
    # allocate and fault in the kernels' memory)
    prefill = side_by_side(models, lambda model: prefill_pass(model, long_ids), args.rounds)
    decode_seconds = side_by_side(models, lambda model: decode(model, short_ids, args.new_tokens), args.decode_rounds,
                                  warm_up=lambda model: decode(model, short_ids, 2))
    decode_speed = {name: [args.new_tokens / t for t in times] for name, times in decode_seconds.items()}
    results = {"description": description, "rows": []}
    for name in SCHEMES:
        prefill_ratio = median_ratio(prefill[name], prefill["bf16"])
        decode_ratio = median_ratio(decode_speed[name], decode_speed["bf16"])
        results["rows"].append({
            "scheme": name,
            "prefill_bf16_ms": statistics.median(prefill["bf16"]) * 1e3,
            "prefill_fp8_ms": statistics.median(prefill[name]) * 1e3,
            "prefill_time_ratio": prefill_ratio,
            "decode_bf16": statistics.median(decode_speed["bf16"]),
            "decode_fp8": statistics.median(decode_speed[name]),
            "decode_speed_ratio": decode_ratio,
        })
    return results


def write_results(args, results, elapsed) -> pathlib.Path:
    lines = [
        "# End to end: SmolLM2-135M-Instruct, bf16 vs FP8Linear (CPU)",
        "",
        *cpu_results_header(args, elapsed, f"python benchmarks/bench_e2e.py{' --smoke' if args.smoke else ''}"),
        f"Model: {results['description']}.",
        "",
        f"Prefill: one forward pass over a {args.prompt_tokens}-token prompt (time to first token), "
        f"{args.rounds} rounds; decode: greedy generation of {args.new_tokens} tokens after a short prompt, "
        f"{args.decode_rounds} rounds, both under `torch.no_grad()` (as transformers' `generate`). The models "
        "run in alternation within each round; times are medians "
        "over rounds and ratios medians of the per-round ratios. `per-tensor` (`quantize_model(model, \"fp8\")`'s "
        "default) is per-tensor weights with dynamic per-tensor activations, `per-channel` per-channel weights with dynamic per-token activations; "
        "lm_head stays bf16 (the default skip).",
        "",
        "| scheme | prefill bf16 ms | prefill FP8 ms | FP8 / bf16 time | decode bf16 tokens/s | decode FP8 tokens/s "
        "| FP8 / bf16 speed |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(f"| {row['scheme']} | {row['prefill_bf16_ms']:.1f} | {row['prefill_fp8_ms']:.1f} | "
                     f"{row['prefill_time_ratio']:.3f} | {row['decode_bf16']:.1f} | {row['decode_fp8']:.1f} | "
                     f"{row['decode_speed_ratio']:.2f}x |")
    path = (args.output_dir / args.name).with_suffix(".md")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None):
    parser = cpu_benchmark_parser(__doc__, "e2e", "a tiny random model, few rounds: checks the script runs")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15, help="prefill rounds")
    parser.add_argument("--decode-rounds", type=int, default=5)
    args = parser.parse_args(argv)
    setup_cpu_benchmark(args, "e2e")
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.rounds, args.decode_rounds = 64, 4, 2, 1
    start = time.perf_counter()
    results = run(args)
    path = write_results(args, results, time.perf_counter() - start)
    print(path.read_text())


if __name__ == "__main__":
    main()
