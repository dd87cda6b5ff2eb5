"""The lean Llama forward (backends/lean_forward.py) gives transformers' logits and hidden states bit for bit.

Every comparison is ``torch.equal`` between two adapters over the same weights, one on the lean forward and one on
transformers' forward, fed the same sequence of calls: a prefill, single-token steps, chains, trees (additive masks),
crops and tree ``keep``s. Deterministic: no false-failure odds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from jointspec.backends.hf import CausalLM
from jointspec.backends.lean_forward import LeanLlamaForward, lean_forward_for, unsupported_reason
from jointspec.core.loop import SpeculativeDecoder
from jointspec.kernels.fp32 import use_gqa_attention
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import VOCAB, greedy, greedy_by_methods, random_prompt, tiny_llama, tiny_qwen2


def both(model) -> tuple[CausalLM, CausalLM]:
    lean, stock = CausalLM(model, name="lean"), CausalLM(model, name="transformers", lean=False)
    assert lean.lean is not None and stock.lean is None
    return lean, stock


def same_calls(lean: CausalLM, stock: CausalLM, layers: tuple[int, ...] = (-1,)) -> int:
    """Drive both adapters through one script of calls; assert equal outputs at each; return the calls checked."""
    for adapter in (lean, stock):
        adapter.attach_feature_mirror(layers)
        adapter.reset()
    prompt = random_prompt(3, length=9)
    calls = [
        dict(token_ids=prompt, num_logits=0),  # prefill: no logits wanted
        dict(token_ids=[5], num_logits=None, output_hidden=True),  # a plain step
        dict(token_ids=[6, 7, 8], num_logits=None),  # a chain
        dict(token_ids=[9, 10, 11, 12], parents=[-1, 0, 0, 1], num_logits=None, output_hidden=True),  # a tree
        dict(token_ids=[13, 14], num_logits=1),
    ]
    for step, call in enumerate(calls):
        outs = [adapter.forward(**call) for adapter in (lean, stock)]
        assert torch.equal(outs[0].logits, outs[1].logits), f"call {step}: logits differ"
        assert outs[0].logits.shape[0] == (len(call["token_ids"]) if call["num_logits"] is None
                                           else call["num_logits"])
        if call.get("output_hidden"):
            assert torch.equal(outs[0].hidden, outs[1].hidden), f"call {step}: hidden states differ"
        assert torch.equal(lean.mirrors[0].features, stock.mirrors[0].features), f"call {step}: mirrors differ"
        if step == 3:  # keep the tree's path 0 -> 1 -> 3 and continue from there
            kept = list(range(lean.num_cached - 4)) + [lean.num_cached - 4 + i for i in (0, 1, 3)]
            for adapter in (lean, stock):
                adapter.keep(kept)
        if step == 2:
            for adapter in (lean, stock):
                adapter.crop(adapter.num_cached - 2)
    for layer, (a, b) in enumerate(zip(lean.cache.layers, stock.cache.layers)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"layer {layer}: caches differ"
    return len(calls)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "gqa"])
def test_lean_forward_equals_transformers_bit_for_bit(attn):
    model = tiny_llama(0, layers=3, attn="sdpa" if attn == "gqa" else attn, device="cpu")
    if attn == "gqa":
        assert use_gqa_attention(model)
    # Hidden states the way a fused EAGLE head asks for them: the embeddings, a middle layer and the final norm.
    assert same_calls(*both(model), layers=(0, 2, -1)) == 5


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_lean_forward_runs_quantised_layers_and_their_attention(mode):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = quantize_model(LlamaForCausalLM(config).eval(), mode)
    same_calls(*both(model))


def test_lean_and_transformers_forward_decode_the_same_tokens(target_model):
    """Whole greedy decodes through the loop (a tree method and plain decoding) give the same tokens either way."""
    prompt = random_prompt(0)
    outputs = {}
    for lean in (True, False):
        for method in ("ar", "specinfer"):
            target = CausalLM(target_model, name="tiny-target", lean=lean)
            config = MethodConfig(name=method, draft="self", tree=(2, 2))
            drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
            outputs[lean, method] = SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(30))
    assert len(outputs[True, "ar"]) == 30
    assert outputs[True, "ar"] == outputs[False, "ar"] == outputs[True, "specinfer"] == outputs[False, "specinfer"]


def test_models_other_than_transformers_llama_take_transformers_forward():
    class MyLlama(LlamaForCausalLM):
        pass

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    assert "MyLlama" in unsupported_reason(MyLlama(config).eval())
    llama = LlamaForCausalLM(config)
    assert "training" in unsupported_reason(llama.train())
    llama.eval()
    llama.model.layers[0].mlp = torch.nn.Identity()
    assert "Identity replaces transformers' LlamaMLP" in unsupported_reason(llama)
    with pytest.raises(ValueError, match="LlamaMLP"):
        LeanLlamaForward(llama)


def test_mistral_takes_the_lean_forward_bit_for_bit_and_its_sliding_window_does_not():
    """Mistral is Llama's forward but for an optional window (7B v0.1's 4,096, MistralConfig's default; later Mistral
    models have none)."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    model = MistralForCausalLM(MistralConfig(sliding_window=None, **sizes)).eval()
    assert same_calls(*both(model)) == 5
    # On the grouped int4 layers (every width a multiple of 64) it runs the compiled layers, each row alone.
    grouped = quantize_model(MistralForCausalLM(MistralConfig(sliding_window=None, **{**sizes, "intermediate_size": 128}
                                                              )).eval(), "int4")
    assert CausalLM(grouped).lean.compiled is not None
    ar, sps, specinfer = greedy_by_methods(grouped, random_prompt(0), 30)
    assert len(ar) == 30 and sps == ar and specinfer == ar
    windowed = MistralForCausalLM(MistralConfig(**sizes)).eval()
    assert unsupported_reason(windowed) == "sliding-window attention layers"
    assert lean_forward_for(windowed) is None and CausalLM(windowed).lean is None


def test_qwen2_takes_the_lean_forward_bit_for_bit_and_sliding_windows_do_not():
    model = tiny_qwen2(0)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert same_calls(*both(model)) == 5
    windowed = tiny_qwen2(0, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert unsupported_reason(windowed) == "sliding-window attention layers"
    assert CausalLM(windowed).lean is None
