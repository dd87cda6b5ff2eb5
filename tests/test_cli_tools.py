"""The command line around the core commands: ``--version``, the errors a missing extra gives, and the tools that
read a finished run or a trained head (``bench-intervals``, ``head-agreement --record``, ``corpus-replay``).

Everything runs in process on conftest's tiny Llama with the word-level tokenizer of helpers.py, injected through
each subcommand's ``load_target`` seam. One tiny bench run (8 prompts: the fewest that get intervals) is shared by the
tests that read a results.json; it runs with matplotlib hidden, as an install without the ``bench`` extra would.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.cli import bench as bench_cli
from jointspec.cli import corpus_replay as corpus_replay_cli
from jointspec.cli import head_agreement as head_agreement_cli
from jointspec.cli import main as cli

from helpers import VOCAB, WORDS, run_cli, tiny_tokenizer

# Eight prompts in two categories; one has a second turn, so replays see two turns.
PROMPTS = [{"question_id": f"q{i}", "category": "summary" if i % 2 else "code",
            "turns": [f"please {WORDS[i]} the {WORDS[10 + i]} text with {WORDS[20 + i]} words"]
            + (["now make it one short line"] if i == 0 else [])} for i in range(8)]


def tiny_loader(target_model):
    """A ``load_target`` stand-in: the tiny target (the name its trained heads record) and the word tokenizer."""
    tokenizer = tiny_tokenizer()
    return lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), tokenizer)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "questions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    return path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, target_model, prompt_file):
    """``jointspec bench`` of ar and pld on the 8 prompts with matplotlib hidden: (report folder, code, stderr)."""
    folder = tmp_path_factory.mktemp("bench") / "report"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr(bench_cli, "load_target", tiny_loader(target_model))
        patch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
        code = cli.main(["bench", "--no-progress", "--no-warmup", "--no-cost-model", "--prompts", str(prompt_file),
                         "--methods", "ar,pld:n=4", "--max-new-tokens", "10", "--report-dir", str(folder)])
    return folder, code, err.getvalue()


def test_version_prints_the_installed_version(capsys):
    import re

    import jointspec

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    declared = re.search(r'^version\s*=\s*"([^"]+)"', pyproject, re.MULTILINE).group(1)
    try:
        installed = metadata.version("jointspec")
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH, as on the GPU machine
        installed = declared
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out == f"jointspec {installed}\n"
    assert jointspec.__version__ == installed == declared


def test_importing_the_package_imports_nothing_else():
    code = ("import sys, jointspec; "
            "print(sorted(m for m in sys.modules if m.startswith(('jointspec', 'torch', 'transformers'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['jointspec']"


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["bogus"]])
def test_help_and_a_mistyped_command_import_neither_torch_nor_transformers(argv):
    """The parser of the command a run asks for is built alone: `jointspec --help` answers in a fraction of a second
    instead of after torch's and transformers' imports."""
    code = ("import sys\nfrom jointspec.cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout + run.stderr
    if argv == ["bogus"]:
        assert "invalid choice: 'bogus'" in run.stderr and "'generate'" in run.stderr


def test_each_commands_own_parser_is_the_full_parsers():
    """A run builds only its command's options; they are the options the whole parser gives that command, and every
    command's summary is listed either way."""
    from jointspec.cli.commands import COMMANDS

    def options(parser, name):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert sorted(sub.choices) == sorted(COMMANDS)
        return [(a.dest, tuple(a.option_strings), a.default, a.choices, a.help) for a in sub.choices[name]._actions]

    full = cli.build_parser()
    for name in COMMANDS:
        assert options(cli.build_parser(name), name) == options(full, name), name
    assert len(options(cli.build_parser(""), "bench")) == 1  # only -h until bench is the command


def test_each_commands_help_gives_its_own_defaults():
    """``SUBCOMMAND --help`` ends an option's help with the default that command runs with (``set_defaults``
    included), once, and says nothing where the default is None or a flag's False."""
    def help_text(name: str) -> str:
        sub = next(a for a in cli.build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        return " ".join(sub.choices[name].format_help().split("options:")[1].split())  # unwrapped, past the usage

    serve, bench, generate = help_text("serve"), help_text("bench"), help_text("generate")
    assert "quantised target (default: auto)" in serve and "quantised target (default: none)" in bench
    assert "port to listen on (default: 8000)" in serve
    assert "(default: default)" in generate.split("--method METHOD")[1].split("--draft")[0]
    assert "new tokens at most (default: 128)" in generate
    assert "(default: None)" not in generate and "(default: False)" not in generate
    # A help that already gives its default is left as it is.
    assert "(default 64) (default" not in serve and "(default 64)" in serve


def test_no_commands_help_shows_docstring_markup():
    """Two commands' --help showed their module docstrings' first lines, RST and all (``jointspec build-corpus``)."""
    from jointspec.cli.commands import COMMANDS

    for name in COMMANDS:
        sub = next(a for a in cli.build_parser(name)._actions if isinstance(a, argparse._SubParsersAction))
        text = sub.choices[name].format_help()
        assert not any(mark in text for mark in ("``", ":class:", ":func:", ":data:", ":mod:")), name


def test_serve_without_its_extra_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    code, _, err = run_cli(capsys, "serve")
    assert code == 2
    assert err.startswith("jointspec: error: `jointspec serve` needs the serve extra: pip install 'jointspec[serve]'")
    assert err.count("\n") == 1


def test_bench_without_matplotlib_writes_the_report_and_skips_plots(bench_run):
    folder, code, err = bench_run
    assert code == 0, err
    assert {path.name for path in folder.iterdir()} == {"report.md", "results.json"}
    notes = [line for line in err.splitlines() if "plots" in line]
    assert notes == [("jointspec bench: no plots: they need matplotlib, the bench extra (pip install "
                      "'jointspec[bench]')")]


def test_bench_intervals_between_two_methods(bench_run, capsys):
    folder, _, _ = bench_run
    code, out, err = run_cli(capsys, "bench-intervals", str(folder / "results.json"), "pld", "ar")
    assert code == 0, err
    comparison = json.loads(out.splitlines()[-1])
    assert (comparison["method"], comparison["reference"], comparison["num_prompts"]) == ("pld:n=4", "ar", 8)
    speedup = comparison["speedup"]
    assert speedup["interval"][0] <= speedup["ratio"] <= speedup["interval"][1]
    # pld is lossless: the same tokens, so the same log-probabilities on every prompt and a point interval at 1.
    assert comparison["perplexity_ratio"] == {"ratio": 1.0, "interval": [1.0, 1.0], "excludes_1": False}
    # The same pair as the bench's own report (its times unrounded, the file's to 0.1 ms).
    summary = json.loads((folder / "results.json").read_text())["methods"]["pld:n=4"]
    assert speedup["ratio"] == pytest.approx(summary["speedup"], rel=0.05)
    assert out.splitlines()[0] == "pld:n=4 against ar, 8 prompts"
    # After the prompt too, as the report's "decode x" with its interval (both engines time prompt reading apart).
    decode = comparison["decode_speedup"]
    assert decode["ratio"] == pytest.approx(summary["decode_speedup"], rel=0.02)  # the file's times: to 0.1 ms
    assert decode["interval"] == pytest.approx(summary["decode_speedup_interval"], rel=0.05)


def test_bench_intervals_names_a_method_the_run_does_not_have(bench_run, capsys):
    folder, _, _ = bench_run
    code, out, err = run_cli(capsys, "bench-intervals", str(folder / "results.json"), "mtad", "ar")
    assert code == 2 and out == ""
    assert err == "jointspec: error: 'mtad' matches 0 of the run's methods; the run has: ar, pld:n=4\n"
    code, _, err = run_cli(capsys, "bench-intervals", str(folder / "nope.json"), "pld", "ar")
    assert code == 2 and err.startswith("jointspec: error: cannot read ") and "nope.json" in err


def test_bench_intervals_pools_shards_into_the_whole_runs_comparison(bench_run, capsys, tmp_path):
    """A run split by prompts into two files (as shards would write them) pools back to the whole run's answer."""
    folder, _, _ = bench_run
    whole = json.loads((folder / "results.json").read_text())
    shards = []
    for name, keep in (("a", {0, 2, 4, 6}), ("b", {1, 3, 5, 7})):
        # Each shard numbers its prompts from 0, as a run of only those prompts does.
        renumber = {index: i for i, index in enumerate(sorted(keep))}
        runs = [{**run, "prompt_index": renumber[run["prompt_index"]]}
                for run in whole["runs"] if run["prompt_index"] in keep]
        shards.append(tmp_path / f"{name}.json")
        shards[-1].write_text(json.dumps({**whole, "runs": runs}))
    code, out, err = run_cli(capsys, "bench-intervals", str(folder / "results.json"), "pld", "ar")
    assert code == 0, err
    code, pooled_out, err = run_cli(capsys, "bench-intervals", *map(str, shards), "pld", "ar")
    assert code == 0, err
    pooled, alone = json.loads(pooled_out.splitlines()[-1]), json.loads(out.splitlines()[-1])
    assert pooled["num_prompts"] == 8
    # The same prompts in another order: the same ratio; the resampling draws other prompts, so only close bounds.
    assert pooled["speedup"]["ratio"] == pytest.approx(alone["speedup"]["ratio"], rel=1e-9)
    assert pooled["perplexity_ratio"] == alone["perplexity_ratio"]
    # The same shard twice holds the same prompts twice: refused, naming the prompt and both files.
    code, _, err = run_cli(capsys, "bench-intervals", str(shards[0]), str(shards[0]), "pld", "ar")
    assert code == 2 and "prompt 'q0' (code) is in both" in err and err.count(str(shards[0])) == 2
    # Other sampling settings are another experiment: refused, naming the setting.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(shards[1].read_text()),
                                 "config": {**whole["config"], "temperature": 0.7}}))
    code, _, err = run_cli(capsys, "bench-intervals", str(shards[0]), str(other), "pld", "ar")
    assert code == 2 and "temperature=0.7" in err and "only runs with the same settings pool" in err
    # So are another target (its model, its quantisation) and a method run with other settings.
    second = json.loads(shards[1].read_text())
    others = {"quantize": {**second, "config": {**whole["config"], "quantize": "int4"}},
              "model": {**second, "environment": {**whole["environment"], "model": "another"}},
              "settings": {**second, "settings": {**whole["settings"],
                                                  "pld:n=4": {**whole["settings"]["pld:n=4"], "num_draft_tokens": 2}}}}
    for what, results in others.items():
        other.write_text(json.dumps(results))
        code, _, err = run_cli(capsys, "bench-intervals", str(shards[0]), str(other), "pld", "ar")
        assert code == 2 and {"quantize": "quantize='int4'", "model": "ran model 'another'",
                              "settings": "ran 'pld:n=4' with other settings than"}[what] in err, (what, err)
    # One model kept at another path on another machine is the same target: those shards pool.
    for path in ("/home/a/models/tiny", "/srv/b/tiny"):
        other.write_text(json.dumps({**second, "environment": {**whole["environment"], "model": path}}))
        (tmp_path / "first.json").write_text(json.dumps({**json.loads(shards[0].read_text()), "environment": {
            **whole["environment"], "model": "/home/a/models/tiny"}}))
        code, _, err = run_cli(capsys, "bench-intervals", str(tmp_path / "first.json"), str(other), "pld", "ar")
        assert code == 0, err
    # A method against itself is no comparison.
    code, _, err = run_cli(capsys, "bench-intervals", str(folder / "results.json"), "pld", "pld")
    assert code == 2 and "both names pick 'pld:n=4'" in err


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory, target_model):
    """An EAGLE head trained briefly for the tiny target on its own greedy continuations of 24 random prompts."""
    from jointspec.train.data import build_data
    from jointspec.train.heads import HeadTrainConfig, HeadTrainer

    target = CausalLM(target_model, name="tiny-target")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (8,), generator=generator).tolist() for _ in range(24)]
    data = build_data(target, None, prompts, tmp_path_factory.mktemp("data"), max_new_tokens=24, max_length=64,
                      shard_size=12, batch_size=8)
    out = tmp_path_factory.mktemp("head")
    config = HeadTrainConfig(draft_vocab_size=None, epochs=15, batch_tokens=512, learning_rate=3e-3,
                             warmup_steps=5, eval_every=20, patience=100, eval_fraction=0.1)
    HeadTrainer(target, config).train(data, out, progress=False)
    return out


def test_head_agreement_records_top_w_hit_rates(trained_head, target_model, prompt_file, monkeypatch, capsys):
    from jointspec.methods.tree_width import top_w_hit_rate

    monkeypatch.setattr(head_agreement_cli, "load_target", tiny_loader(target_model))
    before = json.loads((trained_head / "draft.json").read_text())
    assert "measured" not in before
    code, out, err = run_cli(capsys, "head-agreement", "--sets", str(prompt_file), "--num-prompts", "6",
                             "--max-new-tokens", "16", "--record", str(trained_head))
    assert code == 0, err
    assert f"target answers ({prompt_file}): 100%" in err  # the bar over the target's answers
    row = json.loads(out.splitlines()[-1])[str(trained_head)][str(prompt_file)]
    after = json.loads((trained_head / "draft.json").read_text())
    rates = after["measured"]["top_w_hit_rate"]
    assert set(rates) == {"1", "2", "3"}
    assert 0.0 <= rates["1"] <= rates["2"] <= rates["3"] <= 1.0 and rates["3"] > 0.0
    # One set: the recorded rates are that set's top-1/2/3 shares, over the positions it scored.
    assert [rates["1"], rates["2"], rates["3"]] == [row["depth1"], row["depth1_top2"], row["depth1_top3"]]
    assert row["tokens"] > 50 and "6 prompts" in after["measured"]["how"]
    assert (after["config"], after["training"]) == (before["config"], before["training"])
    assert sorted(path.name for path in trained_head.iterdir() if "draft.json" in path.name) == ["draft.json"]
    # What `default` and `hybrid-tree` size their tree by now reads the measurement.
    assert top_w_hit_rate(str(trained_head)) == {int(w): rate for w, rate in rates.items()}


def test_head_agreement_refuses_to_record_what_it_does_not_measure(tmp_path, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load for a refused request")

    monkeypatch.setattr(head_agreement_cli, "load_target", no_model)
    (tmp_path / "draft.json").write_text(json.dumps({"config": {"kind": "medusa"}}))
    code, _, err = run_cli(capsys, "head-agreement", "--record", str(tmp_path))
    assert code == 2 and "--record writes top-w hit rates" in err and "'medusa' draft" in err
    code, _, err = run_cli(capsys, "head-agreement", str(tmp_path / "missing"))
    assert code == 2 and "holds no readable draft.json" in err


def test_head_agreement_records_nothing_it_did_not_measure(trained_head, target_model, prompt_file, tmp_path,
                                                           monkeypatch, capsys):
    """Answers of one token score no position, and an empty set or list of sets scores nothing: --record wrote hit
    rates of 0 % (what default sizes its tree by) over 0 tokens. Refused now, the head's draft.json untouched; the
    empty sets before the model loads."""
    import shutil

    head = tmp_path / "head"
    shutil.copytree(trained_head, head)
    before = (head / "draft.json").read_text()
    monkeypatch.setattr(head_agreement_cli, "load_target", tiny_loader(target_model))
    code, _, err = run_cli(capsys, "head-agreement", "--sets", str(prompt_file), "--num-prompts", "2",
                           "--max-new-tokens", "1", "--record", str(head))
    assert code == 2 and "no answer position was scored" in err, err
    assert (head / "draft.json").read_text() == before
    monkeypatch.setattr(head_agreement_cli, "load_target", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "empty.jsonl").write_text("")
    for sets, reason in ((",", "names no prompt set"), (str(tmp_path / "empty.jsonl"), "holds no prompts")):
        code, _, err = run_cli(capsys, "head-agreement", "--sets", sets, "--record", str(head))
        assert code == 2 and reason in err, err


def test_corpus_replay_ranks_a_table_of_the_answers_above_an_unrelated_one(bench_run, target_model, prompt_file,
                                                                         tmp_path, monkeypatch, capsys):
    from jointspec.drafters.corpus import NgramTable

    folder, _, _ = bench_run
    results = json.loads((folder / "results.json").read_text())
    answers = [answer for run in results["runs"] if run["method"] == "ar" for answer in run["output_ids"]]
    NgramTable.build(answers, VOCAB, max_order=3, min_count=1).save(tmp_path / "answers", {})
    NgramTable.build([list(range(3, VOCAB))], VOCAB, max_order=3, min_count=1).save(tmp_path / "unrelated", {})
    monkeypatch.setattr(corpus_replay_cli, "load_target", tiny_loader(target_model))
    code, out, err = run_cli(capsys, "corpus-replay", "--results", str(folder / "results.json"), "--method", "ar",
                             "--prompts", str(prompt_file), str(tmp_path / "answers"), str(tmp_path / "unrelated"))
    assert code == 0, err
    assert f"replaying {tmp_path / 'answers'}: 100%" in err and f"replaying {tmp_path / 'unrelated'}: 100%" in err
    report = json.loads(out.splitlines()[-1])["tables"]
    rates = {name: report[str(tmp_path / name)] for name in ("answers", "unrelated")}
    assert all(len(row["by_turn"]) == 2 and row["tokens_per_cost"] > 0 for row in rates.values())
    assert rates["answers"]["tokens_per_cost"] > rates["unrelated"]["tokens_per_cost"]


def test_corpus_replay_refuses_a_table_of_another_tokenizer_and_a_sampled_run(bench_run, target_model, prompt_file,
                                                                               tmp_path, monkeypatch, capsys):
    """A table built under another tokenizer (same vocabulary size) was replayed and could even rank first, though
    `corpus` refuses it; a sampled run was replayed as if its answers were greedy. Both refused, by name."""
    from jointspec.drafters.corpus import NgramTable, tokenizer_fingerprint

    from helpers import FakeTokenizer

    folder, _, _ = bench_run
    other = FakeTokenizer({f"other{i}": i for i in range(VOCAB)})
    NgramTable.build([list(range(3, VOCAB))], VOCAB, max_order=3, min_count=1).save(
        tmp_path / "other", {"tokenizer_fingerprint": tokenizer_fingerprint(other)})
    monkeypatch.setattr(corpus_replay_cli, "load_target", tiny_loader(target_model))
    args = ["corpus-replay", "--method", "ar", "--prompts", str(prompt_file), str(tmp_path / "other")]
    code, _, err = run_cli(capsys, *args[:1], "--results", str(folder / "results.json"), *args[1:])
    assert code == 2 and "was built under another tokenizer" in err, err
    sampled = json.loads((folder / "results.json").read_text())
    sampled["config"]["temperature"] = 0.8
    (tmp_path / "sampled.json").write_text(json.dumps(sampled))
    code, _, err = run_cli(capsys, *args[:1], "--results", str(tmp_path / "sampled.json"), *args[1:])
    assert code == 2 and "is a sampled run (temperature 0.8)" in err, err


def test_bench_intervals_under_eight_prompts_gives_the_ratio_without_an_interval(bench_run, capsys, tmp_path):
    """Under 8 prompts there is no interval, but the ratio is still the run's (it printed '-' for both and null in the
    JSON): the same pooled ratio as the summed tokens and seconds give."""
    folder, _, _ = bench_run
    whole = json.loads((folder / "results.json").read_text())
    runs = [run for run in whole["runs"] if run["prompt_index"] < 4]
    few = tmp_path / "few.json"
    few.write_text(json.dumps({**whole, "runs": runs}))
    code, out, err = run_cli(capsys, "bench-intervals", str(few), "pld", "ar")
    assert code == 0, err
    comparison = json.loads(out.splitlines()[-1])
    rate = {label: sum(r["num_new_tokens"] for r in runs if r["method"] == label)
            / sum(statistics.median(r["seconds"]) for r in runs if r["method"] == label) for label in ("pld:n=4", "ar")}
    assert comparison["speedup"]["interval"] is None
    assert comparison["speedup"]["ratio"] == pytest.approx(rate["pld:n=4"] / rate["ar"], abs=1e-4)
    assert comparison["perplexity_ratio"] == {"ratio": 1.0, "interval": None, "excludes_1": None}
    assert f"speedup: {comparison['speedup']['ratio']:.3f}" in out and "(no intervals under 8 prompts)" in out
