"""`jointspec train-draft` end to end on the tiny target (patched in through the command's ``load_target``): it trains
and saves a head whose artifact records how it was made, resumes instead of redoing, and refuses bad options with one
line. (Options of the other kinds are tested with each kind: test_drafts_*.py.)

Seeded and deterministic on one thread: no false-failure odds.
"""

from __future__ import annotations

import pytest

from jointspec.drafts.eagle import load_head

from helpers import train_cli_argv


def test_train_draft_cli_end_to_end_and_resume(target_model, tmp_path, monkeypatch, capsys):
    """The command trains and saves a head, and a second run with the same options resumes instead of redoing."""
    import json

    from jointspec.cli import main as cli

    base = train_cli_argv(monkeypatch, target_model, tmp_path, "head")
    argv = base + ["--cls-weight", "1.5", "--cls-fraction", "1"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["best"]["agreement"] and summary["size_bytes"] > 0
    head, training = load_head(tmp_path / "head")
    assert head.config.draft_vocab_size == 50 and head.config.target_name == "tiny-target"
    # The artifact says how it was made: the settings, and a command with every training option in it.
    assert training["settings"]["draft_vocab_size"] == 50 and training["settings"]["epochs"] == 3
    assert training["settings"]["cls_weight"] == 1.5 and training["settings"]["cls_fraction"] == 1.0
    assert training["command"].startswith("jointspec train-draft --target default --kind heads")
    assert "--draft-vocab 50" in training["command"] and "--no-progress" not in training["command"]
    assert "--cls-weight 1.5 --cls-fraction 1.0" in training["command"]
    shards = sorted((tmp_path / "head" / "data").glob("shard-*.pt"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    assert cli.main(argv) == 0  # resumes: the data is kept, the finished checkpoint is reused
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    # A head of one kind cannot start another kind: a clear one-line error, before any work.
    assert cli.main(base + ["--head", "hydra", "--init", str(tmp_path / "head")]) == 2
    assert "holds a 'eagle' draft, which cannot start a hydra draft" in capsys.readouterr().err
    for bad, message in (("0", "must be in (0, 1], got 0"), ("1.5", "must be in (0, 1], got 1.5"),
                         ("x", "expected a number, got 'x'")):
        with pytest.raises(SystemExit):
            cli.main(base + ["--cls-fraction", bad])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("bad, refusal", [
    (["--learning-rate", "0"], "--learning-rate: must be a finite number > 0, got 0"),
    (["--learning-rate=-1e-3"], "--learning-rate: must be a finite number > 0"),
    (["--batch-tokens", "8"], "--batch-tokens: must be at least 16, got 8"),
    (["--max-minutes", "0"], "--max-minutes: must be a finite number > 0, got 0"),
    (["--draft-vocab", "1"], "--draft-vocab must be 0 (the full vocabulary) or at least 2, got 1"),
    (["--head", "eagle3", "--layers", "2"], "--layers 2: an EAGLE-3 head has one decoder layer"),
])
def test_bad_training_settings_are_refused_before_the_target_loads(target_model, tmp_path, monkeypatch, capsys, bad,
                                                                     refusal):
    from jointspec.cli import main as cli
    from jointspec.cli import train as train_cli

    argv = train_cli_argv(monkeypatch, target_model, tmp_path, "out") + bad

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr(train_cli, "load_target", no_load)
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    assert refusal in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
