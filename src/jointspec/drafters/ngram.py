"""Prompt lookup: draft by copying what followed the last occurrence of the context's final n-gram.

Example with ``max_ngram=2``: context ``[5, 6, 7, 9, 5, 6]`` ends with the bigram ``[5, 6]``, which also occurs at
position 0 and was followed by ``[7, 9, 5, 6]``; with ``num_draft_tokens=3`` the draft is ``[7, 9, 5]``. Longer
n-grams are tried first (a longer match predicts better); among equal-length matches the most recent one wins
(recent text is what a model tends to repeat). No match: an empty draft, and the round costs one plain step.
The drafter has no probabilities: verifiers treat its tokens as one-hot drafts.

Draft length adapts: a copy that was accepted whole is probably still running (the model is quoting its input), so
the next draft doubles, up to ``max_num_draft_tokens``; any rejection drops back to ``num_draft_tokens``. Long drafts
thus only happen while they pay, and a spurious match costs at most a short verification.

With an :class:`~jointspec.drafters.memory.OutputMemory` the drafter also copies from the target's earlier answers
where they hold a longer match than the context (online adaptation, :mod:`jointspec.drafters.memory`).
"""

from __future__ import annotations

import numpy as np
import torch

from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.memory import OutputMemory, longest_source, most_common_path


def suffix_matches(context: np.ndarray, max_ngram: int, min_ngram: int, max_matches: int) -> tuple[int, list[int]]:
    """(n, starts): the longest suffix n-gram (``min_ngram <= n <= max_ngram``) that occurs earlier in ``context``
    followed by at least one token, and where its most recent ``max_matches`` occurrences are followed (the index of
    the token after each, most recent first). (0, []) when none occurs."""
    length = len(context)
    top = min(max_ngram, length - 1)
    if top < min_ngram:
        return 0, []
    # Every drafted token asks this of the whole context, so compare the context once: the positions where its last
    # token recurs (not at the end) are the only places an occurrence can end; longer n-grams filter them further.
    ends = np.flatnonzero(context[: length - 1] == context[-1])
    for n in range(top, min_ngram - 1, -1):
        hits = ends[ends >= n - 1]
        for back in range(1, n):
            if not hits.size:
                break
            hits = hits[context[hits - back] == context[-1 - back]]
        if hits.size:
            return n, [int(h) + 1 for h in hits[::-1][:max_matches]]
    return 0, []


def lookup(context: np.ndarray, num_draft_tokens: int, max_ngram: int, min_ngram: int,
           memory: OutputMemory | None = None) -> list[int]:
    """The continuation of the most recent earlier occurrence of the longest matching suffix n-gram; with a
    ``memory``, the continuation most of its earlier answers agree on where they match a longer final n-gram."""
    match = suffix_matches(context, max_ngram, min_ngram, 1)
    starts = match[1]
    if memory is not None:
        in_memory = memory.continuations(context, num_draft_tokens, max_ngram=max_ngram, min_ngram=min_ngram)
        _, starts, continuations = longest_source(match, in_memory)
        if not starts:
            return most_common_path(continuations, num_draft_tokens)
    return context[starts[0]: starts[0] + num_draft_tokens].tolist() if starts else []


class PromptLookupDrafter:
    def __init__(self, num_draft_tokens: int = 4, max_ngram: int = 3, min_ngram: int = 1,
                 max_num_draft_tokens: int | None = None, *, output_memory: OutputMemory | None = None) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        max_num_draft_tokens = num_draft_tokens if max_num_draft_tokens is None else max_num_draft_tokens
        if max_num_draft_tokens < num_draft_tokens:
            raise ValueError(f"max_num_draft_tokens ({max_num_draft_tokens}) must be >= num_draft_tokens "
                             f"({num_draft_tokens})")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_num_draft_tokens = max_num_draft_tokens
        self.output_memory = output_memory
        self._length = num_draft_tokens
        self._last_num_drafted = 0

    def start(self, prompt_ids: list[int]) -> None:
        self._length = self.num_draft_tokens
        self._last_num_drafted = 0

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        tokens = self.peek(context_ids, min(self._length, max_num_draft_tokens))
        self._last_num_drafted = len(tokens)
        return Draft(token_ids=tokens) if tokens else EMPTY_DRAFT

    def peek(self, context_ids: list[int], num_tokens: int) -> list[int]:
        """The draft of up to ``num_tokens`` tokens that ``propose`` would make after ``context_ids``, with no change
        to the drafter's state (a cost-aware wrapper's shadow test reads it)."""
        if num_tokens <= 0:
            return []
        return lookup(np.asarray(context_ids, dtype=np.int64), num_tokens, self.max_ngram, self.min_ngram,
                      self.output_memory)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        if self._last_num_drafted and num_accepted == self._last_num_drafted:
            self._length = min(2 * self._length, self.max_num_draft_tokens)
        elif self._last_num_drafted:
            self._length = self.num_draft_tokens
