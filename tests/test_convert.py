"""quantize_model: swapping layers in existing models (torch modules and a transformers Llama)."""
import logging

import pytest
import torch
from torch import nn

import fp8linear
from fp8linear import FP8Linear
from test_linear import sqnr_db


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, width=64, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.tied = self.blocks[0].up  # the same module reachable twice
        self.lm_head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = x + self.attention(x, x, x, need_weights=False)[0]
        return self.lm_head(x)


def test_converts_nested_layers_and_keeps_shared_modules_shared(caplog):
    model = Model()
    x = torch.randn(2, 5, 64)
    expected = model(x)
    with caplog.at_level(logging.INFO, logger="fp8linear"):
        returned = fp8linear.quantize_model(model, "fp8", weight_granularity="channel", activation_granularity="token")
    assert returned is model
    assert all(isinstance(b.up, FP8Linear) and isinstance(b.down, FP8Linear) for b in model.blocks)
    assert model.tied is model.blocks[0].up
    assert type(model.lm_head) is nn.Linear  # skipped by default
    assert type(model.attention.out_proj) is not FP8Linear  # an nn.Linear subclass MHA reads directly
    report = model.fp8linear_report
    assert len(report.converted) == 6
    assert report.skipped["lm_head"] == "listed in skip_modules"
    assert "subclass" in report.skipped["attention.out_proj"]
    assert "could not convert attention.out_proj" in caplog.text and "converted 6" in caplog.text
    assert sqnr_db(expected, model(x)) >= 25


def test_none_changes_nothing_and_unknown_is_refused():
    model = Model()
    assert fp8linear.quantize_model(model, None) is model
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    with pytest.raises(ValueError, match=r"quantization must be one of \['fp8'\]"):
        fp8linear.quantize_model(model, "int4")
    with pytest.raises(ValueError, match="weight_granularity must be one of"):
        fp8linear.quantize_model(model, "fp8", weight_granularity="row")


def test_skip_modules_and_filter_fn():
    model = Model()
    fp8linear.quantize_model(model, "fp8", skip_modules=("down",), filter_fn=lambda m, fqn: not fqn.startswith("blocks.2"))
    assert isinstance(model.lm_head, FP8Linear)
    assert type(model.blocks[0].down) is nn.Linear and isinstance(model.blocks[0].up, FP8Linear)
    assert type(model.blocks[2].up) is nn.Linear
    assert model.fp8linear_report.skipped["blocks.2.up"] == "filter_fn returned False"


def test_meta_weights_are_reported_not_converted():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    fp8linear.quantize_model(model, "fp8")
    assert type(model[0]) is nn.Linear
    assert "meta" in model.fp8linear_report.skipped["0"]


def test_a_failure_part_way_leaves_the_model_untouched(monkeypatch):
    model = Model()
    original = {name: module for name, module in model.named_modules()}
    calls = []

    def failing_from_linear(linear, **options):
        calls.append(linear)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return FP8Linear(linear.in_features, linear.out_features)

    monkeypatch.setattr(FP8Linear, "from_linear", staticmethod(failing_from_linear))
    with pytest.raises(RuntimeError, match="out of memory"):
        fp8linear.quantize_model(model, "fp8")
    assert {name: module for name, module in model.named_modules()} == original


def test_memory_halved_after_conversion():
    model = Model(width=256).to(torch.bfloat16)
    fp8linear.quantize_model(model, "fp8")
    report = fp8linear.memory_report(model)
    assert report.converted_layers == 6 and report.ratio <= 0.51
    assert report.other_linear_layers == 2  # lm_head and MHA's out_proj
    assert "6 FP8Linear layers" in str(report)


def test_transformers_llama_from_a_small_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 320, (4, 32))
    with torch.no_grad():
        expected = model(ids).logits
        fp8linear.quantize_model(model, "fp8", weight_granularity="channel", activation_granularity="token")
        got = model(ids).logits
    converted = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer; lm_head kept
    assert sqnr_db(expected, got) >= 25
    # random weights give near-uniform logits, so compare argmax only where the reference is decisive
    top2 = expected.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 0.5 * expected.std()
    assert decisive.sum() >= 5
    assert torch.equal(expected.argmax(-1)[decisive], got.argmax(-1)[decisive])
    with torch.no_grad():
        generated = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
