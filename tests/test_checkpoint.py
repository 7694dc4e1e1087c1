"""save_quantized / load_quantized: round trips, the real readers (transformers +
compressed-tensors) in both directions, vLLM's "fp8" format, fused layers, and refusals."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8linear
from fp8linear import FP8Linear
from fp8linear.checkpoint_files import model_skeleton, read_headers
from tiny_models import fp8_layers, logits, relative_error, same_state, tiny_llama, tiny_tokenizer, token_ids

SCHEMES = list(fp8linear.SCHEMES)


def converted_llama(scheme: str, **overrides):
    model = tiny_llama(**overrides)
    fp8linear.quantize_model(model, "fp8", **fp8linear.SCHEMES[scheme])
    if scheme == "static":
        fp8linear.calibrate(model, [token_ids(seed=seed) for seed in range(3)])
    return model


@pytest.mark.parametrize("scheme", SCHEMES)
def test_round_trip_is_exact(scheme, tmp_path):
    model = converted_llama(scheme)
    ids = token_ids()
    expected = logits(model, ids)
    fp8linear.save_quantized(model, tmp_path, tokenizer=tiny_tokenizer())
    quantization = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors"
    assert quantization["ignore"] == ["lm_head"]
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "generation_config.json").is_file()

    loaded = fp8linear.load_quantized(tmp_path)
    assert not loaded.training
    assert {name: layer.config for name, layer in fp8_layers(loaded).items()} == \
        {name: layer.config for name, layer in fp8_layers(model).items()}
    assert same_state(model, loaded)
    assert torch.equal(logits(loaded, ids), expected)
    assert all(t.device.type != "meta" for t in list(loaded.parameters()) + list(loaded.buffers()))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_written_config_is_what_compressed_tensors_parses(scheme, tmp_path):
    quantization_module = pytest.importorskip("compressed_tensors.quantization")
    fp8linear.save_quantized(converted_llama(scheme), tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    parsed = quantization_module.QuantizationConfig.model_validate(written).model_dump()
    for key in ("config_groups", "format", "ignore", "quantization_status", "kv_cache_scheme"):
        assert parsed[key] == written[key], key
    group = written["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["weights"]["type"] == "float"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as file:
        assert file.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
        scale = file.get_tensor("model.layers.0.mlp.up_proj.weight_scale")
        assert scale.dtype == torch.float32
        expected_shapes = {"channel": (344, 1), "block": (3, 1), "tensor": (1,)}  # up_proj: [344, 128]
        assert scale.shape == expected_shapes[group["weights"]["strategy"]]
        has_input_scale = "model.layers.0.mlp.up_proj.input_scale" in file.keys()
    assert has_input_scale == (scheme == "static")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_reads_our_checkpoint(scheme, tmp_path):
    """transformers loads the directory through compressed-tensors (its own fp8 emulation).

    Layer by layer the two agree to float32 rounding. Through the whole model, dynamic
    per-tensor scales amplify those last-bit differences (an amax one ulp apart moves
    elements across fp8 rounding boundaries), so the logits are held to a small fraction
    of the quantization error itself."""
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    # compressed-tensors' block-wise forward needs whole blocks of 128 (it reshapes the
    # activations into groups): an intermediate size of 384 instead of 344 for it
    aligned = {"intermediate_size": 384} if scheme == "block" else {}
    model = converted_llama(scheme, **aligned)
    ids = token_ids()
    fp8linear.save_quantized(model, tmp_path, tokenizer=tiny_tokenizer())
    reader = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reader.model.layers[0].mlp.up_proj.weight.dtype == torch.float8_e4m3fn  # stored compressed
    read_logits = logits(reader, ids)  # the first forward decompresses the reader's layers
    quantization_error = relative_error(logits(model, ids), logits(tiny_llama(**aligned), ids))
    assert 0.01 < quantization_error < 0.2
    assert relative_error(read_logits, logits(model, ids)) < quantization_error / 20
    x = torch.randn(3, 7, 128)
    with torch.no_grad():
        ours, theirs = model.model.layers[1].mlp.up_proj(x), reader.model.layers[1].mlp.up_proj(x)
    assert relative_error(theirs, ours) < 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("import this")["input_ids"] == tiny_tokenizer()("import this")["input_ids"]


def write_with_compressed_tensors(preset: str, directory) -> nn.Module:
    """A checkpoint written by compressed-tensors' own API (what llm-compressor does after
    its observers: set the scales, compress, save_pretrained, update_config)."""
    lifecycle = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(seed=3, **({"intermediate_size": 384} if preset == "FP8_BLOCK" else {}))
    config = lifecycle.QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                          ignore=["lm_head"])
    lifecycle.apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        weight = module.weight.detach()
        per_channel = scheme.weights.strategy == "channel"
        if scheme.weights.strategy == "block":  # min and max per 128 x 128 block (partial at the edges)
            n, k = weight.shape
            grid = [[weight[r:r + 128, c:c + 128] for c in range(0, k, 128)] for r in range(0, n, 128)]
            low = torch.tensor([[block.min() for block in row] for row in grid])
            high = torch.tensor([[block.max() for block in row] for row in grid])
        else:
            low = weight.amin(dim=1, keepdim=True) if per_channel else weight.amin()
            high = weight.amax(dim=1, keepdim=True) if per_channel else weight.amax()
        scale, _ = calculate_qparams(low, high, scheme.weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale"):  # static: what a calibration would have found
            module.input_scale.data.fill_(0.02)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return model


@pytest.mark.parametrize("preset, expected", [
    ("FP8_DYNAMIC", fp8linear.FP8Config(weight_granularity="channel", activation_granularity="token")),
    ("FP8", fp8linear.FP8Config(activations="static")),
    ("FP8_BLOCK", fp8linear.FP8Config(weight_granularity="block", activation_granularity="group")),
])
def test_compressed_tensors_checkpoint_loads_into_fp8linear(preset, expected, tmp_path):
    transformers = pytest.importorskip("transformers")
    write_with_compressed_tensors(preset, tmp_path)
    ids = token_ids()
    reader = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    reference = logits(reader, ids)

    loaded = fp8linear.load_quantized(tmp_path)
    layers = fp8_layers(loaded)
    assert len(layers) == 14 and all(layer.config == expected for layer in layers.values())
    # as in test_transformers_reads_our_checkpoint: float32-exact per layer, and the whole
    # model within a small fraction of the quantization error
    original = tiny_llama(seed=3, **({"intermediate_size": 384} if preset == "FP8_BLOCK" else {}))
    quantization_error = relative_error(reference, logits(original, ids))
    assert relative_error(logits(loaded, ids), reference) < quantization_error / 20
    x = torch.randn(3, 7, 128)
    with torch.no_grad():
        ours, theirs = loaded.model.layers[1].mlp.up_proj(x), reader.model.layers[1].mlp.up_proj(x)
    assert relative_error(ours, theirs) < 1e-5
    # into an existing full-precision model: its linear layers become FP8Linear
    into = fp8linear.load_quantized(tmp_path, tiny_llama(seed=9, **({"intermediate_size": 384} if preset == "FP8_BLOCK"
                                                                    else {})))
    assert torch.equal(logits(into, ids), logits(loaded, ids))


def vllm_fp8_checkpoint(model: nn.Module, directory, activation_scheme: str) -> None:
    """The AutoFP8 layout vLLM's quant_method "fp8" reads: per-tensor scales as 0-d tensors."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        tensors[name] = tensor.reshape(()) if name.endswith("_scale") else tensor.contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict() if hasattr(model, "config") else {}
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activation_scheme,
                                     "ignored_layers": ["lm_head"]}
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("scheme", ["per-tensor", "static"])
def test_vllm_fp8_format(scheme, tmp_path):
    model = converted_llama(scheme)
    vllm_fp8_checkpoint(model, tmp_path, "static" if scheme == "static" else "dynamic")
    loaded = fp8linear.load_quantized(tmp_path)
    assert same_state(model, loaded)
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(model, ids))


class FusedAttention(nn.Module):
    """A model that fuses q/k/v (as vLLM and Phi-3 do) while the checkpoint stores them apart."""

    def __init__(self, width=32, kv_width=16, bias=True):
        super().__init__()
        self.qkv_proj = nn.Linear(width, width + 2 * kv_width, bias=bias)

    def forward(self, x):
        return self.qkv_proj(x)


def test_fused_parts_are_requantized_to_their_largest_scale(tmp_path):
    torch.manual_seed(0)
    parts = {"q_proj": nn.Linear(32, 32), "k_proj": nn.Linear(32, 16), "v_proj": nn.Linear(32, 16)}
    with torch.no_grad():
        parts["k_proj"].weight.mul_(4)  # the largest scale
        parts["v_proj"].weight.mul_(0.25)
    quantized = {name: FP8Linear.from_linear(linear, activations="static") for name, linear in parts.items()}
    for scale, layer in zip((0.01, 0.03, 0.02), quantized.values()):
        layer.set_input_scale(scale)
    tensors = {f"{name}.{key}": value.reshape(()) if key.endswith("scale") else value
               for name, layer in quantized.items() for key, value in layer.state_dict().items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "static"}}))

    model = fp8linear.load_quantized(tmp_path, FusedAttention())
    fused = model.qkv_proj
    k = quantized["k_proj"]
    assert isinstance(fused, FP8Linear) and torch.equal(fused.weight_scale, k.weight_scale)
    assert torch.equal(fused.input_scale, torch.tensor(0.03))
    rows = fused.weight.view(torch.uint8)
    assert torch.equal(rows[32:48], k.weight.view(torch.uint8))  # the part with the largest scale is kept as is
    for name, rows_of in (("q_proj", slice(0, 32)), ("v_proj", slice(48, 64))):
        part = quantized[name]
        again, _ = fp8linear.quantize_fp8(fp8linear.dequantize_fp8(part.weight, part.weight_scale), k.weight_scale)
        assert torch.equal(rows[rows_of], again.view(torch.uint8))
    assert torch.equal(fused.bias, torch.cat([layer.bias for layer in quantized.values()]))


def corrupt(directory, name, value=None):
    """Rewrite model.safetensors with tensor ``name`` replaced (or removed when value is None)."""
    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


UP = "model.layers.1.mlp.up_proj"


@pytest.mark.parametrize("change, message", [
    (lambda t: (f"{UP}.weight", t[f"{UP}.weight"][:-1].clone()), f"{UP}.weight: expected shape"),
    (lambda t: (f"{UP}.weight", t[f"{UP}.weight"].float()), f"{UP}.weight: expected dtype"),
    (lambda t: (f"{UP}.weight_scale", torch.ones(344, 1)), f"{UP}.weight_scale: expected shape"),
    (lambda t: ("model.norm.weight", t["model.norm.weight"].bfloat16()), "model.norm.weight: expected dtype"),
    (lambda t: ("model.extra.weight", torch.ones(3)), "model.extra.weight has no counterpart"),
    (lambda t: (f"{UP}.weight_scale", None), f"{UP}.weight_scale is missing"),
    (lambda t: ("model.embed_tokens.weight", None), "model.embed_tokens.weight is missing"),
    (lambda t: (f"{UP}.weight_scale", torch.tensor([float("inf")])), f"{UP}: weight_scale must be finite"),
])
def test_mismatching_checkpoint_is_refused_and_the_model_untouched(change, message, tmp_path):
    fp8linear.save_quantized(converted_llama("per-tensor"), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as file:
        name, value = change({key: file.get_tensor(key) for key in file.keys()})
    corrupt(tmp_path, name, value)
    target = converted_llama("per-channel", seed=5)
    modules_before = dict(target.named_modules())
    state_before = {key: value.clone() for key, value in target.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        fp8linear.load_quantized(tmp_path, target)
    assert dict(target.named_modules()) == modules_before
    assert target.state_dict().keys() == state_before.keys()
    assert all(torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                           state_before[key].view(torch.uint8) if value.element_size() == 1 else state_before[key])
               for key, value in target.state_dict().items())


def test_a_model_layer_the_checkpoint_keeps_in_full_precision_is_refused(tmp_path):
    fp8linear.save_quantized(converted_llama("per-tensor"), tmp_path)  # lm_head stays bf16/fp32
    target = tiny_llama()
    fp8linear.quantize_model(target, "fp8", skip_modules=())
    with pytest.raises(ValueError, match="layer lm_head is an FP8Linear in the model but stored in full precision"):
        fp8linear.load_quantized(tmp_path, target)


class RecordFloatCopies(TorchDispatchMode):
    """Records every op output that is a floating-point (not fp8) tensor of a watched shape."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = set(shapes), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(tensor, torch.Tensor) and tuple(tensor.shape) in self.shapes
                    and tensor.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)):
                self.seen.append((func, tuple(tensor.shape), tensor.dtype))
        return out


def test_loading_never_materializes_full_precision_weights(tmp_path):
    model = converted_llama("per-channel")
    fp8linear.save_quantized(model, tmp_path)
    shapes = {tuple(layer.weight.shape) for layer in fp8_layers(model).values()}
    # the skeleton that load_quantized(tmp_path) would build: parameters on the meta device
    skeleton = model_skeleton(json.loads((tmp_path / "config.json").read_text()))
    assert all(p.device.type == "meta" for p in skeleton.parameters())
    with RecordFloatCopies(shapes) as recorder:
        loaded = fp8linear.load_quantized(tmp_path, skeleton)
    assert recorder.seen == []
    assert len(fp8_layers(loaded)) == 14
    # the recorder does see a dequantized weight: it is not blind
    with RecordFloatCopies(shapes) as recorder:
        fp8linear.dequantize_fp8(model.model.layers[0].mlp.up_proj.weight, torch.tensor(1.0))
    assert recorder.seen


def test_tied_embeddings_are_stored_once_and_stay_tied(tmp_path):
    model = converted_llama("per-tensor", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fp8linear.save_quantized(model, tmp_path)
    assert "lm_head.weight" not in read_headers(tmp_path)
    loaded = fp8linear.load_quantized(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_shards_index_and_stale_files(tmp_path):
    model = converted_llama("per-channel")
    fp8linear.save_quantized(model, tmp_path, max_shard_size=200_000)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_headers(tmp_path))
    ids = token_ids()
    assert torch.equal(logits(fp8linear.load_quantized(tmp_path), ids), logits(model, ids))
    fp8linear.save_quantized(model, tmp_path)  # one file now: the old shards and index must go
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_save_refusals(tmp_path):
    with pytest.raises(ValueError, match="no FP8Linear layers"):
        fp8linear.save_quantized(tiny_llama(), tmp_path)
    uncalibrated = tiny_llama()
    fp8linear.quantize_model(uncalibrated, "fp8", activations="static")
    with pytest.raises(ValueError, match="static activations but no input_scale"):
        fp8linear.save_quantized(uncalibrated, tmp_path)
    e5m2 = tiny_llama()
    fp8linear.quantize_model(e5m2, "fp8", fp8_dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match="stores float8_e4m3fn only"):
        fp8linear.save_quantized(e5m2, tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_plain_module_round_trips(tmp_path):
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    fp8linear.quantize_model(model, "fp8", weight_granularity="channel", activation_granularity="token")
    fp8linear.save_quantized(model, tmp_path)
    target = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    fp8linear.load_quantized(tmp_path, target)
    x = torch.randn(5, 24)
    assert torch.equal(target(x), model(x))
    with pytest.raises(ValueError, match="does not describe a transformers model"):
        fp8linear.load_quantized(tmp_path)


def test_progress_bars(tmp_path, capsys):
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8", activations="static", progress=True)
    fp8linear.calibrate(model, [token_ids()], progress=True)
    fp8linear.save_quantized(model, tmp_path, progress=True)
    fp8linear.load_quantized(tmp_path, progress=True)
    fp8linear.save_quantized(model, tmp_path, progress=False)
    err = capsys.readouterr().err
    for description in ("Converting to FP8", "Calibrating", "Saving FP8 checkpoint", "Loading FP8 checkpoint"):
        assert err.count(description) >= 1, description
    assert err.count("Saving FP8 checkpoint: 100%") == 1


def test_from_fp8_keeps_the_stored_tensors_and_checks_them():
    """FP8Linear.from_fp8, the loaders' building block: no copy, same numbers, clear refusals."""
    source = FP8Linear.from_linear(nn.Linear(24, 40), weight_granularity="channel", activations="static")
    source.set_input_scale(0.05)
    layer = FP8Linear.from_fp8(source.weight, source.weight_scale, bias=source.bias,
                               input_scale=source.input_scale, config=source.config)
    assert layer.weight.data_ptr() == source.weight.data_ptr()
    x = torch.randn(3, 24)
    assert torch.equal(layer(x), source(x))
    waiting = FP8Linear.from_fp8(source.weight, source.weight_scale, config=source.config)
    with pytest.raises(RuntimeError, match="input_scale is not set"):
        waiting(x)
    bad = [
        (dict(weight=source.weight.float()), "weight must be a 2-D torch.float8_e4m3fn tensor"),
        (dict(weight_scale=source.weight_scale.reshape(-1)), r"per-channel weights must have shape \[40, 1\]"),
        (dict(weight_scale=-source.weight_scale), "weight_scale must be finite and > 0"),
        (dict(bias=torch.zeros(39)), r"bias must be a float tensor of shape \[40\]"),
        (dict(input_scale=torch.tensor(0.0)), "input_scale must be finite and > 0"),
    ]
    for change, message in bad:
        arguments = {**dict(weight=source.weight, weight_scale=source.weight_scale, bias=None, input_scale=None,
                            config=source.config), **change}
        with pytest.raises(ValueError, match=message):
            FP8Linear.from_fp8(arguments.pop("weight"), arguments.pop("weight_scale"), **arguments)
    with pytest.raises(ValueError, match="input_scale is only used with activations='static'"):
        FP8Linear.from_fp8(source.weight, source.weight_scale.reshape(-1, 1), input_scale=torch.tensor(1.0),
                           weight_granularity="channel")
