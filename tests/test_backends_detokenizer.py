"""The incremental detokenizer (backends/tokens.py): streamed deltas add up to a whole decode, for byte-level BPE
(characters split across tokens), a SentencePiece-style tokenizer (word markers, byte fallback, the text's first
space stripped), one whose decode cleans up spaces, with special tokens kept and with an echoed context; and each
push decodes a window, not the whole answer. Seeded draws: deterministic.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jointspec.backends.tokens import IncrementalDetokenizer, decode_text

from helpers import byte_tokenizer


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama 2's and Mistral's kind: words with a marker for their space, byte tokens for what no piece holds, and a
    decoder that drops the text's first space."""
    words = ["\u2581the", "\u2581cat", "\u2581caf", "\u00e9", "s", "\u2581", "ing", "\u2581\u6771"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {word: 259 + index for index, word in enumerate(words)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def cleaning_up() -> PreTrainedTokenizerFast:
    """A decode with clean-up of spaces (" '" then "m" becomes "'m"), which rewrites text before a later token."""
    model = Tokenizer(models.WordLevel(vocab={"I": 0, "\u0120'": 1, "m": 2, "\u0120ok": 3}, unk_token="I"))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=model, clean_up_tokenization_spaces=True)


def counting_decodes(tokenizer) -> list[int]:
    """The number of tokens each of ``tokenizer``'s decodes from now on reads, in a list that grows as it decodes."""
    decoded: list[int] = []
    original = tokenizer.decode

    def counting(token_ids, **options):
        decoded.append(len(token_ids))
        return original(token_ids, **options)

    tokenizer.decode = counting
    return decoded


TOKENIZERS = {"byte-level": byte_tokenizer, "sentencepiece": sentencepiece_like, "clean-up": cleaning_up}


def streamed(tokenizer, ids: list[int], pieces: list[int], context=None, kept=None) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, context, kept)
    out, at = [], 0
    for size in pieces:
        out.append(detokenizer.push(ids[at:at + size]))
        at += size
    return "".join(out) + detokenizer.push(ids[at:]) + detokenizer.finish()


def units(tokenizer, name: str) -> list[list[int]]:
    """What an answer is drawn from: single tokens, except that a SentencePiece tokenizer's byte tokens come as whole
    characters (its decoder turns a run of byte tokens that is not UTF-8 into one U+FFFD a byte, whatever follows,
    so no stream can add up to such a run's whole decode)."""
    vocab = sorted(set(tokenizer.get_vocab().values()))
    if name != "sentencepiece":
        return [[token] for token in vocab]
    words = [[token] for token in vocab if not tokenizer.convert_ids_to_tokens(token).startswith("<0x")]
    characters = [tokenizer(character, add_special_tokens=False)["input_ids"][1:] for character in "éü🎉ß"]
    return words + characters


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_deltas_add_up_to_a_whole_decode_however_the_tokens_come(name):
    tokenizer = TOKENIZERS[name]()
    drawn = units(tokenizer, name)
    special = tokenizer.eos_token_id
    draws = random.Random(0)
    for _ in range(300):
        ids = [token for _ in range(draws.randint(0, 30)) for token in draws.choice(drawn)]
        pieces = [draws.randint(1, 4) for _ in range(len(ids))]
        assert streamed(tokenizer, ids, pieces) == decode_text(tokenizer, ids), ids
        kept = {special: "<END>"} if special is not None else None
        assert streamed(tokenizer, ids, pieces, kept=kept) == decode_text(tokenizer, ids, kept), ids
        context = [token for _ in range(draws.randint(1, 10)) for token in draws.choice(drawn)]
        whole, before = decode_text(tokenizer, context + ids), decode_text(tokenizer, context)
        if whole.startswith(before):  # (what the answer adds to its context's text)
            assert streamed(tokenizer, ids, pieces, context=context) == whole[len(before):], (context, ids)


def test_a_sentencepiece_answer_keeps_its_spaces_and_characters_split_over_byte_tokens():
    tokenizer = sentencepiece_like()
    ids = tokenizer("the cat caf\u00e9s \u6771 \u00e9")["input_ids"]
    assert streamed(tokenizer, ids, [1] * len(ids)) == "the cat caf\u00e9s \u6771 \u00e9"
    # an answer after a prompt keeps the space its first word's marker spells
    assert streamed(tokenizer, tokenizer("the cat")["input_ids"], [1, 1], context=tokenizer("the")["input_ids"]) == \
        " the cat"


def test_each_push_decodes_a_window_not_the_whole_answer():
    """The tokens decoded over an answer of n tokens pushed one at a time grow as n, not n^2."""
    tokenizer = byte_tokenizer()
    decoded = counting_decodes(tokenizer)
    ids = tokenizer("a reasonably long answer, " * 80)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.push([token]) for token in ids) + detokenizer.finish() == decode_text(tokenizer, ids)
    assert len(ids) > 2000 and sum(decoded) < 6 * len(ids)


def test_a_decode_that_rewrites_sent_text_sends_only_what_lies_past_it():
    """SentencePiece's byte fallback turns a run of byte tokens that is not UTF-8 into one U+FFFD a byte, so a later
    byte can rewrite a character already sent (C2 9F is U+009F; C2 9F C2 is three U+FFFD). What was sent stays sent:
    the stream goes on from the whole text past its length."""
    tokenizer = sentencepiece_like()
    ids = tokenizer.convert_tokens_to_ids(["<0xC2>", "<0x9F>", "<0xC2>"])
    assert decode_text(tokenizer, ids) == "\ufffd" * 3 and decode_text(tokenizer, ids[:2]) == "\x9f"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([token]) for token in ids] + [detokenizer.finish()] == ["", "\x9f", "", "\ufffd" * 2]


def test_an_echoed_prompt_ending_in_byte_tokens_leaves_the_answers_characters_whole():
    """The first window reaches into the context from a character's start: begun inside a run of byte tokens, the
    byte fallback read the run, the answer's bytes with it, as a U+FFFD a byte (a review's case: "x €€€" then 🎉)."""
    tokenizer = sentencepiece_like()
    context = tokenizer("x \u20ac\u20ac\u20ac")["input_ids"]
    answer = tokenizer("\U0001f389", add_special_tokens=False)["input_ids"][1:]
    assert len(context) > 8 and all(tokenizer.convert_ids_to_tokens(token).startswith("<0x") for token in answer)
    assert streamed(tokenizer, answer, [1] * len(answer), context=context) == "\U0001f389"


def test_tokens_that_add_no_text_are_not_decoded_again():
    """A run of skipped special tokens (a broken model writing its pad token on and on) stays linear too."""
    tokenizer = byte_tokenizer()
    decoded = counting_decodes(tokenizer)
    ids = tokenizer("hi ")["input_ids"] + [tokenizer.pad_token_id] * 3000 + tokenizer("there")["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.push([token]) for token in ids) + detokenizer.finish() == "hi there"
    assert sum(decoded) < 6 * len(ids)
