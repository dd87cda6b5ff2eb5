"""Verify-cost curve of the llama.cpp adapter: the time of one k-token forward after a fixed context, relative to k = 1.

Each forward returns all k rows of logits, as verification needs. Measured with flash attention on (the adapter's
default, needed for exact speculation) and off (llama-cpp-python's default); optionally the torch target beside it.

Run on a quiet machine (timings on a busy one mean nothing):

    python benchmarks/llamacpp_cost_curve.py --threads 2 --torch --json-out cost_curve.json

Method: prefill ``--context`` random tokens once, then for each of ``--repeats`` passes run every k once in a
shuffled order (so drift in machine speed hits every k alike), cropping back to the context after each forward;
the first pass is a discarded warm-up. Reports the median per k and the ratio to k = 1. The last stdout line is
JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def measure(adapter, ks: list[int], context: int, repeats: int, seed: int) -> dict[int, float]:
    rng = random.Random(seed)
    vocab = adapter.vocab_size
    adapter.reset()
    adapter.forward([rng.randrange(vocab) for _ in range(context)], num_logits=0)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for timed in [False] + [True] * repeats:
        order = list(ks)
        rng.shuffle(order)
        for k in order:
            tokens = [rng.randrange(vocab) for _ in range(k)]
            start = time.perf_counter()
            adapter.forward(tokens)
            elapsed = time.perf_counter() - start
            adapter.crop(context)
            if timed:
                samples[k].append(elapsed)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2 GGUF) or a .gguf path")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp and torch threads (default: all cores)")
    parser.add_argument("--ks", default="1,2,4,8,16", help="forward sizes; must include 1")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before each forward")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch", action="store_true", help="also measure the torch fp32 target from the same model")
    parser.add_argument("--no-flash-attn-off", action="store_true", help="skip the adapter without flash attention")
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    ks = sorted({int(k) for k in args.ks.split(",")})
    if ks[0] != 1:
        parser.error("--ks must include 1 (the curve is relative to one step)")

    from jointspec.backends.llamacpp import LlamaCppLM, load_llamacpp
    from jointspec.kernels.cpu import usable_cores

    threads = args.threads or usable_cores()
    adapters = {}
    adapter, _ = load_llamacpp(args.model, n_threads=threads)
    adapters["llamacpp"] = adapter
    if not args.no_flash_attn_off:
        adapters["llamacpp-nofa"] = LlamaCppLM(adapter.model, n_ctx=adapter.max_context, n_threads=threads,
                                               flash_attn=False)
    if args.torch:
        import torch

        from jointspec.backends.loading import load_model

        torch.set_num_threads(threads)
        adapters["torch"], _ = load_model(args.model)

    result = {"model": args.model, "threads": threads, "context": args.context, "repeats": args.repeats,
              "backends": {}}
    for name, adapter in adapters.items():
        seconds = measure(adapter, ks, args.context, args.repeats, args.seed)
        result["backends"][name] = {"ms_by_k": {str(k): round(s * 1e3, 3) for k, s in seconds.items()},
                                    "relative_to_k1": {str(k): round(s / seconds[1], 3) for k, s in seconds.items()}}
    print(f"{'backend':<14} " + " ".join(f"{'k=' + str(k):>14}" for k in ks))
    for name, curve in result["backends"].items():
        cells = [f"{curve['ms_by_k'][str(k)]:7.2f}ms {curve['relative_to_k1'][str(k)]:4.2f}x" for k in ks]
        print(f"{name:<14} " + " ".join(f"{c:>14}" for c in cells))
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            handle.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
