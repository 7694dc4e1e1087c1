"""calibrate: static input scales from the amax of the batches; atomic on failure."""
import logging

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Linear
from fp8linear.calibration import text_batches
from tiny_models import english_text, logits, tiny_llama, tiny_tokenizer


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x, scale=1.0):
        return self.second(torch.relu(self.first(x * scale)))


def static_copy_and_dynamic_copy(seed=0):
    torch.manual_seed(seed)
    static, dynamic = TwoLayers(), TwoLayers()
    dynamic.load_state_dict(static.state_dict())
    fp8linear.quantize_model(static, "fp8", activations="static")
    fp8linear.quantize_model(dynamic, "fp8")
    return static, dynamic


def test_scales_are_the_amax_over_the_batches():
    static, dynamic = static_copy_and_dynamic_copy()
    batches = [torch.randn(4, 16), torch.randn(6, 16) * 3, torch.randn(2, 16)]
    inputs = {"first": [], "second": []}
    hooks = [getattr(dynamic, name).register_forward_pre_hook(lambda m, a, name=name: inputs[name].append(a[0]))
             for name in inputs]
    for batch in batches:
        dynamic(batch)  # calibration runs the static layers as dynamic per-tensor ones
    for hook in hooks:
        hook.remove()
    report = fp8linear.calibrate(static, batches)
    for name, seen in inputs.items():
        amax = max(x.abs().max() for x in seen)
        expected = (amax.double() / 448).float()
        assert torch.equal(getattr(static, name).input_scale, expected)
        assert report.amax[name] == float(amax) and report.input_scales[name] == float(expected)
    assert report.batches == 3 and report.uncalibrated == ["unused"]
    # on the batch that set both maxima, static and dynamic per-tensor quantization agree exactly
    assert torch.equal(static(batches[1]), dynamic(batches[1]))


def test_batch_forms_and_the_floor_for_tiny_inputs():
    static, _ = static_copy_and_dynamic_copy()
    tiny = torch.full((3, 16), 1e-6)
    fp8linear.calibrate(static, [(tiny, 1.0), {"x": tiny[:2], "scale": 2.0}])
    assert torch.equal(static.first.input_scale, torch.tensor(1 / (448 * 512), dtype=torch.float32))
    # all-zero inputs give no range at all: reported, not given the floor (tests/test_robust_messages.py)
    x = torch.randn(3, 16)
    x[0, 0] = float("inf")  # non-finite values don't set the range
    fp8linear.calibrate(static, [x])
    assert torch.equal(static.first.input_scale, (x[torch.isfinite(x)].abs().max().double() / 448).float())


def test_a_failing_batch_leaves_every_layer_as_it_was():
    static, _ = static_copy_and_dynamic_copy()

    def batches():
        yield torch.randn(4, 16)
        raise RuntimeError("data loader broke")

    with pytest.raises(RuntimeError, match="data loader broke"):
        fp8linear.calibrate(static, batches())
    with pytest.raises(RuntimeError, match="input_scale is not set"):
        static(torch.randn(2, 16))
    assert torch.isnan(static.first.input_scale)
    fp8linear.calibrate(static, [torch.randn(4, 16)])
    before = static.first.input_scale.clone()
    with pytest.raises(ValueError, match="in_features=16"):
        fp8linear.calibrate(static, [torch.randn(4, 16) * 10, torch.randn(4, 17)])
    assert torch.equal(static.first.input_scale, before)
    assert not static.first._forward_pre_hooks


def test_refusals_and_the_warning_for_unreached_layers(caplog):
    with pytest.raises(ValueError, match="no FP8Linear layer with activations='static'"):
        fp8linear.calibrate(static_copy_and_dynamic_copy()[1], [torch.randn(2, 16)])
    static, _ = static_copy_and_dynamic_copy()
    with pytest.raises(ValueError, match="batches is empty"):
        fp8linear.calibrate(static, [])
    with caplog.at_level(logging.INFO, logger="fp8linear"):
        report = fp8linear.calibrate(static, [torch.randn(2, 16)])
    assert "calibrated 2 static layer(s) over 1 batch(es)" in caplog.text
    assert "without calibration data (no batch reached them): unused" in caplog.text
    assert torch.isnan(static.unused.input_scale) and str(report).endswith("no input reached 1: unused")


def test_a_static_llama_calibrated_on_text_is_close_to_per_tensor_dynamic():
    tokenizer = tiny_tokenizer()
    batches = text_batches(tokenizer, english_text()[:20_000], sequence_length=64, count=6)
    assert len(batches) == 6 and all(b.shape == (1, 64) for b in batches)
    static, dynamic = tiny_llama(), tiny_llama()
    fp8linear.quantize_model(static, "fp8", activations="static")
    fp8linear.quantize_model(dynamic, "fp8")
    report = fp8linear.calibrate(static, [{"input_ids": ids} for ids in batches])
    assert len(report.input_scales) == 14 and not report.uncalibrated
    assert all(isinstance(m.input_scale, torch.Tensor) and m.input_scale > 0
               for m in static.modules() if isinstance(m, FP8Linear))
    ids = torch.cat(batches[:2])
    reference, got = logits(dynamic, ids), logits(static, ids)
    assert ((got - reference).norm() / reference.norm()).item() < 0.05


def test_text_batches_drops_the_short_tail():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("a b c d e f g", add_special_tokens=False)["input_ids"]
    pieces = text_batches(tokenizer, "a b c d e f g", sequence_length=5)
    assert [p.tolist() for p in pieces] == [[ids[:5]]]
    assert [p.tolist() for p in text_batches(tokenizer, "a b", sequence_length=5)] == \
        [[tokenizer("a b", add_special_tokens=False)["input_ids"]]]
    with pytest.raises(ValueError, match="empty"):
        text_batches(tokenizer, "")
