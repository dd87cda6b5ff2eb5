"""ADED (drafters/aded.py, methods/aded.py): the adaptive tri-gram store, the best-first tree search over it, and greedy
equivalence of the `aded` method with plain decoding.

Everything here is deterministic: exact arithmetic on fixed inputs, and greedy decodes of the sharpened tiny fp32
models (helpers.tiny_llama), whose argmax near-ties are vanishingly rare. No test has false-failure odds worth
stating; a failure is a bug.
"""

from __future__ import annotations

import math

import pytest

from jointspec.core.draft import tree_depths
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.aded import AdedDrafter, TrigramStore
from jointspec.drafters.corpus import NgramTable
from jointspec.drafters.costaware import CostCurve
from jointspec.methods import aded as aded_method
from jointspec.methods import lossless_methods
from jointspec.methods.aded import NO_PRIOR  # registers `aded`

from helpers import (
    VOCAB,
    assert_greedy_equivalent,
    decoder_for,
    first_occurrences,
    greedy,
    hf_greedy,
    random_prompt,
    tiny_llama,
)

GREEDY = SamplingConfig()
FLAT = CostCurve({1: 1.0, 64: 1.0 + 1e-9})  # extra rows cost nothing: every searched node pays
LINEAR = CostCurve({1: 1.0, 2: 2.0, 64: 64.0})  # each row costs a step: no draft beats plain decoding
GENTLE = CostCurve({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4, 64: 1.8})  # a tiny model's, roughly
NO_DECAY = math.inf  # counts never fade (decay exactly 1)


# -- the store --------------------------------------------------------------------------------------------------------

def test_decay_makes_the_recent_continuation_win():
    # "1 2" was followed by 3, then by 4. Without decay the two tie at every order; with it the recent one leads.
    tokens = [1, 2, 3, 1, 2, 4]
    flat = TrigramStore(memory=NO_DECAY)
    flat.observe_all(tokens)
    chances = flat.chances([1, 2])
    assert chances[3] == pytest.approx(chances[4])
    adaptive = TrigramStore(memory=2.0)  # decay 0.5: the earlier sighting weighs half
    adaptive.observe_all(tokens)
    assert adaptive.trigrams.get((1, 2)) == {3: 0.5, 4: 1.0}
    chances = adaptive.chances([1, 2])
    assert chances[4] > chances[3] > 0
    assert 0.9 < sum(chances.values()) < 1.0  # what is left goes to tokens the store never saw


def test_back_off_to_the_bigram_and_the_unigram():
    store = TrigramStore(memory=NO_DECAY)
    store.observe_all([1, 2, 3, 1, 2, 4, 5, 6])
    # An unseen pair backs off to its last token's bigram exactly, an unseen last token to the unigram.
    assert store.chances([9, 2]) == store.chances([2])
    assert store.chances([9, 9]) == store.chances([9]) == store.chances([])
    # Counts are interpolated with beta = 1: "1 2" seen twice (3 and 4 once each) keeps a quarter for the back-off.
    bigram = store.chances([2])
    assert store.chances([1, 2])[3] == pytest.approx((1 + bigram[3]) / 3)
    # The unigram: 8 observations and beta 1.
    assert store.chances([])[5] == pytest.approx(1 / 9)
    # A token the store never saw has no chance at any order.
    assert 7 not in store.chances([1, 2])


def test_memory_is_bounded_by_contexts_and_continuations():
    store = TrigramStore(memory=NO_DECAY, max_next=2, max_contexts=3)
    for token in (10, 10, 11, 12):  # "1 2" -> 10 twice, then 11, then 12: the lightest (11) makes room for 12
        store.observe([1, 2], token)
    assert store.trigrams.get((1, 2)) == {10: 2.0, 12: 1.0}
    for pair in ((3, 4), (5, 6), (7, 8)):  # three newer contexts push out the least recently seen, (1, 2)
        store.observe(list(pair), 20)
    assert len(store.trigrams.table) == 3 and (1, 2) not in store.trigrams.table
    assert all(len(weights) <= 2 for weights in store.bigrams.table.values())


def test_a_prior_table_seeds_contexts_and_the_request_outweighs_it():
    # The table says "1 2" is followed by 7 (every time); the request itself then shows 8 after "1 2" three times.
    table = NgramTable.build([[1, 2, 7, 0]] * 3, VOCAB, max_order=2, min_count=1)
    store = TrigramStore(memory=NO_DECAY, prior=table, prior_weight=2.0)
    store.observe_all([1, 2])
    assert store.chances([1, 2])[7] == pytest.approx(2 / 3)  # 2 pseudo-counts and beta 1, nothing seen yet
    store.observe_all([1, 2, 8, 1, 2, 8, 1, 2, 8], start=2)
    chances = store.chances([1, 2])
    assert chances[8] > 0.5 > chances[7]
    assert TrigramStore(prior=None, prior_weight=2.0).prior_weight == 0.0  # no table, no pseudo-counts


def test_bad_options_are_refused():
    for options in ({"memory": 1.0}, {"beta": 0.0}, {"max_next": 0}, {"prior_weight": -1.0}):
        with pytest.raises(ValueError):
            TrigramStore(**options)
    with pytest.raises(ValueError):
        AdedDrafter(FLAT, memory=0.5)  # store options are checked when the drafter is built
    with pytest.raises(ValueError):
        AdedDrafter(FLAT, max_children=0)


# -- the tree search --------------------------------------------------------------------------------------------------

def _draft(drafter: AdedDrafter, context: list[int], budget: int = 8):
    drafter.start(context)
    return drafter.propose(context, budget, GREEDY, None)


def test_a_repeated_pattern_is_drafted_as_the_first_chain():
    context = [1, 2, 3, 4, 5] * 3 + [1, 2]
    draft = _draft(AdedDrafter(FLAT, max_depth=4, max_nodes=16), context)
    parents = draft.node_parents()
    # The likeliest path, node by node from the root, repeats the pattern: 3 4 5 1.
    path, node = [], 0
    while node is not None:
        path.append(draft.token_ids[node])
        node = next((i for i, parent in enumerate(parents) if parent == node), None)
    assert path == [3, 4, 5, 1]


def test_the_tree_is_valid_ranked_and_within_its_budgets():
    context = random_prompt(1, length=40) + [5, 6, 7, 5, 6, 8, 5, 6]  # "5 6" branches to 7 and 8
    drafter = AdedDrafter(FLAT, max_depth=3, max_nodes=10)
    drafter.start(context)
    tokens, parents, chances = drafter.trie(context, 3)
    depths = tree_depths(parents)  # raises unless every parent is -1 or an earlier node
    assert len(tokens) == 10 and max(depths) <= 2
    assert all(a >= b for a, b in zip(chances, chances[1:]))  # best-first: ranked by chance
    assert all(chances[i] < chances[p] for i, p in enumerate(parents) if p >= 0)  # a child never outranks its parent
    assert {tokens[i] for i, p in enumerate(parents) if p == -1} >= {7, 8}  # both continuations are siblings
    # A child's chance is its parent's times the store's chance of it after the path.
    child = next(i for i, p in enumerate(parents) if p == 0)
    assert chances[child] == pytest.approx(chances[0] * drafter.store.chances([6, tokens[0]])[tokens[child]])
    # The loop's budget bounds the depth; no budget, no draft.
    draft = drafter.propose(context, 2, GREEDY, None)
    assert max(tree_depths(draft.node_parents())) + 1 <= 2
    assert drafter.propose(context, 0, GREEDY, None).num_nodes == 0


def test_what_must_not_be_drafted():
    context = [1, 2, 3, 4, 5] * 3 + [1, 2]
    # Nothing after an end-of-sequence token: 4 is EOS here, so the pattern's path stops at it.
    draft = _draft(AdedDrafter(FLAT, max_depth=4, eos_token_ids=frozenset({4})), context)
    eos_nodes = [i for i, token in enumerate(draft.token_ids) if token == 4]
    assert eos_nodes and not any(p in eos_nodes for p in draft.node_parents())
    # Only tokens the request has shown (no prior table): the store never invents one.
    assert set(draft.token_ids) <= set(context)
    # Paths less likely than min_chance are not searched.
    _, _, chances = AdedDrafter(FLAT, max_depth=4, min_chance=0.2).trie(context, 4)
    assert chances and min(chances) >= 0.2
    # A curve on which every extra row costs a full step: nothing pays, nothing is drafted.
    assert _draft(AdedDrafter(LINEAR), context).num_nodes == 0


def test_commits_teach_the_store_and_rejections_lower_the_calibration():
    drafter = AdedDrafter(FLAT, max_depth=2)
    drafter.start([1, 2, 3])
    assert (2, 3) not in drafter.store.trigrams.table
    drafter.propose([1, 2, 3], 4, GREEDY, None)
    drafter.commit([1, 2, 3, 9, 8], 1)  # one draft token kept, then the target's own token
    assert drafter.store.trigrams.get((2, 3)) == {9: 1.0} and drafter.store.trigrams.get((3, 9)) == {8: 1.0}
    before = drafter.calibration
    for _ in range(5):
        drafter.propose([1, 2, 3, 9, 8], 4, GREEDY, None)
        drafter.commit([1, 2, 3, 9, 8], 0)
    assert drafter.calibration < before
    drafter.start([1, 2])  # a new request: a new store and the calibration's prior
    assert drafter.store.trigrams.table == {} and drafter.calibration == 1.0


# -- the method: greedy equivalence -----------------------------------------------------------------------------------

class _Recording:
    """Passes every call on to the drafter, keeping each round's (new tokens before it, draft, tokens accepted)."""

    def __init__(self, inner):
        self.inner = inner
        self.rounds = []

    def start(self, prompt_ids):
        self.rounds, self.prompt_length = [], len(prompt_ids)
        self.inner.start(prompt_ids)

    def propose(self, context_ids, max_num_draft_tokens, sampling, generator):
        draft = self.inner.propose(context_ids, max_num_draft_tokens, sampling, generator)
        self.rounds.append([len(context_ids) - self.prompt_length, draft, 0])
        return draft

    def commit(self, context_ids, num_accepted):
        self.rounds[-1][2] = num_accepted
        self.inner.commit(context_ids, num_accepted)


def test_registered_as_lossless():
    assert "aded" in lossless_methods()


@pytest.mark.parametrize("prompt_seed", [1, 3, 6])
def test_greedy_output_equals_plain_decoding(target_model, prompt_seed):
    # Seeds 3 and 6 wander before they loop, seed 1 loops at once (see helpers.random_prompt): between them the
    # drafts are rejected, partly accepted and accepted whole. assert_greedy_equivalent also puts the length limit
    # (7 new tokens) and an end-of-sequence token (the 10th new one) inside drafts.
    decoder = decoder_for(target_model, "aded", NO_PRIOR, num_draft_tokens=4)
    assert_greedy_equivalent(target_model, decoder, random_prompt(prompt_seed))


def test_trees_are_drafted_accepted_and_cut_at_eos(target_model, monkeypatch):
    # The prompt, the target's continuation of it, the prompt again: the store has seen what the target is about to
    # write, so drafts are accepted in runs (seed 6: 7 new tokens in round one). Trees are sized by a fixed cost curve,
    # not one timed now: on a loaded machine a timed one can leave no tree worth drafting.
    monkeypatch.setattr(aded_method, "target_cost_curve", lambda target: GENTLE)
    seed_prompt = random_prompt(6)
    prompt = seed_prompt + hf_greedy(target_model, seed_prompt, 24) + seed_prompt
    expected = hf_greedy(target_model, prompt, 40)
    decoder = decoder_for(target_model, "aded", NO_PRIOR)
    decoder.drafter = recording = _Recording(decoder.drafter)
    assert decoder.generate(prompt, greedy(40)) == expected
    assert decoder.stats.mean_accepted_tokens > 2.0
    assert any(not draft.is_chain for _, draft, _ in recording.rounds)  # trees, not only chains
    # EOS inside a draft: declare as EOS a token the target first writes as an accepted draft token below the root;
    # the decode must commit the round's draft up to it and stop there, as plain decoding with that EOS does.
    first = first_occurrences(expected)
    position = next(new + depth for new, _, accepted in recording.rounds for depth in range(1, accepted)
                    if first[expected[new + depth]] == new + depth)
    eos = expected[position]
    assert decoder.generate(prompt, greedy(40, frozenset({eos}))) == expected[:position + 1]
    assert hf_greedy(target_model, prompt, 40, eos_token_id=eos) == expected[:position + 1]


def test_context_limit_inside_a_draft():
    # A 24-position context: a 20-token prompt leaves room for 4 new tokens, fewer than asked and than a draft.
    model = tiny_llama(0, max_positions=24)
    prompt = random_prompt(3, length=20)
    decoder = decoder_for(model, "aded", NO_PRIOR, num_draft_tokens=5)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(model, prompt, 4)


def test_drafting_pays_on_a_loop_by_the_numbers(target_model):
    # Tokens per target call on a prompt that holds the target's loop (seed 1 loops at once): every round commits
    # 1 + accepted, so 40 tokens take far fewer than 40 rounds. A bound, not an exact count: the measured cost curve
    # (timings) sizes the trees.
    seed_prompt = random_prompt(1)
    prompt = seed_prompt + hf_greedy(target_model, seed_prompt, 24)
    decoder = decoder_for(target_model, "aded", NO_PRIOR)
    decoder.generate(prompt, greedy(40))
    stats = decoder.stats
    assert stats.num_rounds + stats.num_accepted_tokens == 40
    assert stats.num_rounds <= 40 // 4
