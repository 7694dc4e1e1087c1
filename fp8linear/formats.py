"""The ``quantization_config`` of FP8 checkpoints: written for compressed-tensors, read for
compressed-tensors and for vLLM's earlier ``quant_method: "fp8"``.

compressed-tensors "float-quantized" (what vLLM, transformers and llm-compressor read
and write for FP8), as its pydantic models serialize (``QuantizationConfig``,
``QuantizationScheme``, ``QuantizationArgs`` in compressed_tensors 0.20)::

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
          "weights": {"num_bits": 8, "type": "float", "symmetric": true, "group_size": null,
                      "strategy": "channel", "dynamic": false},
          "input_activations": {... "strategy": "token", "dynamic": true},
          "output_activations": null}},
      "ignore": ["lm_head"], "kv_cache_scheme": null, ...}

with tensors ``<layer>.weight`` (float8_e4m3fn), ``<layer>.weight_scale`` (``[1]`` or
``[N, 1]``) and, for static activations, ``<layer>.input_scale`` (``[1]``). A weight-only
group has ``input_activations: null`` and format "naive-quantized" (what
compressed-tensors infers for it). Scales are the dequantization multipliers, as ours.

vLLM "fp8" (AutoFP8 checkpoints): ``{"quant_method": "fp8", "activation_scheme":
"static" | "dynamic", "ignored_layers": [...]}`` with per-tensor ``weight_scale`` and
``input_scale``. The block-wise checkpoints of DeepSeek-V3 / Qwen3 use the same method with
``"weight_block_size": [128, 128]`` and ``<layer>.weight_scale_inv`` ``[ceil(N/128),
ceil(K/128)]`` (float32, bfloat16 or float16; a dequantization multiplier despite its name),
activations dynamic per token and group of 128; compressed-tensors writes the same as
weights ``"strategy": "block", "block_structure": [128, 128]`` with activations
``"strategy": "group", "group_size": 128`` (its FP8_BLOCK preset).

This module depends on neither package: the test suite checks what it writes against
compressed-tensors' own parser and what it reads against checkpoints written by it.
"""
from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from .linear import FP8Config, FP8Linear
from .ops import FP8_DTYPES, SCALE_FORMATS

__all__ = ["CheckpointScheme", "compressed_tensors_config", "parse_quantization_config"]

COMPRESSED_TENSORS = "compressed-tensors"
VLLM_FP8 = "fp8"
FLOAT_QUANTIZED = "float-quantized"  # fp8 weights with fp8 activations
NAIVE_QUANTIZED = "naive-quantized"  # fp8 weights, activations left alone
MIXED_PRECISION = "mixed-precision"


BLOCK = 128  # the only block size of FP8Linear's block-wise layers (weights 128 x 128, activation groups 128)


def _args(strategy: str, dynamic: bool) -> dict:
    """One compressed-tensors ``QuantizationArgs`` for 8-bit floats, serialized as it does."""
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": BLOCK if strategy == "group" else None,
            "strategy": strategy, "dynamic": dynamic}
    if strategy == "block":
        args["block_structure"] = [BLOCK, BLOCK]
    return args


def _scheme(config: FP8Config, targets: list[str]) -> dict:
    if config.fp8_dtype != torch.float8_e4m3fn:
        raise ValueError(f"the compressed-tensors format stores float8_e4m3fn only (its 8-bit float type); "
                         f"got layers with {config.fp8_dtype}")
    if config.activations == "none":
        activations = None
    elif config.activations == "static":
        activations = _args("tensor", dynamic=False)
    else:
        activations = _args(config.activation_granularity, dynamic=True)  # tensor, token or group
    return {"targets": targets, "weights": _args(config.weight_granularity, dynamic=False),
            "input_activations": activations, "output_activations": None,
            "format": NAIVE_QUANTIZED if activations is None else FLOAT_QUANTIZED}


def compressed_tensors_config(layers: dict[str, FP8Config], ignored: list[str], version: str) -> dict:
    """The ``quantization_config`` for FP8Linear layers (name -> config) and the linear
    layers left in full precision (``ignored``), one config group per distinct scheme.

    With one scheme the group targets the class ``"Linear"`` and the ``ignore`` list names
    the rest, as llm-compressor writes it; with several, each group lists its layers.

    Block layers with ``scale_fmt="ue8m0"`` add ``"scale_fmt": "ue8m0"`` beside the groups,
    where DeepSeek's "fp8" configs have it: compressed-tensors has no field for it and its
    parser ignores keys it does not know at that level, and fp8linear reads it back. It is
    one flag for the whole model, so the block layers must all have it or none.
    """
    scale_formats = {config.scale_fmt for config in layers.values() if config.weight_granularity == "block"}
    if len(scale_formats) > 1:
        raise ValueError(f"block layers with different scale_fmt ({sorted(map(str, scale_formats))}): the "
                         "compressed-tensors config holds one scale_fmt for all of them")
    scale_fmt = scale_formats.pop() if scale_formats else None
    by_config: dict[FP8Config, list[str]] = {}
    for name, config in layers.items():
        by_config.setdefault(config, []).append(name)
    single = len(by_config) == 1
    groups = {f"group_{index}": _scheme(config, ["Linear"] if single else names)
              for index, (config, names) in enumerate(by_config.items())}
    formats = {group["format"] for group in groups.values()}
    return {
        "quant_method": COMPRESSED_TENSORS,
        "format": formats.pop() if len(formats) == 1 else MIXED_PRECISION,
        "quantization_status": "compressed",
        "config_groups": groups,
        **({"scale_fmt": scale_fmt} if scale_fmt else {}),
        "ignore": list(ignored),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": version,
    }


def _matches(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` prefix = regex match from the start, else the exact
    module name or a class name in the module's MRO; FP8Linear stands in for ``Linear``."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    if target == name:
        return True
    if isinstance(module, FP8Linear) and target == "Linear":
        return True
    return any(cls.__name__ == target for cls in type(module).__mro__)


def _fp8_config_from_args(group: str, weights: dict | None, activations: dict | None) -> FP8Config:
    """Map one compressed-tensors scheme to an FP8Config, refusing what FP8Linear can't run."""
    def refuse(what: str):
        raise ValueError(f"config group {group!r}: {what} has no FP8Linear equivalent")

    if not weights or weights.get("type") != "float" or weights.get("num_bits") != 8:
        refuse(f"weights {weights}")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        refuse("asymmetric or dynamic weight quantization")
    weight_strategy = weights.get("strategy") or ("channel" if weights.get("group_size") == -1 else "tensor")
    if weight_strategy not in ("tensor", "channel", "block"):
        refuse(f"weight strategy {weight_strategy!r} (FP8Linear has per-tensor, per-channel and 128 x 128 block "
               "weight scales)")
    if weight_strategy == "block" and list(weights.get("block_structure") or []) != [BLOCK, BLOCK]:
        refuse(f"block_structure {weights.get('block_structure')} (FP8Linear's block-wise kernels use 128 x 128)")
    if activations is None:
        return FP8Config(weight_granularity=weight_strategy, activations="none")
    if activations.get("type") != "float" or activations.get("num_bits") != 8 or not activations.get("symmetric", True):
        refuse(f"input activations {activations}")
    strategy = activations.get("strategy") or "tensor"
    if strategy == "group" and activations.get("group_size") != BLOCK:
        refuse(f"activation groups of {activations.get('group_size')} (FP8Linear's groups are {BLOCK} wide)")
    if activations.get("dynamic") is True and strategy in ("tensor", "token", "group"):
        return FP8Config(weight_granularity=weight_strategy, activations="dynamic", activation_granularity=strategy)
    if activations.get("dynamic") is False and strategy == "tensor":
        return FP8Config(weight_granularity=weight_strategy, activations="static")
    refuse(f"input activations with strategy {strategy!r} and dynamic={activations.get('dynamic')!r}")


@dataclasses.dataclass
class CheckpointScheme:
    """Which linear layers a checkpoint stores in FP8, and how.

    method: ``"compressed-tensors"`` or ``"fp8"`` (vLLM's earlier format).
    groups: ``(targets, FP8Config)`` per config group, in order (the first match wins).
    ignore: names/classes/regexes kept in full precision.
    decided_by_dtype: vLLM's format names no targets: a layer is FP8 when its stored
        weight is (its lm_head, for one, never is), unless it is in ``ignore``.
    """

    method: str
    groups: list[tuple[list[str], FP8Config]]
    ignore: list[str]
    decided_by_dtype: bool = False
    raw: dict = dataclasses.field(default_factory=dict)
    #: the names of the stored scales: compressed-tensors and AutoFP8 write weight_scale and
    #: input_scale; DeepSeek-V3 / Qwen3 / Mistral ("fp8" with weight_scale_inv) write
    #: weight_scale_inv and activation_scale (a dequantization multiplier despite the name)
    weight_scale_names: tuple[str, ...] = ("weight_scale",)
    input_scale_names: tuple[str, ...] = ("input_scale",)

    def config_for(self, name: str, module: nn.Module, stored_dtype: torch.dtype | None) -> FP8Config | None:
        """The FP8Config of layer ``name`` (an nn.Linear or FP8Linear), or None if it is
        stored in full precision. ``stored_dtype``: the dtype of its stored weight."""
        if any(_matches(name, module, target) for target in self.ignore):
            return None
        if self.decided_by_dtype:
            if stored_dtype not in FP8_DTYPES:
                return None
            return dataclasses.replace(self.groups[0][1], fp8_dtype=stored_dtype)
        for targets, config in self.groups:
            if any(_matches(name, module, target) for target in targets):
                return config
        return None

    def describe(self) -> str:
        schemes = "; ".join(config.describe() for _, config in self.groups)
        return f"{self.method} ({schemes})"


def parse_quantization_config(config: dict, source: str = "config.json") -> CheckpointScheme:
    """Read the ``quantization_config`` of a model's config.json (``config`` is the whole
    config.json, or the quantization_config itself). Raises ValueError naming what it
    can't map to FP8Linear."""
    quantization = config["quantization_config"] if "quantization_config" in config else config
    if "quant_method" not in quantization:
        raise ValueError(f"{source} has no quantization_config: not a quantized checkpoint")
    method = quantization["quant_method"]
    if method == COMPRESSED_TENSORS:
        return _parse_compressed_tensors(quantization, source)
    if method == VLLM_FP8:
        return _parse_vllm_fp8(quantization, source)
    raise ValueError(f"{source}: quantization_config.quant_method must be {COMPRESSED_TENSORS!r} or "
                     f"{VLLM_FP8!r}, got {method!r}")


def _scale_fmt(quantization: dict, source: str) -> str | None:
    """The config's "scale_fmt" (DeepSeek's key; fp8linear writes it beside compressed-tensors'
    groups too), checked: None or "ue8m0"."""
    scale_fmt = quantization.get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"{source}: scale_fmt {scale_fmt!r}: fp8linear knows 'ue8m0' (or none)")
    return scale_fmt


def _parse_compressed_tensors(quantization: dict, source: str) -> CheckpointScheme:
    if quantization.get("kv_cache_scheme"):
        raise ValueError(f"{source}: kv_cache_scheme is set; FP8Linear quantizes linear layers only")
    if quantization.get("quantization_status") not in (None, "compressed"):
        raise ValueError(f"{source}: quantization_status {quantization.get('quantization_status')!r}: "
                         "only compressed checkpoints (fp8 weights stored as fp8) can be loaded")
    model_format = quantization.get("format")
    scale_fmt = _scale_fmt(quantization, source)
    groups = []
    for group_name, group in (quantization.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            raise ValueError(f"{source}: config group {group_name!r} is a preset name ({group!r}); "
                             "write the scheme out in full")
        group_format = group.get("format") or model_format
        if group_format not in (FLOAT_QUANTIZED, NAIVE_QUANTIZED):
            raise ValueError(f"{source}: config group {group_name!r} has format {group_format!r}; fp8linear reads "
                             f"{FLOAT_QUANTIZED!r} and {NAIVE_QUANTIZED!r} (fp8 weights)")
        if group.get("output_activations"):
            raise ValueError(f"{source}: config group {group_name!r} quantizes output activations")
        config = _fp8_config_from_args(group_name, group.get("weights"), group.get("input_activations"))
        if config.weight_granularity == "block" and scale_fmt:  # (fp8linear's own key, see compressed_tensors_config)
            config = dataclasses.replace(config, scale_fmt=scale_fmt)
        groups.append((list(group.get("targets") or []), config))
    if not groups:
        raise ValueError(f"{source}: quantization_config has no config_groups")
    return CheckpointScheme(COMPRESSED_TENSORS, groups, list(quantization.get("ignore") or []), raw=quantization)


def _parse_vllm_fp8(quantization: dict, source: str) -> CheckpointScheme:
    """vLLM's "fp8" method: AutoFP8 (per-tensor weight_scale / input_scale) and the
    block-wise checkpoints of DeepSeek-V3 and Qwen3 (weight_block_size [128, 128],
    weight_scale_inv per block, dynamic activations per token and group of 128); Mistral's
    per-tensor variant (weight_block_size null, weight_scale_inv and activation_scale)."""
    scheme = quantization.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ValueError(f"{source}: activation_scheme must be 'static' or 'dynamic', got {scheme!r}")
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: fmt {fmt!r}: fp8linear reads e4m3 block-wise checkpoints")
    block = quantization.get("weight_block_size")
    if block:
        if list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"{source}: weight_block_size {block}: FP8Linear's block-wise kernels use "
                             f"[{BLOCK}, {BLOCK}]")
        # activations are quantized per token and group of 128 (dynamic), as DeepSeek's kernels do;
        # "scale_fmt": "ue8m0" (DeepSeek-V3.1 and later): with scales rounded up to powers of two,
        # as DeepSeek's inference code quantizes them for such checkpoints (the stored weight
        # scales are kept as they are, powers of two or not)
        scale_fmt = _scale_fmt(quantization, source)
        config = (FP8Config(weight_granularity="block", activation_granularity="group", scale_fmt=scale_fmt)
                  if scheme == "dynamic" else FP8Config(weight_granularity="block", activations="static", scale_fmt=scale_fmt))
    else:
        config = FP8Config(activations=scheme)  # per-tensor weights and activations, as that format defines
    ignored = [*(quantization.get("ignored_layers") or []), *(quantization.get("modules_to_not_convert") or [])]
    return CheckpointScheme(VLLM_FP8, [(["Linear"], config)], ignored, decided_by_dtype=True, raw=quantization,
                            weight_scale_names=("weight_scale", "weight_scale_inv"),
                            input_scale_names=("input_scale", "activation_scale"))
