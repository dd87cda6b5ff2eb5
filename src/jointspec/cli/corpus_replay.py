"""``jointspec corpus-replay``: which n-gram table would draft better, replayed over a bench run's recorded answers.

    jointspec corpus-replay --results reports/x/results.json --method ar:quantize=int4 \\
        src/jointspec/data/drafts/smollm2-135m-instruct-corpus corpus/new

The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json

from jointspec.backends.loading import load_model
from jointspec.cli.commands import command_help

# Test seam: tests replace this with a function returning a tiny in-process (CausalLM, tokenizer).
load_target = load_model


def add_parser(subparsers) -> None:
    from jointspec.bench.corpus_replay import INT4_CURVE

    parser = subparsers.add_parser(
        "corpus-replay", help=command_help("corpus-replay"),
        description="Replays the rounds cost-aware `corpus` drafting would run on a lossless method's recorded greedy "
                    "answers (a bench results.json), with each table, charging each round the target forward it "
                    "needs on --curve; reports answer tokens per unit of that cost, overall and by turn. No model "
                    "forward runs: an estimate of the drafts' worth, not a timing. The last stdout line is JSON.")
    parser.add_argument("tables", nargs="+", metavar="TABLE_DIR", help="n-gram table folders (build-corpus --out)")
    parser.add_argument("--results", required=True, help="a jointspec bench results.json")
    parser.add_argument("--method", required=True,
                        help="the row whose outputs to replay: a lossless method's label, or a unique part of it")
    parser.add_argument("--prompts", default="builtin:mt_bench", metavar="FILE|builtin:NAME",
                        help="the prompt set that run used (default: builtin:mt_bench)")
    parser.add_argument("--model", default="default", help="whose tokenizer formats the turns (the run's target)")
    parser.add_argument("--curve", default=INT4_CURVE,
                        help="tokens:cost pairs relative to a 1-token step (default: the int4 embedded model's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr (model loading's too)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from jointspec.bench.compare import load_results, pick_method
    from jointspec.bench.corpus_replay import parse_curve, replay, replay_summary, runs_by_prompt
    from jointspec.bench.prompts import load_prompts
    from jointspec.core.errors import JointspecError
    from jointspec.drafters.corpus import NgramTable, table_for

    results = load_results(args.results)
    method = pick_method(list(results["methods"]), args.method)
    temperature = results.get("config", {}).get("temperature", 0.0) or 0.0
    if temperature > 0:  # a sampled answer is one draw: drafts matching it say nothing of what greedy accepts
        raise JointspecError(f"'{args.results}' is a sampled run (temperature {temperature}); the replay scores "
                             "drafts against greedy answers: give a bench run at temperature 0")
    curve = parse_curve(args.curve)
    runs = runs_by_prompt(results, method, load_prompts(args.prompts))
    tables = {folder: NgramTable.load(folder)[0] for folder in args.tables}  # a bad folder fails before the model
    target, tokenizer = load_target(args.model, quantize="none")
    for folder in tables:  # a table of another tokenizer drafts other tokens: refused, as `corpus` refuses it
        table_for(folder, tokenizer, target.vocab_size)
    report = {}
    for folder, table in tables.items():
        turns = replay(table, tokenizer, runs, curve, progress=None if args.no_progress else f"replaying {folder}")
        report[folder] = replay_summary(turns)
        by_turn = ", ".join(f"{rate:.4f}" for rate in report[folder]["by_turn"])
        print(f"{folder}: {report[folder]['tokens_per_cost']:.4f} tokens per step-cost (by turn: {by_turn})")
    print(json.dumps({"results": args.results, "method": method, "curve": args.curve, "tables": report}))
    return 0
