"""Commands that write folders or listen on a port refuse what they could not do before any work, and say what to pass
instead: an output path that is a file or under one, a port outside 1-65535 or already taken, an export into a
format that does not hold the draft, prompt files that reuse a question id. No model is needed for any of these
refusals (they come before loading), so the tests are deterministic and fast.
"""

from __future__ import annotations

import json
import socket

import pytest

from jointspec.cli.options import check_output_folder
from jointspec.core.errors import UnsupportedOptionError

from helpers import assert_clean_error, run_cli


def test_check_output_folder_refuses_files_in_the_way_and_creates_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(UnsupportedOptionError, match="is a file, not a folder"):
        check_output_folder(blocker, "--out")
    with pytest.raises(UnsupportedOptionError, match="'.*a-file' is a file"):
        check_output_folder(blocker / "deeper" / "out", "--out")
    check_output_folder(tmp_path / "new" / "out", "--out")  # fine, and nothing made
    assert not (tmp_path / "new").exists()
    for empty in ("", "  "):  # the current folder, unasked: its files would be written among the user's own
        with pytest.raises(UnsupportedOptionError, match="--report-dir is empty; pass a folder path"):
            check_output_folder(empty, "--report-dir")
    monkeypatch.setattr("os.access", lambda path, mode: False)  # this suite may run as root, who may write anywhere
    with pytest.raises(UnsupportedOptionError, match="no permission"):
        check_output_folder(tmp_path / "out", "--report-dir")


def test_bench_refuses_a_report_dir_it_could_not_write_before_running(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    # No model at that path: the refusal comes before anything loads or runs.
    code, _, err = run_cli(capsys, "bench", "--model", str(tmp_path / "no-model"), "--methods", "ar",
                           "--report-dir", str(blocker), "--no-progress")
    assert_clean_error(code, err, "jointspec: error:", "--report-dir", "is a file")


@pytest.mark.parametrize("flags", [["--beam-width", "8"], ["--tree", "4,2,2"], ["--draft", "self"]])
def test_bench_refuses_a_shared_option_no_method_of_it_reads(capsys, tmp_path, flags):
    # Accepted, every row ignored it. No model at that path: the refusal comes before anything loads.
    code, _, err = run_cli(capsys, "bench", "--model", str(tmp_path / "no-model"), "--methods", "ar,pld", *flags,
                           "--no-progress")
    assert_clean_error(code, err, "jointspec: error:", flags[0], "(ar, pld)", "would be ignored")


def test_train_draft_names_the_option_the_user_passed(capsys, tmp_path):
    """With --data-only and no --data, the data folder is --out's: an --out that is a file was refused as
    "--data 'FILE/data' cannot be made", an option the user never passed."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    code, _, err = run_cli(capsys, "train-draft", "--target", str(tmp_path / "no-model"), "--data-only", "--out",
                           str(blocker))
    assert_clean_error(code, err, "jointspec: error:", "--out", "is a file")
    assert "--data" not in err


def test_bench_takes_a_shared_option_one_of_its_methods_reads(capsys, tmp_path):
    code, _, err = run_cli(capsys, "bench", "--model", str(tmp_path / "no-model"), "--methods", "ar,spectr",
                           "--beam-width", "3", "--no-progress")
    assert code != 0 and "would be ignored" not in err and "no-model" in err  # it got as far as loading


def test_export_names_the_format_it_was_asked_for(capsys, tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "draft.json").write_text(json.dumps({"config": {"kind": "eagle"}}))
    code, _, err = run_cli(capsys, "export-draft", str(head), "--format", "medusa", "--out", str(tmp_path / "x"))
    assert_clean_error(code, err, "jointspec: error:", "as medusa", "Medusa heads")
    assert not (tmp_path / "x").exists()


def test_serve_refuses_a_port_out_of_range_and_one_in_use_before_loading():
    from jointspec.cli.serve import check_address_free, port_number

    with pytest.raises(Exception, match="1-65535"):
        port_number("99999")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(Exception, match=f"cannot listen on 127.0.0.1:{port}.*--port"):
            check_address_free("127.0.0.1", port)
    check_address_free("127.0.0.1", port)  # free again once closed


def test_prompt_sets_that_reuse_a_question_id_are_refused(tmp_path):
    from jointspec.bench.prompts import PromptSetError, load_prompt_sets, load_prompts

    row = {"question_id": 1, "category": "x", "turns": ["Write a haiku about rain"]}
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps(row) + "\n" + json.dumps(row | {"turns": ["List three primes"]}) + "\n")
    with pytest.raises(PromptSetError, match="twice.jsonl:2: question_id 1 is also at .*twice.jsonl:1"):
        load_prompts(str(twice))
    one, other = tmp_path / "one.jsonl", tmp_path / "other.jsonl"
    one.write_text(json.dumps(row) + "\n")
    other.write_text(json.dumps(row | {"category": "y"}) + "\n")
    with pytest.raises(PromptSetError, match="other.jsonl: question_id 1 is also at .*one.jsonl"):
        load_prompt_sets([str(one), str(other)])
    assert len(load_prompt_sets(["builtin:mt_bench", "builtin:grounded"])) > 80  # the built-in sets do not collide


def test_a_trained_draft_on_a_target_without_features_is_refused_by_name(tmp_path):
    # The llama.cpp adapter exposes no hidden states (nor weights to check a draft against): a head folder there
    # used to fail deep in binding with an AttributeError.
    from types import SimpleNamespace

    from jointspec.core.target import TargetCapabilities
    from jointspec.methods import MethodConfig
    from jointspec.methods.registry import MethodContext

    head = tmp_path / "head"
    head.mkdir()
    (head / "draft.json").write_text(json.dumps({"config": {"kind": "eagle"}}))
    target = SimpleNamespace(name="a llama.cpp target", capabilities=TargetCapabilities())
    context = MethodContext(MethodConfig(name="sps", draft=str(head)), target, None, lambda source: None)
    with pytest.raises(UnsupportedOptionError, match="trained draft.*--backend torch"):
        context.draft_model()


def test_the_log_level_is_read_in_either_case_and_a_wrong_one_is_refused_in_a_line(capsys, monkeypatch):
    """JOINTSPEC_LOG=debug (lower case, as cli.md spells it) ended every command in logging's ValueError."""
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # (basicConfig configures only a root without handlers)
    monkeypatch.setattr(root, "level", root.level)
    monkeypatch.setenv("JOINTSPEC_LOG", "debug")
    code, out, _ = run_cli(capsys, "methods")
    assert code == 0 and "ar" in out and root.level == logging.DEBUG
    for level in ("", "warn", " Info "):  # set but empty: the default; logging's own other names
        monkeypatch.setenv("JOINTSPEC_LOG", level)
        assert run_cli(capsys, "methods")[0] == 0, level
    monkeypatch.setenv("JOINTSPEC_LOG", "verbose")
    code, _, err = run_cli(capsys, "methods")
    assert_clean_error(code, err, "JOINTSPEC_LOG='verbose' is not a log level", "DEBUG, INFO, WARNING")
