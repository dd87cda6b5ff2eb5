"""Cross-tokenizer drafting (``cross``): the text round trip between two tokenizers, and the method in the loop.

Losslessness comes from the verifier: ``cross`` hands :class:`~jointspec.verifiers.rejection.RejectionSamplingVerifier`
one-hot drafts and uses it unchanged, so that the sampled outputs follow the target's distribution is what
tests/test_verifiers_rejection.py's chi-square tests (one-hot drafts included) prove; here the sampling test checks
only that a sampled decode is reproducible from its generator and stays within the target's vocabulary. The greedy
tests hold the method to transformers' own greedy decoding, bit for bit.

The models are tiny (vocab 99 or 259, hidden 32) and the tokenizers differ in kind: words (:func:`tiny_tokenizer`),
bytes (:func:`byte_tokenizer`) and a byte-level BPE trained here (merges, so tokens can split and re-merge).
"""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import jointspec.methods.cross_tokenizer  # noqa: F401  (registers 'cross')
from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.cross_tokenizer import (
    CrossTokenizerDrafter,
    DraftTextView,
    TargetBoundary,
    special_ids,
    text_after,
)
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import (
    VOCAB,
    WORDS,
    assert_greedy_equivalent,
    byte_tokenizer,
    greedy,
    hf_greedy,
    tiny_llama,
    tiny_tokenizer,
)

GREEDY = SamplingConfig()


# -- tokenizers -------------------------------------------------------------------------------------------------------

def trained_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE learned from a few sentences: " cat" is one token, " c" is two, "\\n\\n" is one."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["the cat sat on the mat.\n\nthe dog sat on the log.", "a cat and a dog",
                                 "the hive is warm\n\n"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def metaspace_words() -> PreTrainedTokenizerFast:
    """SentencePiece-style words: "▁the" is " the", but a decode drops the space of its first token."""
    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "▁sat": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_text_after_keeps_the_space_a_leading_token_loses_alone():
    words = metaspace_words()
    assert words.decode([2]) == "cat"  # alone, the first token's space is dropped ...
    assert text_after(words, [1, 2, 3], 1) == " cat sat"  # ... read after "the", it is kept
    assert text_after(words, [1, 2, 3], 0) == "the cat sat"


# -- the target side: the draft's text after committed tokens ---------------------------------------------------------

BPE = trained_bpe()


def ids(text: str) -> list[int]:
    return BPE.encode(text, add_special_tokens=False)


BOS = BPE.bos_token_id


@pytest.mark.parametrize("context, text, expected", [
    # Must match: the window's tokens come back unchanged and the new ones follow.
    (ids(" the cat"), " sat", ids(" sat")),
    (ids(" the cat\n"), " sat", ids(" sat")),
    # A special token ends the window: the text is encoded as it would start a sequence.
    (ids(" the cat") + [BOS], "the dog", ids("the dog")),
    # Must not match: the committed " c" + "at" split (not one the tokenizer makes from text) would merge with more
    # text into " cat"; a committed newline would merge with a new one into "\n\n". The target cannot take back
    # committed tokens, so nothing is drafted.
    (ids(" the") + ids(" c") + ids("at"), " sat", None),
    (ids(" the c"), "at", None),
    (ids(" the cat\n"), "\n", None),
])
def test_target_boundary(context, text, expected):
    assert TargetBoundary(BPE, context, 4, special_ids(BPE)).encode(text) == expected


def test_target_window_is_the_last_tokens_and_never_reaches_past_a_special_token():
    context = ids(" the dog sat on the log")
    assert TargetBoundary(BPE, context, 2, special_ids(BPE)).window_ids == context[-2:]
    assert TargetBoundary(BPE, context + [BOS] + ids(" cat"), 4, special_ids(BPE)).window_ids == ids(" cat")


# -- the draft side: the target's committed text, in draft ids --------------------------------------------------------

def test_draft_view_follows_the_whole_encoding_and_moves_its_sync_point():
    words = tiny_tokenizer()  # the target: words, decoded with spaces between them
    sentence = [words.convert_tokens_to_ids(w) for w in "the hive is warm and the water is cold".split()] * 3
    view = DraftTextView(words, BPE, window=3)
    for end in range(1, len(sentence) + 1, 2):  # a few tokens a round, as the loop commits them
        context = sentence[:end]
        assert view.update(context) == BPE.encode(words.decode(context), add_special_tokens=False)
        # Only the last few tokens' text is read again each round: the sync point trails the end by the window.
        assert len(context) - len(view.synced_ids) <= 3 + 3 or end < 6
    assert len(view.synced_ids) > len(sentence) // 2
    other = sentence[:4][::-1]  # a new sequence: not a continuation, so the view starts over
    assert view.update(other) == BPE.encode(words.decode(other), add_special_tokens=False)


def test_draft_view_puts_the_draft_tokenizers_bos_first():
    from tokenizers import processors

    bpe = trained_bpe()  # a BOS added by a template, as Llama-family tokenizers add theirs
    bpe.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    words = tiny_tokenizer()
    context = [words.convert_tokens_to_ids(w) for w in ["the", "hive"]]
    assert DraftTextView(words, bpe).update(context) == [BOS] + ids("the hive")


# -- the drafter, with a draft that says what it is told --------------------------------------------------------------

class ScriptedDraft:
    """A byte-level draft model that writes ``script`` after any context of ``context_length`` bytes: each forward
    predicts the script's next byte from how many bytes are cached beyond the context."""

    name = "scripted"
    vocab_size = 259

    def __init__(self, script: list[int], context_length: int, max_context: int = 1000) -> None:
        self.script, self.context_length, self.max_context = script, context_length, max_context
        self.reset()

    def reset(self) -> None:
        self.num_cached, self.num_forwards = 0, 0

    def crop(self, length: int) -> None:
        self.num_cached = length

    def forward(self, token_ids, num_logits=None):
        self.num_cached += len(token_ids)
        self.num_forwards += 1
        logits = torch.zeros(1, self.vocab_size)  # [1, vocab]
        logits[0, self.script[min(self.num_cached - self.context_length, len(self.script) - 1)]] = 1.0
        return type("Output", (), {"logits": logits})


CONTEXT = ids("the dog")


def scripted_drafter(script: str, context: list[int] = CONTEXT, target_eos=frozenset(), then_eos: bool = False,
                     **options):
    """Target: the trained BPE; draft: bytes, scripted to write the bytes of ``script``, then (``then_eos``) the
    byte draft's EOS token."""
    bytes_ = byte_tokenizer()
    script_ids = list(script.encode()) + ([bytes_.eos_token_id] if then_eos else [])
    draft = ScriptedDraft(script_ids, len(BPE.decode(context).encode()))
    drafter = CrossTokenizerDrafter(draft, bytes_, BPE, target_eos_ids=target_eos,
                                    draft_eos_ids=frozenset({bytes_.eos_token_id}), **options)
    drafter.start(context)
    return drafter


def test_drafter_stops_one_target_token_past_its_budget_and_keeps_the_budget():
    # " the cat sat on the mat" is six BPE tokens; a budget of 3 keeps " the cat sat". The draft stopped writing
    # as soon as a fourth token had begun: 13 bytes (" the cat sat o"), read in 13 forwards (the context, 12 bytes).
    drafter = scripted_drafter(" the cat sat on the mat", num_draft_tokens=3)
    draft = drafter.propose(CONTEXT, 10, GREEDY, None)
    assert draft.token_ids == ids(" the cat sat") and draft.draft_probs is None
    assert drafter.draft.num_forwards == 13
    assert drafter.propose(CONTEXT, 2, GREEDY, None).token_ids == ids(" the cat")  # the loop's budget wins
    assert drafter.propose(CONTEXT, 0, GREEDY, None).token_ids == []


def test_draft_eos_becomes_the_targets_and_a_target_eos_ends_the_draft():
    eos = BPE.eos_token_id
    drafter = scripted_drafter(" the cat", target_eos=frozenset({eos}), then_eos=True, num_draft_tokens=4)
    assert drafter.propose(CONTEXT, 10, GREEDY, None).token_ids == ids(" the cat") + [eos]
    # Without an end-of-sequence id the loop stops at, the draft just ends.
    drafter = scripted_drafter(" the cat", then_eos=True, num_draft_tokens=4)
    assert drafter.propose(CONTEXT, 10, GREEDY, None).token_ids == ids(" the cat")
    # The draft's text may spell the target's special token: nothing after it is drafted.
    drafter = scripted_drafter(" the</s> cat sat", target_eos=frozenset({eos}), num_draft_tokens=4)
    assert drafter.propose(CONTEXT, 10, GREEDY, None).token_ids == ids(" the") + [eos]


def test_a_draft_that_would_re_split_committed_tokens_drafts_nothing():
    context = CONTEXT + ids(" c")  # the target committed " c"; the draft writes "at": " cat" is one BPE token
    drafter = scripted_drafter("at on the mat", context, num_draft_tokens=2)
    assert drafter.propose(context, 10, GREEDY, None).token_ids == []
    assert drafter.num_boundary_misses == 1


def test_draft_stays_within_the_drafts_context():
    drafter = scripted_drafter(" the cat sat on the mat", num_draft_tokens=4)
    drafter.draft.max_context = len(b" the dog") + 3  # room for three bytes
    assert drafter.propose(CONTEXT, 10, GREEDY, None).token_ids == ids(" the")
    assert drafter.draft.num_cached <= drafter.draft.max_context
    # Up to the window's last position: a window the context fills exactly still drafts (its last token is never
    # fed), one the context overflows drafts nothing.
    context_bytes = len(b"the dog")
    for max_context in range(context_bytes - 2, context_bytes + 6):
        drafter = scripted_drafter(" the cat sat on the mat", num_draft_tokens=4)
        drafter.draft.max_context = max_context
        drafted = drafter.propose(CONTEXT, 10, GREEDY, None).token_ids
        assert drafter.draft.num_cached <= max_context
        assert bool(drafted) == (max_context >= context_bytes), (max_context, drafted)


def test_length_doubles_after_full_acceptance_and_resets_after_rejection():
    drafter = scripted_drafter(" the cat sat on the mat and the dog sat on the log and", num_draft_tokens=2,
                               max_num_draft_tokens=8)
    lengths = []
    for accept_all in (True, True, True, False):
        draft = drafter.propose(CONTEXT, 100, GREEDY, None)
        lengths.append(draft.num_nodes)
        drafter.commit(CONTEXT, draft.num_nodes if accept_all else 1)
    assert lengths == [2, 4, 8, 8]
    assert drafter.propose(CONTEXT, 100, GREEDY, None).num_nodes == 2


# -- the method in the loop -------------------------------------------------------------------------------------------

def cross_decoder(target_model, target_tokenizer, draft_model, draft_tokenizer, **config) -> SpeculativeDecoder:
    target = CausalLM(target_model, name="tiny-target")

    def load_draft(source: str):
        assert source == "other"
        return CausalLM(draft_model, name="tiny-draft"), draft_tokenizer

    method = MethodConfig("cross", draft="other", **config)
    drafter, verifier = build_method(MethodContext(method, target, target_tokenizer, load_draft))
    return SpeculativeDecoder(target, drafter, verifier)


def renamed_copy(model, tokenizer, seed: int = 7):
    """``model`` and ``tokenizer`` with their ordinary tokens' ids shuffled alike: another vocabulary over the same
    words and the same predictions, so a draft that knows everything, through another tokenizer."""
    order = torch.randperm(VOCAB - 4, generator=torch.Generator().manual_seed(seed)) + 4
    new_id = torch.cat([torch.arange(4), order])  # specials keep their ids
    vocab = {token: int(new_id[i]) for token, i in tokenizer.get_vocab().items()}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    renamed = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]",
                                      unk_token="[UNK]", pad_token="[PAD]")
    copy = tiny_llama(0)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        copy.model.embed_tokens.weight[new_id] = model.model.embed_tokens.weight
        copy.lm_head.weight[new_id] = model.lm_head.weight
    return copy, renamed


@pytest.fixture(scope="module")
def words_target():
    return tiny_llama(0), tiny_tokenizer()


def word_prompt(seed: int, length: int = 10) -> list[int]:
    """Ordinary word ids only (no specials, which the draft never sees as text)."""
    return torch.randint(9, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_draft_that_knows_everything_through_another_vocabulary_is_accepted_whole(words_target):
    model, tokenizer = words_target
    draft_model, draft_tokenizer = renamed_copy(model, tokenizer)
    assert draft_tokenizer.get_vocab() != tokenizer.get_vocab()
    decoder = cross_decoder(model, tokenizer, draft_model, draft_tokenizer, num_draft_tokens=4)
    prompt = word_prompt(0)
    expected = hf_greedy(model, prompt, 40)
    assert all(token >= 4 for token in expected)  # else the draft could not write it as text
    assert decoder.generate(prompt, greedy(40)) == expected
    stats = decoder.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # 4, 8, 16, 16 tokens a round (doubling), the last round cut by the length: 40 tokens in at most 4 target calls.
    assert stats.num_rounds <= 4
    assert_greedy_equivalent(model, decoder, prompt)


@pytest.mark.parametrize("seed", [0, 3])
def test_greedy_equals_plain_decoding_with_a_random_byte_level_draft(words_target, seed):
    model, tokenizer = words_target
    decoder = cross_decoder(model, tokenizer, tiny_llama(11, vocab=259), byte_tokenizer())
    assert_greedy_equivalent(model, decoder, word_prompt(seed), drafts_kept=False)  # a random draft: rejected


def test_greedy_equals_plain_decoding_for_a_byte_level_target_with_a_word_draft(words_target):
    # Random bytes decode to broken characters and to text the word draft cannot spell: the drafter must not stumble.
    model, tokenizer = words_target
    target = tiny_llama(5, vocab=259)
    decoder = cross_decoder(target, byte_tokenizer(), model, tokenizer, num_draft_tokens=3)
    assert_greedy_equivalent(target, decoder, list(b" the hive is warm"), drafts_kept=False)


def test_sampled_decoding_is_reproducible_from_its_generator(words_target):
    model, tokenizer = words_target
    draft_model, draft_tokenizer = renamed_copy(model, tokenizer)
    decoder = cross_decoder(model, tokenizer, draft_model, draft_tokenizer)
    config = DecodeConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=0.8))
    runs = [decoder.generate(word_prompt(1), config, torch.Generator().manual_seed(5)) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30 and all(0 <= t < VOCAB for t in runs[0])
    assert decoder.stats.num_accepted_tokens > 0
    # (Not plain sampling's text for the seed, though its drafts carry no probabilities: the draft samples them with
    # the same generator, so the target's draws come later in its stream. The law is the target's all the same.)


def test_clear_errors(words_target):
    model, tokenizer = words_target
    target = CausalLM(model, name="tiny-target")
    with pytest.raises(UnsupportedOptionError, match="--draft"):
        build_method(MethodContext(MethodConfig("cross"), target, tokenizer, lambda source: None))
    no_tokenizer = MethodContext(MethodConfig("cross", draft="bare"), target, tokenizer,
                                 lambda source: (CausalLM(tiny_llama(1), name="bare"), None))
    with pytest.raises(UnsupportedOptionError, match="draft 'bare' has no tokenizer"):
        build_method(no_tokenizer)
    with pytest.raises(UnsupportedOptionError, match="without a tokenizer"):
        build_method(MethodContext(MethodConfig("cross", draft="x"), target, None, lambda source: None))


def test_words_are_the_tiny_tokenizers():
    # The tests above write words the tiny tokenizer knows; a word it lacks would be [UNK] to the target.
    assert {"the", "hive", "is", "warm", "and", "water", "cold"} <= set(WORDS)
