"""Sampled equivalence: a method whose drafts carry no probabilities emits exactly plain sampling's tokens.

Prompt lookup, corpus lookup, lookahead (its trie), lookahead decoding (``lade``: Jacobi guesses) and ADED propose
tokens without a distribution. Their verifiers judge such a draft
by the target's own draw at each position, one draw per emitted token, in order (verifiers/rejection.py), which is
how ``ar`` samples. So with the same seeded generator every one of them must emit ``ar``'s tokens, whatever it
drafted, however long its drafts were and however a cost-aware wrapper timed them: the property `--seed` promises.
The law of each token is tested apart (tests/test_verifiers_rejection.py, tests/test_verifiers_tree_spectr.py).

False failures: the target scores a draft in one multi-row forward and ``ar`` one row at a time. On these fp32
tiny models the two can differ in the last bits of a probability (about 1e-7), which moves a draw only if its
uniform falls that close to a boundary of the cumulative sum: about 1e-6 per token here, about 2e-3 for the file's
nearly 1,600 tokens.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.core.loop import DecodeConfig
from jointspec.core.sampling import SamplingConfig

from helpers import decoder_for, first_occurrences, make_decoder, random_prompt

MAX_NEW_TOKENS = 40
# Sharp enough that the tiny target repeats itself and lookup drafts are kept, soft enough that most tokens are
# real draws (the top token has well under all the mass).
SAMPLING = SamplingConfig(temperature=0.7, top_k=8)
METHODS = ["pld", "corpus", "lookahead", "lade", "aded"]


def sampled(max_new_tokens: int, eos_token_ids: frozenset[int] = frozenset()) -> DecodeConfig:
    return DecodeConfig(max_new_tokens=max_new_tokens, sampling=SAMPLING, eos_token_ids=eos_token_ids)


def plain_sampling(target_model, prompt: list[int], config: DecodeConfig, seed: int) -> list[int]:
    return make_decoder("ar", target_model).generate(prompt, config, torch.Generator().manual_seed(seed))


def repetitive_prompt(seed: int) -> list[int]:
    """A prompt that repeats itself, so lookup finds drafts from the first round on."""
    start = random_prompt(seed, length=6)
    return start * 3


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lookup_methods_sample_what_ar_samples(target_model, method, seed):
    prompt = repetitive_prompt(seed)
    decoder = make_decoder(method, target_model)
    out = decoder.generate(prompt, sampled(MAX_NEW_TOKENS), torch.Generator().manual_seed(seed))
    assert out == plain_sampling(target_model, prompt, sampled(MAX_NEW_TOKENS), seed)
    assert decoder.stats.num_draft_tokens > 0


def test_drafts_were_kept_and_rejected(target_model):
    # The equivalence above is only worth something if drafts were both kept (tokens emitted from the draft) and
    # rejected (the target's draw replacing a drafted token) along the way.
    accepted = drafted = 0
    for seed in range(3):
        decoder = make_decoder("pld", target_model)
        decoder.generate(repetitive_prompt(seed), sampled(MAX_NEW_TOKENS), torch.Generator().manual_seed(seed))
        accepted += decoder.stats.num_accepted_tokens
        drafted += decoder.stats.num_draft_tokens
    assert 0 < accepted < drafted


@pytest.mark.parametrize("num_draft_tokens", [1, 2, 5])
def test_draft_length_does_not_change_the_text(target_model, num_draft_tokens):
    prompt = repetitive_prompt(4)
    decoder = make_decoder("pld", target_model, num_draft_tokens=num_draft_tokens)
    out = decoder.generate(prompt, sampled(MAX_NEW_TOKENS), torch.Generator().manual_seed(4))
    assert out == plain_sampling(target_model, prompt, sampled(MAX_NEW_TOKENS), 4)


@pytest.mark.parametrize("method", ["pld", "corpus"])
def test_cost_aware_schedule_does_not_change_the_text(target_model, method):
    # The cost-aware wrapper chooses each round's draft length from forward times measured when it starts, which
    # differ from run to run; the text must not.
    from helpers import corpus_folder

    prompt = repetitive_prompt(5)
    draft = corpus_folder(target_model) if method == "corpus" else None
    decoder = decoder_for(target_model, method, draft, cost_aware=True)
    out = decoder.generate(prompt, sampled(MAX_NEW_TOKENS), torch.Generator().manual_seed(5))
    assert out == plain_sampling(target_model, prompt, sampled(MAX_NEW_TOKENS), 5)
    # Whatever the timings the first round is at least a probe, and this prompt repeats: something was drafted.
    assert decoder.stats.num_draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_eos_stops_a_sampled_decode_as_it_stops_plain_sampling(target_model, method):
    # Declare as EOS tokens that plain sampling emits at several places: every method must stop right after the
    # first occurrence, as plain sampling with that EOS does, whether the EOS came from a draft or the target.
    prompt = repetitive_prompt(1)
    reference = plain_sampling(target_model, prompt, sampled(MAX_NEW_TOKENS), 1)
    candidates = sorted((pos, token) for token, pos in first_occurrences(reference).items() if pos > 2)
    assert len(candidates) >= 3
    for pos, eos in (candidates[0], candidates[len(candidates) // 2], candidates[-1]):
        config = sampled(MAX_NEW_TOKENS, frozenset({eos}))
        expected = plain_sampling(target_model, prompt, config, 1)
        assert expected == reference[:pos + 1]
        decoder = make_decoder(method, target_model)
        assert decoder.generate(prompt, config, torch.Generator().manual_seed(1)) == expected


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
def test_max_new_tokens_inside_a_sampled_draft(target_model, method, max_new_tokens):
    prompt = repetitive_prompt(2)
    decoder = make_decoder(method, target_model, num_draft_tokens=5)
    out = decoder.generate(prompt, sampled(max_new_tokens), torch.Generator().manual_seed(2))
    assert out == plain_sampling(target_model, prompt, sampled(max_new_tokens), 2)
    assert len(out) == max_new_tokens
