"""The corpus n-gram table, its drafter, the `corpus` method and `jointspec build-corpus` (tiny models, no downloads)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import FakeTokenizer, VOCAB, corpus_folder, greedy, hf_greedy, make_decoder, random_prompt
from jointspec.drafters.corpus import (CONFIG_FILE, CorpusLookupDrafter, NgramTable, shipped_table_for, table_for,
                                       tokenizer_fingerprint)
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig

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


def test_corpus_method_without_a_table_says_how_to_build_one(target_model):
    from jointspec.methods import MethodConfig, MethodContext, build_method
    from jointspec.backends.hf import CausalLM

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


class CharTokenizer(FakeTokenizer):
    """One token per character, enough for build-corpus to tokenize prompt files."""

    eos_token_id = None
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + (ord(ch) % (VOCAB - 3)) for ch in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        text = " ".join(m["content"] for m in messages)
        return self(text)["input_ids"] if tokenize else text


def build_corpus_on(monkeypatch, target_model) -> CharTokenizer:
    """Point build-corpus at the tiny ``target_model``; returns the tokenizer it gets."""
    import jointspec.cli.corpus as corpus_cli
    from jointspec.backends.hf import CausalLM

    tokenizer = CharTokenizer({f"t{i}": i for i in range(VOCAB)})
    monkeypatch.setattr(corpus_cli, "load_target", lambda *a, **k: (CausalLM(target_model), tokenizer))
    return tokenizer


def test_build_corpus_command_answers_resumes_and_writes_a_table(tmp_path, monkeypatch, target_model):
    # The target answers the prompts of a .txt source; a second run with more prompts answers only the new ones.
    from jointspec.cli.main import main

    tokenizer = build_corpus_on(monkeypatch, target_model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"question number {i} about things" for i in range(5)))
    out, data = tmp_path / "table", tmp_path / "data"
    args = ["build-corpus", "--prompts", str(prompts), "--max-new-tokens", "6", "--min-count", "1", "--no-progress",
            "--out", str(out), "--data", str(data)]
    assert main(args + ["--num-prompts", "3"]) == 0
    assert len((data / "answers.jsonl").read_text().splitlines()) == 3
    assert main(args) == 0
    lines = [json.loads(line) for line in (data / "answers.jsonl").read_text().splitlines()]
    assert sorted(line["index"] for line in lines) == [0, 1, 2, 3, 4]  # the first three were not answered again
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["num_target_answers"] == 5 and config["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    table = table_for(out, tokenizer, VOCAB)
    assert table.num_entries > 0
    assert all(len(line["answer_ids"]) == 6 for line in lines)
    assert corpus_folder(target_model)  # the equivalence tests' table exists too (built once per model)


def test_build_corpus_counts_the_answers_of_train_draft_data_folders(tmp_path, monkeypatch, capsys, target_model,
                                                                     other_model):
    # Answers generated for training a head go into the table as well; a folder of another target is refused.
    from jointspec.cli.main import main
    from jointspec.backends.hf import CausalLM
    from jointspec.train.data import build_data

    tokenizer = build_corpus_on(monkeypatch, target_model)
    prompts = [[5 + i, 7, 11 + i] for i in range(4)]
    folder = build_data(CausalLM(target_model), None, prompts, tmp_path / "mine", max_new_tokens=12,
                        max_length=64, shard_size=3, batch_size=4)
    prompt_file = tmp_path / "prompts.txt"
    prompt_file.write_text("one short question")
    args = ["build-corpus", "--prompts", str(prompt_file), "--max-new-tokens", "4", "--min-count", "1",
            "--no-progress", "--data", str(tmp_path / "data")]
    assert main(args + ["--out", str(tmp_path / "with"), "--answers-from", str(folder)]) == 0
    config = json.loads((tmp_path / "with" / CONFIG_FILE).read_text())
    assert config["num_data_folder_answers"] == 4 and config["num_target_answers"] == 1
    with_folder = table_for(tmp_path / "with", tokenizer, VOCAB)
    assert main(args + ["--out", str(tmp_path / "without")]) == 0  # the same table without the folder's answers
    without = table_for(tmp_path / "without", tokenizer, VOCAB)
    assert with_folder.num_entries > without.num_entries
    # Each folder answer is the target's greedy continuation: the table now predicts it from its own n-grams.
    from jointspec.cli.corpus import data_folder_answers

    answers = data_folder_answers(folder, CausalLM(target_model))
    assert [len(a) for a in answers] == [12] * 4
    answer = answers[0]
    assert with_folder.continuation(answer[:3])[0] == answer[3]
    other = build_data(CausalLM(other_model), None, prompts, tmp_path / "other", max_new_tokens=4, max_length=64,
                       shard_size=4, batch_size=4)
    assert main(args + ["--out", str(tmp_path / "refused"), "--answers-from", str(other)]) != 0
    assert "holds answers of another target" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()  # refused before anything was written


def test_default_drafts_with_the_table_shipped_for_the_tokenizer(tmp_path, monkeypatch, target_model):
    import jointspec.drafters.corpus as corpus
    from jointspec.drafters.costaware import CostAwareDrafter
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.methods import MethodConfig, MethodContext, build_method
    from jointspec.backends.hf import CausalLM

    mine = FakeTokenizer({f"t{i}": i for i in range(VOCAB)})
    NgramTable.build([[1, 2, 3]], vocab_size=VOCAB, min_count=1).save(
        tmp_path / "table", {"kind": "corpus", "tokenizer_fingerprint": tokenizer_fingerprint(mine)})
    monkeypatch.setattr(corpus, "SHIPPED_TABLES", tmp_path)
    target = CausalLM(target_model)  # no head is shipped for this tiny target
    drafter, _ = build_method(MethodContext(MethodConfig(name="default"), target, mine, None))
    assert isinstance(drafter, CostAwareDrafter) and isinstance(drafter.inner, CorpusLookupDrafter)
    other = FakeTokenizer({f"u{i}": i for i in range(VOCAB)})  # no table for this one: prompt lookup
    drafter, _ = build_method(MethodContext(MethodConfig(name="default"), target, other, None))
    assert isinstance(drafter.inner, PromptLookupDrafter)


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
