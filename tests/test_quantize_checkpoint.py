"""``python -m fp8linear quantize``: streaming conversion of sharded checkpoints."""
import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import fp8linear
from fp8linear.__main__ import main
from fp8linear.calibration import text_batches
from fp8linear.checkpoint_files import model_skeleton, read_headers
from tiny_models import english_text, fp8_layers, logits, same_state, tiny_llama, tiny_tokenizer, token_ids


def hf_checkpoint(directory, max_shard_size="300KB"):
    """A transformers model directory with several shards and a tokenizer."""
    tiny_llama().save_pretrained(directory, max_shard_size=max_shard_size)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize("scheme", ["per-channel", "weight-only"])
def test_cli_writes_what_quantize_model_and_save_quantized_would(scheme, tmp_path, capsys):
    source, out = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8"
    assert main(["quantize", str(source), str(out), "--scheme", scheme, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "14 FP8Linear layers" in printed and "kept lm_head: listed in skip_modules" in printed
    assert re.search(r"peak memory \(RSS\): [\d.]+ MB while streaming shards", printed)

    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(shards) > 2 and sorted(p.name for p in out.glob("*.safetensors")) == shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(read_headers(out))
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()

    expected = tiny_llama()
    fp8linear.quantize_model(expected, "fp8", **fp8linear.SCHEMES[scheme])
    loaded = fp8linear.load_quantized(out)
    assert same_state(expected, loaded)
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(expected, ids))


def test_cli_static_calibrates_on_the_text(tmp_path, capsys):
    source, out, text_file = hf_checkpoint(tmp_path / "model"), tmp_path / "fp8", tmp_path / "calibration.txt"
    text = english_text()[:30_000]
    text_file.write_text(text, encoding="utf-8")
    main(["quantize", str(source), str(out), "--scheme", "static", "--calibration-text", str(text_file),
          "--calibration-samples", "4", "--sequence-length", "64", "--no-progress"])
    assert "calibrated 14 static layer(s) over 4 batch(es)" in capsys.readouterr().out

    expected = tiny_llama()
    fp8linear.quantize_model(expected, "fp8", activations="static")
    fp8linear.calibrate(expected, text_batches(tiny_tokenizer(), text, sequence_length=64, count=4))
    loaded = fp8linear.load_quantized(out)
    assert all(layer.config.activations == "static" for layer in fp8_layers(loaded).values())
    assert same_state(expected, loaded)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is False


def test_refusals(tmp_path):
    source = hf_checkpoint(tmp_path / "model")
    with pytest.raises(ValueError, match="'static' scheme needs a calibration text"):
        fp8linear.quantize_checkpoint(source, tmp_path / "a", scheme="static")
    with pytest.raises(ValueError, match="only it uses one"):
        fp8linear.quantize_checkpoint(source, tmp_path / "a", calibration_text="text")
    with pytest.raises(ValueError, match="scheme must be one of"):
        fp8linear.quantize_checkpoint(source, tmp_path / "a", scheme="int4")
    with pytest.raises(ValueError, match="out_dir must differ"):
        fp8linear.quantize_checkpoint(source, source)
    fp8linear.quantize_checkpoint(source, tmp_path / "fp8", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        fp8linear.quantize_checkpoint(tmp_path / "fp8", tmp_path / "again")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=3)))
    with pytest.raises(ValueError, match="model.layers.2.self_attn.q_proj.weight is not in the checkpoint"):
        fp8linear.quantize_checkpoint(source, tmp_path / "b")


PEAK = re.compile(r"peak memory \(RSS\): ([\d.]+) MB while streaming shards, ([\d.]+) MB above the ([\d.]+) MB before")


def test_streaming_peak_memory_stays_near_the_largest_shard(tmp_path):
    """Three float32 shards of ~51 MB (one decoder layer each): converting them one at a
    time must not need the whole 160 MB checkpoint (plus its fp8 copy) in memory."""
    transformers = pytest.importorskip("transformers")
    try:  # what the command uses to measure the streaming's own peak (Linux)
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError as error:
        pytest.skip(f"the peak RSS of the streaming alone can't be measured here: {error}")
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2752, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    source = tmp_path / "model"
    source.mkdir()
    config.save_pretrained(source)
    shapes = {name: tensor.shape for name, tensor in model_skeleton(config.to_dict()).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard in range(3):
        names = [n for n in shapes if n.startswith(f"model.layers.{shard}.")]
        names += {0: ["model.embed_tokens.weight"], 2: ["model.norm.weight", "lm_head.weight"]}.get(shard, [])
        file = f"model-{shard + 1:05d}-of-00003.safetensors"
        save_file({n: torch.randn(shapes[n], generator=generator) * 0.02 for n in names}, str(source / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sizes = [p.stat().st_size for p in source.glob("*.safetensors")]

    run = subprocess.run([sys.executable, "-m", "fp8linear", "quantize", str(source), str(tmp_path / "fp8"),
                          "--scheme", "per-tensor", "--no-progress"], capture_output=True, text=True, check=True)
    peak, above, before = (float(value) * 1e6 for value in PEAK.search(run.stdout).groups())
    print(f"\nshards {[round(s / 1e6, 1) for s in sizes]} MB; peak RSS {peak / 1e6:.1f} MB, "
          f"{above / 1e6:.1f} MB above the {before / 1e6:.1f} MB before streaming")
    assert 0 < above < 1.6 * max(sizes) < sum(sizes)
    assert len(fp8_layers(fp8linear.load_quantized(tmp_path / "fp8"))) == 21


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "missing"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fp8linear quantize: error: ") and "config.json not found" in err
    assert not (tmp_path / "out").exists()
