"""Lossless verification of token trees: SpecInfer / MCSD recursive rejection sampling.

**Token tree (SpecInfer, Miao et al. 2023; MCSD, Yang et al. 2024).** Walk from the root. At the current node, with
``target_row`` = the target's distribution there, try its children in order: child token ``x`` is accepted with
probability ``min(1, target_row[x] / draft_row[x])``; on acceptance move to that child; on rejection replace
``target_row`` by the normalised residual ``max(target_row - draft_row, 0)`` and, when the children were drawn
without replacement, also remove ``x`` from ``draft_row`` and renormalise (the next child was drawn from that).
When every child is rejected the *recovered* token comes from the last residual; at a leaf the *bonus* token comes
from the target row after it. Each step is one speculative-sampling step with the right draft distribution, so the
output has exactly the target's law provided the children of a node are i.i.d. draft samples (or sequential draws
without replacement) given the node, as :class:`jointspec.drafters.tree.TreeDrafter` produces.

Children without draft probabilities (lookup trees) are one-hot drafts: the target draws its own token at each node
and the walk follows the child with that token, as for a one-hot chain (:mod:`jointspec.verifiers.rejection`): each
child is kept with its target probability, and the round uses one draw per emitted token, as plain sampling does.

Temperature 0: the target is one-hot and this reduces to greedy tree verification (:class:`GreedyVerifier`).
"""

from __future__ import annotations

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict, children_of, path_to
from jointspec.verifiers.greedy import GreedyVerifier
from jointspec.verifiers.rejection import follow_target_draws, residual_distribution


class TreeRejectionVerifier:
    """SpecInfer / MCSD recursive rejection sampling over a token tree. ``replacement`` must match the drafter."""
    reads_argmax_when_greedy = True  # temperature 0 goes to GreedyVerifier
    reads_top_k_when_sampling = True  # only processed_probs of the target's rows
    # Temperature alone, a draft without probabilities: only the target's own draw of each row is read.
    draws_for_drafts_without_probs = True

    def __init__(self, replacement: bool = True) -> None:
        self.replacement = replacement
        self._greedy = GreedyVerifier()

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        if sampling.greedy:
            return self._greedy.verify(draft, target_logits, sampling, generator)
        target_probs = processed_probs(target_logits, sampling)  # [num_nodes + 1, vocab]
        if draft.draft_probs is None:  # one-hot children: the target's draws, as for a chain
            return follow_target_draws(draft, target_probs, generator)
        children = children_of(draft)
        node = -1
        while True:
            target_row = target_probs[node + 1]
            kids = children[node]
            if not kids:  # a leaf (or an empty draft): the bonus token
                return self._verdict(draft, node, int(sample(target_row, generator)))
            draft_row = draft.draft_probs[kids[0]]  # siblings share their parent's draft distribution
            uniforms = torch.rand(len(kids), generator=generator).tolist()
            accepted = None
            for child, uniform in zip(kids, uniforms):
                token = draft.token_ids[child]
                if uniform * float(draft_row[token]) < float(target_row[token]):
                    accepted = child
                    break
                target_row = self._residual(target_row, draft_row)
                if not self.replacement:
                    draft_row = draft_row.clone()
                    draft_row[token] = 0.0
                    total = draft_row.sum()
                    if total <= 0:
                        break  # the draft support is exhausted, so no sibling can follow
                    draft_row = draft_row / total
            if accepted is None:
                return self._verdict(draft, node, int(sample(target_row, generator)))
            node = accepted

    def _residual(self, target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
        return residual_distribution(target_row, draft_row)

    @staticmethod
    def _verdict(draft: Draft, node: int, token: int) -> Verdict:
        path = path_to(draft.node_parents(), node)
        return Verdict(path, [draft.token_ids[i] for i in path] + [token])
