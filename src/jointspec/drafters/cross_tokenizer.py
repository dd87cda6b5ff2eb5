"""Cross-tokenizer drafting: a draft model with its own tokenizer drafts for the target through text.

This is the idea behind OmniDraft (Ramakrishnan et al., 2025, "OmniDraft: A Cross-vocabulary, Online Adaptive
Drafter for On-device Speculative Decoding") and Hugging Face transformers' "universal assisted generation"
(``AssistedCandidateGeneratorDifferentTokenizers``). Token ids mean nothing across tokenizers, but text does. Each
round:

1. the target's committed tokens are read as text and encoded with the draft's tokenizer (:class:`DraftTextView`);
   the draft's KV cache keeps the longest prefix of draft ids it shares with the new encoding, so only the changed
   tail is fed again;
2. the draft proposes tokens one at a time (greedy, or sampled with the loop's generator);
3. after each one, the draft's new text up to the word it is still writing is encoded with the target's tokenizer
   *after the committed context* (:class:`TargetBoundary`), until that gives the round's number of target tokens
   (a word not yet finished could still become other tokens, so it waits for the next word to begin);
4. the target tokens go to the verifier as a deterministic (one-hot) draft, so an existing verifier decides what
   is kept, and the output is the target's own, greedy or sampled.

The token-boundary problem. The target has already committed its tokens, so the draft's text must be encoded as it
continues *those* tokens. Encoding the new text alone would be wrong where a tokenizer merges across the boundary,
and encoding the whole context each round costs time that grows with the context. So the last few committed tokens
(the *window*, never reaching back past a special token) are decoded, the new text is appended, the lot is encoded,
and the draft is what comes after the window's tokens, provided the encoding starts with exactly those tokens.
Example with a byte-level BPE target that commits ``[" the", " cat"]`` and a draft whose text is ``" sat on"``:
``" the cat sat on"`` encodes to ``[" the", " cat", " sat", " on"]``, the window's two tokens come back unchanged,
and the draft is ``[" sat", " on"]``. Had the target committed ``[" c", "at"]`` (a split its tokenizer would not
make from text) the encoding would start ``[" cat", ...]``: the committed tokens cannot be taken back, so the round
drafts nothing rather than guess.

Draft length adapts as prompt lookup's does (:mod:`jointspec.drafters.ngram`): a draft accepted whole doubles the
next round's length up to ``max_num_draft_tokens``, any rejection drops it back to ``num_draft_tokens``. With the
method's ``--cost-aware`` option the target's measured cost curve chooses each round's budget instead.

What the draft sees is the target's text without its special tokens (a chat template's markers read as the plain
words around them), as transformers does; the draft's own chat template is not applied. A special token from the
draft ends its draft, and an end-of-sequence token among them becomes the target's end-of-sequence token.
"""

from __future__ import annotations

import logging
import math

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig, pick
from jointspec.drafters.model import common_prefix_length, draft_room

log = logging.getLogger(__name__)

# A character split across byte-level tokens decodes to this until its last byte arrives.
REPLACEMENT = "\ufffd"


def special_ids(tokenizer) -> frozenset[int]:
    return frozenset(int(i) for i in tokenizer.all_special_ids)


def added_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text (a BOS token, or nothing)."""
    with_specials = tokenizer.encode("a", add_special_tokens=True)
    plain = tokenizer.encode("a", add_special_tokens=False)
    start = len(with_specials) - len(plain)
    # A tokenizer that also appends specials (an EOS after the text) has no clean prefix: then none is added.
    return with_specials[:start] if start > 0 and with_specials[start:] == plain else []


def decode(tokenizer, token_ids: list[int]) -> str:
    # No space clean-up: pieces of text must concatenate to the text of the whole.
    return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def text_after(tokenizer, token_ids: list[int], start: int) -> str:
    """The text of ``token_ids[start:]`` as it reads after ``token_ids[:start]``.

    Decoding a piece alone can lose what its first token means in context (a SentencePiece decoder drops the space
    of a leading "▁word"), so the token before it is decoded with it and its own text cut off again.
    """
    lead = max(0, start - 1)
    before = decode(tokenizer, token_ids[lead:start])
    whole = decode(tokenizer, token_ids[lead:])
    return whole[len(before):] if whole.startswith(before) else decode(tokenizer, token_ids[start:])


def last_word_start(text: str) -> int:
    """Where the last word of ``text`` starts (0: none has). Tokenizers split text into words at whitespace before
    merging pieces, so the tokens of the text before it stay as they are whatever the word becomes."""
    return max(text.rfind(" "), text.rfind("\n"), text.rfind("\t"), 0)


class TargetBoundary:
    """Encodes text written after a committed context with the target's tokenizer (the module's token-boundary
    problem): the window is the context's last ``window`` tokens after its last special token."""

    def __init__(self, tokenizer, context_ids: list[int], window: int, specials: frozenset[int]) -> None:
        start = len(context_ids)
        while start > 0 and len(context_ids) - start < window and context_ids[start - 1] not in specials:
            start -= 1
        self.tokenizer = tokenizer
        self.window_ids = context_ids[start:]
        self.window_text = text_after(tokenizer, context_ids, start)

    def encode(self, text: str) -> list[int] | None:
        """Target ids of ``text`` after the context, or None when the text would re-split the window's tokens."""
        ids = self.tokenizer.encode(self.window_text + text, add_special_tokens=False)
        n = len(self.window_ids)
        return ids[n:] if ids[:n] == self.window_ids else None


class DraftTextView:
    """The draft tokenizer's encoding of the target's committed text, kept up to date with tokenizer work that does
    not grow with the context.

    It keeps a *sync point*: a number of committed target tokens whose text the draft ids in ``stable`` encode,
    at a place where both tokenizers split the text. Each update decodes only the target tokens after the sync point,
    encodes that text with the draft's tokenizer after ``stable``, then moves the sync point up to ``window`` target
    tokens short of the end where the encodings agree on the split (later text can still merge with the last few).
    """

    def __init__(self, target_tokenizer, draft_tokenizer, window: int = 4) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.target_tokenizer = target_tokenizer
        self.draft_tokenizer = draft_tokenizer
        self.window = window
        self.prefix = added_prefix(draft_tokenizer)
        self.reset()

    def reset(self) -> None:
        self.synced_ids: list[int] = []  # the target tokens up to the sync point
        self.stable: list[int] = list(self.prefix)  # their draft encoding

    def update(self, context_ids: list[int]) -> list[int]:
        """The draft ids of ``context_ids``' text (the draft tokenizer's BOS first, if it adds one)."""
        sync = len(self.synced_ids)
        if context_ids[:sync] != self.synced_ids:  # not a continuation of what was seen: start over
            self.reset()
            sync = 0
        text = text_after(self.target_tokenizer, context_ids, sync)
        tail = self.draft_tokenizer.encode(text, add_special_tokens=False)
        draft_ids = self.stable + tail
        # Candidates from the latest on: a place where the draft tokenizer merges across (a newline run) is skipped.
        for new_sync in range(len(context_ids) - self.window, max(sync, len(context_ids) - self.window - 3), -1):
            head_text = text_after(self.target_tokenizer, context_ids[:new_sync], sync)
            if not text.startswith(head_text) or head_text.endswith(REPLACEMENT):
                continue
            head = self.draft_tokenizer.encode(head_text, add_special_tokens=False)
            if tail[:len(head)] == head:
                self.stable += head
                self.synced_ids = list(context_ids[:new_sync])
                break
        return draft_ids


class CrossTokenizerDrafter:
    """Drafts for the target with a model that has another tokenizer (module docstring).

    ``draft_tokenizer`` / ``target_tokenizer``: each model's own. ``target_eos_ids``: the ids the loop stops at (a
    draft is cut after the first); ``draft_eos_ids``: the draft's, which become the target tokenizer's EOS.
    ``window``: committed tokens re-encoded at each boundary.
    """

    def __init__(self, draft: CausalLM, draft_tokenizer, target_tokenizer, num_draft_tokens: int = 4,
                 max_num_draft_tokens: int | None = None, *, target_eos_ids: frozenset[int] = frozenset(),
                 draft_eos_ids: frozenset[int] = frozenset(), window: int = 4) -> None:
        max_num_draft_tokens = num_draft_tokens if max_num_draft_tokens is None else max_num_draft_tokens
        if not 1 <= num_draft_tokens <= max_num_draft_tokens:
            raise ValueError(f"need 1 <= num_draft_tokens <= max_num_draft_tokens, got {num_draft_tokens} and "
                             f"{max_num_draft_tokens}")
        self.draft = draft  # read by the cost-aware wrapper for the draft's per-call cost
        self.draft_tokenizer = draft_tokenizer
        self.target_tokenizer = target_tokenizer
        self.num_draft_tokens = num_draft_tokens
        self.max_num_draft_tokens = max_num_draft_tokens
        self.target_eos_ids = frozenset(target_eos_ids)
        self.draft_eos_ids = frozenset(draft_eos_ids)
        self.window = window
        self.view = DraftTextView(target_tokenizer, draft_tokenizer, window)
        self.draft_specials = special_ids(draft_tokenizer)
        self.target_specials = special_ids(target_tokenizer)
        eos = target_tokenizer.eos_token_id
        # What a draft's end of sequence becomes: the target tokenizer's own, if the loop stops at it.
        self.target_eos = eos if eos is not None and eos in self.target_eos_ids else None
        self.num_boundary_misses = 0  # rounds that drafted nothing because the text re-split committed tokens
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        self.draft.reset()
        self._cached: list[int] = []  # the draft ids in the draft's cache
        self.view.reset()
        self._length = self.num_draft_tokens
        self._last_num_drafted = 0

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        self._last_num_drafted = 0
        budget = min(self._length, max_num_draft_tokens)
        if budget <= 0:
            return EMPTY_DRAFT
        draft_ids = self.view.update(context_ids)
        # The context says how many draft tokens its text takes per target token; twice that for the budget and
        # the word after it lets the draft finish its words without running on when its text goes nowhere.
        per_target_token = len(draft_ids) / len(context_ids)
        max_steps = min(math.ceil(2 * per_target_token * (budget + 1)) + 2, draft_room(self.draft, draft_ids))
        if not draft_ids or max_steps <= 0:
            return EMPTY_DRAFT
        boundary = TargetBoundary(self.target_tokenizer, context_ids, self.window, self.target_specials)

        # Feed the draft what its cache lacks (at least one token, for the logits of the next).
        keep = min(common_prefix_length(self._cached, draft_ids), len(draft_ids) - 1)
        self.draft.crop(keep)
        self._cached = draft_ids[:keep]
        logits = self._feed(draft_ids[keep:])
        generated: list[int] = []
        settled: list[int] = []  # the target ids of the text before the word being written
        settled_end = 0
        text = ""
        ended = False
        for step in range(max_steps):
            if step:
                logits = self._feed(generated[-1:])
            token = int(pick(logits, sampling, generator))
            if token in self.draft_specials:
                ended = token in self.draft_eos_ids
                break
            generated.append(token)
            # A character still missing bytes is left for the next token.
            text = text_after(self.draft_tokenizer, draft_ids + generated, len(draft_ids)).rstrip(REPLACEMENT)
            end = last_word_start(text)
            if end > settled_end:
                converted = boundary.encode(text[:end])
                if converted is None:
                    break
                settled, settled_end = converted, end
                if len(settled) >= budget:
                    break
        # Once the draft has ended, its last word is finished too; text without a word boundary (code, or a
        # language written without spaces) is taken whole rather than not at all.
        target_ids = settled
        if text and (ended or not settled):
            whole = boundary.encode(text)
            if whole is not None:
                target_ids = whole
            elif not settled:
                self.num_boundary_misses += 1
        target_ids = target_ids[:budget]
        if ended and self.target_eos is not None and len(target_ids) < budget:
            target_ids.append(self.target_eos)
        cut = next((i + 1 for i, token in enumerate(target_ids) if token in self.target_eos_ids), len(target_ids))
        target_ids = target_ids[:cut]
        self._last_num_drafted = len(target_ids)
        return Draft(token_ids=target_ids) if target_ids else EMPTY_DRAFT

    def _feed(self, token_ids: list[int]) -> torch.Tensor:
        """Feed ``token_ids`` to the draft; returns the logits after the last ([vocab])."""
        logits = self.draft.forward(token_ids, num_logits=1).logits[-1]  # [vocab]
        self._cached.extend(token_ids)
        assert self.draft.num_cached == len(self._cached)
        return logits

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        # The draft's cache is brought in line at the next propose, which sees the new text anyway.
        if self._last_num_drafted and num_accepted == self._last_num_drafted:
            self._length = min(2 * self._length, self.max_num_draft_tokens)
        elif self._last_num_drafted:
            self._length = self.num_draft_tokens
