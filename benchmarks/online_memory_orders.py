"""Issue 32's online-memory measure (tokens per call over the last 20 requests against the first 20) in many orders of
the same requests, replayed over a bench run's recorded greedy answers.

One bench run puts its requests in one order, so "last 20 against first 20" mixes what the memory learnt with which
requests happened to land at the two ends. This replays prompt lookup (``pld`` as the bench runs it: its adaptive
length, not cost-aware) with and without an :class:`~jointspec.drafters.memory.OutputMemory` that each finished
answer joins, over the answers a lossless method committed (greedy: every drafter's rounds are then fixed by the
answers), in ``--orders`` random orders, and reports the measure's mean with the memory and without it, and the
memory's own gain over the first and last requests. No model forward runs: tokens per call are exact for the
recorded answers (in the bench's own order they are the bench's ``pld`` and ``pld:memory=online`` rows' figures).
Single-turn prompt sets only: the bench remembers every turn, this replays first turns.

    python benchmarks/online_memory_orders.py --results DIR/results.json --prompts code200.jsonl --method ar

The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from jointspec.backends.loading import load_model
from jointspec.bench.compare import load_results, pick_method
from jointspec.bench.corpus_replay import runs_by_prompt
from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.memory import OutputMemory
from jointspec.drafters.ngram import PromptLookupDrafter
from jointspec.methods import MethodConfig


def replay(requests: list[tuple[list[int], list[int]]], memory: OutputMemory | None) -> list[tuple[int, int]]:
    """(answer tokens, target calls) per request, in the given order, ``pld`` with its defaults."""
    config = MethodConfig(name="pld")
    greedy = SamplingConfig(temperature=0.0)
    per_request = []
    for prompt_ids, answer in requests:
        drafter = PromptLookupDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram,
                                      max(config.max_num_draft_tokens, config.num_draft_tokens), output_memory=memory)
        drafter.start(list(prompt_ids))
        context, done, calls = list(prompt_ids), 0, 0
        while done < len(answer):
            draft = drafter.propose(context, len(answer) - done - 1, greedy, None).token_ids
            accepted = 0
            while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
                accepted += 1
            step = min(accepted + 1, len(answer) - done)
            context += answer[done:done + step]
            done += step
            calls += 1
            drafter.commit(context, accepted)
        per_request.append((len(answer), calls))
        if memory is not None:
            memory.add(prompt_ids, answer)
    return per_request


def tokens_per_call(rows: list[tuple[int, int]]) -> float:
    return sum(tokens for tokens, _ in rows) / sum(calls for _, calls in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True, help="a jointspec bench results.json")
    parser.add_argument("--method", default="ar", help="the lossless row whose greedy answers to replay")
    parser.add_argument("--prompts", required=True, help="the prompt set that run used (first turns are replayed)")
    parser.add_argument("--model", default="default", help="whose tokenizer formats the prompts (the run's target)")
    parser.add_argument("--orders", type=int, default=20, help="random orders replayed (seeds 0 .. orders - 1)")
    parser.add_argument("--ends", type=int, default=20, help="requests at each end that are compared")
    args = parser.parse_args()

    results = load_results(args.results)
    method = pick_method(list(results["methods"]), args.method)
    runs = runs_by_prompt(results, method, load_prompts(args.prompts))
    if any(len(prompt.turns) > 1 for prompt, _ in runs):
        parser.error("multi-turn prompts: the bench remembers every turn and this replays first turns only")
    if len(runs) < 2 * args.ends:
        parser.error(f"{len(runs)} requests cannot give two ends of {args.ends}")
    _, tokenizer = load_model(args.model, quantize="none")
    requests = [(chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}]), run["output_ids"][0])
                for prompt, run in runs]
    plain = replay(requests, None)  # without a memory a request's rounds do not depend on the order

    def ends(rows):
        return tokens_per_call(rows[:args.ends]), tokens_per_call(rows[-args.ends:])

    measures = {"memory": [], "plain": [], "gain_first": [], "gain_last": []}
    for seed in range(args.orders):
        order = list(range(len(requests)))
        random.Random(seed).shuffle(order)
        learnt = replay([requests[i] for i in order], OutputMemory())
        (first, last), (plain_first, plain_last) = ends(learnt), ends([plain[i] for i in order])
        measures["memory"].append(last / first)
        measures["plain"].append(plain_last / plain_first)
        measures["gain_first"].append(first / plain_first)
        measures["gain_last"].append(last / plain_last)
        print(f"order {seed}: last/first {last / first:.3f} with the memory, {plain_last / plain_first:.3f} without; "
              f"memory's gain {first / plain_first:.3f} (first {args.ends}), {last / plain_last:.3f} (last)",
              flush=True)
    summary = {name: round(statistics.mean(values), 4) for name, values in measures.items()}
    summary["memory_sd"] = round(statistics.stdev(measures["memory"]), 4) if args.orders > 1 else 0.0
    print(f"mean over {args.orders} orders: last/first {summary['memory']:.3f} (sd {summary['memory_sd']:.3f}) with "
          f"the memory, {summary['plain']:.3f} without; the memory's gain {summary['gain_first']:.3f} over the first "
          f"{args.ends} requests, {summary['gain_last']:.3f} over the last {args.ends}")
    print(json.dumps({"results": args.results, "method": method, "requests": len(requests),
                      "orders": args.orders, "ends": args.ends, **summary}))


if __name__ == "__main__":
    main()
