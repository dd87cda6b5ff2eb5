"""``jointspec`` command line. Subcommands live in their own modules and add themselves via ``add_parser``."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from jointspec.cli.commands import COMMANDS, command_help
from jointspec.cli.options import (
    add_model_arguments,
    add_sampling_arguments,
    add_template_argument,
    apply_threads,
    check_reads,
    method_config_from_args,
    model_options,
    positive_int,
    prebuild_kernels,
    sampling_options,
    say_quantize_choice,
    with_flags,
)
from jointspec.core.errors import JointspecError

DEFAULT_PROMPT = ("Summarise in two sentences: Speculative decoding lets a small draft propose several tokens that "
                  "the large model checks in one forward pass, so generation gets faster without changing what the "
                  "large model would have written.")


def _add_generate(subparsers) -> None:
    parser = subparsers.add_parser("generate", help=command_help("generate"))
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt (default: a short summarisation task)")
    # As llama.cpp's -p / --prompt; without it, argparse reads --prompt as an abbreviation of --prompt-file.
    parser.add_argument("-p", "--prompt", dest="prompt_option", metavar="TEXT", default=None,
                        help="the prompt, as an option (the same as giving it as the argument)")
    parser.add_argument("--prompt-file", metavar="PATH", default=None,
                        help="read the prompt from this text file ('-': standard input), e.g. a long document and a "
                             "question about it")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="new tokens at most")
    add_sampling_arguments(parser, "fixes a sampled answer (default: a fresh seed per run, reported so the answer "
                                   "can be repeated)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
    add_template_argument(parser)
    parser.add_argument("--attention", choices=("full", "sparse", "speckv", "specpc"), default="full",
                        help="APPROXIMATE (lossy) decoding for long inputs, past 2,048 tokens of context. sparse: "
                             "the model sees only attention sinks, its last 1,024 tokens and the input spans its "
                             "context points to; speckv: only the 1,296 prompt tokens a 16-token lookahead attends "
                             "to most, and its answer; specpc: the model reads only the 1,296 prompt tokens its "
                             "first quarter of layers attends to most from the prompt's end, which also cuts the time "
                             "to the first token (docs/long-inputs.md)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--logprobs", type=int, metavar="N", default=None,
                        help="each new token's log-probability under the model (temperature 1, before top-k, top-p "
                             "and a format), with its N most likely alternatives (0 to 20): --json's 'logprobs', "
                             "else a table on stderr after the answer")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA", default=None,
                       help="structured output: the answer is JSON that this schema accepts (the schema inline, or "
                            "a path to a .json file); works with every method (docs/structured-output.md)")
    shape.add_argument("--json-object", action="store_true", help="structured output: the answer is a JSON object")
    shape.add_argument("--regex", metavar="PATTERN", default=None,
                       help="structured output: the whole answer matches this regular expression")
    shape.add_argument("--lark", metavar="PATH", default=None,
                       help="structured output: the answer is a sentence of this Lark grammar (llguidance's dialect)")
    # generate's default is the fastest exact configuration (the bench's `default`, which serve also runs; the bench
    # runs its --methods). Its quantisation likewise: auto runs the embedded default on the int4 kernel that
    # recovers its own weights.
    parser.set_defaults(run=_run_generate, method="default", quantize="auto")


def _run_generate(args: argparse.Namespace) -> int:
    prebuild_kernels(args)  # first: a first run compiles them while the rest imports and loads
    from jointspec.api import GenerationConfig, Pipeline
    from jointspec.backends.tokens import TokenSpelling
    from jointspec.core.sampling import fresh_seed
    from jointspec.methods import method_names
    from jointspec.methods.registry import method_is_lossless, unknown_method_error

    if args.method not in method_names():
        raise JointspecError(unknown_method_error(args.method))
    # Without --seed a sampled answer is a fresh one each run, as in llama.cpp's CLI; the seed drawn is reported.
    seed = args.seed if args.seed is not None else fresh_seed()
    try:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, seed=seed, chat=not args.no_chat,
                                  chat_template_kwargs=args.chat_template_kwargs,
                                  output_format=_output_format(args), logprobs=args.logprobs,
                                  **sampling_options(args))
        method = method_config_from_args(args)
        check_reads(method, args)
    except ValueError as error:
        raise JointspecError(with_flags(str(error))) from error
    prompt = _prompt_text(args)  # before the model loads: a prompt that cannot be read fails at once
    if not prompt.strip():
        raise JointspecError("the prompt is empty; pass some text (as the argument, --prompt, --prompt-file or on "
                             "stdin with --prompt-file -)")
    from jointspec.backends.loading import check_model_path, load_model

    check_model_path(method.draft, "--draft")  # before the target loads
    apply_threads(args)
    from jointspec.drafters.approximate import with_attention
    from jointspec.drafters.curve_store import persisted_curves

    # Pipeline.load's two steps, with the target wrapped in between where --attention asks for an approximate one.
    model, tokenizer = load_model(args.model, **model_options(args))
    with persisted_curves():  # one answer per process: the cost curve measured by an earlier run is read back
        pipeline = Pipeline(with_attention(model, args.attention), tokenizer, method, **model_options(args))
    if args.attention != "full":
        where = ("once its context passes 2,048 tokens" if args.attention == "sparse"
                 else "after a prompt of 2,048 tokens or more")
        print(f"jointspec: --attention {args.attention}: approximate decoding; the output is not the model's own "
              f"{where}", file=sys.stderr)
    say_quantize_choice(args)
    if args.json:
        from jointspec.analysis.quality import quality_report
        from jointspec.bench.energy import meter_for_device

        meter = meter_for_device(args.device)
        meter.start()
        result = pipeline.generate(prompt, config)
        joules = meter.stop()
        record = result.to_dict()
        if result.logprobs is not None:  # with each token's own text, and its alternatives'
            spell = TokenSpelling(tokenizer)
            for entry in record["logprobs"]:
                entry["token"] = spell(entry["token_id"])[0]
                entry["top"] = [{"token_id": token_id, "token": spell(token_id)[0], "logprob": value}
                                for token_id, value in entry["top"]]
        if args.temperature > 0:
            record["seed"] = seed
        # Scored by the model with its whole cache, also when it decoded over a sparse view.
        record["quality"] = quality_report(model, result.prompt_ids, result.token_ids, joules)
        # Whether the text is the model's own, over full attention: greedy, every method's (each verifier reduces to
        # greedy matching, MTAD's too: token-identical to plain decoding); sampled, a lossless method's (the model's
        # own law).
        record["attention"] = args.attention
        record["exact"] = args.attention == "full" and (config.sampling.greedy or method_is_lossless(args.method))
        print(json.dumps(record))
        _say_if_drafted_nothing(method, result.stats)
        return 0

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    with _prefill_bar(pipeline.target):
        result = pipeline.generate(prompt, config, on_text=show)
    stats = result.stats
    decode_seconds = result.seconds - stats.prefill_seconds
    print(f"\n[{args.method}] prompt {len(result.prompt_ids)} tokens read in {stats.prefill_seconds:.2f} s; "
          f"{result.num_new_tokens} tokens in {decode_seconds:.2f} s = "
          f"{result.num_new_tokens / decode_seconds if decode_seconds > 0 else 0.0:.1f} tok/s; "
          f"{stats.num_rounds} target calls, "
          f"{stats.mean_accepted_tokens:.2f} tokens per call, acceptance {stats.acceptance_rate:.0%} "
          f"{f'({stats.num_forced_tokens} accepted tokens forced by the format) ' if stats.num_forced_tokens else ''}"
          f"({pipeline.target.name}){f'; seed {seed}' if args.temperature > 0 else ''}", file=sys.stderr)
    _say_if_context_ended(result, args.max_new_tokens, pipeline.target.max_context)
    _say_if_drafted_nothing(method, stats)
    if result.logprobs is not None:
        _print_logprobs(result.logprobs, TokenSpelling(tokenizer))
    return 0


def _print_logprobs(figures, spell) -> None:
    """--logprobs without --json: one line per new token on stderr, its log-probability and its alternatives'."""
    print("log-probabilities (token, its log-probability, then the most likely tokens):", file=sys.stderr)
    for figure in figures:
        others = "  ".join(f"{spell(token_id)[0]!r} {value:.3f}" for token_id, value in figure.top)
        print(f"  {spell(figure.token_id)[0]!r} {figure.logprob:.3f}{'    ' + others if others else ''}",
              file=sys.stderr)


def _output_format(args: argparse.Namespace):
    """The structured output --json-schema, --json-object, --regex or --lark asks for (None: free text)."""
    from jointspec.core.grammar import OutputFormat

    if args.json_object:
        output_format = OutputFormat.json_schema()
    elif args.regex is not None:
        output_format = OutputFormat("regex", args.regex)
    elif args.lark is not None:
        output_format = OutputFormat("lark", _read_text(args.lark, "--lark"))
    elif args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):  # not inline JSON: a file
            text = _read_text(text, "--json-schema")
        output_format = OutputFormat.json_schema(text)
    else:
        return None
    output_format.check()  # now, not once the model has loaded
    return output_format


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise JointspecError(f"{flag} {path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise JointspecError(f"{flag} {path}: not UTF-8 text ({error})") from None


def _say_if_context_ended(result, max_new_tokens: int, max_context: int) -> None:
    """A line on stderr where the answer stopped because the model's context was full, not at --max-new-tokens."""
    if (result.finish_reason == "length" and result.num_new_tokens < max_new_tokens
            and len(result.prompt_ids) + result.num_new_tokens >= max_context):
        count = f"{result.num_new_tokens} token" + ("" if result.num_new_tokens == 1 else "s")
        print(f"jointspec: the answer stopped after {count}: the prompt's "
              f"{len(result.prompt_ids):,} tokens and the answer filled the model's {max_context:,}-token context "
              "(--max-new-tokens asked for more)", file=sys.stderr)


# Rounds after which a method that drafted nothing is worth a word (a short answer may end before a lookup matches).
QUIET_ROUNDS = 16


def _say_if_drafted_nothing(method, stats) -> None:
    """A speculative method that drafted nothing ran as plain decoding: say so, and why it can, rather than leave a
    user to wonder why it was no faster."""
    from jointspec.methods.registry import resolved_cost_aware

    if method.name in ("ar", "oracle") or stats.num_draft_tokens or stats.num_rounds < QUIET_ROUNDS:
        return
    if method.name == "sparse-self":
        why = "it drafts only once the context passes 2,048 tokens (a long input)"
    elif resolved_cost_aware(method):
        why = ("it drafts only where it finds a draft and the target's measured costs and the running acceptance say "
               "the draft pays (a draft as dear as a target step, such as --draft self, never does; a head whose "
               "tokens the target rarely accepts seldom does)")
        if method.name not in ("default", "hybrid-tree"):
            why += "; --no-cost-aware drafts every round"
    else:
        why = "its drafter found nothing to propose (lookup drafts only where the text repeats itself)"
    print(f"jointspec: {method.name} drafted no tokens in {stats.num_rounds} rounds, so this was plain decoding: "
          f"{why}", file=sys.stderr)


def _prompt_text(args: argparse.Namespace) -> str:
    given = [args.prompt is not None, args.prompt_option is not None, args.prompt_file is not None]
    if sum(given) > 1:
        raise JointspecError("give the prompt once: as the argument, with --prompt or with --prompt-file, not more")
    if args.prompt_option is not None:
        return args.prompt_option
    if args.prompt_file is None:
        return args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.prompt_file == "-":
        return sys.stdin.read()
    try:
        return Path(args.prompt_file).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise JointspecError(f"cannot read --prompt-file '{args.prompt_file}': {error}") from error


@contextlib.contextmanager
def _prefill_bar(target):
    """A progress bar on stderr while a long prompt is read (the target reports the chunks of a prefill; a prompt
    of up to PREFILL_CHUNK tokens is read in about a second, with no bar)."""
    if not hasattr(target, "prefill_progress"):
        yield
        return
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        from jointspec.backends.hf import PREFILL_CHUNK

        if total <= PREFILL_CHUNK:
            return
        if bar is None:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="reading the prompt", unit="tok", leave=False, file=sys.stderr)
        bar.update(done - bar.n)

    target.prefill_progress = update
    try:
        yield
    finally:
        target.prefill_progress = None
        if bar is not None:
            bar.close()


def _add_methods(subparsers) -> None:
    parser = subparsers.add_parser("methods", help=command_help("methods"))
    parser.set_defaults(run=_run_methods)


def _run_methods(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from jointspec.cli.options import cli_flag
    from jointspec.methods import MethodConfig, method_summaries
    from jointspec.methods.registry import method_reads

    flags = {field.name for field in fields(MethodConfig)}  # the oracle's own settings are bench keys only
    for name, summary in method_summaries().items():
        print(f"{name:12s} {summary}")
        options = ", ".join(cli_flag(option) for option in sorted(method_reads(name)) if option in flags)
        print(f"{'':12s}   options: {options or 'none'}")
    from jointspec.bench.specs import HF_METHODS, LLAMACPP_METHODS

    # Rows `jointspec bench --methods` also takes: other engines' own loops, run beside jointspec's as references.
    print("\nreference rows of `jointspec bench` (other engines' own loops; spec keys, not flags):")
    for name, keys in {**HF_METHODS, **LLAMACPP_METHODS}.items():
        engine = "transformers' generate" if name in HF_METHODS else "llama-cpp-python's generation loop"
        print(f"{name:12s} {engine}; keys: {', '.join(keys) or 'none'}")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: every subcommand's options, or, given the ``command`` a run asks for, that subcommand's
    options and the others' names only (each subcommand's module imports what it runs, torch and transformers among
    them: seconds that ``jointspec --help`` should not wait for)."""
    import importlib

    from jointspec import __version__

    parser = argparse.ArgumentParser(
        prog="jointspec", description="Speculative and multi-token joint decoding for Hugging Face causal LMs.",
        epilog="`jointspec SUBCOMMAND --help` lists a subcommand's options; docs/cli.md describes them all.")
    parser.add_argument("--version", action="version", version=f"jointspec {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    builders = {"generate": _add_generate, "methods": _add_methods}
    for name, (module, summary) in COMMANDS.items():
        if command is not None and name != command:
            subparsers.add_parser(name, help=summary)  # listed; its options are added when it is the one run
        elif name in builders:
            builders[name](subparsers)
        else:
            importlib.import_module(module).add_parser(subparsers)
    for subparser in subparsers.choices.values():
        subparser.formatter_class = DefaultsHelpFormatter
    return parser


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with its default (the subcommand's own, where ``set_defaults`` gives it one), unless
    the help already says it or there is none to say (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        says = any(phrase in text for phrase in ("(default", "default:", "by default"))
        if (not action.option_strings or says or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: %(default)s)"


class Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, ``docker stop``, a CI's cancel), raised in the main thread as Ctrl-C's interrupt is, so
    that what a command cleans up on Ctrl-C (a model half prepared, a report half written) is cleaned up too."""


def _terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    # (A server's uvicorn puts its own draining handler in place while it serves, and restores this one after.)
    on_term = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if on_term:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        return _main(argv)
    finally:
        if on_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _main(argv: list[str] | None) -> int:
    level = os.environ.get("JOINTSPEC_LOG", "").strip().upper() or "WARNING"  # (set but empty: the default)
    if level not in logging.getLevelNamesMapping():  # (logging's own names: WARN and FATAL too)
        print(f"jointspec: error: JOINTSPEC_LOG={os.environ['JOINTSPEC_LOG']!r} is not a log level; use one of "
              f"{', '.join(LOG_LEVELS)} (or leave it unset: WARNING)", file=sys.stderr)
        return 2
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # transformers is chatty on load (GGUF dequantisation notes, generation-config notes); keep the CLI readable.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else list(argv)
    # The subcommand is the first word that is not an option (the options before it take no values).
    command = next((word for word in argv if not word.startswith("-")), None)
    try:
        # (inside: building the parser imports the command's modules, seconds a Ctrl-C may fall into)
        args = build_parser(command if command in COMMANDS else "").parse_args(argv)
        with _library_bars_off(getattr(args, "no_progress", False)):
            return args.run(args)
    except JointspecError as error:
        _say_if_still_building()
        print(f"jointspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # what a command had not finished is lost, and the user should know it
        grouped = sys.modules.get("jointspec.kernels.grouped")
        if grouped is not None:  # a build thread waiting for another process's build would keep the process alive
            grouped.stop_builds()
        how = "terminated" if isinstance(interrupt, Terminated) else "interrupted"
        print(f"jointspec: {how}: {command or 'the command'} stopped before it finished", file=sys.stderr)
        return 143 if isinstance(interrupt, Terminated) else 130
    except BrokenPipeError:  # the reader went away (`jointspec methods | head`): nothing more to say, no traceback
        # Python flushes stdout again on exit: point it at /dev/null so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception:  # a fault no check names (a bug, here or below): the traceback, and what a report needs
        traceback.print_exc()
        _say_if_still_building()
        print(f"jointspec: unexpected error in `jointspec {command or ''}` (a bug: a report with the traceback above "
              "and the output of `jointspec info` helps fix it)", file=sys.stderr)
        return 1


@contextlib.contextmanager
def _library_bars_off(off: bool):
    """``--no-progress`` also silences transformers' own bars (its "Loading weights" bar as a model loads), for the
    command's duration only: main() may run again in the same process."""
    if not off:
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers_logging.enable_progress_bar()


def _say_if_still_building() -> None:
    """A run that stops on an error before it needed the kernels still waits for the build it started ahead
    (grouped.prebuild: stopping the compiler midway would leave its lock to the next run): say why the process
    lingers after its error."""
    grouped = sys.modules.get("jointspec.kernels.grouped")
    if grouped is not None and grouped.prebuild_compiling():
        print("jointspec: finishing the CPU kernel build this run started (about a minute; kept for the next run)",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
