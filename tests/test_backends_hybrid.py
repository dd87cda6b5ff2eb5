"""Hybrid models, whose layers keep state besides keys and values (transformers' linear-attention cache layers).

LFM2's short convolutions keep their last few inputs, which a crop can give back: the adapter records them past each
forward and cuts them back at every crop, so chains decode speculatively there, rejected drafts included, and give
plain greedy decoding's tokens; a tree's branches cannot share one convolution state, so trees are refused with the
reason. Granite 4's Mamba layers (and Qwen3.5's and Qwen3-Next's linear attention) keep a recurrent state that every
token changes for good: no draft can be taken back, so every drafting method is refused with the reason, `default`
decodes without drafts, and the cache refuses a crop. Until this, the first rejected draft (or any tree) raised deep
inside transformers. Deterministic: no false-failure odds.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from jointspec.backends.hf import CausalLM
from jointspec.backends.kvcache import ROLLBACK_ROOM
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import LockstepEngine, engine_for
from jointspec.core.draft import NoDrafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import SpeculativeDecoder
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.methods.oracle import OracleConfig

from helpers import (
    BATCH_GREEDY,
    BATCH_PROMPTS,
    VOCAB,
    assert_greedy_equivalent,
    greedy,
    hf_greedy,
    random_prompt,
    tiny_falcon_h1,
    tiny_granite4,
    tiny_lfm2,
)


@pytest.mark.parametrize("seed", [0, 3])
def test_lfm2_decodes_chains_with_rejected_drafts_as_plain_greedy_decoding(seed):
    """The oracle drafts the target's own greedy continuation with a third of its tokens corrupted: drafts are kept
    up to a corrupted token and rejected there, so the convolutions' state is taken back in most rounds."""
    model = tiny_lfm2(0)
    target = CausalLM(model, name="lfm2")
    config = OracleConfig(num_draft_tokens=4, corruption_rate=0.3, corruption_seed=seed)
    drafter, verifier = build_method(MethodContext(config, target, None, None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    prompt = random_prompt(seed)
    assert_greedy_equivalent(model, decoder, prompt)
    decoder.generate(prompt, greedy(40))
    stats = decoder.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts must be kept and rejected"
    # default's cost curve crops a measured forward back to nothing; it decodes as plain greedy decoding too
    drafter, verifier = build_method(MethodContext(MethodConfig("default"), target, None, None))
    assert SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(40)) == hf_greedy(model, prompt, 40)


def test_lfm2s_recorded_inputs_stay_bounded_and_a_crop_past_them_is_refused():
    """The convolutions record their inputs past each forward, for a crop to take back: as far back as
    ROLLBACK_ROOM tokens, not a long prompt's every input; a crop further back than that is refused, not made
    wrong."""
    model = tiny_lfm2(0, max_positions=1024)
    target = CausalLM(model, name="lfm2")
    prompt = list(range(3, 63)) * 10  # 600 tokens in one forward
    target.forward(prompt)
    assert all(state.shape[-1] <= layer.conv_kernel_size[index] + ROLLBACK_ROOM
               for layer in target.cache.convolutions for index, state in layer.conv_states.items())
    with pytest.raises(UnsupportedOptionError, match="keep the inputs of their last 256 tokens at most"):
        target.crop(600 - ROLLBACK_ROOM - 1)
    target.crop(600 - ROLLBACK_ROOM)  # (as far back as they reach: the next tokens read as after that prefix)
    expected = model(torch.tensor([prompt[:600 - ROLLBACK_ROOM] + [7]])).logits[0, -1]
    assert torch.allclose(target.forward([7]).logits[-1], expected, atol=1e-5)
    target.crop(0)  # (back to nothing, however far that is: no state at all, as a new sequence's)
    assert torch.allclose(target.forward([7]).logits[-1], model(torch.tensor([[7]])).logits[0, -1], atol=1e-5)


def test_lfm2_scores_chains_only_and_refuses_trees_with_the_reason():
    target = CausalLM(tiny_lfm2(0), name="lfm2")
    assert not target.capabilities.trees and not target.capabilities.no_rollback
    with pytest.raises(UnsupportedOptionError, match="lfm2's convolution or recurrent layers keep one state"):
        build_method(MethodContext(MethodConfig("specinfer", draft="self", tree=(2, 2)), target, None, None))
    target.forward(random_prompt(0))
    with pytest.raises(UnsupportedOptionError, match="only a prefix of the cached tokens can be kept"):
        target.keep([0, 1, 3])  # (a tree's accepted path, its sibling dropped)


@pytest.mark.parametrize("make, kind", [(tiny_granite4, "granitemoehybrid"), (tiny_falcon_h1, "falcon_h1")])
def test_a_recurrent_hybrid_refuses_drafting_methods_and_default_decodes_without_drafts(make, kind, caplog):
    """Granite 4's Mamba layers have cache layers of their own; Falcon-H1's share one with attention. `default` says
    once a model that it decodes without drafts (a server builds a method for every request)."""
    model = make(0)
    target = CausalLM(model, name="recurrent")
    assert f"{kind}: its state-space or linear-attention layers keep a recurrent state" in \
        target.capabilities.no_rollback
    for config in (MethodConfig("pld"), MethodConfig("sps", draft="self"), MethodConfig("hybrid", draft="self"),
                   OracleConfig(num_draft_tokens=4, corruption_rate=0.3)):
        with pytest.raises(UnsupportedOptionError, match="cannot take a rejected draft back"):
            build_method(MethodContext(config, target, None, None))
    drafter, verifier = build_method(MethodContext(MethodConfig("default"), target, None, None))
    build_method(MethodContext(MethodConfig("default"), CausalLM(model, name="again"), None, None))
    assert isinstance(drafter, NoDrafter)
    assert caplog.text.count("decoding without drafts (method ar)") == 1
    prompt = random_prompt(0)
    assert SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(40)) == hf_greedy(model, prompt, 40)
    with pytest.raises(UnsupportedOptionError, match="cannot take 1 tokens back out of this cache"):
        target.crop(target.num_cached - 1)


@pytest.mark.parametrize("make", [tiny_lfm2, tiny_granite4])
def test_the_server_engine_serves_a_hybrid_model_each_request_its_own_tokens(make):
    """No ragged cache holds their layers: the engine falls back to lockstep, one loop per request. With a prompt
    cache (serve's default), requests that share a prompt's beginning each get their own tokens: the cache keeps no
    hybrid's caches, whose states its keys and values would not carry."""
    target = CausalLM(make(0), name="hybrid")
    config = MethodConfig("default")
    engine = engine_for(target, method=config, max_batch_size=4, prompt_cache_bytes=1 << 24)
    assert isinstance(engine, LockstepEngine)
    shared = [list(BATCH_PROMPTS[0]) + list(p[:3]) for p in BATCH_PROMPTS[:3]]
    prompts = [*BATCH_PROMPTS[:4], *shared]
    out = engine.generate([BatchRequest(tuple(p), BATCH_GREEDY, config) for p in prompts[:4]])
    out += engine.generate([BatchRequest(tuple(p), BATCH_GREEDY, config) for p in prompts[4:]])
    alone = CausalLM(target.model, name="alone")
    assert out == [SpeculativeDecoder(alone, NoDrafter(), build_method(MethodContext(
        MethodConfig("ar"), alone, None, None))[1]).generate(list(p), BATCH_GREEDY) for p in prompts]


@pytest.mark.parametrize("make, why", [
    (lambda: transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8,
                                                                   num_hidden_layers=2)),
     "mamba keeps its state in an argument of its own"),
    (lambda: transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=64, attention_window_size=16, conv1d_width=4)),
     "recurrent_gemma keeps some layers' state outside transformers' cache"),
])
def test_a_model_whose_state_lives_outside_transformers_cache_is_refused_at_once(make, why):
    """Mamba reads its state from an argument of its own, RecurrentGemma keeps it on its modules: jointspec's cache
    holds neither (Mamba's plain decoding gave other tokens than its own greedy decoding; RecurrentGemma's one state
    would be shared by every sequence and fork of the model), so the adapter refuses them."""
    with pytest.raises(UnsupportedOptionError, match=why):
        CausalLM(make().eval())


def test_a_recurrent_draft_model_is_refused_when_the_method_is_built():
    target = CausalLM(tiny_lfm2(0), name="target")
    recurrent = CausalLM(tiny_granite4(0), name="draft")
    context = MethodContext(MethodConfig("sps", draft="granite4", cost_aware=False), target, None,
                            lambda source: (recurrent, None))
    with pytest.raises(UnsupportedOptionError, match="draft model 'granite4' cannot take its rejected tokens back"):
        build_method(context)
