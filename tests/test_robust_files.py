"""Corrupt, truncated or lying files get a ValueError naming the file and the tensor (issue
10, item C), and a stored dtype the model can't run is refused at load, not in forward."""
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import fp8linear
import fp8linear.checkpoint as checkpoint_module
from fp8linear.checkpoint_files import read_config, read_header, read_headers
from tiny_models import tiny_llama

F32_PAIR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def raw_file(path, header, data: bytes = b"\0" * 8, length=None):
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)
    return path


@pytest.mark.parametrize("header, data, length, message", [
    (None, None, None, r"5 bytes, shorter than the 8-byte header length"),
    ({"x": F32_PAIR}, b"\0" * 8, 10**12, r"header length 1000000000000 is more than the .* bytes after it"),
    (b"\xff\xfe not json", b"", None, "header is not valid JSON"),
    (b"[1, 2]", b"", None, "header is not a JSON object"),
    ({"x": 3}, b"", None, "tensor x: entry is not an object"),
    ({"x": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, None, "tensor x: no dtype"),
    ({"x": {"dtype": "F32", "data_offsets": [0, 8]}}, b"\0" * 8, None, "tensor x: no shape"),
    ({"x": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, None, "tensor x: no data_offsets"),
    ({"x": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"tensor x: shape \[2, -1\] is not a list of sizes"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, b"\0" * 8, None,
     r"tensor x: data_offsets \[0\] are not \[begin, end\]"),
    ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 8, None,
     r"tensor x: data_offsets \[0, 16\] reach past the 8 bytes of data"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None,
     r"tensor x: data_offsets \[0, 8\] hold 8 bytes, but shape \[3\] of F32 needs 12"),
    ({"x": F32_PAIR, "y": F32_PAIR}, b"\0" * 16, None, "tensor y: data_offsets .* overlap"),
    ({"x": F32_PAIR}, b"\0" * 12, None, "4 bytes after the last tensor"),
    ({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", None,
     "tensor x has dtype F4, which fp8linear does not read"),
])
def test_read_header_refuses_corrupt_files_by_name(header, data, length, message, tmp_path):
    path = tmp_path / "model.safetensors"
    if header is None:
        path.write_bytes(b"\x01\x02\x03\x04\x05")
    else:
        raw_file(path, header, data, length)
    with pytest.raises(ValueError, match=message) as error:
        read_header(path)
    assert str(path) in str(error.value)


def test_a_valid_file_reads_as_safetensors_writes_it(tmp_path):
    tensors = {"a": torch.ones(2, 3), "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
               "scalar": torch.tensor(1.5), "f8": torch.zeros(5, dtype=torch.float8_e4m3fn)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    header = read_header(tmp_path / "x.safetensors")
    assert {name: (t.dtype, t.shape) for name, t in header.items()} == \
        {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


def saved_model(tmp_path):
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8")
    fp8linear.save_quantized(model, tmp_path)
    return tmp_path


def test_load_quantized_names_the_corrupt_file(tmp_path):
    directory = saved_model(tmp_path)
    shard = directory / "model.safetensors"
    original = shard.read_bytes()
    for broken in (original[:4], original[:len(original) - 100], original[:8] + b"x" + original[9:]):
        shard.write_bytes(broken)
        with pytest.raises(ValueError, match="model.safetensors"):
            fp8linear.load_quantized(directory)
    shard.write_bytes(original)
    (directory / "config.json").write_text("{\"model_type\": ")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        fp8linear.load_quantized(directory)
    (directory / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config.json is not a JSON object"):
        read_config(directory)


def test_a_corrupt_index_is_named(tmp_path):
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8")
    fp8linear.save_quantized(model, tmp_path, max_shard_size=200_000)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{")
    with pytest.raises(ValueError, match="model.safetensors.index.json is not valid JSON"):
        read_headers(tmp_path)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    with pytest.raises(ValueError, match="model.safetensors.index.json: weight_map must map tensor names to file"):
        read_headers(tmp_path)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="index.json lists gone.safetensors, which is not in"):
        read_headers(tmp_path)


def test_safetensors_errors_while_reading_data_name_the_file_and_tensor(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4)}, str(path))
    with checkpoint_module.open_safetensors(path) as file:
        assert torch.equal(file.get_tensor("a"), torch.ones(4))
        with pytest.raises(ValueError, match=f"{path}: tensor b: "):
            file.get_tensor("b")
    path.write_bytes(path.read_bytes()[:-3])  # changed after its header was checked
    with pytest.raises(ValueError, match=f"{path}: "):
        with checkpoint_module.open_safetensors(path) as file:
            file.get_tensor("a")


def rewrite(directory, name, value):
    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as file:
        tensors = {key: file.get_tensor(key) for key in file.keys()}
    tensors[name] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.uint8])
def test_a_fresh_model_refuses_a_floating_parameter_stored_in_another_dtype(dtype, tmp_path):
    directory = saved_model(tmp_path)
    rewrite(directory, "model.norm.weight", torch.ones(128, dtype=dtype))
    with pytest.raises(ValueError, match=f"model.norm.weight is stored as {dtype}; a floating-point "
                                         "parameter must be stored as float32, bfloat16 or float16"):
        fp8linear.load_quantized(directory)


def test_a_fresh_model_takes_the_stored_float_dtypes(tmp_path):
    directory = saved_model(tmp_path)
    rewrite(directory, "model.norm.weight", torch.ones(128, dtype=torch.bfloat16))
    assert fp8linear.load_quantized(directory).model.norm.weight.dtype == torch.bfloat16


class WithCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        return self.layer(self.norm(x))


def test_meta_tensors_take_stored_dtypes_within_their_kind(tmp_path):
    source = WithCounter()
    fp8linear.quantize_model(source, "fp8")
    state = dict(source.state_dict(), steps=torch.tensor(7, dtype=torch.int32))
    state = {name: t.reshape(1) if name.endswith("_scale") else t for name, t in state.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    quantization = json.loads(json.dumps(fp8linear.formats.compressed_tensors_config(
        {"layer": fp8linear.FP8Config()}, [], "0.20.1")))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization}))
    with torch.device("meta"):
        target = WithCounter()
    loaded = fp8linear.load_quantized(tmp_path, target)
    assert loaded.steps.dtype == torch.int32 and int(loaded.steps) == 7  # an integer buffer stays as stored
    x = torch.randn(3, 8)
    assert torch.equal(loaded(x), source(x))

    for name, value, message in [
        ("norm.weight", torch.ones(8, dtype=torch.float64), "norm.weight is stored as torch.float64"),
        ("layer.bias", torch.ones(4, dtype=torch.float64), "layer.bias: expected dtype"),
        ("steps", torch.tensor(7.0), "steps is stored as torch.float32; an integer or bool buffer"),
    ]:
        save_file(dict(state, **{name: value}), str(tmp_path / "model.safetensors"))
        with torch.device("meta"):
            target = WithCounter()
        with pytest.raises(ValueError, match=message):
            fp8linear.load_quantized(tmp_path, target)
        assert target.norm.weight.device.type == "meta"  # untouched


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": "wide"}, "hidden_size"),
    ({"num_attention_heads": 0}, "ZeroDivisionError"),
    ({"vocab_size": -5}, "negative dimension"),
    ({"model_type": "nonsense"}, "Unrecognized model identifier"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
])
def test_a_config_the_model_cant_take_is_refused_by_name(change, message, tmp_path):
    directory = saved_model(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=f"{directory / 'config.json'}: .*{message}"):
        fp8linear.load_quantized(directory)
