"""What asking for log-probabilities costs a decode (``GenerationConfig.logprobs``, the server's ``logprobs``).

MT-Bench first turns decoded by a Pipeline (the embedded model and ``default`` unless told otherwise), greedy, without
log-probabilities and with them (0 and ``--top`` alternatives a token), the three kinds alternating round by round in
one process. Reported: each kind's tokens per second over the prompts, per round and the median, and the median's
ratio to the decode without; every answer must be the same token for token (asking changes no token).

    python benchmarks/logprobs_cost.py --prompts 8 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from jointspec.api import GenerationConfig, Pipeline
from jointspec.bench.prompts import load_prompts, select_prompts
from jointspec.kernels.cpu import cpu_name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--method", default="default")
    parser.add_argument("--prompts", type=int, default=8, help="MT-Bench first turns, one per category first")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=5, help="alternatives a token in the third kind")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = Pipeline.load(args.model, args.method)
    questions = select_prompts(load_prompts("builtin:mt_bench"),
                               num_per_category=max(1, (args.prompts + 7) // 8))[:args.prompts]
    ids = [pipe.encode(q.turns[0]) for q in questions]
    pipe.generate_ids(ids[0], GenerationConfig(max_new_tokens=16))  # warm-up: kernels, caches, cost curve
    kinds = (None, 0, args.top)
    rates: dict[int | None, list[float]] = {kind: [] for kind in kinds}
    answers: dict[int, list[int]] = {}
    for _ in range(args.rounds):
        for kind in kinds:
            tokens, start = 0, time.perf_counter()
            for i, prompt in enumerate(ids):
                result = pipe.generate_ids(prompt, GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                    logprobs=kind))
                tokens += result.num_new_tokens
                if answers.setdefault(i, result.token_ids) != result.token_ids:
                    raise SystemExit(f"prompt {i}: the answer with logprobs={kind} differs from the first one")
            rates[kind].append(tokens / (time.perf_counter() - start))
    print(f"{cpu_name()}, {args.threads} threads; {pipe.target.name}, method {args.method}; {len(ids)} prompts, "
          f"{args.max_new_tokens} tokens; every answer the same with and without log-probabilities")
    base = statistics.median(rates[None])
    for kind in kinds:
        median = statistics.median(rates[kind])
        label = "none" if kind is None else f"logprobs={kind}"
        print(f"{label:>12}: {' '.join(f'{r:.1f}' for r in rates[kind])} tok/s, median {median:.1f} "
              f"({median / base:.2f}x)")


if __name__ == "__main__":
    main()
