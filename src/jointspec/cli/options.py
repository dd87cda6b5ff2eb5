"""Options every subcommand that loads a model shares: the model, its backend and kernels, threads, the method."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
from pathlib import Path

from jointspec.core.choices import (
    BACKENDS,
    HEAD_WEIGHT_CHOICES,
    KERNEL_CHOICES,
    KV_CACHE_CHOICES,
    QUANTIZE_CHOICES,
    VERIFY_CHOICES,
    dynamic_tree_refusal,
)
from jointspec.core.errors import UnsupportedOptionError


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def check_output_folder(path: str | os.PathLike, option: str) -> None:
    """Refuse, before any work, a folder a command would write into but could not: a file in its place or above it,
    or a parent it may not write in. Creates nothing, so a refused command leaves nothing behind."""
    if not str(path).strip():  # Path("") is the current folder: its files would be written among the user's own
        raise UnsupportedOptionError(f"{option} is empty; pass a folder path (. for the current folder)")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UnsupportedOptionError(f"{option} '{path}' is a file, not a folder; pass a folder path")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UnsupportedOptionError(f"{option} '{path}' cannot be made: '{existing}' is a file; pass a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UnsupportedOptionError(f"{option} '{path}' cannot be written: no permission to write in '{existing}'")


def tree_spec(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 4,2,2, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"branching factors must be >= 1, got '{text}'")
    return values


# Method options by argparse dest -> MethodConfig field: a flag given is refused where the method does not read it,
# also at its default value (check_reads).
METHOD_OPTIONS = {"draft": "draft", "cost_aware": "cost_aware", "verify": "verify",
                  "num_draft_tokens": "num_draft_tokens", "max_draft_tokens": "max_num_draft_tokens",
                  "max_ngram": "max_ngram", "min_ngram": "min_ngram", "beam_width": "beam_width",
                  "accept_threshold": "accept_threshold", "tree": "tree", "tree_budget": "tree_budget",
                  "head_weights": "head_weights"}
GIVEN = "given_method_options"  # the Namespace attribute that lists the method options given on the command line


def _recording(action_class: type[argparse.Action]) -> type[argparse.Action]:
    """``action_class`` that also notes its dest in the namespace's :data:`GIVEN` set when the flag is given."""

    class Recording(action_class):
        def __call__(self, parser, namespace, values, option_string=None):
            given = getattr(namespace, GIVEN, None) or set()
            setattr(namespace, GIVEN, given | {self.dest})
            super().__call__(parser, namespace, values, option_string)

    return Recording


_GIVEN_STORE = _recording(argparse._StoreAction)
_GIVEN_BOOLEAN = _recording(argparse.BooleanOptionalAction)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that loads a model and picks a method."""
    parser.add_argument("--model", default="default",
                        help="target: 'default' (embedded SmolLM2-135M-Instruct), a folder, a .gguf file or a hub id")
    parser.add_argument("--method", default="ar", help="decoding method (see `jointspec methods`)")
    parser.add_argument("--draft", action=_GIVEN_STORE, default=None,
                        help="draft for model-based methods: a model, a head folder from `train-draft`, or 'self'; for "
                             "corpus: a table folder from `build-corpus`")
    parser.add_argument("--cost-aware", action=_GIVEN_BOOLEAN, default=None,
                        help="pld/corpus/cross/sps/hybrid: choose each round's draft length, or no draft, from the "
                             "target's measured cost curve and the running acceptance, so speculation does not run "
                             "slower than plain decoding (measures the curve once, a few seconds); mtad: each round's "
                             "depth, at least 1; specinfer/spectr: whether a round drafts their tree at all. sps, "
                             "hybrid, mtad, specinfer and spectr do this unless --no-cost-aware; pld, corpus and cross "
                             "only with --cost-aware")
    parser.add_argument("--verify", action=_GIVEN_STORE, choices=VERIFY_CHOICES, default="token",
                        help="sps/hybrid/pearl/sparse-self: token = token-wise speculative sampling; block = block "
                             "verification of the same drafts (Sun et al. 2024): the same output law, more tokens kept "
                             "per round; "
                             "specinfer: traversal = traversal verification of its trees (Weng et al. 2025)")
    parser.add_argument("--num-draft-tokens", action=_GIVEN_STORE, type=positive_int, default=4,
                        help="draft length / depth (gamma); lade: its Jacobi window W")
    parser.add_argument("--max-draft-tokens", action=_GIVEN_STORE, type=positive_int, default=16,
                        help="the longest draft: pld/corpus/cross double their length after fully accepted drafts up "
                             "to this; cost-aware chains (sps, hybrid, default's lookup) choose lengths up to it; "
                             "lookahead/aded: the deepest path is the larger of this and --num-draft-tokens")
    parser.add_argument("--max-ngram", action=_GIVEN_STORE, type=positive_int, default=3,
                        help="lookup methods: the longest n-gram to match; lade: its n-gram length N (>= 2)")
    parser.add_argument("--min-ngram", action=_GIVEN_STORE, type=positive_int, default=1,
                        help="lookup methods: the shortest n-gram to match")
    parser.add_argument("--beam-width", action=_GIVEN_STORE, type=positive_int, default=4,
                        help="mtad/mtad-tree: beams per level; spectr: its number of draft chains")
    parser.add_argument("--accept-threshold", action=_GIVEN_STORE, type=float, default=0.5,
                        help="mtad: joint-likelihood ratio tau")
    parser.add_argument("--tree", action=_GIVEN_STORE, type=tree_spec, default=None,
                        help="tree methods: branching per depth, e.g. 4,2,2, drafted every round (default: the "
                             "one-level tree of the draft's top 1-3 tokens that the target's cost curve pays best; "
                             "specinfer with --no-cost-aware: 4,2,2); at most 4,096 nodes, and a CPU round verifies "
                             "at most 255")
    parser.add_argument("--tree-budget", action=_GIVEN_STORE, type=int, default=0, metavar="N",
                        help="hybrid-tree/default: draft a dynamic tree of N nodes ranked by the draft's confidence "
                             "(EAGLE-2) instead of the static --tree, greedy decoding only; lookahead/lade/aded: the "
                             "most nodes of their trees (default 16)")
    parser.add_argument("--head-weights", action=_GIVEN_STORE, choices=HEAD_WEIGHT_CHOICES, default="auto",
                        help="a trained EAGLE head's weights (the draft of default on the embedded model): int8 = "
                             "8-bit weight groups on jointspec's CPU kernel (a draft call ~25 %% cheaper, drafts "
                             "nearly the same; output unchanged either way: the target verifies); auto = int8 where "
                             "that kernel runs with vector instructions (x86 with AVX2 or AVX-512), else float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    parser.add_argument("--backend", choices=BACKENDS, default="torch",
                        help="what runs the target and draft models: torch (transformers) or llamacpp (the model must "
                             "be 'default' or a .gguf file; needs llama-cpp-python; CPU only; chain methods only)")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                        help="torch backend, applied at load to the target and to draft models: int4 = 4-bit weight "
                             "groups of 32 with an int8 head on jointspec's CPU kernels (cheapest step; a GGUF's own "
                             "Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q5_K/Q8_0/Q6_K blocks are taken as stored, docs/kernels.md); "
                             "int8 = int8 weights and per-token int8 activations (flattest k-token cost); "
                             "none = float; auto = int4 where that is the model's own weights (a GGUF whose "
                             "projections and head are all such blocks, like the embedded default) on an x86 CPU with "
                             "AVX2 or AVX-512 (JOINTSPEC_KERNEL_ISA=avx512vnni|avx512|avx2vnni|avx2|neondot|portable "
                             "picks a build), else none. Exactness then holds against the quantised target")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                        help="torch backend: CPU kernels. auto = for a float32 model on an AMD CPU, oneDNN linears "
                             "(MKL weight-major for 2-4 tokens: a cheaper step, and verifying 1-3 draft tokens at "
                             "about the cost of one step there), else PyTorch's own linears; grouped-query attention "
                             "inside SDPA either way (docs/kernels.md says why); onednn = insist; stock = PyTorch's "
                             "F.linear and transformers' sdpa attention")

    parser.add_argument("--kv-cache", choices=KV_CACHE_CHOICES, default="auto",
                        help="torch backend: what the KV cache stores. float16 = half precision, as llama.cpp keeps "
                             "it: half the cache memory, and at long inputs a cheaper step (needs jointspec's "
                             "compiled int4 layers: --quantize auto or int4; exactness then holds against the same "
                             "model with a float16 cache, "
                             "docs/long-inputs.md); float32 = the model's dtype; auto (default) = float16 where the "
                             "model runs on those kernels, else the model's dtype")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="CPU threads for torch (process-wide) and llama.cpp (default: torch's choice, and the "
                             "usable cores for llama.cpp); fewer than the free cores avoids contention")


def model_options(args: argparse.Namespace) -> dict:
    """The ``load_model`` options from the shared model arguments: the one place that lists them, so generate,
    serve, bench and draft loading all pass every one."""
    return dict(device=args.device, dtype=args.dtype, quantize=args.quantize, backend=args.backend,
                threads=args.threads, kernels=args.kernels, kv_cache=args.kv_cache)


def template_kwargs_option(text: str) -> dict:
    """--chat-template-kwargs: a JSON object of further chat template variables."""
    from jointspec.backends.tokens import check_template_kwargs

    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error}): give an object such as "
                                         "'{\"enable_thinking\": false}'") from None
    try:
        return check_template_kwargs(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def add_template_argument(parser: argparse.ArgumentParser) -> None:
    """--chat-template-kwargs, as generate, chat and bench take it (serve: per request, as vLLM reads it)."""
    parser.add_argument("--chat-template-kwargs", type=template_kwargs_option, default=None, metavar="JSON",
                        help="further variables for the model's chat template, as a JSON object, as vLLM's "
                             "chat_template_kwargs: e.g. '{\"enable_thinking\": false}' turns Qwen3's thinking off")


def add_sampling_arguments(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """:func:`add_sampling_flags` and --seed, as generate and chat take them (greedy by default)."""
    add_sampling_flags(parser)
    parser.add_argument("--seed", type=int, default=None, help=seed_help)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p, --min-p, the three penalties and --logit-bias (generate, chat and bench take
    them)."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="0 = off; drop tokens less than this times as likely as the most likely one (after the "
                             "temperature, before top-k and top-p, as vLLM applies it)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="1 = off; the logit of every token of the prompt or answer so far divided by it where "
                             "positive, multiplied where not (vLLM's repetition_penalty, over the whole text)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="0 = off (-2 to 2): subtracted from the logit of every token the answer holds")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="0 = off (-2 to 2): subtracted once per time the answer holds the token")
    parser.add_argument("--logit-bias", type=_logit_bias, action="append", default=[], metavar="TOKEN_ID=AMOUNT",
                        help="add AMOUNT (-100 to 100) to that token's logit before the penalties, as OpenAI's "
                             "logit_bias does (-100 all but bans it); repeat for more tokens")


def _logit_bias(text: str) -> tuple[int, float]:
    """One --logit-bias entry, TOKEN_ID=AMOUNT."""
    token, sep, amount = text.partition("=")
    try:
        if not sep or not re.fullmatch(r"[0-9]+", token) or not math.isfinite(float(amount)):
            raise ValueError
        return int(token), float(amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=AMOUNT, a token id and a finite amount (e.g. 2=-100), "
                                         f"got {text!r}") from None


def sampling_options(args: argparse.Namespace) -> dict:
    """The :func:`add_sampling_flags` values by the names GenerationConfig and BenchConfig take them."""
    options = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                      "presence_penalty", "frequency_penalty")}
    options["logit_bias"] = tuple(args.logit_bias)  # checked (range, repeats) where the config is built
    return options


def model_loader(args: argparse.Namespace):
    """``load(source, name=None) -> (model, tokenizer)`` with the run's :func:`model_options`, for the target and
    every draft model alike; each (source, name) is loaded once."""
    from jointspec.backends.loading import load_model

    @functools.cache
    def load(source: str, name: str | None = None):
        return load_model(source, name=name, **model_options(args))
    return load


def prebuild_kernels(args: argparse.Namespace) -> None:
    """Where this run's model is a torch model on the CPU (which runs jointspec's kernels unless ``--kernels
    stock``), start building them now, beside the imports and the model load (:func:`jointspec.kernels.grouped.
    prebuild`): a first run then waits for the longer of the two instead of their sum."""
    if args.backend != "torch" or args.device != "cpu" or args.kernels == "stock":
        return
    from jointspec.kernels.grouped import prebuild

    prebuild()


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's intra-op threads from ``--threads`` (llama.cpp gets the count at load)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def method_config_from_args(args: argparse.Namespace, name: str | None = None):
    from jointspec.methods import MethodConfig

    config = MethodConfig(name=name or args.method, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
                        max_num_draft_tokens=args.max_draft_tokens,
                        max_ngram=args.max_ngram, min_ngram=args.min_ngram, beam_width=args.beam_width,
                        accept_threshold=args.accept_threshold, tree=args.tree,
                        tree_budget=getattr(args, "tree_budget", 0),
                        cost_aware=getattr(args, "cost_aware", None),
                        head_weights=getattr(args, "head_weights", "auto"),
                        verify=getattr(args, "verify", "token"))
    check_dynamic_tree(config, getattr(args, "temperature", 0.0))
    return config


def given_method_options(args: argparse.Namespace | None) -> list[str]:
    """The MethodConfig fields whose flags were given on the command line (at any value), in a fixed order."""
    return [METHOD_OPTIONS[dest] for dest in sorted(getattr(args, GIVEN, None) or ()) if dest in METHOD_OPTIONS]


def check_reads(config, args: argparse.Namespace | None = None) -> None:
    """Refuse the method options given for a method that does not read them (``--beam-width`` with ``pld``): they
    were ignored without a word. The CLI's defaults are MethodConfig's, so what differs from them was given; ``args``
    also names those given at their default value (``--num-draft-tokens 4`` with ``ar``)."""
    from jointspec.methods.registry import options_set, unread_options_error

    def spell(field: str) -> str:
        return "--no-cost-aware" if field == "cost_aware" and config.cost_aware is False else cli_flag(field)

    fields = list(dict.fromkeys(options_set(config) + given_method_options(args)))
    error = unread_options_error(config.name, fields, spell=spell)
    if error:
        raise UnsupportedOptionError(error)


# Settings whose checks (GenerationConfig, SamplingConfig, MethodConfig) name them as the Python API spells them.
_FLAGGED_FIELDS = ("max_num_draft_tokens", "num_draft_tokens", "max_new_tokens", "accept_threshold", "tree_budget",
                   "beam_width", "min_ngram", "max_ngram", "top_p", "top_k", "min_p", "temperature", "seed",
                   "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias")


def with_flags(message: str) -> str:
    """A settings check's message with each field it names spelt as its command-line flag (``top_p`` -> ``--top-p``)."""
    pattern = r"(?<![\w-])(" + "|".join(_FLAGGED_FIELDS) + r")(?![\w-])"
    return re.sub(pattern, lambda match: cli_flag(match.group(1)), message)


def cli_flag(field: str) -> str:
    """The command-line flag of a MethodConfig field."""
    return {"max_num_draft_tokens": "--max-draft-tokens"}.get(field, "--" + field.replace("_", "-"))


def check_dynamic_tree(config, temperature: float) -> None:
    """Refuse a dynamic tree (``--tree-budget`` of hybrid-tree or default) with sampling here, before a model loads,
    rather than by the drafter after the first tokens are out."""
    refusal = dynamic_tree_refusal(config.name, config.tree_budget, temperature)
    if refusal:
        raise UnsupportedOptionError(refusal)


def say_quantize_choice(args: argparse.Namespace) -> None:
    """One line on stderr: the weights and kernels the target runs on, and why (generate and serve say it)."""
    from jointspec.backends.loading import quantize_choice

    mode, why = quantize_choice(args.quantize, args.model, backend=args.backend, device=args.device, dtype=args.dtype,
                                kernels=args.kernels)
    if mode == "int4" and args.backend == "torch" and args.device == "cpu":
        from jointspec.kernels.grouped import kernels

        built = kernels()
        mode += f" ({built.isa()} kernels)" if built is not None else ""
    print(f"jointspec: quantize={args.quantize} -> {mode}: {why}", file=sys.stderr)
