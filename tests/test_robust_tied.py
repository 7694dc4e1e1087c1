"""Tied weights (issue 10, item A): quantize_model keeps a layer whose weight is tied to
another parameter, and save_quantized never writes a tie_word_embeddings that contradicts
the tensors it wrote."""
import json
import logging

import pytest
import torch

import fp8linear
from fp8linear import FP8Linear
from tiny_models import logits, relative_error, tiny_llama, tiny_tokenizer, token_ids


def test_quantize_model_keeps_a_tied_lm_head_and_says_why(caplog):
    model = tiny_llama(tie_word_embeddings=True)
    embedding = model.model.embed_tokens.weight
    before = fp8linear.memory_report(model)
    with caplog.at_level(logging.WARNING, logger="fp8linear"):
        fp8linear.quantize_model(model, "fp8", skip_modules=())
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is embedding
    reason = model.fp8linear_report.skipped["lm_head"]
    assert reason == "weight tied to ['model.embed_tokens.weight']"
    assert "could not convert lm_head: weight tied to ['model.embed_tokens.weight']" in caplog.text
    assert len(model.fp8linear_report.converted) == 14
    report = fp8linear.memory_report(model)
    assert report.converted_layers == 14 and report.other_linear_layers == 1
    assert report.other_linear_bytes == embedding.numel() * embedding.element_size()
    assert before.other_linear_layers == 15
    # memory went down: the tied matrix is still one tensor, not an fp8 copy beside it
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert total < sum(p.numel() * p.element_size() for p in tiny_llama(tie_word_embeddings=True).parameters())


def test_a_shared_module_is_not_mistaken_for_a_tied_weight():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    model.append(model[0])  # the same layer twice: one module, converted once
    fp8linear.quantize_model(model, "fp8", skip_modules=())
    assert isinstance(model[0], FP8Linear) and model[2] is model[0]
    assert model.fp8linear_report.skipped == {}


def test_saved_tied_model_keeps_the_tie_and_transformers_loads_it(tmp_path):
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(tie_word_embeddings=True)
    fp8linear.quantize_model(model, "fp8", skip_modules=())
    fp8linear.save_quantized(model, tmp_path, tokenizer=tiny_tokenizer())
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    reader = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = token_ids()
    quantization_error = relative_error(logits(model, ids), logits(tiny_llama(tie_word_embeddings=True), ids))
    assert relative_error(logits(reader, ids), logits(model, ids)) < quantization_error / 20


def test_an_untied_lm_head_is_saved_with_tie_word_embeddings_false(tmp_path):
    """A user converts the tied lm_head by hand: the written config must not say tied."""
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(tie_word_embeddings=True)
    fp8linear.quantize_model(model, "fp8")
    model.lm_head = FP8Linear.from_linear(model.lm_head)
    assert model.config.tie_word_embeddings is True
    fp8linear.save_quantized(model, tmp_path, tokenizer=tiny_tokenizer())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["quantization_config"]["ignore"] == []
    assert model.config.tie_word_embeddings is True  # the model's own config is not changed

    ids = token_ids()
    reader = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reader.lm_head.weight.dtype == torch.float8_e4m3fn
    quantization_error = relative_error(logits(model, ids), logits(tiny_llama(tie_word_embeddings=True), ids))
    assert relative_error(logits(reader, ids), logits(model, ids)) < quantization_error / 20
    loaded = fp8linear.load_quantized(tmp_path)
    assert isinstance(loaded.lm_head, FP8Linear)
    assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_embeddings_tied_by_hand_are_saved_with_tie_word_embeddings_true(tmp_path):
    """The other way round: tied tensors are written once, so the config must say tied."""
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    assert model.config.tie_word_embeddings is False
    fp8linear.quantize_model(model, "fp8")
    fp8linear.save_quantized(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = fp8linear.load_quantized(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = token_ids()
    assert torch.equal(logits(loaded, ids), logits(model, ids))
