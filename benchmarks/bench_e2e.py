"""End to end on the CPU: SmolLM2-135M-Instruct in bf16 against its FP8 conversions, side by side.

Times the prefill of a long prompt (time to first token: one forward pass over
--prompt-tokens tokens, where the linear layers run with that many rows, computing the
last position's logits only, as transformers' generate does) and greedy
decode (tokens/s over --new-tokens tokens, one row per step). The bf16 model and each
FP8 copy run in alternation, round after round, so that the host's drift (its memory
bandwidth moves by up to 2x within minutes) hits all of them alike; each figure is a
median over rounds, and each ratio the median of the per-round ratios.

Then, in as many more decode rounds (--breakdown-rounds), it splits a decoded token's time
into the decoder's linear layers, the lm_head and the rest of the model (attention, norms,
embeddings, generate's own work), each linear layer's forward wrapped in a timer: what
FP8 weights can shorten, and what they cannot.

Writes benchmarks/results/e2e-FAMILY.md (e2e-intel-amx, e2e-amd-zen4, ...): one file per
CPU family, so that a run on one CPU never replaces another's.

    python benchmarks/bench_e2e.py                # about a minute on 2 cores
    python benchmarks/bench_e2e.py --smoke        # a tiny random model: checks the script runs
"""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def timed_linear_layers(model, seconds: dict):
    """While in the block, each linear layer's forward time (nn.Linear or FP8Linear) is added
    to seconds["lm_head"] for the model's output layer and to seconds["linear"] for the rest;
    the timer itself adds about a microsecond per call. The layers' forwards are restored
    on leaving."""
    output_layer = model.get_output_embeddings()
    patched = []
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, fp8linear.FP8Linear)):
            def timed(*args, _forward=module.forward, _key="lm_head" if module is output_layer else "linear", **kwargs):
                start = time.perf_counter()
                try:
                    return _forward(*args, **kwargs)
                finally:
                    seconds[_key] += time.perf_counter() - start
            module.forward = timed  # an instance attribute, which nn.Module.__call__ finds first
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def decode_breakdown(models: dict, ids, new_tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    """Milliseconds per decoded token (medians over ``rounds``, the models in turns): in all,
    in the linear layers but the lm_head, in the lm_head, and in the rest."""
    parts = {name: {"token": [], "linear": [], "lm_head": []} for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            seconds = {"linear": 0.0, "lm_head": 0.0}
            with timed_linear_layers(model, seconds):
                start = time.perf_counter()
                decode(model, ids, new_tokens)
                seconds["token"] = time.perf_counter() - start
            for key, value in seconds.items():
                parts[name][key].append(value / new_tokens * 1e3)
    result = {}
    for name, lists in parts.items():
        result[name] = {key: statistics.median(values) for key, values in lists.items()}
        result[name]["rest"] = statistics.median(t - lin - head for t, lin, head in
                                                 zip(lists["token"], lists["linear"], lists["lm_head"], strict=True))
    return result


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
    results = {"description": description, "rows": [],
               "breakdown": decode_breakdown(models, short_ids, args.new_tokens, args.breakdown_rounds)
               if args.breakdown_rounds else {}}
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
        f"Prefill: one forward pass over a {args.prompt_tokens}-token prompt (time to first token; the "
        "last position's logits only, `logits_to_keep=1` as in `generate`: runs before 2026-12-07 computed "
        "every position's), "
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
    if results["breakdown"]:
        lines += [
            "",
            f"Where a decoded token's time goes: {args.breakdown_rounds} more decode rounds of {args.new_tokens} "
            "tokens, the models in turns, each linear layer's forward wrapped in a timer (about 1 us a call, counted in its "
            "layer); ms per token, medians. `linear layers` are the decoder's (the ones FP8Linear replaces), "
            "`lm_head` the output layer (bf16 in every model), `rest` everything else (attention, norms, "
            "embeddings, `generate`'s own work).",
            "",
            "| model | ms per token | linear layers | lm_head | rest |",
            "|---|---|---|---|---|",
        ]
        for name, parts in results["breakdown"].items():
            lines.append(f"| {name} | {parts['token']:.2f} | {parts['linear']:.2f} | {parts['lm_head']:.2f} | "
                         f"{parts['rest']:.2f} |")
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
    parser.add_argument("--breakdown-rounds", type=int, default=5,
                        help="decode rounds with each linear layer timed (0: none)")
    args = parser.parse_args(argv)
    setup_cpu_benchmark(args, "e2e")
    if args.smoke:
        args.prompt_tokens, args.new_tokens, args.rounds, args.decode_rounds = 64, 4, 2, 1
        args.breakdown_rounds = min(args.breakdown_rounds, 1)
    start = time.perf_counter()
    results = run(args)
    path = write_results(args, results, time.perf_counter() - start)
    print(path.read_text())


if __name__ == "__main__":
    main()
