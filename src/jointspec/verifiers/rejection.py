"""Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for a chain draft.

Draft token ``x`` at position ``i`` is kept with probability ``min(1, target_probs[i, x] / draft_probs[i, x])``.
At the first rejection the recovered token is drawn from the normalised positive residual
``max(target_probs[i] - draft_probs[i], 0)``; if all are kept, the bonus token is drawn from ``target_probs[k]``.
The output then has exactly the target's distribution (the sampling config's, see :mod:`jointspec.core.sampling`),
whatever the draft distribution.

A drafter without probabilities (prompt or corpus lookup) is a one-hot draft: its token ``x`` must be kept with
probability ``target_probs[i, x]``, and the residual is the target with ``x`` removed. That is what drawing the
target's own token for the position and keeping ``x`` when the draw is ``x`` gives (the draw, when it is not ``x``, is
the residual's sample), and done so, row by row with one draw per emitted token, a round uses the generator exactly as
plain sampling does: with the same seed the text is plain sampling's, whatever was drafted, however long.

At temperature 0 the target is one-hot and this reduces to :class:`GreedyVerifier`, which is used directly.
"""

from __future__ import annotations

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict
from jointspec.verifiers.greedy import GreedyVerifier, follow_target


def residual_distribution(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """Normalised ``max(target - draft, 0)`` over the vocabulary ([vocab] -> [vocab])."""
    residual = (target_row - draft_row).clamp_min(0.0)
    total = residual.sum()
    # The residual can only be all-zero when target <= draft everywhere, i.e. target == draft, in which case the
    # rejection that led here had probability 0; fall back to the target so rounding never divides by zero.
    return residual / total if total > 0 else target_row


def follow_target_draws(draft: Draft, target_probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """A draft without probabilities (a chain or a tree), judged by the target's own draw at each position, one draw
    per emitted token in order (the module docstring says why that is lossless and repeats plain sampling)."""
    return follow_target(draft, lambda row: int(sample(target_probs[row], generator)))


class RejectionSamplingVerifier:
    reads_argmax_when_greedy = True  # temperature 0 goes to GreedyVerifier
    reads_top_k_when_sampling = True  # only processed_probs of the target's rows
    # Temperature alone, a draft without probabilities: only the target's own draw of each row is read.
    draws_for_drafts_without_probs = True

    def __init__(self) -> None:
        self._greedy = GreedyVerifier()

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        if sampling.greedy:
            return self._greedy.verify(draft, target_logits, sampling, generator)
        if not draft.is_chain:
            raise ValueError("RejectionSamplingVerifier verifies chains; use a tree verifier for tree drafts")
        target_probs = processed_probs(target_logits, sampling)  # [num_nodes + 1, vocab]
        if draft.draft_probs is None:
            return follow_target_draws(draft, target_probs, generator)
        num_nodes = draft.num_nodes
        uniforms = torch.rand(num_nodes, generator=generator).tolist() if num_nodes else []
        for i, token in enumerate(draft.token_ids):
            if uniforms[i] * float(draft.draft_probs[i, token]) < float(target_probs[i, token]):
                continue
            recovered = int(sample(residual_distribution(target_probs[i], draft.draft_probs[i]), generator))
            return Verdict(list(range(i)), list(draft.token_ids[:i]) + [recovered])
        bonus = int(sample(target_probs[num_nodes], generator))
        return Verdict(list(range(num_nodes)), list(draft.token_ids) + [bonus])
