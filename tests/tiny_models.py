"""Small transformers models and a tokenizer built locally (nothing is downloaded), and the
comparisons the checkpoint, calibration, compile and command-line tests share."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fp8linear import FP8Linear

VOCAB = 320


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A 2-layer Llama with random weights (GQA, unaligned intermediate size), in eval mode."""
    transformers = pytest.importorskip("transformers")
    options = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config = transformers.LlamaConfig(**{**options, **overrides})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def token_ids(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference.double()).norm() / reference.double().norm()).item()


def fp8_layers(model) -> dict[str, FP8Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, FP8Linear)}


def same_state(a: nn.Module, b: nn.Module) -> bool:
    """Equal names, shapes, dtypes and values; 1-byte (fp8) tensors are compared as bytes."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape
        and torch.equal(sa[k].view(torch.uint8) if sa[k].element_size() == 1 else sa[k],
                        sb[k].view(torch.uint8) if sb[k].element_size() == 1 else sb[k]) for k in sa)


def english_text() -> str:
    """English prose shipped with CPython (the pydoc topic help texts)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([english_text()[:100_000]], trainer)
    return tokenizer.to_str()


def tiny_tokenizer():
    """A byte-level BPE tokenizer with VOCAB tokens, trained in milliseconds on english_text()."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json()),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")
