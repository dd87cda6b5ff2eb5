"""``jointspec generate`` from the command line: bad input gives one clear line and a non-zero exit, never a
traceback; ``--json`` prints a parseable result.

Models are tiny random Llamas saved with ``save_pretrained`` into temporary folders, each with a small word-level
tokenizer (``w4 w5 ...``; ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3), so the CLI loads them exactly as it would
load a real model folder. Errors come in two forms, both accepted: argparse's (usage, then ``jointspec generate:
error: ...``, exit 2) for malformed options, and the library's (``jointspec: error: ...``, exit 2) for everything
found later. Deterministic: greedy decoding on fixed weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from helpers import SPECIALS, VOCAB, assert_clean_error, record_curve_store, run_cli, save_model

PROMPT = "w10 w11 w12 w13 w10 w11"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_model(root / "target", 0),
        "draft": save_model(root / "draft", 1),
        # Another vocabulary altogether (120 words): tokenizers differ.
        "other_vocab": save_model(root / "other_vocab", 1, vocab=120),
        # The target's tokenizer but 120 output rows: only the model sizes differ.
        "other_size": save_model(root / "other_size", 1, vocab=120, tokenizer_vocab=VOCAB),
        # A 16-position context.
        "short": save_model(root / "short", 0, max_positions=16),
    }


def generate_args(model: str, *extra: str) -> list[str]:
    # --no-chat: the tiny tokenizers have no chat template; 8 new tokens keep each run to a few milliseconds.
    return ["generate", PROMPT, "--model", model, "--no-chat", "--max-new-tokens", "8", *extra]


def test_missing_model_path(capsys, tmp_path):
    code, out, err = run_cli(capsys, *generate_args(str(tmp_path / "no-such-model")))
    assert_clean_error(code, err, "jointspec: error:", "does not exist")
    assert out == ""


def test_folder_without_config(capsys, tmp_path):
    code, _, err = run_cli(capsys, *generate_args(str(tmp_path)))
    assert_clean_error(code, err, "jointspec: error:", "config.json")


def test_missing_draft_path(capsys, model_dirs, tmp_path, monkeypatch):
    """Refused before the target loads (it was found only after)."""
    from jointspec.backends import loading

    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("the target loaded"))
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", "sps",
                                                  "--draft", str(tmp_path / "no-such-draft")))
    assert_clean_error(code, err, "jointspec: error:", f"--draft '{tmp_path / 'no-such-draft'}' does not exist")


@pytest.mark.parametrize(("draft", "said"), [
    ("no-such-draft-here", "there is no folder 'no-such-draft-here' here, and as a hub id it is not in this machine's "
                           "cache: check the path; hub ids load only"),
    ("nobody/no-such-draft", "'nobody/no-such-draft' is not a folder here, and as a hub id it is not in this "
                             "machine's cache; hub ids load only"),
])
def test_a_draft_neither_a_folder_nor_cached_says_so_first(capsys, model_dirs, draft, said):
    """The message opened with transformers' text about connecting to the hub, which is never tried."""
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", "sps", "--draft", draft))
    assert_clean_error(code, err, f"jointspec: error: could not load model '{draft}': {said}")


def test_sps_without_draft(capsys, model_dirs):
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", "sps"))
    assert_clean_error(code, err, "jointspec: error:", "--draft")


@pytest.mark.parametrize("draft", ["other_vocab", "other_size"])
def test_draft_vocabulary_mismatch(capsys, model_dirs, draft):
    # other_vocab: a different tokenizer; other_size: the same tokenizer on a model with more output rows.
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", "sps",
                                                  "--draft", model_dirs[draft]))
    assert_clean_error(code, err, "jointspec: error:", "tokenizer", "the cross method")


def test_an_answer_the_context_cut_says_so(capsys, model_dirs):
    # 10 prompt tokens and 20 asked for, on a 16-position model: the answer stopped at 6 tokens with nothing said.
    prompt = " ".join(f"w{4 + i}" for i in range(10))
    code, _, err = run_cli(capsys, "generate", prompt, "--model", model_dirs["short"], "--no-chat",
                           "--max-new-tokens", "20", "--method", "ar")
    assert code == 0, err
    assert "stopped after 6 tokens: the prompt's 10 tokens and the answer filled the model's 16-token context" in err
    longer = " ".join(f"w{4 + i}" for i in range(15))  # one token of room: "1 token", not "1 tokens"
    code, _, err = run_cli(capsys, "generate", longer, "--model", model_dirs["short"], "--no-chat",
                           "--max-new-tokens", "20", "--method", "ar")
    assert code == 0 and "stopped after 1 token: the prompt's 15 tokens" in err, err
    code, _, err = run_cli(capsys, "generate", prompt, "--model", model_dirs["short"], "--no-chat",
                           "--max-new-tokens", "3", "--method", "ar")
    assert code == 0 and "context" not in err  # it stopped where asked


def test_prompt_longer_than_context(capsys, model_dirs):
    long_prompt = " ".join(f"w{4 + i}" for i in range(20))  # 20 tokens for a 16-position context
    code, _, err = run_cli(capsys, "generate", long_prompt, "--model", model_dirs["short"], "--no-chat")
    assert_clean_error(code, err, "jointspec: error:", "20 tokens", "16")


@pytest.mark.parametrize("option, value", [
    ("--num-draft-tokens", "0"),
    ("--num-draft-tokens", "two"),
    ("--max-new-tokens", "0"),
    ("--temperature", "warm"),
])
def test_malformed_options_are_argparse_errors(capsys, model_dirs, option, value):
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], option, value))
    assert code == 2
    assert_clean_error(code, err, option)
    assert "usage:" in err


@pytest.mark.parametrize("option, value, needle", [
    ("--temperature", "-0.5", "--temperature"),
    ("--temperature", "nan", "--temperature"),
    ("--top-p", "0", "--top-p must be"),  # named by its flag, not the API's field (top_p)
    ("--top-p", "1.5", "--top-p must be"),
    ("--top-p", "-0.1", "--top-p must be"),
    ("--top-k", "-1", "--top-k"),
    ("--method", "no-such-method", "unknown method"),
    ("--dtype", "float8", "dtype"),
    ("--min-ngram", "4", "--min-ngram <= --max-ngram"),  # 4 > --max-ngram 3
    ("--tree-budget", "-1", "--tree-budget"),
])
def test_bad_values_are_library_errors(capsys, model_dirs, option, value, needle):
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], option, value))
    assert code == 2
    assert_clean_error(code, err, "jointspec: error:", needle)


@pytest.mark.parametrize("method", ["hybrid-tree", "default"])
def test_dynamic_tree_with_sampling_is_refused_before_any_output(capsys, model_dirs, method):
    code, out, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", method, "--tree-budget", "3",
                                                    "--temperature", "0.8"))
    assert code == 2 and out == ""
    assert_clean_error(code, err, "jointspec: error:", f"{method}: --tree-budget drafts for greedy decoding only")


def test_a_tree_budget_that_caps_a_lookup_tree_samples(capsys, model_dirs):
    # lookahead's --tree-budget is its trie's node cap, not a dynamic tree: sampling with it runs.
    code, out, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", "lookahead", "--tree-budget",
                                                    "3", "--temperature", "0.8", "--seed", "1"))
    assert code == 0, err
    assert out.strip()


@pytest.mark.parametrize("options, flag", [(("--method", "pld", "--beam-width", "8"), "--beam-width"),
                                           (("--method", "ar", "--draft", "self"), "--draft"),
                                           (("--method", "default", "--no-cost-aware"), "--no-cost-aware"),
                                           # given at its default value: it was accepted and ignored
                                           (("--method", "ar", "--num-draft-tokens", "4"), "--num-draft-tokens"),
                                           (("--method", "pld", "--verify", "token"), "--verify"),
                                           (("--method", "ar", "--cost-aware"), "--cost-aware")])
def test_an_option_the_method_does_not_read_is_refused_not_ignored(capsys, model_dirs, options, flag):
    code, out, err = run_cli(capsys, *generate_args(model_dirs["target"], *options))
    assert_clean_error(code, err, "jointspec: error:", f"does not read {flag}, so it would be ignored")
    assert not out


def test_methods_lists_the_options_each_method_reads(capsys):
    code, out, _ = run_cli(capsys, "methods")
    methods, references = out.split("\n\nreference rows of `jointspec bench`")
    lines = methods.splitlines()
    options = {line.split()[0]: lines[i + 1] for i, line in enumerate(lines) if not line.startswith(" ")}
    assert code == 0 and "--max-ngram" in options["pld"] and "--beam-width" not in options["pld"]
    assert options["ar"].split() == ["options:", "none"]
    # The rows bench also takes, which the listing left out: other engines' loops, with their spec keys.
    rows = {line.split()[0]: line for line in references.splitlines()[1:]}
    assert set(rows) == {"hf-generate", "hf-assisted", "hf-pld", "llamacpp", "llamacpp-pld"}
    assert "keys: num_pred_tokens, max_ngram_size, flash_attn" in rows["llamacpp-pld"]


def test_unknown_device(capsys, model_dirs):
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--device", "tpu-please"))
    assert_clean_error(code, err, "jointspec: error:", "unknown device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(capsys, model_dirs):
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--device", "cuda"))
    assert_clean_error(code, err, "jointspec: error:", "CUDA is not available")


def test_empty_prompt_without_chat_template(capsys, model_dirs):
    # No chat template and no text: nothing to condition on (the loop needs at least one token).
    code, _, err = run_cli(capsys, "generate", "", "--model", model_dirs["target"], "--no-chat")
    assert_clean_error(code, err, "jointspec: error:", "prompt is empty")


REQUIRED_STATS = {"num_rounds", "num_draft_tokens", "num_accepted_tokens", "mean_accepted_tokens"}


def json_result(capsys, *args: str) -> dict:
    started = time.perf_counter()
    code, out, err = run_cli(capsys, *args)
    elapsed = time.perf_counter() - started
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert {"text", "token_ids", "num_new_tokens", "seconds", "tokens_per_second", "stats"} <= set(result)
    assert REQUIRED_STATS <= set(result["stats"])
    assert len(result["token_ids"]) == result["num_new_tokens"] == result["stats"]["num_new_tokens"]
    assert isinstance(result["text"], str)
    # The decode's own wall time (rounded to 0.1 ms): more than nothing, no more than the whole command took; and
    # the rate is tokens / seconds, to the rounding of both numbers (seconds +- 5e-5, the rate +- 5e-4).
    seconds, rate, num_tokens = result["seconds"], result["tokens_per_second"], result["num_new_tokens"]
    assert 0 < seconds <= elapsed + 5e-5, (seconds, elapsed)
    assert num_tokens / (seconds + 5e-5) - 5e-4 <= rate <= num_tokens / max(seconds - 5e-5, 1e-9) + 5e-4, result
    return result


@pytest.mark.parametrize("method", [["--method", "ar"], ["--method", "pld"],
                                    ["--method", "sps", "--no-cost-aware", "--draft", "self"]])
def test_json_output(capsys, model_dirs, method):
    # 16 new tokens with 4-token drafts: a few rounds, unless the model emits </s> (id 2) before; the same greedy
    # tokens for every method, whatever each accepted. The self-draft every round (cost-aware, it never drafts: a
    # draft as dear as a target step cannot pay).
    reference = json_result(capsys, "generate", PROMPT, "--model", model_dirs["target"], "--no-chat",
                            "--max-new-tokens", "16", "--json")
    result = json_result(capsys, "generate", PROMPT, "--model", model_dirs["target"], "--no-chat",
                         "--max-new-tokens", "16", "--json", *method)
    assert result["token_ids"] == reference["token_ids"]
    assert 1 <= result["num_new_tokens"] <= 16
    stats = result["stats"]
    assert stats["num_rounds"] + stats["num_accepted_tokens"] == result["num_new_tokens"]
    if method[-1] == "self":  # the target drafting for itself: everything is accepted
        assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0
        assert stats["mean_accepted_tokens"] > 1.0


def test_a_method_that_drafted_nothing_says_it_decoded_plainly(capsys, model_dirs):
    """Cost-aware sps with the target as its own draft drafts nothing (no chain of a draft as dear as a target step
    pays): it says so, and how to draft anyway; with --no-cost-aware it drafts and says nothing. 32 tokens: past the
    rounds after which the note is due, unless the tiny model emits </s> early (then the check below says so)."""
    args = ["generate", PROMPT, "--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "32", "--method",
            "sps", "--draft", "self"]
    code, out, err = run_cli(capsys, *args, "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["stats"]["num_rounds"] >= 16, "the tiny model stopped early: pick a longer answer"
    assert result["stats"]["num_draft_tokens"] == 0
    assert "sps drafted no tokens in" in err and "plain decoding" in err and "--no-cost-aware" in err
    code, _, err = run_cli(capsys, *args, "--no-cost-aware")
    assert code == 0 and "drafted no tokens" not in err
    # A method for long inputs says why it drafted nothing on a short one.
    code, _, err = run_cli(capsys, *args[:-4], "--method", "sparse-self")
    assert code == 0 and "sparse-self drafted no tokens" in err and "passes 2,048 tokens" in err, err


@pytest.mark.parametrize("extra, exact", [((), True), (("--attention", "speckv"), False),
                                          (("--method", "mtad", "--draft", "self"), True),
                                          (("--method", "mtad", "--draft", "self", "--temperature", "1"), False),
                                          (("--method", "pld", "--temperature", "1"), True)])
def test_json_says_whether_the_text_is_the_models_own(capsys, model_dirs, extra, exact):
    """--json names the attention and whether the output is exact (over full attention: greedy, every method, MTAD's
    verifier reducing to greedy matching; sampled, a lossless method): an approximate attention mode or sampled MTAD
    is not, whatever the tokens happen to be on a short prompt."""
    result = json_result(capsys, *generate_args(model_dirs["target"], "--json", *extra))
    assert result["exact"] is exact
    assert result["attention"] == (extra[1] if extra[:1] == ("--attention",) else "full")


def test_json_with_a_separate_draft_model(capsys, model_dirs):
    # Every round: the tiny draft costs what the tiny target does, so cost-aware sps would never draft with it.
    result = json_result(capsys, *generate_args(model_dirs["target"], "--method", "sps", "--draft",
                                                model_dirs["draft"], "--no-cost-aware", "--json"))
    assert result["stats"]["num_draft_tokens"] > 0


def test_sampling_is_reproducible_with_a_seed(capsys, model_dirs):
    # Sampled speculative decoding through the CLI: the same --seed gives the same tokens and another seed different
    # ones. With fixed seeds the outcome is fixed; for another pair of seeds the two continuations would coincide with
    # odds of about 1e-6 (the mean probability of a sampled continuation at these settings, estimated from 300 of
    # them; the few that stop early at </s> dominate it). Not cost-aware: a timed schedule moves which round a token
    # is drawn in, and with it the draw (docs/cli.md).
    args = generate_args(model_dirs["target"], "--method", "sps", "--draft", model_dirs["draft"], "--temperature",
                         "1.5", "--top-k", "50", "--top-p", "0.95", "--max-new-tokens", "16", "--no-cost-aware",
                         "--json")
    first = json_result(capsys, *args, "--seed", "3")
    again = json_result(capsys, *args, "--seed", "3")
    other = json_result(capsys, *args, "--seed", "4")
    assert first["token_ids"] == again["token_ids"]
    assert other["token_ids"] != first["token_ids"]


def test_sampling_without_a_seed_draws_one_and_reports_it(capsys, model_dirs):
    # Without --seed each sampled run draws its own seed (two alike by chance: 2^-53) and reports it; that seed
    # repeats the answer. A greedy run reports none: it draws nothing.
    args = generate_args(model_dirs["target"], "--method", "pld", "--temperature", "1.5", "--top-k", "50",
                         "--max-new-tokens", "16", "--json")
    first, second = json_result(capsys, *args), json_result(capsys, *args)
    assert first["seed"] != second["seed"]
    again = json_result(capsys, *args, "--seed", str(first["seed"]))
    assert again["token_ids"] == first["token_ids"] and again["seed"] == first["seed"]
    assert "seed" not in json_result(capsys, *generate_args(model_dirs["target"], "--max-new-tokens", "4", "--json"))
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--temperature", "1", "--seed", "7",
                                                  "--max-new-tokens", "4"))
    assert code == 0 and "; seed 7" in err


def test_text_output_streams_and_reports(capsys, model_dirs):
    code, out, err = run_cli(capsys, *generate_args(model_dirs["target"]))
    assert code == 0, err
    assert out.strip() and all(word.startswith("w") or word in SPECIALS for word in out.split())
    assert "[default]" in err and "tok/s" in err  # generate's default method: the fastest exact configuration


def test_subprocess_error_has_no_traceback(tmp_path):
    # The one end-to-end check in a fresh interpreter: the installed entry point, exit status and stderr as a user
    # sees them.
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, "-m", "jointspec", "generate", "hi", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("jointspec: error: model path")


def test_a_reader_that_goes_away_gets_no_traceback():
    """`jointspec methods | head -1`: the reader closes the pipe, and the listing stopped with a BrokenPipeError
    traceback. The pipe is closed here before the command has imported enough to write (a second or so)."""
    done = subprocess.Popen([sys.executable, "-m", "jointspec", "methods"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    done.stdout.close()
    err = done.stderr.read()
    done.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_logprobs_in_json_and_as_a_table(capsys, model_dirs):
    """--logprobs: each new token's log-probability under the model, with its text and its alternatives, in --json
    (their mean is minus the log of the perplexity --json reports); a table on stderr otherwise; out of range, a
    clear error naming the flag."""
    import math

    args = ("generate", PROMPT, "--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "12",
            "--method", "pld")
    result = json_result(capsys, *args, "--json", "--logprobs", "2")
    figures = result["logprobs"]
    assert [f["token_id"] for f in figures] == result["token_ids"]
    assert all(f["token"] and len(f["top"]) == 2 and f["top"][0]["logprob"] >= f["top"][1]["logprob"]
               for f in figures)
    mean = sum(f["logprob"] for f in figures) / len(figures)
    assert math.exp(-mean) == pytest.approx(result["quality"]["perplexity"], rel=1e-3)
    code, out, err = run_cli(capsys, *args, "--logprobs", "1")
    assert code == 0 and "log-probabilities" in err
    table = err.split("the most likely tokens):\n")[1].strip().splitlines()
    assert len(table) == len(figures) and table[0].split()[:2] == [repr(figures[0]["token"]),
                                                                   f"{figures[0]['logprob']:.3f}"]
    code, _, err = run_cli(capsys, *args, "--logprobs", "21")
    assert_clean_error(code, err, "--logprobs must be a whole number from 0 to 20")


def test_min_p_one_samples_the_greedy_answer_and_a_bad_one_is_refused(capsys, model_dirs):
    args = ("generate", PROMPT, "--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "12", "--json")
    greedy = json_result(capsys, *args)["token_ids"]
    assert json_result(capsys, *args, "--temperature", "1", "--min-p", "1", "--seed", "4")["token_ids"] == greedy
    code, _, err = run_cli(capsys, *args, "--temperature", "1", "--min-p", "1.5")
    assert_clean_error(code, err, "--min-p must be in [0, 1]")


def test_logit_bias_bans_a_token_and_a_bad_one_is_refused(capsys, model_dirs):
    args = ("generate", PROMPT, "--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "12", "--json")
    greedy = json_result(capsys, *args)["token_ids"]
    banned = json_result(capsys, *args, "--logit-bias", f"{greedy[0]}=-100", "--logit-bias", f"{greedy[1]}=-100")
    assert greedy[0] not in banned["token_ids"] and greedy[1] not in banned["token_ids"]
    for bad, message in (("5", "expected TOKEN_ID=AMOUNT"), ("5=200", r"--logit-bias\[5\] must be in \[-100, 100\]"),
                         ("10000000=1", "beyond this model's vocabulary"), ("5=nan", "a finite amount"),
                         ("5_0=1", "expected TOKEN_ID=AMOUNT")):
        code, _, err = run_cli(capsys, *args, "--logit-bias", bad)
        assert code != 0 and re.search(message, err) and "Traceback" not in err and "unexpected error" not in err, err


def test_json_quality_block(capsys, model_dirs, monkeypatch):
    """--json reports perplexity under the raw target (checked against a direct computation), distinct-2 and the
    4-gram repetition rate of the tokens it printed (counted here by hand), and energy per token only from a
    hardware counter: the counter's joules over the tokens, or "unavailable" where there is none (both faked here
    through ``meter_for_device``, so both branches run on every machine)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jointspec.bench import energy

    class FixedMeter:  # a counter that saw 1.5 J during the decode
        source = "fake"

        def start(self):
            pass

        def stop(self):
            return 1.5

    args = ("generate", PROMPT, "--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "24", "--json")
    monkeypatch.setattr(energy, "meter_for_device", lambda device: FixedMeter())
    result = json_result(capsys, *args)
    quality = result["quality"]
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32).eval()
    prompt_ids = AutoTokenizer.from_pretrained(model_dirs["target"])(PROMPT)["input_ids"]
    assert result["num_prompt_tokens"] == len(prompt_ids)
    ids = torch.tensor([prompt_ids + result["token_ids"]])
    with torch.no_grad():
        logprobs = model(ids).logits[0, len(prompt_ids) - 1:-1].log_softmax(-1)
    expected = math.exp(-logprobs.gather(-1, torch.tensor(result["token_ids"])[:, None]).mean().item())
    assert quality["perplexity"] == pytest.approx(expected, rel=1e-3)
    tokens = result["token_ids"]
    bigrams = list(zip(tokens, tokens[1:]))
    fourgrams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    repeated = sum(gram in fourgrams[:i] for i, gram in enumerate(fourgrams))
    assert 0 < repeated and len(set(bigrams)) < len(bigrams)  # the tiny model loops: neither rate is trivial here
    assert quality["distinct_2"] == pytest.approx(len(set(bigrams)) / len(bigrams), abs=1e-4)
    assert quality["repetition_rate_4"] == pytest.approx(repeated / len(fourgrams), abs=1e-4)
    assert quality["energy_joules_per_token"] == pytest.approx(1.5 / len(tokens), abs=1e-6)
    monkeypatch.setattr(energy, "meter_for_device", lambda device: energy.UnavailableMeter())
    assert json_result(capsys, *args)["quality"]["energy_joules_per_token"] == "unavailable"


def test_prompt_file_gives_the_same_answer_as_the_argument(capsys, model_dirs, tmp_path):
    options = ["--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "8", "--method", "ar", "--json"]
    code, out, _ = run_cli(capsys, "generate", PROMPT, *options)
    assert code == 0
    document = tmp_path / "prompt.txt"
    document.write_text(PROMPT, encoding="utf-8")
    code, from_file, _ = run_cli(capsys, "generate", "--prompt-file", str(document), *options)
    assert code == 0
    assert json.loads(from_file.splitlines()[-1])["token_ids"] == json.loads(out.splitlines()[-1])["token_ids"]
    for flag in ("--prompt", "-p"):  # llama.cpp's spelling, not an abbreviation of --prompt-file
        code, as_option, _ = run_cli(capsys, "generate", flag, PROMPT, *options)
        assert code == 0 and json.loads(as_option.splitlines()[-1])["token_ids"] == json.loads(out.splitlines()[-1])[
            "token_ids"]
    for twice in ((PROMPT, "--prompt-file", str(document)), (PROMPT, "--prompt", PROMPT)):
        code, _, err = run_cli(capsys, "generate", *twice, *options)
        assert_clean_error(code, err, "jointspec: error:", "give the prompt once")
    code, _, err = run_cli(capsys, "generate", "--prompt-file", str(tmp_path / "missing.txt"), *options)
    assert_clean_error(code, err, "jointspec: error:", "missing.txt")


@pytest.mark.parametrize("mode", ["sparse", "speckv", "specpc"])
def test_approximate_attention_says_it_is_approximate(capsys, model_dirs, mode):
    """--attention sparse|speckv|specpc decodes on the approximate target and says so; below its 2,048-token threshold
    (every prompt of these tiny models) it still sees the whole cache, so the tokens are exact decoding's."""
    options = ["--model", model_dirs["target"], "--no-chat", "--max-new-tokens", "8", "--method", "ar", "--json"]
    code, exact, _ = run_cli(capsys, "generate", PROMPT, *options)
    assert code == 0
    code, sparse, err = run_cli(capsys, "generate", PROMPT, "--attention", mode, *options)
    assert code == 0 and f"--attention {mode}: approximate decoding" in err
    assert json.loads(sparse.splitlines()[-1])["token_ids"] == json.loads(exact.splitlines()[-1])["token_ids"]


def test_generate_keeps_its_cost_curve_for_the_next_run(capsys, model_dirs, tmp_path, monkeypatch):
    """A cost-aware method measures the target's cost curve once; the next `generate` of the same model reads it
    back instead of measuring (nothing new written), and answers the same."""
    from jointspec.drafters import curve_store

    monkeypatch.delenv(curve_store.ENV)
    monkeypatch.setattr(curve_store, "default_directory", lambda: tmp_path)
    args = generate_args(model_dirs["target"], "--method", "pld", "--cost-aware", "--json")
    code, first, _ = run_cli(capsys, *args)
    assert code == 0 and len(list(tmp_path.glob("*.json"))) == 1
    read, written = record_curve_store(monkeypatch)
    code, second, _ = run_cli(capsys, *args)
    assert code == 0 and json.loads(second.splitlines()[-1])["text"] == json.loads(first.splitlines()[-1])["text"]
    assert len(read) == 1 and read[0] is not None and written == []


def test_an_empty_prompt_is_refused_before_the_model_loads(capsys, tmp_path):
    # The model path does not exist either: the prompt is read and refused first.
    for argv in (["generate", ""], ["generate", "--prompt", "  \n"]):
        code, _, err = run_cli(capsys, *argv, "--model", str(tmp_path / "no-such-model"))
        assert_clean_error(code, err, "jointspec: error:", "the prompt is empty")


def test_a_model_folder_without_tokenizer_or_weights_says_what_a_folder_holds(capsys, tmp_path, tokenizer):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    # No tokenizer: said so, not transformers' advice to install sentencepiece or tiktoken.
    code, _, err = run_cli(capsys, *generate_args(str(tmp_path)))
    assert_clean_error(code, err, "jointspec: error:", f"model folder '{tmp_path}' has no tokenizer",
                       "tokenizer.save_pretrained(folder)")
    assert "sentencepiece" not in err
    # A tokenizer but no weights.
    tokenizer.save_pretrained(tmp_path)
    code, _, err = run_cli(capsys, *generate_args(str(tmp_path)))
    assert_clean_error(code, err, "jointspec: error:", "could not load model", "tokenizer files and weights")


def test_an_ngram_table_as_a_draft_model_is_named(capsys, model_dirs, tmp_path):
    (tmp_path / "corpus.json").write_text("{}")
    code, _, err = run_cli(capsys, *generate_args(model_dirs["target"], "--method", "sps", "--draft", str(tmp_path)))
    assert_clean_error(code, err, "jointspec: error:", "n-gram table", "--method corpus")
