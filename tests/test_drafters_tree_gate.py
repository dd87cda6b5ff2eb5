"""The cost gate of token trees (drafters/tree_gate.py) and the methods behind it: ``specinfer`` and ``spectr`` draft
their tree only while it beats plain decoding on the target's cost curve, unless a tree is given or they are told
not to be cost-aware.

Greedy equivalence is exact by construction; the rest is arithmetic on given cost curves. Deterministic: no
false-failure odds.
"""

from __future__ import annotations

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.core.loop import SpeculativeDecoder
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.tree import TreeDrafter
from jointspec.drafters.tree_gate import GatedTreeDrafter, TreeGate
from jointspec.drafts.eagle import bind_head
from jointspec.verifiers.tree import TreeRejectionVerifier

from helpers import decoder_for, first_occurrences, greedy, hf_greedy, random_prompt, untrained_head

# Curves for a width-3 tree (a 4-token forward) and a draft call of 0.1 step. FREE: extra rows cost nothing, so any
# accepted token pays. SOME: the tree costs 1.7 steps a round and could gain 18 % if it always kept its token, so it
# pays only with a good draft, and a probe (0.7 steps more than a plain round) may come every 16 rounds at most often.
# DEAR (llama.cpp-like): 3.5 steps a round for at most 2 tokens, so no tree can pay.
FREE = CostCurve({1: 1.0, 2: 1.0, 4: 1.0, 5: 1.5})
SOME = CostCurve({1: 1.0, 2: 1.3, 4: 1.6, 5: 2.0})
DEAR = CostCurve({1: 1.0, 2: 1.8, 4: 3.4, 5: 4.0})


def gated_decoder(target_model, folder, curve: CostCurve, **settings) -> tuple[SpeculativeDecoder, GatedTreeDrafter]:
    target = CausalLM(target_model, name="tiny-target")
    drafter = GatedTreeDrafter(TreeDrafter(bind_head(folder, target), (3,)), curve,
                               draft_cost_per_call=0.0 if curve is FREE else 0.1, **settings)
    return SpeculativeDecoder(target, drafter, TreeRejectionVerifier(replacement=True)), drafter


@pytest.mark.parametrize("curve", ["free", "some", "dear"])
def test_the_tree_is_drafted_only_while_it_pays(target_model, tmp_path, curve):
    folder = tmp_path / "untrained"
    untrained_head(CausalLM(target_model), draft_vocab_size=40).save(folder)  # a head that is rarely right
    decoder, drafter = gated_decoder(target_model, folder, {"free": FREE, "some": SOME, "dear": DEAR}[curve])
    prompt = random_prompt(5)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    rounds = decoder.stats.num_rounds
    assert drafter.num_tree_rounds == decoder.stats.drafted_per_position[0] if drafter.num_tree_rounds else True
    if curve == "free":  # every round but the last, where the length limit leaves no room for a draft
        assert drafter.num_tree_rounds == rounds - 1
    elif curve == "some":  # plain rounds, a probe after at least 16 of them: 1 or 2 in 39 rounds
        assert drafter.tree_speedup() < 1 and 1 <= drafter.num_tree_rounds <= 2 < rounds
    else:
        assert drafter.num_tree_rounds == 0


def test_a_tree_drafted_every_round_whatever_it_costs(target_model, tmp_path):
    folder = tmp_path / "untrained"
    untrained_head(CausalLM(target_model), draft_vocab_size=40).save(folder)
    decoder, drafter = gated_decoder(target_model, folder, DEAR, every_round=True)
    prompt = random_prompt(5)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    assert drafter.tree_speedup() < 1
    assert drafter.num_tree_rounds == decoder.stats.drafted_per_position[0] == decoder.stats.num_rounds - 1


def test_the_gate_probes_after_doubling_runs_of_plain_rounds_and_drafts_again_once_it_pays():
    gate = TreeGate(prior_tree_tokens=0.0, prior_weight=1.0, memory=2.0, max_probe_interval=4)
    tree_cost = 2.0  # a tree that pays only if it keeps more than one token a round
    drafted = []
    for _ in range(12):
        due = gate.due(gate.speedup(FREE, tree_cost) > 1.0)
        drafted.append(due)
        if due:
            gate.record(0, FREE, tree_cost)  # nothing accepted
    # probes at rounds 0, 2, 6, 10: intervals 1, 2, 4, then capped at 4
    assert [i for i, due in enumerate(drafted) if due] == [0, 2, 6, 10]
    gate.record(3, FREE, tree_cost)  # a probe that kept three tokens: (1 + 1.5) / 2 > 1
    assert gate.speedup(FREE, tree_cost) > 1 and gate.due(True) and gate.due(True)


@pytest.mark.parametrize("method", ["specinfer", "spectr"])
@pytest.mark.parametrize("max_new_tokens, eos_index", [(40, None), (7, None), (40, 2), (40, -1)])
def test_gated_tree_methods_match_plain_greedy(target_model, trained_head_dir, method, max_new_tokens, eos_index,
                                               monkeypatch):
    """The methods as built by default (gated, specinfer's tree chosen from the curve): greedy decoding, with EOS and
    the length limit inside drafts. On the tiny target's own curve the trees do not pay and it decodes plainly, so the
    methods get a curve where any kept token pays: the tree is then drafted every round."""
    from jointspec.methods import trees

    monkeypatch.setattr(trees, "target_cost_curve", lambda target: CostCurve({1: 1.0, 17: 1.0}))
    monkeypatch.setattr(trees, "draft_cost_per_call", lambda draft, target=None: 0.0)
    prompt = random_prompt(6)
    reference = hf_greedy(target_model, prompt, max_new_tokens)
    by_position = sorted(first_occurrences(reference), key=first_occurrences(reference).get)  # early to late
    eos = frozenset() if eos_index is None else frozenset({by_position[eos_index]})
    if eos:
        reference = reference[:reference.index(next(iter(eos))) + 1]
    decoder = decoder_for(target_model, method, trained_head_dir, num_draft_tokens=3, beam_width=2, cost_aware=None)
    assert type(decoder.drafter) is GatedTreeDrafter and not decoder.drafter.every_round
    assert decoder.generate(prompt, greedy(max_new_tokens, eos)) == reference
    # every round drafts the tree, but a last one where the length limit leaves no room for a draft
    assert decoder.drafter.num_tree_rounds >= decoder.stats.num_rounds - 1


def test_the_lockstep_engine_gives_a_gated_tree_its_batchs_curve():
    from jointspec.batch.lockstep import load_aware_parts

    tree = TreeDrafter.__new__(TreeDrafter)  # the shape is all the gate reads
    tree.branching = (3,)
    drafter = GatedTreeDrafter(tree, FREE, draft_cost_per_call=0.0)
    assert load_aware_parts(drafter) == [drafter]
    drafter.curve = DEAR  # what the engine does as its batch fills
    assert drafter.tree_cost == pytest.approx(DEAR.cost(4))


def test_probes_are_spaced_by_what_they_cost_against_what_the_tree_could_gain():
    from jointspec.drafters.costaware import LEARNING_SHARE_OF_GAIN
    from jointspec.drafters.tree_gate import probe_floor

    assert probe_floor(FREE, 1.0, 1) == 1.0  # a probe that costs nothing may come every round
    # SOME, width 3 with a 0.1 draft call: 0.7 steps a probe against a best gain of 2 / 1.7 - 1
    assert probe_floor(SOME, 1.7, 1) == pytest.approx(0.7 / (LEARNING_SHARE_OF_GAIN * (2 / 1.7 - 1)))
    assert probe_floor(DEAR, 3.5, 1) == float("inf")  # at most 2 tokens for 3.5 steps: never
    assert probe_floor(DEAR, 3.5, 3) < float("inf")  # a deeper tree could keep 4 for the same cost


def test_gate_validation():
    with pytest.raises(ValueError, match="prior_tree_tokens"):
        TreeGate(prior_tree_tokens=-1.0)
    with pytest.raises(ValueError, match="memory"):
        TreeGate(memory=1.0)
    with pytest.raises(ValueError, match="max_probe_interval"):
        TreeGate(max_probe_interval=0)
    with pytest.raises(ValueError, match="draft_cost_per_call"):
        GatedTreeDrafter(object(), FREE, draft_cost_per_call=float("nan"))
