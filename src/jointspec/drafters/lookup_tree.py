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

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
from jointspec.drafters.dynamic_tree import DynamicTreeDrafter
from jointspec.drafters.tree import TreeDrafter
from jointspec.drafters.tree_gate import GatedTreeDrafter, tree_round_cost  # noqa: F401  (re-exported)


class LookupOrTreeDrafter:
    cost_aware = True  # its lookup half is; the tree is what the lookup must beat (methods.build_method)

    def __init__(self, lookup: CostAwareDrafter, tree: TreeDrafter | DynamicTreeDrafter, curve: CostCurve, *,
                 draft_cost_per_call: float, prior_tree_tokens: float = 0.5, prior_weight: float = 2.0,
                 memory: float = 10.0, max_probe_interval: int = 64) -> None:
        self.lookup = lookup
        # The tree half: drafted where lookup drafts nothing, while it pays (drafters/tree_gate.py).
        self.gated = GatedTreeDrafter(tree, curve, draft_cost_per_call=draft_cost_per_call, space_probes=False,
                                      prior_tree_tokens=prior_tree_tokens, prior_weight=prior_weight, memory=memory,
                                      max_probe_interval=max_probe_interval)
        self.num_lookup_rounds = 0

    @property
    def tree(self) -> TreeDrafter | DynamicTreeDrafter:
        return self.gated.tree

    @property
    def curve(self) -> CostCurve:
        """The target's cost curve the tree is judged on; a batched engine replaces it with its batch's each round
        (its lookup half gets the batch's too), and the tree's round cost follows."""
        return self.gated.curve

    @curve.setter
    def curve(self, curve: CostCurve) -> None:
        self.gated.curve = curve

    @property
    def tree_cost(self) -> float:
        return self.gated.tree_cost

    @property
    def num_tree_rounds(self) -> int:
        return self.gated.num_tree_rounds

    @property
    def draft(self):
        """The draft model behind the tree (what the benchmark times as draft work)."""
        return self.gated.draft

    @property
    def tree_tokens(self) -> float:
        """Running mean of draft tokens accepted per tree round."""
        return self.gated.tree_tokens

    def tree_speedup(self) -> float:
        """The tree's running rate relative to plain decoding (tokens per unit cost; 1 = level)."""
        return self.gated.tree_speedup()

    def tree_gain(self) -> float:
        """How much faster than plain decoding the tree runs now (0: not faster)."""
        return max(0.0, self.tree_speedup() - 1.0)

    def start(self, prompt_ids: list[int]) -> None:
        self.lookup.start(prompt_ids)
        self.gated.start(prompt_ids)
        self.num_lookup_rounds = 0

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self.lookup.min_gain = self.tree_gain()
        draft = self.lookup.propose(context_ids, max_num_draft_tokens, sampling, generator)
        if draft.num_nodes:
            self.num_lookup_rounds += 1
            return draft
        return self.gated.propose(context_ids, max_num_draft_tokens, sampling, generator)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self.lookup.commit(context_ids, 0 if self.gated.tree_round else num_accepted)
        self.gated.commit(context_ids, num_accepted)
