"""Drafters for the batched engine: one object drafts for many sequences at once.

A :class:`BatchDrafter` is the single-sequence :class:`~jointspec.core.draft.Drafter` protocol with a sequence id
on every call, so sequences can join (``add``) and leave (``remove``) between rounds. Two kinds exist:

- :class:`PerRowDrafter` runs one copy of a single-sequence drafter per sequence. Right for drafters that are cheap
  and keep no model state (``ar``'s :class:`NoDrafter`, prompt lookup).
- :class:`BatchModelDrafter` runs a draft model over the whole batch, its KV cache a
  :class:`~jointspec.batch.cache.RaggedCache`, one forward per draft depth for every row together.

:func:`batch_drafter_for` turns the drafter a method builds into one of these, and refuses the rest.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Protocol

import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch.cache import RaggedCache
from jointspec.core.draft import EMPTY_DRAFT, Draft, Drafter, NoDrafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.drafters.corpus import CorpusLookupDrafter
from jointspec.drafters.model import ModelDrafter, common_prefix_length, draft_room
from jointspec.drafters.ngram import PromptLookupDrafter


class BatchDrafter(Protocol):
    def add(self, seq_id: int, prompt_ids: list[int]) -> None:
        """A sequence joins with ``prompt_ids``."""

    def remove(self, seq_ids: set[int]) -> None:
        """Sequences leave (finished or cancelled)."""

    def propose(self, seq_ids: list[int], contexts: list[list[int]], budgets: list[int],
                samplings: list[SamplingConfig], generators: list[torch.Generator | None]) -> list[Draft]:
        """One chain draft per sequence, at most ``budgets[i]`` tokens long."""

    def commit(self, seq_ids: list[int], contexts: list[list[int]], num_accepted: list[int]) -> None:
        """What each sequence kept this round; ``contexts[i]`` is its whole committed sequence."""


class PerRowDrafter:
    """A fresh copy of ``prototype`` per sequence; calls go to each copy in turn. The attributes named in ``shared``
    (read-only data such as an n-gram table) are shared by every copy rather than copied per request."""

    def __init__(self, prototype: Drafter, shared: tuple[str, ...] = ()) -> None:
        self.prototype = prototype
        self.shared = {id(getattr(prototype, name)): getattr(prototype, name) for name in shared}
        self.drafters: dict[int, Drafter] = {}

    def add(self, seq_id: int, prompt_ids: list[int]) -> None:
        drafter = copy.deepcopy(self.prototype, memo=dict(self.shared))
        drafter.start(prompt_ids)
        self.drafters[seq_id] = drafter

    def remove(self, seq_ids: set[int]) -> None:
        for seq_id in seq_ids:
            self.drafters.pop(seq_id, None)

    def propose(self, seq_ids, contexts, budgets, samplings, generators) -> list[Draft]:
        return [self.drafters[s].propose(c, b, sc, g)
                for s, c, b, sc, g in zip(seq_ids, contexts, budgets, samplings, generators)]

    def commit(self, seq_ids, contexts, num_accepted) -> None:
        for seq_id, context, accepted in zip(seq_ids, contexts, num_accepted):
            self.drafters[seq_id].commit(context, accepted)


class BatchModelDrafter:
    """:class:`~jointspec.drafters.model.ModelDrafter` for a batch: the same drafts, one forward per depth.

    Per row it keeps ``cached_ids``, the tokens whose keys are in the draft cache, and follows the same fix-up: after
    a round the cache holds the context plus every draft token but the last; ``commit`` keeps the longest prefix
    shared with the committed sequence (never the last committed token, which the next round feeds). So the next
    round feeds 1 token per row after a rejection and 2 after a full acceptance: a ragged first forward.

    A row whose budget is shorter than the batch's draft length stops sampling at its budget (it still feeds dummy
    tokens so the batch stays rectangular), so its generator sees exactly the draws a single-sequence run makes.
    """

    def __init__(self, drafter: ModelDrafter) -> None:
        self.num_draft_tokens = drafter.num_draft_tokens
        self.draft = drafter.draft
        self.cache = RaggedCache(drafter.draft)
        self.cached_ids: dict[int, list[int]] = {}

    def add(self, seq_id: int, prompt_ids: list[int]) -> None:
        self.cache.add(seq_id, prompt_ids[:-1])
        self.cached_ids[seq_id] = list(prompt_ids[:-1])

    def remove(self, seq_ids: set[int]) -> None:
        self.cache.remove(seq_ids)
        for seq_id in seq_ids:
            self.cached_ids.pop(seq_id, None)

    def _in_row_order(self, seq_ids: list[int]) -> list[int]:
        assert sorted(seq_ids) == sorted(self.cache.row_ids), "every sequence of this drafter drafts each round"
        position = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        return [position[row_id] for row_id in self.cache.row_ids]

    def propose(self, seq_ids, contexts, budgets, samplings, generators) -> list[Draft]:
        # A row drafts what the draft's own window holds, as ModelDrafter does (drafters/model.py, draft_room): past
        # it the row feeds dummy tokens (the cache clamps their positions) and draws nothing.
        budgets = [min(self.num_draft_tokens, budget, draft_room(self.draft, context))
                   for budget, context in zip(budgets, contexts)]
        depth = max(budgets, default=0)
        if depth <= 0:
            return [EMPTY_DRAFT] * len(seq_ids)
        order = self._in_row_order(seq_ids)  # order[r]: index in the arguments of the sequence in cache row r
        inputs = [contexts[i][len(self.cached_ids[seq_ids[i]]):] for i in order]
        logits = self.cache.forward(inputs)  # [rows, width, vocab]
        last = torch.tensor([len(x) - 1 for x in inputs])
        logits = logits[torch.arange(len(order)), last]  # [rows, vocab]: after each row's last real token
        tokens: list[list[int]] = [[] for _ in order]
        rows: list[list[torch.Tensor]] = [[] for _ in order]
        for step in range(depth):
            for r, i in enumerate(order):
                if step >= budgets[i]:
                    tokens[r].append(0)  # dummy: keeps the batch rectangular, never part of a draft
                elif samplings[i].greedy:
                    tokens[r].append(int(logits[r].argmax()))
                else:
                    probs = processed_probs(logits[r], samplings[i])  # [vocab]
                    tokens[r].append(int(sample(probs, generators[i])))
                    rows[r].append(probs)
            if step + 1 < depth:
                logits = self.cache.forward([[t[-1]] for t in tokens])[:, 0]  # [rows, vocab]
        drafts: list[Draft] = [EMPTY_DRAFT] * len(seq_ids)
        for r, i in enumerate(order):
            self.cached_ids[seq_ids[i]] = list(contexts[i]) + tokens[r][:-1]
            if budgets[i] > 0:
                drafts[i] = Draft(token_ids=tokens[r][:budgets[i]],
                                  draft_probs=torch.stack(rows[r]) if rows[r] else None)
        return drafts

    def commit(self, seq_ids, contexts, num_accepted) -> None:
        context_of = dict(zip(seq_ids, contexts))
        keep: list[int] = []
        for row_id, length in zip(self.cache.row_ids, self.cache.lengths()):
            cached = self.cached_ids[row_id]
            assert length == len(cached)
            if row_id in context_of:
                context = context_of[row_id]
                n = common_prefix_length(cached, context, start=len(cached) - self.num_draft_tokens)
                n = min(n, len(context) - 1)  # always leave one committed token to feed next time
                self.cached_ids[row_id] = cached[:n]
                length = n
            keep.append(length)
        self.cache.truncate(keep)


# Drafter types the batched engine knows how to run, and how. Add an entry to batch a new drafter.
_BATCH_DRAFTERS: dict[type, Callable[[Drafter], BatchDrafter]] = {
    NoDrafter: PerRowDrafter,
    # A memory of earlier answers (drafters/memory.py) is shared by every row that drafts from it, never copied.
    PromptLookupDrafter: lambda drafter: PerRowDrafter(drafter, shared=("output_memory",)),
    CorpusLookupDrafter: lambda drafter: PerRowDrafter(drafter, shared=("table", "output_memory")),
    ModelDrafter: BatchModelDrafter,
}


def register_batch_drafter(drafter_type: type, make: Callable[[Drafter], BatchDrafter]) -> None:
    _BATCH_DRAFTERS[drafter_type] = make


def batch_drafter_for(drafter: Drafter, method_name: str) -> BatchDrafter:
    """The batched form of ``drafter``; :class:`UnsupportedOptionError` if it has none."""
    # Cost-aware wrapping is per sequence: a batch runs the inner drafter (a batched forward has its own cost curve).
    drafter = getattr(drafter, "inner", drafter)
    price_rows = getattr(drafter, "price_rows", None)
    if price_rows is not None:
        # The wrapper priced the drafter's rows as a lone sequence's; a padded batch's cost more, and no curve
        # prices them here: the unpriced bar.
        price_rows(None)
    if isinstance(drafter, ModelDrafter) and not isinstance(drafter.draft, CausalLM):
        raise UnsupportedOptionError(f"method '{method_name}' with a trained draft head cannot run batched yet; "
                                     "decode it one sequence at a time")
    make = _BATCH_DRAFTERS.get(type(drafter))
    if make is None:
        raise UnsupportedOptionError(
            f"method '{method_name}' cannot run batched: its drafter ({type(drafter).__name__}) has no batched "
            f"form; batched methods use drafters {', '.join(sorted(t.__name__ for t in _BATCH_DRAFTERS))} "
            "(methods ar, pld, corpus, sps). Decode it one sequence at a time instead")
    return make(drafter)
