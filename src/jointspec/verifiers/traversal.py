"""Lossless traversal verification of a token tree (Weng, Hu et al., arXiv 2505.12398, NeurIPS 2025).

Recursive rejection (``verifiers/tree.py``) walks a tree from the root and stops where every child of a node fails.
Traversal verification walks it from the leaves: it extends block verification (``verifiers/block.py``) from one
chain to every chain of the tree, so a rejected token deep in a branch does not cost its ancestors their chance.

Each node ``c`` with parent ``u`` carries a weight ``w[c] = min(w[u] * Pb[u][tok c] / Ps[u][tok c], 1)`` (``w`` of
the root, the last committed token, is 1), where ``Pb[u]`` is the target's row after ``u`` and ``Ps[u]`` the draft
row ``u``'s children were drawn from. Then, until a token is emitted:

1. ``a`` = the first live node in post-order (from the root, follow the first live child until there is none);
2. ``a`` is the root: emit a draw from ``Pb[root]`` (no draft token kept); stop;
3. with probability ``w[a]``: keep the path to ``a`` and emit a draw from ``Pb[a]``; stop;
4. else fold ``a`` into its parent ``u``: ``S = sum_v max(w[u] Pb[u][v] - Ps[u][v], 0)``, ``Pb[u]`` becomes that
   residual normalised (kept as it was if ``S = 0``, a branch of probability 0), ``w[u]`` becomes
   ``S / (S + 1 - w[u])`` (the root's stays 1), and for siblings drawn without replacement ``a``'s token leaves
   ``Ps[u]`` (renormalised); delete ``a`` and recompute the weights of ``u``'s live descendants.

``Pb[a]`` in step 3 may already be a residual, if ``a``'s own children were folded into it. A chain is block
verification exactly, and a tree of depth 1 is recursive rejection. Siblings must be tried in the order they were
drawn (node order here, as :class:`~jointspec.drafters.tree.TreeDrafter` lists them); ordering them by probability
is lossy (the tests include that mutant). Drafts without draft rows (deterministic siblings) gain nothing from it and
go to recursive rejection, whose law is the same; temperature 0 goes to greedy tree matching.
"""

from __future__ import annotations

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict, children_of, path_to
from jointspec.verifiers.greedy import GreedyVerifier
from jointspec.verifiers.tree import TreeRejectionVerifier

ROOT = -1


class TraversalVerifier:
    """Traversal verification of token trees that carry their draft rows. ``replacement`` must match the drafter."""

    reads_argmax_when_greedy = True  # temperature 0 goes to GreedyVerifier
    reads_top_k_when_sampling = True  # only processed_probs of the target's rows
    # Temperature alone, a draft without probabilities: only the target's own draw of each row is read.
    draws_for_drafts_without_probs = True

    def __init__(self, replacement: bool = True) -> None:
        self.replacement = replacement
        self._greedy = GreedyVerifier()
        self._top_down = TreeRejectionVerifier(replacement)

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        if sampling.greedy:
            return self._greedy.verify(draft, target_logits, sampling, generator)
        if draft.draft_probs is None or draft.num_nodes == 0:
            return self._top_down.verify(draft, target_logits, sampling, generator)
        target = processed_probs(target_logits, sampling).double()  # [num_nodes + 1, vocab]
        parents = draft.node_parents()
        tokens = list(draft.token_ids)
        live = children_of(draft)  # node -> its children not yet folded, in draw order
        after = {node: target[node + 1] for node in live}  # Pb: the target's row after each node (root: row 0)
        drawn_from = {node: draft.draft_probs[kids[0]].double() for node, kids in live.items() if kids}  # Ps
        weight = {ROOT: 1.0}
        self._refresh(ROOT, live, after, drawn_from, tokens, weight)
        while True:
            node = ROOT
            while live[node]:
                node = live[node][0]
            if node == ROOT:
                return Verdict([], [int(sample(after[ROOT], generator))])
            if float(torch.rand(1, generator=generator)) < weight[node]:
                path = path_to(parents, node)
                return Verdict(path, [tokens[i] for i in path] + [int(sample(after[node], generator))])
            self._fold(node, parents[node], live, after, drawn_from, tokens, weight)

    def _fold(self, node: int, parent: int, live: dict, after: dict, drawn_from: dict, tokens: list[int],
              weight: dict) -> None:
        """Reject ``node`` and fold it into ``parent`` (step 4 of the module docstring)."""
        residual = (weight[parent] * after[parent] - drawn_from[parent]).clamp_min(0.0)
        mass = float(residual.sum())
        if mass > 0:
            after[parent] = residual / mass
        if parent != ROOT:
            denominator = mass + 1.0 - weight[parent]
            weight[parent] = mass / denominator if denominator > 0 else 1.0
        if not self.replacement:
            row = drawn_from[parent].clone()
            row[tokens[node]] = 0.0
            total = float(row.sum())
            if total > 0:
                drawn_from[parent] = row / total
        live[parent].remove(node)
        self._refresh(parent, live, after, drawn_from, tokens, weight)

    @staticmethod
    def _refresh(top: int, live: dict, after: dict, drawn_from: dict, tokens: list[int], weight: dict) -> None:
        """Recompute the weights of ``top``'s live descendants, parents first."""
        stack = [top]
        while stack:
            node = stack.pop()
            for child in live[node]:
                drafted, target = float(drawn_from[node][tokens[child]]), float(after[node][tokens[child]])
                # A token the target gives 0 is never kept, even one a malformed draft claims it never drew.
                ratio = 0.0 if target == 0 else target / drafted if drafted > 0 else float("inf")
                weight[child] = min(weight[node] * ratio, 1.0)
                stack.append(child)
