"""Exact MTJD on a tiny vocabulary, the target-only beam approximation, the idealised MTAD bound.

Everything here is exact or deterministic (no statistical tests).
"""

from __future__ import annotations

import pytest
import torch

from jointspec.analysis.mtjd import (
    all_prefixes_tree,
    beam_mtjd_generate,
    exact_block_distribution,
    idealised_mtad,
    mtjd_greedy_block,
    total_variation,
)
from jointspec.backends.hf import CausalLM
from jointspec.core.draft import NoDrafter
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig, processed_probs
from jointspec.drafters.beam import beam_search
from jointspec.drafters.treecache import DraftTreeCache
from jointspec.verifiers.rejection import RejectionSamplingVerifier

from helpers import tiny_llama

SMALL_VOCAB = 7
CONTEXT = [1, 4, 3]
RAW = SamplingConfig(1.0)  # the untruncated joint: what beam search ranks by


@pytest.fixture(scope="module")
def small_model():
    return tiny_llama(3, vocab=SMALL_VOCAB)


def test_prefix_tree_layout():
    parents, tokens = all_prefixes_tree(3, 2)
    assert tokens == [0, 1, 2] + [0, 1, 2] * 3
    assert parents == [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_exact_block_distribution_matches_sequential_scoring(small_model):
    model = CausalLM(small_model)
    sampling = SamplingConfig(0.8, top_k=5)
    joint = exact_block_distribution(model, CONTEXT, 3, sampling)  # [7, 7, 7]
    assert joint.shape == (SMALL_VOCAB,) * 3 and abs(float(joint.sum()) - 1.0) < 1e-6  # float32 rows
    assert model.num_cached == 0  # the probe used its own cache
    for block in [(0, 0, 0), (2, 5, 1), (6, 3, 3), mtjd_greedy_block(joint)]:
        probability = 1.0
        for i in range(3):
            ids = torch.tensor([CONTEXT + list(block[:i])], device=small_model.device)
            with torch.no_grad():
                logits = small_model(input_ids=ids).logits[0, -1]
            probability *= float(processed_probs(logits, sampling)[block[i]])
        assert abs(float(joint[block]) - probability) < 1e-5


def test_beam_search_wide_enough_finds_the_joint_argmax(small_model):
    joint = exact_block_distribution(CausalLM(small_model), CONTEXT, 2, RAW)
    cache = DraftTreeCache(CausalLM(small_model))
    cache.start()
    # With as many beams as the vocabulary, depth-2 beam search keeps every first token: it is exhaustive.
    beams = beam_search(cache, CONTEXT, 2, SMALL_VOCAB, SamplingConfig(0.0), None)
    best = tuple(beams.token_ids[i] for i in beams.path(beams.beams[beams.best_beam]))
    assert best == mtjd_greedy_block(joint)
    assert abs(float(beams.beam_log_joint.max()) - float(joint.max().log())) < 1e-5


def test_beam_mtjd_with_one_beam_is_greedy_and_wider_beams_find_likelier_blocks(target_model):
    greedy = SamplingConfig(0.0)
    plain = SpeculativeDecoder(CausalLM(target_model), NoDrafter(), RejectionSamplingVerifier())
    expected = plain.generate(CONTEXT, DecodeConfig(10, greedy))
    assert beam_mtjd_generate(CausalLM(target_model), CONTEXT, 10, 3, 1, greedy, None) == expected
    wide = beam_mtjd_generate(CausalLM(target_model), CONTEXT, 3, 3, 4, greedy, None)

    def log_joint(block):
        ids = torch.tensor([CONTEXT + block], device=target_model.device)
        with torch.no_grad():
            logits = target_model(input_ids=ids).logits[0, len(CONTEXT) - 1:-1]
        return float(logits.log_softmax(-1).gather(-1, ids[0, len(CONTEXT):, None]).sum())

    assert log_joint(wide) >= log_joint(expected[:3]) - 1e-6


def test_beam_mtjd_stops_at_eos(target_model):
    greedy = SamplingConfig(0.0)
    free = beam_mtjd_generate(CausalLM(target_model), CONTEXT, 8, 3, 2, greedy, None)
    eos = frozenset({free[4]})
    out = beam_mtjd_generate(CausalLM(target_model), CONTEXT, 8, 3, 2, greedy, None, eos)
    assert out[-1] in eos and len(out) <= 5 and all(t not in eos for t in out[:-1])


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.9])
def test_idealised_mtad_bound_holds_on_random_joints(tau):
    g = torch.Generator().manual_seed(int(tau * 10))
    for _ in range(50):
        target = torch.softmax(torch.randn(16, generator=g) * 2, 0)  # a joint over 4 x 4 blocks, flattened
        draft = torch.softmax(target.log() + torch.randn(16, generator=g), 0)
        ideal = idealised_mtad(target, draft, tau)
        assert total_variation(ideal.law, target) <= ideal.bound + 1e-12
        assert 1 - ideal.kept_mass <= total_variation(draft, target) / (1 - tau) + 1e-12
    same = idealised_mtad(target, target, tau)
    assert same.kept_mass == pytest.approx(1.0) and total_variation(same.law, target) < 1e-6
