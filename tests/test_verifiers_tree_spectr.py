"""Losslessness of the multi-candidate verifiers (SpecInfer token trees, SpecTr k-sequential selection).

Each case builds a two-level "language" on a tiny vocabulary from hand-made tables: target and draft distributions
after the context, after each first token and after each pair. Drafts are drawn from the draft tables exactly as the
drafters do (k-config trees with or without replacement; k i.i.d. chains for SpecTr), the verifier runs once per
draw, and a chi-square test compares the first emitted token with ``target(. | context)``, the first two with
``target(a) target(b | a)`` and the first three with ``target(a) target(b | a) target(c | a, b)`` (when a round emits
fewer, the rest are drawn from the target, as the next rounds would). The third token is the bonus drawn after a
kept leaf: a verifier that draws it from another row is caught there alone. Every run is seeded, so the tests are
deterministic; for a fresh seed each lossless check fails falsely with probability ``ALPHA`` = 1e-4 (about 1e-3 over
the file), and the mutants must give p-values below ``ALPHA`` too.
"""

from __future__ import annotations

import pytest
import torch
from tree_tables import ALPHA, DRAFT, NUM_DRAWS, NUM_SMALL, TARGET, disjoint_case, p_values, run_verifier

from jointspec.core.sampling import processed_probs, sample
from jointspec.core.verdict import Verdict, children_of
from jointspec.verifiers.spectr import SpecTrVerifier, kseq_rho
from jointspec.verifiers.tree import TreeRejectionVerifier


class NoResidual(TreeRejectionVerifier):
    """Mutant: the recovered token comes from the target row, not from the residual."""

    def _residual(self, target_row, draft_row):
        return target_row


class RhoOne(SpecTrVerifier):
    """Mutant: rho = 1 for any number of candidates (over-accepts; the residual is clamped, hence wrong)."""

    def _rho(self, target_row, draft_row, num_candidates):
        _, beta, _ = kseq_rho(target_row, draft_row, num_candidates)
        return 1.0, sum((1.0 - beta) ** i for i in range(num_candidates))


@pytest.mark.parametrize("replacement", [True, False], ids=["with-replacement", "without-replacement"])
def test_specinfer_is_lossless(replacement):
    third = []
    first, second = run_verifier(TreeRejectionVerifier(replacement), TARGET, DRAFT, (3, 2), NUM_DRAWS, replacement,
                                 seed=10, third=third)
    assert min(p_values(TARGET, first, second, third)) > ALPHA


@pytest.mark.parametrize("case", ["draft-is-target", "disjoint", "one-hot"])
def test_specinfer_edge_cases_are_lossless(case):
    target_tables, draft_tables = {"draft-is-target": (TARGET, TARGET), "disjoint": disjoint_case(),
                                   "one-hot": (TARGET, DRAFT)}[case]
    first, second = run_verifier(TreeRejectionVerifier(True), target_tables, draft_tables, (3, 2), NUM_SMALL, True,
                                 seed=11, one_hot=case == "one-hot")
    assert min(p_values(target_tables, first, second)) > ALPHA


def test_specinfer_mutant_is_rejected():
    first, second = run_verifier(NoResidual(True), TARGET, DRAFT, (3, 2), NUM_SMALL, True, seed=12)
    assert min(p_values(TARGET, first, second)) < ALPHA


class RedrawWhereNoChildMatches(TreeRejectionVerifier):
    """Mutant (children without draft probabilities): where no child has the target's draw, a second draw comes out
    instead of that draw (it can be a child's token)."""

    def verify(self, draft, target_logits, sampling, generator):
        target_probs = processed_probs(target_logits, sampling)
        children = children_of(draft)
        node, path = -1, []
        while True:
            wanted = int(sample(target_probs[node + 1], generator))
            match = next((c for c in children[node] if draft.token_ids[c] == wanted), None)
            if match is None:
                token = int(sample(target_probs[node + 1], generator)) if children[node] else wanted
                return Verdict(path, [draft.token_ids[i] for i in path] + [token])
            path.append(match)
            node = match


def test_one_hot_mutant_is_rejected():
    first, second = run_verifier(RedrawWhereNoChildMatches(True), TARGET, DRAFT, (3, 2), NUM_SMALL, True, seed=14,
                                 one_hot=True)
    assert min(p_values(TARGET, first, second)) < ALPHA


def test_replacement_mismatch_is_rejected():
    """Drafts drawn without replacement but verified as i.i.d. ones: the same test must catch it."""
    first, second = run_verifier(TreeRejectionVerifier(True), TARGET, DRAFT, (3, 2), NUM_SMALL, False, seed=13)
    assert min(p_values(TARGET, first, second)) < ALPHA


def test_spectr_is_lossless():
    third = []
    first, second = run_verifier(SpecTrVerifier(), TARGET, DRAFT, (3, 1), NUM_DRAWS, True, seed=20, third=third)
    assert min(p_values(TARGET, first, second, third)) > ALPHA


class BonusFromTheParentsRow:
    """Mutant of either verifier: a kept leaf's bonus token is drawn from its parent's row (the verifier is given
    the leaves' rows replaced by their parents'; nothing but the bonus reads a leaf's row)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def verify(self, draft, target_logits, sampling, generator):
        rows = target_logits.clone()
        for node, parent in enumerate(draft.parents):
            if parent >= 0:
                rows[node + 1] = target_logits[parent + 1]
        return self.inner.verify(draft, rows, sampling, generator)


@pytest.mark.parametrize("verifier, branching", [(TreeRejectionVerifier(True), (3, 2)), (SpecTrVerifier(), (3, 1))],
                         ids=["specinfer", "spectr"])
def test_a_bonus_drawn_from_the_wrong_row_is_rejected(verifier, branching):
    third = []
    first, second = run_verifier(BonusFromTheParentsRow(verifier), TARGET, DRAFT, branching,
                                 NUM_SMALL, True, seed=22, third=third)
    first_two = p_values(TARGET, first, second)
    assert min(first_two) > ALPHA  # (the first two tokens never read a leaf's row: only the third can tell)
    assert p_values(TARGET, first, second, third)[2] < ALPHA


@pytest.mark.parametrize("case", ["draft-is-target", "disjoint"])
def test_spectr_edge_cases_are_lossless(case):
    target_tables, draft_tables = {"draft-is-target": (TARGET, TARGET), "disjoint": disjoint_case()}[case]
    first, second = run_verifier(SpecTrVerifier(), target_tables, draft_tables, (4, 1), NUM_SMALL, True, seed=21)
    assert min(p_values(target_tables, first, second)) > ALPHA


def test_spectr_mutant_is_rejected():
    first, second = run_verifier(RhoOne(), TARGET, DRAFT, (3, 1), NUM_SMALL, True, seed=22)
    assert min(p_values(TARGET, first, second)) < ALPHA


def test_kseq_rho_qualifies_and_beats_the_trivial_choice():
    p0, q0 = TARGET[0], DRAFT[0]
    for m in (1, 2, 4, 8):
        rho, beta, f = kseq_rho(p0, q0, m)
        assert 1.0 <= rho <= m and f <= rho + 1e-12
        # More candidates never lower the chance of accepting one: 1 - (1 - beta)^m grows with m.
        if m == 1:
            assert rho == 1.0 and abs(beta - float(torch.minimum(p0, q0).sum())) < 1e-6
    rho_same, beta_same, _ = kseq_rho(p0, p0, 4)
    assert rho_same == 1.0 and abs(beta_same - 1.0) < 1e-6  # draft = target: accept the first candidate always
