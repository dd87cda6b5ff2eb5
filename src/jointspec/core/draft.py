"""What a drafter hands the loop, and what the loop expects of a drafter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from jointspec.core.sampling import SamplingConfig


@dataclass
class Draft:
    """Proposed tokens: a chain, or a tree when ``parents`` is given.

    ``parents[i]`` is the index of the draft node that node ``i`` follows, or -1 when it follows the last committed
    token. Parents come before children. ``draft_probs[i]`` is the distribution node ``i`` was drawn from (already
    shaped by temperature/top-k/top-p); ``None`` means a deterministic drafter, verified as one-hot drafts.
    ``draft_logprobs[i]`` is the draft's log-probability of node ``i``'s token, for verifiers (MTAD) that test joint
    likelihoods without needing whole distributions.
    """

    token_ids: list[int]
    draft_probs: torch.Tensor | None = None  # [num_nodes, vocab]
    parents: list[int] | None = None
    draft_logprobs: torch.Tensor | None = None  # [num_nodes]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.parents is not None and len(self.parents) != n:
            raise ValueError(f"Draft has {n} tokens but {len(self.parents)} parents")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError(f"Draft has {n} tokens but draft_probs has {self.draft_probs.shape[0]} rows")
        if self.draft_logprobs is not None and self.draft_logprobs.shape[0] != n:
            raise ValueError(f"Draft has {n} tokens but draft_logprobs has {self.draft_logprobs.shape[0]} rows")

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def node_parents(self) -> list[int]:
        """Parents of every node, for chains too ([-1, 0, 1, ...])."""
        return list(range(-1, self.num_nodes - 1)) if self.parents is None else list(self.parents)


def chain_parents(num_tokens: int) -> list[int]:
    return list(range(-1, num_tokens - 1))


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node (a child of the cache has depth 0). Parents must come before their children."""
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a parent must be -1 or an earlier node")
        depths.append(0 if parent == -1 else depths[parent] + 1)
    return depths


def row_paths(draft: Draft) -> list[list[int]]:
    """The draft tokens before each row of the forward that scores ``draft`` (row 0, the pending token's: none; row
    1 + i: node i and its ancestors, root first)."""
    parents = draft.node_parents()
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(parents):  # (parents come before their children)
        paths.append(paths[parent + 1] + [draft.token_ids[node]])
    return paths


EMPTY_DRAFT = Draft(token_ids=[])


class Drafter(Protocol):
    """Proposes tokens after a context. It never sees the target model and never returns the whole sequence."""

    def start(self, prompt_ids: list[int]) -> None:
        """Forget any previous sequence; a new one begins with ``prompt_ids``."""

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        """Draft at most ``max_num_draft_tokens`` tokens deep after ``context_ids`` (every committed token)."""

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        """The loop kept ``num_accepted`` draft tokens; ``context_ids`` is now the whole committed sequence."""

    # Optional: a drafter with ``observes_target = True`` also gets ``observe_target(draft, target_tokens, accepted)``
    # before each ``commit``: the target's argmax after the pending token (``target_tokens[0]``) and after each draft
    # node (``target_tokens[i + 1]``), whatever was accepted, and the accepted nodes (the verdict's). Lookahead
    # decoding learns its n-grams from those rows. Where a sampled round's rows are draws rather than logits
    # (temperature alone on the 4-bit screen, core/sampling.py's RowDraws) each row's argmax is its draw, so the
    # drafter learns the target's samples: drafts only, the verifier keeps the output law.

    # Optional: ``finish()``, called once when the sequence ends: at its end-of-sequence token or its length (after
    # the last round's ``commit`` if there is one), or when its caller closes the stream before then. A drafter that
    # works beside the loop (PEARL's worker thread) stops there, so that nothing of it runs on after the sequence.


class NoDrafter:
    """Drafts nothing: the loop then decodes one token per target call (the ``ar`` baseline)."""

    # Read by the loop: a target may then decode on kernels that are fast but not batch-invariant (llama.cpp).
    never_drafts = True

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, context_ids, max_num_draft_tokens, sampling, generator) -> Draft:
        return EMPTY_DRAFT

    def commit(self, context_ids, num_accepted) -> None:
        pass
