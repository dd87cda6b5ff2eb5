"""A token tree shaped by the draft's confidence (EAGLE-2's dynamic tree), for greedy verification.

A static tree (:mod:`jointspec.drafters.tree`, e.g. ``(3,)``) spends its nodes the same way every round. Under greedy
verification a node is accepted only if every node on its path is the target's argmax, so, when the draft's
probabilities are calibrated, the expected number of accepted tokens of a tree is the sum over its nodes of the
product of the draft probabilities along each node's path. For a budget of ``N`` nodes that sum is largest for the
``N`` nodes with the highest path probability: where the draft is sure of its first token the tree goes deep, where
it hesitates it goes wide.

Each round the drafter expands level by level. Level 0 holds the draft's top ``N`` next tokens, each scored by its
log-probability. A level's nodes that rank among the ``N`` best scored so far (and are not end-of-sequence) are fed
to the draft, one draft call per level, and each gets its top ``N`` children, scored by the path's summed
log-probability. A child never scores above its parent, so once no node of a level ranks among the best ``N`` nothing
deeper can, and the expansion stops. The tree proposed is the ``N`` best nodes (ancestors come first on ties, so the
set is closed under parents).

Only greedy decoding: the nodes are chosen deterministically from the draft's ranking, so there is no draft
distribution a rejection-sampling verifier could correct; sampling asks for a static ``--tree`` instead.
"""

from __future__ import annotations

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.treecache import DraftTreeCache


class DynamicTreeDrafter:
    def __init__(self, draft: CausalLM, budget: int, *, eos_token_ids: frozenset[int] = frozenset()) -> None:
        if budget < 1:
            raise ValueError(f"a dynamic tree needs a budget of at least 1 node, got {budget}")
        self.cache = DraftTreeCache(draft)
        self.budget = budget
        self.eos_token_ids = frozenset(eos_token_ids)

    # What a round can cost (drafters.lookup_tree weighs it): at most ``budget`` nodes and ``budget`` levels, but a
    # draft call per level past the first only where a node deep enough still ranks.
    @property
    def max_nodes(self) -> int:
        return self.budget

    @property
    def max_draft_calls(self) -> int:
        return self.budget

    def start(self, prompt_ids: list[int]) -> None:
        self.cache.start()

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        if not sampling.greedy:
            raise UnsupportedOptionError("a dynamic tree (--tree-budget) drafts for greedy decoding only; for "
                                         "sampling, give a static tree with --tree")
        depth = min(self.budget, max_num_draft_tokens, self.cache.room(context_ids))
        if depth <= 0:
            return EMPTY_DRAFT
        budget = self.budget
        # Every candidate node: token, parent candidate (-1: the root), depth, path log-probability.
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        fed: list[int] = []  # candidates fed to the draft, in feeding order (level by level)

        def add_children(logits: torch.Tensor, parent: int) -> None:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            top = torch.topk(logprobs, min(budget, logprobs.shape[-1]))
            base = scores[parent] if parent >= 0 else 0.0
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                if value == float("-inf"):
                    break
                tokens.append(token)
                parents.append(parent)
                depths.append(0 if parent < 0 else depths[parent] + 1)
                scores.append(base + value)

        def best() -> list[int]:
            # Ties go to the shallower (then earlier) node, so a parent always ranks before its equal child.
            return sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:budget]

        add_children(self.cache.context_logits(context_ids), -1)
        for level in range(1, depth):
            ranked = set(best())
            frontier = [i for i in range(len(tokens)) if depths[i] == level - 1 and i in ranked
                        and tokens[i] not in self.eos_token_ids]
            if not frontier:
                break
            fed.extend(frontier)
            position = {node: k for k, node in enumerate(fed)}
            logits = self.cache.tree_logits([position.get(parents[i], -1) for i in fed], [tokens[i] for i in fed],
                                            num_logits=len(frontier))
            for row, node in enumerate(frontier):
                add_children(logits[row], node)
        chosen = sorted(best(), key=lambda i: (depths[i], i))  # parents before children
        index = {node: k for k, node in enumerate(chosen)}
        return Draft(token_ids=[tokens[i] for i in chosen],
                     parents=[index[parents[i]] if parents[i] >= 0 else -1 for i in chosen])

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self.cache.commit(context_ids, num_accepted)
