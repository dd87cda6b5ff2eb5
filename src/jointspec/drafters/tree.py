"""Token trees from a draft model by a k-config (SpecInfer / MCSD), e.g. ``(4, 2, 2)``.

Every node at depth ``d`` (the root being the last committed token) gets ``branching[d]`` children drawn from the
draft's processed distribution after that node: i.i.d. (``replacement=True``), or one after another without
replacement (each draw renormalises over the tokens not yet drawn). ``(4, 2, 2)`` gives 4 + 8 + 16 = 28 nodes.
``(k, 1, ..., 1)`` with replacement is ``k`` independent draft chains, which is what SpecTr verifies.

``draft_probs[i]`` is the distribution node ``i``'s parent drew its children from, *before* any sibling was
removed; a verifier for sampling without replacement re-derives the sequential distributions from it, so drafter
and verifier must agree on ``replacement``. At temperature 0 the children are the ``branching[d]`` most likely
distinct tokens and the draft carries no probabilities (greedy verification needs none).

Children of an end-of-sequence node are not drawn: the loop stops at the EOS anyway. If top-k/top-p leave fewer
possible tokens than ``branching[d]`` when sampling without replacement, the node gets them all.
Draft KV cache: :mod:`jointspec.drafters.treecache`.
"""

from __future__ import annotations

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig, multinomial, processed_probs
from jointspec.drafters.treecache import DraftTreeCache


class TreeDrafter:
    def __init__(self, draft: CausalLM, branching: tuple[int, ...], *, replacement: bool = True,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        if not branching or any(k < 1 for k in branching):
            raise ValueError(f"branching must be a non-empty tuple of factors >= 1, got {branching}")
        self.cache = DraftTreeCache(draft)
        self.branching = tuple(branching)
        self.replacement = replacement
        self.eos_token_ids = frozenset(eos_token_ids)

    def start(self, prompt_ids: list[int]) -> None:
        self.cache.start()

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        depth = min(len(self.branching), max_num_draft_tokens, self.cache.room(context_ids))
        if depth <= 0:
            return EMPTY_DRAFT
        parents: list[int] = []
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        logits = self.cache.context_logits(context_ids)[None]  # [1, vocab]
        level = [-1]  # nodes whose children are drawn next (-1: the root)
        for d in range(depth):
            if d > 0:
                logits = self.cache.tree_logits(parents, token_ids, num_logits=len(level))
            next_level: list[int] = []
            for row, node in enumerate(level):
                if node != -1 and token_ids[node] in self.eos_token_ids:
                    continue
                # Greedy drafts carry no probabilities (module docstring): skip the one-hot over the vocabulary.
                draft_row = None if sampling.greedy else processed_probs(logits[row], sampling)  # [vocab]
                for token in self._draw(logits[row], draft_row, self.branching[d], sampling, generator):
                    parents.append(node)
                    token_ids.append(token)
                    rows.append(draft_row)
                    next_level.append(len(token_ids) - 1)
            if not next_level:
                break
            # tree_logits returns rows for the last nodes fed: keep the next level in feeding order.
            level = next_level
        draft_probs = None if sampling.greedy else torch.stack(rows)  # [num_nodes, vocab]
        return Draft(token_ids=token_ids, draft_probs=draft_probs, parents=parents)

    def _draw(self, logits: torch.Tensor, draft_row: torch.Tensor | None, num_children: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> list[int]:
        if sampling.greedy:
            return torch.topk(logits, min(num_children, logits.shape[-1])).indices.tolist()
        if self.replacement:
            return multinomial(draft_row, num_children, replacement=True, generator=generator).tolist()
        num_children = min(num_children, int((draft_row > 0).sum()))
        return multinomial(draft_row, num_children, replacement=False, generator=generator).tolist()

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self.cache.commit(context_ids, num_accepted)
