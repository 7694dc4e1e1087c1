"""quantize_checkpoint: convert a transformers safetensors checkpoint to FP8, one shard at a time.

The model is never built in full precision: its structure comes from config.json (a
skeleton with parameters on the meta device), and each shard is read, its linear
weights quantized and written before the next shard is opened, so peak memory stays
near the largest shard and a model larger than RAM converts. The weights are quantized
exactly as quantize_model does, and the output is what save_quantized writes.

The static scheme also needs activation ranges: the converted checkpoint is loaded
(fp8 weights: half a bf16 model) and run over the calibration text, and the input
scales are added to the shards, again one at a time.

All or nothing: every input is checked before converting, and the output is written
into a temporary directory beside OUT_DIR, renamed to OUT_DIR at the end (see
quantize_checkpoint for what happens to an existing OUT_DIR).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import secrets
import shutil
import sys

import torch
from torch import nn

from ._progress import progress_bar
from .calibration import CalibrationReport, calibrate, text_batches
from .checkpoint import COMPRESSED_TENSORS_FORMAT_VERSION, load_quantized
from .checkpoint_files import (CONFIG_NAME, INDEX_NAME, checkpoint_files, model_skeleton, open_safetensors,
                               read_config, read_header, read_headers, write_index, write_safetensors)
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
# Any of these makes a directory's tokenizer loadable by transformers' AutoTokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


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
    granularity = {"tensor": "tensor", "channel": "row", "block": "block"}[config.weight_granularity]
    weight_map: dict[str, str] = {}
    with progress_bar(progress, total=len(files), desc="Quantizing shards", unit="shard") as bar:
        for path in files:
            written: dict[str, torch.Tensor] = {}
            with open_safetensors(path) as file:
                for name in file.keys():
                    tensor = file.get_tensor(name)
                    layer, _, attribute = name.rpartition(".")
                    if layer in convert and attribute == "weight":
                        weight, scale = quantize_fp8(tensor, dtype=config.fp8_dtype, granularity=granularity,
                                                     scale_fmt=config.scale_fmt)
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


def _calibrate_and_add_input_scales(out_dir: pathlib.Path, batches: list[torch.Tensor],
                                    progress) -> tuple[CalibrationReport, dict[str, str]]:
    """Load the per-tensor checkpoint just written, make its layers static, calibrate, and
    add each layer's input_scale to the shard holding its weight."""
    model = load_quantized(out_dir, progress=progress)
    static = FP8Config(activations="static")
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, FP8Linear):  # same fp8 tensors, no copy
                setattr(parent, child_name, FP8Linear.from_fp8(child.weight, child.weight_scale, bias=child.bias,
                                                               config=static))
    report = calibrate(model, batches, progress=progress)
    if report.uncalibrated:
        raise ValueError(f"the calibration text reached no input of {len(report.uncalibrated)} layer(s): "
                         f"{', '.join(report.uncalibrated)}")
    if report.no_signal:
        raise ValueError(f"{len(report.no_signal)} layer(s) saw no finite nonzero input in the calibration text, so "
                         f"they have no input scale: {', '.join(report.no_signal)}; calibrate on another text "
                         "or keep them in full precision (--skip)")
    scales = {name: module.input_scale.reshape(1).clone() for name, module in model.named_modules()
              if isinstance(module, FP8Linear)}
    del model
    weight_map = {}
    for path in checkpoint_files(out_dir):
        with open_safetensors(path) as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}
        for name in list(tensors):
            layer, _, attribute = name.rpartition(".")
            if attribute == "weight" and layer in scales:
                tensors[f"{layer}.input_scale"] = scales[layer]
        write_safetensors(path, tensors)
        weight_map.update((name, path.name) for name in tensors)
        del tensors
    return report, weight_map


# ---------------------------------------------------------------------------------------
# checks before converting, and the output directory


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")


def _load_tokenizer(model_dir: pathlib.Path):
    """The tokenizer of model_dir, or a ValueError saying what is missing (transformers'
    own error for a directory without tokenizer files is a hint to install sentencepiece)."""
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{model_dir} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): the static "
                         "scheme tokenizes the calibration text with the model's own tokenizer")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as error:  # transformers raises ValueError, OSError, ImportError... for a broken tokenizer
        raise ValueError(f"{model_dir}: the tokenizer does not load: {error}") from error


def _calibration_batches(model_dir: pathlib.Path, config: dict, text, samples: int,
                         sequence_length: int) -> list[torch.Tensor]:
    """The static scheme's calibration batches, made before anything is converted."""
    if not isinstance(text, str):
        raise ValueError(f"calibration_text must be a str, got {type(text).__name__}")
    longest = config.get("max_position_embeddings")
    if isinstance(longest, int) and sequence_length > longest:
        raise ValueError(f"sequence_length {sequence_length} is more than the model's max_position_embeddings "
                         f"{longest} ({model_dir / CONFIG_NAME})")
    return text_batches(_load_tokenizer(model_dir), text, sequence_length=sequence_length, count=samples)


def _is_replaceable(out_dir: pathlib.Path) -> bool:
    """An empty directory, or a quantized checkpoint (an earlier output): config.json with
    a quantization_config."""
    if not any(out_dir.iterdir()):
        return True
    try:
        return "quantization_config" in read_config(out_dir)
    except (ValueError, OSError):
        return False


def _check_out_dir(out_dir: pathlib.Path, model_dir: pathlib.Path) -> None:
    if out_dir == model_dir.resolve():
        raise ValueError("out_dir must differ from model_dir: the shards are rewritten")
    if out_dir in model_dir.resolve().parents:
        raise ValueError(f"out_dir {out_dir} contains model_dir {model_dir}: replacing it would delete the model")
    if not os.path.lexists(out_dir):
        return
    if not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} exists and is not a directory")
    if not _is_replaceable(out_dir):
        raise ValueError(f"out_dir {out_dir} is not empty and not an FP8 checkpoint (no config.json with a "
                         "quantization_config): not replacing it; choose another directory")


def _sibling(out_dir: pathlib.Path, role: str) -> pathlib.Path:
    """A new name beside out_dir (same parent: renames between them are atomic)."""
    return out_dir.with_name(f".{out_dir.name}.fp8linear-{role}-{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def _staged_output(out_dir: pathlib.Path):
    """A temporary directory beside out_dir to write into, renamed to out_dir when the block
    succeeds (an earlier output there is replaced as a whole); removed, with any parent
    directories made for it, when the block fails, so out_dir stays as it was."""
    made = [directory for directory in [out_dir.parent, *out_dir.parent.parents] if not directory.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = _sibling(out_dir, "tmp")
    staging.mkdir()  # os.mkdir honours the umask (tempfile.mkdtemp would make it private)
    try:
        yield staging
        if not os.path.lexists(out_dir):
            os.rename(staging, out_dir)
        elif not any(out_dir.iterdir()):
            out_dir.rmdir()
            os.rename(staging, out_dir)
        else:  # an earlier output, checked before converting: check again, it may have changed since
            if not _is_replaceable(out_dir):
                raise ValueError(f"out_dir {out_dir} changed while converting and is no longer an FP8 checkpoint: "
                                 "not replacing it")
            previous = _sibling(out_dir, "old")
            os.rename(out_dir, previous)
            try:
                os.rename(staging, out_dir)
            except BaseException:
                os.rename(previous, out_dir)
                raise
            shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in made:  # deepest first; only the empty ones made above
            try:
                directory.rmdir()
            except OSError:
                break
        raise


def quantize_checkpoint(model_dir: os.PathLike, out_dir: os.PathLike, *, scheme: str = "per-channel",
                        skip_modules=("lm_head",), calibration_text: str | None = None,
                        calibration_samples: int = 16, sequence_length: int = 512,
                        progress: bool | None = None, scale_fmt: str | None = None) -> CheckpointConversion:
    """Write the FP8 checkpoint of the transformers model in ``model_dir`` to ``out_dir``.

    scheme: a key of SCHEMES ("per-tensor", "per-channel", "static", "weight-only", "block").
    scale_fmt: "ue8m0" with the block scheme: power-of-two block scales (FP8Config.scale_fmt).
    skip_modules: linear layers kept in full precision (last name component or full name).
    calibration_text: for "static" (required there): up to ``calibration_samples``
        sequences of ``sequence_length`` tokens of it calibrate the input scales, with
        model_dir's tokenizer.
    Shards keep their names; the tokenizer and other files are copied. The result loads
    with load_quantized, transformers (with compressed-tensors) and vLLM.

    All or nothing: the arguments, config.json, the shards' headers, the tokenizer and the
    calibration text are checked before anything is converted; the output is written into
    a temporary directory beside ``out_dir`` and renamed to ``out_dir`` at the end. On any
    failure the temporary directory is removed and ``out_dir`` is as it was (absent, or
    its previous content). An existing ``out_dir`` is replaced as a whole only when it is
    empty or holds an FP8 checkpoint (config.json with a quantization_config, e.g. an
    earlier output); any other existing path is refused with a ValueError, nothing deleted.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    if scale_fmt is not None and scheme != "block":
        raise ValueError(f"scale_fmt {scale_fmt!r} is for the block scheme, got scheme {scheme!r}")
    if (scheme == "static") != (calibration_text is not None):
        raise ValueError("the 'static' scheme needs a calibration text, and only it uses one")
    _check_count("calibration_samples", calibration_samples)
    _check_count("sequence_length", sequence_length)
    model_dir, given_out_dir = pathlib.Path(model_dir), pathlib.Path(out_dir)
    out_dir = pathlib.Path(os.path.realpath(given_out_dir))  # a symlink to a directory: write beside its target
    _check_out_dir(out_dir, model_dir)
    config = read_config(model_dir)
    if "quantization_config" in config:
        raise ValueError(f"{model_dir} is already quantized ({config['quantization_config'].get('quant_method')})")
    batches = (_calibration_batches(model_dir, config, calibration_text, calibration_samples, sequence_length)
               if scheme == "static" else None)
    skip_modules = {skip_modules} if isinstance(skip_modules, str) else set(skip_modules or ())
    skeleton = model_skeleton(config, str(model_dir / CONFIG_NAME))
    convert, skipped, ignored = _plan_layers(skeleton, skip_modules)
    known = set(skeleton.state_dict())
    del skeleton
    if not convert:
        raise ValueError(f"{model_dir}: no linear layer to convert ({len(skipped)} kept: "
                         f"{', '.join(sorted(set(skipped.values())))})")
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
    layer_config = FP8Config(**SCHEMES["per-tensor" if scheme == "static" else scheme],
                             **({"scale_fmt": scale_fmt} if scale_fmt else {}))
    files = checkpoint_files(model_dir)
    memory = MemoryReport(other_linear_layers=len(skipped))
    for name in skipped:
        memory.other_linear_bytes += sum(stored[t].nbytes for t in (f"{name}.weight", f"{name}.bias") if t in stored)
    calibration = None
    with _staged_output(out_dir) as staging:
        rss_before = _current_rss_bytes()
        _reset_peak_rss()
        weight_map = _stream_shards(files, staging, set(convert), layer_config, memory, progress)
        peak_streaming = _peak_rss_bytes()
        _copy_side_files(model_dir, staging)
        _write_config(staging, config, dict.fromkeys(convert, layer_config), ignored)
        if len(files) > 1:
            write_index(staging, weight_map, _tensor_bytes(staging, files))
        if scheme == "static":
            layer_config = FP8Config(**SCHEMES["static"])
            calibration, weight_map = _calibrate_and_add_input_scales(staging, batches, progress)
            memory.converted_bytes += 4 * len(convert)
            _write_config(staging, config, dict.fromkeys(convert, layer_config), ignored)
            if len(files) > 1:
                write_index(staging, weight_map, _tensor_bytes(staging, files))
    return CheckpointConversion(given_out_dir, scheme, layer_config, [p.name for p in files],
                                max(p.stat().st_size for p in files), memory, skipped, calibration,
                                rss_before, peak_streaming, _peak_rss_bytes())
