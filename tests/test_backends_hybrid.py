"""Hybrid models, whose layers keep state besides keys and values (transformers' linear-attention cache layers).

LFM2's short convolutions keep their last few inputs, which a crop can give back: the adapter records them past each
forward and cuts them back at every crop, so chains decode speculatively there, rejected drafts included, and give
plain greedy decoding's tokens; a tree's branches cannot share one convolution state, so trees are refused with the
reason. Granite 4's and Falcon-H1's Mamba layers, and Qwen3.5's and Qwen3-Next's linear attention, keep a recurrent
state that every token changes for good: the adapter copies it before each forward, a crop puts a copy back, and the
next forward reads the kept tokens after it again (backends/recurrent.py). Chains then decode speculatively there too,
rejected drafts and recurrent draft models included. Deterministic: no false-failure odds. The references are
transformers' own greedy decoding, which reads one token a forward where a verification reads several: the two
agree to rounding, so a model whose top two logits came within it could differ; these models and prompts have no such
near-tie.
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
    lasting_state,
    random_prompt,
    tiny_falcon_h1,
    tiny_granite4,
    tiny_lfm2,
    tiny_qwen3_5,
    tiny_qwen3_next,
)

RECURRENT = [tiny_granite4, tiny_falcon_h1, tiny_qwen3_5, tiny_qwen3_next]


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


def test_lfm2s_recorded_inputs_stay_bounded_and_a_crop_past_them_reads_the_kept_tokens_again():
    """The convolutions record their inputs past each forward, for a crop to take back: as far back as
    ROLLBACK_ROOM tokens, not a long prompt's every input (transformers convolves all of them at every step); a crop
    further back than that reads the kept tokens again, and is as right."""
    model = tiny_lfm2(0, max_positions=1024)
    target = CausalLM(model, name="lfm2")
    prompt = list(range(3, 63)) * 10  # 600 tokens in one forward
    target.forward(prompt)
    assert all(state.shape[-1] <= layer.conv_kernel_size[index] + ROLLBACK_ROOM
               for layer in target.cache.convolutions for index, state in layer.conv_states.items())
    target.crop(600 - ROLLBACK_ROOM)  # (as far back as they reach: the next tokens read as after that prefix)
    assert not target.states.replay
    expected = model(torch.tensor([prompt[:600 - ROLLBACK_ROOM] + [7]])).logits[0, -1]
    assert torch.allclose(target.forward([7]).logits[-1], expected, atol=1e-5)
    target.crop(500)  # (further: the 500 tokens are read again at the next forward)
    assert target.states.replay == prompt[:500] and target.cache.get_seq_length() == 0
    expected = model(torch.tensor([prompt[:500] + [7]])).logits[0, -1]
    assert torch.allclose(target.forward([7]).logits[-1], expected, atol=1e-5)
    target.crop(0)  # (back to nothing, however far that is: no state at all, as a new sequence's)
    assert torch.allclose(target.forward([7]).logits[-1], model(torch.tensor([[7]])).logits[0, -1], atol=1e-5)


def test_lfm2_scores_chains_only_and_refuses_trees_with_the_reason():
    target = CausalLM(tiny_lfm2(0), name="lfm2")
    assert not target.capabilities.trees
    with pytest.raises(UnsupportedOptionError, match="lfm2's convolution or recurrent layers keep one state"):
        build_method(MethodContext(MethodConfig("specinfer", draft="self", tree=(2, 2)), target, None, None))
    target.forward(random_prompt(0))
    with pytest.raises(UnsupportedOptionError, match="only a prefix of the cached tokens can be kept"):
        target.keep([0, 1, 3])  # (a tree's accepted path, its sibling dropped)


@pytest.mark.parametrize("make", RECURRENT)
@pytest.mark.parametrize("seed", [0, 3])
def test_a_recurrent_hybrid_decodes_chains_with_rejected_drafts_as_plain_greedy_decoding(make, seed):
    """As the LFM2 test above: a third of the oracle's tokens corrupted, so most rounds take part of a draft back out
    of the recurrent states; also with max length and EOS inside a draft (assert_greedy_equivalent)."""
    model = make(0)
    target = CausalLM(model, name="recurrent")
    config = OracleConfig(num_draft_tokens=4, corruption_rate=0.3, corruption_seed=seed)
    decoder = SpeculativeDecoder(target, *build_method(MethodContext(config, target, None, None)))
    prompt = random_prompt(seed)
    assert_greedy_equivalent(model, decoder, prompt)
    decoder.generate(prompt, greedy(40))
    stats = decoder.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts must be kept and rejected"
    # the loop never takes a kept token back: the copies before the kept length are let go of, round by round
    assert 1 <= len(target.states.snapshots) <= 2


@pytest.mark.parametrize("make, k", [(tiny_granite4, 4), (tiny_qwen3_5, 4), (tiny_granite4, 50)])
def test_what_a_round_reads_again_stays_what_the_round_before_kept(make, k):
    """Every draft rejected (the oracle's tokens all corrupted): each round keeps only the pending token, which the
    next forward reads again with its own. The copy for the next crop is the state between the two (the layers hand it
    back), so no forward reads more than 1 + 1 + k tokens; before, the tokens read again grew by one a round. A draft
    of 50 reaches back past ROLLBACK_ROOM: the convolutions keep their inputs back to the oldest copy."""
    model = make(0)
    target = CausalLM(model, name="recurrent")
    lengths = []
    forward = target._forward
    target._forward = lambda token_ids, *rest: lengths.append(len(token_ids)) or forward(token_ids, *rest)
    config = OracleConfig(num_draft_tokens=k, corruption_rate=1.0)
    decoder = SpeculativeDecoder(target, *build_method(MethodContext(config, target, None, None)))
    prompt = random_prompt(3)
    assert decoder.generate(prompt, greedy(80)) == hf_greedy(model, prompt, 80)
    assert decoder.stats.num_accepted_tokens == 0 and decoder.stats.num_rounds == 80
    assert max(lengths[1:]) == 2 + k, lengths  # (after the prompt's forward)


def test_a_forward_that_fails_leaves_the_counts_as_they_were():
    model = tiny_qwen3_5(0)
    target = CausalLM(model, name="recurrent")
    tokens = random_prompt(0, 20)
    target.forward(tokens[:12], num_logits=0)
    target.forward(tokens[12:16])
    target.crop(14)  # (two tokens to read again)
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5} is outside the model's vocabulary"):
        target.forward([VOCAB + 5])
    with pytest.raises(ValueError, match="at least one token"):
        target.forward([])
    assert target.num_cached == 14 and target.states.replay == tokens[12:14]
    out = target.forward(tokens[14:17])
    with torch.inference_mode():
        whole = model(torch.tensor([tokens[:17]])).logits[0, 14:]
    assert out.logits.shape[0] == 3 and torch.allclose(out.logits, whole, atol=1e-5)
    # a failure inside the model (its last layer: the others have written the cache): all read again
    layer = model.model.layers[-1]
    original = layer.forward
    layer.forward = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("inside the model"))
    with pytest.raises(RuntimeError, match="inside the model"):
        target.forward(tokens[17:19])
    layer.forward = original
    assert target.num_cached == 17 and target.states.replay == tokens[:17]
    out = target.forward(tokens[17:19])
    with torch.inference_mode():
        whole = model(torch.tensor([tokens[:19]])).logits[0, 17:]
    assert torch.allclose(out.logits, whole, atol=1e-5)


@pytest.mark.parametrize("make", [tiny_granite4, tiny_qwen3_5])
@pytest.mark.parametrize("method", ["pld", "default", "sps"])
def test_drafting_methods_on_a_recurrent_hybrid_give_plain_greedy_decoding(make, method):
    """`sps` drafts with the model itself (a fork): a draft model that is recurrent too, which drafts a token a
    forward and takes several forwards back after a rejection."""
    model = make(0)
    target = CausalLM(model, name="recurrent")
    config = MethodConfig(method, draft="self" if method == "sps" else None, num_draft_tokens=4,
                          cost_aware=None if method == "default" else False)
    decoder = SpeculativeDecoder(target, *build_method(MethodContext(config, target, None, None)))
    for seed in (0, 1, 5):
        prompt = random_prompt(seed)
        assert decoder.generate(prompt, greedy(40)) == hf_greedy(model, prompt, 40), (method, seed)


@pytest.mark.parametrize("make", RECURRENT)
def test_a_crop_puts_the_recurrent_states_back_and_the_next_forward_reads_the_kept_tokens_again(make):
    """Against the model run from scratch on the kept tokens: the logits of the next forward, and the features a
    head reads (a mirror of the last hidden states), which must hold each kept token once."""
    model = make(0)
    target = CausalLM(model, name="recurrent")
    mirror = target.attach_feature_mirror()
    target.reset()
    prompt = random_prompt(0, 20)
    target.forward(prompt[:10], num_logits=0)
    target.forward(prompt[10:16])  # (a round: pending token and five drafts)
    target.crop(12)  # two of them kept
    assert target.num_cached == 12 and target.states.replay == prompt[10:12]
    target.crop(11)  # (one of those still to read again dropped)
    assert target.states.replay == prompt[10:11]
    out = target.forward(prompt[11:14])
    assert out.logits.shape[0] == 3 and target.num_cached == 14
    with torch.inference_mode():
        fresh = model(torch.tensor([prompt[:14]]), output_hidden_states=True)
    assert torch.allclose(out.logits, fresh.logits[0, 11:14], atol=1e-5)
    assert mirror.features.shape[0] == 14
    assert torch.allclose(mirror.features, fresh.hidden_states[-1][0], atol=1e-5)


@pytest.mark.parametrize("make", RECURRENT)
def test_short_chains_read_without_padding_give_the_rows_of_a_whole_forward(make):
    """A verification's chain after a state is read as one chunk of its own length (Gated DeltaNet's of up to four
    tokens a token at a time): the rows a forward of the whole sequence computes, for chains on each side of those
    lengths."""
    import sys

    model = make(0)
    target = CausalLM(model, name="recurrent")
    module = sys.modules[type(model).__module__]
    forms = [getattr(module, name) for name in ("mamba2_chunk_scan", "torch_chunk_gated_delta_rule")
             if hasattr(module, name)]
    assert forms and all(getattr(form, "short_chains", False) for form in forms)
    tokens = random_prompt(5, 30)
    target.forward(tokens[:12], num_logits=0)
    for n in (2, 4, 5, 9, 17):
        out = target.forward(tokens[12:12 + n])
        with torch.inference_mode():
            whole = model(torch.tensor([tokens[:12 + n]])).logits[0, 12:]
        assert torch.allclose(out.logits, whole, atol=1e-5), n
        target.crop(12)


@pytest.mark.parametrize("plain", [False, True])
def test_a_crop_further_back_than_every_copy_reads_the_kept_tokens_again(plain, monkeypatch):
    """The copies are at most the last MAX_SNAPSHOTS forwards' (here 4; a decode that drafts nothing keeps none): a
    crop further back empties the cache and reads the kept tokens again, in the next forward, as a prompt past a
    prefill chunk."""
    monkeypatch.setattr("jointspec.backends.recurrent.MAX_SNAPSHOTS", 4)
    model = tiny_qwen3_5(0)
    target = CausalLM(model, name="recurrent")
    target.reset(plain=plain)
    tokens = random_prompt(0, 40)
    target.forward(tokens[:12], num_logits=0)
    for token in tokens[12:18]:
        target.forward([token])
    assert len(target.states.snapshots) == (0 if plain else 4)
    target.crop(13)
    assert target.states.replay == tokens[:13] and target.cache.get_seq_length() == 0
    monkeypatch.setattr("jointspec.backends.hf.PREFILL_CHUNK", 8)  # (the 13 read again in chunks, then its own)
    out = target.forward(tokens[13:16])
    with torch.inference_mode():
        fresh = model(torch.tensor([tokens[:16]])).logits[0, 13:16]
    assert target.num_cached == 16 and torch.allclose(out.logits, fresh, atol=1e-5)
    # that forward, read from an empty cache, handed back the states after the 13 tokens it read again: the copy the
    # next crop goes back to (without it, every later crop would read everything again)
    target.crop(14)
    if plain:
        assert target.states.replay == tokens[:14]
    else:
        assert target.states.replay == tokens[13:14] and target.cache.get_seq_length() == 13
        out = target.forward(tokens[14:16])
        assert torch.allclose(out.logits, fresh[1:], atol=1e-5)


@pytest.mark.parametrize("make", [tiny_lfm2, tiny_granite4, tiny_qwen3_5])
@pytest.mark.parametrize("method", ["default", "pld"])
def test_the_server_engine_serves_a_hybrid_model_each_request_its_own_tokens(make, method):
    """No ragged cache holds their layers: the engine falls back to lockstep, one loop per request (`pld` drafting
    every round, rejected drafts taken back in a batch). With a prompt cache (serve's default), requests that share a
    prompt's beginning each get their own tokens: the cache keeps no hybrid's caches, whose states its keys and
    values would not carry."""
    target = CausalLM(make(0), name="hybrid")
    config = MethodConfig(method, cost_aware=None if method == "default" else False)
    engine = engine_for(target, method=config, max_batch_size=4, prompt_cache_bytes=1 << 24)
    assert isinstance(engine, LockstepEngine)
    shared = [list(BATCH_PROMPTS[0]) + list(p[:3]) for p in BATCH_PROMPTS[:3]]
    prompts = [*BATCH_PROMPTS[:4], *shared]
    out = engine.generate([BatchRequest(tuple(p), BATCH_GREEDY, config) for p in prompts[:4]])
    out += engine.generate([BatchRequest(tuple(p), BATCH_GREEDY, config) for p in prompts[4:]])
    alone = CausalLM(target.model, name="alone")
    assert out == [SpeculativeDecoder(alone, NoDrafter(), build_method(MethodContext(
        MethodConfig("ar"), alone, None, None))[1]).generate(list(p), BATCH_GREEDY) for p in prompts]


JAMBA = "jamba: transformers' recurrent layers for it read a forward of several tokens without the state before it"


def _tiny_jamba():
    """As initialised, its Mamba layers' states move the logits by less than its chunks' error does; with
    lasting_state, by far more: the probe refuses it both ways."""
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2)).eval()


@pytest.mark.parametrize("make, why", [
    (lambda: transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8,
                                                                   num_hidden_layers=2)),
     "mamba keeps its state in an argument of its own"),
    (lambda: transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=64, attention_window_size=16, conv1d_width=4)),
     "recurrent_gemma keeps some layers' state outside transformers' cache"),
    (lambda: _tiny_jamba(), JAMBA),
    (lambda: lasting_state(_tiny_jamba()), JAMBA),
])
def test_a_model_whose_state_lives_outside_transformers_cache_is_refused_at_once(make, why):
    """Mamba reads its state from an argument of its own, RecurrentGemma keeps it on its modules: jointspec's cache
    holds neither (Mamba's plain decoding gave other tokens than its own greedy decoding; RecurrentGemma's one state
    would be shared by every sequence and fork of the model), so the adapter refuses them. Jamba's Mamba layers read
    a forward of several tokens from a zero state, not the cached one (a probe of two tokens after one finds it)."""
    with pytest.raises(UnsupportedOptionError, match=why):
        CausalLM(make().eval())


def test_a_recurrent_draft_model_drafts_for_another_hybrid():
    target_model = tiny_qwen3_5(0)
    target = CausalLM(target_model, name="target")
    draft = CausalLM(tiny_granite4(0), name="draft")
    context = MethodContext(MethodConfig("sps", draft="granite4", cost_aware=False, num_draft_tokens=4), target, None,
                            lambda source: (draft, None))
    decoder = SpeculativeDecoder(target, *build_method(context))
    prompt = random_prompt(3)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    assert decoder.stats.num_draft_tokens > 0
