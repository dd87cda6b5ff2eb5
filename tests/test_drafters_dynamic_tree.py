"""The dynamic tree (``--tree-budget N``, EAGLE-2 style): it proposes the N nodes whose draft path probability is
highest, checked against a brute-force ranking computed with the draft model directly; it refuses sampling; and with
``hybrid-tree``/``default`` it decodes exactly like greedy decoding (the greedy-equivalence tests of the head kinds
run it too: test_drafts_eagle.py, test_drafts_medusa_hydra.py).

Every check here is deterministic (greedy, fixed seeds): no false-failure odds.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.dynamic_tree import DynamicTreeDrafter

from helpers import assert_greedy_equivalent, decoder_for, random_prompt, tiny_llama

GREEDY = SamplingConfig(temperature=0.0)


def path_logprob(model, context: list[int], path: tuple[int, ...]) -> float:
    """Sum of the draft's log-probabilities of ``path`` after ``context``, from one plain forward of the model."""
    with torch.no_grad():
        logits = model(torch.tensor([context + list(path)], device=model.device)).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(context) - 1
    return sum(float(logprobs[start + i, token]) for i, token in enumerate(path))


def best_paths(model, context: list[int], budget: int) -> set[tuple[int, ...]]:
    """The ``budget`` paths of highest probability, by brute force: a node among the best ``budget`` is among its
    parent's ``budget`` likeliest children, so those are the only candidates (depth at most ``budget``)."""
    candidates: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[int, ...]] = [()]
    for _ in range(budget):
        grown = []
        for path in frontier:
            with torch.no_grad():
                logits = model(torch.tensor([context + list(path)], device=model.device)).logits[0, -1].float()
            for token in torch.topk(logits, budget).indices.tolist():
                grown.append(path + (token,))
                candidates[grown[-1]] = path_logprob(model, context, grown[-1])
        frontier = grown
    return set(sorted(candidates, key=lambda p: -candidates[p])[:budget])


def proposed_paths(draft) -> set[tuple[int, ...]]:
    paths = []
    for i, token in enumerate(draft.token_ids):
        parent = draft.parents[i]
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    assert all(parent < i for i, parent in enumerate(draft.parents))  # parents come first
    return set(paths)


@pytest.mark.parametrize("budget", [1, 3, 4])
@pytest.mark.parametrize("prompt_seed", [0, 5])
def test_proposes_the_budget_most_likely_paths(budget, prompt_seed):
    model = tiny_llama(3).eval()
    drafter = DynamicTreeDrafter(CausalLM(model), budget)
    drafter.start([])
    context = random_prompt(prompt_seed)
    draft = drafter.propose(context, 16, GREEDY, None)
    assert len(draft.token_ids) == budget
    assert proposed_paths(draft) == best_paths(model, context, budget)
    # Next round, after committing two tokens of the context's continuation: the cache follows.
    drafter.commit(context + [7, 8], 1)
    draft = drafter.propose(context + [7, 8], 16, GREEDY, None)
    assert proposed_paths(draft) == best_paths(model, context + [7, 8], budget)


def test_depth_is_capped_by_the_room_left_and_sampling_is_refused():
    drafter = DynamicTreeDrafter(CausalLM(tiny_llama(3)), 4)
    drafter.start([])
    context = random_prompt(1)
    draft = drafter.propose(context, 1, GREEDY, None)  # one token of room: depth 1 only
    assert draft.parents == [-1] * len(draft.token_ids)
    with pytest.raises(UnsupportedOptionError, match="greedy decoding only.*--tree"):
        drafter.propose(context, 4, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="budget of at least 1"):
        DynamicTreeDrafter(CausalLM(tiny_llama(3)), 0)


@pytest.mark.parametrize("budget,prompt_seed", list(itertools.product([2, 5], [0, 3])))
def test_greedy_equivalence_with_the_target_as_draft(target_model, budget, prompt_seed):
    """The target as its own draft (not a head): every top path is accepted, so drafts run deep and max length and
    EOS fall inside them."""
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter

    decoder = decoder_for(target_model, "hybrid-tree", "self", tree_budget=budget)
    assert isinstance(decoder.drafter, LookupOrTreeDrafter)
    assert isinstance(decoder.drafter.tree, DynamicTreeDrafter)
    assert_greedy_equivalent(target_model, decoder, random_prompt(prompt_seed))


def test_static_and_dynamic_trees_are_not_both_given(target_model):
    with pytest.raises(UnsupportedOptionError, match="either --tree.*or --tree-budget"):
        decoder_for(target_model, "hybrid-tree", "self", tree=(3,), tree_budget=3)
