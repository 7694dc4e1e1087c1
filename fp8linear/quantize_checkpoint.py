"""quantize_checkpoint: convert a transformers safetensors checkpoint to FP8, one shard at a time.

The model is never built in full precision: its structure comes from config.json (a
skeleton with parameters on the meta device), and each shard is read, its linear
weights quantized and written before the next shard is opened, so peak memory stays
near the largest shard and a model larger than RAM converts. The weights are quantized
exactly as quantize_model does, and the output is what save_quantized writes.

The static scheme also needs activation ranges: the converted checkpoint is loaded
(fp8 weights: half a bf16 model) and run over the calibration text, and the input
scales are added to the shards, again one at a time.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import shutil
import sys

import torch
from safetensors import safe_open
from torch import nn

from ._progress import progress_bar
from .calibration import CalibrationReport, calibrate, text_batches
from .checkpoint import (CONFIG_NAME, COMPRESSED_TENSORS_FORMAT_VERSION, INDEX_NAME, checkpoint_files,
                         load_quantized, model_skeleton, read_config, read_header, read_headers, remove_stale_shards,
                         write_index, write_safetensors)
from .convert import SCHEMES, skip_reason
from .formats import compressed_tensors_config
from .linear import FP8Config, FP8Linear
from .memory import MemoryReport
from .ops import FLOAT_DTYPES, quantize_fp8

__all__ = ["quantize_checkpoint", "CheckpointConversion"]

logger = logging.getLogger("fp8linear")

# Weights and config are the model; everything else in the directory (tokenizer,
# generation config, chat template, license) is copied as it is.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".tmp")


def _proc_status_bytes(field: str) -> int | None:
    """A memory figure of this process from /proc/self/status (Linux), in bytes."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> None:
    """Restart the peak-RSS count (Linux: writing 5 to clear_refs resets VmHWM), so the
    peak measured next belongs to the streaming, not to imports before it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def _peak_rss_bytes() -> int | None:
    """Peak resident memory of this process. VmHWM where there is /proc: getrusage's
    ru_maxrss survives exec, so a child of a big process would report its parent's peak."""
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kilobytes


def _current_rss_bytes() -> int | None:
    return _proc_status_bytes("VmRSS") or _peak_rss_bytes()


@dataclasses.dataclass
class CheckpointConversion:
    """What quantize_checkpoint wrote and the memory it took.

    memory: the linear layers' bytes, as memory_report counts them for a loaded model.
    rss_before: resident memory just before the shards were read; peak_rss_streaming:
    the peak while streaming them; peak_rss: the peak at the end (calibration included).
    Bytes, None where the platform does not report them.
    """

    out_dir: pathlib.Path
    scheme: str
    config: FP8Config
    files: list[str]
    largest_shard_bytes: int
    memory: MemoryReport
    skipped: dict[str, str]
    calibration: CalibrationReport | None = None
    rss_before: int | None = None
    peak_rss_streaming: int | None = None
    peak_rss: int | None = None

    def __str__(self) -> str:
        mb = 1e6
        lines = [f"fp8linear: wrote {self.out_dir} ({self.scheme}: {self.config.describe()})",
                 f"  {len(self.files)} shard(s), largest input shard {self.largest_shard_bytes / mb:.1f} MB",
                 f"  {self.memory}"]
        lines += [f"  kept {name}: {reason}" for name, reason in self.skipped.items()]
        if self.calibration is not None:
            lines.append(f"  {self.calibration}")
        if self.peak_rss_streaming is not None and self.rss_before is not None:
            lines.append(f"  peak memory (RSS): {self.peak_rss_streaming / mb:.1f} MB while streaming shards, "
                         f"{(self.peak_rss_streaming - self.rss_before) / mb:.1f} MB above the "
                         f"{self.rss_before / mb:.1f} MB before; peak {self.peak_rss / mb:.1f} MB in all")
        return "\n".join(lines)


def _plan_layers(skeleton: nn.Module, skip_modules) -> tuple[list[str], dict[str, str], list[str]]:
    """Names of the linear layers to convert, the skipped ones with the reason, and every
    nn.Linear not converted (the checkpoint's ignore list)."""
    tied: dict[int, list[str]] = {}
    for name, parameter in skeleton.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    convert, skipped, ignored = [], {}, []
    for name, module in skeleton.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        reason = skip_reason(module, name, skip_modules, None, check_weight=False)
        if reason is None and len(tied[id(module.weight)]) > 1:
            # a tied weight is stored once, under its first name, which may not be this layer
            reason = f"weight tied to {[n for n in tied[id(module.weight)] if n != name + '.weight']}"
        if reason is None:
            convert.append(name)
        else:
            skipped[name] = reason
            ignored.append(name)
    return convert, skipped, ignored


def _tensor_bytes(out_dir: pathlib.Path, files: list[pathlib.Path]) -> int:
    """The index's total_size: the bytes of the tensors written (headers excluded)."""
    return sum(t.nbytes for path in files for t in read_header(out_dir / path.name).values())


def _copy_side_files(model_dir: pathlib.Path, out_dir: pathlib.Path) -> None:
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in (CONFIG_NAME, INDEX_NAME) and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out_dir / path.name)


def _write_config(out_dir: pathlib.Path, config: dict, layers: dict[str, FP8Config], ignored: list[str]) -> None:
    quantization_config = compressed_tensors_config(layers, ignored, COMPRESSED_TENSORS_FORMAT_VERSION)
    data = dict(config, quantization_config=quantization_config)
    (out_dir / CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _stream_shards(files: list[pathlib.Path], out_dir: pathlib.Path, convert: set[str], config: FP8Config,
                   memory: MemoryReport, progress) -> dict[str, str]:
    """Quantize the linear weights of each shard and write it under the same name; returns the weight map."""
    granularity = "row" if config.weight_granularity == "channel" else "tensor"
    weight_map: dict[str, str] = {}
    with progress_bar(progress, total=len(files), desc="Quantizing shards", unit="shard") as bar:
        for path in files:
            written: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt") as file:
                for name in file.keys():
                    tensor = file.get_tensor(name)
                    layer, _, attribute = name.rpartition(".")
                    if layer in convert and attribute == "weight":
                        weight, scale = quantize_fp8(tensor, dtype=config.fp8_dtype, granularity=granularity)
                        written[name] = weight
                        written[f"{layer}.weight_scale"] = scale.reshape(1) if scale.dim() == 0 else scale
                        memory.converted_layers += 1
                        memory.converted_bytes += weight.numel() + scale.numel() * 4
                        memory.converted_bf16_bytes += 2 * weight.numel()
                    else:
                        written[name] = tensor
                        if layer in convert and attribute == "bias":
                            memory.converted_bytes += tensor.numel() * tensor.element_size()
                            memory.converted_bf16_bytes += 2 * tensor.numel()
                    del tensor
            write_safetensors(out_dir / path.name, written)
            weight_map.update((name, path.name) for name in written)
            del written
            bar.update(1)
    return weight_map


def _calibrate_and_add_input_scales(out_dir: pathlib.Path, model_dir: pathlib.Path, text: str, samples: int,
                                    sequence_length: int, progress) -> tuple[CalibrationReport, dict[str, str]]:
    """Load the per-tensor checkpoint just written, make its layers static, calibrate, and
    add each layer's input_scale to the shard holding its weight."""
    from transformers import AutoTokenizer

    model = load_quantized(out_dir, progress=progress)
    static = FP8Config(activations="static")
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, FP8Linear):  # same fp8 tensors, no copy
                setattr(parent, child_name, FP8Linear.from_fp8(child.weight, child.weight_scale, bias=child.bias,
                                                               config=static))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    batches = text_batches(tokenizer, text, sequence_length=sequence_length, count=samples)
    report = calibrate(model, batches, progress=progress)
    if report.uncalibrated:
        raise RuntimeError(f"the calibration text reached no input of {report.uncalibrated}")
    scales = {name: module.input_scale.reshape(1).clone() for name, module in model.named_modules()
              if isinstance(module, FP8Linear)}
    del model
    weight_map = {}
    for path in checkpoint_files(out_dir):
        with safe_open(str(path), framework="pt") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}
        for name in list(tensors):
            layer, _, attribute = name.rpartition(".")
            if attribute == "weight" and layer in scales:
                tensors[f"{layer}.input_scale"] = scales[layer]
        write_safetensors(path, tensors)
        weight_map.update((name, path.name) for name in tensors)
        del tensors
    return report, weight_map


def quantize_checkpoint(model_dir: os.PathLike, out_dir: os.PathLike, *, scheme: str = "per-channel",
                        skip_modules=("lm_head",), calibration_text: str | None = None,
                        calibration_samples: int = 16, sequence_length: int = 512,
                        progress: bool | None = None) -> CheckpointConversion:
    """Write the FP8 checkpoint of the transformers model in ``model_dir`` to ``out_dir``.

    scheme: a key of SCHEMES ("per-tensor", "per-channel", "static", "weight-only").
    skip_modules: linear layers kept in full precision (last name component or full name).
    calibration_text: for "static" (required there): up to ``calibration_samples``
        sequences of ``sequence_length`` tokens of it calibrate the input scales.
    Shards keep their names; the tokenizer and other files are copied. The result loads
    with load_quantized, transformers (with compressed-tensors) and vLLM.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    if (scheme == "static") != (calibration_text is not None):
        raise ValueError("the 'static' scheme needs a calibration text, and only it uses one")
    model_dir, out_dir = pathlib.Path(model_dir), pathlib.Path(out_dir)
    if model_dir.resolve() == out_dir.resolve():
        raise ValueError("out_dir must differ from model_dir: the shards are rewritten")
    config = read_config(model_dir)
    if "quantization_config" in config:
        raise ValueError(f"{model_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    skip_modules = {skip_modules} if isinstance(skip_modules, str) else set(skip_modules or ())
    skeleton = model_skeleton(config, str(model_dir / CONFIG_NAME))
    convert, skipped, ignored = _plan_layers(skeleton, skip_modules)
    known = set(skeleton.state_dict())
    del skeleton
    stored = read_headers(model_dir)
    missing = [f"{name}.weight" for name in convert if f"{name}.weight" not in stored]
    if missing:
        raise ValueError(f"{model_dir}: the model's linear weight {missing[0]} is not in the checkpoint "
                         f"({len(missing)} missing); is config.json the checkpoint's?")
    not_float = [f"{name}.weight" for name in convert if stored[f"{name}.weight"].dtype not in FLOAT_DTYPES]
    if not_float:
        raise ValueError(f"{model_dir}: {not_float[0]} is {stored[not_float[0]].dtype}; fp8linear quantizes "
                         "float32, bfloat16 and float16 weights")
    unknown = sorted(set(stored) - known)
    if unknown:
        logger.warning("fp8linear: %d checkpoint tensor(s) are not in the model and are copied as they are: %s",
                       len(unknown), ", ".join(unknown[:5]))

    # Weights are quantized the same way for "static" as for "per-tensor"; the static
    # input scales come from calibrating the written checkpoint.
    layer_config = FP8Config(**SCHEMES["per-tensor" if scheme == "static" else scheme])
    files = checkpoint_files(model_dir)
    memory = MemoryReport(other_linear_layers=len(skipped))
    for name in skipped:
        memory.other_linear_bytes += sum(stored[t].nbytes for t in (f"{name}.weight", f"{name}.bias") if t in stored)
    out_dir.mkdir(parents=True, exist_ok=True)
    rss_before = _current_rss_bytes()
    _reset_peak_rss()
    weight_map = _stream_shards(files, out_dir, set(convert), layer_config, memory, progress)
    peak_streaming = _peak_rss_bytes()
    remove_stale_shards(out_dir, {path.name for path in files} | ({INDEX_NAME} if len(files) > 1 else set()))
    _copy_side_files(model_dir, out_dir)
    _write_config(out_dir, config, dict.fromkeys(convert, layer_config), ignored)
    if len(files) > 1:
        write_index(out_dir, weight_map, _tensor_bytes(out_dir, files))

    calibration = None
    if scheme == "static":
        layer_config = FP8Config(**SCHEMES["static"])
        calibration, weight_map = _calibrate_and_add_input_scales(out_dir, model_dir, calibration_text,
                                                                  calibration_samples, sequence_length, progress)
        memory.converted_bytes += 4 * len(convert)
        _write_config(out_dir, config, dict.fromkeys(convert, layer_config), ignored)
        if len(files) > 1:
            write_index(out_dir, weight_map, _tensor_bytes(out_dir, files))
    return CheckpointConversion(out_dir, scheme, layer_config, [p.name for p in files],
                                max(p.stat().st_size for p in files), memory, skipped, calibration,
                                rss_before, peak_streaming, _peak_rss_bytes())
