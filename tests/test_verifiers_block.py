"""Block verification (``jointspec.verifiers.block``): lossless by exact law and by chi-square, and never fewer tokens
per round than token-wise verification.

Setup, as in test_verifiers_rejection.py: a 4-token vocabulary and a target given directly as rows, ``p_0`` after the
committed context and ``p_i`` after the i-th draft token, with rows that differ by position (one row for every
position would hide a verifier that reads the wrong one). Draft token ``i`` is drawn from ``q_i``, half the target's
row and half noise, independently of the others. Rows that ignore the tokens before them are a legitimate model, and
with them the target's law of the first two emitted tokens is ``p_0(a) p_1(b)``; a round that emits one token is
completed with a draw from ``p_1``.

1. Exact law: every draft of 3 tokens is enumerated with its probability; the decision's law of the kept length
   (``BlockDecision.law_of_kept_length``) and the residual give the law of the first two emitted tokens, which must
   equal ``p_0 x p_1`` to 1e-12. Two mutants (the residual without the weight; the weight without its per-step
   clamp) must miss it by more than 1e-4. Deterministic.
2. ``verify()`` itself, 30,000 seeded rounds: Pearson's chi-square on the 16 cells of the first two tokens. A correct
   verifier fails at ALPHA = 1e-4 (its seeds are fixed, so the test passes or fails the same way on every run; the
   chance that these seeds were unlucky is at most 1e-4). Two mutants that scan the wrong way or drop the residual
   mass from ``h`` are rejected with p-values far below ALPHA (deviations of order 1e-2 to 1e-1 in the cells).
3. ``verify()`` again, on all GAMMA + 1 tokens of a round (the bonus after a whole block included; a shorter round
   completed from the target's rows): 30,000 rounds, the same ALPHA, and a mutant that draws the bonus from the
   wrong row, which the first two tokens cannot show.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import Draft
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers import block
from jointspec.verifiers.block import BlockDecision, BlockVerifier, block_decision, block_residual

from helpers import greedy, hf_greedy, random_prompt

VOCAB = 4
GAMMA = 3
ALPHA = 1e-4
T1 = SamplingConfig(temperature=1.0)
_rng = np.random.default_rng(7)
TARGET = _rng.random((GAMMA + 1, VOCAB)) + 0.05
TARGET /= TARGET.sum(axis=1, keepdims=True)
_NOISE = _rng.random((GAMMA, VOCAB)) + 0.05
DRAFT = 0.5 * TARGET[:GAMMA] + 0.5 * _NOISE / _NOISE.sum(axis=1, keepdims=True)


def exact_first_two(target: np.ndarray, draft: np.ndarray, decide=block_decision,
                    residual=block_residual) -> np.ndarray:
    """The exact law of the first two emitted tokens under block verification of every 3-token draft."""
    p, q = torch.tensor(target, dtype=torch.float64), torch.tensor(draft, dtype=torch.float64)
    law = np.zeros((VOCAB, VOCAB))
    for tokens in itertools.product(range(VOCAB), repeat=GAMMA):
        drafted = float(np.prod([draft[i, token] for i, token in enumerate(tokens)]))
        decision = decide(p, q, list(tokens))
        for kept, chance in enumerate(decision.law_of_kept_length()):
            weight = drafted * chance
            if kept >= 2:
                law[tokens[0], tokens[1]] += weight
                continue
            after = (target[GAMMA] if kept == GAMMA else
                     residual(p[kept], q[kept], decision.weights[kept]).numpy())
            if kept == 1:
                law[tokens[0]] += weight * after
            else:  # the round emitted one token: complete it with the target's row 1
                law += weight * np.outer(after, target[1])
    return law


def test_the_exact_law_is_the_targets():
    law = exact_first_two(TARGET, DRAFT)
    assert np.abs(law - np.outer(TARGET[0], TARGET[1])).max() < 1e-12


def unclamped_decision(target_rows, draft_rows, tokens) -> BlockDecision:
    """Mutant: the weight is the plain product of ratios, clamped once at the end instead of at every step."""
    product, weights = 1.0, [1.0]
    for i, token in enumerate(tokens):
        product *= float(target_rows[i, token] / draft_rows[i, token])
        weights.append(min(product, 1.0))
    keep = []
    for i in range(1, len(tokens)):
        rho = float((weights[i] * target_rows[i] - draft_rows[i]).clamp_min(0.0).sum())
        keep.append(rho / (rho + 1.0 - weights[i]) if rho + 1.0 - weights[i] > 0 else 1.0)
    keep.append(weights[-1])
    return BlockDecision(weights, keep)


@pytest.mark.parametrize("mutant", [
    {"residual": lambda target_row, draft_row, weight: block_residual(target_row, draft_row, 1.0)},
    {"decide": unclamped_decision},
], ids=["residual-without-weight", "no-per-step-clamp"])
def test_the_exact_law_check_rejects_mutants(mutant):
    law = exact_first_two(TARGET, DRAFT, **mutant)
    assert np.abs(law - np.outer(TARGET[0], TARGET[1])).max() > 1e-4


def token_wise_mean_kept(target: np.ndarray, draft: np.ndarray) -> float:
    """E[tokens kept] under token-wise speculative sampling with position-only rows: sum_i prod_{j<=i} beta_j."""
    accepted = np.minimum(target[:len(draft)], draft).sum(axis=1)
    return float(np.cumprod(accepted).sum())


def block_mean_kept(target: np.ndarray, draft: np.ndarray) -> float:
    p, q = torch.tensor(target, dtype=torch.float64), torch.tensor(draft, dtype=torch.float64)
    gamma = len(draft)
    mean = 0.0
    for tokens in itertools.product(range(target.shape[1]), repeat=gamma):
        drafted = float(np.prod([draft[i, token] for i, token in enumerate(tokens)]))
        law = block_decision(p, q, list(tokens)).law_of_kept_length()
        mean += drafted * sum(kept * chance for kept, chance in enumerate(law))
    return mean


def test_block_keeps_more_tokens_than_token_wise():
    # The worked case of docs/methods.md's source notes: w_1 in (0, 1) and residual mass ahead.
    target = np.array([[.5, .5, 0], [.4, .4, .2], [.3, .3, .4]])
    draft = np.array([[.6, .2, .2], [.2, .3, .5]])
    assert token_wise_mean_kept(target, draft) == pytest.approx(1.19, abs=1e-12)
    assert block_mean_kept(target, draft) == pytest.approx(1.24, abs=1e-12)
    assert block_mean_kept(TARGET, DRAFT) > token_wise_mean_kept(TARGET, DRAFT)


@pytest.mark.parametrize("case", ["worked", "random-rows"])
def test_expected_kept_lengths_of_one_draft_average_to_each_verifiers_mean(case):
    """expected_kept_lengths gives, for one fixed draft, each verifier's expected kept length over its own uniforms;
    weighted by how likely each draft is, they must give the two means above exactly. Deterministic."""
    target, draft = ((np.array([[.5, .5, 0], [.4, .4, .2], [.3, .3, .4]]), np.array([[.6, .2, .2], [.2, .3, .5]]))
                     if case == "worked" else (TARGET, DRAFT))
    p, q = torch.tensor(target, dtype=torch.float64), torch.tensor(draft, dtype=torch.float64)
    means = np.zeros(2)
    for tokens in itertools.product(range(target.shape[1]), repeat=len(draft)):
        drafted = float(np.prod([draft[i, token] for i, token in enumerate(tokens)]))
        means += drafted * np.array(block.expected_kept_lengths(p, q, list(tokens)))
    assert means[0] == pytest.approx(token_wise_mean_kept(target, draft), abs=1e-12)
    assert means[1] == pytest.approx(block_mean_kept(target, draft), abs=1e-12)
    assert means[1] > means[0]


def first_two_counts(verifier, num_rounds: int, seed: int) -> np.ndarray:
    logits = torch.tensor(TARGET).log().float()
    draft_rows = torch.tensor(DRAFT, dtype=torch.float32)
    second_row = torch.tensor(TARGET[1], dtype=torch.float32)
    drafting, verifying, completing = (torch.Generator().manual_seed(seed + k) for k in range(3))
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(num_rounds):
        tokens = torch.multinomial(draft_rows, 1, generator=drafting).squeeze(1).tolist()
        emitted = verifier.verify(Draft(tokens, draft_probs=draft_rows), logits, T1, verifying).token_ids
        second = emitted[1] if len(emitted) > 1 else int(torch.multinomial(second_row, 1, generator=completing))
        counts[emitted[0], second] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray) -> float:
    expected = np.outer(TARGET[0], TARGET[1]).ravel() * counts.sum()
    return float(stats.chisquare(counts.ravel(), expected).pvalue)


def test_verify_is_lossless_by_chi_square():
    assert chi_square_pvalue(first_two_counts(BlockVerifier(), 30_000, seed=11)) > ALPHA


def whole_round_counts(verifier, num_rounds: int, seed: int) -> np.ndarray:
    """Counts of the first GAMMA + 1 emitted tokens: a round that keeps the whole block emits all of them (the last
    is the bonus, from the target's row after the block); a shorter one is completed by draws from the target's rows,
    as the next rounds would emit with these position-only rows."""
    logits = torch.tensor(TARGET).log().float()
    draft_rows = torch.tensor(DRAFT, dtype=torch.float32)
    rows = torch.tensor(TARGET, dtype=torch.float32)
    drafting, verifying, completing = (torch.Generator().manual_seed(seed + k) for k in range(3))
    counts = np.zeros((VOCAB,) * (GAMMA + 1))
    for _ in range(num_rounds):
        tokens = torch.multinomial(draft_rows, 1, generator=drafting).squeeze(1).tolist()
        emitted = verifier.verify(Draft(tokens, draft_probs=draft_rows), logits, T1, verifying).token_ids
        for position in range(len(emitted), GAMMA + 1):
            emitted.append(int(torch.multinomial(rows[position], 1, generator=completing)))
        counts[tuple(emitted)] += 1
    return counts


class BonusFromTheLastDraftRow(BlockVerifier):
    """Mutant: the bonus after a whole kept block is drawn from the row of the block's last token (the verifier is
    given that row in place of the one after the block, which nothing else reads)."""

    def verify(self, draft, target_logits, sampling, generator):
        rows = target_logits.clone()
        rows[len(draft.token_ids)] = target_logits[len(draft.token_ids) - 1]
        return super().verify(draft, rows, sampling, generator)


@pytest.mark.parametrize("verifier, lossless", [(BlockVerifier(), True), (BonusFromTheLastDraftRow(), False)],
                         ids=["block", "bonus-from-the-wrong-row"])
def test_every_token_of_a_round_follows_the_target_bonus_included(verifier, lossless):
    """The law of a round's GAMMA + 1 tokens (256 cells, 30,000 rounds): the residual after each kept length and the
    bonus after a whole block. A correct verifier fails at ALPHA = 1e-4 (fixed seeds); the mutant's p-value was 0 in
    double precision when written."""
    counts = whole_round_counts(verifier, 30_000, seed=17)
    law = TARGET[0]
    for row in TARGET[1:]:
        law = np.multiply.outer(law, row)
    pvalue = float(stats.chisquare(counts.ravel(), law.ravel() * counts.sum()).pvalue)
    assert (pvalue > ALPHA) if lossless else (pvalue < ALPHA), pvalue


class FrontToBackVerifier(BlockVerifier):
    """Mutant: keeps the prefix up to the first position that fails, as token-wise verification would."""

    def verify(self, draft, target_logits, sampling, generator):
        rows = processed_probs(target_logits, sampling)
        tokens = list(draft.token_ids)
        decision = block_decision(rows, draft.draft_probs, tokens)
        uniforms = torch.rand(len(tokens), generator=generator).tolist()
        kept = next((i for i in range(len(tokens)) if uniforms[i] > decision.keep[i]), len(tokens))
        row = rows[kept] if kept == len(tokens) else block_residual(rows[kept], draft.draft_probs[kept],
                                                                     decision.weights[kept])
        return Verdict(list(range(kept)), tokens[:kept] + [int(sample(row, generator))])


def keep_is_weight(target_rows, draft_rows, tokens) -> BlockDecision:
    """Mutant: h_i = w_i, without the residual mass that makes the law right."""
    decision = block_decision(target_rows, draft_rows, tokens)
    return BlockDecision(decision.weights, decision.weights[1:])


@pytest.mark.parametrize("mutant", ["front-to-back", "keep-is-weight"])
def test_the_chi_square_test_rejects_mutants(mutant, monkeypatch):
    if mutant == "keep-is-weight":
        monkeypatch.setattr(block, "block_decision", keep_is_weight)
        verifier = BlockVerifier()
    else:
        verifier = FrontToBackVerifier()
    assert chi_square_pvalue(first_two_counts(verifier, 30_000, seed=11)) < ALPHA


def test_greedy_block_verification_equals_plain_decoding(target_model, other_model):
    """At temperature 0 block verification is greedy matching: the output is plain greedy decoding's."""
    load = lambda source: (CausalLM(other_model, name=source), None)  # noqa: E731
    target = CausalLM(target_model)
    drafter, verifier = build_method(MethodContext(MethodConfig(name="sps", draft="other", verify="block"), target,
                                                   None, load))
    assert isinstance(verifier, BlockVerifier)
    decoder = SpeculativeDecoder(target, drafter, verifier)
    for seed in (1, 2):
        prompt = random_prompt(seed)
        assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)


def test_block_verification_is_offered_where_it_applies(target_model):
    with pytest.raises(ValueError, match="verify must be one of"):
        MethodConfig(name="sps", verify="blocks")
    with pytest.raises(UnsupportedOptionError, match="sps, hybrid, pearl and sparse-self"):
        build_method(MethodContext(MethodConfig(name="pld", verify="block"), CausalLM(target_model), None, None))
    # The message names every chain method that takes it: each builds a block verifier.
    target = CausalLM(target_model)
    load = lambda source: (target, None)  # noqa: E731
    for name, draft in (("sps", "self"), ("hybrid", "self"), ("pearl", "self"), ("sparse-self", None)):
        _, verifier = build_method(MethodContext(MethodConfig(name=name, draft=draft, verify="block"), target, None,
                                                 load))
        assert isinstance(verifier, BlockVerifier), name
