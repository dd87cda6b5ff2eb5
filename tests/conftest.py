"""Tiny random models built in process (fp32, CPU): no downloads, forward passes well under a millisecond.

Odd sizes (vocab 99, hidden 32, intermediate 37) catch shape mix-ups that round numbers hide.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jointspec.backends.hf import CausalLM

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


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Every test runs with one intra-op thread, restored afterwards. The tiny models run hundreds of
    sub-millisecond forwards, and on a shared 2-core machine a second thread spends more time synchronising than
    computing: a 40-token tiny decode took 6 s with 2 threads and 0.3 s with 1, and the real-model test 253 s vs 18 s
    under load."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


def greedy_by_methods(model, prompt: list[int], max_new_tokens: int,
                      methods=(("ar", None, None), ("sps", "self", None), ("specinfer", "self", (2, 2)))):
    """Greedy output of ``model`` on ``prompt`` under each (method, draft, tree): a chain and a tree method next to
    plain decoding, each on a fresh adapter."""
    from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
    from jointspec.methods import MethodConfig, MethodContext, build_method
    from jointspec.core.sampling import SamplingConfig

    outputs = []
    for name, draft, tree in methods:
        target = CausalLM(model, name=f"{name} target")
        drafter, verifier = build_method(MethodContext(MethodConfig(name=name, draft=draft, tree=tree), target, None,
                                                       load_draft=None))
        config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=0.0))
        outputs.append(SpeculativeDecoder(target, drafter, verifier).generate(prompt, config))
    return outputs
