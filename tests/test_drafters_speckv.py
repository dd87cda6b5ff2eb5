"""The SpecKV-style approximate target (drafters/speckv.py) and the attention it reads (``CausalLM.attention_mass``).

What must hold: ``attention_mass`` is the model's own attention from the new rows to each cached token (checked
against transformers' eager attention weights, and on the compiled int4 layers against the Python layers of the same
model) and leaves the cache as it was; the selection keeps the sinks, the window and the best-scored positions with
their neighbours, at the capacity asked; every decoding forward of the target sees exactly that selection and what
came after the prompt; and since the selection is fixed for the answer, speculative methods on this approximate
target give its own plain decoding token for token. All checks are deterministic (fp32 tiny models with sharpened
logits, as tests/test_core_loop_equivalence.py argues; the int4 ones compute each row alone).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafters.approximate import with_attention
from jointspec.drafters.sparse_self import SparseView
from jointspec.drafters.speckv import LookaheadSelection, SpecKVTarget
from jointspec.kernels.grouped import float_inputs
from jointspec.kernels.quantize import quantize_model

from helpers import decode_greedy as decode
from helpers import grouped_llama, random_prompt, tiny_llama

# Sizes for tiny models: the lookahead's view and the selection leave out most of a 120-token prompt.
TINY_VIEW = SparseView(sinks=2, window=6, chunk=5, chunks=2, lead=1, min_ngram=1, min_context=8)
TINY_SELECTION = LookaheadSelection(lookahead=4, capacity=24, sinks=2, window=4, pool=3, min_context=8)


def test_attention_mass_is_the_models_attention_and_leaves_the_cache_as_it_was():
    model = tiny_llama(2, attn="eager")  # 4 query heads over 2 key heads: the grouping is checked too
    target = CausalLM(model)
    context = random_prompt(3, length=30)
    target.forward(context, num_logits=0)
    keys = [layer.keys.clone() for layer in target.cache.layers]
    mass = target.attention_mass([5, 6, 7])
    assert mass.shape == (2, 4, 30)
    with torch.no_grad():
        weights = model(input_ids=torch.tensor([context + [5, 6, 7]], device=model.device),
                        output_attentions=True).attentions
    expected = torch.stack([layer[0, :, 30:, :30].sum(1) for layer in weights])
    assert torch.allclose(mass, expected, atol=1e-6)
    assert target.num_cached == 30 and all(torch.equal(layer.keys, key) for layer, key in zip(target.cache.layers,
                                                                                             keys))
    fresh = CausalLM(model)
    fresh.forward(context, num_logits=0)
    assert torch.equal(target.forward([9]).logits, fresh.forward([9]).logits)


def test_attention_mass_on_the_compiled_layers_reads_each_layers_own_input():
    """The compiled int4 layers hand back every layer's input; the mass made from them must be the one the Python
    layers of the same quantised model give (to float rounding, with float inputs to the kernels)."""
    model = quantize_model(grouped_llama(3), "int4")
    context = random_prompt(4, length=40)
    masses = []
    with float_inputs():
        for compiled in (True, False):
            target = CausalLM(model)
            assert target.lean.compiled is not None
            if not compiled:
                target.lean.compiled = None  # the same modules, run one by one in Python
            target.forward(context, num_logits=0)
            masses.append(target.attention_mass([9, 10, 11]))
    assert torch.allclose(masses[0], masses[1], atol=1e-4)
    # The two layers' masses differ by far more than that tolerance, so a layer given another's input would show.
    assert (masses[0][0] - masses[0][1]).abs().max() > 1e-3


def test_the_selection_keeps_sinks_window_and_the_peaks_with_their_neighbours():
    mass = torch.full((2, 2, 100), 1e-3)
    mass[1, 0, 40] = 0.9
    mass[0, 1, 70] = 0.5
    mass[0, 0, 20] = 0.01  # a faint preference: kept only once the peaks are in
    kept = LookaheadSelection(capacity=12, sinks=2, window=4, pool=3).positions(mass)
    assert kept.tolist() == [0, 1, 39, 40, 41, 69, 70, 71, 96, 97, 98, 99]
    kept = LookaheadSelection(capacity=15, sinks=2, window=4, pool=3).positions(mass)
    assert {19, 20, 21} <= set(kept.tolist()) and len(kept) == 15
    assert LookaheadSelection(capacity=500, sinks=2, window=4).positions(mass).tolist() == list(range(100))
    # One head's sharp interest against every head's moderate one: the mean takes the second, the maximum the first.
    mass = torch.full((2, 2, 100), 1e-3)
    mass[0, 0, 30] = 0.5
    mass[:, :, 60] = 0.2
    for reduce, peak in (("mean", 60), ("max", 30)):
        kept = LookaheadSelection(capacity=5, sinks=1, window=1, pool=3, reduce=reduce).positions(mass)
        assert kept.tolist() == [0, peak - 1, peak, peak + 1, 99]
    with pytest.raises(ValueError, match="pool must be odd"):
        LookaheadSelection(pool=4)
    with pytest.raises(ValueError, match="reduce must be"):
        LookaheadSelection(reduce="sum")
    with pytest.raises(ValueError, match="exceed capacity"):
        LookaheadSelection(capacity=10, sinks=8, window=8)


def test_the_target_decodes_over_its_selection_and_what_follows_the_prompt():
    model = tiny_llama(0)
    prompt = random_prompt(5, length=120)
    target = SpecKVTarget(CausalLM(model), TINY_SELECTION, TINY_VIEW)
    out = decode(target, prompt, max_new_tokens=20)
    kept, end = target._kept, target._prompt_end
    assert end == len(prompt) - 1 and len(kept) == TINY_SELECTION.capacity
    assert kept[:2].tolist() == [0, 1] and kept[-4:].tolist() == list(range(end - 4, end))
    # The same tokens by hand: plain decoding where each step sees the selection and everything after the prompt.
    reference = CausalLM(model)
    reference.forward(prompt[:-1], num_logits=0)
    sequence = list(prompt)
    for _ in range(20):
        seen = torch.cat([kept, torch.arange(end, reference.num_cached)])
        sequence.append(int(reference.forward([sequence[-1]], attend_to=seen).logits[-1].argmax()))
    assert out == sequence[len(prompt):]
    full = CausalLM(model)  # and the selection matters: the first step's logits with the whole cache differ
    full.forward(prompt[:-1], num_logits=0)
    reference.crop(end)
    assert not torch.allclose(full.forward(prompt[-1:]).logits, reference.forward(prompt[-1:], attend_to=kept).logits,
                              atol=1e-3)


def test_below_min_context_it_is_the_target_itself():
    model = tiny_llama(0)
    prompt = random_prompt(6, length=60)
    target = SpecKVTarget(CausalLM(model), LookaheadSelection(min_context=10 ** 6))
    assert decode(target, prompt) == decode(CausalLM(model), prompt) and target._kept is None


def test_an_answer_growing_past_min_context_keeps_the_whole_cache():
    """The choice is made once, when decoding starts: a short prompt whose answer crosses min_context is decoded
    exactly, by plain and speculative decoding alike (a choice made at the crossing would fall on different forwards
    for the two)."""
    model = tiny_llama(0)
    prompt = (random_prompt(7, length=40) * 3)[:110]
    selection = dataclasses.replace(TINY_SELECTION, min_context=120)
    exact = decode(CausalLM(model), prompt, max_new_tokens=40)
    assert decode(SpecKVTarget(CausalLM(model), selection, TINY_VIEW), prompt, max_new_tokens=40) == exact
    assert decode(SpecKVTarget(CausalLM(model), selection, TINY_VIEW), prompt, "pld", max_new_tokens=40) == exact


@pytest.mark.parametrize("method, draft, tree", [("pld", None, None), ("sps", "self", None),
                                                 ("specinfer", "self", (2, 2))])
def test_speculative_methods_give_the_approximate_targets_own_plain_decoding(method, draft, tree):
    """The selection is fixed once decoding starts, so a verified draft's rows see what they see decoded one by one:
    lookup chains, model chains and trees (the draft a fork of the same approximate target) all give ``ar``'s tokens
    on this target, with drafts accepted."""
    model = tiny_llama(0)
    prompt = (random_prompt(7, length=40) * 3)[:110]  # repeats, so lookup drafts get accepted
    plain = decode(SpecKVTarget(CausalLM(model), TINY_SELECTION, TINY_VIEW), prompt)
    accepted = []
    assert decode(SpecKVTarget(CausalLM(model), TINY_SELECTION, TINY_VIEW), prompt, method, draft=draft, tree=tree,
                  accepted=accepted) == plain
    assert accepted[0] >= 10


def test_on_the_compiled_int4_layers_drafts_give_plain_decoding_too():
    model = quantize_model(grouped_llama(3), "int4")
    prompt = (random_prompt(8, length=40) * 3)[:110]
    plain = decode(SpecKVTarget(CausalLM(model), TINY_SELECTION, TINY_VIEW), prompt)
    accepted = []
    assert decode(SpecKVTarget(CausalLM(model), TINY_SELECTION, TINY_VIEW), prompt, "pld", accepted=accepted) == plain
    assert accepted[0] >= 5 and plain != decode(CausalLM(model), prompt)


def test_refusals_and_the_bench_option():
    from jointspec.bench.specs import MethodSpecError, parse_spec

    with pytest.raises(UnsupportedOptionError, match="Llama-family"):
        SpecKVTarget(CausalLM(tiny_llama(0), lean=False))
    with pytest.raises(ValueError, match="attention 'dense'"):
        with_attention(CausalLM(tiny_llama(0)), "dense")
    assert parse_spec("ar:attention=speckv").attention == "speckv"
    with pytest.raises(MethodSpecError, match="attention=speckv is for the torch backend"):
        parse_spec("ar:attention=speckv,backend=llamacpp")
