"""Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding"): Jacobi iterations ride in the verification forward, and the n-grams they produce become drafts.

Jacobi decoding guesses the next ``window`` tokens at once and lets the target score them in one forward: the
target's argmax after guess ``j`` is a better guess for position ``j + 1`` (it saw guesses 1..j as its prefix, right
or wrong), so iterating refines the window towards the target's own continuation. On its own that gains little: a
guess is rarely right while the guesses before it are wrong. Lookahead decoding's point is what the iterations
leave behind: every scored row says "after these tokens the target would say this one", an n-gram of the target's
own. Kept in a pool keyed by their first token, they are drafted whenever the context ends with that token, and
verified like any draft.

This drafter, each round:

1. drafts, as one token tree rooted after the pending token, the pool's continuations of the context's last token
   (the most frequent first, at most ``max_guesses``) and the Jacobi window (the current guesses for the next
   positions), shared prefixes merged;
2. after the verification, reads the target's argmax on every row (:meth:`observe_target`): each row gives an n-gram
   (the ``ngram - 1`` tokens ending at that node, context included, then the target's token) for the pool, and the
   window's rows give the next Jacobi guesses, shifted past whatever the round committed.

Its difference from the paper's: the paper keeps ``ngram - 1`` levels of past windows and takes each n-gram along a
diagonal of that 2D history, with a custom attention mask beside the verification branch. Here the window is one
chain and its n-grams are read along the chain itself, so the whole draft is an ordinary token tree (each node sees
its ancestors at consecutive positions) and the loop, the verifiers and every backend's tree forward serve it
unchanged. Its rows are verified too, so a Jacobi guess the target agrees with is accepted at once.

How many rows: the pool's nodes as :class:`~jointspec.drafters.trie.TrieLookupDrafter` sizes its trie (ranked by
their share of the pooled counts, kept while the expected tokens per unit of the target's measured cost rise, with its
calibration and probes), then the window on the rows the cost curve says are nearly free (each at most
``free_row_cost`` of a step). Jacobi guesses are rarely accepted; their worth is the n-grams their rows leave, so they
stay out of the calibration and never make a round slower. On a GPU extra rows are nearly free and the whole window
runs; on a CPU it runs only where the curve is flat.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from jointspec.core.draft import Draft, chain_parents
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.trie import TrieLookupDrafter, merge_branches


class NgramPool:
    """The target's n-grams seen so far: per first token, up to ``max_per_key`` continuations with their counts
    (least recently seen out first)."""

    def __init__(self, max_per_key: int = 8) -> None:
        if max_per_key < 1:
            raise ValueError(f"max_per_key must be >= 1, got {max_per_key}")
        self.max_per_key = max_per_key
        self._pool: dict[int, OrderedDict[tuple[int, ...], int]] = {}

    def add(self, ngram: list[int]) -> None:
        if len(ngram) < 2:
            return
        entries = self._pool.setdefault(ngram[0], OrderedDict())
        key = tuple(ngram[1:])
        entries[key] = entries.pop(key, 0) + 1
        if len(entries) > self.max_per_key:
            entries.popitem(last=False)

    def continuations(self, token: int, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """Up to ``limit`` (continuation, count) after ``token``: the most counted first, then the most recent."""
        entries = self._pool.get(token)
        if not entries:
            return []
        ranked = sorted(enumerate(entries.items()), key=lambda item: (-item[1][1], -item[0]))
        return [entry for _, entry in ranked[:limit]]


class JacobiLookaheadDrafter(TrieLookupDrafter):
    """Lookahead decoding's drafts: the pool's n-grams and the Jacobi window as one tree (module docstring).

    ``window``: Jacobi guesses kept (W). ``ngram``: the n-gram length (N; continuations of N - 1 tokens).
    ``max_guesses``: pool continuations drafted per round (G). ``curve``: the target's cost curve (None: draft
    every node, up to ``max_nodes``)."""

    observes_target = True

    def __init__(self, curve: CostCurve | None, *, window: int = 4, ngram: int = 3, max_guesses: int = 4,
                 max_nodes: int = 16, free_row_cost: float = 0.05, memory: float = 10.0) -> None:
        if window < 1 or ngram < 2 or max_guesses < 0:
            raise ValueError(f"need window >= 1, ngram >= 2 and max_guesses >= 0, got {window}, {ngram}, "
                             f"{max_guesses}")
        if not free_row_cost >= 0:
            raise ValueError(f"free_row_cost must be >= 0, got {free_row_cost}")
        self.window = window
        self.ngram = ngram
        self.max_guesses = max_guesses
        self.free_row_cost = free_row_cost
        super().__init__(curve, max_depth=max(window, ngram - 1), max_nodes=max_nodes, memory=memory)

    def start(self, prompt_ids: list[int]) -> None:
        super().start(prompt_ids)
        self.pool = NgramPool()
        # The first guesses: the prompt's last tokens (the paper starts from tokens of the prompt, too). Jacobi
        # rewrites them within a few rounds.
        self.guesses = list(prompt_ids[-self.window:])
        self._context_length = len(prompt_ids)
        self._window_nodes: list[int] = []  # draft node of each drafted window guess, in order
        self._next_guesses: list[int] = []  # the target's guesses for the positions after the pending token
        self._num_pool_nodes = 0  # the last draft's nodes from the pool (the window's come after them)
        self._num_pool_accepted = 0  # of the last round's accepted nodes, those the pool drafted

    def trie(self, context_ids: list[int], max_depth: int) -> tuple[list[int], list[int], list[float]]:
        """The pool's continuations of the context's last token, merged and ranked."""
        return merge_branches([(list(tokens[:max_depth]), float(count))
                               for tokens, count in self.pool.continuations(context_ids[-1], self.max_guesses)])

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self._context_length = len(context_ids)
        self._draft_context = context_ids[-(self.ngram - 1):]
        # The pool's n-grams, as many as pay for their rows (the calibration learns how often they are accepted).
        draft = super().propose(context_ids, max_num_draft_tokens, sampling, generator)
        self._num_pool_nodes = draft.num_nodes
        tokens, parents = list(draft.token_ids), draft.node_parents()
        # Then the window, on rows the cost curve says are nearly free: Jacobi guesses are rarely accepted, their worth
        # is the n-grams their rows leave, so they are kept out of the calibration and never paid for with a slower
        # round. Where a guess is already a node (a pooled n-gram drafted it), the window follows that node.
        children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
        self._window_nodes, parent = [], -1
        for token in self.guesses[:min(self.max_depth, max_num_draft_tokens)]:
            node = children.get((parent, token))
            if node is None:
                if not self._free_row(len(tokens)):
                    break
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
            self._window_nodes.append(node)
            parent = node
        if len(tokens) == draft.num_nodes:
            return draft
        return Draft(token_ids=tokens, parents=None if parents == chain_parents(len(tokens)) else parents)

    def _free_row(self, num_nodes: int) -> bool:
        """Whether one more draft row (after ``num_nodes``) costs at most ``free_row_cost`` of a step."""
        if self.curve is None:
            return num_nodes < self.max_nodes
        return (num_nodes < self.max_nodes and self.curve.cost(num_nodes + 2) - self.curve.cost(num_nodes + 1)
                <= self.free_row_cost * self.curve.cost(1))

    def observe_target(self, draft: Draft, target_tokens: list[int], accepted: list[int]) -> None:
        """Pool every row's n-gram; take the window rows' tokens as the next Jacobi guesses; note how many of the
        accepted nodes the pool drafted (the window's rows being free, the calibration counts only those)."""
        context = self._draft_context
        paths: list[list[int]] = []
        for parent, token in zip(draft.node_parents(), draft.token_ids):
            paths.append((paths[parent] if parent >= 0 else []) + [token])
        self.pool.add((context + [target_tokens[0]])[-self.ngram:])  # the pending token's row: a true n-gram
        for node, path in enumerate(paths):
            self.pool.add((context + path + [target_tokens[node + 1]])[-self.ngram:])
        # The target's guess for position j after the pending token saw guesses 1..j-1 as its prefix (Jacobi).
        self._next_guesses = [target_tokens[0]] + [target_tokens[node + 1] for node in self._window_nodes]
        self._num_pool_accepted = sum(node < self._num_pool_nodes for node in accepted)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        super().commit(context_ids, self._num_pool_accepted)
        num_committed = len(context_ids) - self._context_length  # accepted tokens and the target's own one
        # The guesses for the positions after the new pending token; positions Jacobi has not reached keep the
        # old guesses shifted along (or, past them, the last guess), to be refined in later rounds.
        refined = self._next_guesses[num_committed:]
        older = self.guesses[num_committed + len(refined):]
        guesses = (refined + older)[:self.window]
        while guesses and len(guesses) < self.window:
            guesses.append(guesses[-1])
        self.guesses = guesses or list(context_ids[-self.window:])
        self._next_guesses = []
