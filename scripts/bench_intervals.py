"""Paired 95 % intervals between any two methods of a finished bench run, from its results.json.

The bench reports every method against its baseline. To ask "is MTAD faster than `sps`, does it lower perplexity
against it" without running again, this reads the per-prompt times, token counts and log-probabilities that
``results.json`` keeps and applies the same paired bootstrap (:mod:`jointspec.bench.intervals`):

    python scripts/bench_intervals.py docs/bench/mtad80/results.json mtad:draft=H,k=3 sps:draft=H,k=2

Methods may be given by their full label or by a unique substring of it. Perplexity needs a run made with
perplexity on and written since the runs kept their log-probabilities; older runs give speed only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from jointspec.bench.intervals import paired_ratio_interval


def pick(labels: list[str], wanted: str) -> str:
    if wanted in labels:
        return wanted
    matches = [label for label in labels if wanted in label]
    if len(matches) != 1:
        sys.exit(f"'{wanted}' matches {len(matches)} of the run's methods: {', '.join(labels)}")
    return matches[0]


def parts(runs: list[dict], columns: str) -> torch.Tensor:
    """[num_prompts, 2] in prompt order: (tokens, median seconds) or (log-prob sum, scored tokens)."""
    rows = sorted(runs, key=lambda r: r["prompt_index"])
    if columns == "rate":
        return torch.tensor([[r["num_new_tokens"], statistics.median(r["seconds"])] for r in rows])
    return torch.tensor([[r.get("logprob_sum", 0.0), r.get("num_scored_tokens", 0)] for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a bench run's results.json")
    parser.add_argument("method", help="the method to compare (label or unique part of it)")
    parser.add_argument("reference", help="the method to compare it with")
    args = parser.parse_args()
    results = json.load(open(args.results))
    labels = list(results["methods"])
    method, reference = pick(labels, args.method), pick(labels, args.reference)
    by_method = {label: [r for r in results["runs"] if r["method"] == label] for label in (method, reference)}
    seed = results["config"].get("seed", 0)
    out = {"method": method, "reference": reference, "num_prompts": len(by_method[method])}
    for kind, name in (("rate", "speedup"), ("perplexity", "perplexity_ratio")):
        interval = paired_ratio_interval(parts(by_method[method], kind), parts(by_method[reference], kind), kind,
                                         seed=seed)
        out[name] = None if interval is None else {"ratio": round(interval.ratio, 4), "interval": interval.to_list(),
                                                   "excludes_1": interval.excludes_one}
        print(f"{name}: " + ("-" if interval is None else
                             f"{interval.ratio:.3f} [{interval.low:.3f}, {interval.high:.3f}]"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
