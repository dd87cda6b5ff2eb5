"""Prompt lookup where it pays more than a small token tree from a draft head; the tree otherwise.

Two facts from the cost curve shape this drafter (``docs/lab/benchmarks.md`` §6). On the float32 CPU kernels it was
designed on (oneDNN with the weight-major GEMM, docs/kernels.md) a target forward of up to 4 tokens costs about one
plain step, and a trained head's top-3 candidates contain the target's next token far more often (~0.6 on MT-Bench)
than its top-1 does (~0.4). So where prompt lookup has nothing good to offer, the best use of those 4 tokens is one
head call and a width-3 tree (the pending token plus 3 siblings), not a chain: the chain pays a head call per token
and its second token is accepted only after the first was.

Each round:

1. The prompt-lookup drafter, wrapped in :class:`~jointspec.drafters.costaware.CostAwareDrafter`, decides whether a
   lookup draft pays, and how long. Its bar is not plain decoding but the tree's expected rate: ``min_gain`` is set
   every round to how much faster than plain decoding the tree is running, ``(1 + t) * T(1) / (T(n + 1) + d * c)``
   minus 1, with ``t`` the tree's running mean of accepted tokens, ``n`` its nodes, ``d`` its depth (head calls)
   and ``c`` one head call. Where the text repeats (extraction, code edits) lookup acceptance is high and long free
   drafts win; on open-ended text they rarely beat the tree and the wrapper skips them (probing now and then, as
   it does against plain decoding).
2. Otherwise the tree drafter proposes its tree (``branching``, e.g. ``(3,)``, or a dynamic tree of ``budget`` nodes:
   :mod:`jointspec.drafters.dynamic_tree`, charged as its largest round), if the tree pays: where its running
   rate is below plain decoding's (a target whose multi-token forwards are dear, such as a quantised model or
   llama.cpp, or a head that fits the text badly) the round drafts nothing, and the tree is tried again every 2nd,
   4th, 8th, ... round (at most every ``max_probe_interval``-th) to see whether it pays again.

``t`` is a decayed mean over recent tree rounds (``memory`` rounds, starting from ``prior_tree_tokens`` over
``prior_weight`` rounds), per request. Both drafters see every ``start`` and ``commit``; the lookup wrapper is told
0 accepted tokens in a tree round (it drafted nothing), and the tree drafter's cache catches up on tokens committed
while lookup drafted (see :mod:`jointspec.drafters.treecache`).
"""

from __future__ import annotations

import math

import torch

from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
from jointspec.drafters.dynamic_tree import DynamicTreeDrafter
from jointspec.drafters.tree import TreeDrafter


def tree_round_cost(curve: CostCurve, branching: tuple[int, ...], draft_cost_per_call: float) -> float:
    """Cost of a round that drafts a full ``branching`` tree (one draft call per level) and verifies it."""
    nodes, level = 0, 1
    for factor in branching:
        level *= factor
        nodes += level
    return curve.cost(nodes + 1) + len(branching) * draft_cost_per_call


class LookupOrTreeDrafter:
    cost_aware = True  # its lookup half is; the tree is what the lookup must beat (methods.build_method)

    def __init__(self, lookup: CostAwareDrafter, tree: TreeDrafter | DynamicTreeDrafter, curve: CostCurve, *,
                 draft_cost_per_call: float, prior_tree_tokens: float = 0.5, prior_weight: float = 2.0,
                 memory: float = 10.0, max_probe_interval: int = 64) -> None:
        if not (math.isfinite(draft_cost_per_call) and draft_cost_per_call >= 0):
            raise ValueError(f"draft_cost_per_call must be finite and >= 0, got {draft_cost_per_call}")
        if prior_tree_tokens < 0 or not prior_weight > 0:
            raise ValueError(f"need prior_tree_tokens >= 0 and prior_weight > 0, got {prior_tree_tokens} and "
                             f"{prior_weight}")
        if not memory > 1:
            raise ValueError(f"memory must be > 1 (tree rounds the estimate averages), got {memory}")
        if max_probe_interval < 1:
            raise ValueError(f"max_probe_interval must be >= 1, got {max_probe_interval}")
        self.lookup = lookup
        self.tree = tree
        self.draft_cost_per_call = draft_cost_per_call
        self.curve = curve
        self.prior = (prior_tree_tokens * prior_weight, prior_weight)
        self.decay = 1.0 - 1.0 / memory
        self.max_probe_interval = max_probe_interval
        self._reset()

    @property
    def curve(self) -> CostCurve:
        """The target's cost curve the tree is judged on; a batched engine replaces it with its batch's each round
        (its lookup half gets the batch's too), and the tree's round cost follows."""
        return self._curve

    @curve.setter
    def curve(self, curve: CostCurve) -> None:
        self._curve = curve
        if hasattr(self.tree, "branching"):  # a static tree
            self.tree_cost = tree_round_cost(curve, self.tree.branching, self.draft_cost_per_call)
        else:  # a dynamic tree (drafters.dynamic_tree): its largest round
            self.tree_cost = curve.cost(self.tree.max_nodes + 1) + self.tree.max_draft_calls * self.draft_cost_per_call

    def _reset(self) -> None:
        self._accepted, self._rounds = self.prior
        self._tree_round = False
        self._rounds_without_tree = 0
        self._probe_interval = 1
        self.num_lookup_rounds = self.num_tree_rounds = 0

    @property
    def draft(self):
        """The draft model behind the tree (what the benchmark times as draft work)."""
        return self.tree.cache.draft

    @property
    def tree_tokens(self) -> float:
        """Running mean of draft tokens accepted per tree round."""
        return self._accepted / self._rounds

    def tree_speedup(self) -> float:
        """The tree's running rate relative to plain decoding (tokens per unit cost; 1 = level)."""
        return (1.0 + self.tree_tokens) * self.curve.cost(1) / self.tree_cost

    def tree_gain(self) -> float:
        """How much faster than plain decoding the tree runs now (0: not faster)."""
        return max(0.0, self.tree_speedup() - 1.0)

    def start(self, prompt_ids: list[int]) -> None:
        self.lookup.start(prompt_ids)
        self.tree.start(prompt_ids)
        self._reset()

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self.lookup.min_gain = self.tree_gain()
        self._tree_round = False
        draft = self.lookup.propose(context_ids, max_num_draft_tokens, sampling, generator)
        if draft.num_nodes:
            self.num_lookup_rounds += 1
            return draft
        if self.tree_speedup() <= 1.0 and self._rounds_without_tree + 1 < self._probe_interval:
            self._rounds_without_tree += 1
            return EMPTY_DRAFT  # the tree's cache catches up on these tokens when it next drafts
        draft = self.tree.propose(context_ids, max_num_draft_tokens, sampling, generator)
        self._tree_round = draft.num_nodes > 0
        self.num_tree_rounds += self._tree_round
        return draft

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        if self._tree_round:
            self._accepted = self._accepted * self.decay + num_accepted
            self._rounds = self._rounds * self.decay + 1.0
            self._rounds_without_tree = 0
            # Paying again: draft every round. Still not: try again after twice as many rounds.
            self._probe_interval = (1 if self.tree_speedup() > 1.0
                                    else min(2 * self._probe_interval, self.max_probe_interval))
        self.lookup.commit(context_ids, 0 if self._tree_round else num_accepted)
        self.tree.commit(context_ids, num_accepted)
        self._tree_round = False
