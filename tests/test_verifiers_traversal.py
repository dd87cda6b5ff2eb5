"""Losslessness of traversal verification (``verifiers/traversal.py``), with the harness of the tree verifiers:
two-level trees drawn from hand-made draft tables on a 5-token vocabulary, the verifier run once per draw, and
chi-square tests of the first emitted tokens against the target tables (tests/tree_tables.py). For a fresh seed each
lossless check fails falsely with probability ``ALPHA`` = 1e-4; the mutants (the ones the derivation in shared
research lists, each at a known distance from the target's law) must give p-values below ``ALPHA`` on the same test.
"""

from __future__ import annotations

import pytest
import torch
from tree_tables import ALPHA, DRAFT, NUM_DRAWS, NUM_SMALL, TARGET, disjoint_case, p_values, run_verifier

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.verifiers.traversal import ROOT, TraversalVerifier
from jointspec.verifiers.tree import TreeRejectionVerifier


@pytest.mark.parametrize("replacement", [True, False], ids=["with-replacement", "without-replacement"])
@pytest.mark.parametrize("branching, num", [((3, 2), NUM_DRAWS), ((1, 1), NUM_SMALL)], ids=["3x2", "chain"])
def test_traversal_is_lossless(replacement, branching, num):
    # (2, 2) trees at 50,000 draws: in the test that compares with recursive rejection below.
    third = []  # (the third token: the bonus after a kept leaf)
    first, second = run_verifier(TraversalVerifier(replacement), TARGET, DRAFT, branching, num, replacement, seed=30,
                                 third=third)
    assert min(p_values(TARGET, first, second, third)) > ALPHA


@pytest.mark.parametrize("case", ["draft-is-target", "disjoint", "one-hot"])
def test_traversal_edge_cases_are_lossless(case):
    # With replacement: the disjoint draft has two first-level tokens, fewer than three siblings drawn without it.
    target_tables, draft_tables = {"draft-is-target": (TARGET, TARGET), "disjoint": disjoint_case(),
                                   "one-hot": (TARGET, DRAFT)}[case]
    first, second = run_verifier(TraversalVerifier(True), target_tables, draft_tables, (3, 2), NUM_SMALL, True,
                                 seed=31, one_hot=case == "one-hot")
    assert min(p_values(target_tables, first, second)) > ALPHA


class WeightNotUpdated(TraversalVerifier):
    """Mutant: a parent keeps its weight after a child is folded into it."""

    def _fold(self, node, parent, live, after, drawn_from, tokens, weight):
        kept = weight[parent]
        super()._fold(node, parent, live, after, drawn_from, tokens, weight)
        if weight[parent] != kept:
            weight[parent] = kept
            self._refresh(parent, live, after, drawn_from, tokens, weight)


class OriginalRowAfterFold(TraversalVerifier):
    """Mutant: the token after a node whose children were all rejected comes from the target's original row there,
    not from the residual."""

    def _fold(self, node, parent, live, after, drawn_from, tokens, weight):
        original = after[parent]
        super()._fold(node, parent, live, after, drawn_from, tokens, weight)
        after[parent] = original


class SiblingsByTargetProbability(TraversalVerifier):
    """Mutant: siblings tried in order of the target's probability instead of their draw order."""

    def verify(self, draft, target_logits, sampling, generator):
        from jointspec.core.sampling import processed_probs

        target = processed_probs(target_logits, sampling)
        parents, order = draft.node_parents(), list(range(draft.num_nodes))
        score = {i: float(target[parents[i] + 1][draft.token_ids[i]]) for i in order}
        order.sort(key=lambda i: (parents[i], -score[i]))  # parents keep their place: level by level
        remap = {old: new for new, old in enumerate(order)}
        reordered = Draft([draft.token_ids[i] for i in order], draft.draft_probs[order],
                          [ROOT if parents[i] == ROOT else remap[parents[i]] for i in order])
        logits = torch.cat([target_logits[:1], target_logits[1:][order]])
        verdict = super().verify(reordered, logits, sampling, generator)
        return type(verdict)([order[i] for i in verdict.accepted], verdict.token_ids)


@pytest.mark.parametrize("mutant", [WeightNotUpdated, OriginalRowAfterFold, SiblingsByTargetProbability])
def test_traversal_mutants_are_rejected(mutant):
    first, second = run_verifier(mutant(False), TARGET, DRAFT, (3, 2), NUM_SMALL, False, seed=32)
    assert min(p_values(TARGET, first, second)) < ALPHA


@pytest.mark.parametrize("replacement", [False], ids=["without-replacement"])
def test_traversal_keeps_more_than_recursive_rejection_on_the_same_trees(replacement):
    """The same seeded trees, verified both ways: traversal keeps more draft tokens on average. The gap is a few
    hundredths of a token against a per-round spread of about one token, so 50,000 paired rounds resolve it with a
    margin of many standard errors; both verifiers are also held to the target's law here."""
    kept_traversal: list[int] = []
    kept_top_down: list[int] = []
    for verifier, kept in ((TraversalVerifier(replacement), kept_traversal),
                           (TreeRejectionVerifier(replacement), kept_top_down)):
        first, second = run_verifier(verifier, TARGET, DRAFT, (2, 2), NUM_DRAWS, replacement, seed=33, kept=kept)
        assert min(p_values(TARGET, first, second)) > ALPHA
    gap = torch.tensor(kept_traversal, dtype=torch.float64) - torch.tensor(kept_top_down, dtype=torch.float64)
    standard_error = float(gap.std()) / len(gap) ** 0.5
    assert float(gap.mean()) > 4 * standard_error


def test_traversal_at_temperature_0_and_without_draft_rows_decodes_like_the_top_down_walk():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=generator)
    draft = Draft([int(logits[0].argmax()), 1, 2, 3, 4], None, [-1, -1, 0, 0, 1])
    greedy = SamplingConfig(0.0)
    assert TraversalVerifier().verify(draft, logits, greedy, None) == TreeRejectionVerifier().verify(
        draft, logits, greedy, None)
    sampled = SamplingConfig(1.0)
    ours = TraversalVerifier().verify(draft, logits, sampled, torch.Generator().manual_seed(4))
    theirs = TreeRejectionVerifier().verify(draft, logits, sampled, torch.Generator().manual_seed(4))
    assert ours == theirs  # one-hot drafts go to recursive rejection: the same draws


def test_specinfer_verifies_by_traversal_when_asked_and_stays_greedy_exact(target_model):
    from jointspec.backends.hf import CausalLM
    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
    from jointspec.methods import MethodConfig, MethodContext, build_method

    from helpers import greedy, hf_greedy, random_prompt

    target = CausalLM(target_model)
    config = MethodConfig(name="specinfer", draft="self", tree=(2, 2), verify="traversal")
    drafter, verifier = build_method(MethodContext(config, target, None, None))
    assert isinstance(verifier, TraversalVerifier)
    decoder = SpeculativeDecoder(target, drafter, verifier)
    prompt = random_prompt(3)
    assert decoder.generate(prompt, greedy(24)) == hf_greedy(target_model, prompt, 24)
    sampling = DecodeConfig(24, SamplingConfig(1.0, top_k=10))
    sampled = decoder.generate(prompt, sampling, torch.Generator().manual_seed(1))
    assert len(sampled) == 24 and decoder.stats.acceptance_per_position[0] == 1.0  # a self-draft's children pass
    with pytest.raises(UnsupportedOptionError, match="no traversal verification"):
        build_method(MethodContext(MethodConfig(name="sps", draft="self", verify="traversal"), target, None, None))
