"""Lossless block verification of a chain draft (Sun et al., arXiv 2403.10444, ICLR 2025).

Token-wise speculative sampling decides each draft token alone and stops at the first rejection. Block verification
judges the block as a whole: it keeps a running weight ``w_i = min(w_{i-1} * p_i(x_i) / q_i(x_i), 1)`` (``w_0 = 1``;
``p_i`` the target row the i-th draft token is scored by, ``q_i`` the draft row it was drawn from), and keeps the
prefix of length ``i`` with probability ``h_i``, where

    rho_i = sum_v max(w_i * p_{i+1}(v) - q_{i+1}(v), 0)        (the residual mass one position ahead)
    h_i   = rho_i / (rho_i + 1 - w_i)    for i < gamma,         h_gamma = w_gamma.

With one uniform ``eta_i`` per position, the kept length is ``tau = max({0} | {i : eta_i <= h_i})``: the scan runs
from the end and stops at the first position that passes, so a rejected token in the middle does not end the block
the way it ends token-wise verification. The token after the prefix is a bonus draw from ``p_{gamma+1}`` when the
whole block is kept, else a draw from the normalised ``max(w_tau * p_{tau+1} - q_{tau+1}, 0)`` (at ``tau = 0`` the
ordinary residual). For every prefix ``P(tau >= i | x_{<=i}) = w_i`` and the next emitted token has the target's row,
so the output has exactly the target's law; among verifiers that see only the rows along the block it keeps the most
tokens per round, never fewer than token-wise verification on average.

It gains nothing where ``w_i`` is 0 or 1: at temperature 0 (greedy matching, used directly) and for drafts without
probabilities (lookup drafts: the law of ``tau`` equals token-wise's, so those go to
:class:`~jointspec.verifiers.rejection.RejectionSamplingVerifier`). ``docs/methods.md`` says where it is offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointspec.core.draft import Draft
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict
from jointspec.verifiers.greedy import GreedyVerifier
from jointspec.verifiers.rejection import RejectionSamplingVerifier


@dataclass(frozen=True)
class BlockDecision:
    """What block verification needs to decide, from the rows alone: ``weights[i]`` is ``w_i`` (``weights[0] = 1``)
    and ``keep[i - 1]`` is ``h_i``, the chance that the prefix of length ``i`` is kept once every longer one failed.
    Float64 lists of length ``gamma + 1`` and ``gamma``."""

    weights: list[float]
    keep: list[float]

    def law_of_kept_length(self) -> list[float]:
        """``P(tau = i)`` for ``i = 0..gamma``: ``h_i`` times the chance that every longer prefix failed."""
        gamma = len(self.keep)
        law = [0.0] * (gamma + 1)
        longer_failed = 1.0
        for i in range(gamma, 0, -1):
            law[i] = self.keep[i - 1] * longer_failed
            longer_failed *= 1.0 - self.keep[i - 1]
        law[0] = longer_failed
        return law


def block_decision(target_rows: torch.Tensor, draft_rows: torch.Tensor, tokens: list[int]) -> BlockDecision:
    """``target_rows``: [gamma + 1, vocab] (row ``i`` scores draft token ``i``; the last is the bonus row);
    ``draft_rows``: [gamma, vocab], the rows the tokens were drawn from. Computed in float64."""
    gamma = len(tokens)
    p = target_rows.double()
    q = draft_rows.double()
    weights = [1.0]
    for i, token in enumerate(tokens):
        drafted = float(q[i, token])
        ratio = float(p[i, token]) / drafted if drafted > 0 else float("inf")
        weights.append(min(weights[-1] * ratio, 1.0))
    keep = []
    for i in range(1, gamma):
        rho = float((weights[i] * p[i] - q[i]).clamp_min(0.0).sum())
        denominator = rho + 1.0 - weights[i]
        keep.append(rho / denominator if denominator > 0 else 1.0)
    keep.append(weights[gamma])
    return BlockDecision(weights, keep)


def expected_kept_lengths(target_rows: torch.Tensor, draft_rows: torch.Tensor,
                          tokens: list[int]) -> tuple[float, float]:
    """(token-wise, block): the expected number of draft tokens each verifier keeps of this one draft, over its own
    uniforms only (the draft fixed). Token-wise keeps token ``i`` with chance ``min(1, p_i(x_i) / q_i(x_i))`` once it
    kept every earlier one; block keeps ``i`` with the law :meth:`BlockDecision.law_of_kept_length` gives. Comparing
    the two on the same drafts leaves out the noise of both verifiers' draws and of different drafts
    (``benchmarks/block_verification_expectation.py``). Rows as for :func:`block_decision`."""
    p = target_rows.double()
    q = draft_rows.double()
    token_wise, survive = 0.0, 1.0
    for i, token in enumerate(tokens):
        drafted, scored = float(q[i, token]), float(p[i, token])
        # RejectionSamplingVerifier keeps a token when u * q < p: a token the draft gave no mass is kept where p > 0.
        survive *= min(1.0, scored / drafted) if drafted > 0 else float(scored > 0)
        token_wise += survive
    law = block_decision(target_rows, draft_rows, tokens).law_of_kept_length()
    return token_wise, sum(i * chance for i, chance in enumerate(law))


def block_residual(target_row: torch.Tensor, draft_row: torch.Tensor, weight: float) -> torch.Tensor:
    """Normalised ``max(weight * target - draft, 0)``: the law of the token after a kept prefix that is not the whole
    block. Falls back to the target row where that is all zero (a branch taken with probability 0)."""
    residual = (weight * target_row.double() - draft_row.double()).clamp_min(0.0)
    total = residual.sum()
    return (residual / total).to(target_row.dtype) if total > 0 else target_row


class BlockVerifier:
    """Block verification of chain drafts that carry their draft rows; greedy rows and lookup drafts go to the
    verifiers with the same law (see the module docstring)."""

    reads_argmax_when_greedy = True  # temperature 0 goes to GreedyVerifier
    reads_top_k_when_sampling = True  # only processed_probs of the target's rows
    # Temperature alone, a draft without probabilities: only the target's own draw of each row is read.
    draws_for_drafts_without_probs = True

    def __init__(self) -> None:
        self._greedy = GreedyVerifier()
        self._token_wise = RejectionSamplingVerifier()

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        if sampling.greedy:
            return self._greedy.verify(draft, target_logits, sampling, generator)
        if not draft.is_chain:
            raise UnsupportedOptionError("block verification verifies chains; tree drafts need a tree verifier")
        if draft.draft_probs is None or draft.num_nodes == 0:
            return self._token_wise.verify(draft, target_logits, sampling, generator)
        target_rows = processed_probs(target_logits, sampling)  # [gamma + 1, vocab]
        tokens = list(draft.token_ids)
        decision = block_decision(target_rows, draft.draft_probs, tokens)
        gamma = len(tokens)
        uniforms = torch.rand(gamma, generator=generator).tolist()
        kept = next((i for i in range(gamma, 0, -1) if uniforms[i - 1] < decision.keep[i - 1]), 0)
        if kept == gamma:
            token = int(sample(target_rows[gamma], generator))
        else:
            row = block_residual(target_rows[kept], draft.draft_probs[kept], decision.weights[kept])
            token = int(sample(row, generator))
        return Verdict(list(range(kept)), tokens[:kept] + [token])
