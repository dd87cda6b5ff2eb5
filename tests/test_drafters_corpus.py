"""The corpus n-gram table, its drafter and the `corpus` method (tiny models, no downloads). `jointspec build-corpus`
is tested in test_cli_corpus.py. Deterministic: no false-failure odds."""

from __future__ import annotations

import numpy as np
import pytest

from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.files import WriteError
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.corpus import (
    CONFIG_FILE,
    DEFAULT_MIN_SHARE,
    SHARE_OVER_ACCEPTANCE,
    CorpusLookupDrafter,
    NgramTable,
    shipped_table_for,
    table_for,
    tokenizer_fingerprint,
)
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve

from helpers import VOCAB, FakeTokenizer, greedy, hf_greedy, make_decoder, random_prompt

GREEDY = SamplingConfig(temperature=0.0)


def test_table_keeps_the_most_frequent_continuation():
    # (1, 2, 3) is followed by 4 twice and 5 once: 4 with share 2/3. Pairs never cross from one sequence to the next
    # (3 ends one sequence and 9 starts another, so (3, 9) is never counted).
    table = NgramTable.build([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], [9, 1, 2], [3]], vocab_size=10, max_order=3,
                             min_count=1)
    assert table.continuation([7, 1, 2, 3]) == (4, pytest.approx(2 / 3), 3)
    assert table.continuation([9, 1]) == (2, 1.0, 2)
    assert table.continuation([8]) is None  # never seen
    assert table.continuation([3], min_order=1)[0] == 4  # "3" alone: followed by 4, 5, 4 (and by nothing once)
    assert table.continuation([2, 3], min_order=3) is None  # too short for the orders asked


def test_table_finds_every_ngram_of_a_large_vocabulary_at_its_longest_order():
    # Keys take 16 bits a token here (4 orders fill 64): a lookup packs its key as the table was built, ids up to the
    # last of the vocabulary included. Checked against counts made directly, at every position of the sequences and
    # for contexts never seen.
    rng = np.random.default_rng(0)
    vocab = 50_000
    sequences = [list(rng.choice([0, 1, 2, vocab - 2, vocab - 1, 40_000], size=60)) for _ in range(20)]
    table = NgramTable.build(sequences, vocab_size=vocab, max_order=4, min_count=1)
    followers: dict[tuple[int, ...], dict[int, int]] = {}
    for sequence in sequences:
        for end in range(1, len(sequence)):
            for n in range(1, min(4, end) + 1):
                counts = followers.setdefault(tuple(int(t) for t in sequence[end - n:end]), {})
                counts[int(sequence[end])] = counts.get(int(sequence[end]), 0) + 1
    contexts = [list(sequence[:end]) for sequence in sequences for end in range(1, len(sequence))]
    contexts += [[3, 4, 5], [vocab - 1, 7], [0, 1, vocab - 1, 9]]
    for context in contexts:
        expected = None
        for n in range(min(4, len(context)), 0, -1):
            counts = followers.get(tuple(int(t) for t in context[-n:]))
            if counts:
                best = min(counts, key=lambda token: (-counts[token], token))
                expected = (best, counts[best] / sum(counts.values()), n)
                break
        found = table.continuation(np.asarray(context, dtype=np.int64))
        assert (found is None) == (expected is None), context
        if found is not None:
            assert found[0] == expected[0] and found[2] == expected[2] and found[1] == pytest.approx(expected[1])


def test_table_ties_go_to_the_lowest_id_and_rare_ngrams_are_dropped():
    table = NgramTable.build([[5, 8], [5, 6]], vocab_size=10, max_order=2, min_count=1)
    assert table.continuation([5]) == (6, 0.5, 1)
    pruned = NgramTable.build([[5, 8], [5, 6], [7, 1]], vocab_size=10, max_order=2, min_count=2)
    assert pruned.continuation([5]) == (6, 0.5, 1)
    assert pruned.continuation([7]) is None  # seen once


def test_table_refuses_ids_outside_the_vocabulary_and_orders_beyond_a_key():
    with pytest.raises(ValueError, match="token ids"):
        NgramTable.build([[1, 10]], vocab_size=10)
    with pytest.raises(ValueError, match="max_order"):
        NgramTable.build([[1, 2]], vocab_size=49152, max_order=5)  # 16 bits an id: 4 per 64-bit key


def test_table_round_trips_through_its_folder(tmp_path):
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 20, size=30).tolist() for _ in range(8)]
    table = NgramTable.build(sequences, vocab_size=20, max_order=3, min_count=1)
    table.save(tmp_path, {"kind": "corpus", "note": "test"})
    loaded, config = NgramTable.load(tmp_path)
    assert config["note"] == "test" and config["num_entries"] == table.num_entries
    for n in range(3):
        assert np.array_equal(loaded.keys[n], table.keys[n]) and np.array_equal(loaded.next_ids[n], table.next_ids[n])
    context = sequences[0][:10]
    assert loaded.continuation(context) == (table.continuation(context)[0], pytest.approx(
        table.continuation(context)[1], abs=1e-3), table.continuation(context)[2])


def test_a_save_stopped_midway_leaves_no_table_with_another_tables_config(tmp_path, monkeypatch):
    """A rebuild into the same folder that stops before its config is in place must not leave the new table.npz read
    with the old corpus.json (another max_order: a KeyError, or wrong shares): the folder holds no table instead."""
    from pathlib import Path

    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 20, size=30).tolist() for _ in range(8)]
    NgramTable.build(sequences, vocab_size=20, max_order=2, min_count=1).save(tmp_path, {"kind": "corpus"})

    import os

    real_replace = os.replace

    def refuse_the_config(source, destination):  # the config's rename, the save's last step, fails
        if Path(destination).name == CONFIG_FILE:
            raise OSError("disk full")
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", refuse_the_config)
    with pytest.raises(WriteError, match="could not write the n-gram table .* [(]disk full"):
        NgramTable.build(sequences, vocab_size=20, max_order=4, min_count=1).save(tmp_path, {"kind": "corpus"})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.npz"]  # no partial file left
    with pytest.raises(UnsupportedOptionError, match="holds no n-gram table"):
        NgramTable.load(tmp_path)


@pytest.mark.parametrize("damage", ["table cut short", "config emptied", "config without a key"])
def test_a_damaged_table_is_refused_naming_its_folder_and_what_to_do(tmp_path, damage):
    """Both files are written atomically, so only damage from outside makes them unreadable: that was the archive
    or JSON library's own traceback. Now an error naming the folder and how to make the table again."""
    NgramTable.build([[1, 2, 3, 4], [1, 2, 3, 5]], vocab_size=20, max_order=2, min_count=1).save(tmp_path, {})
    if damage == "table cut short":
        table = tmp_path / "table.npz"
        table.write_bytes(table.read_bytes()[:100])
    elif damage == "config emptied":
        (tmp_path / "corpus.json").write_text("")
    else:
        (tmp_path / "corpus.json").write_text('{"vocab_size": 20}')
    with pytest.raises(UnsupportedOptionError, match="is damaged .*jointspec build-corpus") as raised:
        NgramTable.load(tmp_path)
    assert str(tmp_path) in str(raised.value)


def test_drafter_copies_the_context_first_then_the_table_then_stops():
    # Context lookup ((4, 5) occurred earlier, followed by 6) wins over the table; where the context has no match
    # of >= 2 tokens the table continues (1 -> 2 -> 3); the table knows nothing after 3: the draft ends there.
    table = NgramTable.build([[1, 2, 3]] * 3 + [[4, 5, 9]] * 3, vocab_size=10, max_order=2, min_count=1)
    drafter = CorpusLookupDrafter(table, num_draft_tokens=4)
    drafter.start([])
    assert drafter.propose([4, 5, 6, 0, 4, 5], 4, GREEDY, None).token_ids[0] == 6
    assert drafter.propose([0, 7, 1], 4, GREEDY, None).token_ids == [2, 3]
    assert drafter.propose([0, 8], 4, GREEDY, None).token_ids == []


def test_drafter_leaves_out_continuations_below_min_share():
    table = NgramTable.build([[1, 2], [1, 3], [1, 4]], vocab_size=10, max_order=1, min_count=1)  # 1 -> 2 at 1/3
    assert CorpusLookupDrafter(table, 2, min_share=0.3).propose([1], 2, GREEDY, None).token_ids == [2]
    assert CorpusLookupDrafter(table, 2, min_share=0.5).propose([1], 2, GREEDY, None).token_ids == []


def test_a_cost_aware_wrapper_prices_the_tables_bar_by_what_a_row_costs():
    # 1 -> 2 at share 1/3. Alone a drafted row costs 5 % of a step (the bar 0.15: drafted); where a row costs half a
    # plain round, as in a batch of four, the bar is 0.6 and the entry is left out; a bar given stays where it is.
    table = NgramTable.build([[1, 2], [1, 3], [1, 4]], vocab_size=10, max_order=1, min_count=1)
    cheap = CostCurve({1: 1.0, 2: 1.05, 3: 1.1})
    dear = CostCurve({1: 1.0, 2: 1.5, 3: 2.0})
    lookup = CorpusLookupDrafter(table, 2)
    assert lookup.min_share == DEFAULT_MIN_SHARE  # nothing prices it yet
    wrapper = CostAwareDrafter(lookup, cheap, prior_acceptance=0.9)
    wrapper.start([])
    assert lookup.min_share == pytest.approx(0.05 + SHARE_OVER_ACCEPTANCE)
    assert wrapper.propose([1], 2, GREEDY, None).token_ids[:1] == [2]
    wrapper.commit([1, 2], 1)
    wrapper.curve = dear  # what a batched engine does as its batch fills
    assert lookup.min_share == pytest.approx(0.5 + SHARE_OVER_ACCEPTANCE)
    assert lookup.peek([1], 2) == []
    fixed = CorpusLookupDrafter(table, 2, min_share=0.3)
    CostAwareDrafter(fixed, dear)
    assert fixed.min_share == 0.3 and fixed.peek([1], 2) == [2]
    with pytest.raises(ValueError, match="row_cost"):
        lookup.price_rows(-0.1)


def test_the_ragged_batch_engine_drafts_the_table_at_the_unpriced_bar():
    # The ragged engine runs the inner drafter of a cost-aware wrapper in a padded batch, whose rows cost more than a
    # lone sequence's: the bar a lone sequence's curve set (0.15 here) goes back to the unpriced one; a given one stays.
    from jointspec.batch.drafters import batch_drafter_for

    table = NgramTable.build([[1, 2], [1, 3], [1, 4]], vocab_size=10, max_order=1, min_count=1)
    cheap = CostCurve({1: 1.0, 2: 1.05, 3: 1.1})
    priced = CostAwareDrafter(CorpusLookupDrafter(table, 2), cheap)
    assert priced.inner.min_share == pytest.approx(0.05 + SHARE_OVER_ACCEPTANCE)
    assert batch_drafter_for(priced, "corpus").prototype.min_share == DEFAULT_MIN_SHARE
    given = CostAwareDrafter(CorpusLookupDrafter(table, 2, min_share=0.3), cheap)
    assert batch_drafter_for(given, "corpus").prototype.min_share == 0.3


def test_drafter_length_doubles_after_a_whole_accepted_draft():
    table = NgramTable.build([list(range(10))] * 2, vocab_size=10, max_order=1, min_count=1)
    drafter = CorpusLookupDrafter(table, num_draft_tokens=2, max_num_draft_tokens=6)
    drafter.start([0])
    assert len(drafter.propose([0], 9, GREEDY, None).token_ids) == 2
    drafter.commit([0, 1, 2, 3], 2)
    assert len(drafter.propose([0, 1, 2, 3], 9, GREEDY, None).token_ids) == 4
    drafter.commit([0, 1, 2, 3, 9], 0)
    assert len(drafter.propose([0, 1, 2], 9, GREEDY, None).token_ids) == 2


def test_corpus_method_accepts_drafts_and_matches_plain_greedy(target_model):
    # The table holds the target's own continuations of other prompts; here also this prompt's own, so drafts are
    # accepted (the output must still be plain greedy's, token for token).
    prompt = random_prompt(4)
    reference = hf_greedy(target_model, prompt, 40)
    decoder = make_decoder("corpus", target_model)
    assert decoder.generate(prompt, greedy(40)) == reference
    assert decoder.stats.num_draft_tokens > 0  # the table drafted
    assert decoder.stats.num_accepted_tokens > 0



def test_corpus_with_one_token_context_matches_builds_and_matches_plain_greedy(target_model):
    # --max-ngram 1: the context's 1-token matches, then the table. It used to fail building with a min_ngram of 2
    # the user never gave.
    from jointspec.backends.hf import CausalLM
    from jointspec.core.loop import SpeculativeDecoder
    from jointspec.methods import MethodConfig, MethodContext, build_method

    from helpers import corpus_folder

    prompt = random_prompt(4)
    config = MethodConfig(name="corpus", draft=corpus_folder(target_model), max_ngram=1, cost_aware=False)
    target = CausalLM(target_model)
    decoder = SpeculativeDecoder(target, *build_method(MethodContext(config, target, None, None)))
    assert decoder.drafter.min_ngram == decoder.drafter.max_ngram == 1
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)

def test_table_for_refuses_another_vocabulary_or_tokenizer(tmp_path, target_model):
    mine = FakeTokenizer({f"t{i}": i for i in range(VOCAB)})
    theirs = FakeTokenizer({f"u{i}": i for i in range(VOCAB)})
    NgramTable.build([[1, 2, 3]], vocab_size=VOCAB, min_count=1).save(
        tmp_path, {"kind": "corpus", "tokenizer_fingerprint": tokenizer_fingerprint(mine)})
    assert table_for(tmp_path, mine, VOCAB).vocab_size == VOCAB
    with pytest.raises(UnsupportedOptionError, match="another tokenizer"):
        table_for(tmp_path, theirs, VOCAB)
    with pytest.raises(UnsupportedOptionError, match="vocabulary"):
        table_for(tmp_path, mine, VOCAB + 1)
    with pytest.raises(UnsupportedOptionError, match="no n-gram table"):
        table_for(tmp_path / "missing", mine, VOCAB)


def test_defaults_lookup_through_the_table_keeps_a_longer_min_ngram(target_model):
    # `default` reads --min-ngram for its lookup; where a table is shipped its lookup drafts as corpus does, which
    # fixed the shortest context match at 2 and dropped the user's value without a word.
    from jointspec.backends.hf import CausalLM
    from jointspec.methods import MethodConfig, MethodContext
    from jointspec.methods.lossless import _corpus_lookup, table_for

    from helpers import corpus_folder

    target = CausalLM(target_model)
    table = table_for(corpus_folder(target_model), None, target.vocab_size)
    for min_ngram, expected in ((1, 2), (3, 3)):
        config = MethodConfig(name="default", min_ngram=min_ngram, max_ngram=3)
        assert _corpus_lookup(MethodContext(config, target, None, None), table).min_ngram == expected


def test_corpus_method_without_a_table_says_how_to_build_one(target_model):
    from jointspec.backends.hf import CausalLM
    from jointspec.methods import MethodConfig, MethodContext, build_method

    context = MethodContext(MethodConfig(name="corpus"), CausalLM(target_model), FakeTokenizer({"a": 0}), None)
    with pytest.raises(UnsupportedOptionError, match="build-corpus"):
        build_method(context)


def test_shipped_table_is_found_by_tokenizer(tmp_path, monkeypatch):
    import jointspec.drafters.corpus as corpus

    mine = FakeTokenizer({"a": 0, "b": 1})
    folder = tmp_path / "some-table"
    NgramTable.build([[0, 1]], vocab_size=2, min_count=1).save(
        folder, {"kind": "corpus", "tokenizer_fingerprint": tokenizer_fingerprint(mine)})
    monkeypatch.setattr(corpus, "SHIPPED_TABLES", tmp_path)
    assert shipped_table_for(mine) == folder
    assert shipped_table_for(FakeTokenizer({"a": 1, "b": 0})) is None
    assert shipped_table_for(None) is None


def test_fingerprint_is_kept_per_tokenizer_until_its_vocabulary_grows():
    class Sized(FakeTokenizer):
        calls = 0

        def get_vocab(self):
            Sized.calls += 1
            return super().get_vocab()

        def __len__(self):
            return len(self.vocab)

    tokenizer = Sized({"a": 0, "b": 1})
    first = tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer) == first and Sized.calls == 1  # hashed once
    tokenizer.vocab["c"] = 2  # a token added: hashed again, and the hash changes
    assert tokenizer_fingerprint(tokenizer) != first and Sized.calls == 2


def test_peek_is_the_draft_without_its_state():
    # A cost-aware wrapper's shadow tests read peek: it must be the draft propose would make, and leave the length
    # propose adapts (doubled after a whole accepted draft) as it was.
    table = NgramTable.build([list(range(10))] * 2, vocab_size=10, max_order=1, min_count=1)
    drafter = CorpusLookupDrafter(table, num_draft_tokens=2, max_num_draft_tokens=6)
    drafter.start([0])
    drafter.propose([0], 9, GREEDY, None)
    drafter.commit([0, 1, 2, 3], 2)  # a whole draft accepted: the next one is 4 long
    assert drafter.peek([0, 1, 2, 3], 6) == [4, 5, 6, 7, 8, 9]
    assert drafter.peek([0, 8], 3) == [9] and drafter.peek([0, 1], 0) == []
    assert drafter.propose([0, 1, 2, 3], 9, GREEDY, None).token_ids == drafter.peek([0, 1, 2, 3], 4)
