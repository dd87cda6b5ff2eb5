"""``hybrid`` (drafters/hybrid.py: prompt lookup where the text repeats, else the draft) and ``hybrid-tree``
(drafters/lookup_tree.py: lookup where it beats the draft's token tree, else the tree), with an EAGLE head as draft.

Greedy equivalence is exact by construction; the rest is arithmetic on given cost curves. Deterministic: no
false-failure odds.
"""

from __future__ import annotations

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.core.loop import SpeculativeDecoder
from jointspec.drafts.eagle import bind_head

from helpers import decoder_for, greedy, hf_greedy, random_prompt, untrained_head


def test_hybrid_uses_lookup_where_text_repeats_and_the_head_elsewhere(target_model, trained_head_dir):
    decoder = decoder_for(target_model, "hybrid", trained_head_dir, num_draft_tokens=4, cost_aware=False)
    prompt = random_prompt(0)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    # The tiny target's continuation falls into a loop: lookups match there, the head drafts before that.
    assert decoder.drafter.num_lookup_rounds > 0 and decoder.drafter.num_model_rounds > 0


def test_hybrid_tree_uses_lookup_where_text_repeats_and_the_tree_elsewhere(target_model, trained_head_dir):
    decoder = decoder_for(target_model, "hybrid-tree", trained_head_dir, tree=(3,))
    prompt = random_prompt(0)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    drafter = decoder.drafter
    # The tiny target's continuation falls into a loop: lookups pay there, the tree drafts before that.
    assert drafter.num_lookup_rounds > 0 and drafter.num_tree_rounds > 0
    assert drafter.num_lookup_rounds + drafter.num_tree_rounds <= decoder.stats.num_rounds
    assert 0 <= drafter.tree_tokens <= 1  # a width-only tree accepts at most one draft token a round


def test_hybrid_tree_holds_lookup_to_the_trees_rate():
    from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter, tree_round_cost

    curve = CostCurve({1: 1.0, 2: 1.0, 4: 1.1, 5: 1.6})
    assert tree_round_cost(curve, (3,), 0.1) == pytest.approx(1.1 + 0.1)
    assert tree_round_cost(curve, (2, 1), 0.1) == pytest.approx(1.6 + 0.2)  # 2 + 2 nodes (5-token forward), 2 calls

    class FakeTree:
        branching = (3,)

    drafter = LookupOrTreeDrafter(CostAwareDrafter(object(), curve), FakeTree(), curve, draft_cost_per_call=0.1,
                                  prior_tree_tokens=0.65)
    # (1 + 0.65) tokens for 1.2 units: the tree runs 37.5 % faster than plain decoding, so a lookup draft must too.
    assert drafter.tree_gain() == pytest.approx(1.65 / 1.2 - 1)
    weak = LookupOrTreeDrafter(CostAwareDrafter(object(), curve), FakeTree(), curve, draft_cost_per_call=0.1,
                               prior_tree_tokens=0.1)
    assert weak.tree_gain() == 0.0  # a tree slower than plain decoding sets no bar above plain decoding


@pytest.mark.parametrize("dear", [False, True])
def test_hybrid_tree_drafts_no_tree_where_trees_do_not_pay(target_model, tmp_path, dear):
    # On a target whose 4-token forward costs 3.4 steps (llama.cpp-like) a tree cannot pay (at most 2 tokens for 3.5
    # units): the drafter decodes plainly and only probes the tree now and then. Where a 4-token forward and the draft
    # cost nothing extra, any tree pays (1 + accepted > 1), so it drafts one in every round lookup leaves.
    from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.drafters.tree import TreeDrafter
    from jointspec.verifiers.tree import TreeRejectionVerifier

    folder = tmp_path / "untrained"
    untrained_head(CausalLM(target_model), draft_vocab_size=40).save(folder)
    target = CausalLM(target_model, name="tiny-target")
    curve = CostCurve({1: 1.0, 2: 1.8, 4: 3.4, 5: 4.0} if dear else {1: 1.0, 2: 1.0, 4: 1.0, 5: 1.5})
    lookup = CostAwareDrafter(PromptLookupDrafter(4, 3, 3, 4), curve, max_num_draft_tokens=4)  # 3-grams: rare
    drafter = LookupOrTreeDrafter(lookup, TreeDrafter(bind_head(folder, target), (3,)), curve,
                                  draft_cost_per_call=0.1 if dear else 0.0)
    decoder = SpeculativeDecoder(target, drafter, TreeRejectionVerifier(replacement=True))
    prompt = random_prompt(5)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    non_lookup_rounds = decoder.stats.num_rounds - drafter.num_lookup_rounds
    if dear:
        assert drafter.tree_speedup() < 1 and drafter.num_tree_rounds <= 6 < non_lookup_rounds  # probes 1, 3, 7, ...
    else:
        assert drafter.num_tree_rounds == non_lookup_rounds
