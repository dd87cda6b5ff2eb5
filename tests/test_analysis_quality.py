"""Output-quality numbers (``jointspec.analysis.quality``) on hand-counted examples: distinct-n, the repetition rate,
and perplexity from the target's own log-probabilities. Deterministic: no false-failure odds.
"""

from __future__ import annotations

import math

import pytest
import torch

from jointspec.analysis.quality import distinct_n, perplexity, repetition_rate
from jointspec.backends.hf import CausalLM


def test_distinct_n_counts_distinct_ngrams_over_all_ngrams():
    # Bigrams of 1 2 1 2 3: (1,2) (2,1) (1,2) (2,3): 3 distinct of 4. Trigrams: (1,2,1) (2,1,2) (1,2,3): all distinct.
    assert distinct_n([1, 2, 1, 2, 3], 2) == 0.75
    assert distinct_n([1, 2, 1, 2, 3], 3) == 1.0
    assert distinct_n([4, 4, 4, 4, 4], 2) == 0.25  # (4,4) four times
    assert math.isnan(distinct_n([7], 2))  # no bigram at all


def test_repetition_rate_counts_every_ngram_seen_before_in_the_same_output():
    # 4-grams of 1 2 3 4 1 2 3 4 1: 1234 2341 3412 4123 1234 (seen) 2341 (seen): 2 of 6.
    assert repetition_rate([1, 2, 3, 4, 1, 2, 3, 4, 1], 4) == pytest.approx(2 / 6)
    # Bigrams of 5 5 5 5: (5,5) three times, the last two seen before: 2 of 3 (every repeat counts, not each kind).
    assert repetition_rate([5, 5, 5, 5], 2) == pytest.approx(2 / 3)
    assert repetition_rate([1, 2, 3, 4, 5], 2) == 0.0
    assert math.isnan(repetition_rate([1, 2, 3], 4))


def test_perplexity_is_the_exponentiated_mean_negative_log_probability_of_the_new_tokens(target_model):
    prompt, new = [5, 17, 33, 2, 60], [8, 41, 8, 90]
    with torch.no_grad():
        logits = target_model(torch.tensor([prompt + new], device=target_model.device)).logits[0]
    # Token new[i] is predicted by the row of the position before it: rows len(prompt) - 1 ... end - 1.
    logprobs = [logits[len(prompt) - 1 + i].log_softmax(-1)[token].item() for i, token in enumerate(new)]
    expected = math.exp(-sum(logprobs) / len(new))
    assert perplexity(CausalLM(target_model), prompt, new) == pytest.approx(expected, rel=1e-5)
    assert math.isnan(perplexity(CausalLM(target_model), prompt, []))
