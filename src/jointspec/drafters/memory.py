"""Online adaptation: lookup drafters that also copy from the target's earlier answers (OSD / OmniDraft's online n-gram
cache; Lookahead's global trie).

Prompt lookup copies from the current context only, so each request starts from nothing although a model's answers
to one kind of request repeat each other: the same openings, code skeletons, list markers and closing lines. An
:class:`OutputMemory` holds the answers a target has already given (each with the last few tokens of its prompt,
so that an answer's opening can be matched from the chat template's assistant header) and finds, for the context's
final n-gram, what followed it in those answers. The lookup drafters (``pld``, ``corpus``, ``lookahead`` and
``default``'s lookup half) consult it where the context itself has no longer match.

Example: three earlier answers ended "... let me know if you have any other questions." When the current answer
reaches "let me know if", the memory's 4-gram match drafts "you have any other questions." although the current
context never contained it.

Who writes: the owner of the requests (the server, the bench, :class:`jointspec.api.Pipeline`) adds a finished
answer with :meth:`OutputMemory.add`; drafters only read. So the answer being generated is never in the memory, and
what is in it was committed by the target, verified like every draft: the memory decides how often drafts are
accepted, never what is generated.

Bounds: at most ``max_tokens`` tokens are kept (the oldest answers go first: the default, 65,536, holds about 500
answers of 128 tokens, and its index about 200,000 n-grams), and each n-gram keeps the positions of its
``max_matches`` most recent occurrences. Scope: a memory belongs to one model and one scope (a user, or everyone
where the server is told to share); :func:`memory_for` keeps them.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class OutputMemory:
    """Earlier answers of one target, indexed by their n-grams (``min_ngram`` .. ``max_ngram`` tokens)."""

    def __init__(self, *, max_tokens: int = 65_536, max_ngram: int = 3, min_ngram: int = 1,
                 max_matches: int = 32, prompt_tail: int = 4) -> None:
        if max_tokens < 1 or max_matches < 1 or prompt_tail < 0:
            raise ValueError(f"max_tokens and max_matches must be >= 1 and prompt_tail >= 0, got {max_tokens}, "
                             f"{max_matches}, {prompt_tail}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.prompt_tail = prompt_tail
        self._sequences: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> (sequence, position after it)
        self._next_id = 0
        self._num_tokens = 0
        self._num_evicted = 0  # tokens of dropped sequences still named in the index (rebuilt when it grows)
        self._lock = threading.Lock()  # one memory may serve several threads (a server scope, pipelines in threads)
        self.num_answers = 0  # answers ever added (evicted ones included)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def add(self, prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> None:
        """Remember one finished answer, after the last ``prompt_tail`` tokens of its prompt."""
        answer = [int(t) for t in answer_ids]
        if not answer:
            return
        tokens = [int(t) for t in prompt_ids[len(prompt_ids) - self.prompt_tail:]] if self.prompt_tail else []
        tokens = (tokens + answer)[-self.max_tokens:]
        with self._lock:
            sequence_id = self._next_id
            self._next_id += 1
            self._sequences[sequence_id] = tokens
            self._num_tokens += len(tokens)
            self.num_answers += 1
            self._index_sequence(sequence_id, tokens)
            while self._num_tokens > self.max_tokens:
                _, dropped = self._sequences.popitem(last=False)
                self._num_tokens -= len(dropped)
                self._num_evicted += len(dropped)
            if self._num_evicted > self.max_tokens // 2:
                self._rebuild_index()

    def _index_sequence(self, sequence_id: int, tokens: list[int]) -> None:
        # Position p is indexed under each n-gram ending just before it, so a match's continuation starts at p.
        for p in range(1, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                entries = self._index.setdefault(tuple(tokens[p - n:p]), [])
                entries.append((sequence_id, p))
                if len(entries) > self.max_matches:
                    del entries[0]

    def _rebuild_index(self) -> None:
        self._index = {}
        for sequence_id, tokens in self._sequences.items():
            self._index_sequence(sequence_id, tokens)
        self._num_evicted = 0

    def continuations(self, context: Sequence[int] | np.ndarray, max_depth: int, *, max_ngram: int | None = None,
                      min_ngram: int | None = None) -> tuple[int, list[list[int]]]:
        """(n, continuations): the longest final n-gram of ``context`` that earlier answers hold, and up to
        ``max_depth`` tokens of what followed each of its most recent occurrences (most recent first). (0, [])
        when none holds it. ``max_ngram``/``min_ngram`` narrow the memory's own range."""
        top = min(self.max_ngram, max_ngram or self.max_ngram, len(context))
        bottom = max(self.min_ngram, min_ngram or self.min_ngram)
        if max_depth < 1:
            return 0, []
        tail = [int(t) for t in context[len(context) - top:]] if top > 0 else []
        with self._lock:
            for n in range(top, bottom - 1, -1):
                entries = self._index.get(tuple(tail[top - n:]))
                if not entries:
                    continue
                found = [self._sequences[s][p:p + max_depth] for s, p in reversed(entries) if s in self._sequences]
                if found:
                    return n, found
        return 0, []

    @property
    def max_order(self) -> int:
        return self.max_ngram

    def continuation(self, context: Sequence[int], min_order: int = 1) -> tuple[int, float, int] | None:
        """(next token, its share, n) for the longest final n-gram of ``context`` that earlier answers hold: the
        token most of its recent occurrences were followed by. The interface of
        :meth:`~jointspec.drafters.corpus.NgramTable.continuation`, so the memory can stand where a table does."""
        n, continuations = self.continuations(context, 1, min_ngram=max(min_order, self.min_ngram))
        if not continuations:
            return None
        token = most_common_path(continuations, 1)[0]
        return token, sum(c[0] == token for c in continuations) / len(continuations), n


def most_common_path(continuations: list[list[int]], num_tokens: int) -> list[int]:
    """The path most of ``continuations`` (most recent first) agree on: at each step the token most of those still
    on the path continue with (ties: the most recent), for at most ``num_tokens`` tokens. Where many earlier answers
    matched, the most recent one is often not the typical one; a chain drafter takes this path instead."""
    path: list[int] = []
    live = [c for c in continuations if c]
    while live and len(path) < num_tokens:
        counts: dict[int, int] = {}
        for continuation in live:  # dicts keep insertion order, so max() breaks ties towards the most recent
            counts[continuation[0]] = counts.get(continuation[0], 0) + 1
        token = max(counts, key=counts.__getitem__)
        path.append(token)
        live = [c[1:] for c in live if c[0] == token and len(c) > 1]
    return path


def longest_source(context_match: tuple[int, list], memory_match: tuple[int, list]) -> tuple[int, list, list]:
    """Which source a lookup drafter follows: (n, context starts, memory continuations), keeping the longer match,
    both on a tie (the context's first: the current answer is the better guide to itself)."""
    (n_context, starts), (n_memory, continuations) = context_match, memory_match
    if n_memory > n_context:
        return n_memory, [], continuations
    if n_context > n_memory:
        return n_context, starts, []
    return n_context, starts, continuations


# Memories per model and scope, dropped with the model; at most MAX_SCOPES scopes per model, least recently used out.
MAX_SCOPES = 64
_memories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_memories_lock = threading.Lock()


def memory_for(model: object, scope: str, **settings) -> OutputMemory:
    """The memory of ``model`` (its weights: a target's ``.model``) for ``scope`` (a user, or a name every request
    shares), made on first use with ``settings``."""
    with _memories_lock:
        scopes = _memories.setdefault(model, OrderedDict())
        memory = scopes.get(scope)
        if memory is None:
            memory = scopes[scope] = OutputMemory(**settings)
            while len(scopes) > MAX_SCOPES:
                scopes.popitem(last=False)
        scopes.move_to_end(scope)
        return memory


def forget_if_unused(model: object, memory: OutputMemory) -> None:
    """Drop ``memory``'s scope where it holds no answer: made for a request that was then refused, it would only push
    a scope with answers out of the :data:`MAX_SCOPES`."""
    with _memories_lock:
        scopes = _memories.get(model) or {}
        for scope, held in list(scopes.items()):
            if held is memory and memory.num_answers == 0:
                del scopes[scope]
