"""Whole-model forward cost of the CPU linear kernels, side by side: what ``--kernels`` and the small-row path buy.

Three settings of the same loaded model (same weights, same cache contents):

- ``stock``: PyTorch's ``F.linear`` (MKL in the official wheels), as transformers runs it;
- ``onednn-packed``: every float32 linear on oneDNN's packed kernel, whatever the row count;
- ``default``: what jointspec runs (oneDNN for 1 and more than ``WEIGHT_MAJOR_MAX_ROWS`` rows, the weight-major
  GEMM of :func:`jointspec.kernels.fp32.weight_major_linear` in between).

Each timed forward feeds ``k`` random tokens after ``--context`` cached ones (all ``k`` rows of logits, as verification
needs) and crops back. Settings alternate forward by forward in a shuffled order, so drift in machine speed hits them
alike; the first pass is a discarded warm-up. Reported: the median and the 20th percentile (less sensitive to other
work on a shared machine) in ms, and the 20th percentile relative to the same setting's k = 1. The last stdout line
is JSON.

    python benchmarks/linear_kernels.py --threads 2 --ks 1,2,3,4,5,8,16 --repeats 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time

import torch

from jointspec.backends.loading import load_model
from jointspec.kernels import fp32 as cpukernels

SETTINGS = ("stock", "onednn-packed", "default")


@contextlib.contextmanager
def setting(model, name: str):
    if name == "stock":
        with cpukernels.stock_kernels(model):
            yield
        return
    saved = cpukernels.WEIGHT_MAJOR_MAX_ROWS
    cpukernels.WEIGHT_MAJOR_MAX_ROWS = 0 if name == "onednn-packed" else saved
    try:
        yield
    finally:
        cpukernels.WEIGHT_MAJOR_MAX_ROWS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ks", default="1,2,3,4,5,8,16", help="forward sizes; must include 1")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, from: " + ", ".join(SETTINGS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ks = sorted({int(k) for k in args.ks.split(",")})
    names = [s for s in args.settings.split(",") if s]
    if ks[0] != 1:
        parser.error("--ks must include 1")
    if any(s not in SETTINGS for s in names):
        parser.error(f"--settings: choose from {', '.join(SETTINGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_model(args.model, kernels="onednn")
    rng = random.Random(args.seed)
    target.forward([rng.randrange(target.vocab_size) for _ in range(args.context)], num_logits=0)
    samples = {(s, k): [] for s in names for k in ks}
    load_at_start = os.getloadavg()[0]
    for timed in [False] + [True] * args.repeats:
        pairs = [(s, k) for s in names for k in ks]
        rng.shuffle(pairs)
        for name, k in pairs:
            tokens = [rng.randrange(target.vocab_size) for _ in range(k)]
            with setting(target.model, name):
                start = time.perf_counter()
                target.forward(tokens)
                elapsed = time.perf_counter() - start
            target.crop(args.context)
            if timed:
                samples[(name, k)].append(elapsed)
    results = {}
    print(f"{args.model}, {torch.get_num_threads()} threads, context {args.context}, {args.repeats} passes; "
          f"ms: median / 20th percentile (p20 relative to k = 1)")
    print("| setting | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|" + "---:|" * len(ks))
    for name in names:
        median = {k: statistics.median(samples[(name, k)]) * 1e3 for k in ks}
        p20 = {k: sorted(samples[(name, k)])[len(samples[(name, k)]) // 5] * 1e3 for k in ks}
        results[name] = {"median_ms": median, "p20_ms": p20, "p20_relative": {k: p20[k] / p20[1] for k in ks}}
        print(f"| {name} | " + " | ".join(f"{median[k]:.1f} / {p20[k]:.1f} ({p20[k] / p20[1]:.2f}x)" for k in ks)
              + " |")
    load = max(load_at_start, os.getloadavg()[0])
    print(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "context": args.context,
                      "repeats": args.repeats, "torch": torch.__version__, "load_average_max": round(load, 2),
                      "weight_major_max_rows": cpukernels.WEIGHT_MAJOR_MAX_ROWS,
                      "results": {n: {m: {str(k): round(v, 3) for k, v in r[m].items()} for m in r}
                                  for n, r in results.items()}}))


if __name__ == "__main__":
    main()
