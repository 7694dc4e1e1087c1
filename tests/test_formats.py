"""formats: mapping quantization_config to FP8Config, and what FP8Linear can't run is refused."""
import copy

import pytest
import torch
from torch import nn

from fp8linear import FP8Config, FP8Linear
from fp8linear.formats import compressed_tensors_config, parse_quantization_config

STATIC = FP8Config(activations="static")
PER_CHANNEL = FP8Config(weight_granularity="channel", activation_granularity="token")


def written(layers=None, ignored=("lm_head",)):
    return compressed_tensors_config(layers or {"a": PER_CHANNEL}, list(ignored), "0.20.1")


def test_one_scheme_targets_linear_and_mixed_schemes_list_their_layers():
    single = written({"a": STATIC, "b": STATIC})
    assert list(single["config_groups"]) == ["group_0"]
    assert single["config_groups"]["group_0"]["targets"] == ["Linear"] and single["format"] == "float-quantized"
    mixed = written({"a": STATIC, "b": FP8Config(activations="none"), "c": STATIC})
    groups = mixed["config_groups"]
    assert groups["group_0"]["targets"] == ["a", "c"] and groups["group_1"]["targets"] == ["b"]
    assert groups["group_1"]["input_activations"] is None and groups["group_1"]["format"] == "naive-quantized"
    assert mixed["format"] == "mixed-precision"
    scheme = parse_quantization_config({"quantization_config": mixed})
    linear = nn.Linear(2, 2)
    assert [scheme.config_for(name, linear, None) for name in "abcd"] == \
        [STATIC, FP8Config(activations="none"), STATIC, None]


def test_matching_rules_follow_compressed_tensors():
    config = written()
    config["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\..*", "Embedding"]
    config["ignore"] = ["re:.*down_proj", "model.layers.0.mlp.up_proj"]
    scheme = parse_quantization_config(config)
    linear = nn.Linear(2, 2)
    assert scheme.config_for("model.layers.1.mlp.up_proj", linear, None) == PER_CHANNEL
    assert scheme.config_for("model.layers.0.mlp.up_proj", linear, None) is None  # ignored by name
    assert scheme.config_for("model.layers.1.mlp.down_proj", linear, None) is None  # ignored by regex
    assert scheme.config_for("model.layers.1.self_attn.q_proj", linear, None) is None  # not targeted
    by_class = written()  # "Linear" matches nn.Linear subclasses and FP8Linear too
    scheme = parse_quantization_config(by_class)
    assert scheme.config_for("x", FP8Linear(2, 2), None) == PER_CHANNEL
    assert scheme.config_for("x", nn.modules.linear.NonDynamicallyQuantizableLinear(2, 2), None) == PER_CHANNEL
    assert scheme.config_for("x", nn.Embedding(2, 2), None) is None


def test_vllm_fp8_decides_by_the_stored_dtype():
    scheme = parse_quantization_config({"quant_method": "fp8", "activation_scheme": "static",
                                        "ignored_layers": ["model.layers.0.mlp.up_proj"]})
    linear = nn.Linear(2, 2)
    assert scheme.config_for("lm_head", linear, torch.bfloat16) is None
    assert scheme.config_for("q", linear, torch.float8_e4m3fn) == STATIC
    assert scheme.config_for("model.layers.0.mlp.up_proj", linear, torch.float8_e4m3fn) is None
    dynamic = parse_quantization_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert dynamic.config_for("q", linear, torch.float8_e4m3fn) == FP8Config()


def change(path, value):
    config = written()
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return config


GROUP = ("config_groups", "group_0")


@pytest.mark.parametrize("config, message", [
    (change(GROUP + ("weights", "strategy"), "block"), "block_structure None"),
    (change(GROUP + ("weights",), {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 64]}),
     "block_structure \\[64, 64\\]"),
    (change(GROUP + ("weights", "strategy"), "group"), "weight strategy 'group'"),
    (change(GROUP + ("weights", "symmetric"), False), "asymmetric"),
    (change(GROUP + ("weights", "type"), "int"), "weights"),
    (change(GROUP + ("input_activations", "strategy"), "group"), "activation groups of None"),
    (change(GROUP + ("input_activations",), {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 64,
                                             "dynamic": True}), "activation groups of 64"),
    (change(GROUP + ("input_activations", "dynamic"), False), "strategy 'token' and dynamic=False"),
    (change(GROUP + ("input_activations", "num_bits"), 4), "input activations"),
    (change(GROUP + ("output_activations",), {"num_bits": 8, "type": "float"}), "quantizes output activations"),
    (change(GROUP + ("format",), "pack-quantized"), "format 'pack-quantized'"),
    (change(("config_groups",), {"FP8": ["Linear"]}), "preset name"),
    (change(("config_groups",), {}), "no config_groups"),
    (change(("kv_cache_scheme",), {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (change(("quantization_status",), "frozen"), "quantization_status 'frozen'"),
    (change(("quant_method",), "gptq"), "must be 'compressed-tensors' or 'fp8', got 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme"),
    ({"model_type": "llama"}, "no quantization_config"),
])
def test_what_fp8linear_cannot_run_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(copy.deepcopy(config), source="dir/config.json")


def test_e5m2_is_refused_when_writing():
    with pytest.raises(ValueError, match="stores float8_e4m3fn only"):
        written({"a": FP8Config(fp8_dtype=torch.float8_e5m2)})


# quantization_config exactly as llm-compressor 0.14.0.1 (compressed-tensors 0.19.0) wrote it for
# QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]). It can't be
# installed next to this project's transformers (it pins transformers<=5.17), so its output is kept here.
LLM_COMPRESSOR_FP8_DYNAMIC = {
    "config_groups": {"group_0": {
        "format": "float-quantized",
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                              "num_bits": 8, "observer": None, "observer_kwargs": {}, "scale_dtype": None,
                              "strategy": "token", "symmetric": True, "type": "float", "zp_dtype": None},
        "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None,
                    "strategy": "channel", "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "float-quantized", "global_compression_ratio": None, "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
    "transform_config": {}, "version": "0.19.0",
}


def test_llm_compressor_fp8_dynamic_config():
    scheme = parse_quantization_config({"quantization_config": LLM_COMPRESSOR_FP8_DYNAMIC})
    assert scheme.config_for("model.layers.0.mlp.up_proj", nn.Linear(2, 2), torch.float8_e4m3fn) == PER_CHANNEL
    assert scheme.config_for("lm_head", nn.Linear(2, 2), torch.bfloat16) is None
