"""``python -m fp8linear quantize`` / quantize_checkpoint is all or nothing (issue 10, items
B and C): every input is checked before converting, the output is written beside OUT_DIR
and renamed at the end, and a failure leaves OUT_DIR as it was, with a one-line error."""
import importlib
import json

import pytest
import torch

import fp8linear
from fp8linear.__main__ import main
from tiny_models import english_text, fp8_layers, tiny_llama, tiny_tokenizer

# the module, not the function fp8linear re-exports under the same name
quantize_module = importlib.import_module("fp8linear.quantize_checkpoint")


def hf_checkpoint(directory, tokenizer=True, max_shard_size="300KB", model=None):
    (model or tiny_llama()).save_pretrained(directory, max_shard_size=max_shard_size)
    if tokenizer:
        tiny_tokenizer().save_pretrained(directory)
    return directory


def text_file(directory, text=None):
    path = directory / "calibration.txt"
    path.write_text(english_text()[:20_000] if text is None else text, encoding="utf-8")
    return path


def snapshot(directory):
    """Every file under directory with its bytes (None: the directory does not exist)."""
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def quantize(source, out, *options):
    return main(["quantize", str(source), str(out), "--no-progress", *options])


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    line = err.splitlines()[-1]
    assert line.startswith("python -m fp8linear quantize: error: "), err
    return line


STATIC = ("--scheme", "static", "--sequence-length", "32", "--calibration-samples", "2")


def test_static_without_a_tokenizer_fails_before_converting(tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model", tokenizer=False), tmp_path / "fp8"
    assert quantize(source, out, *STATIC, "--calibration-text", str(text_file(tmp_path))) == 2
    line = error_line(capsys)
    assert str(source) in line and "no tokenizer" in line and "sentencepiece" not in line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.txt", "model"]  # no temporary left


@pytest.mark.parametrize("options, message", [
    (("--calibration-samples", "0"), "--calibration-samples: must be at least 1, got 0"),
    (("--sequence-length", "0"), "--sequence-length: must be at least 1, got 0"),
    (("--sequence-length", "-3"), "--sequence-length: must be at least 1, got -3"),
])
def test_cli_option_values_are_checked(options, message, tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    with pytest.raises(SystemExit) as exit_info:
        quantize(source, out, "--scheme", "static", "--calibration-text", str(text_file(tmp_path)), *options)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("arguments, message", [
    (dict(calibration_samples=0), "calibration_samples must be at least 1, got 0"),
    (dict(sequence_length=0), "sequence_length must be at least 1, got 0"),
    (dict(sequence_length=129), "sequence_length 129 is more than the model's max_position_embeddings 128"),
    (dict(calibration_text=""), "the calibration text is empty after tokenization"),
])
def test_api_checks_the_calibration_arguments_before_converting(arguments, message, tmp_path, monkeypatch):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    streamed = []
    monkeypatch.setattr(quantize_module, "_stream_shards", lambda *a, **k: streamed.append(a) or {})
    options = {"scheme": "static", "calibration_text": "some text to calibrate on", "sequence_length": 32,
               "progress": False, **arguments}
    with pytest.raises(ValueError, match=message):
        fp8linear.quantize_checkpoint(source, out, **options)
    assert streamed == [] and not out.exists()


def test_empty_or_unreadable_calibration_text_is_refused_by_name(tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    empty = text_file(tmp_path, "")
    assert quantize(source, out, *STATIC, "--calibration-text", str(empty)) == 2
    assert "the calibration text is empty after tokenization" in error_line(capsys)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \x81")
    assert quantize(source, out, *STATIC, "--calibration-text", str(binary)) == 2
    line = error_line(capsys)
    assert str(binary) in line and "UTF-8" in line
    assert quantize(source, out, *STATIC, "--calibration-text", str(tmp_path / "missing.txt")) == 2
    assert "missing.txt" in error_line(capsys)
    assert not out.exists()


def test_nothing_to_convert_is_refused(tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    assert quantize(source, out, "--skip", *names) == 2
    assert "no linear layer to convert" in error_line(capsys)
    assert not out.exists()


def fail_after_the_first_shard(monkeypatch):
    real = quantize_module.write_safetensors
    calls = []

    def write_then_fail(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(path, tensors)

    monkeypatch.setattr(quantize_module, "write_safetensors", write_then_fail)
    return calls


def test_a_failure_part_way_leaves_no_output(tmp_path, monkeypatch, capsys):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "nested" / "fp8"
    calls = fail_after_the_first_shard(monkeypatch)
    assert quantize(source, out) == 2
    assert "No space left on device" in error_line(capsys)
    assert len(calls) == 2 and calls[0].parent != out  # written beside OUT_DIR, not into it
    assert not out.exists()
    assert not (tmp_path / "nested").exists()  # the parent made for it is gone too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_failure_leaves_a_previous_output_as_it_was(tmp_path, monkeypatch):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    fp8linear.quantize_checkpoint(source, out, scheme="per-tensor", progress=False)
    before = snapshot(out)
    fail_after_the_first_shard(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        fp8linear.quantize_checkpoint(source, out, progress=False)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "model"]


def test_static_calibration_failure_leaves_no_output(tmp_path, capsys):
    """A layer that sees only zeros while calibrating has no scale: refused, nothing written."""
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.zero_()  # q, k and v of layer 0 see zeros
    source, out = hf_checkpoint(tmp_path / "model", model=model), tmp_path / "fp8"
    assert quantize(source, out, *STATIC, "--calibration-text", str(text_file(tmp_path))) == 2
    line = error_line(capsys)
    assert "model.layers.0.self_attn.q_proj" in line and "no finite nonzero" in line
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration.txt", "model"]


def test_a_previous_output_is_replaced_as_a_whole(tmp_path):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    fp8linear.quantize_checkpoint(source, out, scheme="per-tensor", progress=False)
    (out / "stale-notes.txt").write_text("from the earlier run")
    fp8linear.quantize_checkpoint(source, out, scheme="weight-only", progress=False)
    assert not (out / "stale-notes.txt").exists()
    assert all(layer.config.activations == "none" for layer in fp8_layers(fp8linear.load_quantized(out)).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "model"]
    empty = tmp_path / "empty"
    empty.mkdir()
    fp8linear.quantize_checkpoint(source, empty, progress=False)  # an empty directory is used
    assert (empty / "config.json").is_file()


def test_unrelated_files_in_out_dir_are_never_deleted(tmp_path, capsys):
    source = hf_checkpoint(tmp_path / "model")
    user_dir = tmp_path / "documents"
    user_dir.mkdir()
    (user_dir / "thesis.tex").write_text("precious")
    before = snapshot(user_dir)
    assert quantize(source, user_dir) == 2
    line = error_line(capsys)
    assert str(user_dir) in line and "not an FP8 checkpoint" in line
    assert snapshot(user_dir) == before

    other_model = hf_checkpoint(tmp_path / "other")  # a full-precision model: not ours to replace
    before = snapshot(other_model)
    with pytest.raises(ValueError, match="not an FP8 checkpoint"):
        fp8linear.quantize_checkpoint(source, other_model, progress=False)
    assert snapshot(other_model) == before

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        fp8linear.quantize_checkpoint(source, a_file, progress=False)
    with pytest.raises(ValueError, match="contains model_dir"):
        fp8linear.quantize_checkpoint(source, tmp_path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["documents", "file", "model", "other"]


def test_cli_reports_corrupt_files_by_name(tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model", max_shard_size="100MB"), tmp_path / "fp8"
    shard = source / "model.safetensors"
    original = shard.read_bytes()
    shard.write_bytes(original[:5])
    assert quantize(source, out) == 2
    assert "model.safetensors" in error_line(capsys)
    shard.write_bytes(original[:len(original) // 2])  # truncated data
    assert quantize(source, out) == 2
    assert "model.safetensors" in error_line(capsys)
    shard.write_bytes(original)
    config = (source / "config.json").read_text()
    (source / "config.json").write_text(config[:-10])
    assert quantize(source, out) == 2
    line = error_line(capsys)
    assert "config.json" in line and "not valid JSON" in line
    assert not out.exists()


def test_cli_reports_a_corrupt_index_by_name(tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    index = source / "model.safetensors.index.json"
    index.write_text("{not json")
    assert quantize(source, out) == 2
    line = error_line(capsys)
    assert "model.safetensors.index.json" in line and "not valid JSON" in line
    index.write_text(json.dumps({"metadata": {}}))
    assert quantize(source, out) == 2
    assert "model.safetensors.index.json has no weight_map" in error_line(capsys)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-99999-of-99999.safetensors"}}))
    assert quantize(source, out) == 2
    assert "model-99999-of-99999.safetensors" in error_line(capsys)
    assert not out.exists()


def test_unexpected_exceptions_still_propagate(tmp_path, monkeypatch):
    source = hf_checkpoint(tmp_path / "model")

    def broken(*args, **kwargs):
        raise KeyError("a bug, not bad input")

    monkeypatch.setattr(quantize_module, "_stream_shards", broken)
    with pytest.raises(KeyError, match="a bug"):
        quantize(source, tmp_path / "fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

