"""``jointspec chat``: a conversation on the terminal, each answer shown as it is written.

Each turn hands the whole conversation, as a chat client hands it to a server, to the batched engine ``serve`` runs,
here in the same process and without HTTP. Where that engine keeps a prompt cache, the conversation's cache stays from
one turn to the next, so a follow-up reads only its own new tokens rather than the whole conversation again (a second
question about a long document is answered at once). The engine gives a request ``generate``'s tokens, so a greedy
turn's answer is the one ``generate`` writes for the same conversation.

Lines typed are the user's turns (a line ending with a backslash continues on the next, and text from a line that
begins with triple quotes to a line of them alone is one turn: a paste of several lines); a word after one slash is a
command:
``/file PATH [question]`` sends a file's text, ``/reset`` starts a new conversation, ``/exit`` or ``/quit`` (or end
of input, Ctrl-D) ends the chat. Ctrl-C stops the answer being written (what was shown stays in the conversation).
Read from a pipe, each line is a turn and each answer is followed by a newline, so a conversation can be scripted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import sys
import time
from pathlib import Path

from jointspec.cli.commands import command_help
from jointspec.core.errors import ContextTooLongError, JointspecError

IDLE_TIMEOUT = 120.0  # seconds a stopped answer may take to leave the engine (a round of a long prompt's reading)
COMMANDS_HELP = (
    'a line ending with \\ continues on the next; """ opens a turn of several lines (a paste) and a line of """ alone '
    "closes it; /file PATH [question] sends a file's text (and the question after it; a path with spaces in quotes); "
    "/reset starts a new conversation; /exit, /quit or Ctrl-D ends the chat; Ctrl-C stops an answer; // sends a line "
    "that begins with /")


def add_parser(subparsers) -> None:
    from jointspec.cli.options import add_model_arguments, add_sampling_arguments, add_template_argument, positive_int
    from jointspec.cli.serve import non_negative_int

    parser = subparsers.add_parser("chat", help=command_help("chat"))
    add_model_arguments(parser)
    parser.add_argument("--system", metavar="TEXT", default=None,
                        help="a system message that opens the conversation (and every one /reset starts)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=512, help="new tokens at most per answer")
    add_template_argument(parser)
    add_sampling_arguments(parser, "fixes a sampled conversation: answer n (from 0) samples with seed + n "
                                   "(default: a fresh seed, reported when the chat starts)")
    parser.add_argument("--prompt-cache-mb", type=non_negative_int, default=256, metavar="MB",
                        help="the conversation's cache kept between turns, up to this many MB, so a turn reads only "
                             "its new tokens; 0 reads the whole conversation every turn (the lockstep engine only, "
                             "not the ragged one of float models)")
    # What generate runs by default; the serving engine's settings for one conversation at a time.
    parser.set_defaults(run=run_chat, method="default", quantize="auto", max_batch_size=1, max_queue=0,
                        model_id=None, online_memory="off")


def run_chat(args: argparse.Namespace) -> int:
    from jointspec.api import GenerationConfig
    from jointspec.cli.options import apply_threads, prebuild_kernels, sampling_options, say_quantize_choice, with_flags
    from jointspec.cli.serve import build_engine
    from jointspec.core.sampling import fresh_seed

    try:  # generate's check of the same options, before the model loads
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed, **sampling_options(args))
    except ValueError as error:
        raise JointspecError(with_flags(str(error))) from None
    # Sampled: the conversation's seed (answer n samples with seed + n); greedy: none.
    seed = (args.seed if args.seed is not None else fresh_seed()) if args.temperature > 0 else None
    prebuild_kernels(args)
    apply_threads(args)
    from jointspec.drafters.curve_store import persisted_curves

    args.max_tokens = args.max_new_tokens  # (the engine's answer length where a request gives none)
    with persisted_curves():
        engine = build_engine(args)
        try:
            say_quantize_choice(args)
            try:  # a bias on a token the model lacks: refused once, not at every turn
                config.penalties.check_vocab(engine.target.vocab_size)
            except JointspecError as error:
                raise JointspecError(with_flags(str(error))) from None
            return _converse(engine, args, seed)
        finally:
            engine.close()


def _converse(engine, args: argparse.Namespace, seed: int | None) -> int:
    interactive = sys.stdin.isatty()
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    if interactive:
        with contextlib.suppress(ImportError):  # line editing and history for input() where the platform has it
            import readline  # noqa: F401
        print(f"jointspec chat: {engine.model_id} (method {args.method}){f'; seed {seed}' if seed is not None else ''}"
              ". /help lists the commands; /exit or Ctrl-D ends the chat.", file=sys.stderr, flush=True)
    elif seed is not None:
        print(f"jointspec chat: seed {seed}", file=sys.stderr, flush=True)
    if not engine.keeps_prompts:
        print("jointspec chat: no prompt cache here (" + ("--prompt-cache-mb 0" if not args.prompt_cache_mb else
              "the batched engine of float models keeps none") + "): every turn reads the whole conversation again",
              file=sys.stderr, flush=True)
    turn = 0
    # One event loop for the whole chat: a request the engine takes after Ctrl-C has stopped its turn is cancelled
    # through this loop, which must still be there to hear of it (_settle).
    with asyncio.Runner() as runner:
        while True:
            read = _read_turn(interactive)
            if read is None:
                return 0
            line, quoted = _text(read[0]), read[1]
            command = None if quoted else _command(line)
            if not line.strip() or command in ("/exit", "/quit"):
                if command:
                    return 0
                continue
            if command == "/reset":
                messages = list(opening)
                print("(a new conversation)", file=sys.stderr, flush=True)
                continue
            if command == "/help":
                print(COMMANDS_HELP, file=sys.stderr, flush=True)
                continue
            if command is not None and command != "/file":
                print(f"jointspec: unknown command {command}; /help lists them (begin a turn with // to send a line "
                      "that begins with /)", file=sys.stderr, flush=True)
                continue
            if command == "/file":
                try:
                    line = _file_turn(line)
                except JointspecError as error:
                    print(f"jointspec: {error}", file=sys.stderr, flush=True)
                    continue
            elif not quoted and line.lstrip().startswith("//"):
                line = line.replace("/", "", 1)
            messages.append({"role": "user", "content": line})
            answer = _Answer()
            turn_seed = None if seed is None else (seed + turn) % 2 ** 63  # (what a torch.Generator takes)
            coroutine = _answer(engine, messages, args, turn_seed, answer)
            try:
                runner.run(coroutine)
            except KeyboardInterrupt:  # stop this answer, not the chat
                coroutine.close()  # (one stopped before it began was never awaited)
                _settle(runner, engine)
                answer.stopped = True
            except (JointspecError, ValueError) as error:  # this turn refused (the context is full): the chat goes on
                messages.pop()
                _end_line(answer, finished=False)
                hint = " (/reset starts a new conversation)" if isinstance(error, ContextTooLongError) else ""
                print(f"jointspec: {error}; the turn was not kept{hint}", file=sys.stderr, flush=True)
                continue
            _end_line(answer, finished=not answer.stopped)
            if answer.stopped and not answer.text:  # nothing shown: as if the turn had not been asked
                messages.pop()
                print("(stopped; the turn was not kept)", file=sys.stderr, flush=True)
                continue
            turn += 1
            messages.append(answer.message())
            if answer.stopped or answer.summary:
                print("(stopped)" if answer.stopped else answer.summary, file=sys.stderr, flush=True)


def _settle(runner: asyncio.Runner, engine) -> None:
    """After Ctrl-C: wait until the stopped answer has left the engine, running the chat's loop meanwhile (a request
    the engine took just as the turn stopped is cancelled from there). Ctrl-C again only waits on."""
    deadline = time.monotonic() + IDLE_TIMEOUT
    while True:
        try:
            if engine.is_idle():
                return
            if time.monotonic() > deadline:
                raise JointspecError(f"the engine did not free the stopped answer's row within {IDLE_TIMEOUT:g} s")
            runner.run(asyncio.sleep(0.01))
        except KeyboardInterrupt:
            continue


def _end_line(answer, finished: bool) -> None:
    """Ends the answer's line on stdout: each answer is followed by a newline, one stopped or failed part-way too."""
    if answer.text or finished:
        sys.stdout.write("\n")
        sys.stdout.flush()


def _text(line: str) -> str:
    """A line as text: bytes that are not UTF-8 (piped input reads them as lone surrogates) become U+FFFD."""
    return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _command(line: str) -> str | None:
    """The command a line gives (``/reset``, ``/FILE`` as ``/file``), or None for a turn; a word of letters after
    one slash is a command, so a path such as ``/usr/bin`` and ``//`` lines are turns."""
    word = line.strip().split(None, 1)[0] if line.strip() else ""
    found = re.fullmatch(r"(/[A-Za-z]+)[.!?]*", word)  # (/exit. and /help? too)
    return found.group(1).lower() if found else None


BLOCK = '"""'  # a line that begins with it opens a turn of several lines; a line of it alone closes it


def _read_turn(interactive: bool) -> tuple[str, bool] | None:
    """The user's next turn and whether it came in triple quotes: a line; lines joined where each but the last ends
    with a backslash; or the lines from one that begins with triple quotes to a line of triple quotes alone (a paste
    of several lines, as ollama takes it: a terminal hands Python's input() a paste line by line), the quotes left
    out and the text sent as it is, never read as a command. Only quotes alone at a line's start close it, so pasted
    code's docstrings (indented, or with text beside them) stay inside. None at the end of input (Ctrl-D; piped
    input that ends inside a turn sends what it has). Ctrl-C at the prompt drops what was typed and asks again."""
    lines: list[str] = []
    block = False  # inside triple quotes
    while True:
        if interactive:
            try:
                line = input("> " if not lines and not block else ". ")
            except EOFError:
                print(file=sys.stderr)
                return None
            except KeyboardInterrupt:
                print("\n(Ctrl-D or /exit ends the chat)", file=sys.stderr, flush=True)
                lines, block = [], False
                continue
        else:
            line = sys.stdin.readline()
            if not line:
                if block:
                    return _quoted(lines), True
                return ("\n".join(lines), False) if lines else None
            line = line.rstrip("\r\n")
        if not block and not lines and line.startswith(BLOCK):  # (' """...' is a line of text)
            rest = line[len(BLOCK):]
            if rest.rstrip().endswith(BLOCK):  # '"""text"""': a turn of one line
                return rest.rstrip()[:-len(BLOCK)], True
            lines, block = [rest], True
            continue
        if block:
            if line.rstrip() != BLOCK:
                lines.append(line)
                continue
            return _quoted(lines), True
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines), False


def _quoted(lines: list[str]) -> str:
    """The text of a turn in triple quotes: its lines, less the opening quotes' own line where they stand alone."""
    return "\n".join(lines[1:] if lines and not lines[0].strip() else lines)


def _file_turn(line: str) -> str:
    """``/file PATH [question]``: the file's text, then the question as typed after a blank line (a document and a
    question). A path with spaces goes in quotes."""
    rest = line.strip()[len("/file"):].strip()
    if rest[:1] in ("'", '"'):
        end = rest.find(rest[0], 1)
        if end < 0:
            raise JointspecError(f"/file: the path's closing {rest[0]} is missing")
        name, question = rest[1:end], rest[end + 1:].strip()
    else:
        name, _, question = rest.partition(" ")
        question = question.strip()
    if not name:
        raise JointspecError("/file needs a path: /file report.txt [a question about it]")
    path = Path(name)
    try:
        path = path.expanduser()
        document = path.read_text(encoding="utf-8")
    except (OSError, ValueError, RuntimeError) as error:  # (a NUL in the path, ~nosuchuser, a name too long)
        missing = False
        with contextlib.suppress(OSError, ValueError):
            missing = not path.exists()
        hint = "; a path with spaces goes in quotes" if question and missing else ""
        raise JointspecError(f"/file: cannot read '{path}': {getattr(error, 'strerror', None) or error}{hint}"
                             ) from None
    if not document.strip():
        raise JointspecError(f"/file: '{path}' is empty")
    return document.rstrip("\n") + (f"\n\n{question}" if question else "")


def show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# A reasoning model's thinking, shown faint on a terminal (ANSI's faint, then reset): apart from its answer.
FAINT, PLAIN = "\x1b[2m", "\x1b[0m"


def _styled() -> bool:
    """Whether the answer may be styled: a terminal that takes ANSI's codes, and no NO_COLOR (no-color.org)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


class _Shown:
    """What a turn shows of its answer as it comes. On a terminal, a reasoning model's thinking (its <think> block,
    server/reasoning.py) faint and its answer after a blank line; elsewhere (a pipe, a file), the text as written.
    Either way it follows whether the answer is inside its thinking (:attr:`in_thinking`)."""

    def __init__(self, opens_reasoning: bool | None, tags=None) -> None:
        from jointspec.server.reasoning import THINK, ReasoningStream

        self.tags = tags or THINK  # (the template's reasoning tags)
        self.split = ReasoningStream(opens_reasoning, self.tags) if opens_reasoning is not None else None
        self.styled = self.split is not None and _styled()
        self.thinking = False  # inside the faint part now
        self.thought = False  # some thinking was shown

    @property
    def in_thinking(self) -> bool:
        """Whether the answer so far ends inside its thinking (stopped there, it needs its closing tag)."""
        return self.split is not None and self.split.state == "reasoning"

    def feed(self, text: str, final: bool) -> None:
        if self.split is None:
            if text:
                show(text)
            return
        reasoning, content = self.split.feed(text, final)
        if not self.styled:
            if text:
                show(text)
            return
        shown = ""
        if reasoning:
            shown += ("" if self.thinking else FAINT) + reasoning
            self.thinking = self.thought = True
        if self.thinking and (content or final):
            shown += PLAIN + ("\n\n" if content else "")
            self.thinking = False
        if shown or content:
            show(shown + content)


class _Answer:
    """What a turn wrote, kept as it arrives, so a stopped answer still has the text that was shown."""

    def __init__(self) -> None:
        self.text = ""
        self.summary = ""
        self.stopped = False  # Ctrl-C stopped it
        self.reasoning = None  # (whether its prompt opened a block, its tags), where the answer is read for reasoning

    def message(self) -> dict:
        """The answer as the conversation keeps it: as written, or, where its reasoning tags are special tokens
        (Gemma 4's channel), its content with its reasoning apart: the text of a message is read as text, so a template
        would not see such tags in it to drop earlier thinking."""
        if self.reasoning is None or not self.reasoning[1].kept:
            return {"role": "assistant", "content": self.text}
        from jointspec.server.reasoning import split_reasoning

        parts = split_reasoning(self.text, *self.reasoning)
        message = {"role": "assistant", "content": parts.content}
        if parts.reasoning is not None:
            message["reasoning_content"] = parts.reasoning
        return message


async def _answer(engine, messages: list[dict], args: argparse.Namespace, seed: int | None, answer: _Answer) -> None:
    from jointspec.api import GenerationConfig
    from jointspec.cli.options import sampling_options
    from jointspec.server.engine import CompletionRequest

    config = GenerationConfig(**sampling_options(args))
    request = CompletionRequest(messages=tuple(dict(m) for m in messages), temperature=config.temperature,
                                top_k=config.top_k, top_p=config.top_p, min_p=config.min_p, seed=seed or 0,
                                penalties=config.penalties, template_kwargs=args.chat_template_kwargs)
    start = time.perf_counter()
    generation = await engine.submit(request)
    shown = _Shown(generation.opens_reasoning, getattr(generation, "reasoning_tags", None))
    if generation.opens_reasoning is not None:
        answer.reasoning = (generation.opens_reasoning, shown.tags)
    first = None
    tokens = 0
    try:
        async for chunk in generation:
            if chunk.failure is not None:
                raise JointspecError(chunk.failure.message)
            if chunk.text or chunk.finish_reason is not None:
                first = first or (time.perf_counter() if chunk.text else None)
                shown.feed(chunk.text, final=chunk.finish_reason is not None)
                answer.text += chunk.text
            tokens += chunk.num_tokens
            if chunk.finish_reason is not None:
                answer.summary = _summary(args, generation.num_prompt_tokens, tokens, chunk, start, first)
    finally:
        if shown.thinking:  # (stopped mid-thinking: what follows is not faint)
            show(PLAIN)
        if shown.in_thinking and answer.text:
            # (an answer that ends inside its thinking, stopped or cut, keeps it closed: a template that drops
            # earlier thinking then drops it, rather than show it to the model as the answer)
            answer.text += shown.tags.close
        generation.cancel()  # (a no-op once it ended; frees the row when Ctrl-C stopped the answer)


def _summary(args: argparse.Namespace, num_prompt_tokens: int, tokens: int, last, start: float,
             first: float | None) -> str:
    """One line after an answer: speed, speculation, and how much of the conversation the cache spared reading."""
    end = time.perf_counter()
    stats = last.stats
    reused = stats.prompt_tokens_reused if stats is not None else 0
    decode = end - (first or end)
    parts = [f"[{args.method}] {tokens} token{'' if tokens == 1 else 's'}"]
    if tokens >= 8 and decode > 0:  # (fewer make no speed worth reading)
        parts.append(f"{(tokens - 1) / decode:.1f} tok/s")
    if stats is not None and stats.num_rounds:
        parts.append(f"{stats.mean_accepted_tokens:.2f} tokens per call")
    parts.append(f"first token after {((first or end) - start):.2f} s; conversation {num_prompt_tokens} tokens"
                 + (f", {reused} of them from the cache" if reused else ""))
    if last.finish_reason == "length":
        parts.append("cut at --max-new-tokens" if tokens >= args.max_new_tokens else
                     "cut where the model's context ends (/reset starts a new conversation)")
    return "; ".join(parts)
