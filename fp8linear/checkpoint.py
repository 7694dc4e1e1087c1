"""Saving and loading FP8 checkpoints (safetensors + config.json) that other tools read.

save_quantized writes the compressed-tensors "float-quantized" format, which vLLM and
transformers (with the compressed-tensors package) load; load_quantized reads it and
vLLM's earlier ``quant_method: "fp8"`` format (see formats.py for both).

Loading never materializes a full-precision copy of a quantized weight: FP8Linear
layers are built from the stored fp8 tensors (FP8Linear.from_fp8), and a model made
from config.json is built with its parameters on the meta device. Everything is
checked against the safetensors headers before any data is read, and the model is
only modified once every tensor has been read and every layer built, so a
mismatching or broken checkpoint leaves it untouched.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import pathlib

import torch
from torch import nn

from ._progress import progress_bar
from .checkpoint_files import (CONFIG_NAME, INDEX_NAME, SINGLE_FILE_NAME, StoredTensor, model_skeleton,
                               open_safetensors, read_config, read_headers, remove_stale_shards, write_index,
                               write_safetensors)
from .formats import CheckpointScheme, compressed_tensors_config, parse_quantization_config
from .linear import FP8Config, FP8Linear
from .ops import FLOAT_DTYPES, dequantize_fp8, quantize_fp8

__all__ = ["save_quantized", "load_quantized", "FUSED_MODULES"]

logger = logging.getLogger("fp8linear")

#: The compressed-tensors release whose serialization formats.py follows; readers
#: treat the "version" field as information only.
COMPRESSED_TENSORS_FORMAT_VERSION = "0.20.1"

#: A model's fused layer -> the checkpoint layers it is made of (vLLM's
#: packed_modules_mapping for Llama-like models). Used when a model has the fused layer
#: and the checkpoint stores the parts, each with its own scale.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---------------------------------------------------------------------------------------
# saving


def _stored_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, FP8Config], list[str]]:
    """The tensors to write (each once), the FP8Linear layers and the nn.Linear layers left alone."""
    layers: dict[str, FP8Config] = {}
    ignored: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            if module.config.activations == "static" and not module.input_scale_ready:
                raise ValueError(f"layer {name} has static activations but no input_scale: run "
                                 "fp8linear.calibrate(model, batches) before saving")
            layers[name] = module.config
        elif isinstance(module, nn.Linear):
            ignored.append(name)
    if not layers:
        raise ValueError("the model has no FP8Linear layers: convert it with fp8linear.quantize_model first")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights and shared modules are written once, under their first name
            continue
        seen.add(id(tensor))
        if tensor.device.type == "meta":
            raise ValueError(f"tensor {name} is on the meta device (not loaded): nothing to save")
        layer, _, attribute = name.rpartition(".")
        if layer in layers and attribute in ("weight_scale", "input_scale") and tensor.dim() == 0:
            tensor = tensor.reshape(1)  # compressed-tensors' shape of a per-tensor scale
        tensors[name] = tensor.detach()
    return tensors, layers, ignored


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _embeddings_tied(model: nn.Module) -> bool | None:
    """Whether the model's output embedding holds its input embedding's tensor (None: the
    model has no such pair, e.g. not a transformers model)."""
    try:
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if inputs is None or outputs is None:
        return None
    return getattr(outputs, "weight", None) is getattr(inputs, "weight", object())


def write_model_config(directory: pathlib.Path, model: nn.Module, quantization_config: dict) -> None:
    """config.json (the transformers config if the model has one, with quantization_config)
    and generation_config.json, so the directory loads as a model.

    tie_word_embeddings says what the tensors are: a tied lm_head converted by hand is
    stored on its own, and a reader that tied it back would put the fp8 weight into the
    embedding (transformers fails: "Promotion for Float8 Types is not supported")."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
        data = read_config(directory)
    else:
        data = {}
    tied = _embeddings_tied(model) if data else None
    if tied is not None and data.get("tie_word_embeddings", tied) != tied:
        logger.warning("fp8linear: the model's config says tie_word_embeddings=%s, but its input and output "
                       "embeddings are %s: writing tie_word_embeddings=%s", data["tie_word_embeddings"],
                       "one tensor" if tied else "separate tensors", tied)
    if tied is not None:  # absent, transformers reads it as True
        data["tie_word_embeddings"] = tied
    data["quantization_config"] = quantization_config
    (directory / CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "save_pretrained"):
        generation_config.save_pretrained(directory)


def save_quantized(model: nn.Module, directory: os.PathLike, *, tokenizer=None,
                   max_shard_size: int = 5 * 2**30, progress: bool | None = None) -> pathlib.Path:
    """Write ``model`` (converted by quantize_model) as a compressed-tensors FP8 checkpoint.

    ``directory`` gets safetensors shards of at most ``max_shard_size`` bytes (one
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus an index), with fp8
    ``weight``, float32 ``weight_scale`` and ``input_scale`` per FP8Linear and every other
    tensor as it is; ``config.json`` (the model's transformers config, if any, plus the
    ``quantization_config``); ``generation_config.json`` and the ``tokenizer``'s files when
    given. vLLM and transformers load the directory as an FP8 model; so does load_quantized.
    Files of an earlier save in the directory are replaced. The config's
    ``tie_word_embeddings`` says whether the input and output embeddings are one tensor
    (written once) or two (e.g. an lm_head converted by hand). Returns the directory.

    Refused: fp8 e5m2 layers (the format stores e4m3 only) and static layers that have not
    been calibrated.
    """
    directory = pathlib.Path(directory)
    tensors, layers, ignored = _stored_state(model)
    quantization_config = compressed_tensors_config(layers, ignored, COMPRESSED_TENSORS_FORMAT_VERSION)
    directory.mkdir(parents=True, exist_ok=True)
    shards = _plan_shards(tensors, max_shard_size)
    names = ([SINGLE_FILE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    with progress_bar(progress, total=len(tensors), desc="Saving FP8 checkpoint", unit="tensor") as bar:
        for file_name, shard in zip(names, shards):
            write_safetensors(directory / file_name, {name: tensors[name] for name in shard})
            weight_map.update((name, file_name) for name in shard)
            bar.update(len(shard))
    keep = set(names)
    if len(shards) > 1:
        write_index(directory, weight_map, sum(t.numel() * t.element_size() for t in tensors.values()))
        keep.add(INDEX_NAME)
    remove_stale_shards(directory, keep)
    write_model_config(directory, model, quantization_config)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    logger.info("fp8linear: saved %d FP8Linear layers (%d tensors, %d file(s)) to %s",
                len(layers), len(tensors), len(names), directory)
    return directory


# ---------------------------------------------------------------------------------------
# loading: plan (headers only), read and build, then modify the model


@dataclasses.dataclass
class _LayerPlan:
    """An FP8Linear to build from stored tensors: its own, or the parts of a fused layer."""

    name: str
    config: FP8Config
    parts: list[str]  # checkpoint layer names: [name], or the parts in fused order
    bias: bool
    places: list[tuple[nn.Module, str]]  # (parent, attribute) where the model holds the layer
    scale_name: str = "weight_scale"  # or weight_scale_inv (DeepSeek / Qwen3 / Mistral)
    input_name: str = "input_scale"  # or activation_scale (Mistral)

    def tensor_names(self) -> list[str]:
        suffixes = ["weight", self.scale_name] + (["bias"] if self.bias else [])
        suffixes += [self.input_name] if self.config.activations == "static" else []
        return [f"{part}.{suffix}" for part in self.parts for suffix in suffixes]


def _stored_suffix(stored: dict[str, StoredTensor], parts: list[str], names: tuple[str, ...]) -> str:
    """Which of the scale's possible names the checkpoint uses (the first if none: then
    the missing tensor is reported under that name)."""
    for suffix in names:
        if all(f"{part}.{suffix}" in stored for part in parts):
            return suffix
    return names[0]


def _block_grid(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // 128), -(-cols // 128)


@dataclasses.dataclass
class _TensorPlan:
    """A parameter or persistent buffer to fill from one stored tensor (tied ones share it)."""

    source: str
    slots: list[tuple[nn.Module, str, bool]]  # (module, attribute, is_parameter)
    requires_grad: bool


def _mismatch(name: str, what: str, expected, got) -> ValueError:
    return ValueError(f"checkpoint does not match the model: {name}: expected {what} {expected}, got {got}")


def _check_stored(stored: dict[str, StoredTensor], name: str, shape, dtypes, what: str) -> StoredTensor:
    if name not in stored:
        raise ValueError(f"checkpoint does not match the model: tensor {name} is missing ({what})")
    tensor = stored[name]
    if shape is not None and tensor.shape != tuple(shape):
        raise _mismatch(name, "shape", list(shape), list(tensor.shape))
    if tensor.dtype not in dtypes:
        raise _mismatch(name, "dtype", " or ".join(map(str, dtypes)), tensor.dtype)
    return tensor


def _check_meta_dtype(name: str, tensor: torch.Tensor, stored_dtype: torch.dtype) -> None:
    """A tensor on the meta device takes the stored dtype, within its kind: a float64 or
    integer norm weight would only fail later, in forward."""
    if tensor.is_floating_point() and stored_dtype not in FLOAT_DTYPES:
        raise ValueError(f"checkpoint does not match the model: {name} is stored as {stored_dtype}; a floating-point "
                         "parameter must be stored as float32, bfloat16 or float16")
    if not tensor.is_floating_point() and (stored_dtype.is_floating_point or stored_dtype.is_complex):
        raise ValueError(f"checkpoint does not match the model: {name} is stored as {stored_dtype}; an integer "
                         f"or bool buffer ({tensor.dtype} in the model) must be stored as an integer or bool")


def _plan_layer(name: str, module: nn.Module, scheme: CheckpointScheme, stored: dict[str, StoredTensor],
                fused_modules: dict[str, tuple[str, ...]], places) -> _LayerPlan | None:
    """The plan for one linear layer of the model, or None if the checkpoint stores it in full precision."""
    parent, _, last = name.rpartition(".")
    parts = [name]
    if f"{name}.weight" not in stored and last in fused_modules:
        candidates = [f"{parent}.{part}" if parent else part for part in fused_modules[last]]
        if all(f"{part}.weight" in stored for part in candidates):
            parts = candidates
    configs = {scheme.config_for(part, module, stored[f"{part}.weight"].dtype if f"{part}.weight" in stored else None)
               for part in parts}
    if len(configs) != 1:
        raise ValueError(f"checkpoint layers {parts}, fused into the model's {name}, are quantized differently")
    config = configs.pop()
    if config is None:
        if isinstance(module, FP8Linear):
            raise ValueError(f"checkpoint does not match the model: layer {name} is an FP8Linear in the model "
                             f"but stored in full precision in the checkpoint ({name}.weight)")
        return None
    if type(module) not in (nn.Linear, FP8Linear):
        raise ValueError(f"checkpoint stores {name} in fp8, but the model's layer is a "
                         f"{type(module).__qualname__}, a subclass of nn.Linear that FP8Linear cannot replace")
    out_features, in_features = module.out_features, module.in_features
    scale_name = _stored_suffix(stored, parts, scheme.weight_scale_names)
    input_name = _stored_suffix(stored, parts, scheme.input_scale_names)
    rows = []
    for index, part in enumerate(parts):
        shape = (out_features, in_features) if len(parts) == 1 else None  # parts: checked below
        weight = _check_stored(stored, f"{part}.weight", shape, (config.fp8_dtype,), "fp8 weight")
        if len(weight.shape) != 2 or weight.shape[1] != in_features:
            raise _mismatch(f"{part}.weight", "shape", f"[*, {in_features}]", list(weight.shape))
        rows.append(weight.shape[0])
        if config.weight_granularity == "channel":
            scale_shapes = [(weight.shape[0], 1), (weight.shape[0],)]
        elif config.weight_granularity == "block":
            scale_shapes = [_block_grid(weight.shape[0], in_features)]
            if index < len(parts) - 1 and weight.shape[0] % 128:
                raise ValueError(f"checkpoint layers {parts}, fused into the model's {name}: {part} has "
                                 f"{weight.shape[0]} rows, not whole blocks of 128, so its block scales cannot "
                                 "be stacked with the next part's")
        else:
            scale_shapes = [(), (1,)]
        scale = _check_stored(stored, f"{part}.{scale_name}", None, _FLOAT_SCALE_DTYPES, "weight scale")
        if scale.shape not in scale_shapes:
            raise _mismatch(f"{part}.{scale_name}", "shape", " or ".join(str(list(s)) for s in scale_shapes),
                            list(scale.shape))
        if config.activations == "static":
            input_scale = _check_stored(stored, f"{part}.{input_name}", None, _FLOAT_SCALE_DTYPES, "input scale")
            if input_scale.shape not in [(), (1,)]:
                raise _mismatch(f"{part}.{input_name}", "shape", "[] or [1]", list(input_scale.shape))
        if module.bias is not None:  # a bias on the meta device takes the stored dtype
            bias_dtypes = FLOAT_DTYPES if module.bias.device.type == "meta" else (module.bias.dtype,)
            _check_stored(stored, f"{part}.bias", (weight.shape[0],), bias_dtypes, "bias")
    if sum(rows) != out_features:
        raise _mismatch(f"{name} (fused from {parts})", "output rows", out_features, sum(rows))
    return _LayerPlan(name, config, parts, module.bias is not None, places, scale_name, input_name)


def _plan(model: nn.Module, scheme: CheckpointScheme, stored: dict[str, StoredTensor],
          fused_modules: dict[str, tuple[str, ...]]) -> tuple[list[_LayerPlan], list[_TensorPlan]]:
    """Match every stored tensor to the model, from the headers alone; raise on any mismatch."""
    names_of: dict[int, list[str]] = {}
    places_of: dict[int, list[tuple[nn.Module, str]]] = {}
    modules: dict[int, nn.Module] = {}
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for child_name, child in parent._modules.items():
            if child is None:
                continue
            fqn = f"{parent_name}.{child_name}" if parent_name else child_name
            names_of.setdefault(id(child), []).append(fqn)
            places_of.setdefault(id(child), []).append((parent, child_name))
            modules[id(child)] = child
    names_of.setdefault(id(model), [""])
    modules[id(model)] = model

    layers: list[_LayerPlan] = []
    consumed: set[str] = set()
    replaced: set[int] = set()
    for key, module in modules.items():
        if key == id(model) or not isinstance(module, (nn.Linear, FP8Linear)):
            continue  # the model itself has no parent to hold a replacement
        plan = _plan_layer(names_of[key][0], module, scheme, stored, fused_modules, places_of[key])
        if plan is not None:
            layers.append(plan)
            replaced.add(key)
            consumed.update(plan.tensor_names())
            for alias in names_of[key][1:]:  # a shared module's other names may also be stored: not read
                consumed.update(f"{alias}.{suffix}" for suffix in ("weight", "bias", *scheme.weight_scale_names,
                                                                   *scheme.input_scale_names))

    groups: dict[int, tuple[list[str], list[tuple[nn.Module, str, bool]], torch.Tensor]] = {}
    for key, module in modules.items():
        if key in replaced:
            continue
        persistent = [(n, t, False) for n, t in module._buffers.items() if n not in module._non_persistent_buffers_set]
        for attribute, tensor, is_parameter in [(n, t, True) for n, t in module._parameters.items()] + persistent:
            if tensor is None:
                continue
            names, slots, _ = groups.setdefault(id(tensor), ([], [], tensor))
            names.extend(f"{prefix}.{attribute}" if prefix else attribute for prefix in names_of[key])
            slots.append((module, attribute, is_parameter))
    tensors: list[_TensorPlan] = []
    for names, slots, tensor in groups.values():
        present = [name for name in names if name in stored]
        if not present:
            raise ValueError(f"checkpoint does not match the model: tensor {names[0]} is missing")
        source = present[0]
        if tensor.device.type == "meta":
            _check_meta_dtype(source, tensor, stored[source].dtype)
        dtypes = (tensor.dtype,) if tensor.device.type != "meta" else (stored[source].dtype,)
        _check_stored(stored, source, tensor.shape, dtypes, "")
        consumed.update(names)
        tensors.append(_TensorPlan(source, slots, tensor.requires_grad))
    unexpected = [name for name in stored if name not in consumed]
    if unexpected:
        raise ValueError(f"checkpoint does not match the model: tensor {unexpected[0]} has no counterpart "
                         f"in the model" + (f" ({len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    return layers, tensors


def _requantize(weight: torch.Tensor, scale: torch.Tensor, new_scale: torch.Tensor) -> torch.Tensor:
    """fp8 ``weight`` (dequantized by ``scale``) quantized again with the larger ``new_scale``,
    a block of rows at a time so the float32 temporary stays small (16 MB); the part that
    has the largest scale already is kept byte for byte."""
    if torch.equal(scale, new_scale):
        return weight
    out = torch.empty_like(weight)
    rows = max(1, (1 << 22) // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        block = dequantize_fp8(weight[start:start + rows], scale)
        out[start:start + rows] = quantize_fp8(block, new_scale, dtype=weight.dtype)[0]
    return out


def _build_layer(plan: _LayerPlan, read: dict[str, torch.Tensor]) -> FP8Linear:
    """The FP8Linear of a plan; fused per-tensor parts are re-quantized to the largest of
    their scales (as vLLM does: one scale per kernel call), per-channel ones concatenated."""
    config = plan.config
    weights = [read[f"{part}.weight"] for part in plan.parts]
    scales = [read[f"{part}.{plan.scale_name}"].to(torch.float32) for part in plan.parts]
    biases = [read[f"{part}.bias"] for part in plan.parts] if plan.bias else None
    input_scales = ([read[f"{part}.{plan.input_name}"].to(torch.float32).reshape(()) for part in plan.parts]
                    if config.activations == "static" else None)
    if len(plan.parts) == 1:  # the stored tensors as they are: no copy
        weight, bias = weights[0], biases[0] if biases else None
        if config.weight_granularity == "block":
            weight_scale = scales[0]
        else:
            weight_scale = scales[0].reshape(-1, 1) if config.weight_granularity == "channel" else scales[0].reshape(())
        input_scale = input_scales[0] if input_scales else None
    else:
        if config.weight_granularity == "block":  # whole 128-row blocks per part (checked in the plan)
            weight, weight_scale = torch.cat(weights), torch.cat(scales)
        elif config.weight_granularity == "channel":
            weight, weight_scale = torch.cat(weights), torch.cat([s.reshape(-1, 1) for s in scales])
        else:
            weight_scale = torch.stack([s.reshape(()) for s in scales]).max()
            weight = torch.cat([_requantize(w, s.reshape(()), weight_scale) for w, s in zip(weights, scales)])
        bias = torch.cat(biases) if biases else None
        # the fused layer sees one input: the largest calibrated range covers every part
        input_scale = torch.stack(input_scales).max() if input_scales else None
    try:
        return FP8Linear.from_fp8(weight, weight_scale, bias=bias, input_scale=input_scale, config=config)
    except ValueError as error:
        raise ValueError(f"layer {plan.name}: {error}") from error


def _read_and_build(layers: list[_LayerPlan], tensors: list[_TensorPlan], stored: dict[str, StoredTensor],
                    device, progress) -> tuple[list[FP8Linear], list[torch.Tensor]]:
    """Read the needed tensors file by file and build the new layers (the model is not touched)."""
    needed = [name for plan in layers for name in plan.tensor_names()] + [plan.source for plan in tensors]
    by_file: dict[pathlib.Path, list[str]] = {}
    for name in needed:
        by_file.setdefault(stored[name].file, []).append(name)
    read: dict[str, torch.Tensor] = {}
    with progress_bar(progress, total=len(needed), desc="Loading FP8 checkpoint", unit="tensor") as bar:
        for path, names in by_file.items():
            with open_safetensors(path, device) as file:
                for name in names:
                    read[name] = file.get_tensor(name)
                    bar.update(1)
    built = [_build_layer(plan, read) for plan in layers]
    return built, [read[plan.source] for plan in tensors]


def load_quantized(directory: os.PathLike, model: nn.Module | None = None, *,
                   device: str | torch.device | None = None,
                   fused_modules: dict[str, tuple[str, ...]] = FUSED_MODULES,
                   progress: bool | None = None) -> nn.Module:
    """Load an FP8 checkpoint (compressed-tensors float-quantized, or vLLM's ``"fp8"``).

    With ``model=None`` the transformers model that ``directory/config.json`` describes is
    built (parameters on the meta device, so no full-precision copy ever exists) and
    returned in eval mode. With a model (plain, already converted, or on the meta device)
    its quantized layers become FP8Linear layers holding the stored fp8 tensors and its
    other parameters and buffers take the stored ones; the model is returned.

    Every stored tensor must match a model tensor by name, shape and dtype (a tensor on
    the meta device takes the stored dtype: float32, bfloat16 or float16 for a floating-point
    one, an integer or bool dtype for an integer or bool buffer), and every model tensor
    must be stored; tied parameters stay tied. ``fused_modules`` names the model's fused layers (e.g.
    ``qkv_proj``) that the checkpoint may store as parts with a scale each. On a mismatch,
    a ValueError names the tensor and the model is left untouched. Tensors are read onto
    ``device`` (default: where the model's tensors are, else the CPU).
    """
    directory = pathlib.Path(directory)
    config = read_config(directory)
    scheme = parse_quantization_config(config, source=str(directory / CONFIG_NAME))
    stored = read_headers(directory)
    if model is None:
        model = model_skeleton(config, source=str(directory / CONFIG_NAME))
    if device is None:
        placed = (t.device for t in itertools.chain(model.parameters(), model.buffers()) if t.device.type != "meta")
        device = next(placed, torch.device("cpu"))
    layers, tensors = _plan(model, scheme, stored, fused_modules)
    if not layers:
        raise ValueError(f"{directory}: no linear layer of the model is stored in fp8 ({scheme.describe()})")
    built, values = _read_and_build(layers, tensors, stored, device, progress)

    # Nothing above modified the model; from here on nothing can fail.
    for plan, layer in zip(layers, built):
        for parent, attribute in plan.places:
            setattr(parent, attribute, layer)
    for plan, value in zip(tensors, values):
        parameter = nn.Parameter(value, requires_grad=plan.requires_grad and value.is_floating_point())
        for module, attribute, is_parameter in plan.slots:
            if is_parameter:
                module._parameters[attribute] = parameter
            else:
                module._buffers[attribute] = value
    logger.info("fp8linear: loaded %d FP8Linear layers from %s (%s)", len(layers), directory, scheme.describe())
    return model
