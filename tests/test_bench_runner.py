"""`jointspec bench` end to end on tiny in-process models (``jointspec.bench.runner`` and the command): the JSON
contract and the report folder, losslessness of every lossless method against the baseline, and the oracle's known
acceptance. Prompt files and method specs are tested in test_bench_prompts.py and test_bench_specs.py.

The target is conftest's tiny Llama (vocab 99, sharpened logits, so greedy ties are vanishingly rare) with a
word-level tokenizer over 99 ids and a minimal chat template, injected through ``cli.bench.load_target``. Settings:
``max_new_tokens=12`` gives several rounds of 4-token drafts per turn while keeping the two-turn conversations far
inside the model's 256 positions; the cost model is measured with 2 repeats only (it is timed, not checked here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.bench.prompts import BenchPrompt, load_prompts
from jointspec.bench.report import CONTRACT_KEYS
from jointspec.cli import bench as bench_cli
from jointspec.cli import main as cli

from helpers import WORDS, run_tiny


@pytest.fixture()
def bench_main(monkeypatch, target_model, bench_tokenizer, capsys):
    """Run ``jointspec bench ...`` in process on the tiny target; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(bench_cli, "load_target",
                        lambda *args, **kwargs: (CausalLM(target_model, name="tiny-target"), bench_tokenizer))

    def main(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["bench", "--no-progress", *argv])
        out, err = capsys.readouterr()
        return code, out, err
    return main


def test_cli_errors_are_one_line(bench_main, bench_prompt_file, tmp_path):
    code, out, err = bench_main("--prompts", str(bench_prompt_file), "--methods", "ar,warp")
    assert code == 2 and err.startswith("jointspec: error: unknown method 'warp'") and err.count("\n") == 1
    code, out, err = bench_main("--prompts", str(bench_prompt_file), "--methods", "ar", "--baseline", "warp")
    assert code == 2 and err.startswith("jointspec: error: --baseline: unknown method 'warp'")  # names the option
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n{oops\n')
    code, out, err = bench_main("--prompts", str(bad))
    assert code == 2 and f"{bad}:1: missing key(s) category, turns" in err


@pytest.mark.parametrize("argv, message", [
    (["--methods", "ar,hf-pld:n=0"], "num_draft_tokens=0 in 'hf-pld:n=0' must be a whole number >= 1"),
    (["--methods", "ar,hf-pld:max_ngram=0"], "max_ngram=0 in 'hf-pld:max_ngram=0' must be a whole number >= 1"),
    (["--methods", "ar,hf-assisted:draft=self,schedule=bogus"], "schedule=bogus in .* must be one of: constant"),
    (["--methods", "ar,hf-assisted:draft=self,confidence=2"], r"confidence=2 in .* must be a number in \[0, 1\]"),
    (["--methods", "ar,hf-assisted"], "'hf-assisted' needs a draft model"),
    (["--methods", "ar,llamacpp", "--temperature", "1"], "'llamacpp' runs greedy only"),
])
def test_bad_reference_rows_are_refused_before_the_model_loads(bench_main, bench_prompt_file, monkeypatch, argv,
                                                               message):
    # transformers would fail at the warm-up, or run another setting than the row's label says (max_ngram 0 as 2).
    # Nor does a first run start compiling the kernels, or wait for them to decide quantize=auto, before the check.
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the methods were checked")

    def no_build(*args, **kwargs):
        raise AssertionError("the kernels were built before the methods were checked")

    monkeypatch.setattr(bench_cli, "load_target", no_load)
    monkeypatch.setattr(bench_cli, "prebuild_kernels", no_build)
    monkeypatch.setattr(bench_cli, "_auto_quantize", no_build)
    code, out, err = bench_main("--prompts", str(bench_prompt_file), *argv)
    assert code == 2 and err.count("\n") == 1
    assert re.search(message, err), err


def test_transformers_rows_stop_at_the_context_as_jointspec_does(bench_main, tmp_path):
    # A prompt 4 tokens short of the tiny model's 256 positions: every row gets the same 4 new tokens at most.
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "long",
                                   "turns": [" ".join(WORDS[i % 40] for i in range(250))]}) + "\n")
    code, out, err = bench_main("--prompts", str(prompts), "--methods", "ar,hf-generate,hf-pld:n=3",
                                "--max-new-tokens", "16", "--no-perplexity", "--no-cost-model",
                                "--baseline", " ar",  # as --methods names it: no second 'ar' row
                                "--report-dir", str(tmp_path / "report"))
    assert code == 0, err
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert results["baseline"] == "ar" and len(results["runs"]) == 3
    runs = {r["method"]: r for r in results["runs"]}
    assert runs["ar"]["num_new_tokens"] < 16
    for name in ("hf-generate", "hf-pld:n=3"):
        assert runs[name]["num_new_tokens"] == runs["ar"]["num_new_tokens"] and runs[name]["identical"], name


def test_cli_json_contract_and_report(bench_main, bench_prompt_file, tmp_path):
    report = tmp_path / "report"
    code, out, err = bench_main("--prompts", str(bench_prompt_file), "--methods", "ar,pld:n=3,hf-generate",
                                "--max-new-tokens", "12", "--repeats", "2", "--report-dir", str(report))
    assert code == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["baseline"] == "ar"
    assert set(last["methods"]) == {"ar", "pld:n=3", "hf-generate"}
    for summary in last["methods"].values():
        assert set(CONTRACT_KEYS) | {"per_category"} == set(summary)
        assert set(summary["per_category"]) == {"summary", "code"}
        assert set(summary["per_category"]["code"]) == set(CONTRACT_KEYS)
        assert summary["num_prompts"] == 3
    assert last["methods"]["ar"]["speedup"] == 1.0
    assert "speedup by category" in out  # the people's table precedes the JSON line
    assert {p.name for p in report.iterdir()} == {"report.md", "results.json", "speedup_by_category.png",
                                                  "accepted_length.png", "speed_vs_perplexity.png"}
    results = json.loads((report / "results.json").read_text())
    assert results["target_cost"]["ms_by_k"]["1"] > 0
    # What each row ran, resolved, and the code it ran: a report read later says what "pld:n=3" meant.
    pld = results["settings"]["pld:n=3"]
    assert pld["method"] == "pld" and pld["num_draft_tokens"] == 3 and pld["quantize"] == "as loaded"
    assert set(pld) >= {"max_ngram", "min_ngram", "cost_aware"} and pld["cost_aware"] is False
    assert results["settings"]["hf-generate"] == {"method": "hf-generate", "options": {}}
    assert "jointspec_commit" in results["environment"]
    text = (report / "report.md").read_text()
    assert "## Columns" in text and "`acc.tok`" in text and "## Rows as run" in text
    drafted = results["methods"]["pld:n=3"]["drafted_per_position"]
    # A round that drafted depth d + 1 drafted depth d too: the counts never grow with depth.
    assert drafted[0] > 0 and all(a >= b for a, b in zip(drafted, drafted[1:]))
    assert len(results["runs"]) == 9 and all(len(r["seconds"]) == 2 for r in results["runs"])
    # Reading the prompt is timed apart where the engine says how long it took (transformers' generate does not).
    assert all((r["prefill_seconds"] is None) == (r["method"] == "hf-generate") for r in results["runs"])
    assert "prompt s" in out and "decode x" in out
    # Each run keeps its answers as text too, per turn, for scorers that read text (jointspec pass-at-k).
    assert all(len(r["output_text"]) == len(r["output_ids"]) and all(isinstance(t, str) for t in r["output_text"])
               for r in results["runs"])
    assert any(text.strip() for r in results["runs"] for text in r["output_text"])
    # Each run keeps its log-probabilities, so any two methods can be compared later (jointspec bench-intervals).
    assert all(r["num_scored_tokens"] == sum(map(len, r["output_ids"])) and r["logprob_sum"] < 0
               for r in results["runs"])
    # distinct-2 recounted from the stored outputs, by hand (not with the library's own distinct_n): per answer,
    # distinct bigrams over bigrams, averaged over the answers of two tokens or more.
    def distinct_bigrams(tokens: list[int]) -> float:
        bigrams = list(zip(tokens, tokens[1:]))
        return len(set(bigrams)) / len(bigrams)

    for method, numbers in results["methods"].items():
        outputs = [out for r in results["runs"] if r["method"] == method for out in r["output_ids"] if len(out) >= 2]
        assert numbers["distinct_2"] == pytest.approx(sum(map(distinct_bigrams, outputs)) / len(outputs), abs=1e-4)
    assert any(distinct_bigrams(out) < 1 for r in results["runs"] for out in r["output_ids"] if len(out) >= 2)
    # The target's own quantisation beside what a row's quantize=auto adds to it (both nothing here).
    assert results["config"]["quantize"] == "none" and results["config"]["auto_quantize"] == "none"


def test_llamacpp_rows_on_a_folder_target_say_they_run_another_model(monkeypatch, capsys, bench_prompt_file,
                                                                      tmp_path):
    # llama.cpp reads GGUF files only: on a folder target its rows ran the embedded default's file, and the report's
    # 0/N identical answers read as if the same model disagreed.
    from jointspec.bench.runner import row_settings
    from jointspec.bench.specs import parse_spec
    from jointspec.methods import MethodConfig

    def stop(*args, **kwargs):
        raise SystemExit(9)
    monkeypatch.setattr(bench_cli, "load_target", stop)
    monkeypatch.setattr(bench_cli, "prebuild_kernels", lambda args: None)
    with pytest.raises(SystemExit):
        cli.main(["bench", "--no-progress", "--model", str(tmp_path), "--prompts", str(bench_prompt_file),
                  "--methods", "ar,llamacpp,pld:backend=llamacpp", "--no-perplexity"])
    err = capsys.readouterr().err
    assert "llamacpp, pld:backend=llamacpp run llama.cpp on the embedded default's GGUF, not on" in err
    assert "--llamacpp-model" in err
    with pytest.raises(SystemExit):  # the model's own GGUF named: nothing to say
        cli.main(["bench", "--no-progress", "--model", str(tmp_path), "--llamacpp-model", "own.gguf",
                  "--prompts", str(bench_prompt_file), "--methods", "ar,llamacpp", "--no-perplexity"])
    assert "warning" not in capsys.readouterr().err
    # --llamacpp-model without a row on llama.cpp would be ignored: refused, before the model loads.
    assert cli.main(["bench", "--no-progress", "--llamacpp-model", "own.gguf", "--prompts", str(bench_prompt_file),
                     "--methods", "ar,pld", "--no-perplexity"]) == 2
    assert "no method of --methods (ar, pld) runs on llama.cpp, so --llamacpp-model" in capsys.readouterr().err
    # A draft path that does not exist: refused before the model loads too (load_target stops the run above).
    assert cli.main(["bench", "--no-progress", "--prompts", str(bench_prompt_file), "--methods",
                     "ar,sps:draft=/no/such/draft", "--no-perplexity"]) == 2
    assert "'sps:draft=/no/such/draft': draft '/no/such/draft' does not exist" in capsys.readouterr().err
    # and each such row names the file it ran in the report's settings
    for text in ("llamacpp", "pld:backend=llamacpp"):
        assert row_settings(parse_spec(text), MethodConfig(), "none", "own.gguf")["model"] == "own.gguf"
    assert "model" not in row_settings(parse_spec("pld"), MethodConfig(), "none", "own.gguf")


def test_the_report_says_what_quantize_auto_loaded(monkeypatch):
    # A `--quantize auto` run's config said auto_quantize 'none' (what a row's auto adds to a target already int4)
    # and nothing of the target's own int4: the report now names what auto decided.
    import argparse

    decided = []
    monkeypatch.setattr(bench_cli, "resolve_quantize", lambda mode, model, **kw: decided.append(mode) or "int4")
    args = argparse.Namespace(quantize="auto", model="default", backend="torch", device="cpu", dtype=None,
                              kernels="auto")
    assert bench_cli._target_quantize(args) == "auto -> int4" and decided == ["auto"]
    args.quantize = "int8"
    assert bench_cli._target_quantize(args) == "int8"


def test_lossless_methods_match_the_baseline_at_temperature_0(target_model, bench_tokenizer, bench_prompt_file):
    prompts = load_prompts(str(bench_prompt_file))
    sps = "sps:draft=self,k=3,cost_aware=false"  # a fixed length: the self-draft then fills every round
    methods = f"ar,pld:n=4,{sps},oracle:corrupt=0.3,hf-generate,hf-pld:n=4,hf-assisted:draft=self,n=3"
    result, summary = run_tiny(target_model, bench_tokenizer, methods, prompts)
    for method, s in summary.items():
        assert s["num_identical"] == s["num_prompts"] == 3, method
    assert summary[sps]["mean_accepted_tokens"] > 3.0  # the target drafting for itself
    assert summary["hf-generate"]["mean_accepted_tokens"] == pytest.approx(1.0)
    assert summary["hf-assisted:draft=self,n=3"]["mean_accepted_tokens"] > 2.0
    # The second turn followed the method's own first answer: its prompt contains that answer.
    first = next(r for r in result.runs if r.method == "ar" and r.question_id == "1")
    assert len(first.prompt_ids) == 2 and len(first.prompt_ids[1]) > len(first.prompt_ids[0]) + 5


def test_a_penalised_run_keeps_every_lossless_method_on_the_baselines_tokens(target_model, bench_tokenizer,
                                                                            bench_prompt_file, monkeypatch):
    # --repetition-penalty, --presence-penalty and --frequency-penalty: every lossless method, transformers' generate
    # (repetition alone, its only one) included, writes the penalised baseline's answers.
    from jointspec.bench.engines import JointspecEngine
    from jointspec.bench.specs import MethodSpecError

    prompts = load_prompts(str(bench_prompt_file))
    sps = "sps:draft=self,k=3,cost_aware=false"
    result, summary = run_tiny(target_model, bench_tokenizer, f"ar,pld:n=4,{sps},hf-generate", prompts,
                               repetition_penalty=1.5)
    assert all(s["num_identical"] == s["num_prompts"] == 3 for s in summary.values()), summary
    plain, _ = run_tiny(target_model, bench_tokenizer, "ar", prompts)
    penalised = {r.question_id: r.output_ids for r in result.runs if r.method == "ar"}
    assert penalised != {r.question_id: r.output_ids for r in plain.runs}  # (the penalty changed the answers)
    _, both = run_tiny(target_model, bench_tokenizer, f"ar,{sps}", prompts, presence_penalty=0.5,
                       frequency_penalty=0.5)
    assert both[sps]["num_identical"] == 3
    decoded = []  # refused before anything decodes
    original = JointspecEngine.generate
    monkeypatch.setattr(JointspecEngine, "generate", lambda self, *a, **k: decoded.append(1) or original(self, *a, **k))
    with pytest.raises(MethodSpecError, match="no presence or frequency penalty"):
        run_tiny(target_model, bench_tokenizer, "ar,hf-generate", prompts, presence_penalty=0.5)
    with pytest.raises(MethodSpecError, match="does not pass --logit-bias to transformers"):
        run_tiny(target_model, bench_tokenizer, "ar,hf-generate", prompts, logit_bias=((4, -100.0),))
    assert not decoded
    # --logit-bias reaches every row: the biased baseline differs from the plain one, and each lossless row writes it.
    plain_ids = {r.question_id: r.output_ids for r in plain.runs}
    banned = sorted({t for ids in plain_ids.values() for turn in ids for t in turn})[:3]
    bias = tuple((t, -100.0) for t in banned)
    biased, summary = run_tiny(target_model, bench_tokenizer, f"ar,pld:n=4,{sps}", prompts, logit_bias=bias)
    assert all(s["num_identical"] == s["num_prompts"] == 3 for s in summary.values()), summary
    biased_ids = {r.question_id: r.output_ids for r in biased.runs if r.method == "ar"}
    assert biased_ids != plain_ids
    assert not {t for ids in biased_ids.values() for turn in ids for t in turn} & set(banned)


def test_decode_speed_is_timed_after_the_prompt(target_model, bench_tokenizer, bench_prompt_file):
    """The decode speedup is tokens over the medians of (time - time reading the prompt), recomputed here from the
    runs; an engine that does not time its prompt (transformers' generate) gets none."""
    result, summary = run_tiny(target_model, bench_tokenizer, "ar,pld:n=4,hf-generate",
                               load_prompts(str(bench_prompt_file)), repeats=2)

    def decode_rate(method: str) -> float:
        runs = [r for r in result.runs if r.method == method]
        assert all(len(r.prefill_seconds) == 2 and 0 < min(r.prefill_seconds) for r in runs)
        seconds = sum(statistics.median(s - p for s, p in zip(r.seconds, r.prefill_seconds)) for r in runs)
        return sum(r.num_new_tokens for r in runs) / seconds

    assert summary["pld:n=4"]["decode_speedup"] == pytest.approx(decode_rate("pld:n=4") / decode_rate("ar"),
                                                                 abs=1e-4)
    assert summary["ar"]["decode_speedup"] == 1.0
    assert summary["hf-generate"]["decode_speedup"] is None
    assert summary["pld:n=4"]["prompt_seconds"] > 0


@pytest.mark.parametrize("corruption", [0.0, 0.3, 0.7])
def test_oracle_acceptance_matches_corruption_rate(target_model, bench_tokenizer, corruption):
    # 24 prompts x 40 tokens with 4-token drafts: 355 first-position draws at corruption 0.3 and 669 at 0.7, so
    # +-0.1 is 4.1 and 5.6 standard deviations of the accepted share: for a fresh corruption seed the check fails
    # falsely with odds of 4e-5 and 2e-8 (the seeded run gives 0.738 and 0.295). At 0.0 nothing is random.
    prompts = [BenchPrompt(str(i), "x", (f"{' '.join(WORDS[i:i + 6])}",)) for i in range(24)]
    _, summary = run_tiny(target_model, bench_tokenizer, f"ar,oracle:corrupt={corruption},n=4", prompts,
                          max_new_tokens=40, perplexity=False)
    s = summary[f"oracle:corrupt={corruption},n=4"]
    assert s["num_identical"] == 24
    assert s["acceptance_per_position"][0] == pytest.approx(1 - corruption, abs=0.1)
    if corruption == 0.0:
        assert s["acceptance_per_position"] == [1.0] * 4


# What the registry says of each method (``register_method(..., lossless=...)``); `ar` is the baseline itself. A method
# added to the registry fails the test below until it is put in one of these two sets, agreeing with its flag.
LOSSLESS = {"aded", "corpus", "cross", "default", "hybrid", "hybrid-tree", "lade", "lookahead", "oracle", "pearl",
            "pld", "sparse-self", "specinfer", "spectr", "sps"}
NOT_LOSSLESS = {"mtad", "mtad-tree"}
# Methods for long inputs, which draft nothing on these short prompts (their drafting is tested on their own:
# tests/test_drafters_sparse_self.py).
LONG_INPUT_ONLY = {"sparse-self"}


def test_every_registered_method_runs_and_every_lossless_one_matches_the_baseline(target_model, bench_tokenizer,
                                                                                   bench_prompt_file, tmp_path):
    """Methods other modules register (mtad, specinfer, ...) need no change in the bench: each runs with the
    target as its own draft (``corpus`` and ``aded``, which draft from an n-gram table, with a small one), and every
    lossless one emits the baseline's tokens on every turn of every prompt, with drafts accepted on the way (so the
    speculation really ran). Greedy and deterministic: no false-failure odds."""
    from jointspec.drafters.corpus import NgramTable
    from jointspec.methods import lossless_methods, method_names
    from jointspec.methods.registry import method_reads

    assert set(method_names()) == LOSSLESS | NOT_LOSSLESS | {"ar"}, "put the new method in LOSSLESS or NOT_LOSSLESS"
    assert set(lossless_methods()) == LOSSLESS | {"ar"}
    NgramTable.build([[5, 6, 7, 8]] * 2, vocab_size=target_model.config.vocab_size).save(tmp_path, {"kind": "corpus"})
    drafts = {"corpus": str(tmp_path), "aded": str(tmp_path)}  # aded's draft is its n-gram prior
    # The cost-aware methods draft only where it pays, and a self-draft never pays (a draft call costs a target
    # step): told to draft every round, they speculate here.
    every_round = {name: ["cost_aware=false"] for name in ("specinfer", "spectr", "sps", "hybrid")}
    # A draft only for the methods that read one (a key a method would ignore is refused).
    options = {name: ([f"draft={drafts.get(name, 'self')}"] if "draft" in method_reads(name) else [])
               + every_round.get(name, []) for name in method_names() if name != "ar"}
    specs = {name: ":".join([name, ",".join(items)]) if items else name for name, items in options.items()}
    result, summary = run_tiny(target_model, bench_tokenizer, ",".join(["ar", *specs.values()]),
                               load_prompts(str(bench_prompt_file)), max_new_tokens=8, perplexity=False)
    assert set(summary) == {"ar", *specs.values()}

    def outputs(method: str) -> dict[str, list[list[int]]]:
        return {run.question_id: run.output_ids for run in result.runs if run.method == method}

    baseline = outputs("ar")
    assert len(baseline) == 3 and sum(len(turns) for turns in baseline.values()) == 4  # 3 prompts, 4 turns
    for name in sorted(LOSSLESS):
        assert outputs(specs[name]) == baseline, name  # compared here, not only through the bench's own flag
        assert summary[specs[name]]["num_identical"] == 3, name
        assert summary[specs[name]]["mean_accepted_tokens"] > (0.0 if name in LONG_INPUT_ONLY else 1.0), name


def test_a_row_that_learns_online_remembers_only_after_its_timed_runs(target_model, bench_tokenizer, tmp_path):
    # Ten prompts of one "distribution": the same request under different ids. The row with memory=online copies
    # each earlier answer, so it needs fewer target calls on every prompt but the first; the row without the
    # memory decodes each as the first. The first prompt, even after the warm-up ran it, has nothing to copy: the
    # warm-up never writes the memory, and a prompt's own answer joins it only after its timed runs (repeats 2).
    from jointspec.bench.report import write_report

    prompts = [BenchPrompt(str(i), "x", (" ".join(WORDS[:8]),)) for i in range(10)]
    result, summary = run_tiny(target_model, bench_tokenizer, "ar,pld,pld:memory=online", prompts, repeats=2,
                               max_new_tokens=16)
    runs = {m: sorted((r for r in result.runs if r.method == m), key=lambda r: r.prompt_index)
            for m in result.methods}
    assert all(r.identical for r in runs["pld:memory=online"])
    assert runs["pld:memory=online"][0].num_target_calls == runs["pld"][0].num_target_calls
    assert all(online.num_target_calls < plain.num_target_calls
               for online, plain in zip(runs["pld:memory=online"][1:], runs["pld"][1:]))
    curve = summary["pld:memory=online"]["learning"]
    first, last = runs["pld:memory=online"][0].stats, runs["pld:memory=online"][-1].stats
    assert curve["num_prompts_each"] == 1 and curve["first_tokens_per_call"] == round(first.mean_accepted_tokens, 4)
    assert curve["last_tokens_per_call"] == round(last.mean_accepted_tokens, 4) > curve["first_tokens_per_call"]
    assert "learning" not in summary["pld"]
    write_report(result, summary, tmp_path, "jointspec bench ...")
    report = (tmp_path / "report.md").read_text()
    assert "## Online memory: the first prompts against the last" in report
    assert "`pld` on the same prompts: " in report


def test_a_report_that_fails_while_written_leaves_the_earlier_one_whole(bench_main, bench_prompt_file, tmp_path,
                                                                        monkeypatch):
    from jointspec.bench import report as bench_report

    folder = tmp_path / "report"
    common = ("--prompts", str(bench_prompt_file), "--max-new-tokens", "4", "--no-perplexity", "--no-cost-model",
              "--report-dir", str(folder))
    assert bench_main(*common, "--methods", "ar,pld")[0] == 0
    before = {path.name: path.read_bytes() for path in folder.iterdir()}

    def broken_plots(*args, **kwargs):  # as a Ctrl-C or a plotting error while the plots are drawn
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_report, "write_plots", broken_plots)
    code, out, err = bench_main(*common, "--methods", "ar,hf-generate")
    assert code == 130 and "interrupted" in err
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before  # nothing half-written


def test_a_sigterm_while_a_report_is_written_cleans_up_as_ctrl_c_does(bench_main, bench_prompt_file, tmp_path,
                                                                        monkeypatch):
    """SIGTERM (`timeout`, `docker stop`, a CI's cancel) ended the process at once, skipping every clean-up: a
    report's staging folder stayed in the report folder (and a first run's half-prepared model, 183 MB). The CLI now
    raises it as it raises Ctrl-C's interrupt: the same clean-up, exit status 143."""
    import os
    import signal

    from jointspec.bench import report as bench_report

    folder = tmp_path / "report"
    common = ("--prompts", str(bench_prompt_file), "--max-new-tokens", "4", "--no-perplexity", "--no-cost-model",
              "--report-dir", str(folder))
    assert bench_main(*common, "--methods", "ar")[0] == 0
    before = {path.name: path.read_bytes() for path in folder.iterdir()}

    def terminated_plots(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # (a no-op that lets the handler run here, as it would at the next instruction)

    monkeypatch.setattr(bench_report, "write_plots", terminated_plots)
    code, out, err = bench_main(*common, "--methods", "ar,pld")
    assert code == 143 and "terminated" in err
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # as it was before the command


def test_a_report_that_finds_the_disk_full_says_so_and_still_gives_the_runs_figures(bench_main, bench_prompt_file,
                                                                                     tmp_path, monkeypatch):
    """A full disk while the report was written (after the whole run) ended in PIL's or json's traceback, the run's
    figures printed only as the table. Now the JSON line still goes out, then an error naming the folder."""
    from jointspec.bench import report as bench_report

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench_report, "_write_report", full)
    folder = tmp_path / "report"
    code, out, err = bench_main("--prompts", str(bench_prompt_file), "--max-new-tokens", "4", "--no-perplexity",
                                "--no-cost-model", "--report-dir", str(folder), "--methods", "ar")
    assert code == 2 and "Traceback" not in err
    assert f"could not write the report in {folder} (No space left on device)" in err
    assert json.loads(out.strip().splitlines()[-1])["methods"]["ar"]["num_prompts"] > 0
    assert not folder.exists()


def test_a_report_stopped_in_a_new_folder_leaves_no_folder(bench_main, bench_prompt_file, tmp_path, monkeypatch):
    """The folders made for a report were left, empty, by a run stopped while writing it."""
    from jointspec.bench import report as bench_report

    def broken_plots(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_report, "write_plots", broken_plots)
    code, _, err = bench_main("--prompts", str(bench_prompt_file), "--max-new-tokens", "4", "--no-perplexity",
                              "--no-cost-model", "--methods", "ar", "--report-dir", str(tmp_path / "new" / "sub"))
    assert code == 130 and not (tmp_path / "new").exists()


def test_a_rerun_leaves_no_plot_it_did_not_draw_and_says_how_it_ran(bench_main, bench_prompt_file, tmp_path,
                                                                    monkeypatch):
    """An earlier run's plots stayed beside a rerun's report that drew fewer (no matplotlib, or --no-perplexity,
    which drew an empty speed-vs-perplexity chart); the report said 'after a discarded warm-up' with --no-warmup."""
    pytest.importorskip("matplotlib")
    folder = tmp_path / "report"
    common = ("--prompts", str(bench_prompt_file), "--max-new-tokens", "4", "--no-cost-model", "--methods", "ar,pld",
              "--report-dir", str(folder))
    assert bench_main(*common)[0] == 0
    assert (folder / "speed_vs_perplexity.png").is_file()
    assert bench_main(*common, "--no-perplexity", "--no-warmup")[0] == 0
    assert not (folder / "speed_vs_perplexity.png").exists() and (folder / "speedup_by_category.png").is_file()
    report = (folder / "report.md").read_text()
    assert "(no warm-up)" in report and "discarded warm-up" not in report and "speed_vs_perplexity" not in report


def test_prompts_that_cannot_fit_the_context_are_refused_before_anything_runs(target_model, bench_tokenizer,
                                                                              monkeypatch):
    """A prompt too long for the model's context was refused only when the bench reached it, after every prompt
    before it had run (hours, on a real set), and without its id. Now every prompt's turns are checked first, with
    empty answers before each turn (the least a turn needs): the too-long ones are named, and nothing is built or
    run. The tiny target holds 256 positions."""
    from jointspec.bench import runner
    from jointspec.core.errors import ContextTooLongError

    monkeypatch.setattr(runner, "build_engine", lambda *args: pytest.fail("an engine was built"))
    short, long_turn = " ".join(WORDS[:8]), " ".join(WORDS[:60] * 5)
    prompts = [BenchPrompt("fits", "x", (short,)), BenchPrompt("too-long", "x", (long_turn,)),
               BenchPrompt("second-turn", "x", (short, long_turn))]
    with pytest.raises(ContextTooLongError, match=r"2 of 3 prompts do not fit the model's context of 256 tokens: "
                                                  r"too-long \(turn 1: [\d,]+ tokens\), second-turn \(turn 2: "):
        run_tiny(target_model, bench_tokenizer, "ar,pld", prompts)


def test_llamacpp_rows_check_the_prompts_against_their_own_capped_context(target_model, bench_tokenizer,
                                                                            monkeypatch):
    """llama.cpp's rows read within a context capped below the target's (its cache is allocated up front): a prompt
    that fits the target but not that cap was refused only when its llama.cpp row reached it. The cap is lowered to 48
    here, the tiny target holding 256."""
    from jointspec.bench import runner
    from jointspec.core.errors import ContextTooLongError

    monkeypatch.setattr(runner, "build_engine", lambda *args: pytest.fail("an engine was built"))
    monkeypatch.setattr(runner, "LLAMACPP_MAX_CONTEXT", 48)
    prompts = [BenchPrompt("fits", "x", (" ".join(WORDS[:8]),)), BenchPrompt("long", "x", (" ".join(WORDS[:60]),))]
    with pytest.raises(ContextTooLongError, match=r"1 of 2 prompts do not fit the model's context of 48 tokens: long"):
        run_tiny(target_model, bench_tokenizer, "ar,llamacpp", prompts)


def test_each_row_reports_what_it_added_apart_from_the_memory_other_rows_hold(target_model, bench_tokenizer,
                                                                              monkeypatch):
    """The RSS column is the process's peak, which holds every row's caches: a row that kept 96 MB made the baseline
    look as big on the next prompt. +MB is what a run raised memory by over what was resident when it began: the
    holding row shows its 96 MB, the baseline next to nothing, though its peak covers the other row's memory. Margins
    of 32 MB against the tiny model's own allocations (a few MB)."""
    import numpy as np

    from jointspec.bench import runner

    held, conversation = [], runner.run_conversation

    def holding(engine, tokenizer, prompt, config):
        turns = conversation(engine, tokenizer, prompt, config)
        if engine.spec.label == "pld" and not held:
            held.append(np.ones(96 * 2**20, dtype=np.uint8))  # written: resident, and kept for the rest of the run
        return turns

    monkeypatch.setattr(runner, "run_conversation", holding)
    prompts = [BenchPrompt(str(i), "x", (" ".join(WORDS[i:i + 8]),)) for i in range(3)]
    result, summary = run_tiny(target_model, bench_tokenizer, "ar,pld", prompts, max_new_tokens=4, warmup=False)
    assert summary["pld"]["added_rss_mb"] >= 96 - 8
    assert summary["ar"]["added_rss_mb"] < 32
    late_baseline = [run for run in result.runs if run.method == "ar" and run.prompt_index > 0]
    assert all(run.peak_rss_bytes >= run.added_rss_bytes + 64 * 2**20 for run in late_baseline)


def test_a_process_that_cannot_reset_its_peak_reports_no_added_memory(target_model, bench_tokenizer, monkeypatch):
    """Where the peak cannot be reset between runs (no /proc/self/clear_refs, or not allowed), it holds every earlier
    run's peak, so +MB would charge a row with the others' memory: it says nothing ('-') rather than that."""
    from jointspec.bench import runner
    from jointspec.bench.report import table

    monkeypatch.setattr(runner, "reset_peak_memory", lambda device: False)
    prompts = [BenchPrompt(str(i), "x", (" ".join(WORDS[i:i + 8]),)) for i in range(2)]
    result, summary = run_tiny(target_model, bench_tokenizer, "ar,pld", prompts, max_new_tokens=4, warmup=False)
    assert summary["ar"]["added_rss_mb"] is None and summary["pld"]["added_rss_mb"] is None
    assert all(run.added_rss_bytes is None for run in result.runs)
    assert summary["ar"]["peak_rss_mb"] > 0  # the peak itself is still reported
    header, *rows = table(result, summary).splitlines()[:3]
    end = header.index("+MB") + len("+MB")  # cells are right-aligned to their header's end
    assert [row[:end].split()[-1] for row in rows] == ["-", "-"]


def test_the_report_says_what_few_prompts_and_sampling_leave_unsaid():
    """Notes under the table: intervals from few prompts cover less than they say, and sampled answers may leave the
    baseline's (and a rerun's) for reasons other than a broken method. Deterministic: no false failures."""
    from jointspec.bench.report import notes
    from jointspec.bench.runner import BenchConfig, BenchResult

    def result(temperature: float) -> BenchResult:
        return BenchResult(BenchConfig(temperature=temperature), ["ar"], "ar", [], None)

    assert notes(result(0.0), {"ar": {"num_prompts": 48}}) == []
    few = notes(result(0.0), {"ar": {"num_prompts": 8}})
    assert len(few) == 1 and "85-90 %" in few[0]
    sampled = notes(result(1.0), {"ar": {"num_prompts": 48}})
    assert len(sampled) == 1 and "rerun with the same seed" in sampled[0] and "`pld`" in sampled[0]


def test_rows_on_another_target_than_the_baselines_are_marked():
    """`default` runs quantize=auto: on a float target, an int4 copy. Its `identical` count then compares two models'
    answers, and a lossless method showed 1/2 with nothing said; such rows are marked and the mark explained.
    Deterministic: no false failures."""
    from jointspec.bench.report import other_target_note, other_target_rows
    from jointspec.bench.runner import BenchConfig, BenchResult

    placed = {"backend": "torch", "kv": "auto", "kernels": "loaded"}
    settings = {"ar": {"quantize": "as loaded", **placed}, "pld": {"quantize": "as loaded", **placed},
                "default": {"quantize": "int4", **placed}, "llamacpp": {"method": "llamacpp", "options": {}}}
    result = BenchResult(BenchConfig(), list(settings), "ar", [], None, settings=settings)
    assert other_target_rows(result) == ["default"]
    note = other_target_note(result, other_target_rows(result))
    assert note.startswith("* runs another target than the baseline (default: quantize int4)")
    same = BenchResult(BenchConfig(), ["ar", "pld"], "ar", [], None,
                       settings={k: settings[k] for k in ("ar", "pld")})
    assert other_target_rows(same) == [] and other_target_note(same, []) is None


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_report_names_the_commit_only_of_a_checkout_that_holds_the_package(tmp_path):
    """A report names the jointspec commit that ran, with "+changes" where tracked files were edited; a copy installed
    inside some other repository (a virtual environment in a project's folder) names none, not that project's commit.
    Deterministic: no false failures."""
    import subprocess

    from jointspec.bench.runner import source_commit

    def git(*args):
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t"}
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, env=env)

    package = tmp_path / "src" / "jointspec"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "project")
    assert source_commit(package) is None  # untracked: an installed copy, not this repository's code
    git("add", "src")
    git("commit", "-q", "-m", "package")
    commit = source_commit(package)
    assert commit is not None and len(commit) == 12 and int(commit, 16) >= 0
    (package / "__init__.py").write_text("x = 1\n")
    assert source_commit(package) == commit + "+changes"
    assert source_commit(tmp_path.parent / "nowhere") is None


def test_the_report_names_the_kernels_the_linear_layers_run_on(target_model):
    # An int4 target's report said "linear layers on stock": what kernels_in_use says of anything not on oneDNN.
    from jointspec.bench.runner import linear_kernels
    from jointspec.kernels.grouped import kernels, selected_isa
    from jointspec.kernels.quantize import quantize_model

    from helpers import grouped_llama

    assert linear_kernels(None) == ""
    assert linear_kernels(target_model) in ("oneDNN", "PyTorch's own kernels")
    assert kernels() is not None  # the compiled kernels build on every CI machine (a C++ compiler is required)
    assert linear_kernels(quantize_model(grouped_llama(0), "int4")) == f"jointspec's {selected_isa()} kernels"
