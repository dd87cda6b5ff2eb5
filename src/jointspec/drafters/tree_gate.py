"""A token tree drafted only while it runs faster than plain decoding on the target's cost curve.

A tree round verifies every node in one target forward, after one draft call per level, and keeps on average
``1 + t`` tokens, ``t`` the tree's running mean of accepted draft tokens. Its rate relative to plain decoding is
``(1 + t) * T(1) / (T(nodes + 1) + levels * c)``, with ``T`` the target's cost curve and ``c`` one draft call. Where
that is 1 or less (a target whose many-row forwards are dear, such as a quantised model on a CPU or llama.cpp; a
draft that fits the text badly; a batch that fills up) the round drafts nothing, and the tree is tried again after
2, 4, 8, ... rounds (at most ``max_probe_interval``) to see whether it pays again; it drafts every round while it
does.

A probe costs what a tree round costs, several plain steps for a large tree on a dear curve, so
:class:`GatedTreeDrafter` also spaces its probes so that they cost at most
:data:`~jointspec.drafters.costaware.LEARNING_SHARE_OF_GAIN` of the most the tree could gain (every level accepted),
and drafts no tree at all where even that would not beat plain decoding.

``t`` is a decayed mean over recent tree rounds (``memory`` rounds), per request, starting from
``prior_tree_tokens`` over ``prior_weight`` rounds. Whether a round drafts depends only on earlier rounds, never on
the draws of its own, so the verifier's output law is unchanged: a lossless tree method stays lossless.

:class:`TreeGate` is that bookkeeping; :class:`GatedTreeDrafter` is a tree drafter behind it (``specinfer`` and
``spectr``), and :class:`~jointspec.drafters.lookup_tree.LookupOrTreeDrafter` (`default`'s) uses the same gate for
its tree half.
"""

from __future__ import annotations

import math

import torch

from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import LEARNING_SHARE_OF_GAIN, CostCurve


def tree_round_cost(curve: CostCurve, branching: tuple[int, ...], draft_cost_per_call: float) -> float:
    """Cost of a round that drafts a full ``branching`` tree (one draft call per level) and verifies it."""
    nodes, level = 0, 1
    for factor in branching:
        level *= factor
        nodes += level
    return curve.cost(nodes + 1) + len(branching) * draft_cost_per_call


class TreeGate:
    """Whether a tree round is due: the tree's running mean of accepted tokens, and the probes of a tree that does not
    pay (module docstring)."""

    def __init__(self, *, prior_tree_tokens: float = 0.5, prior_weight: float = 2.0, memory: float = 10.0,
                 max_probe_interval: int = 64) -> None:
        if not (math.isfinite(prior_tree_tokens) and prior_tree_tokens >= 0) or not prior_weight > 0:
            raise ValueError(f"need prior_tree_tokens >= 0 and prior_weight > 0, got {prior_tree_tokens} and "
                             f"{prior_weight}")
        if not memory > 1:
            raise ValueError(f"memory must be > 1 (tree rounds the estimate averages), got {memory}")
        if max_probe_interval < 1:
            raise ValueError(f"max_probe_interval must be >= 1, got {max_probe_interval}")
        self.prior = (prior_tree_tokens * prior_weight, prior_weight)
        self.decay = 1.0 - 1.0 / memory
        self.max_probe_interval = max_probe_interval
        # The fewest plain rounds between probes (its owner sets it from what a probe costs); inf: never probe.
        self.min_probe_interval = 1.0
        self.reset()

    def reset(self) -> None:
        self._accepted, self._rounds = self.prior
        self._rounds_without_tree = 0
        self._probe_interval = 1

    @property
    def tree_tokens(self) -> float:
        """Running mean of draft tokens accepted per tree round."""
        return self._accepted / self._rounds

    def speedup(self, curve: CostCurve, tree_cost: float) -> float:
        """The tree's running rate relative to plain decoding on ``curve`` (tokens per unit cost; 1 = level), a
        round of it costing ``tree_cost``."""
        return (1.0 + self.tree_tokens) * curve.cost(1) / tree_cost

    def due(self, paying: bool) -> bool:
        """Whether this round drafts the tree: always while it pays, else when a probe is due (counting the round
        as one without a tree where it is not)."""
        if paying or self._rounds_without_tree + 1 >= max(self._probe_interval, self.min_probe_interval):
            return True
        self._rounds_without_tree += 1
        return False

    def record(self, num_accepted: int, curve: CostCurve, tree_cost: float) -> None:
        """A tree round kept ``num_accepted`` of its draft tokens."""
        self._accepted = self._accepted * self.decay + num_accepted
        self._rounds = self._rounds * self.decay + 1.0
        self._rounds_without_tree = 0
        # Paying again: draft every round. Still not: try again after twice as many rounds.
        self._probe_interval = (1 if self.speedup(curve, tree_cost) > 1.0
                                else min(2 * self._probe_interval, self.max_probe_interval))


def probe_floor(curve: CostCurve, tree_cost: float, max_tokens: int) -> float:
    """The fewest plain rounds between probes of a tree that costs ``tree_cost`` a round and keeps at most
    ``max_tokens`` draft tokens, so that probing costs at most LEARNING_SHARE_OF_GAIN of the most it could gain (inf
    where it could gain nothing)."""
    step = curve.cost(1)
    best_gain = (1 + max_tokens) * step / tree_cost - 1.0
    if best_gain <= 0:
        return math.inf
    return max(1.0, (tree_cost / step - 1.0) / (LEARNING_SHARE_OF_GAIN * best_gain))


def round_cost_of(tree, curve: CostCurve, draft_cost_per_call: float) -> float:
    """What one round of ``tree`` costs on ``curve``: a static tree's full shape, a dynamic tree
    (:mod:`jointspec.drafters.dynamic_tree`) its largest round."""
    if hasattr(tree, "branching"):
        return tree_round_cost(curve, tree.branching, draft_cost_per_call)
    return curve.cost(tree.max_nodes + 1) + tree.max_draft_calls * draft_cost_per_call


class GatedTreeDrafter:
    """A tree drafter (:class:`~jointspec.drafters.tree.TreeDrafter`) that drafts only while its tree pays on the
    target's cost curve (module docstring). A batched engine may replace ``curve`` with its batch's each round.
    ``every_round``: a tree the user asked for, drafted every round whatever it costs (its rate is still tracked).
    ``space_probes``: probes at least :func:`probe_floor` rounds apart (a static tree; `default`'s lookup-or-tree
    drafter, whose trees are small, probes on the doubling schedule alone)."""

    cost_aware = True  # weighs its tree against the cost curve itself (methods.build_method does not wrap it)

    def __init__(self, tree, curve: CostCurve, *, draft_cost_per_call: float, every_round: bool = False,
                 space_probes: bool = True, **gate_settings) -> None:
        if not (math.isfinite(draft_cost_per_call) and draft_cost_per_call >= 0):
            raise ValueError(f"draft_cost_per_call must be finite and >= 0, got {draft_cost_per_call}")
        self.tree = tree
        self.every_round = every_round
        self.space_probes = space_probes
        self.draft_cost_per_call = draft_cost_per_call
        self.gate = TreeGate(**gate_settings)
        self.curve = curve
        self._tree_round = False
        self.num_tree_rounds = 0

    @property
    def curve(self) -> CostCurve:
        return self._curve

    @curve.setter
    def curve(self, curve: CostCurve) -> None:
        self._curve = curve
        self.tree_cost = round_cost_of(self.tree, curve, self.draft_cost_per_call)
        if self.space_probes:
            self.gate.min_probe_interval = probe_floor(curve, self.tree_cost, len(self.tree.branching))

    @property
    def draft(self):
        """The draft model behind the tree (what the benchmark times as draft work)."""
        return self.tree.cache.draft

    @property
    def tree_tokens(self) -> float:
        """Running mean of draft tokens accepted per tree round."""
        return self.gate.tree_tokens

    @property
    def tree_round(self) -> bool:
        """Whether the round proposed last drafted the tree (until its commit)."""
        return self._tree_round

    def tree_speedup(self) -> float:
        """The tree's running rate relative to plain decoding (tokens per unit cost; 1 = level)."""
        return self.gate.speedup(self.curve, self.tree_cost)

    def start(self, prompt_ids: list[int]) -> None:
        self.tree.start(prompt_ids)
        self.gate.reset()
        self._tree_round = False
        self.num_tree_rounds = 0

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self._tree_round = False
        if not (self.every_round or self.gate.due(self.tree_speedup() > 1.0)):
            return EMPTY_DRAFT  # the tree's cache catches up on these tokens when it next drafts
        draft = self.tree.propose(context_ids, max_num_draft_tokens, sampling, generator)
        self._tree_round = draft.num_nodes > 0
        self.num_tree_rounds += self._tree_round
        return draft

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        if self._tree_round:
            self.gate.record(num_accepted, self.curve, self.tree_cost)
        self.tree.commit(context_ids, num_accepted)
        self._tree_round = False
