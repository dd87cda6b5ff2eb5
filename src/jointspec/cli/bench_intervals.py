"""``jointspec bench-intervals``: paired intervals between any two methods of a finished bench run."""

from __future__ import annotations

import argparse
import json

from jointspec.cli.commands import command_help


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench-intervals", help=command_help("bench-intervals"),
        description="The speedup and perplexity ratio of METHOD against REFERENCE, with the bench's paired bootstrap "
                    "intervals over prompts, from a results.json that `jointspec bench --report-dir` wrote; no "
                    "model is loaded. Methods may be given by their full label or a unique part of it. Several "
                    "results.json of the same methods and settings over disjoint prompts (shards) pool into one "
                    "comparison. The last stdout line is JSON.")
    parser.add_argument("results", nargs="+", help="a bench run's results.json, or several over disjoint prompts")
    parser.add_argument("method", help="the method to compare (its label or a unique part of it)")
    parser.add_argument("reference", help="the method to compare it with")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jointspec.bench.compare import compare_methods, describe, load_results, pool_results

    results = pool_results([load_results(path) for path in args.results], names=args.results)
    comparison = compare_methods(results, args.method, args.reference)
    print("\n".join(describe(comparison)))
    print(json.dumps(comparison))
    return 0
