"""`jointspec build-corpus`: the target answers prompt files (resuming where it stopped), the answers of train-draft
data folders are counted too, and a folder of another target is refused before anything is written.

Tiny in-process models with a one-token-per-character tokenizer; greedy decoding: no false-failure odds.
"""

from __future__ import annotations

import json

from jointspec.drafters.corpus import CONFIG_FILE, table_for, tokenizer_fingerprint

from helpers import VOCAB, FakeTokenizer, corpus_folder


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
    from jointspec.backends.hf import CausalLM
    from jointspec.cli.main import main
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
    # --answers-from alone counts those answers only: the target answers no default prompts, writes no data folder.
    assert main(["build-corpus", "--answers-from", str(folder), "--min-count", "1", "--no-progress",
                 "--out", str(tmp_path / "only"), "--data", str(tmp_path / "only-data")]) == 0
    config = json.loads((tmp_path / "only" / CONFIG_FILE).read_text())
    assert config["num_data_folder_answers"] == 4 and config["num_target_answers"] == 0
    assert not (tmp_path / "only-data").exists()
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
    # An unfinished folder (a shard missing: its build was stopped) is refused, as train-draft --extra-data does.
    next(iter(sorted(folder.glob("shard-*.pt")))).unlink()
    assert main(args + ["--out", str(tmp_path / "part"), "--answers-from", str(folder)]) != 0
    assert "is unfinished" in capsys.readouterr().err and not (tmp_path / "part").exists()


def test_answers_made_with_other_settings_are_refused_not_reused(tmp_path, monkeypatch, capsys, target_model):
    # A rerun into the same data folder with other prompts or another answer length would have counted the old
    # answers under the new settings; it is refused, naming what differs. A cut-off last line is made again.
    from jointspec.cli.main import main

    build_corpus_on(monkeypatch, target_model)
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("question one here\nquestion two here\n")
    second.write_text("another question\nand one more\nand a third\n")
    out, data = tmp_path / "table", tmp_path / "data"

    def run(prompts, length="4"):
        return main(["build-corpus", "--max-new-tokens", length, "--min-count", "1", "--no-progress", "--out",
                     str(out), "--data", str(data), "--prompts", str(prompts)])

    assert run(first) == 0
    capsys.readouterr()
    assert run(second) == 2 and "differing: prompts" in capsys.readouterr().err
    assert run(first, "8") == 2 and "differing: max_new_tokens" in capsys.readouterr().err
    (data / "answers.json").rename(tmp_path / "kept.json")  # answers whose settings nobody recorded
    assert run(first) == 2 and "no record of the settings" in capsys.readouterr().err
    (tmp_path / "kept.json").rename(data / "answers.json")
    answers = data / "answers.jsonl"
    lines = answers.read_text().splitlines()
    answers.write_text(lines[0] + "\n" + lines[1][:7])  # an interrupted run's last line
    assert run(first) == 0
    assert [json.loads(line)["index"] for line in answers.read_text().splitlines()] == [0, 1]


def test_a_run_stopped_before_its_first_answer_does_not_file_later_answers_under_its_settings(
        tmp_path, monkeypatch, capsys, target_model):
    """A run stopped after writing its settings record but before its first answer (the method's setup times the cost
    curve: seconds) left that record; the next run, with another answer length, then filed its answers under it, and
    a third with the first settings reused them. The record is now written afresh while there are no answers, so the
    third run is refused as made with other settings. Without --prompts, the shipped prompts are used (it was a
    traceback)."""
    import jointspec.api as api
    from jointspec.cli.main import main

    build_corpus_on(monkeypatch, target_model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("question one here\nquestion two here\n")
    out, data = tmp_path / "table", tmp_path / "data"

    def run(length):
        return main(["build-corpus", "--max-new-tokens", length, "--min-count", "1", "--no-progress", "--out",
                     str(out), "--data", str(data), "--prompts", str(prompts)])

    real = api.Pipeline

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(api, "Pipeline", stopped)
    assert run("4") == 130
    monkeypatch.setattr(api, "Pipeline", real)
    assert run("8") == 0
    assert json.loads((data / "answers.json").read_text())["max_new_tokens"] == 8
    capsys.readouterr()
    assert run("4") == 2 and "differing: max_new_tokens" in capsys.readouterr().err
    assert main(["build-corpus", "--max-new-tokens", "2", "--num-prompts", "2", "--min-count", "1", "--no-progress",
                 "--out", str(tmp_path / "shipped")]) == 0
    assert json.loads((tmp_path / "shipped" / "data" / "answers.json").read_text())["prompts"] == ["train:default"]


def test_a_failed_start_leaves_no_folders(tmp_path, monkeypatch, capsys, target_model):
    from jointspec.cli.main import main

    build_corpus_on(monkeypatch, target_model)
    out = tmp_path / "table"
    assert main(["build-corpus", "--prompts", str(tmp_path / "missing.txt"), "--out", str(out), "--no-progress"]) == 2
    assert not out.exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["build-corpus", "--prompts", "train:default", "--out", str(blocker / "t"), "--no-progress"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_prompt_the_context_cannot_hold_is_left_out_not_the_end_of_the_run(tmp_path, monkeypatch, capsys,
                                                                              target_model):
    """A prompt as long as the target's context (256 here) stopped the whole run with a context error; it is now left
    out, as one over --max-prompt-tokens is, and the run says so. (train:default's source-code prompts depend on the
    Python version: on 3.14 one such prompt came second in the seeded order.) And train-draft's data builder cuts its
    prompts to the context: a longer one ended that run too."""
    from jointspec.backends.hf import CausalLM
    from jointspec.cli.main import main
    from jointspec.train.data import build_data, load_shards, read_spec

    build_corpus_on(monkeypatch, target_model)
    context = target_model.config.max_position_embeddings
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("short question one\n" + "x" * (context + 40) + "\nshort question two\n")
    out, data = tmp_path / "table", tmp_path / "data"
    code = main(["build-corpus", "--prompts", str(prompts), "--max-new-tokens", "3", "--min-count", "1",
                 "--no-progress", "--out", str(out), "--data", str(data)])
    assert code == 0
    assert f"1 of 3 prompts left out: over {context - 1} tokens" in capsys.readouterr().err
    assert json.loads((out / CONFIG_FILE).read_text())["num_target_answers"] == 2
    folder = build_data(CausalLM(target_model), None, [[5] * (context + 40), [6, 7]], tmp_path / "train",
                        max_new_tokens=4, max_length=1024, shard_size=4, batch_size=2, progress=False)
    assert read_spec(folder)["max_length"] == context
    (shard,) = load_shards(folder)
    sizes = (shard["starts"][1:] - shard["starts"][:-1]).tolist()
    assert sizes == [context, 2 + 4]  # the long prompt cut to context - 1 tokens and one answer token; the other whole
