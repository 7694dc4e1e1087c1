"""The file layer of FP8 checkpoints: safetensors headers read and checked without
reading data, safetensors files opened with errors that name the file and tensor, the
shards and index of a model directory, config.json, atomic writers, and the transformers
model a config.json describes, built with its parameters on the meta device.

checkpoint.py (save_quantized, load_quantized) and quantize_checkpoint.py build on these.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import re
import struct

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
_SHARD_PATTERN = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16,
    "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I8": torch.int8,
    "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}


# ---------------------------------------------------------------------------------------
# safetensors files and transformers configs


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint, as its file header describes it (no data read)."""

    file: pathlib.Path
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def _corrupt(path: pathlib.Path, what: str) -> ValueError:
    return ValueError(f"{path}: not a valid safetensors file: {what}")


def _header_entry(path: pathlib.Path, name: str, entry, data_size: int) -> tuple[StoredTensor, int, int]:
    """One tensor's entry of a header, checked as safetensors checks it on opening."""
    if not isinstance(entry, dict):
        raise _corrupt(path, f"tensor {name}: entry is not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise _corrupt(path, f"tensor {name}: no {key}")
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {name} has dtype {dtype_name}, which fp8linear does not read")
    if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
        raise _corrupt(path, f"tensor {name}: shape {shape} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _corrupt(path, f"tensor {name}: data_offsets {offsets} are not [begin, end]")
    if offsets[1] > data_size:
        raise _corrupt(path, f"tensor {name}: data_offsets {offsets} reach past the {data_size} bytes of data")
    tensor = StoredTensor(path, _SAFETENSORS_DTYPES[dtype_name], tuple(shape))
    if offsets[1] - offsets[0] != tensor.nbytes:
        raise _corrupt(path, f"tensor {name}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                             f"but shape {shape} of {dtype_name} needs {tensor.nbytes}")
    return tensor, offsets[0], offsets[1]


def read_header(path: os.PathLike) -> dict[str, StoredTensor]:
    """Names, dtypes and shapes of a safetensors file, from its JSON header only. A file
    that safetensors would refuse (truncated, a header that does not describe the data)
    is refused here, with a ValueError naming the file and the tensor."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size < 8:
        raise _corrupt(path, f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > size - 8:
            raise _corrupt(path, f"header length {length} is more than the {size - 8} bytes after it")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise _corrupt(path, f"header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - length
    tensors, spans = {}, []
    for name, entry in header.items():
        tensors[name], begin, end = _header_entry(path, name, entry, data_size)
        spans.append((begin, end, name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise _corrupt(path, f"tensor {name}: data_offsets [{begin}, {stop}] overlap or leave a gap "
                                 f"after the previous tensor (which ends at {end})")
        end = stop
    if end != data_size:
        raise _corrupt(path, f"{data_size - end} bytes after the last tensor: the header does not describe them")
    return tensors


class _CheckedSafetensors:
    """A safe_open handle whose errors are ValueErrors naming the file and the tensor."""

    def __init__(self, handle, path: pathlib.Path):
        self._handle, self._path = handle, path

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"{self._path}: tensor {name}: {error}") from error


@contextlib.contextmanager
def open_safetensors(path: os.PathLike, device: str | torch.device = "cpu"):
    """safe_open(path) for torch tensors on ``device``, with safetensors' errors (a file
    changed or truncated after its header was read) as ValueErrors naming the file."""
    path = pathlib.Path(path)
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except SafetensorError as error:
        raise ValueError(f"{path}: not a valid safetensors file: {error}") from error
    with handle:
        yield _CheckedSafetensors(handle, path)


def _read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def checkpoint_files(directory: os.PathLike) -> list[pathlib.Path]:
    """The safetensors files of a model directory: those of its index, or the single file."""
    directory = pathlib.Path(directory)
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if weight_map is None:
            raise ValueError(f"{index} has no weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: weight_map must map tensor names to file names")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ValueError(f"{index} lists {missing[0]}, which is not in {directory}"
                             + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        return files
    if (directory / SINGLE_FILE_NAME).is_file():
        return [directory / SINGLE_FILE_NAME]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {directory} (fp8linear reads safetensors checkpoints)")
    return files


def read_headers(directory: os.PathLike) -> dict[str, StoredTensor]:
    """Every tensor of a model directory's checkpoint; a name stored twice is refused."""
    stored: dict[str, StoredTensor] = {}
    for path in checkpoint_files(directory):
        for name, tensor in read_header(path).items():
            if name in stored:
                raise ValueError(f"tensor {name} is stored twice: in {stored[name].file.name} and {path.name}")
            stored[name] = tensor
    return stored


def read_config(directory: os.PathLike) -> dict:
    path = pathlib.Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a checkpoint directory needs a config.json")
    return _read_json(path)


def write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write through a temporary file and rename: a reader (or a model whose tensors are
    memory-mapped from the old file) never sees a half-written file."""
    temporary = path.with_name(path.name + ".tmp")
    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(temporary),
              metadata={"format": "pt"})  # transformers refuses files without this metadata
    os.replace(temporary, path)


def write_index(directory: pathlib.Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def remove_stale_shards(directory: pathlib.Path, keep: set[str]) -> None:
    """Remove model*.safetensors files and the index left by an earlier save: with a
    different number of shards they would otherwise be read together with the new ones."""
    for path in directory.iterdir():
        ours = _SHARD_PATTERN.fullmatch(path.name) or path.name == INDEX_NAME
        if ours and path.name not in keep:
            path.unlink()


@contextlib.contextmanager
def parameters_on_meta():
    """Put parameters on the meta device as modules register them, and leave buffers as
    usual: non-persistent buffers such as rotary frequencies are computed at construction
    and are not in checkpoints, so they must be real. (A module's constructor still
    allocates each parameter with torch.empty for an instant, as accelerate's
    init_empty_weights lets it: uninitialized memory the kernel never hands out pages for,
    and initialization then runs on the meta tensor.)"""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, parameter):
        if parameter is not None and parameter.device.type != "meta":
            parameter = nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)
        register(module, name, parameter)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def model_skeleton(config: dict, source: str = CONFIG_NAME) -> nn.Module:
    """The transformers model a config.json describes, with its parameters on the meta device."""
    import transformers

    architectures = config.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"{source}: architectures must be a list of class names, got {architectures!r}")
    if "model_type" not in config:
        raise ValueError(f"{source} does not describe a transformers model (no model_type): "
                         "pass the model to load into as model=")
    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    named = architectures[0] if architectures and isinstance(architectures[0], str) else None
    model_class = getattr(transformers, named, None) if named else None
    try:
        model_config = transformers.AutoConfig.for_model(**plain)
        with parameters_on_meta():
            if model_class is not None:
                model = model_class(model_config)
            else:
                model = transformers.AutoModelForCausalLM.from_config(model_config)
    except Exception as error:  # a config with values the model can't take: its error type varies
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(f"{source}: transformers can't build the model it describes: "
                         f"{type(error).__name__}: {first_line}") from error
    return model.eval()
