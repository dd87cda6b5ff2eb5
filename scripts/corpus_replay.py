"""Offline replay of cost-aware corpus lookup over recorded greedy answers: which n-gram table drafts better.

A bench run's ``results.json`` keeps every method's output tokens. A lossless method's greedy output is the target's,
so the rounds `corpus` would run on it can be replayed without the model: each round the drafter (cost-aware, as
``default`` runs it on the int4 model) proposes from the context, the tokens that match the recorded answer are
accepted, and the round is charged the target forward it would have needed on ``--curve`` (relative to one plain
step). Reported: answer tokens per unit of that cost, overall and per turn, for each table. An estimate of the
drafts' worth, not a timing: Python, the draft's own cost and the machine's noise are left out. Only the tokenizer
is loaded (with the target, once), so it runs in seconds next to other work.

    python scripts/corpus_replay.py --results docs/bench/intel-amx-mtbench80-turns2/results.json \\
        --method ar:quantize=int4 src/jointspec/data/drafts/smollm2-135m-instruct-corpus corpus/new
"""

from __future__ import annotations

import argparse
import json

from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.drafters.corpus import CorpusLookupDrafter, NgramTable
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
from jointspec.methods import MethodConfig
from jointspec.backends.loading import load_model
from jointspec.core.sampling import SamplingConfig

# The int4 SmolLM2's forward cost by tokens, relative to a step (docs/lab/benchmarks.md section 5: a 2-token forward
# 1.13x, a 4-token one 1.37x; the rest from that run's curve).
INT4_CURVE = "1:1,2:1.13,3:1.25,4:1.37,5:1.45,8:1.7,16:2.4"


def replay(table: NgramTable, tokenizer, prompts, runs, curve: CostCurve) -> list[tuple[int, float]]:
    """Per turn: (answer tokens, cost of the rounds that committed them)."""
    config = MethodConfig()
    greedy = SamplingConfig(temperature=0.0)
    totals = [[0, 0.0] for _ in range(max(len(run["output_ids"]) for run in runs.values()))]
    for index, run in sorted(runs.items()):
        drafter = CostAwareDrafter(CorpusLookupDrafter(table, config.num_draft_tokens, config.max_num_draft_tokens,
                                                       max_ngram=config.max_ngram),
                                   curve, max_num_draft_tokens=config.max_num_draft_tokens)
        messages: list[dict[str, str]] = []
        for turn, (text, answer) in enumerate(zip(prompts[index].turns, run["output_ids"])):
            messages.append({"role": "user", "content": text})
            context = chat_prompt_ids(tokenizer, messages)
            drafter.start(context)
            context = list(context)
            done = 0
            while done < len(answer):
                draft = drafter.propose(context, len(answer) - done - 1, greedy, None).token_ids
                accepted = 0
                while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
                    accepted += 1
                drafter.commit(context, accepted)
                step = min(accepted + 1, len(answer) - done)
                context += answer[done:done + step]
                done += step
                totals[turn][1] += curve.cost(len(draft) + 1)
            totals[turn][0] += len(answer)
            messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
    return [(tokens, cost) for tokens, cost in totals]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tables", nargs="+", help="n-gram table folders (build-corpus --out)")
    parser.add_argument("--results", required=True, help="a jointspec bench results.json")
    parser.add_argument("--method", required=True, help="the row whose outputs to replay (a lossless method's)")
    parser.add_argument("--prompts", default="builtin:mt_bench", help="the prompt set that run used")
    parser.add_argument("--model", default="default", help="whose tokenizer formats the turns")
    parser.add_argument("--curve", default=INT4_CURVE, help="tokens:cost pairs relative to a step")
    args = parser.parse_args()
    results = json.load(open(args.results))
    runs = {run["prompt_index"]: run for run in results["runs"] if run["method"] == args.method}
    if not runs:
        parser.error(f"no runs of '{args.method}' in {args.results}")
    curve = CostCurve({int(n): float(c) for n, c in (pair.split(":") for pair in args.curve.split(","))})
    _, tokenizer = load_model(args.model, quantize="none")
    prompts = load_prompts(args.prompts)
    report = {}
    for folder in args.tables:
        table, _ = NgramTable.load(folder)
        turns = replay(table, tokenizer, prompts, runs, curve)
        tokens, cost = sum(t for t, _ in turns), sum(c for _, c in turns)
        report[folder] = {"tokens_per_cost": round(tokens / cost, 4),
                          "by_turn": [round(t / c, 4) for t, c in turns if c]}
        print(f"{folder}: {tokens / cost:.4f} tokens per step-cost (by turn: "
              + ", ".join(f"{t / c:.4f}" for t, c in turns if c) + ")")
    print(json.dumps({"results": args.results, "method": args.method, "curve": args.curve, "tables": report}))


if __name__ == "__main__":
    main()
