"""``jointspec`` command line. Subcommands live in their own modules and add themselves via ``add_parser``."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys

from jointspec.core.errors import JointspecError, UnsupportedOptionError

DEFAULT_PROMPT = ("Summarise in two sentences: Speculative decoding lets a small draft propose several tokens that "
                  "the large model checks in one forward pass, so generation gets faster without changing what the "
                  "large model would have written.")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _tree(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 4,2,2, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"branching factors must be >= 1, got '{text}'")
    return values


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that loads a model and picks a method."""
    parser.add_argument("--model", default="default",
                        help="target: 'default' (embedded SmolLM2-135M-Instruct), a folder, a .gguf file or a hub id")
    parser.add_argument("--method", default="ar", help="decoding method (see `jointspec methods`)")
    parser.add_argument("--draft", default=None,
                        help="draft for model-based methods: a model, a head folder from `train-draft`, or 'self'; for "
                             "corpus: a table folder from `build-corpus`")
    parser.add_argument("--cost-aware", action="store_true",
                        help="pld/corpus/sps/hybrid: choose each round's draft length, or no draft, from the target's "
                             "measured cost curve and the running acceptance, so speculation does not run slower "
                             "than plain decoding (measures the curve once, a few seconds)")
    parser.add_argument("--num-draft-tokens", type=_positive_int, default=4, help="draft length / depth (gamma)")
    parser.add_argument("--max-draft-tokens", type=_positive_int, default=16,
                        help="pld: the draft length doubles after fully accepted drafts, up to this")
    parser.add_argument("--max-ngram", type=_positive_int, default=3, help="pld: longest n-gram to match")
    parser.add_argument("--min-ngram", type=_positive_int, default=1, help="pld: shortest n-gram to match")
    parser.add_argument("--beam-width", type=_positive_int, default=4, help="mtad: beams per level")
    parser.add_argument("--accept-threshold", type=float, default=0.5, help="mtad: joint-likelihood ratio tau")
    parser.add_argument("--tree", type=_tree, default=None,
                        help="tree methods: branching per depth, e.g. 4,2,2 (default: 3 for hybrid-tree, 4,2,2 for "
                             "specinfer)")
    parser.add_argument("--tree-budget", type=int, default=0, metavar="N",
                        help="hybrid-tree/default: draft a dynamic tree of N nodes ranked by the draft's confidence "
                             "(EAGLE-2) instead of the static --tree; greedy decoding only")
    from jointspec.drafts.artifact import HEAD_WEIGHT_CHOICES

    parser.add_argument("--head-weights", choices=HEAD_WEIGHT_CHOICES, default="auto",
                        help="a trained EAGLE head's weights (the draft of default on the embedded model): int8 = "
                             "8-bit weight groups on jointspec's CPU kernel (a draft call ~25 %% cheaper, drafts "
                             "nearly the same; output unchanged either way: the target verifies); auto = int8 where "
                             "that kernel runs with vector instructions (x86 with AVX2 or AVX-512), else float32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    from jointspec.backends.loading import BACKENDS, QUANTIZE_CHOICES
    from jointspec.kernels.fp32 import KERNEL_CHOICES

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
                             "AVX2 or AVX-512 (JOINTSPEC_KERNEL_ISA=avx512|avx2|portable picks a kernel build), else "
                             "none. Exactness then holds against the quantised target (default: auto for generate, "
                             "none elsewhere)")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                        help="torch backend: CPU kernels. auto = for a float32 model on an AMD CPU, oneDNN linears "
                             "(MKL weight-major for 2-4 tokens) and grouped-query attention inside SDPA (a cheaper "
                             "step, and verifying 1-3 draft tokens at about the cost of one step there), else "
                             "PyTorch's own (faster on the Intel Xeon measured); onednn = insist; stock = PyTorch's "
                             "F.linear and transformers' sdpa attention")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="CPU threads for torch (process-wide) and llama.cpp (default: torch's choice, and the "
                             "usable cores for llama.cpp); fewer than the free cores avoids contention")


def model_options(args: argparse.Namespace) -> dict:
    """The ``load_model`` options from the shared model arguments: the one place that lists them, so generate,
    serve, bench and draft loading all pass every one."""
    return dict(device=args.device, dtype=args.dtype, quantize=args.quantize, backend=args.backend,
                threads=args.threads, kernels=args.kernels)


def model_loader(args: argparse.Namespace):
    """``load(source, name=None) -> (model, tokenizer)`` with the run's :func:`model_options`, for the target and
    every draft model alike; each (source, name) is loaded once."""
    from jointspec.backends.loading import load_model

    @functools.cache
    def load(source: str, name: str | None = None):
        return load_model(source, name=name, **model_options(args))
    return load


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's intra-op threads from ``--threads`` (llama.cpp gets the count at load)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def method_config_from_args(args: argparse.Namespace, name: str | None = None):
    from jointspec.methods import MethodConfig

    if getattr(args, "tree_budget", 0) and getattr(args, "temperature", 0.0) > 0:
        # Refused here, before a model loads, rather than by the drafter after the first token is out.
        raise UnsupportedOptionError(f"--tree-budget drafts for greedy decoding only, not at --temperature "
                                     f"{args.temperature}; for sampling, give a static tree with --tree")

    return MethodConfig(name=name or args.method, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
                        max_num_draft_tokens=args.max_draft_tokens,
                        max_ngram=args.max_ngram, min_ngram=args.min_ngram, beam_width=args.beam_width,
                        accept_threshold=args.accept_threshold, tree=args.tree,
                        tree_budget=getattr(args, "tree_budget", 0),
                        cost_aware=getattr(args, "cost_aware", False),
                        head_weights=getattr(args, "head_weights", "auto"))


def _add_generate(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt")
    parser.add_argument("prompt", nargs="?", default=None, help="the prompt (default: a short summarisation task)")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    # generate's default is the fastest exact configuration (the bench's `default`); serve and bench keep `ar`,
    # since the batched engine has no hybrid/head drafter.
    # Its quantisation likewise: auto runs the embedded default on the int4 kernel that recovers its own weights.
    parser.set_defaults(run=_run_generate, method="default", quantize="auto")


def _run_generate(args: argparse.Namespace) -> int:
    from jointspec.api import GenerationConfig, Pipeline
    from jointspec.methods import method_names

    if args.method not in method_names():
        raise JointspecError(f"unknown method '{args.method}'; choose one of: {', '.join(method_names())}")
    try:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed, chat=not args.no_chat)
        method = method_config_from_args(args)
    except ValueError as error:
        raise JointspecError(str(error)) from error
    apply_threads(args)
    pipeline = Pipeline.load(args.model, method, **model_options(args))
    _say_quantize_choice(args)
    prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if args.json:
        from jointspec.bench.energy import meter_for_device
        from jointspec.analysis.quality import quality_report

        meter = meter_for_device(args.device)
        meter.start()
        result = pipeline.generate(prompt, config)
        joules = meter.stop()
        record = result.to_dict()
        record["quality"] = quality_report(pipeline.target, result.prompt_ids, result.token_ids, joules)
        print(json.dumps(record))
        return 0

    def show(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    result = pipeline.generate(prompt, config, on_text=show)
    stats = result.stats
    print(f"\n[{args.method}] {result.num_new_tokens} tokens in {result.seconds:.2f} s = "
          f"{result.tokens_per_second:.1f} tok/s; {stats.num_rounds} target calls, "
          f"{stats.mean_accepted_tokens:.2f} tokens per call, acceptance {stats.acceptance_rate:.0%} "
          f"({pipeline.target.name})", file=sys.stderr)
    return 0


def _say_quantize_choice(args: argparse.Namespace) -> None:
    """One line on stderr: the weights and kernels the target runs on, and why."""
    from jointspec.backends.loading import quantize_choice

    mode, why = quantize_choice(args.quantize, args.model, backend=args.backend, device=args.device, dtype=args.dtype,
                                kernels=args.kernels)
    if mode == "int4" and args.backend == "torch" and args.device == "cpu":
        from jointspec.kernels.grouped import kernels

        built = kernels()
        mode += f" ({built.isa()} kernels)" if built is not None else ""
    print(f"jointspec: quantize={args.quantize} -> {mode}: {why}", file=sys.stderr)


def _add_methods(subparsers) -> None:
    parser = subparsers.add_parser("methods", help="list the decoding methods")
    parser.set_defaults(run=_run_methods)


def _run_methods(args: argparse.Namespace) -> int:
    from jointspec.methods import method_summaries

    for name, summary in method_summaries().items():
        print(f"{name:12s} {summary}")
    return 0


# Subcommand modules that define ``add_parser(subparsers)``. Each adds itself here.
_SUBCOMMAND_MODULES: list[str] = ["jointspec.cli.bench", "jointspec.cli.serve", "jointspec.cli.train",
                                    "jointspec.cli.corpus"]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="jointspec", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_generate(subparsers)
    _add_methods(subparsers)
    for module in _SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("JOINTSPEC_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    # transformers is chatty on load (GGUF dequantisation notes, generation-config notes); keep the CLI readable.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except JointspecError as error:
        print(f"jointspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
