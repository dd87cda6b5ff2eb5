"""MTAD's verifier (chain and tree) through the one decode loop and on hand-made logits, and the idealised MTAD law.
Its beam drafter is tested in test_drafters_beam.py, the registered joint methods in test_methods.py.

Settings: draft length 4 and 3 beams give several rounds within 20-30 new tokens; the tiny models (conftest) have
sharpened logits so greedy near-ties are vanishingly rare. The statistical test (idealised MTAD law) is seeded and
deterministic; for a fresh seed its chi-square check fails falsely with probability 1e-4.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from jointspec.analysis.mtjd import idealised_mtad, total_variation
from jointspec.backends.hf import CausalLM
from jointspec.core.draft import Draft, NoDrafter
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.beam import BeamDrafter
from jointspec.verifiers.mtad import MTADVerifier
from jointspec.verifiers.rejection import RejectionSamplingVerifier

GREEDY = SamplingConfig(0.0)
PROMPT = [1, 17, 42, 5, 88]


def plain(target_model, prompt, config: DecodeConfig, seed: int = 0) -> list[int]:
    decoder = SpeculativeDecoder(CausalLM(target_model), NoDrafter(), RejectionSamplingVerifier())
    return decoder.generate(prompt, config, torch.Generator().manual_seed(seed))


def mtad(target_model, draft_model, prompt, config: DecodeConfig, *, tree: bool, tau: float = 0.5,
         num_draft_tokens: int = 4, beam_width: int = 3, seed: int = 0) -> SpeculativeDecoder:
    drafter = BeamDrafter(CausalLM(draft_model), num_draft_tokens, beam_width, tree=tree,
                          eos_token_ids=config.eos_token_ids)
    decoder = SpeculativeDecoder(CausalLM(target_model), drafter, MTADVerifier(tau))
    decoder.output = decoder.generate(prompt, config, torch.Generator().manual_seed(seed))
    return decoder


# --- greedy: MTAD at temperature 0 is greedy speculative decoding ---------------------------------------------------

@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("drafter", ["self", "other"])
def test_greedy_mtad_equals_plain_greedy(target_model, other_model, tree, drafter):
    config = DecodeConfig(max_new_tokens=23, sampling=GREEDY)  # 23: the last block is cut by the length budget
    expected = plain(target_model, PROMPT, config)
    draft_model = target_model if drafter == "self" else other_model
    decoder = mtad(target_model, draft_model, PROMPT, config, tree=tree)
    assert decoder.output == expected
    assert len(decoder.output) == 23
    if drafter == "self":
        assert decoder.stats.num_accepted_tokens > 0  # the beam search shares most of its path with greedy


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_with_eos_inside_a_block_and_one_token_prompt(target_model, tree):
    reference = plain(target_model, [7], DecodeConfig(max_new_tokens=20, sampling=GREEDY))
    eos = reference[6]  # greedy decoding stops at its first occurrence, usually mid-block
    config = DecodeConfig(max_new_tokens=20, sampling=GREEDY, eos_token_ids=frozenset({eos}))
    expected = plain(target_model, [7], config)
    assert expected[-1] == eos and len(expected) <= 7
    decoder = mtad(target_model, target_model, [7], config, tree=tree)
    assert decoder.output == expected


def test_gamma_one(target_model, other_model):
    config = DecodeConfig(max_new_tokens=9, sampling=GREEDY)
    for tree in (False, True):
        decoder = mtad(target_model, other_model, PROMPT, config, tree=tree, num_draft_tokens=1)
        assert decoder.output == plain(target_model, PROMPT, config)
        assert len(decoder.stats.drafted_per_position) == 1
    sampled = mtad(target_model, other_model, PROMPT, DecodeConfig(9, SamplingConfig(1.0, top_k=10)), tree=False,
                   num_draft_tokens=1)
    assert len(sampled.output) == 9


# --- sampling ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("sampling", [SamplingConfig(1.0), SamplingConfig(1.0, top_k=10, top_p=0.9)],
                         ids=["raw", "top-k-top-p"])
def test_self_draft_accepts_everything(target_model, tree, sampling):
    """Draft = target with the same processing: every joint ratio is 1 (up to fp32 noise), so tau = 1 keeps all."""
    decoder = mtad(target_model, target_model, PROMPT, DecodeConfig(max_new_tokens=25, sampling=sampling),
                   tree=tree, tau=1.0, seed=3)
    assert decoder.stats.acceptance_per_position == [1.0] * 4


# --- the verifier on hand-made logits ---------------------------------------------------------------------------------

def logits_from(rows: list[list[float]]) -> torch.Tensor:
    """Logits whose softmax is the given probability rows ([num_rows, vocab]); zeros become -inf (exactly 0)."""
    return torch.tensor(rows).log()


def test_longest_passing_prefix_not_first_failure():
    # Draft joint of prefixes: 0.5, 0.5*0.5 = 0.25, 0.25*1.0; target: 0.2, 0.2*0.9 = 0.18, 0.18*0.1 = 0.018.
    # Ratios 0.4 (fails tau = 0.6), 0.72 (passes), 0.072 (fails): the longest passing prefix has 2 tokens.
    draft = Draft(token_ids=[1, 2, 0], draft_logprobs=torch.tensor([0.5, 0.5, 1.0]).log())
    target = logits_from([[0.8, 0.2, 0.0], [0.05, 0.05, 0.9], [0.1, 0.0, 0.9], [0.0, 1.0, 0.0]])
    verdict = MTADVerifier(0.6).verify(draft, target, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert verdict.accepted == [0, 1]
    assert verdict.token_ids[:2] == [1, 2] and verdict.token_ids[2] in (0, 2)  # endpoint from row 2 (after node 1)


def test_tree_threshold_uses_each_nodes_own_path_and_ties_by_target_joint():
    # Level 0: nodes 0 (token 0) and 1 (token 1); level 1: node 2 (child of 0), nodes 3, 4 (children of 1).
    draft = Draft(token_ids=[0, 1, 2, 2, 0], parents=[-1, -1, 0, 1, 1],
                  draft_logprobs=torch.tensor([0.9, 0.1, 0.9, 0.5, 0.5]).log())
    target = logits_from([[0.9, 0.1, 0.0],  # row 0: nodes 0 and 1 match the draft exactly
                          [0.4, 0.0, 0.6],  # after node 0: node 2 (token 2) has 0.6
                          [0.2, 0.0, 0.8],  # after node 1: node 3 (token 2) 0.8, node 4 (token 0) 0.2
                          [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # Own-path ratios at depth 1: node 2: 0.54/0.81 = 0.67; node 3: 0.08/0.05 = 1.6; node 4: 0.02/0.05 = 0.4.
    # tau = 0.8: only node 3 passes. (Against the best beam's draft joint, 0.81 (node 2), as the reference code
    # thresholds, nothing at depth 1 would pass.)
    sampling, g = SamplingConfig(1.0), torch.Generator().manual_seed(0)
    verdict = MTADVerifier(0.8).verify(draft, target, sampling, g)
    assert verdict.accepted == [1, 3] and verdict.token_ids == [1, 2, 0]
    # tau = 0.35: nodes 2, 3 and 4 pass; node 2 has the largest target joint (0.54).
    verdict = MTADVerifier(0.35).verify(draft, target, sampling, g)
    assert verdict.accepted == [0, 2] and verdict.token_ids == [0, 2, 0]


def test_nothing_passes_and_off_support_tokens_fail():
    draft = Draft(token_ids=[2, 1], draft_logprobs=torch.tensor([float("-inf"), 0.0]))  # -inf - -inf = nan
    target = logits_from([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    verdict = MTADVerifier(0.01).verify(draft, target, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert verdict.accepted == [] and verdict.token_ids[0] in (0, 1)


# --- the idealised MTAD law and its TV bound (research/mtad.md §4) ----------------------------------------------------

def test_idealised_mtad_law_and_tv_bound():
    """Blocks y ~ Q that the chain verifier keeps whole follow pi = Q restricted to {P >= tau Q}, renormalised, and
    TV(pi, P) <= TV(Q, P)·(2 - tau)/(1 - tau), where P is the exact target joint (exact MTJD sampling).

    Only the idealised law is bounded: real MTAD proposes the best of W beams and keeps prefixes, so its block law is
    not pi (the bound says how far joint-ratio filtering of *draft samples* can move from the target)."""
    vocab, num = 4, 100_000
    g = torch.Generator().manual_seed(5)
    p0 = torch.softmax(torch.randn(vocab, generator=g) * 1.5, 0)
    p1 = torch.softmax(torch.randn(vocab, vocab, generator=g) * 1.5, 1)
    q0 = torch.softmax(p0.log() + 0.6 * torch.randn(vocab, generator=g), 0)  # a draft near the target
    q1 = torch.softmax(p1.log() + 0.6 * torch.randn(vocab, vocab, generator=g), 1)
    target_joint, draft_joint = p0[:, None] * p1, q0[:, None] * q1
    first = torch.multinomial(q0, num, replacement=True, generator=g)
    second = torch.multinomial(q1[first], 1, generator=g)[:, 0]
    for tau in (0.3, 0.5, 0.8):
        verifier = MTADVerifier(tau)
        # Whether a block is kept whole is deterministic (only the endpoint token is random): verify each distinct
        # block once, then count the sampled blocks.
        kept_whole = {}
        for a in range(vocab):
            for b in range(vocab):
                draft = Draft(token_ids=[a, b], draft_logprobs=torch.stack([q0[a], q1[a, b]]).log())
                logits = torch.stack([p0, p1[a], p1[b]]).log()  # the bonus row is irrelevant here
                kept_whole[a, b] = verifier.verify(draft, logits, SamplingConfig(1.0), g).num_accepted == 2
        drawn = torch.bincount(first * vocab + second, minlength=vocab * vocab).reshape(vocab, vocab).double()
        kept = drawn * torch.tensor([[kept_whole[a, b] for b in range(vocab)] for a in range(vocab)])
        ideal = idealised_mtad(target_joint, draft_joint, tau)
        assert ideal.bound < 1.0  # not vacuous
        assert total_variation(ideal.law, target_joint) <= ideal.bound
        assert bool((ideal.law <= target_joint / (tau * ideal.kept_mass) + 1e-12).all())
        empirical = kept / kept.sum()
        # The sampled law's distance from the ideal one: at most 0.0063 in expectation (<= 16 cells, >= 83,000 kept
        # blocks), and by McDiarmid's inequality the 0.02 slack is exceeded with odds below 1e-13.
        assert total_variation(empirical, target_joint) <= ideal.bound + 0.02
        support = ideal.law.flatten() > 0
        assert kept.flatten()[~support].sum() == 0
        p_value = chisquare(kept.flatten()[support].double(), ideal.law.flatten()[support] * kept.sum()).pvalue
        assert p_value > 1e-4
        # The kept share of 10^5 draws has a standard deviation of at most 0.0016: 0.02 is over 12 of them.
        assert math.isclose(float(kept.sum()) / num, ideal.kept_mass, abs_tol=0.02)
