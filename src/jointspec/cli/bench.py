"""The ``jointspec bench`` subcommand: parse options, load the target once, run, print a table and one JSON line."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from jointspec.backends.loading import DEFAULT_MODEL, check_model_path, load_model, resolve_quantize
from jointspec.bench import report
from jointspec.bench.engines import hf_settings, penalties_refusal
from jointspec.bench.prompts import BUILTIN_PREFIX, builtin_names, load_prompt_sets, select_prompts
from jointspec.bench.report import contract, summarise, table, write_report
from jointspec.bench.runner import BenchConfig, run_bench
from jointspec.bench.specs import (
    MethodSpecError,
    all_method_names,
    method_config,
    parse_spec,
    parse_specs,
    valid_keys,
)
from jointspec.cli.commands import command_help
from jointspec.cli.options import (
    add_model_arguments,
    add_sampling_flags,
    add_template_argument,
    apply_threads,
    check_dynamic_tree,
    check_output_folder,
    cli_flag,
    given_method_options,
    method_config_from_args,
    model_loader,
    model_options,
    positive_int,
    prebuild_kernels,
    sampling_options,
)
from jointspec.core.errors import JointspecError
from jointspec.methods.registry import options_set

# Test seam: tests replace this with a function returning a tiny in-process (CausalLM, tokenizer).
load_target = load_model


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help=command_help("bench"),
        description="Run every method on the same prompts, seeds and max_new_tokens, prompt-major, and report "
                    "tokens/s, speedup, acceptance, perplexity and output identity. The last stdout line is JSON.")
    parser.add_argument("--prompts", action="append", default=None, metavar="FILE|builtin:NAME",
                        help="MT-Bench/Spec-Bench JSONL (question_id, category, turns); repeatable. Built-in: "
                             + ", ".join(BUILTIN_PREFIX + n for n in builtin_names()) + " (default: builtin:mt_bench)")
    parser.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    parser.add_argument("--num-per-category", type=positive_int, default=None, help="first N prompts per category")
    parser.add_argument("--max-turns", type=positive_int, default=None, help="ask at most N turns per prompt")
    parser.add_argument("--methods", default="ar,pld",
                        help="comma-separated specs name[:key=value,...], e.g. ar,pld:n=4,sps:draft=self,k=5,"
                             "hf-generate,hf-pld,hf-assisted:draft=self. Methods: " + ", ".join(all_method_names()))
    parser.add_argument("--baseline", default="ar", help="the method speedups are relative to (added if not listed)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="per turn")
    parser.add_argument("--repeats", type=positive_int, default=1, help="timed repeats (median; min-max shown)")
    add_sampling_flags(parser)
    add_template_argument(parser)
    parser.add_argument("--seed", type=int, default=0,
                        help="when sampling, each prompt and turn draws with a seed derived from this and its id")
    parser.add_argument("--report-dir", type=Path, default=None,
                        help="write report.md, results.json and PNG plots (plots need the bench extra)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up run")
    parser.add_argument("--no-perplexity", action="store_true", help="skip perplexity under the target")
    parser.add_argument("--no-cost-model", action="store_true", help="skip measuring T(k) and the predictions")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--llamacpp-model", default=None, metavar="default|FILE.gguf",
                        help="the GGUF that the llamacpp / llamacpp-pld baselines and backend=llamacpp methods run "
                             "(default: --model when it is 'default' or a .gguf file, else 'default')")
    add_model_arguments(parser)
    parser.set_defaults(run=run, method=None)  # the bench runs --methods; --method is refused in run
    for action in parser._actions:
        if action.dest == "method":
            action.help = argparse.SUPPRESS  # (refused: not listed)


def llamacpp_model(args: argparse.Namespace) -> str:
    """The GGUF for the llama.cpp methods: ``--llamacpp-model``, else the target itself when llama.cpp can read it."""
    if args.llamacpp_model is not None:
        return args.llamacpp_model
    return args.model if args.model == DEFAULT_MODEL or args.model.endswith(".gguf") else DEFAULT_MODEL


def _target_quantize(args: argparse.Namespace) -> str:
    """The target's own quantisation as loaded: ``--quantize``, with what ``auto`` decided ('auto -> int4')."""
    if args.quantize != "auto":
        return args.quantize
    mode = resolve_quantize("auto", args.model, backend=args.backend, device=args.device, dtype=args.dtype,
                            kernels=args.kernels)
    return f"auto -> {mode}"


def _auto_quantize(args: argparse.Namespace, specs) -> str:
    """What quantize=auto means here: the quantisation ``jointspec generate`` would give this target, for a float
    torch target ('none' when the target is loaded quantised or on llama.cpp, or no method asks)."""
    if args.quantize != "none" or args.backend != "torch" or not any(spec.quantize == "auto" for spec in specs):
        return "none"
    return resolve_quantize("auto", args.model, device=args.device, dtype=args.dtype, kernels=args.kernels)


def check_shared_options(defaults, specs, given=()) -> None:
    """Refuse a shared method option (``--beam-width 8``) that no method of the bench reads: it would be ignored by
    every row, as ``generate`` refuses one its method does not read. One that some row reads is that row's setting.
    ``given``: the options given on the command line at their default value, refused alike."""
    unread = [option for option in dict.fromkeys([*options_set(defaults), *given])
              if not any(option in valid_keys(spec.name) for spec in specs)]
    if unread:
        raise MethodSpecError(f"no method of --methods ({', '.join(spec.label for spec in specs)}) reads "
                              f"{', '.join(cli_flag(option) for option in unread)}, so it would be ignored; "
                              "`jointspec methods` lists what each method reads")


def run(args: argparse.Namespace) -> int:
    if args.method is not None:
        raise MethodSpecError(f"bench runs the methods of --methods (comma-separated specs, e.g. --methods ar,"
                              f"{args.method}), not --method")
    specs = parse_specs(args.methods)
    try:
        baseline = parse_spec(args.baseline)
    except MethodSpecError as error:
        raise MethodSpecError(f"--baseline: {error}") from None
    args.baseline = baseline.label  # as --methods names it: " ar" is ar
    if args.baseline not in [s.label for s in specs]:
        specs.insert(0, baseline)
    try:
        defaults = method_config_from_args(args, name="ar")
        config = BenchConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed,
                             **sampling_options(args), warmup=not args.no_warmup,
                             perplexity=not args.no_perplexity, cost_model=not args.no_cost_model,
                             llamacpp_model=llamacpp_model(args), threads=args.threads, kv_cache=args.kv_cache,
                             chat_template_kwargs=args.chat_template_kwargs)
    except ValueError as error:
        raise MethodSpecError(str(error)) from error
    check_shared_options(defaults, specs, given_method_options(args))
    refusal = next(filter(None, (penalties_refusal(spec, config.penalties) for spec in specs)), None)
    if refusal:  # a row that cannot apply the penalties or the bias: before the model loads too
        raise MethodSpecError(refusal)
    for spec in specs:  # bad option values fail here, before the model loads
        if spec.is_hf:
            hf_settings(spec, defaults)
        elif spec.is_llamacpp_reference:
            if args.temperature > 0:
                raise MethodSpecError(f"'{spec.label}' runs greedy only (temperature 0); drop it from a sampling "
                                      "bench")
        else:
            spec_config = method_config(spec, defaults)
            check_dynamic_tree(spec_config, args.temperature)
            check_model_path(spec_config.draft, f"'{spec.label}': draft")
    quantized = [spec.label for spec in specs if spec.quantize_explicit]
    if quantized and (args.quantize != "none" or args.backend != "torch"):
        raise MethodSpecError(f"{', '.join(quantized)} quantise a copy of the float torch target; drop --quantize "
                              "and --backend, or the methods' quantize option")
    stock = [spec.label for spec in specs if spec.kernels != "loaded"]
    if stock and (args.quantize != "none" or args.backend != "torch" or args.kernels == "stock"):
        raise MethodSpecError(f"{', '.join(stock)} run on a stock-kernel copy of the float torch target loaded on "
                              "oneDNN; drop --quantize, --backend and --kernels stock, or the methods' kernels option")
    if args.backend == "llamacpp":
        # The bench target is then a llama.cpp adapter: it has no transformers model to run transformers' generate
        # or to score perplexity with.
        hf = [spec.label for spec in specs if spec.is_hf]
        if hf:
            raise MethodSpecError(f"{', '.join(hf)} run transformers and need --backend torch; to compare with "
                                  "llama.cpp, keep --backend torch and add ':backend=llamacpp' methods or the "
                                  "llamacpp baselines")
        if not args.no_perplexity:
            raise MethodSpecError("perplexity is scored by the torch target; with --backend llamacpp pass "
                                  "--no-perplexity (or keep --backend torch and add ':backend=llamacpp' methods)")
    # Every check above is cheap and runs first: a mistyped option is refused before a first run starts compiling
    # the kernels, and before quantize=auto waits for them (or reads the model file) to decide.
    llamacpp_rows = [spec.label for spec in specs if spec.is_llamacpp_reference or spec.backend == "llamacpp"]
    if args.llamacpp_model is not None and not llamacpp_rows and args.backend != "llamacpp":
        raise MethodSpecError(f"no method of --methods ({', '.join(spec.label for spec in specs)}) runs on llama.cpp, "
                              "so --llamacpp-model would be ignored; add llamacpp or a ':backend=llamacpp' method, or "
                              "drop it")
    if llamacpp_rows and args.llamacpp_model is None and config.llamacpp_model != args.model:
        print(f"jointspec bench: warning: {', '.join(llamacpp_rows)} run llama.cpp on the embedded default's GGUF, "
              f"not on {args.model} (llama.cpp reads GGUF files only): their answers and speed are another model's; "
              "pass --llamacpp-model FILE.gguf with this model's GGUF", file=sys.stderr)
    prebuild_kernels(args)  # a first run compiles them while it reads the prompts and loads the model
    config = replace(config, quantize=_target_quantize(args), auto_quantize=_auto_quantize(args, specs))
    prompts = load_prompt_sets(args.prompts or [f"{BUILTIN_PREFIX}mt_bench"])
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    prompts = select_prompts(prompts, categories, args.num_per_category, args.max_turns)

    if args.report_dir is not None:  # before the run: a report that cannot be written would lose its results
        check_output_folder(args.report_dir, "--report-dir")
    apply_threads(args)
    target, tokenizer = load_target(args.model, **model_options(args))
    # Draft models load with the target's options: same backend, same quantisation.
    load_draft = model_loader(args)
    result = run_bench(target, tokenizer, prompts, specs, args.baseline, config, defaults,
                       lambda source: load_draft(source, name=source), progress=not args.no_progress)
    summary = summarise(result)
    load, cpus = result.environment.get("load_average_end"), result.environment.get("cpu_count")
    if load is not None and cpus and load > cpus:
        print(f"jointspec bench: warning: load average {load} on {cpus} CPUs: other work competed for the cores, "
              "so timings are unreliable", file=sys.stderr)
    print(table(result, summary))
    print(json.dumps(contract(result, summary)))  # (before the report: a report that cannot be written loses no figure)
    if args.report_dir is not None:
        command = "jointspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        if not report.plots_available():
            print("jointspec bench: no plots: they need matplotlib, the bench extra (pip install 'jointspec[bench]')",
                  file=sys.stderr)
        try:
            files = write_report(result, summary, args.report_dir, command)
        except OSError as error:  # a full disk, after the whole run: the figures are out above
            raise JointspecError(f"could not write the report in {args.report_dir} ({error.strerror or error}); "
                                 "nothing of it was left there: the table and the JSON line above are what this run "
                                 "measured") from None
        print(f"wrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0

