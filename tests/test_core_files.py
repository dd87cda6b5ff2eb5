"""Files written whole or not at all (jointspec/core/files.py), and what a user reads when a disk is full: the file
named, the reason, the room left, and what was kept; no temporary file left behind. The commands that write drafts,
training data and checkpoints are tested through their own entry points with the write made to fail as a full disk
fails (torch's writer and safetensors' do not say which file). Deterministic: no false-failure odds."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from jointspec.core.errors import JointspecError
from jointspec.core.files import WriteError, cannot_write, replacing
from jointspec.drafts.eagle1 import Eagle1Config, Eagle1Head

from helpers import CausalLM, run_cli, tiny_tokenizer, train_cli_argv, untrained_draft_of

FULL = OSError(errno.ENOSPC, "No space left on device")


def test_a_file_is_replaced_only_once_written_whole(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("old")
    with replacing(path, "the table") as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old" and tmp.parent == tmp_path  # a sibling: the rename stays on one disk
    assert path.read_text() == "new" and sorted(tmp_path.iterdir()) == [path]


TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")  # torch.save's


TORCH_CANNOT_OPEN = RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                                 "Permission denied")  # torch.save in a folder made read-only
SAFETENSORS_OLD = Exception('Error while serializing: IoError(Os { code: 13, kind: PermissionDenied, message: '
                            '"Permission denied" })')  # safetensors before 0.8 (pyproject allows 0.4 on)


@pytest.mark.parametrize("failure", [FULL, TORCH_FULL, TORCH_CANNOT_OPEN, SAFETENSORS_OLD])
def test_a_failed_write_keeps_the_old_file_and_names_what_where_and_why(tmp_path, failure):
    path = tmp_path / "checkpoint.pt"
    path.write_text("old")
    with pytest.raises(WriteError) as raised:
        with replacing(path, "the training checkpoint", "the one before is kept") as tmp:
            tmp.write_text("half of it")
            raise failure
    message = str(raised.value)
    assert message.startswith(f"could not write the training checkpoint '{path}' (")
    assert " ".join(str(failure).split())[:30] in message or "No space left on device" in message
    assert " free there); the one before is kept" in message
    assert raised.value.__cause__ is failure
    assert path.read_text() == "old" and sorted(tmp_path.iterdir()) == [path]


def test_a_user_error_and_ctrl_c_pass_through_and_leave_nothing(tmp_path):
    path = tmp_path / "out.json"
    for stop in (JointspecError("the user's own error"), KeyboardInterrupt()):
        with pytest.raises(type(stop)) as raised:
            with replacing(path, "the report") as tmp:
                tmp.write_text("part")
                raise stop
        assert raised.value is stop
    assert list(tmp_path.iterdir()) == []


def test_the_room_left_is_said_for_a_folder_not_made_yet(tmp_path):
    message = str(cannot_write("the draft", tmp_path / "a" / "b" / "c", FULL))
    assert message.startswith(f"could not write the draft '{tmp_path / 'a' / 'b' / 'c'}' (No space left on device; ")
    assert message.endswith(" free there)")


def full_disk_on(name_part: str, writer):
    """``writer`` (torch.save or safetensors' save_file) failing as on a full disk for paths holding ``name_part``,
    writing part of the file first as the real writers do."""
    def write(obj, path, *args, **kwargs):
        if name_part in str(path):
            with open(path, "wb") as out:
                out.write(b"\0" * 100)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return writer(obj, path, *args, **kwargs)
    return write


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*") if "tmp" in p.name or "partial" in p.name)


def test_train_draft_on_a_full_disk_says_what_was_kept_and_resumes(target_model, tmp_path, monkeypatch, capsys):
    from jointspec.train import data as train_data
    from jointspec.train import heads as train_heads

    argv = train_cli_argv(monkeypatch, target_model, tmp_path, "head")
    real_save = torch.save
    # The data build's shard cannot be written: the folder's record stays, and the next run goes on from it.
    monkeypatch.setattr(train_data.torch, "save", full_disk_on("shard-00000", real_save))
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert f"could not write training data '{tmp_path / 'head' / 'data' / 'shard-00000.pt'}' (" in err
    assert "the files written before are kept: free some room and run the same command again" in err
    assert (tmp_path / "head" / "data" / "data.json").is_file() and not leftovers(tmp_path)
    assert not list((tmp_path / "head" / "data").glob("shard-*"))
    # Training cannot write its checkpoint: the head saved at that evaluation stays, the command says how to go on.
    monkeypatch.setattr(train_data.torch, "save", full_disk_on("checkpoint.pt", real_save))
    assert train_heads.torch is train_data.torch  # (one torch module: the patch covers the checkpoint's writer)
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert f"could not write the training checkpoint '{tmp_path / 'head' / 'checkpoint.pt'}'" in err
    assert "run the same command again to resume from that checkpoint" in err
    assert (tmp_path / "head" / "draft.json").is_file() and not (tmp_path / "head" / "checkpoint.pt").exists()
    assert not leftovers(tmp_path)
    # The head itself cannot be written (safetensors' writer): the same advice.
    import safetensors.torch

    monkeypatch.setattr(train_data.torch, "save", real_save)
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on(".safetensors", safetensors.torch.save_file))
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and "Traceback" not in err
    assert f"could not write the draft '{tmp_path / 'head'}'" in err
    assert "run the same command again to resume from that checkpoint" in err and not leftovers(tmp_path)
    monkeypatch.undo()
    code, out, err = run_cli(capsys, *train_cli_argv(monkeypatch, target_model, tmp_path, "head"))
    assert code == 0, err


def test_an_answer_from_a_server_that_cannot_be_kept_says_so(tmp_path):
    from jointspec.train.server_answers import AnswerCache, ServerAnswer

    path = tmp_path / "server-answers.jsonl"
    cache = AnswerCache(path)
    path.mkdir()  # (where the file should be: appending fails as on a full disk)
    with pytest.raises(WriteError, match="could not write the server's answers .* the answers before this one are "
                                         "kept"):
        cache.add("key", ServerAnswer("text", "stop"), "model")


def test_export_draft_on_a_full_disk_leaves_no_checkpoint(target_model, tmp_path, monkeypatch, capsys):
    import safetensors.torch

    from jointspec.cli import export as export_cli
    untrained_draft_of(Eagle1Head, Eagle1Config, CausalLM(target_model)).save(tmp_path / "head")
    monkeypatch.setattr(export_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tiny_tokenizer()))

    def full(*args, **kwargs):  # safetensors' own words on a full disk
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, _, err = run_cli(capsys, "export-draft", str(tmp_path / "head"), "--format", "vllm-eagle", "--out",
                           str(tmp_path / "vllm"))
    assert code == 2 and "Traceback" not in err
    assert f"could not write the checkpoint '{tmp_path / 'vllm'}' (Error while serializing: I/O error: No space " in err
    assert "nothing of it was left there" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]


def test_build_corpus_on_a_full_disk_keeps_its_answers(tmp_path, monkeypatch, capsys, target_model):
    import numpy as np

    from jointspec.cli import corpus as corpus_cli

    monkeypatch.setattr(corpus_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tiny_tokenizer()))

    def full(*args, **kwargs):
        raise FULL

    monkeypatch.setattr(np, "savez_compressed", full)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"question number {i} about things" for i in range(3)))
    out = tmp_path / "table"
    code, _, err = run_cli(capsys, "build-corpus", "--prompts", str(prompts), "--max-new-tokens", "6", "--min-count",
                           "1", "--no-progress", "--out", str(out))
    assert code == 2 and "Traceback" not in err
    assert f"could not write the n-gram table '{out}' (No space left on device; " in err
    assert "the answers it was built from are kept" in err
    answers = (out / "data" / "answers.jsonl").read_text().splitlines()
    assert len(answers) == 3 and all(json.loads(line)["answer_ids"] for line in answers)
    assert not leftovers(tmp_path) and not (out / "corpus.json").exists()


def test_build_corpus_whose_answers_cannot_be_written_says_so(tmp_path, monkeypatch, capsys, target_model):
    """The answers log's write failing: closing the file flushes again and raised its own OSError over the message."""
    import io
    import pathlib

    from jointspec.cli import corpus as corpus_cli

    monkeypatch.setattr(corpus_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tiny_tokenizer()))

    class Full(io.RawIOBase):  # a file on a full disk: every write fails
        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = pathlib.Path.open

    def open_(self, mode="r", *args, **kwargs):
        if self.name == corpus_cli.ANSWERS_FILE and "a" in mode:
            return io.TextIOWrapper(io.BufferedWriter(Full()))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"question number {i} about things" for i in range(2)))
    code, _, err = run_cli(capsys, "build-corpus", "--prompts", str(prompts), "--max-new-tokens", "6", "--min-count",
                           "1", "--no-progress", "--out", str(tmp_path / "table"))
    assert code == 2 and "Traceback" not in err, err
    assert f"could not write the answers '{tmp_path / 'table' / 'data' / 'answers.jsonl'}' (No space left" in err


def test_a_draft_whose_config_cannot_be_written_keeps_the_folder_as_it_was(target_model, tmp_path, monkeypatch):
    """The weights were renamed into place before the config was written: a failure there paired new weights with
    the old config. And a bug raised while writing is not a full disk: it goes on as it was."""
    import pathlib

    folder = tmp_path / "head"
    untrained_draft_of(Eagle1Head, Eagle1Config, CausalLM(target_model), seed=0).save(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real_write = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if self.name.startswith("draft") and self.suffix == ".json":  # (the config, under its temporary name)
            raise FULL
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(WriteError, match="could not write the draft .* what the folder held before is kept"):
        untrained_draft_of(Eagle1Head, Eagle1Config, CausalLM(target_model), seed=1).save(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before

    def bug(self, *args, **kwargs):
        raise TypeError("Object of type set is not JSON serializable")

    monkeypatch.setattr(pathlib.Path, "write_text", bug)
    with pytest.raises(TypeError, match="not JSON serializable"):
        untrained_draft_of(Eagle1Head, Eagle1Config, CausalLM(target_model), seed=1).save(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    with pytest.raises(ValueError, match="a bug"):  # replacing() too: only a failure to write is reported as one
        with replacing(tmp_path / "x.json", "the record") as tmp:
            tmp.write_bytes(b"part")
            raise ValueError("a bug")
    assert not (tmp_path / "x.json").exists() and not list(tmp_path.glob("x.json.tmp*"))


def test_an_oserror_of_the_decoding_is_not_reported_as_the_answers_log(tmp_path):
    """build-corpus's guard around its answers log tells a failure to write from an OSError raised while decoding."""
    from types import SimpleNamespace

    from jointspec.cli import corpus as corpus_cli

    class Failing:
        def generate_ids(self, ids, config):
            raise OSError(errno.EIO, "the backend's own error")

    with pytest.raises(OSError, match="the backend's own error"):
        corpus_cli._target_answers([[5, 6]], {"a": 1}, tmp_path, Failing(), None, progress_bar=False)

    class Answering:
        def generate_ids(self, ids, config):
            return SimpleNamespace(token_ids=[1, 2, 3])

    answers = corpus_cli._target_answers([[5, 6]], {"a": 1}, tmp_path, Answering(), None, progress_bar=False)
    assert answers == [[1, 2, 3]]


def test_recorded_hit_rates_keep_the_config_and_its_mode_or_leave_it_as_it_was(tmp_path, monkeypatch):
    """head-agreement --record rewrites a head's draft.json: whole, with the file's own mode, or not at all."""
    import os
    import pathlib

    from jointspec.bench.head_agreement import record_top_w_hit_rate

    config = tmp_path / "draft.json"
    config.write_text(json.dumps({"kind": "eagle", "measured": {"note": "kept"}}))
    os.chmod(config, 0o640)
    record_top_w_hit_rate(tmp_path, {2: 0.5, 1: 0.25}, "by hand")
    meta = json.loads(config.read_text())
    assert meta == {"kind": "eagle", "measured": {"note": "kept", "top_w_hit_rate": {"1": 0.25, "2": 0.5},
                                                   "how": "by hand"}}
    assert config.stat().st_mode & 0o777 == 0o640 and sorted(tmp_path.iterdir()) == [config]

    before = config.read_bytes()
    real_write = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        real_write(self, "{\"half", encoding="utf-8")
        raise FULL

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(WriteError, match=f"could not write the head's draft.json '{config}' .*; it is as it was"):
        record_top_w_hit_rate(tmp_path, {1: 0.75}, "again")
    assert config.read_bytes() == before and sorted(tmp_path.iterdir()) == [config]
