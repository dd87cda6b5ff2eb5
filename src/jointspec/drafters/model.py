"""A separate draft model (speculative sampling's classic drafter).

The draft model keeps its own KV cache. After a round, the draft cache holds the context plus every draft token
but the last (the last one was never fed). ``commit`` crops it back to the longest prefix it shares with the
committed sequence; the next ``propose`` feeds whatever committed tokens are missing (1 token after a rejection,
2 after a full acceptance: the last draft token and the bonus token).
"""

from __future__ import annotations

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.errors import VocabularyMismatchError
from jointspec.core.sampling import SamplingConfig, processed_probs, sample


def common_prefix_length(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, assuming the first ``start`` entries already agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target: CausalLM, draft: CausalLM) -> None:
    """Refuse a draft whose token ids do not mean the same text as the target's."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise VocabularyMismatchError(
                f"draft '{draft.name}' and target '{target.name}' use different vocabularies "
                f"({len(draft_tokenizer)} vs {len(target_tokenizer)} tokens); this method needs a draft with the "
                "target's tokenizer (the cross method drafts with a model of another tokenizer)")
    if draft.vocab_size != target.vocab_size:
        raise VocabularyMismatchError(
            f"draft '{draft.name}' has {draft.vocab_size} output tokens but target '{target.name}' has "
            f"{target.vocab_size}; this method needs a draft with the target's tokenizer (the cross method drafts "
            "with a model of another tokenizer)")


def draft_room(draft, context_ids: list[int]) -> int:
    """How many tokens ``draft`` can draft after ``context_ids`` within its own context window: a draft trained for
    fewer positions than its target (SmolLM-135M's 2,048 drafting for SmolLM2's 8,192) stops drafting where its
    window ends, and the loop decodes on without drafts (plain decoding, so nothing changes in the output). The
    last drafted token is never fed, so ``max_context - len(context) + 1``; none once the context itself does not
    fit."""
    return max(0, int(draft.max_context) - len(context_ids) + 1)


class ModelDrafter:
    """Drafts ``num_draft_tokens`` tokens one at a time with a small causal LM."""

    def __init__(self, draft: CausalLM, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens
        self._cached_ids: list[int] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.draft.reset()
        self._cached_ids = []

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        num_tokens = min(self.num_draft_tokens, max_num_draft_tokens, draft_room(self.draft, context_ids))
        if num_tokens <= 0:
            return EMPTY_DRAFT
        assert self.draft.num_cached == len(self._cached_ids) < len(context_ids)
        logits = self.draft.forward(context_ids[self.draft.num_cached:], num_logits=1).logits[-1]  # [vocab]
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(num_tokens):
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                probs = processed_probs(logits, sampling)  # [vocab]
                token = int(sample(probs, generator))
                rows.append(probs)
            token_ids.append(token)
            if i + 1 < num_tokens:
                logits = self.draft.forward([token], num_logits=1).logits[-1]
        self._cached_ids = list(context_ids) + token_ids[:-1]
        # Greedy drafts are verified as one-hot drafts: no need to carry their distributions.
        return Draft(token_ids=token_ids, draft_probs=torch.stack(rows) if rows else None)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        # The draft tokens were the last entries at most; a short cache (prompt of one token, or a budget that
        # allowed no draft) must not make the start negative.
        start = max(0, len(self._cached_ids) - self.num_draft_tokens)
        keep = common_prefix_length(self._cached_ids, context_ids, start=start)
        keep = min(keep, len(context_ids) - 1)  # always leave one committed token to feed next time
        self.draft.crop(keep)
        # A draft model may keep less than asked (a feature-fed head drops entries fed with its own guesses).
        self._cached_ids = self._cached_ids[:self.draft.num_cached]
