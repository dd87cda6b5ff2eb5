"""A draft model that scores token trees and keeps its KV cache in step with the loop.

Tree drafters (beam sampling, SpecInfer k-configs) grow a tree one level at a time, and each new level needs the
draft's distribution after every node of the level before. The adapter's tree mask lets a node see the cache plus
its own ancestors *among the tokens fed in the same call*; a node fed in an earlier call would be visible to every
later node, siblings' subtrees included. So each level crops the cache back to the committed context and re-feeds
the whole tree grown so far in one call (``tree_logits``). That costs ``W·(1 + 2 + ... + (depth - 1))`` fed tokens
per round instead of ``W·(depth - 1)``, but it needs nothing beyond ``CausalLM.forward(parents=...)``/``crop``/``keep``
and every node is scored exactly as if its branch were run alone. A draft with ``extend_tree`` (the feature head of
:mod:`jointspec.drafts.eagle`, which builds its own masks over the cached tree) is fed only each level's new nodes.

Cache invariant between rounds (as in :mod:`jointspec.drafters.model`): the cache holds a prefix of the committed
sequence, never all of it. After a round it holds the context plus the last fed tree; ``commit`` finds the newly
committed tokens as a path in that tree and ``keep``\\ s the context plus that path. Sibling nodes with the same token
under the same parent have identical keys and values, so any matching path will do.
"""

from __future__ import annotations

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafters.model import draft_room


class DraftTreeCache:
    def __init__(self, draft: CausalLM) -> None:
        capabilities = getattr(draft, "capabilities", None)
        if capabilities is not None and not capabilities.trees:
            why = capabilities.chains_only or "its backend"
            raise UnsupportedOptionError(f"this method scores token trees in its draft model, and draft "
                                         f"'{draft.name}' scores chains only ({why}); use a chain method (sps) or "
                                         "another draft")
        self.draft = draft
        self._cached_ids: list[int] = []  # committed tokens in the cache, in order
        self._tree_parents: list[int] = []  # the tree fed after them (adapter convention: -1 = last context token)
        self._tree_tokens: list[int] = []
        self._primed: torch.Tensor | None = None  # context_logits' answer, computed in a batch (prime)

    @property
    def vocab_size(self) -> int:
        return self.draft.vocab_size

    def start(self) -> None:
        self.draft.reset()
        self._cached_ids, self._tree_parents, self._tree_tokens = [], [], []
        self._primed = None

    def room(self, context_ids: list[int]) -> int:
        """The deepest tree the draft's own context window lets it draft after ``context_ids`` (0: none at all;
        drafters/model.py, ``draft_room``)."""
        return draft_room(self.draft, context_ids)

    def pending(self, context_ids: list[int]) -> list[int]:
        """The tokens :meth:`context_logits` would feed the draft for ``context_ids`` (none where it is primed, or
        where the draft's window has no room for them)."""
        if (self._primed is not None or not self.draft.num_cached == len(self._cached_ids) < len(context_ids)
                or self.room(context_ids) <= 0):
            return []
        return context_ids[self.draft.num_cached:]

    def prime(self, context_ids: list[int], logits: torch.Tensor) -> None:
        """Someone fed the draft :meth:`pending`'s tokens and got ``logits`` after them (a batched engine, in one pass
        for many requests' drafts: drafts/eagle.py, ``context_logits_many``): the next :meth:`context_logits` for
        ``context_ids`` returns them."""
        assert self.draft.num_cached == len(context_ids)
        self._cached_ids = list(context_ids)
        self._tree_parents, self._tree_tokens = [], []
        self._primed = logits

    def context_logits(self, context_ids: list[int]) -> torch.Tensor:
        """The draft's logits after the whole committed context ([vocab]); feeds only what the cache lacks."""
        if self._primed is not None:
            assert len(self._cached_ids) == len(context_ids), "primed for another context"
            logits, self._primed = self._primed, None
            return logits
        assert self.draft.num_cached == len(self._cached_ids) < len(context_ids)
        logits = self.draft.forward(context_ids[self.draft.num_cached:], num_logits=1).logits[-1]
        self._cached_ids = list(context_ids)
        self._tree_parents, self._tree_tokens = [], []
        return logits

    def tree_logits(self, parents: list[int], token_ids: list[int], num_logits: int) -> torch.Tensor:
        """Logits after the last ``num_logits`` nodes of a tree that follows the context ([num_logits, vocab])."""
        fed = len(self._tree_tokens)
        if (fed and hasattr(self.draft, "extend_tree") and num_logits <= len(token_ids) - fed
                and token_ids[:fed] == self._tree_tokens and parents[:fed] == self._tree_parents):
            # A draft that masks its own tree (a feature head) scores only the new nodes.
            out = self.draft.extend_tree(token_ids, parents, num_logits=num_logits).logits
        else:
            self.draft.crop(len(self._cached_ids))
            out = self.draft.forward(token_ids, parents=parents, num_logits=num_logits).logits
        self._tree_parents, self._tree_tokens = list(parents), list(token_ids)
        return out

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self._primed = None  # primed for a round that drafted nothing: the cache holds the context, as after a draft
        num_context = len(self._cached_ids)
        path = _longest_path(self._tree_parents, self._tree_tokens, context_ids[num_context:num_context + num_accepted])
        keep = list(range(num_context)) + [num_context + node for node in path]
        keep = keep[:len(context_ids) - 1]  # always leave one committed token to feed next time
        self.draft.keep(keep)
        # A draft model may keep less than asked (a feature-fed head drops entries fed with its own guesses).
        self._cached_ids = list(context_ids[:self.draft.num_cached])
        self._tree_parents, self._tree_tokens = [], []


def _longest_path(parents: list[int], token_ids: list[int], wanted: list[int]) -> list[int]:
    """Nodes of the deepest root-to-node path whose tokens are a prefix of ``wanted`` (depth-first)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    best: list[int] = []

    def walk(node: int, path: list[int]) -> None:
        nonlocal best
        if len(path) > len(best):
            best = list(path)
        if len(path) == len(wanted):
            return
        for child in children.get(node, []):
            if token_ids[child] == wanted[len(path)]:
                walk(child, path + [child])

    walk(-1, [])
    return best
