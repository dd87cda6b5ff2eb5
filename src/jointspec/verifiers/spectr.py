"""Lossless verification of several independent draft chains: SpecTr's k-sequential selection.

**SpecTr K-SEQ (Sun et al. 2023, arXiv 2310.15141).** ``m`` i.i.d. candidates ``x_1..x_m ~ draft_row`` for one
position. With ``beta(rho) = Σ_y min(draft_row[y], target_row[y] / rho)`` and
``f = (1 - (1 - beta)^m) / beta = Σ_{i<m} (1 - beta)^i``, candidate ``x_i`` is accepted, in order, with probability
``min(1, target_row[x_i] / (rho · draft_row[x_i]))``; the first acceptance wins. Token ``y`` is then output with
probability ``min(draft_row[y], target_row[y] / rho) · f``, which is at most ``target_row[y]`` whenever ``f <= rho``;
if all are rejected the token comes from the residual ``target_row - min(draft_row, target_row / rho) · f``
(normalised; it carries mass ``(1 - beta)^m``). Any ``rho`` in ``[1, m]`` with ``f <= rho`` is lossless; the
smallest accepts most, found by a grid search (``rho = m`` always qualifies).
Over whole drafts: after accepting ``y`` every candidate whose token is ``y`` survives and their children (i.i.d.
given the prefix, independent of the selection) are the next position's candidates. With one candidate this is
plain speculative sampling. Drafts: ``k`` independent chains, i.e. a tree with branching ``(k, 1, ..., 1)``.

Temperature 0: the target is one-hot and this reduces to greedy tree verification (:class:`GreedyVerifier`).
"""

from __future__ import annotations

import numpy as np
import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict, children_of, path_to
from jointspec.verifiers.greedy import GreedyVerifier

_GRID = np.linspace(0.0, 1.0, 33)
_GRID_ROUNDS = 2


def kseq_rho(target_row: torch.Tensor, draft_row: torch.Tensor, num_candidates: int) -> tuple[float, float, float]:
    """SpecTr's (rho, beta, f) for ``num_candidates`` i.i.d. candidates. Rows: [vocab].

    ``rho`` is the smallest qualifying (``f <= rho``) point of a grid on ``[1, m]``, refined once around it. Any
    qualifying ``rho`` is lossless and ``rho = m`` always qualifies, so a coarse search only costs acceptance, never
    correctness; a grid also needs no monotonicity of ``f(rho) - rho``.
    """
    support = torch.nonzero(draft_row > 0).flatten()  # beta only depends on the draft's support
    target = target_row[support].double().cpu().numpy()
    draft = draft_row[support].double().cpu().numpy()
    powers = np.arange(num_candidates)

    def beta_and_f(rhos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        beta = np.minimum(draft[None, :], target[None, :] / rhos[:, None]).sum(axis=1)  # [num_rhos]
        f = ((1.0 - beta)[:, None] ** powers[None, :]).sum(axis=1)  # Σ_{i<m} (1 - beta)^i, stable as beta -> 0
        return beta, f

    low, high = 1.0, float(num_candidates)
    for _ in range(_GRID_ROUNDS if num_candidates > 1 else 0):  # one candidate: rho = f = 1 (plain SpS)
        rhos = low + (high - low) * _GRID
        qualifying = np.flatnonzero(beta_and_f(rhos)[1] <= rhos)
        first = int(qualifying[0]) if qualifying.size else len(_GRID) - 1  # the top end qualifies
        low, high = float(rhos[max(first - 1, 0)]), float(rhos[first])
        if first == 0:
            break
    beta, f = beta_and_f(np.array([high]))
    return high, float(beta[0]), float(f[0])


class SpecTrVerifier:
    """SpecTr's k-sequential draft selection, position by position over the surviving candidates."""
    reads_argmax_when_greedy = True  # temperature 0 goes to GreedyVerifier
    reads_top_k_when_sampling = True  # only processed_probs of the target's rows

    def __init__(self) -> None:
        self._greedy = GreedyVerifier()

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        if sampling.greedy:
            return self._greedy.verify(draft, target_logits, sampling, generator)
        if draft.num_nodes and draft.draft_probs is None:
            raise ValueError("SpecTrVerifier needs the draft's probabilities (a sampled draft)")
        target_probs = processed_probs(target_logits, sampling)  # [num_nodes + 1, vocab]
        children = children_of(draft)
        parents = draft.node_parents()
        alive = [-1]  # nodes that all carry the accepted prefix (identical tokens, so identical target rows)
        while True:
            target_row = target_probs[alive[0] + 1]
            candidates = [c for node in alive for c in children[node]]
            if not candidates:
                token = int(sample(target_row, generator))
                return Verdict(path_to(parents, alive[0]), self._tokens(draft, parents, alive[0]) + [token])
            draft_row = draft.draft_probs[candidates[0]]  # every candidate was drawn after the same prefix
            rho, f = self._rho(target_row, draft_row, len(candidates))
            token = _select(target_row, draft_row, [draft.token_ids[c] for c in candidates], rho, generator)
            if token is None:
                token = int(sample(_residual(target_row, draft_row, rho, f), generator))
                return Verdict(path_to(parents, alive[0]), self._tokens(draft, parents, alive[0]) + [token])
            alive = [c for c in candidates if draft.token_ids[c] == token]

    @staticmethod
    def _tokens(draft: Draft, parents: list[int], node: int) -> list[int]:
        return [draft.token_ids[i] for i in path_to(parents, node)]

    def _rho(self, target_row: torch.Tensor, draft_row: torch.Tensor, num_candidates: int) -> tuple[float, float]:
        rho, _, f = kseq_rho(target_row, draft_row, num_candidates)
        return rho, f


def _select(target_row: torch.Tensor, draft_row: torch.Tensor, tokens: list[int], rho: float,
            generator: torch.Generator | None) -> int | None:
    """K-SEQ: the first accepted candidate's token, or None when all are rejected."""
    uniforms = torch.rand(len(tokens), generator=generator).tolist()
    for token, uniform in zip(tokens, uniforms):
        if uniform * rho * float(draft_row[token]) < float(target_row[token]):
            return token
    return None


def _residual(target_row: torch.Tensor, draft_row: torch.Tensor, rho: float, f: float) -> torch.Tensor:
    """Normalised ``target_row - min(draft_row, target_row / rho) * f`` ([vocab])."""
    target, draft = target_row.double(), draft_row.double()
    residual = (target - torch.minimum(draft, target / rho) * f).clamp_min(0.0)  # >= 0 up to rounding when f <= rho
    total = residual.sum()
    # All mass accepted means a rejection had probability 0; fall back to the target (as rejection.py does).
    return (residual / total).float() if total > 0 else target_row
