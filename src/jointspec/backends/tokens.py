"""Tokenizer helpers every backend and front end shares: which ids end a sequence, and streaming detokenisation."""

from __future__ import annotations

from jointspec.backends.hf import CausalLM


def eos_token_ids(model: CausalLM, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_eos = getattr(getattr(getattr(model, "model", None), "generation_config", None), "eos_token_id", None)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(int(i) for i in generation_eos)
    return frozenset(ids)


def decode_text(tokenizer, token_ids: list[int]) -> str:
    """The text of generated ``token_ids``, as every front end shows it: special tokens skipped and no clean-up of
    spaces. Clean-up (``clean_up_tokenization_spaces``, which some tokenizers turn on) rewrites text before a later
    token (" '" then "m" becomes "'m"), so a stream that had sent the earlier text could not show what a whole decode
    shows; without it a decode of more tokens extends a decode of fewer."""
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    except TypeError:  # a tokenizer whose decode takes no such option (not transformers') has no clean-up either
        return tokenizer.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 characters; the deltas and
    :meth:`finish` add up to :func:`decode_text` of every id pushed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def push(self, token_ids: list[int]) -> str:
        self.token_ids.extend(token_ids)
        text = decode_text(self.tokenizer, self.token_ids)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is split across tokens: wait for the rest
        return self._advance(text)

    def finish(self) -> str:
        """The held-back rest at the end: bytes no later token completes show as U+FFFD, as a whole decode shows
        them."""
        return self._advance(decode_text(self.tokenizer, self.token_ids))

    def _advance(self, text: str) -> str:
        # Text already sent is never sent again: a decode that no longer extends it (a tokenizer whose pieces change
        # with what follows them) sends only what lies past it.
        delta = text[len(self.emitted):]
        self.emitted = text if text.startswith(self.emitted) else self.emitted + delta
        return delta
