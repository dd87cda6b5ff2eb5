"""Lookahead decoding (drafters/jacobi.py): the n-gram pool, the Jacobi window's update, the loop's report of the
target's rows, and greedy equivalence with plain decoding.

Plain greedy is transformers' own ``generate`` on the same tiny fp32 model, and greedy speculative decoding is exact
by construction, so any difference is a bug (no false-failure odds). The drafters here are built without a cost curve
(every node drafted), so that the tests exercise deep trees, EOS and the length limit inside drafts whatever the
machine's load; the registered method sizes its trees from the measured curve. Everything else is exact arithmetic on
fixed inputs.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import Draft
from jointspec.core.loop import SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.jacobi import JacobiLookaheadDrafter, NgramPool
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers.greedy import GreedyVerifier
from jointspec.verifiers.tree import TreeRejectionVerifier

from helpers import first_occurrences, greedy, hf_greedy, random_prompt

GREEDY = SamplingConfig()


def test_the_pool_ranks_by_count_then_recency_and_stays_bounded():
    pool = NgramPool(max_per_key=2)
    pool.add([5, 1, 2])
    pool.add([5, 3, 4])
    pool.add([5, 3, 4])
    assert pool.continuations(5, 4) == [((3, 4), 2), ((1, 2), 1)]
    pool.add([5, 7, 8])  # a third continuation: the least recently seen one (1 2) goes
    assert pool.continuations(5, 4) == [((3, 4), 2), ((7, 8), 1)]
    pool.add([5, 9, 9])  # the least recently seen goes, whatever its count: the pool follows the text as it moves
    assert pool.continuations(5, 4) == [((9, 9), 1), ((7, 8), 1)]
    assert pool.continuations(6, 4) == [] and NgramPool().continuations(5, 4) == []
    pool.add([5])  # too short to say anything
    with pytest.raises(ValueError, match="max_per_key"):
        NgramPool(0)


def test_the_first_round_drafts_the_window_from_the_prompt():
    drafter = JacobiLookaheadDrafter(None, window=3, ngram=3)
    drafter.start([10, 11, 12, 13, 14])
    draft = drafter.propose([10, 11, 12, 13, 14], 8, GREEDY, None)
    assert draft.token_ids == [12, 13, 14] and draft.is_chain
    assert drafter.propose([10, 11, 12, 13, 14], 2, GREEDY, None).token_ids == [12, 13]  # the budget bounds depth


def test_target_rows_become_pool_ngrams_and_the_next_jacobi_guesses():
    drafter = JacobiLookaheadDrafter(None, window=3, ngram=3)
    context = [10, 11, 12, 13, 14]
    drafter.start(context)
    draft = drafter.propose(context, 8, GREEDY, None)  # the window 12 13 14 after the pending token 14
    # The target's argmax after the pending token, then after each window node: it agrees with none of the guesses.
    drafter.observe_target(draft, [20, 21, 22, 23], [])
    # One n-gram per row: the last two tokens before the row's position, then the target's token.
    # After the pending token: "13 14 -> 20"; after window node 12: "14 12 -> 21"; after 13: "12 13 -> 22"; after
    # 14: "13 14 -> 23" (the same two tokens as the first, so both continue 13; the later one first).
    assert drafter.pool.continuations(13, 4) == [((14, 23), 1), ((14, 20), 1)]
    assert drafter.pool.continuations(14, 4) == [((12, 21), 1)]
    assert drafter.pool.continuations(12, 4) == [((13, 22), 1)]
    # The round commits the target's own token (20): the guesses for the positions after it are the target's
    # tokens after the first and second window nodes (Jacobi), padded with the last to the window's length.
    drafter.commit(context + [20], 0)
    assert drafter.guesses == [21, 22, 23]
    # Next round, the context ends in 20, which no pooled n-gram starts with: the draft is the window alone.
    assert drafter.propose(context + [20], 8, GREEDY, None).token_ids == [21, 22, 23]


def test_pool_continuations_and_the_window_merge_into_one_tree():
    drafter = JacobiLookaheadDrafter(None, window=2, ngram=3, max_guesses=2)
    drafter.start([1, 2, 3, 4])  # the window: 3 4
    for ngram in ([4, 3, 9], [4, 3, 9], [4, 5, 6]):
        drafter.pool.add(ngram)
    # The pool's branches after the pending 4, ranked: "3 9" (count 2), "5 6" (1).
    tokens, parents, chances = drafter.trie([1, 2, 3, 4], 4)
    assert tokens == [3, 9, 5, 6] and parents == [-1, 0, -1, 2]
    assert chances == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    # The window "3 4" follows the pooled "3" and adds one node under it.
    draft = drafter.propose([1, 2, 3, 4], 8, GREEDY, None)
    assert draft.token_ids == [3, 9, 5, 6, 4] and draft.parents == [-1, 0, -1, 2, 0]


def test_the_window_takes_only_rows_the_cost_curve_says_are_nearly_free():
    flat = CostCurve({1: 1.0, 2: 1.01, 17: 1.2})  # a row costs ~1 % of a step (a launch-bound GPU)
    dear = CostCurve({1: 1.0, 2: 1.13, 17: 2.8})  # a row costs 13 % (the int4 CPU target)
    for curve, expected in ((flat, [12, 13, 14]), (dear, [])):
        drafter = JacobiLookaheadDrafter(curve, window=3)
        drafter.start([10, 11, 12, 13, 14])  # an empty pool: only the window could be drafted
        assert drafter.propose([10, 11, 12, 13, 14], 8, GREEDY, None).token_ids == expected
    with pytest.raises(ValueError, match="free_row_cost"):
        JacobiLookaheadDrafter(None, free_row_cost=-1)


def test_accepted_window_guesses_leave_the_calibration_alone():
    drafter = JacobiLookaheadDrafter(None, window=3)
    context = [10, 11, 12, 13, 14]
    drafter.start(context)
    draft = drafter.propose(context, 8, GREEDY, None)  # the window alone: 12 13 14
    drafter.observe_target(draft, [12, 13, 14, 99], [0, 1, 2])  # the target agrees with every guess
    drafter.commit(context + [12, 13, 14, 99], 3)
    assert drafter.calibration == 1.0  # it predicted nothing for the window, and counts nothing for it
    # Jacobi had nothing past the committed tokens: the next window restarts from the context's end.
    assert drafter.guesses == [13, 14, 99]


def test_the_loop_reports_the_target_argmax_of_every_row(target_model):
    class Recorder:
        observes_target = True

        def __init__(self) -> None:
            self.seen: list[tuple[list[int], list[int], list[int]]] = []

        def start(self, prompt_ids): pass

        def propose(self, context_ids, max_num_draft_tokens, sampling, generator):
            return Draft([7, 8, 9][:max_num_draft_tokens], parents=[-1, 0, -1][:max_num_draft_tokens])

        def observe_target(self, draft, target_tokens, accepted):
            self.seen.append((list(draft.token_ids), target_tokens, accepted))

        def commit(self, context_ids, num_accepted): pass

    prompt = random_prompt(3)
    recorder = Recorder()
    SpeculativeDecoder(CausalLM(target_model), recorder, GreedyVerifier()).generate(prompt, greedy(5))
    recorder.seen = recorder.seen[:1]
    (tokens, target_tokens, accepted), = recorder.seen
    # The target's own argmax after the prompt, after "7" and after "7 8" (node 1 is 7's child), after "9".
    with torch.no_grad():
        def next_token(ids: list[int]) -> int:
            return int(target_model(torch.tensor([ids], device=target_model.device)).logits[0, -1].argmax())
    assert target_tokens == [next_token(prompt), next_token(prompt + [7]), next_token(prompt + [7, 8]),
                             next_token(prompt + [9])]
    # And the verdict's accepted nodes: the path the target's argmax follows through the tree.
    expected = {7: [0] + ([1] if target_tokens[1] == 8 else []), 9: [2]}.get(target_tokens[0], [])
    assert accepted == expected


def lade_decoder(target_model, **settings) -> SpeculativeDecoder:
    return SpeculativeDecoder(CausalLM(target_model, name="tiny-target"), JacobiLookaheadDrafter(None, **settings),
                              TreeRejectionVerifier(replacement=True))


MAX_NEW_TOKENS = 40


@pytest.mark.parametrize("prompt_seed", [0, 3, 6])
@pytest.mark.parametrize("settings", [{}, {"window": 6, "ngram": 4, "max_nodes": 24}])
def test_lookahead_decoding_matches_plain_greedy(target_model, prompt_seed, settings):
    prompt = random_prompt(prompt_seed)
    decoder = lade_decoder(target_model, **settings)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == hf_greedy(target_model, prompt, MAX_NEW_TOKENS)
    assert decoder.stats.num_accepted_tokens > 0  # the pool's n-grams were drafted and kept


@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
def test_the_length_limit_inside_a_draft(target_model, max_new_tokens):
    prompt = random_prompt(1)  # loops at once: drafts are accepted, so the limit falls inside them
    decoder = lade_decoder(target_model)
    out = decoder.generate(prompt, greedy(max_new_tokens))
    assert out == hf_greedy(target_model, prompt, max_new_tokens)
    assert len(out) == decoder.stats.num_new_tokens == max_new_tokens


def test_an_end_of_sequence_inside_a_draft_stops_like_plain_greedy(target_model):
    prompt = random_prompt(1)
    reference = hf_greedy(target_model, prompt, MAX_NEW_TOKENS)
    for pos, eos in sorted((pos, token) for token, pos in first_occurrences(reference).items() if pos >= 2)[:3]:
        decoder = lade_decoder(target_model)
        assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS, frozenset({eos}))) == reference[:pos + 1]


def test_the_registered_method_is_lade_with_the_configs_settings(target_model):
    config = MethodConfig(name="lade", num_draft_tokens=5, max_ngram=4, tree_budget=9)
    drafter, verifier = build_method(MethodContext(config, CausalLM(target_model), None, None))
    assert isinstance(drafter, JacobiLookaheadDrafter) and isinstance(verifier, TreeRejectionVerifier)
    assert (drafter.window, drafter.ngram, drafter.max_nodes) == (5, 4, 9) and drafter.curve is not None
    with pytest.raises(ValueError, match="window"):
        JacobiLookaheadDrafter(None, window=0)
