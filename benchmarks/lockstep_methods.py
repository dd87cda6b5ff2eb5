"""Methods side by side on the lockstep engine (what ``jointspec serve`` runs on the int4 kernels), without HTTP.

Each concurrency level keeps that many requests in flight on one :class:`~jointspec.batch.lockstep.LockstepEngine`
(a finished request is replaced by the next prompt) until every prompt is answered, greedy, 128 new tokens by
default. The prompts are the first turns of the built-in MT-Bench set (one per category, in turn) with the model's
chat template. Each method runs once untimed, then ``--repeats`` times, the methods alternating, so drift hits them
alike. Reported per level: each method's best tokens per second (prompt reading included, as a server pays it), its
ratio to the first method's best, and whether every answer equals the first method's.

    python benchmarks/lockstep_methods.py                                  # ar,default at 1 2 4 8 16
    python benchmarks/lockstep_methods.py --methods ar,pld --concurrency 4 --prompts 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from jointspec.backends.loading import load_model
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import LockstepEngine
from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.bench.runner import _cpu_name
from jointspec.core.loop import DecodeConfig
from jointspec.kernels.grouped import selected_isa
from jointspec.methods import MethodConfig


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    """``count`` chat prompts: the MT-Bench first turns one category at a time, round the categories."""
    prompts = load_prompts("builtin:mt_bench")
    by_category: dict[str, list] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    order = [p for group in zip(*by_category.values()) for p in group]
    order = (order * (count // len(order) + 1))[:count]
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in order]


def run(engine: LockstepEngine, method: str, prompts: list[list[int]], concurrency: int,
        config: DecodeConfig) -> tuple[int, float, list[list[int]]]:
    """Answer every prompt with ``concurrency`` in flight; (tokens, seconds, answers in prompt order)."""
    queue = list(enumerate(prompts))
    answers: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    tokens = 0
    start = time.perf_counter()
    while queue or engine.has_work:
        while queue and len(engine.active) + len(engine.waiting) < concurrency:
            index, ids = queue.pop(0)
            owner[engine.submit(BatchRequest(tuple(ids), config, MethodConfig(method)))] = index
            answers[index] = []
        for event in engine.step():
            tokens += len(event.token_ids)
            answers[owner[event.seq_id]].extend(event.token_ids)
    return tokens, time.perf_counter() - start, [answers[i] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--methods", default="ar,default", help="comma-separated; the first is the reference")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per level")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    model, tokenizer = load_model(args.model, quantize=args.quantize)
    prompts = prompt_ids(tokenizer, args.prompts)
    config = DecodeConfig(max_new_tokens=args.max_new_tokens)
    engine = LockstepEngine(model, tokenizer, max_batch_size=max(args.concurrency))
    report = {"cpu": _cpu_name(), "kernels": selected_isa(), "threads": torch.get_num_threads(),
              "methods": methods, "levels": []}
    print(f"{report['cpu']}, {report['kernels']} kernels, {report['threads']} threads")
    print(f"{'concurrency':>11}  " + "  ".join(f"{m:>18}" for m in methods))
    for concurrency in args.concurrency:
        for method in methods:  # untimed: cost curves, kernels and caches warm
            run(engine, method, prompts[:2], concurrency, config)
        best: dict[str, float] = {}
        identical: dict[str, bool] = {}
        reference = None
        for _ in range(args.repeats):
            for method in methods:
                tokens, seconds, answers = run(engine, method, prompts, concurrency, config)
                best[method] = max(best.get(method, 0.0), tokens / seconds)
                reference = reference if reference is not None else answers
                identical[method] = identical.get(method, True) and answers == reference
        cells = [f"{best[m]:7.1f} tok/s {best[m] / best[methods[0]]:5.3f}x" + ("" if identical[m] else " !=")
                 for m in methods]
        print(f"{concurrency:>11}  " + "  ".join(cells), flush=True)
        report["levels"].append({"concurrency": concurrency, "tokens_per_second": best,
                                 "ratio": {m: best[m] / best[methods[0]] for m in methods},
                                 "identical": identical})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
