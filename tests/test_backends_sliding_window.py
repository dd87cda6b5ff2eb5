"""Models whose attention layers slide (Mistral, Gemma-3, Qwen2 with a window, gpt-oss, Gemma 3n) or look at chunks
(Llama 4) decode speculatively past the window.

transformers' sliding cache layer drops entries older than the window and then cannot be cropped back, and a tree's
4-D mask is taken as given, without the window: speculative decoding crashed after the window (Gemma-3 at 512
tokens) and tree verification saw keys a plain step does not. The adapter keeps sliding layers whole and puts the
window into its own masks (backends/kvcache.py, backends/hf.py). Each model here has a window of 4 and decodes 40
tokens after a 12-token prompt, so every step but the first few is past it, and each case first checks that the
window changes the plain output (so an attention that ignored it would fail). Deterministic: no false-failure odds.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.backends.kvcache import BufferedCache, BufferedLayer, BufferedSlidingLayer
from jointspec.core.loop import SpeculativeDecoder
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import (
    assert_greedy_equivalent,
    greedy_by_methods,
    hf_greedy,
    random_prompt,
    tiny_gemma3,
    tiny_gemma3n,
    tiny_gpt_oss,
    tiny_llama4,
    tiny_qwen2,
)

WINDOW = 4  # tiny_gemma3's


# (name, the model, the same weights without a window, prompt seed): seeds where the window changes the output.
MODELS = {
    "every layer slides (Mistral's way)": (
        lambda: tiny_qwen2(1, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
        lambda: tiny_qwen2(1), 1),
    "one of two layers slides (Qwen2's max_window_layers)": (
        lambda: tiny_qwen2(1, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        lambda: tiny_qwen2(1), 1),
    "Gemma-3": (lambda: tiny_gemma3(0), lambda: tiny_gemma3(0, window=512), 0),
    # (its heads' learned sinks in every attention, and experts: an architecture of its own in transformers)
    "gpt-oss": (lambda: tiny_gpt_oss(0), lambda: tiny_gpt_oss(0, window=512), 0),
    # (its last layers read earlier layers' entries: their cache layers hold none, which keeping a tree's path skips)
    "Gemma 3n": (lambda: tiny_gemma3n(0), lambda: tiny_gemma3n(0, window=512), 0),
    # (chunks, not windows: a tree's mask must give each key to its own chunk's positions only)
    "Llama 4 (chunked attention)": (lambda: tiny_llama4(0), lambda: tiny_llama4(0, chunk=512), 0),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_chains_and_trees_match_plain_greedy_past_the_window(kind):
    make, unwindowed, seed = MODELS[kind]
    model, prompt = make(), random_prompt(seed)
    expected = hf_greedy(model, prompt, 40)
    assert expected != hf_greedy(unwindowed(), prompt, 40), "the window must matter for this case to test anything"
    ar, sps, specinfer = greedy_by_methods(model, prompt, 40)
    assert ar == expected
    assert sps == expected  # chains: the cache is cropped back past the window after every verification
    assert specinfer == expected  # trees: the window is in the tree's mask, by position


@pytest.mark.parametrize("method, tree", [("sps", None), ("specinfer", (2, 2))])
def test_eos_and_max_length_inside_a_draft_past_the_window(method, tree):
    model = tiny_gemma3(0)
    target = CausalLM(model, name="gemma3 target")
    config = MethodConfig(name=method, draft="self", tree=tree, cost_aware=False)  # a self-draft never pays otherwise
    drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
    assert_greedy_equivalent(model, SpeculativeDecoder(target, drafter, verifier), random_prompt(0))


def test_sliding_layers_are_kept_whole_and_crop_past_the_window():
    model = tiny_gemma3(0)
    cache = BufferedCache(model.config)
    assert [type(layer) for layer in cache.layers] == [BufferedSlidingLayer, BufferedSlidingLayer, BufferedLayer]
    assert cache.is_sliding == [True, True, False] and cache.sliding_window == WINDOW
    keys = torch.randn(1, 2, 10, 16)
    for layer in cache.layers:
        layer.update(keys, keys)
    cache.crop(-3)  # three entries off, back past the window: transformers' own sliding layer refuses this
    for layer in cache.layers:
        assert torch.equal(layer.keys, keys[:, :, :7])
        assert layer.get_mask_sizes(1) == (8, 0)  # every entry visible to the mask, which applies the window
