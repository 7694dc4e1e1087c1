"""Messages that say what happened (issue 10, items C and D): calibration without signal,
an empty memory report, a second conversion, text_batches' documented defaults."""
import inspect
import logging
import pathlib
import re

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear.calibration import text_batches
from tiny_models import tiny_llama, tiny_tokenizer


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def static_model():
    torch.manual_seed(0)
    model = TwoLayers()
    fp8linear.quantize_model(model, "fp8", activations="static")
    return model


@pytest.mark.parametrize("batch, no_signal", [
    (torch.zeros(3, 16), ["first"]),  # second sees relu(bias)
    (torch.tensor([[float("inf"), float("-inf")] * 8]), ["first"]),  # saturated to finite values for second
    (torch.full((3, 16), float("nan")), ["first", "second"]),
])
def test_a_layer_without_finite_nonzero_input_is_not_calibrated(batch, no_signal, caplog):
    model = static_model()
    with caplog.at_level(logging.INFO, logger="fp8linear"):
        report = fp8linear.calibrate(model, [batch])
    assert report.no_signal == no_signal and "first" not in report.input_scales
    assert not model.first.input_scale_ready and torch.isnan(model.first.input_scale)
    assert report.uncalibrated == []
    assert f"no finite nonzero input reached {len(no_signal)}: {', '.join(no_signal)}" in str(report)
    assert "saw no finite nonzero value" in caplog.text and "first" in caplog.text
    with pytest.raises(RuntimeError, match="input_scale is not set"):
        model(torch.randn(2, 16))


def test_a_layer_without_signal_keeps_its_previous_scale():
    model = static_model()
    fp8linear.calibrate(model, [torch.randn(4, 16)])
    before = model.first.input_scale.clone()
    report = fp8linear.calibrate(model, [torch.zeros(4, 16)])
    assert report.no_signal == ["first"] and torch.equal(model.first.input_scale, before)
    assert model.first.input_scale_ready


def test_memory_report_of_a_model_without_fp8_layers():
    report = fp8linear.memory_report(TwoLayers())
    text = str(report)
    assert "nan" not in text
    assert text.startswith("no FP8Linear layers; 2 nn.Linear layers: ")


def test_a_second_quantize_model_says_nothing_was_converted(caplog):
    model = tiny_llama()
    fp8linear.quantize_model(model, "fp8")
    with caplog.at_level(logging.WARNING, logger="fp8linear"):
        assert fp8linear.quantize_model(model, "fp8") is model
    assert "the model already holds 14 FP8Linear layers; nothing was converted" in caplog.text
    assert model.fp8linear_report.converted == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8linear"):
        fp8linear.quantize_model(model, "fp8", skip_modules=())  # lm_head is still to convert
    assert "already holds" not in caplog.text and model.fp8linear_report.converted == ["lm_head"]


def test_text_batches_defaults_are_the_documented_ones():
    parameters = inspect.signature(text_batches).parameters
    defaults = {name: parameters[name].default for name in ("sequence_length", "count")}
    assert defaults == {"sequence_length": 512, "count": 16}
    doc = inspect.getdoc(text_batches)
    assert "512" in doc and "16" in doc
    readme = pathlib.Path(__file__).parents[1] / "README.md"
    mention = re.search(r"text_batches\(tokenizer, text, sequence_length=(\d+), count=(\w+)\)", readme.read_text())
    assert mention and (int(mention[1]), int(mention[2])) == (512, 16)
    tokenizer = tiny_tokenizer()
    assert len(text_batches(tokenizer, "word " * 20_000)) == 16
    assert len(text_batches(tokenizer, "word " * 20_000, count=None)) > 16


@pytest.mark.parametrize("options, message", [
    (dict(sequence_length=0), "sequence_length must be at least 1, got 0"),
    (dict(count=0), "count must be at least 1 or None, got 0"),
])
def test_text_batches_refuses_empty_pieces(options, message):
    with pytest.raises(ValueError, match=message):
        text_batches(tiny_tokenizer(), "some text", **options)
