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

from jointspec.backends.hf import CausalLM
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
    assert_greedy_equivalent,
    greedy,
    hf_greedy,
    random_prompt,
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
    # the convolutions' recorded inputs are cut back at every round, not kept for the whole answer
    assert all(state.shape[-1] <= layer.conv_kernel_size[index]
               for layer in target.cache.convolutions for index, state in layer.conv_states.items())


def test_lfm2_scores_chains_only_and_refuses_trees_with_the_reason():
    target = CausalLM(tiny_lfm2(0), name="lfm2")
    assert not target.capabilities.trees and not target.capabilities.no_rollback
    with pytest.raises(UnsupportedOptionError, match="lfm2's convolution or recurrent layers keep one state"):
        build_method(MethodContext(MethodConfig("specinfer", draft="self", tree=(2, 2)), target, None, None))
    target.forward(random_prompt(0))
    with pytest.raises(UnsupportedOptionError, match="only a prefix of the cached tokens can be kept"):
        target.keep([0, 1, 3])  # (a tree's accepted path, its sibling dropped)


def test_a_recurrent_hybrid_refuses_drafting_methods_and_default_decodes_without_drafts():
    model = tiny_granite4(0)
    target = CausalLM(model, name="granite4")
    assert "granitemoehybrid: its state-space or linear-attention layers keep a recurrent state" in \
        target.capabilities.no_rollback
    for config in (MethodConfig("pld"), MethodConfig("sps", draft="self"), MethodConfig("hybrid", draft="self")):
        with pytest.raises(UnsupportedOptionError, match="cannot take a rejected draft back"):
            build_method(MethodContext(config, target, None, None))
    drafter, verifier = build_method(MethodContext(MethodConfig("default"), target, None, None))
    assert isinstance(drafter, NoDrafter)
    prompt = random_prompt(0)
    assert SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(40)) == hf_greedy(model, prompt, 40)
    with pytest.raises(UnsupportedOptionError, match="cannot take tokens back out of this cache"):
        target.crop(target.num_cached - 1)


@pytest.mark.parametrize("make", [tiny_lfm2, tiny_granite4])
def test_the_server_engine_serves_a_hybrid_model_each_request_its_own_tokens(make):
    """No ragged cache holds their layers: the engine falls back to lockstep, one loop per request."""
    target = CausalLM(make(0), name="hybrid")
    config = MethodConfig("default")
    engine = engine_for(target, method=config, max_batch_size=4)
    assert isinstance(engine, LockstepEngine)
    out = engine.generate([BatchRequest(tuple(p), BATCH_GREEDY, config) for p in BATCH_PROMPTS[:4]])
    alone = CausalLM(target.model, name="alone")
    assert out == [SpeculativeDecoder(alone, NoDrafter(), build_method(MethodContext(
        MethodConfig("ar"), alone, None, None))[1]).generate(list(p), BATCH_GREEDY) for p in BATCH_PROMPTS[:4]]
