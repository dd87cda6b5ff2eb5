"""Tiny random models built in process (fp32, CPU): no downloads, forward passes well under a millisecond.

Odd sizes (vocab 99, hidden 32, intermediate 37) catch shape mix-ups that round numbers hide.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jointspec.models.adapter import CausalLM

VOCAB = 99


def tiny_llama(seed: int, *, vocab: int = VOCAB, layers: int = 2, max_positions: int = 256,
               attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    # Random init gives nearly flat logits; sharpen them so greedy ties and near-ties are vanishingly rare.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def target_model() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="session")
def other_model() -> LlamaForCausalLM:
    return tiny_llama(1)


@pytest.fixture()
def target(target_model) -> CausalLM:
    return CausalLM(target_model, name="tiny-target")


@pytest.fixture()
def other(other_model) -> CausalLM:
    return CausalLM(other_model, name="tiny-other")
