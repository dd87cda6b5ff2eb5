"""The SpecPC-style approximate target (drafters/specpc.py): a long prompt read in part, chosen by a scorer's attention.

What must hold: the default scorer is the target's own first layers over the same weights (its attention is the full
model's in those layers, the model is left whole); the target reads exactly the sinks, the best-scored tokens and the
prompt's last window, as a prompt of its own, and decodes after it as a plain model that was given that shorter text
would; the loop keeps the full prompt's positions (crop, tree ``keep``); speculative methods on this target give its
own plain decoding token for token (drafts accepted, max length inside a draft); below ``min_context`` it is the
target itself. Deterministic checks: fp32 tiny models, or int4 ones that compute each row alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafters.approximate import with_attention
from jointspec.drafters.speckv import select_positions
from jointspec.drafters.specpc import PromptCompressedTarget, PromptCompression, leading_layers
from jointspec.kernels.quantize import quantize_model

from helpers import decode_greedy as decode
from helpers import grouped_llama, random_prompt, tiny_llama

# Sizes for tiny models: a 110-token prompt is read as 24 tokens.
TINY = PromptCompression(capacity=24, sinks=2, window=4, pool=3, scorer_layers=1, min_context=30)


def repeating_prompt(seed: int) -> list[int]:
    return (random_prompt(seed, length=40) * 3)[:110]  # repeats, so lookup drafts get accepted


def test_the_scorer_is_the_targets_first_layers_over_the_same_weights():
    model = tiny_llama(2, layers=3)
    target = CausalLM(model)
    scorer = leading_layers(target, 2)
    assert scorer.model.config.num_hidden_layers == 2 and len(scorer.model.model.layers) == 2
    assert model.config.num_hidden_layers == 3 and len(model.model.layers) == 3  # the model is left whole
    assert scorer.model.model.layers[1].mlp.up_proj.weight is model.model.layers[1].mlp.up_proj.weight
    context = random_prompt(3, length=30)
    target.forward(context, num_logits=0)
    scorer.forward(context, num_logits=0)
    full = target.attention_mass([5, 6, 7])
    mass = scorer.attention_mass([5, 6, 7])
    assert mass.shape == (2, 4, 30) and torch.allclose(mass, full[:2], atol=1e-6)
    with pytest.raises(ValueError, match="must be 1..3"):
        leading_layers(target, 4)


def test_the_target_reads_the_selected_tokens_as_a_prompt_of_their_own():
    model = tiny_llama(0)
    prompt = random_prompt(5, length=110)
    target = PromptCompressedTarget(CausalLM(model), TINY)
    out = decode(target, prompt, max_new_tokens=20)
    kept = target.kept
    read = len(prompt) - 1
    assert len(kept) == TINY.capacity and target.inner.num_cached == TINY.capacity + 20
    assert kept[:2].tolist() == [0, 1] and kept[-4:].tolist() == list(range(read - 4, read))
    # The selection is the scorer's: its attention from the last window to the rest, chosen as SpecKV's would be.
    scorer = leading_layers(CausalLM(model), 1)
    scorer.forward(prompt[:read - 4], num_logits=0)
    mass = scorer.attention_mass(prompt[read - 4:read])
    chosen = select_positions(mass, capacity=20, sinks=2, window=0, pool=3, reduce="mean")
    assert kept[:-4].tolist() == chosen.tolist()
    # The same tokens by hand: the model given the kept tokens and the last prompt token as its prompt.
    shorter = [prompt[i] for i in kept.tolist()] + prompt[-1:]
    assert out == decode(CausalLM(model), shorter, max_new_tokens=20)
    assert out != decode(CausalLM(model), prompt, max_new_tokens=20)  # and leaving tokens out mattered


def test_the_loop_keeps_the_full_prompts_positions():
    model = tiny_llama(0)
    prompt = random_prompt(6, length=110)
    target = PromptCompressedTarget(CausalLM(model), TINY)
    target.forward(prompt, num_logits=0)
    assert target.num_cached == 110 and target.inner.num_cached == TINY.capacity
    target.forward([3, 4, 5])
    target.crop(112)
    assert target.num_cached == 112 and target.inner.num_cached == TINY.capacity + 2
    with pytest.raises(ValueError, match="compressed prompt"):
        target.keep(list(range(50)) + [111])
    target.keep(list(range(110)) + [111])  # a tree's kept path: the prompt, then the second node
    assert target.num_cached == 111 and target._tokens[-1] == 4
    # A crop into the prompt reads what is left of the text whole: the model's own cache of those tokens.
    target.crop(50)
    reference = CausalLM(model)
    reference.forward(prompt[:50], num_logits=0)
    assert target.num_cached == 50 and torch.equal(target.forward([9]).logits, reference.forward([9]).logits)


def test_reading_reports_one_rising_series_over_both_reads(monkeypatch):
    """generate's bar: the scorer's read of the prompt, then the target's of what is kept, as one series of tokens
    read that only rises and ends full (in chunks of 16 here, so both reads report as they go)."""
    import jointspec.backends.hf as hf

    monkeypatch.setattr(hf, "PREFILL_CHUNK", 16)
    target = PromptCompressedTarget(CausalLM(tiny_llama(0)), TINY)
    reports = []
    target.prefill_progress = lambda done, total: reports.append((done, total))
    target.forward(random_prompt(5, length=110), num_logits=0)
    total = 110 - TINY.window + TINY.capacity
    assert {t for _, t in reports} == {total} and reports[-1] == (total, total)
    done = [d for d, _ in reports]
    assert done == sorted(done) and len(done) >= 110 // 16 + TINY.capacity // 16
    assert target.inner.prefill_progress is target.prefill_progress and target.scorer.prefill_progress is None


def test_below_min_context_it_is_the_target_itself():
    model = tiny_llama(0)
    prompt = random_prompt(6, length=60)
    target = PromptCompressedTarget(CausalLM(model), dataclasses.replace(TINY, min_context=10 ** 6))
    assert decode(target, prompt) == decode(CausalLM(model), prompt) and target.kept is None


@pytest.mark.parametrize("method, draft, tree", [("pld", None, None), ("sps", "self", None),
                                                 ("specinfer", "self", (2, 2))])
def test_speculative_methods_give_the_approximate_targets_own_plain_decoding(method, draft, tree):
    """Every forward after the prompt sees the same compressed prompt, so lookup chains, model chains and trees (the
    draft a fork of the same approximate target) give ``ar``'s tokens on it, drafts accepted, also where the length
    limit falls inside a draft."""
    model = tiny_llama(0)
    prompt = repeating_prompt(7)
    for max_new_tokens in (30, 13):
        plain = decode(PromptCompressedTarget(CausalLM(model), TINY), prompt, max_new_tokens=max_new_tokens)
        accepted = []
        assert decode(PromptCompressedTarget(CausalLM(model), TINY), prompt, method, max_new_tokens, draft, tree,
                      accepted) == plain
        assert accepted[0] >= 3


def test_on_the_compiled_int4_layers_drafts_give_plain_decoding_too():
    model = quantize_model(grouped_llama(3), "int4")
    target = PromptCompressedTarget(CausalLM(model), TINY)
    assert target.scorer.lean.compiled is not None and len(target.scorer.lean.compiled) == 1
    prompt = repeating_prompt(8)
    plain = decode(target, prompt)
    accepted = []
    assert decode(PromptCompressedTarget(CausalLM(model), TINY), prompt, "pld", accepted=accepted) == plain
    assert accepted[0] >= 5 and plain != decode(CausalLM(model), prompt)


def test_refusals_and_the_bench_option():
    from jointspec.bench.specs import MethodSpecError, parse_spec

    with pytest.raises(UnsupportedOptionError, match="Llama-family"):
        PromptCompressedTarget(CausalLM(tiny_llama(0), lean=False))
    with pytest.raises(UnsupportedOptionError, match="vocabulary"):
        PromptCompressedTarget(CausalLM(tiny_llama(0)), TINY, scorer=CausalLM(tiny_llama(1, vocab=64)))
    target = with_attention(CausalLM(tiny_llama(0, layers=6)), "specpc")
    assert isinstance(target, PromptCompressedTarget) and not target.capabilities.features
    assert target.scorer.model.config.num_hidden_layers == 2  # a quarter of the layers, rounded up
    with pytest.raises(ValueError, match="must be 1..2"):
        PromptCompressedTarget(CausalLM(tiny_llama(0)), dataclasses.replace(TINY, scorer_layers=3))
    with pytest.raises(UnsupportedOptionError, match="trained heads"):
        target.attach_feature_mirror()
    with pytest.raises(ValueError, match="below capacity"):
        PromptCompression(capacity=10, sinks=6, window=4)
    with pytest.raises(ValueError, match="must exceed capacity"):
        PromptCompression(capacity=100, min_context=100)
    assert parse_spec("ar:attention=specpc").attention == "specpc"
    with pytest.raises(MethodSpecError, match="attention=specpc is for the torch backend"):
        parse_spec("ar:attention=specpc,backend=llamacpp")
