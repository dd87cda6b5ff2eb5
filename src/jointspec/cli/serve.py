"""``jointspec serve``: load a model, start the batched engine, serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import sys

from jointspec.cli.commands import command_help
from jointspec.core.errors import JointspecError


def add_parser(subparsers) -> None:
    from jointspec.cli.options import add_model_arguments, positive_int

    parser = subparsers.add_parser("serve", help=command_help("serve"))
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    parser.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    parser.add_argument("--max-batch-size", type=positive_int, default=16, help="sequences decoded together")
    parser.add_argument("--max-tokens", type=positive_int, default=256,
                        help="new tokens when a chat request does not say")
    parser.add_argument("--model-id", default=None, help="the name /v1/models reports (default: the model source)")
    parser.add_argument("--max-queue", type=non_negative_int, default=64,
                        help="requests that may wait for a row when every row is busy; past that a request gets "
                             "429 with Retry-After at once (default 64)")
    parser.add_argument("--request-timeout", type=positive_float, default=None, metavar="SECONDS",
                        help="stop a request this long after it arrived and answer 504 (default: no limit)")
    parser.add_argument("--drain-timeout", type=non_negative_float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM or Ctrl-C, how long requests in flight may take to finish before they get "
                             "an error (default 30); new requests get 503 meanwhile")
    parser.add_argument("--online-memory", choices=("off", "user", "shared"), default="off",
                        help="online adaptation: the lookup drafters (pld, corpus, lookahead, aded, and the lookup "
                             "of default, hybrid and hybrid-tree) also copy from earlier answers, kept per request "
                             "'user' (requests without one get none) or shared by every request; bounded per model, "
                             "off by default "
                             "(docs/methods.md)")
    parser.add_argument("--prompt-cache-mb", type=non_negative_int, default=256, metavar="MB",
                        help="keep finished requests' caches, up to this many MB, for prompts that begin with their "
                             "tokens (a chat's next turn): the target does not read those tokens again, and the "
                             "answer is the same; 0 keeps none (default 256; the lockstep engine only, not the "
                             "ragged one of float models)")
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help="answer requests only with the header 'Authorization: Bearer KEY' (what OpenAI "
                             "clients send as their api_key); /health and /metrics stay open. Default: "
                             "$JOINTSPEC_API_KEY where set (better than the flag, which other users of the machine "
                             "can read in its process list), else no key")
    parser.add_argument("--reasoning-format", choices=("auto", "none"), default="auto",
                        help="auto (default): a reasoning model's <think> block (Qwen3, DeepSeek-R1's distilled "
                             "models: a chat template that names </think>) comes back as the message's "
                             "reasoning_content, apart from its content; none: left in the content as written")
    parser.add_argument("--stored-responses", type=non_negative_int, default=1000, metavar="N",
                        help="the Responses API's stored responses (store: true, the default), which "
                             "previous_response_id continues and GET /v1/responses/{id} fetches: at most N kept, in "
                             "memory, the least recently used dropped first; 0 stores none (default 1000)")
    parser.add_argument("--stored-responses-mb", type=non_negative_int, default=256, metavar="MB",
                        help="at most this many MB of stored responses' text (their own: a continued response "
                             "shares the conversation it continued), the least recently used dropped first; 0 "
                             "stores none (default 256)")
    # What `generate` runs by default, batched (batch/lockstep.py gives each request generate's tokens).
    parser.set_defaults(run=run_serve, method="default", quantize="auto")


def port_number(text: str) -> int:
    from jointspec.cli.options import positive_int

    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1-65535, got {value}")
    return value


def check_address_free(host: str, port: int) -> None:
    """Refuse, before the model loads, an address the server could not listen on (a port in use, a host that is not
    this machine's). Binds as uvicorn does (address reuse on), so only what would make uvicorn fail is refused."""
    import socket

    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise JointspecError(f"--host '{host}' does not resolve ({error.strerror}); pass an address of this machine, "
                             "e.g. 127.0.0.1 or 0.0.0.0") from None
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise JointspecError(f"cannot listen on {host}:{port}: {error.strerror or error}; pass another --port "
                                 "(or stop what listens there)") from None


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_engine(args: argparse.Namespace):
    """The serving engine for parsed ``serve`` arguments (also used by tests, with a local model folder)."""
    from jointspec.cli.options import check_reads, method_config_from_args, model_loader, with_flags
    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.methods import method_names
    from jointspec.methods.registry import batched_methods, method_is_batched, unknown_method_error
    from jointspec.server.engine import ServingEngine

    if args.method not in method_names():
        raise JointspecError(unknown_method_error(args.method, batched_methods()))
    if not method_is_batched(args.method):  # (refused here, before the model loads, not at the first request)
        raise UnsupportedOptionError(f"method '{args.method}' is not batched; the batched engine runs "
                                     f"{', '.join(batched_methods())}")
    if args.backend != "torch":
        raise UnsupportedOptionError(f"the server's batched engine runs on the torch backend only, not "
                                     f"'{args.backend}'; drop --backend (--quantize int8/int4 gives quantised "
                                     "weights on torch)")
    try:
        method = method_config_from_args(args)
        check_reads(method, args)
    except ValueError as error:
        raise JointspecError(with_flags(str(error))) from error
    load = model_loader(args)
    # The engine thread loads the model: all torch work on one thread (ServingEngine says why).
    return ServingEngine(None, None, method, model_id=args.model_id or args.model,
                         max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                         default_max_tokens=args.max_tokens, load=lambda: load(args.model),
                         load_draft=lambda source: load(source, name=source), online_memory=args.online_memory,
                         prompt_cache_bytes=args.prompt_cache_mb * 2 ** 20)


# What ``jointspec serve`` imports beyond the core dependencies: the ``serve`` extra.
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic")


def require_serve_extra() -> None:
    """Refuse, before any model loads, when the ``serve`` extra is not installed."""
    import importlib

    for module in SERVE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise JointspecError(f"`jointspec serve` needs the serve extra: pip install 'jointspec[serve]' "
                                 f"({error})") from None


def api_key(args: argparse.Namespace) -> str | None:
    """The key ``serve`` asks for: ``--api-key``, else $JOINTSPEC_API_KEY, else None (none asked for)."""
    import os

    from jointspec.server.keys import API_KEY_RULE, API_KEY_VARIABLE, valid_api_key

    key, where = args.api_key, "--api-key"
    if key is None:
        key, where = os.environ.get(API_KEY_VARIABLE), API_KEY_VARIABLE
    if key is not None and not key:
        raise JointspecError(f"{where} is empty; give the key clients must send, or leave it unset for none")
    if key is not None and not valid_api_key(key):  # (the key itself is not repeated: it is a secret)
        raise JointspecError(f"{where}: {API_KEY_RULE}")
    return key


def chat_line(engine, reasoning_format: str = "auto") -> str:
    """What the server reads of its model's chat template (docs/serving.md, "Tool calling" and "Reasoning"): the
    format it reads tool calls in, and where a reasoning block is, so that a user sees which the model gets."""
    native = engine.native_format
    calls = (f"tool calls in {native} format (the chat template's own)" if native else
             "tool calls in hermes format, shown to the model as text (its chat template writes none read here)")
    tags = engine.reasoning_tags
    if tags is None:
        reasoning = "no reasoning block in the template"
    elif reasoning_format == "none":
        reasoning = "reasoning left in the content (--reasoning-format none)"
    elif tags.harmony:
        reasoning = ("reasoning in Harmony's analysis channel returned as reasoning_content, its final channel as "
                     "content")
    else:
        reasoning = f"reasoning between {tags.open} and {tags.close} returned as reasoning_content"
        if tags.answer:
            reasoning += f", the content's {tags.answer[0]} and {tags.answer[1]} taken off"
    return f"chat: {calls}; {reasoning}"


def run_serve(args: argparse.Namespace) -> int:
    require_serve_extra()
    key = api_key(args)  # (before the model loads)
    from jointspec.cli.options import apply_threads, prebuild_kernels, say_quantize_choice

    check_address_free(args.host, args.port)
    prebuild_kernels(args)  # a first run compiles them while the server's modules import and the model loads
    from jointspec.drafters.curve_store import persisted_curves
    from jointspec.server.app import ServerSettings, create_app
    from jointspec.server.lifecycle import serve

    apply_threads(args)
    # The cost curves `generate` measured and kept for this model are read back, and the server's are kept: a restart
    # skips the measurement, and `default` makes the choice `generate` makes on this machine (its tree or lookup alone
    # follows the curve, and a fresh measurement near the bar could fall either side).
    with persisted_curves():
        engine = build_engine(args)  # (its cheap checks first: a mistyped option waits for no kernel build)
        say_quantize_choice(args)  # what --quantize auto chose, as generate says it
        settings = ServerSettings(host=args.host, port=args.port, request_timeout=args.request_timeout,
                                  drain_timeout=args.drain_timeout, api_key=key,
                                  reasoning_format=args.reasoning_format, stored_responses=args.stored_responses,
                                  stored_responses_mb=args.stored_responses_mb)
        # A status line, not a warning: printed whatever the log level (JOINTSPEC_LOG).
        print(f"serving {engine.model_id} (method {args.method}; {engine.description}) on "
              f"http://{args.host}:{args.port}/v1{'; requests need the API key' if key else ''}", file=sys.stderr,
              flush=True)
        print(chat_line(engine, args.reasoning_format), file=sys.stderr, flush=True)
        try:
            serve(create_app(settings, engine), settings)  # returns after SIGTERM / Ctrl-C and a drain
        finally:
            engine.close()
    return 0
