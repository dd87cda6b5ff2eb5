"""``jointspec chat``: each turn answered as ``generate`` answers the same conversation, the conversation kept between
turns and dropped by /reset, a turn the context cannot hold refused without ending the chat. A tiny byte-level model
saved to a folder, driven through the real CLI with its input piped. Deterministic (greedy, or seeded sampling of
the same draws both ways): no false-failure odds."""

from __future__ import annotations

import io
import re
import sys

import pytest

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import chat_template_ids
from jointspec.methods import MethodConfig

from helpers import assert_clean_error, run_cli

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
MAX_NEW_TOKENS = 12


@pytest.fixture
def model_folder(tmp_path, byte_model, tokenizer):
    tokenizer.chat_template = TEMPLATE
    byte_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def chat(capsys, monkeypatch, folder, lines: list[str], *options: str):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    return run_cli(capsys, "chat", "--model", str(folder), "--dtype", "float32",
                   "--max-new-tokens", str(MAX_NEW_TOKENS), *options)


def conversation(byte_model, tokenizer, user_turns: list[str | None], temperature: float = 0.0,
                 seed: int = 0) -> list[str]:
    """What ``generate`` (the Python API's loop, plain decoding) answers to ``user_turns`` (None: /reset), each
    turn's conversation holding the earlier answers; turn n samples with ``seed`` + n."""
    pipeline = Pipeline(CausalLM(byte_model), tokenizer, MethodConfig(name="ar"))
    messages, answers = [], []
    for text in user_turns:
        if text is None:
            messages = []
            continue
        messages.append({"role": "user", "content": text})
        config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, seed=seed + len(answers))
        answers.append(pipeline.generate_ids(chat_template_ids(tokenizer, messages), config).text)
        messages.append({"role": "assistant", "content": answers[-1]})
    return answers


@pytest.mark.parametrize("method", ["ar", "pld", "default"])
def test_each_turn_is_generates_answer_to_the_whole_conversation(capsys, monkeypatch, model_folder, byte_model,
                                                                 tokenizer, method):
    turns = ["abcabc", "and abc again", None, "abcabc"]
    code, out, err = chat(capsys, monkeypatch, model_folder, [t if t is not None else "/reset" for t in turns],
                          "--method", method)
    assert code == 0, err
    answers = conversation(byte_model, tokenizer, turns)
    assert out == "".join(answer + "\n" for answer in answers)
    # The conversation each turn read: the second holds the first turn and its answer, /reset starts over.
    first = [{"role": "user", "content": "abcabc"}]
    second = first + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": "and abc again"}]
    read = [int(n) for n in re.findall(r"conversation (\d+) tokens", err)]
    assert read == [len(chat_template_ids(tokenizer, m)) for m in (first, second, first)], err
    assert err.count(f"[{method}] ") == 3 and "(a new conversation)" in err


def test_a_sampled_chat_repeats_with_its_seed(capsys, monkeypatch, model_folder, byte_model, tokenizer):
    turns = ["abcabc", "more of it"]
    code, out, err = chat(capsys, monkeypatch, model_folder, turns, "--method", "ar", "--temperature", "0.9",
                          "--seed", "7")
    assert code == 0, err
    assert "seed 7" in err
    answers = conversation(byte_model, tokenizer, turns, temperature=0.9, seed=7)
    assert out == "".join(answer + "\n" for answer in answers)
    assert answers != conversation(byte_model, tokenizer, turns, temperature=0.9, seed=8)  # the seed matters


def test_a_turn_the_context_cannot_hold_is_refused_and_the_chat_goes_on(capsys, monkeypatch, model_folder, byte_model,
                                                                        tokenizer):
    long_turn = "x" * 300  # the tiny model holds 256 positions
    code, out, err = chat(capsys, monkeypatch, model_folder, [long_turn, "abcabc", "/exit", "never read"],
                          "--method", "pld")
    assert code == 0, err
    assert "the turn was not kept (/reset starts a new conversation)" in err and "context" in err
    assert out == "".join(answer + "\n" for answer in conversation(byte_model, tokenizer, ["abcabc"]))


def test_a_turn_over_several_lines_and_a_file_turn(capsys, monkeypatch, model_folder, byte_model, tokenizer, tmp_path):
    document = tmp_path / "notes.txt"
    document.write_text("abc abc\nabd abd\n")
    code, out, err = chat(capsys, monkeypatch, model_folder,
                          ["abc\\", "abd", f"/file {tmp_path / 'missing.txt'}", f"/file '{document}' what is it",
                           "/file"], "--method", "pld")
    assert code == 0, err
    turns = ["abc\nabd", "abc abc\nabd abd\n\nwhat is it"]
    answers = conversation(byte_model, tokenizer, turns)
    assert out == "".join(answer + "\n" for answer in answers)
    messages = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": turns[1]}]
    read = [int(n) for n in re.findall(r"conversation (\d+) tokens", err)]
    assert read == [len(chat_template_ids(tokenizer, messages[:1])), len(chat_template_ids(tokenizer, messages))]
    assert f"/file: cannot read '{tmp_path / 'missing.txt'}': No such file" in err
    assert "/file needs a path" in err


def test_a_turn_in_triple_quotes_is_sent_as_pasted(capsys, monkeypatch, model_folder, byte_model, tokenizer):
    # A paste reaches input() line by line; between a line that begins with triple quotes and a line of them alone
    # (ollama's way) it is one turn, sent as it is: a line that looks like a command, a // line, a trailing backslash
    # and pasted code's docstrings (indented, or with text beside the quotes) are text there.
    code, out, err = chat(capsys, monkeypatch, model_folder,
                          ['"""', "abc", "/reset", "//ab \\", "", '  abd"""', '    """Doc."""', '"""   ',
                           '"""one line"""', ' """abc', '"""', "ab"], "--method", "pld")
    assert code == 0, err
    turns = ['abc\n/reset\n//ab \\\n\n  abd"""\n    """Doc."""', "one line", ' """abc',
             "ab"]  # (input that ends inside quotes is sent)
    assert out == "".join(answer + "\n" for answer in conversation(byte_model, tokenizer, turns))
    assert "(a new conversation)" not in err and "unknown command" not in err


def test_ctrl_c_at_the_prompt_drops_the_lines_typed_inside_quotes_too(monkeypatch, capsys):
    from jointspec.cli import chat as chat_cli

    typed = iter(['"""', "half a paste", KeyboardInterrupt, "next", '"""x', KeyboardInterrupt, "/help"])

    def fake_input(prompt):
        item = next(typed)
        if item is KeyboardInterrupt:
            raise KeyboardInterrupt
        return item
    monkeypatch.setattr("builtins.input", fake_input)
    assert chat_cli._read_turn(True) == ("next", False)
    assert chat_cli._read_turn(True) == ("/help", False)  # not inside the quotes Ctrl-C left
    assert capsys.readouterr().err.count("Ctrl-D or /exit ends the chat") == 2


def test_ctrl_c_stops_an_answer_and_the_chat_goes_on(capsys, monkeypatch, model_folder, byte_model, tokenizer):
    """Ctrl-C while an answer is written stops that answer (what was shown stays in the conversation) and frees the
    engine's row: the next turn is answered."""
    from jointspec.cli import chat as chat_cli

    shown = []
    real_show = chat_cli.show

    def interrupted_once(text):
        if len(shown) == 1:  # the answer's second piece: Ctrl-C
            shown.append(None)
            raise KeyboardInterrupt
        shown.append(text)
        real_show(text)

    monkeypatch.setattr(chat_cli, "show", interrupted_once)
    code, out, err = chat(capsys, monkeypatch, model_folder, ["abcabc", "abcabc"], "--method", "ar")
    assert code == 0, err
    assert "(stopped)" in err and len(shown) >= 3
    part = shown[0]
    messages = [{"role": "user", "content": "abcabc"}, {"role": "assistant", "content": part},
                {"role": "user", "content": "abcabc"}]
    pipeline = Pipeline(CausalLM(byte_model), tokenizer, MethodConfig(name="ar"))
    answer = pipeline.generate_ids(chat_template_ids(tokenizer, messages),
                                   GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)).text
    assert out == part + "\n" + answer + "\n"


def test_options_are_checked_before_the_model_loads(capsys, monkeypatch, tmp_path):
    missing = tmp_path / "nothing-here"
    code, _, err = chat(capsys, monkeypatch, missing, ["hi"], "--temperature", "-1")
    assert_clean_error(code, err, "temperature")
    code, _, err = chat(capsys, monkeypatch, missing, ["hi"], "--method", "no-such-method")
    assert_clean_error(code, err, "no-such-method")
    code, _, err = chat(capsys, monkeypatch, missing, ["hi"], "--method", "pearl")  # (serve's check too)
    assert_clean_error(code, err, "method 'pearl' is not batched")


def test_commands_are_words_after_one_slash_and_file_keeps_the_question_as_typed(capsys, monkeypatch, model_folder,
                                                                                 byte_model, tokenizer, tmp_path):
    """/rest (a typo) is refused, not sent; //x sends /x; /usr/bin is a turn; /FILE is /file, its question kept as
    typed (quotes, apostrophes, spaces); a path with spaces goes in quotes; an empty file is refused; bytes that are
    not UTF-8 on piped input become U+FFFD."""
    document = tmp_path / "my notes.txt"
    document.write_text("abc abd")
    (tmp_path / "empty.txt").write_text("\n")
    question = "what's in  it, \"really\"?"
    lines = ["/rest", "//x", "/usr/bin", f"/FILE '{document}' {question}", f"/file {document} what",
             f"/file {tmp_path / 'empty.txt'}", "/file a\x00b", "/file ~no-such-user-here/x", f"/file {'n' * 300} q",
             "ab\udcffc", "/exit.", "never read"]
    code, out, err = chat(capsys, monkeypatch, model_folder, lines, "--method", "pld")
    assert code == 0, err
    turns = ["/x", "/usr/bin", f"abc abd\n\n{question}", "ab\ufffdc"]
    assert out == "".join(answer + "\n" for answer in conversation(byte_model, tokenizer, turns))
    assert "unknown command /rest" in err
    assert "a path with spaces goes in quotes" in err and "is empty" in err
    assert err.count("/file: cannot read") == 4 and "Traceback" not in err  # (NUL, ~user, a name too long)


def test_a_turn_stopped_before_anything_was_shown_is_not_kept(capsys, monkeypatch, model_folder, byte_model,
                                                              tokenizer):
    from jointspec.cli import chat as chat_cli

    real_show, calls = chat_cli.show, []

    def interrupted_first(text):
        calls.append(text)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_show(text)

    monkeypatch.setattr(chat_cli, "show", interrupted_first)
    code, out, err = chat(capsys, monkeypatch, model_folder, ["abcabc", "abd"], "--method", "ar")
    assert code == 0 and "(stopped; the turn was not kept)" in err
    assert out == conversation(byte_model, tokenizer, ["abd"])[0] + "\n"  # the next turn alone in the conversation


def test_a_turn_stopped_just_as_the_engine_takes_it_is_cancelled_not_decoded(byte_model, tokenizer):
    """Ctrl-C after the request went to the engine thread but before the engine said it took it: the cancel is sent
    once the engine answers, through the chat's loop, which must still run then (a loop per turn was closed by then,
    and the answer decoded to its end for nobody). Deterministic: the stop lands right after the hand-off."""
    import asyncio
    import contextlib

    from jointspec.cli.chat import _settle
    from jointspec.server.engine import CompletionRequest, ServingEngine

    engine = ServingEngine(CausalLM(byte_model), tokenizer, model_id="tiny", max_batch_size=1, max_queue=0)
    try:
        request = CompletionRequest(prompt="abcabc", max_tokens=200, temperature=0.0)
        real_put = engine._inbox.put

        async def stopped_as_handed_over():
            task = asyncio.current_task()

            def put_then_stop(item):
                real_put(item)
                if item[0] == "submit":
                    task.cancel()  # raised at submit's next await: waiting for the engine to take it

            engine._inbox.put = put_then_stop
            with contextlib.suppress(asyncio.CancelledError):
                await engine.submit(request)
            engine._inbox.put = real_put

        with asyncio.Runner() as runner:
            runner.run(stopped_as_handed_over())
            _settle(runner, engine)
            assert engine.is_idle()
        assert engine.snapshot().num_cancelled == 1
    finally:
        engine.close()


def test_a_later_turn_takes_the_conversations_cache_and_answers_the_same(tmp_path, monkeypatch, capsys):
    """On the int4 kernels the engine keeps the conversation's cache: turn 2 reads only what turn 1 did not, says
    so, and answers as with --prompt-cache-mb 0, which reuses nothing and says there is no cache."""
    from helpers import grouped_llama, read_prompts_row_by_row, word_tokenizer

    read_prompts_row_by_row(monkeypatch)
    folder = tmp_path / "model"
    grouped_llama(0).save_pretrained(folder)
    words = word_tokenizer(99)
    words.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    words.save_pretrained(folder)
    turns = [" ".join(f"w{5 + i % 60}" for i in range(30)), "w9 w10 w11 w12"]
    outs, reused, errs = [], [], []
    for budget in ("256", "0"):
        code, out, err = chat(capsys, monkeypatch, folder, turns, "--quantize", "int4", "--method", "ar",
                              "--prompt-cache-mb", budget)
        assert code == 0, err
        outs.append(out)
        errs.append(err)
        reused.append([int(n or 0) for n in re.findall(r"conversation \d+ tokens(?:, (\d+) of them from the cache)?",
                                                        err)])
    assert outs[0] == outs[1] and outs[0].count("\n") == 2
    assert reused[0][1] >= 30 and reused[1] == [0, 0], reused
    assert "no prompt cache here" not in errs[0] and "no prompt cache here (--prompt-cache-mb 0)" in errs[1]


def test_a_reasoning_models_thinking_shows_faint_on_a_terminal_and_template_variables_reach_it(
        capsys, monkeypatch, tmp_path, byte_model):
    """A template that opens a reasoning block (DeepSeek-R1's conventions) and reads a variable: on a terminal the
    answer, all thinking here (this random model never closes the block), is shown faint; piped, as written; and
    --chat-template-kwargs reaches the template."""
    from jointspec.cli import chat as chat_cli

    from helpers import byte_tokenizer

    tokenizer = byte_tokenizer()  # (its own: the fixture's is shared)
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'].split('</think>')[-1] }}"
                               "{% endfor %}<assistant>{% if note is defined %}{{ note }}{% endif %}<think>\n")
    byte_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    code, piped, err = chat(capsys, monkeypatch, tmp_path / "model", ["abcabc"], "--method", "ar")
    assert code == 0, err
    written = piped[:-1]  # (less the line's end)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(chat_cli.sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    code, shown, err = chat(capsys, monkeypatch, tmp_path / "model", ["abcabc"], "--method", "ar")
    assert code == 0, err
    assert shown == chat_cli.FAINT + written.strip() + chat_cli.PLAIN + "\n"
    monkeypatch.setenv("NO_COLOR", "1")  # (no-color.org: the text as written)
    assert chat(capsys, monkeypatch, tmp_path / "model", ["abcabc"], "--method", "ar")[1] == piped
    monkeypatch.delenv("NO_COLOR")
    # Ctrl-C while thinking: the terminal is not left faint.
    real_show, pieces = chat_cli.show, []

    def interrupted(text):
        if len(pieces) == 1:
            pieces.append(None)
            raise KeyboardInterrupt
        pieces.append(text)
        real_show(text)

    monkeypatch.setattr(chat_cli, "show", interrupted)
    code, stopped, err = chat(capsys, monkeypatch, tmp_path / "model", ["abcabc"], "--method", "ar")
    assert code == 0 and "(stopped" in err and stopped.startswith(chat_cli.FAINT)
    assert stopped.rstrip("\n").endswith(chat_cli.PLAIN), stopped
    # An answer cut inside its thinking is kept closed, so that the template drops it from the next turn's prompt.
    code, _, err = chat(capsys, monkeypatch, tmp_path / "model", ["abcabc", "abcabc"], "--method", "ar")
    kept = [{"role": "user", "content": "abcabc"}, {"role": "assistant", "content": written + "</think>"},
            {"role": "user", "content": "abcabc"}]
    read = [int(n) for n in re.findall(r"conversation (\d+) tokens", err)]
    assert code == 0 and read[1] == len(chat_template_ids(tokenizer, kept)), err
    code, _, err = chat(capsys, monkeypatch, tmp_path / "model", ["abcabc"], "--method", "ar",
                        "--chat-template-kwargs", '{"note": "xyz"}')
    read = [int(n) for n in re.findall(r"conversation (\d+) tokens", err)]
    assert code == 0 and read == [len(chat_template_ids(tokenizer, [{"role": "user", "content": "abcabc"}])) + 3]
