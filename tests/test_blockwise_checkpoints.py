"""Block-wise FP8 checkpoints as DeepSeek-V3 / Qwen3 ("fp8" with weight_block_size and
weight_scale_inv) and Mistral (the same names, per tensor) publish them, loaded into
FP8Linear with the fp8 bytes as stored; partial edge blocks; the block scheme end to end."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import fp8linear
from fp8linear.checkpoint_files import model_skeleton
from test_checkpoint import RecordFloatCopies
from tiny_models import fp8_layers, logits, relative_error, tiny_llama, token_ids

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_SUFFIXES


def deepseek_checkpoint(model, directory, *, scale_dtype=torch.float32, ignore_key="modules_to_not_convert",
                        power_of_two=False):
    """What DeepSeek-V3 / Qwen3-FP8 ship: fp8 weights, weight_scale_inv [ceil(N/128), ceil(K/128)]
    (a dequantization multiplier) in float32, bfloat16 or float16; lm_head and norms as they are."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if not is_linear(name):
            tensors[name] = tensor.contiguous()
            continue
        scale = fp8linear.reference.block_scales(tensor, torch.float8_e4m3fn, 128, 128)
        if power_of_two:  # scale_fmt "ue8m0": scales rounded up to powers of two
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = scale.to(scale_dtype)
        q, _ = fp8linear.reference.quantize_fp8(tensor, scale.float(), granularity="block")
        tensors[name] = q
        tensors[name[:-len("weight")] + "weight_scale_inv"] = scale
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], ignore_key: ["lm_head"]}
    if power_of_two:
        config["quantization_config"]["scale_fmt"] = "ue8m0"
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def dequantized_model(tensors, **overrides):
    """The same model in float32 with each weight dequantized block by block: the reference."""
    model = tiny_llama(**overrides)
    state = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale_inv"):
            continue
        if is_linear(name):
            scale = tensors[name[:-len("weight")] + "weight_scale_inv"].float()
            n, k = tensor.shape
            state[name] = tensor.float() * fp8linear.reference.expand_block_scales(scale, n, k, 128, 128)
        else:
            state[name] = tensor
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ignore_key", ["modules_to_not_convert", "ignored_layers"])
def test_deepseek_qwen3_checkpoint_loads_with_its_bytes(scale_dtype, ignore_key, tmp_path):
    # hidden 128, intermediate 344 (2.7 blocks), k/v 64 rows (half a block): partial edge blocks
    tensors = deepseek_checkpoint(tiny_llama(), tmp_path, scale_dtype=scale_dtype, ignore_key=ignore_key)
    loaded = fp8linear.load_quantized(tmp_path)
    layers = fp8_layers(loaded)
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.config.weight_granularity == "block" and layer.config.activation_granularity == "group"
        assert torch.equal(layer.weight.view(torch.uint8), tensors[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(layer.weight_scale, tensors[f"{name}.weight_scale_inv"].float())
    assert type(loaded.lm_head) is torch.nn.Linear  # in the ignore list
    ids = token_ids()
    reference = dequantized_model(tensors)
    # the activations' own rounding (per token and group of 128) is the only difference
    error = relative_error(logits(loaded, ids), logits(reference, ids))
    assert error < 0.05, error


def test_power_of_two_scales_are_kept_as_stored(tmp_path):
    tensors = deepseek_checkpoint(tiny_llama(), tmp_path, power_of_two=True)
    loaded = fp8linear.load_quantized(tmp_path)
    layer = loaded.model.layers[0].mlp.down_proj
    scale = layer.weight_scale
    assert torch.equal(scale, tensors["model.layers.0.mlp.down_proj.weight_scale_inv"])
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    # "ue8m0": the activations' group scales are rounded up to powers of two too, as
    # DeepSeek's inference code does for these checkpoints
    assert all(layer.config.scale_fmt == "ue8m0" for layer in fp8_layers(loaded).values())
    x = torch.randn(3, layer.in_features)
    a, scale_a = fp8linear.quantize_fp8(x, granularity="group", scale_fmt="ue8m0")
    assert torch.equal(torch.exp2(torch.log2(scale_a).round()), scale_a)
    expected = fp8linear.scaled_mm(a, layer.weight.t(), scale_a, scale.t(), out_dtype=torch.float32)
    assert torch.equal(layer(x), expected)
    ids = token_ids()
    assert relative_error(logits(loaded, ids), logits(dequantized_model(tensors), ids)) < 0.05


def test_an_unknown_scale_fmt_is_refused(tmp_path):
    deepseek_checkpoint(tiny_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "e4m3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scale_fmt 'e4m3'"):
        fp8linear.load_quantized(tmp_path)


def test_loading_a_block_checkpoint_never_makes_a_full_precision_weight(tmp_path):
    model = tiny_llama()
    deepseek_checkpoint(model, tmp_path)
    shapes = {tuple(t.shape) for n, t in model.state_dict().items() if is_linear(n)}
    skeleton = model_skeleton(json.loads((tmp_path / "config.json").read_text()))
    with RecordFloatCopies(shapes) as recorder:
        loaded = fp8linear.load_quantized(tmp_path, skeleton)
    assert recorder.seen == []
    assert len(fp8_layers(loaded)) == 14


def test_a_deepseek_layer_with_a_partial_grid_of_5_x_56(tmp_path):
    # DeepSeek-V3's kv_a_proj_with_mqa: [576, 7168] weights, a [5, 56] scale grid
    weight = torch.randn(576, 7168) * 0.02
    scale = fp8linear.reference.block_scales(weight, torch.float8_e4m3fn, 128, 128)
    assert scale.shape == (5, 56)
    q, _ = fp8linear.quantize_fp8(weight, scale, granularity="block")
    layer = fp8linear.FP8Linear.from_fp8(q, scale, weight_granularity="block", activation_granularity="group")
    x = torch.randn(3, 7168)
    a, scale_a = fp8linear.reference.quantize_fp8(x, granularity="group")
    exact = fp8linear.reference.scaled_mm_float64(a, q.t(), scale_a, scale.t())
    assert relative_error(layer(x), exact) < 1e-5


def test_mistral_per_tensor_variant(tmp_path):
    # weight_block_size null, static activations: 0-d weight_scale_inv and activation_scale
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8", activations="static")
    fp8linear.calibrate(model, [token_ids(seed=5)])
    tensors = {}
    for name, tensor in model.state_dict().items():
        layer, _, attribute = name.rpartition(".")
        renamed = {"weight_scale": "weight_scale_inv", "input_scale": "activation_scale"}.get(attribute, attribute)
        tensors[f"{layer}.{renamed}"] = tensor.reshape(()) if attribute.endswith("_scale") else tensor.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
                                     "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = fp8linear.load_quantized(tmp_path)
    assert all(layer.config.activations == "static" and layer.config.weight_granularity == "tensor"
               for layer in fp8_layers(loaded).values())
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_block_scheme_round_trip_and_checkpoint_conversion(tmp_path):
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8", **fp8linear.SCHEMES["block"])
    report = fp8linear.memory_report(model)
    assert report.converted_layers == 14 and report.ratio < 0.51
    fp8linear.save_quantized(model, tmp_path / "saved")
    written = json.loads((tmp_path / "saved" / "config.json").read_text())["quantization_config"]
    group = written["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [128, 128]
    assert group["input_activations"]["strategy"] == "group" and group["input_activations"]["group_size"] == 128
    loaded = fp8linear.load_quantized(tmp_path / "saved")
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(model, ids))

    # the command line's --scheme block writes the same layers from a full-precision checkpoint
    original = tiny_llama()
    original.save_pretrained(tmp_path / "plain")
    fp8linear.quantize_checkpoint(tmp_path / "plain", tmp_path / "cli", scheme="block")
    converted = fp8linear.load_quantized(tmp_path / "cli")
    for name, layer in fp8_layers(converted).items():
        assert torch.equal(layer.weight.view(torch.uint8), fp8_layers(model)[name].weight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, fp8_layers(model)[name].weight_scale)
    with safe_open(str(tmp_path / "cli" / "model.safetensors"), "pt") as file:
        assert file.get_tensor("model.layers.0.mlp.up_proj.weight_scale").shape == (3, 1)


def test_ue8m0_block_model_round_trip_and_other_readers(tmp_path):
    # scale_fmt "ue8m0" is written beside the config groups (compressed-tensors has no field
    # for it and ignores it there) and read back; transformers + compressed-tensors load the
    # same checkpoint (with float activation scales of their own)
    quantization_module = pytest.importorskip("compressed_tensors.quantization")
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(intermediate_size=384)  # whole blocks: compressed-tensors' forward needs them
    fp8linear.quantize_model(model, "fp8", **fp8linear.SCHEMES["block"], scale_fmt="ue8m0")
    for layer in fp8_layers(model).values():
        assert torch.equal(fp8linear.reference.power_of_two_ceil(layer.weight_scale), layer.weight_scale)
    fp8linear.save_quantized(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert written["scale_fmt"] == "ue8m0"
    parsed = quantization_module.QuantizationConfig.model_validate(written).model_dump()
    assert parsed["config_groups"] == written["config_groups"]
    loaded = fp8linear.load_quantized(tmp_path)
    assert {name: layer.config for name, layer in fp8_layers(loaded).items()} == \
        {name: layer.config for name, layer in fp8_layers(model).items()}
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(model, ids))
    reader = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    quantization_error = relative_error(logits(model, ids), logits(tiny_llama(intermediate_size=384), ids))
    assert relative_error(logits(reader, ids), logits(model, ids)) < quantization_error

    # one flag for the model: block layers with and without it cannot be saved together
    mixed = tiny_llama()
    fp8linear.quantize_model(mixed, "fp8", **fp8linear.SCHEMES["block"], scale_fmt="ue8m0",
                             filter_fn=lambda module, name: "mlp" in name)
    fp8linear.quantize_model(mixed, "fp8", **fp8linear.SCHEMES["block"])
    with pytest.raises(ValueError, match="different scale_fmt"):
        fp8linear.save_quantized(mixed, tmp_path / "mixed")


def test_command_line_block_scheme_with_ue8m0_scales(tmp_path):
    from fp8linear.__main__ import main

    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8", **fp8linear.SCHEMES["block"], scale_fmt="ue8m0")
    original = tiny_llama()
    original.save_pretrained(tmp_path / "plain")
    assert main(["quantize", str(tmp_path / "plain"), str(tmp_path / "cli"), "--no-progress", "--scheme", "block",
                 "--scale-fmt", "ue8m0"]) == 0
    converted = fp8linear.load_quantized(tmp_path / "cli")
    for name, layer in fp8_layers(converted).items():
        assert layer.config.scale_fmt == "ue8m0"
        assert torch.equal(layer.weight.view(torch.uint8), fp8_layers(model)[name].weight.view(torch.uint8))
        assert torch.equal(layer.weight_scale, fp8_layers(model)[name].weight_scale)
    with pytest.raises(ValueError, match="scale_fmt 'ue8m0' is for the block scheme"):
        fp8linear.quantize_checkpoint(tmp_path / "plain", tmp_path / "other", scheme="per-channel", scale_fmt="ue8m0")
