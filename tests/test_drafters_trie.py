"""Lookahead's trie drafter (drafters/trie.py): which continuations it merges, how it ranks them, how many it drafts.

Greedy equivalence with plain decoding (EOS and the length limit inside a draft, a one-token prompt, the context
limit) is in tests/test_core_loop_equivalence.py, and the sampled law of its verifier (deterministic siblings,
TreeRejectionVerifier) in tests/test_verifiers_tree_spectr.py. Everything here is exact arithmetic on fixed inputs.
"""

from __future__ import annotations

import numpy as np

from jointspec.core.draft import tree_depths
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.ngram import suffix_matches
from jointspec.drafters.trie import TrieLookupDrafter

GREEDY = SamplingConfig()
FLAT = CostCurve({1: 1.0, 64: 1.0 + 1e-9})  # extra rows cost nothing: every node pays
LINEAR = CostCurve({1: 1.0, 2: 2.0, 64: 64.0})  # each row costs a step: no draft beats plain decoding


def test_the_longest_earlier_suffix_ngram_and_where_it_was_followed():
    context = np.array([5, 6, 7, 9, 5, 6, 8, 1, 5, 6])
    assert suffix_matches(context, 3, 1, 32) == (2, [6, 2])  # "5 6" ends the context; "1 5 6" occurs only there
    assert suffix_matches(context, 3, 1, 1) == (2, [6])  # the most recent occurrence first
    assert suffix_matches(np.array([4, 3, 2]), 3, 1, 32) == (0, [])


def test_continuations_merge_into_a_trie_ranked_by_count():
    # "7" follows "5 6" three times: twice as "7 9", once as "7 8"; "3" once.
    context = [5, 6, 7, 9, 0, 5, 6, 3, 0, 5, 6, 7, 9, 0, 5, 6, 7, 8, 0, 5, 6]
    drafter = TrieLookupDrafter(FLAT, max_depth=2, max_ngram=2)
    tokens, parents, chances = drafter.trie(context, 2)
    # By count: 7 (3), 9 (2), then the count-1 nodes, shallower first, then the most recent first ("7 8" is).
    assert tokens == [7, 9, 3, 8, 0]
    assert parents == [-1, 0, -1, 0, 2]
    assert chances == [0.75, 0.5, 0.25, 0.25, 0.25]
    draft = drafter.propose(context, 8, GREEDY, None)
    assert draft.token_ids == tokens and draft.parents == parents  # a flat curve drafts every node, as one tree
    assert max(tree_depths(draft.parents)) + 1 <= 2


def test_a_single_continuation_is_a_chain_and_the_budget_bounds_its_depth():
    context = [1, 2, 3, 4, 5, 1, 2]
    drafter = TrieLookupDrafter(FLAT, max_depth=8, max_ngram=2)
    assert drafter.propose(context, 8, GREEDY, None).token_ids == [3, 4, 5, 1, 2]
    draft = drafter.propose(context, 2, GREEDY, None)
    assert draft.token_ids == [3, 4] and draft.is_chain
    assert drafter.propose(context, 0, GREEDY, None).num_nodes == 0
    assert drafter.propose([7, 8, 9], 8, GREEDY, None).num_nodes == 0  # no earlier occurrence: no draft


def test_the_cost_curve_sizes_the_tree_and_the_calibration_follows_acceptance():
    context = [5, 6, 7, 9, 0, 5, 6, 3, 0, 5, 6, 7, 9, 0, 5, 6, 7, 8, 0, 5, 6]
    assert TrieLookupDrafter(LINEAR, max_ngram=2).propose(context, 8, GREEDY, None).num_nodes == 0
    # A curve where a few extra rows are cheap and more are dear keeps only the likeliest nodes.
    curve = CostCurve({1: 1.0, 2: 1.1, 3: 1.5, 5: 3.0})
    drafter = TrieLookupDrafter(curve, max_depth=2, max_ngram=2)
    assert drafter.propose(context, 8, GREEDY, None).token_ids == [7]
    # Drafts that keep failing lower the calibration until only probes are drafted, ever more rarely.
    drafted = []
    for _ in range(60):
        drafted.append(drafter.propose(context, 8, GREEDY, None).num_nodes)
        drafter.commit(context, 0)
    assert drafter.calibration < 0.2
    assert drafted[:3] == [1, 1, 1] and sum(drafted[-30:]) <= 2
    # An accepted probe raises the calibration and brings the probes back to every round.
    while drafter.propose(context, 8, GREEDY, None).num_nodes == 0:
        drafter.commit(context, 0)
    before = drafter.calibration
    drafter.commit(context + [7], 1)
    assert drafter.calibration > before and drafter._probe_interval == 1
    drafter.start(context)
    assert drafter.calibration == 1.0


def test_a_round_without_budget_leaves_the_probe_schedule_alone():
    # A round given no budget (an answer's last token; a batched round whose drafts the engine holds off) drafts
    # nothing; its commit judged the probe of an earlier round again, as rejected, and doubled the wait each time.
    context = [5, 6, 7, 9, 0, 5, 6, 3, 0, 5, 6, 7, 9, 0, 5, 6, 7, 8, 0, 5, 6]
    drafter = TrieLookupDrafter(CostCurve({1: 1.0, 2: 1.1, 3: 1.5, 5: 3.0}), max_depth=2, max_ngram=2)
    for _ in range(60):  # rejections until only probes are drafted
        drafter.propose(context, 8, GREEDY, None)
        drafter.commit(context, 0)
    while drafter.propose(context, 8, GREEDY, None).num_nodes == 0:
        drafter.commit(context, 0)
    drafter.commit(context + [7], 1)  # the probe accepted: probes every round again
    assert drafter._probe_interval == 1
    for _ in range(5):
        assert drafter.propose(context, 0, GREEDY, None).num_nodes == 0
        drafter.commit(context, 0)
    assert drafter._probe_interval == 1
