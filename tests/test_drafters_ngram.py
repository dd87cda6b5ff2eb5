"""Prompt lookup: which continuation it copies, and how its draft length adapts. Deterministic, no model needed."""

import numpy as np
import pytest

from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.ngram import PromptLookupDrafter, lookup, suffix_matches

GREEDY = SamplingConfig()


def test_longest_ngram_wins_over_more_recent_shorter_match():
    # Suffix [5, 6] occurs at 0 (followed by 7, 9); the unigram [6] also occurs at 5, more recently (followed by 8).
    context = np.array([5, 6, 7, 9, 4, 6, 8, 5, 6])
    assert lookup(context, 2, max_ngram=2, min_ngram=1) == [7, 9]
    assert lookup(context, 2, max_ngram=1, min_ngram=1) == [8, 5]


def test_most_recent_match_among_equal_lengths_and_no_match():
    context = np.array([1, 2, 3, 1, 2, 4, 1, 2])
    assert lookup(context, 3, max_ngram=2, min_ngram=2) == [4, 1, 2]
    assert lookup(np.array([1, 2, 3, 4]), 3, max_ngram=3, min_ngram=1) == []


def reference_suffix_matches(context, max_ngram, min_ngram, max_matches):
    """suffix_matches by its definition: every window of n tokens followed by one more, compared with the suffix."""
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        starts = [j + n for j in range(len(context) - n) if list(context[j:j + n]) == list(context[-n:])]
        if starts:
            return n, starts[::-1][:max_matches]
    return 0, []


@pytest.mark.parametrize("alphabet", [2, 5, 50])
def test_suffix_matches_follows_its_definition(alphabet):
    """On 300 random contexts each (lengths 0-60; small alphabets repeat a lot, large ones rarely) and several n-gram
    ranges, the filtered search finds what comparing every window finds. Deterministic."""
    rng = np.random.default_rng(alphabet)
    for _ in range(300):
        context = rng.integers(0, alphabet, int(rng.integers(0, 61))).astype(np.int64)
        for max_ngram, min_ngram, max_matches in ((3, 1, 4), (3, 2, 1), (5, 1, 32), (1, 1, 2)):
            assert suffix_matches(context, max_ngram, min_ngram, max_matches) == \
                reference_suffix_matches(context, max_ngram, min_ngram, max_matches), (context, max_ngram, min_ngram)


def test_draft_never_exceeds_budget():
    drafter = PromptLookupDrafter(num_draft_tokens=8)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert drafter.propose(context, 3, GREEDY, None).token_ids == [3, 4, 5]
    assert drafter.propose(context, 0, GREEDY, None).token_ids == []


def test_length_doubles_after_full_acceptance_and_resets_after_rejection():
    drafter = PromptLookupDrafter(num_draft_tokens=2, max_num_draft_tokens=8)
    context = list(range(10, 40)) + [10, 11]
    drafter.start(context)
    assert len(drafter.propose(context, 100, GREEDY, None).token_ids) == 2
    drafter.commit(context, 2)
    assert len(drafter.propose(context, 100, GREEDY, None).token_ids) == 4
    drafter.commit(context, 4)
    assert len(drafter.propose(context, 100, GREEDY, None).token_ids) == 8
    drafter.commit(context, 8)
    assert len(drafter.propose(context, 100, GREEDY, None).token_ids) == 8  # capped
    drafter.commit(context, 3)
    assert len(drafter.propose(context, 100, GREEDY, None).token_ids) == 2  # a rejection resets
    drafter.start(context)
    assert drafter._length == 2


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="max_num_draft_tokens"):
        PromptLookupDrafter(num_draft_tokens=4, max_num_draft_tokens=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        PromptLookupDrafter(num_draft_tokens=0)


def test_peek_is_the_draft_without_its_state():
    drafter = PromptLookupDrafter(num_draft_tokens=2, max_num_draft_tokens=8)
    context = [1, 2, 3, 4, 5, 1, 2]
    drafter.start(context)
    assert drafter.peek(context, 3) == [3, 4, 5]
    assert drafter.peek(context, 0) == [] and drafter.peek([7, 8], 3) == []
    drafter.propose(context, 8, SamplingConfig(), None)
    drafter.commit(context + [3, 4], 2)  # whole draft accepted: the next draft may be 4 long
    drafter.peek(context + [3, 4], 1)  # changes nothing
    assert drafter.propose(context + [3, 4], 8, SamplingConfig(), None).token_ids == [5, 1, 2, 3]
