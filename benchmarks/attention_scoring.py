"""How the compiled attention scores a shared prefix, three ways side by side in one process: pair by pair, pair by
pair from a tile of keys widened once (``use_widened_keys``), and key by key for every pair at once
(``use_scores_by_key``, the AVX2 builds' default). The three give the same bits; this measures their speed.

Two measures, each alternating the ways call by call (a VM's speed drifts between processes):
- ``--shape``: the attention alone, 30 layers of ``HEADS,KV_HEADS,DIM`` over ``--context`` half keys and values, a
  fresh pair of tensors a layer (read from memory, as in a model), for each of ``--rows`` query rows;
- ``--model`` (``default``: the embedded one, loaded with ``--quantize auto``): whole forwards of that many rows after
  ``--context`` cached tokens, as a decoding step or a verification runs them.

Prints medians (ms) and each way's ratio to pair by pair::

    python benchmarks/attention_scoring.py --shape 9,3,64 --context 7000 --rows 1,3,4,8 --threads 2
    python benchmarks/attention_scoring.py --model default --context 7000 --rows 1,2,3,4,6,8 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

import torch

WAYS = {"pair by pair": (False, False), "widened tiles": (True, False), "key by key": (False, True)}


def timed(calls: int, run) -> dict[str, float]:
    """Median seconds of ``run()`` for each way, the ways in a rotating order, after two warm-up rounds."""
    from jointspec.kernels.grouped import kernels, widen_keys_setting

    built = kernels()
    by_key_in_force = built.scores_by_key()
    times = {way: [] for way in WAYS}
    order = list(WAYS)
    try:
        for call in range(calls + 2):
            for way in order[call % len(order):] + order[:call % len(order)]:
                widen, by_key = WAYS[way]
                built.use_widened_keys(widen)
                built.use_scores_by_key(by_key)
                start = time.perf_counter()
                run()
                if call >= 2:
                    times[way].append(time.perf_counter() - start)
    finally:  # the settings in force before
        built.use_widened_keys(widen_keys_setting())
        built.use_scores_by_key(by_key_in_force)
    return {way: statistics.median(values) for way, values in times.items()}


def report(label: str, medians: dict[str, float]) -> None:
    base = medians["pair by pair"]
    print(f"{label}: " + "  ".join(f"{way} {seconds * 1e3:.2f} ms ({seconds / base:.3f})"
                                   for way, seconds in medians.items()), flush=True)


def attention_alone(args) -> None:
    from jointspec.kernels.grouped import kernels

    heads, kv_heads, dim = (int(value) for value in args.shape.split(","))
    generator = torch.Generator().manual_seed(0)
    no_mask = torch.empty(0, dtype=torch.bool)
    for rows in args.rows:
        keys, values = ([torch.randn(kv_heads, args.context + rows, dim, generator=generator).half()
                         for _ in range(30)] for _ in range(2))
        query = torch.randn(heads, rows, dim, generator=generator)
        lengths = torch.arange(args.context + 1, args.context + rows + 1)
        run = functools.partial(attend_layers, kernels(), query, keys, values, no_mask, lengths, dim ** -0.5)
        report(f"{args.shape} heads, {args.context} keys, {rows} rows (30 layers)", timed(args.calls, run))


def attend_layers(built, query, keys, values, mask, lengths, scale) -> None:
    for key, value in zip(keys, values):
        built.attention(query, key, value, mask, lengths, scale)


def whole_forwards(args) -> None:
    from jointspec.backends.loading import load_model

    target, _ = load_model(**({} if args.model == "default" else {"source": args.model}), quantize="auto")
    generator = random.Random(0)
    target.forward([generator.randrange(1000) for _ in range(args.context)], num_logits=0)
    cached = target.num_cached
    for rows in args.rows:
        ids = [generator.randrange(1000) for _ in range(rows)]
        run = functools.partial(forward_and_crop, target, ids, cached)
        report(f"{args.model}, {args.context} cached tokens, {rows} rows", timed(args.calls, run))


def forward_and_crop(target, ids: list[int], cached: int) -> None:
    target.forward(ids, num_logits=len(ids), argmax_only=True)
    target.crop(cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="HEADS,KV_HEADS,DIM: time the attention alone")
    parser.add_argument("--model", default=None, help="time whole forwards of this model ('default': the embedded)")
    parser.add_argument("--context", type=int, default=7000)
    parser.add_argument("--rows", type=lambda text: [int(value) for value in text.split(",")], default=[1, 4, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if (args.shape is None) == (args.model is None):
        parser.error("give one of --shape HEADS,KV_HEADS,DIM or --model MODEL")
    if args.threads:
        torch.set_num_threads(args.threads)
    (attention_alone if args.shape else whole_forwards)(args)


if __name__ == "__main__":
    main()
