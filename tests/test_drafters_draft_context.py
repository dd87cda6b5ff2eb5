"""A draft model whose context window is shorter than its target's drafts while its window lasts, then the loop goes
on without drafts: the tokens stay plain decoding's, and the draft is never fed past its last position. GPT-2's
learned positions make feeding past the window an IndexError (a RoPE draft would only drift), so each method is run
across the draft's window end on such a model. ``oracle``, which drafts with the target itself, is run to the
target's own context end the same way. Greedy and deterministic: no false-failure odds."""

from __future__ import annotations

import pytest
import torch
import transformers

from jointspec.backends.hf import CausalLM
from jointspec.core.loop import SpeculativeDecoder
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import greedy, random_prompt


def gpt2(seed: int, positions: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=positions, bos_token_id=1, eos_token_id=2)).eval()


def decoder(method: str, target_model, draft_model=None, **options) -> tuple[SpeculativeDecoder, CausalLM]:
    target = CausalLM(target_model, name="target")
    draft = None if draft_model is None else CausalLM(draft_model, name="short draft")
    config = MethodConfig(method, draft=None if draft is None else "short", cost_aware=False, **options)
    drafter, verifier = build_method(MethodContext(config, target, None, lambda source: (draft, None)))
    return SpeculativeDecoder(target, drafter, verifier), draft


@pytest.mark.parametrize("method, options", [
    ("sps", {"num_draft_tokens": 4}),
    ("hybrid", {"num_draft_tokens": 4}),
    ("specinfer", {"tree": (2, 2, 1)}),
    ("hybrid-tree", {"tree": (2, 1, 1)}),
    ("hybrid-tree", {"tree_budget": 6}),
    ("pearl", {"num_draft_tokens": 3}),
    ("mtad", {"num_draft_tokens": 3, "beam_width": 2}),  # (greedy MTAD keeps plain decoding's tokens too)
])
def test_a_draft_with_a_shorter_window_drafts_until_it_is_full_then_decoding_goes_on(method, options):
    target_model, draft_model = gpt2(0, 64), gpt2(0, 16)  # the draft: the target's weights, a quarter of its window
    draft_model.load_state_dict({k: v[:16] if k == "transformer.wpe.weight" else v
                                 for k, v in target_model.state_dict().items()})
    prompt = random_prompt(3, 10)
    expected = decoder("ar", target_model)[0].generate(prompt, greedy(30))
    assert len(expected) == 30  # (no end of sequence on the way: the answer runs past the draft's window)
    spec, draft = decoder(method, target_model, draft_model, **options)
    fed = []
    forward = draft.forward

    def watched(token_ids, *args, parents=None, **kwargs):
        depths = []  # a tree's nodes sit at their depth's position (parents: -1 the cache's last token)
        for parent in parents or range(-1, len(token_ids) - 1):
            depths.append(1 if parent == -1 else depths[parent] + 1)
        fed.append(draft.num_cached + max(depths))  # the last position fed, counted from 1
        return forward(token_ids, *args, parents=parents, **kwargs)

    draft.forward = watched
    assert spec.generate(prompt, greedy(30)) == expected
    assert max(fed) <= 16  # never past the draft's last position
    if not method.startswith("hybrid"):  # (hybrid's lookup drafts some rounds instead of the model)
        assert max(fed) == 16  # and up to it: a window one short would stop a round early
    assert spec.stats.num_accepted_tokens > 0  # it drafted (and the target kept drafts) while the window lasted


def test_the_oracle_extends_its_continuation_no_further_than_the_context():
    model = gpt2(0, 32)
    for length in (31, 28, 20):  # a continuation chunk of 16 would pass the context's end from 17 tokens on
        prompt = random_prompt(3, length)
        expected = decoder("ar", model)[0].generate(prompt, greedy(100))
        oracle, _ = decoder("oracle", model)
        assert oracle.generate(prompt, greedy(100)) == expected
        assert len(expected) == 32 - length  # to the context's end


def test_the_batched_engine_drafts_within_a_short_window_as_the_loop_does():
    """The ragged engine's model drafter drafted past the window (its cache clamps positions, so no error): its
    sampled drafts then drew otherwise than the loop's, and a seeded request's text was not `generate`'s."""
    from jointspec.batch.engine import BatchEngine, BatchRequest
    from jointspec.core.loop import DecodeConfig
    from jointspec.core.sampling import SamplingConfig

    target_model, draft_model = gpt2(0, 64), gpt2(0, 16)
    draft_model.load_state_dict({k: v[:16] if k == "transformer.wpe.weight" else v
                                 for k, v in target_model.state_dict().items()})
    load = lambda source: (CausalLM(draft_model, name="short draft"), None)  # noqa: E731
    method = MethodConfig("sps", draft="short", num_draft_tokens=4, cost_aware=False)
    config = DecodeConfig(max_new_tokens=40, sampling=SamplingConfig(temperature=0.8, top_k=50))
    prompt = random_prompt(3, 10)
    for seed in range(3):
        single, _ = decoder("sps", target_model, draft_model, num_draft_tokens=4)
        expected = single.generate(prompt, config, torch.Generator().manual_seed(seed))
        engine = BatchEngine(CausalLM(target_model), max_batch_size=2, load_draft=load)
        assert engine.generate([BatchRequest(prompt, config, method, seed=seed)])[0] == expected


def test_a_prompt_past_a_short_windows_end_drafts_nothing_in_the_batched_engine_either():
    """The ragged engine prefilled a draft with the whole prompt at unclamped positions: a prompt longer than a
    learned-position draft's window was an IndexError there (the loop drafts nothing and decodes on)."""
    from jointspec.batch.engine import BatchEngine, BatchRequest

    target_model, draft_model = gpt2(0, 64), gpt2(0, 16)
    load = lambda source: (CausalLM(draft_model, name="short draft"), None)  # noqa: E731
    method = MethodConfig("sps", draft="short", num_draft_tokens=4, cost_aware=False)
    prompt = random_prompt(3, 20)
    expected = decoder("ar", target_model)[0].generate(prompt, greedy(12))
    engine = BatchEngine(CausalLM(target_model), max_batch_size=2, load_draft=load)
    assert engine.generate([BatchRequest(prompt, greedy(12), method)])[0] == expected
