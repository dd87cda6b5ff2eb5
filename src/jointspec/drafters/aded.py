"""ADED (Liu et al., 2024, "Adaptive Draft-Verification for Efficient Large Language Model Decoding"): an adaptive
tri-gram model of what the target writes, and a tree search over it that drafts a token tree.

The store. :class:`TrigramStore` counts, for every pair of tokens ``(a, b)`` the request has seen, which tokens came
next, with a bigram ``b -> next`` and a unigram table to back off to. It learns from the prompt at ``start`` and from
every committed token after, so within a request it follows what the target actually writes (the paper's
"adaptive" representation). Recent observations weigh more: each time a context is seen again its counts are
multiplied by ``decay`` before the new one is added, so a context that changed its continuation (a list that moved
on to its next item) follows within a few sightings rather than being outvoted by its history. Memory is bounded:
at most ``max_next`` continuations per context (the lightest one is dropped for a new one) and ``max_contexts``
contexts per order (the least recently seen is dropped).

Chances, with back-off. The chance of ``x`` after ``a b`` interpolates the orders as a Dirichlet prior would, with
``w`` the decayed counts and ``W`` their sum::

    P3(x | a b) = (w_ab(x) + beta * P2(x | b)) / (W_ab + beta)
    P2(x | b)   = (w_b(x) + beta * P1(x)) / (W_b + beta)
    P1(x)       = w(x) / (W + beta)          (the rest goes to tokens never seen)

so a context seen once is trusted half (beta = 1), one seen often almost fully, and an unseen one falls back to the
shorter context. Example: after "x a b c ... a b c ... a b d", ``P3(c | a b)`` with decay 1 is (2 + P2) / 4 > 0.5
and ``P3(d | a b)`` about 0.25: both are drafted as siblings if the cost curve pays for them.

An optional ``prior`` (an :class:`~jointspec.drafters.corpus.NgramTable` of the target's own answers, shipped for
some tokenizers) adds ``prior_weight`` pseudo-observations to every context: ``prior_weight * share`` on the token
the table says follows the path's longest known n-gram, the rest spread by the back-off. With ``answers`` (an
:class:`~jointspec.drafters.memory.OutputMemory` of this deployment's earlier answers: online adaptation) the
memory adds its own ``prior_weight`` pseudo-observations beside the table's, wherever it knows the context. The
table is read, never copied (a million entries would not fit the store's bound), and the request's own counts
outweigh both after a few sightings.

The tree search. The paper builds drafts with a Monte Carlo tree search (PUCT) that balances exploring uncertain
branches against exploiting likely ones. Here the store gives every node's chance in closed form (the product of
the chances along its path), so the search need not estimate them by simulation: a best-first search pops nodes by
path chance from a heap and pushes each popped node's ``max_children`` likeliest continuations. Because a child's
chance never exceeds its parent's, the popped sequence is the exact top of the tree by chance, parents first, and
its sum is the expected number of accepted tokens under the store. Exploration comes from the back-off: the siblings
of a confident continuation are the shorter contexts' alternatives, and a context seen once is trusted only half.
Nodes after an end-of-sequence token are never drafted (plain decoding stops there).

How many nodes. As Lookahead's trie (:mod:`jointspec.drafters.trie`, whose sizing this drafter reuses): the prefix of
the ranked nodes with the most expected tokens per unit cost on the target's measured cost curve, the chances scaled
by a calibration learned from this request's acceptance, with rare probes when the calibration alone says no.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from jointspec.drafters.corpus import NgramTable
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.memory import OutputMemory
from jointspec.drafters.trie import TrieLookupDrafter


class _Counts:
    """Decayed next-token counts per context, bounded in contexts (least recently seen dropped) and in continuations
    per context (lightest dropped)."""

    def __init__(self, max_contexts: int, max_next: int, decay: float) -> None:
        self.max_contexts = max_contexts
        self.max_next = max_next
        self.decay = decay
        self.table: OrderedDict[object, dict[int, float]] = OrderedDict()

    def observe(self, context: object, token: int) -> None:
        weights = self.table.get(context)
        if weights is None:
            weights = self.table[context] = {}
            if len(self.table) > self.max_contexts:
                self.table.popitem(last=False)
        else:
            self.table.move_to_end(context)
            for other in weights:
                weights[other] *= self.decay
        if token not in weights and len(weights) >= self.max_next:
            del weights[min(weights, key=weights.__getitem__)]
        weights[token] = weights.get(token, 0.0) + 1.0

    def get(self, context: object) -> dict[int, float]:
        return self.table.get(context, {})


class TrigramStore:
    """The adaptive tri-gram representation with bigram and unigram back-off (module docstring)."""

    def __init__(self, *, memory: float = 16.0, beta: float = 1.0, max_next: int = 8, max_contexts: int = 1 << 16,
                 prior: NgramTable | None = None, prior_weight: float = 2.0,
                 answers: OutputMemory | None = None) -> None:
        if not memory > 1:
            raise ValueError(f"memory must be > 1, got {memory}")
        if not beta > 0 or prior_weight < 0:
            raise ValueError(f"need beta > 0 and prior_weight >= 0, got {beta} and {prior_weight}")
        if max_next < 1 or max_contexts < 1:
            raise ValueError(f"max_next and max_contexts must be >= 1, got {max_next} and {max_contexts}")
        decay = 1.0 - 1.0 / memory
        self.beta = beta
        # Each source that knows the context adds its pseudo-observations: the table of the target's answers to other
        # prompts, and its earlier answers here (online adaptation, drafters/memory.py). Replayed over recorded
        # answers, adding both beat asking either first (lab notes, section 13).
        self.priors = tuple(source for source in (prior, answers) if source is not None)
        self.prior_weight = prior_weight if self.priors else 0.0
        self.trigrams = _Counts(max_contexts, max_next, decay)
        self.bigrams = _Counts(max_contexts, max_next, decay)
        # The unigram table is one context with a wider reach: the back-off of last resort.
        self.unigrams = _Counts(1, 4 * max_next, decay)

    def observe(self, history: list[int], token: int) -> None:
        """``token`` followed ``history`` (its last two tokens are read)."""
        self.unigrams.observe(None, token)
        if history:
            self.bigrams.observe(history[-1], token)
        if len(history) >= 2:
            self.trigrams.observe((history[-2], history[-1]), token)

    def observe_all(self, token_ids: list[int], start: int = 0) -> None:
        """Every token of ``token_ids`` from index ``start`` on, each after the tokens before it."""
        for i in range(start, len(token_ids)):
            self.observe(token_ids[max(0, i - 2):i], token_ids[i])

    def chances(self, history: list[int]) -> dict[int, float]:
        """Every token the store can name after ``history``, with its interpolated chance (module docstring)."""
        beta = self.beta
        unigram = self.unigrams.get(None)
        total = sum(unigram.values()) + beta
        chances = {token: weight / total for token, weight in unigram.items()}
        if history:
            chances = self._mix(self.bigrams.get(history[-1]), chances, {}, 0.0)
        if len(history) >= 2:
            prior, prior_weight = {}, 0.0
            for source in self.priors:
                found = source.continuation(history[-source.max_order:])
                if found is not None:
                    prior[found[0]] = prior.get(found[0], 0.0) + self.prior_weight * found[1]
                    prior_weight += self.prior_weight
            chances = self._mix(self.trigrams.get((history[-2], history[-1])), chances, prior, prior_weight)
        return chances

    def _mix(self, weights: dict[int, float], backoff: dict[int, float], prior: dict[int, float],
             prior_weight: float) -> dict[int, float]:
        # The back-off keeps beta pseudo-counts plus what the prior's own share leaves unassigned.
        backoff_weight = self.beta + prior_weight - sum(prior.values())
        total = sum(weights.values()) + self.beta + prior_weight
        mixed = {token: backoff_weight * chance / total for token, chance in backoff.items()}
        for source in (weights, prior):
            for token, weight in source.items():
                mixed[token] = mixed.get(token, 0.0) + weight / total
        return mixed


class AdedDrafter(TrieLookupDrafter):
    """Token trees from an adaptive tri-gram store, found by best-first search and sized by the cost curve (module
    docstring).

    ``curve``: the target's cost curve (None: always ``max_nodes`` nodes at most). ``max_depth``: the deepest node.
    ``max_children``: continuations pushed per expanded node. ``min_chance``: paths less likely than this are not
    searched (they would never pay). ``eos_token_ids``: tokens never drafted past. ``calibration_memory``: rounds
    the calibration averages over. The store is rebuilt per request (from the prompt, then each commit);
    ``store_options`` are :class:`TrigramStore`'s keywords.
    """

    def __init__(self, curve: CostCurve | None, *, max_depth: int = 8, max_nodes: int = 16, max_children: int = 4,
                 min_chance: float = 0.01, eos_token_ids: frozenset[int] = frozenset(),
                 calibration_memory: float = 10.0, **store_options) -> None:
        if max_children < 1:
            raise ValueError(f"max_children must be >= 1, got {max_children}")
        if not 0 <= min_chance < 1:
            raise ValueError(f"min_chance must be in [0, 1), got {min_chance}")
        self.max_children = max_children
        self.min_chance = min_chance
        self.eos_token_ids = eos_token_ids
        self.store_options = store_options
        TrigramStore(**store_options)  # refuse bad options here, not at the first request
        super().__init__(curve, max_depth=max_depth, max_nodes=max_nodes, memory=calibration_memory)

    def start(self, prompt_ids: list[int]) -> None:
        super().start(prompt_ids)
        self.store = TrigramStore(**self.store_options)
        self.store.observe_all(prompt_ids)
        self._num_seen = len(prompt_ids)

    def _catch_up(self, context_ids: list[int]) -> None:
        """Learn the committed tokens the store has not seen yet."""
        if len(context_ids) > self._num_seen:
            self.store.observe_all(context_ids, self._num_seen)
            self._num_seen = len(context_ids)

    def trie(self, context_ids: list[int], max_depth: int) -> tuple[list[int], list[int], list[float]]:
        """The best-first tree: (tokens, parents, chances) per node, by chance, parents before children."""
        self._catch_up(context_ids)
        history = list(context_ids[-4:])  # the store reads 2 tokens, a prior table up to its order (4 at most)
        tokens: list[int] = []
        parents: list[int] = []
        chances: list[float] = []
        # Heap entries: (-chance, tie-break by push order, parent node, token, depth, the path's history).
        heap: list[tuple[float, int, int, int, int, list[int]]] = []
        pushed = 0

        def expand(parent: int, depth: int, path: list[int], chance: float) -> None:
            nonlocal pushed
            if depth >= max_depth:
                return
            ranked = sorted(self.store.chances(path).items(), key=lambda item: (-item[1], item[0]))
            for token, p in ranked[:self.max_children]:
                if chance * p < self.min_chance:
                    break
                heapq.heappush(heap, (-chance * p, pushed, parent, token, depth, (path + [token])[-4:]))
                pushed += 1

        expand(-1, 0, history, 1.0)
        while heap and len(tokens) < self.max_nodes:
            negative, _, parent, token, depth, path = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(token)
            parents.append(parent)
            chances.append(-negative)
            # A full tree needs no more candidates; nothing follows an end-of-sequence token.
            if len(tokens) < self.max_nodes and token not in self.eos_token_ids:
                expand(node, depth + 1, path, -negative)
        return tokens, parents, chances

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        super().commit(context_ids, num_accepted)
        self._catch_up(context_ids)

