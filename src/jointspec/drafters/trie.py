"""Lookahead's trie drafts (Zhao et al., 2023, "Lookahead: An Inference Acceleration Framework for Large Language
Model with Lossless Generation Accuracy"): every continuation the context offers, merged into one tree.

Prompt lookup (:mod:`jointspec.drafters.ngram`) copies what followed the *most recent* earlier occurrence of the
context's last n-gram. Text often offers several: a name followed once by a title and twice by a date, a code
identifier followed by different arguments. This drafter takes the continuations after *every* occurrence (the most
recent ``max_matches``) of the longest suffix n-gram that occurs earlier, merges them into a trie (shared prefixes
become one path; each node counts the occurrences that pass through it), and drafts the trie's best nodes as one
token tree, which the target verifies in one forward.

Which nodes, and how many. A node's count over the number of occurrences estimates the chance that its whole path
is the target's continuation (a copy model of the text), and the sum of those chances over the drafted nodes is
the expected number of accepted tokens. Nodes are ranked by count (a node never outranks its parent, so every
prefix of the ranking is a tree), and the drafter keeps the prefix that maximises expected tokens per unit cost
``(1 + c * sum of chances) / T(nodes + 1)`` on the target's measured cost curve ``T`` (none at all when no prefix
beats plain decoding). ``c`` calibrates the copy model: the decayed ratio of tokens accepted to tokens predicted in
this request's earlier rounds, starting from 1. A calibration that fell so low that nothing pays would never learn
again, so the drafter then still drafts the likeliest node as a probe after 1, 2, 4, ... skipped rounds (at most
64), back to every round once a probe is accepted.

The trie is rebuilt each round from the context (prompt and output so far), and, with an
:class:`~jointspec.drafters.memory.OutputMemory`, from the target's earlier answers too (Lookahead's global trie):
the memory's continuations join the trie where it matches a final n-gram at least as long as the context's. The drafter
has no probabilities, so verifiers treat its nodes as deterministic, distinct siblings (greedy: the longest path
the target agrees with; sampling: :class:`~jointspec.verifiers.tree.TreeRejectionVerifier`).
"""

from __future__ import annotations

import numpy as np
import torch

from jointspec.core.draft import EMPTY_DRAFT, Draft, chain_parents
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.memory import OutputMemory, longest_source
from jointspec.drafters.ngram import suffix_matches


def merge_branches(branches: list[tuple[list[int], float]]) -> tuple[list[int], list[int], list[float]]:
    """Token sequences that all follow the pending token, with weights, merged into one trie: (tokens, parents,
    chances) per node, where a node's chance is the weight of the branches through it over the total. Ranked by
    chance, shallower first among equals (so parents come first), then in order of first sight."""
    tokens: list[int] = []
    parents: list[int] = []
    weights: list[float] = []
    depths: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for branch, weight in branches:
        parent = -1
        for token in branch:
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                weights.append(0.0)
                depths.append(0 if parent < 0 else depths[parent] + 1)
            weights[node] += weight
            parent = node
    total = sum(weight for _, weight in branches)
    order = sorted(range(len(tokens)), key=lambda i: (-weights[i], depths[i], i))
    rank = {node: r for r, node in enumerate(order)}
    return ([tokens[i] for i in order], [-1 if parents[i] < 0 else rank[parents[i]] for i in order],
            [weights[i] / total for i in order])


class TrieLookupDrafter:
    """Multi-branch drafts from every earlier occurrence of the context's suffix n-gram (module docstring).

    ``curve``: the target's cost curve (None: always draft ``max_nodes`` nodes at most). ``max_depth``: the deepest
    continuation taken. ``memory``: rounds the calibration averages over. ``output_memory``: earlier answers to
    draft from as well (online adaptation).
    """

    def __init__(self, curve: CostCurve | None, *, max_depth: int = 8, max_nodes: int = 16, max_ngram: int = 3,
                 min_ngram: int = 1, max_matches: int = 32, memory: float = 10.0,
                 output_memory: OutputMemory | None = None) -> None:
        if max_depth < 1 or max_nodes < 1 or max_matches < 1:
            raise ValueError(f"max_depth, max_nodes and max_matches must be >= 1, got {max_depth}, {max_nodes}, "
                             f"{max_matches}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        if not memory > 1:
            raise ValueError(f"memory must be > 1, got {memory}")
        self.curve = curve
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.decay = 1.0 - 1.0 / memory
        self.output_memory = output_memory
        self.start([])

    @property
    def calibration(self) -> float:
        return self._accepted / self._predicted

    def start(self, prompt_ids: list[int]) -> None:
        self._accepted, self._predicted = 1.0, 1.0  # a prior of one round that went as predicted
        self._last_predicted = 0.0
        self._skipped, self._probe_interval, self._probing = 0, 1, False

    def trie(self, context_ids: list[int], max_depth: int) -> tuple[list[int], list[int], list[float]]:
        """The merged continuations: (tokens, parents, chances) per node, ranked (parents before children)."""
        context = np.asarray(context_ids, dtype=np.int64)
        match = suffix_matches(context, self.max_ngram, self.min_ngram, self.max_matches)
        remembered: list[list[int]] = []
        if self.output_memory is not None:
            in_memory = self.output_memory.continuations(context, max_depth, max_ngram=self.max_ngram,
                                                         min_ngram=self.min_ngram)
            _, starts, remembered = longest_source(match, (in_memory[0], in_memory[1][:self.max_matches]))
        else:
            starts = match[1]
        branches = [context[start:start + max_depth].tolist() for start in starts] + remembered
        return merge_branches([(branch, 1.0) for branch in branches])

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self._last_predicted = 0.0
        self._probing = False  # (also where no budget is left: the round's commit must not judge an earlier probe)
        depth = min(self.max_depth, max_num_draft_tokens)
        if depth <= 0:
            return EMPTY_DRAFT
        tokens, parents, chances = self.trie(context_ids, depth)
        keep = self._nodes_that_pay(chances[:self.max_nodes], self.calibration)
        if keep == 0 and self._nodes_that_pay(chances[:1], 1.0):  # only the calibration says no: probe now and then
            self._skipped += 1
            self._probing = keep = int(self._skipped >= self._probe_interval)
        if keep == 0:
            return EMPTY_DRAFT
        self._skipped = 0
        tokens, parents = tokens[:keep], parents[:keep]
        self._last_predicted = sum(chances[:keep])
        return Draft(token_ids=tokens, parents=None if parents == chain_parents(keep) else parents)

    def _nodes_that_pay(self, chances: list[float], calibration: float) -> int:
        """How many of the ranked nodes to draft: the prefix with the most expected tokens per unit cost."""
        if self.curve is None:
            return len(chances)
        best, best_rate, expected = 0, 1.0 / self.curve.cost(1), 1.0
        for k, chance in enumerate(chances, start=1):
            expected += calibration * chance
            rate = expected / self.curve.cost(k + 1)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        if self._probing:
            self._probe_interval = 1 if num_accepted else min(2 * self._probe_interval, 64)
        if self._last_predicted > 0:
            self._accepted = self.decay * self._accepted + num_accepted
            self._predicted = self.decay * self._predicted + self._last_predicted
