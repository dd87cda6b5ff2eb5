"""The beam drafter (``jointspec.drafters.beam``, MTAD's): normalised beam weights, tree scores equal to scoring each
path alone, children drawn in proportion to their draft joint, and beams that stop at end-of-sequence tokens.

Deterministic (seeded generators) but for the chi-square test, whose false-failure odds for a fresh seed are 1e-4.
"""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from jointspec.backends.hf import CausalLM
from jointspec.core.sampling import SamplingConfig, processed_probs
from jointspec.drafters.beam import BeamDrafter, _choose, beam_search
from jointspec.drafters.treecache import DraftTreeCache

PROMPT = [1, 17, 42, 5, 88]


def test_beam_weights_are_normalised_draft_joints(other_model):
    cache = DraftTreeCache(CausalLM(other_model))
    cache.start()
    beams = beam_search(cache, PROMPT, 3, 4, SamplingConfig(1.0, top_k=10), torch.Generator().manual_seed(0))
    assert torch.logsumexp(beams.log_weights, 0).abs() < 1e-9
    for leaf, joint in zip(beams.beams, beams.beam_log_joint):
        assert abs(float(beams.draft_logprobs[beams.path(leaf)].sum()) - float(joint)) < 1e-9
    assert beams.best_beam == int(beams.log_weights.argmax())


def test_tree_scores_equal_sequential_scoring(target_model, other_model):
    """Draft log-probs and the target rows of a tree pass equal scoring each path alone, from scratch."""
    sampling = SamplingConfig(1.0, top_k=10, top_p=0.9)
    cache = DraftTreeCache(CausalLM(other_model))
    cache.start()
    beams = beam_search(cache, PROMPT, 3, 3, sampling, torch.Generator().manual_seed(1))
    target = CausalLM(target_model)
    target.forward(PROMPT[:-1], num_logits=0)
    rows = target.forward([PROMPT[-1]] + beams.token_ids, parents=[-1] + [p + 1 for p in beams.parents]).logits
    for node in range(len(beams.token_ids)):
        path = [beams.token_ids[i] for i in beams.path(node)]
        ids = torch.tensor([PROMPT + path], device=target_model.device)
        with torch.no_grad():
            alone_target = target_model(input_ids=ids).logits[0, -1]
            alone_draft = other_model(input_ids=ids[:, :-1]).logits[0, -1]
        assert torch.allclose(rows[1 + node], alone_target, atol=1e-4)
        logq = processed_probs(alone_draft, sampling).log()[path[-1]]
        assert abs(float(logq) - float(beams.draft_logprobs[node])) < 1e-4


def test_beam_children_are_drawn_in_proportion_to_their_draft_joint():
    """``_choose`` draws among the finite scores only; the draws must follow softmax(scores), which a uniform draw
    over the same children must fail. 6,000 seeded draws; false-failure odds 1e-4 for fresh seeds."""
    joints = torch.tensor([0.5, 0.0, 0.3, 0.0, 0.0, 0.15, 0.05], dtype=torch.float64)
    scores = joints.log()  # log 0 = -inf: children cut by top-k/top-p or outside a head's vocabulary
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(joints))
    for _ in range(6000):
        counts[_choose(scores, 1, False, False, generator)] += 1
    support = joints > 0
    assert counts[~support].sum() == 0
    assert chisquare(counts[support], joints[support] * counts.sum()).pvalue > 1e-4
    uniform = torch.full((int(support.sum()),), counts.sum() / int(support.sum()))
    assert chisquare(counts[support], uniform).pvalue < 1e-4  # the broken law is rejected
    # Without replacement, every possible child comes back once when beams outnumber them.
    assert sorted(_choose(scores, 6, False, False, generator).tolist()) == [0, 2, 5, 6]


def test_beams_stop_at_eos(other_model):
    cache = DraftTreeCache(CausalLM(other_model))
    cache.start()
    sampling = SamplingConfig(1.0)
    free = beam_search(cache, PROMPT, 3, 4, sampling, torch.Generator().manual_seed(2))
    eos = frozenset(free.token_ids[:2])  # tokens the beams actually reach at the first level
    drafter = BeamDrafter(CausalLM(other_model), 3, 4, tree=True, eos_token_ids=eos)
    drafter.start(PROMPT)
    draft = drafter.propose(PROMPT, 3, sampling, torch.Generator().manual_seed(2))
    assert any(t in eos for t in draft.token_ids)
    assert all(p == -1 or draft.token_ids[p] not in eos for p in draft.parents)
    chain = BeamDrafter(CausalLM(other_model), 3, 4, eos_token_ids=eos)
    for seed in range(5):
        chain.start(PROMPT)
        tokens = chain.propose(PROMPT, 3, sampling, torch.Generator().manual_seed(seed)).token_ids
        assert all(t not in eos for t in tokens[:-1])
