"""Methods side by side on the lockstep engine (what ``jointspec serve`` runs on the int4 kernels), without HTTP.

Each concurrency level keeps that many requests in flight on one :class:`~jointspec.batch.lockstep.LockstepEngine`
(a finished request is replaced by the next prompt) until every prompt is answered, greedy, 128 new tokens by
default (``--temperature``, ``--top-k`` and ``--top-p`` sample instead, request i seeded ``--seed`` + i in every
method). The prompts are first turns of the built-in sets named by ``--prompt-sets`` (MT-Bench by default; one
category at a time, in turn) with the model's chat template. Each method runs once untimed, then ``--repeats``
times, the methods alternating and their order reversed every other repeat, so drift hits them alike.

With ``--rounds-log FILE`` every timed round is also written to FILE as a JSON line (method, level, repeat, and the
engine's :class:`~jointspec.batch.lockstep.RoundRecord`: sequences, input rows, the batched forward's seconds, draft
tokens accepted), and each level prints where each method's time went (rounds, rows, forwards' share of the run):
the rounds' forwards can then be priced cell by cell (sequences, rows) against the same cells of the other method,
which a run's total time, moved by the machine's drift, cannot show.

A second line per level ("all busy") gives the tokens per second of the rounds that ran with every slot taken, their
prompt reading left out (the same work for every method): what a server under steady load decodes at. The rest of a
run is its end, when no prompt is left to replace a finished request and the last requests finish with fewer beside
them; that end weighs on a method whose requests finish at different rounds (a speculative one) more than on one
whose requests of equal length finish together (`ar`).

Reported per level: each method's tokens per second (prompt reading included, as a server pays it; the best repeat),
its ratio to the first method paired by repeat (the geometric mean of the repeats' ratios, with a 95 % t interval
over repeats from 3 repeats on: a repeat, not a request, is the unit, since requests in flight share each forward),
and whether every answer equals the first method's (greedy only: sampled methods with other laws need not agree).
What the interval leaves out: another machine, or this one's
speed moving by more within a level than between its repeats. The report ends with the batch cost curve the engine
measured (once a process) and priced every level's drafts by, where a load-aware method asked for one: greedy rows'
and, for sampled requests, sampled rows' (every row's exact logits).

    python benchmarks/lockstep_methods.py --repeats 5                      # ar,default at 1 2 4 8 16
    python benchmarks/lockstep_methods.py --methods ar,pld --concurrency 4 --prompts 8 --repeats 1
    python benchmarks/lockstep_methods.py --prompt-sets builtin:mt_bench builtin:grounded   # serve_vs_llamacpp's mix
    python benchmarks/lockstep_methods.py --concurrency 4 --rounds-log rounds.jsonl          # every round's forward
    python benchmarks/lockstep_methods.py --methods ar,sps,mtad --temperature 1 --top-k 10 --top-p 0.9 \
        --max-new-tokens 64                                       # sampling: MTAD against plain sampling and sps
    python benchmarks/lockstep_methods.py --methods ar,default,default/unsupervised   # the draft supervisor's worth
    python benchmarks/lockstep_methods.py --methods ar,mtad,mtad/unbatched --temperature 1 --top-k 10 --top-p 0.9 \
        --max-new-tokens 64                                       # MTAD's head calls made together, or each alone

A method written ``NAME/unsupervised`` runs ``NAME`` with the engine's draft supervisor off (drafts as the drafters
choose in every round; batch/supervisor.py); the supervisor's measurements carry over between runs, as in a server.
``NAME/unbatched`` runs ``NAME`` with each request's head call made alone (``LockstepEngine.batch_head_calls``: MTAD's
first head call a round, made for every request in one pass otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from scipy import stats

from jointspec.backends.loading import load_model
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import LockstepEngine, RoundRecord
from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.bench.runner import _cpu_name
from jointspec.core.loop import DecodeConfig
from jointspec.core.sampling import SamplingConfig
from jointspec.kernels.grouped import selected_isa
from jointspec.methods import MethodConfig


def prompt_ids(tokenizer, count: int, sets: tuple[str, ...] = ("builtin:mt_bench",)) -> list[list[int]]:
    """``count`` chat prompts: the sets' first turns one category at a time, round the categories."""
    by_category: dict[str, list] = {}
    for source in sets:
        for prompt in load_prompts(source):
            by_category.setdefault(f"{source}/{prompt.category}", []).append(prompt)
    groups = list(by_category.values())
    order = [group[i] for i in range(max(map(len, groups))) for group in groups if i < len(group)]
    order = (order * (count // len(order) + 1))[:count]
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in order]


def paired_ratio(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """(geometric mean, low, high) of per-repeat ratios; the interval is a t interval on their logarithms (None
    under 3 repeats)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 3:
        return math.exp(mean), None, None
    half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@dataclass
class RunResult:
    tokens: int
    seconds: float
    answers: list[list[int]]  # in prompt order
    # The rounds with every slot taken (as many sequences as the level keeps in flight), their prompt reading left
    # out (the same work for every method): a server under steady load decodes in such rounds only.
    busy_tokens: int = 0
    busy_seconds: float = 0.0


UNSUPERVISED = "/unsupervised"
UNBATCHED = "/unbatched"


def run(engine: LockstepEngine, method: str, prompts: list[list[int]], concurrency: int,
        config: DecodeConfig, rounds: list[RoundRecord] | None = None, seed: int = 0) -> RunResult:
    """Answer every prompt with ``concurrency`` in flight, prompt i's request seeded ``seed`` + i. Each round's
    record is appended to ``rounds`` where given. ``method`` ending in ``/unsupervised``: the engine's draft
    supervisor is off for this run; in ``/unbatched``, each request's head calls are made alone."""
    records: list[RoundRecord] = [] if rounds is None else rounds
    engine.on_round = records.append
    supervisor, batch_head_calls = engine.supervisor, engine.batch_head_calls
    while method.endswith((UNSUPERVISED, UNBATCHED)):  # in either order
        if method.endswith(UNSUPERVISED):
            method, engine.supervisor = method.removesuffix(UNSUPERVISED), None
        else:
            method, engine.batch_head_calls = method.removesuffix(UNBATCHED), False
    queue = list(enumerate(prompts))
    answers: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    result = RunResult(0, 0.0, [])
    start = time.perf_counter()
    try:
        while queue or engine.has_work:
            while queue and len(engine.active) + len(engine.waiting) < concurrency:
                index, ids = queue.pop(0)
                owner[engine.submit(BatchRequest(tuple(ids), config, MethodConfig(method), seed + index))] = index
                answers[index] = []
            num_records, got = len(records), 0
            for event in engine.step():
                got += len(event.token_ids)
                answers[owner[event.seq_id]].extend(event.token_ids)
            result.tokens += got
            if len(records) > num_records and records[-1].sequences == concurrency:
                result.busy_tokens += got
                result.busy_seconds += records[-1].seconds
    finally:
        engine.on_round = None
        engine.supervisor, engine.batch_head_calls = supervisor, batch_head_calls
    result.seconds = time.perf_counter() - start
    result.answers = [answers[i] for i in range(len(prompts))]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--methods", default="ar,default", help="comma-separated; the first is the reference")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per level")
    parser.add_argument("--prompt-sets", nargs="+", default=["builtin:mt_bench"], metavar="SET",
                        help="bench prompt sets whose first turns are asked (default: builtin:mt_bench)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="request i's seed is this plus i (sampling)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds-log", default=None, metavar="FILE",
                        help="write every timed round (sequences, rows, forward seconds, accepted) as JSON lines")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    model, tokenizer = load_model(args.model, quantize=args.quantize)
    prompts = prompt_ids(tokenizer, args.prompts, tuple(args.prompt_sets))
    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=sampling)
    engine = LockstepEngine(model, tokenizer, max_batch_size=max(args.concurrency))
    report = {"cpu": _cpu_name(), "kernels": selected_isa(), "threads": torch.get_num_threads(),
              "methods": methods, "prompt_sets": args.prompt_sets, "prompts": args.prompts,
              "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                           "seed": args.seed},
              "repeats": args.repeats, "levels": []}
    print(f"{report['cpu']}, {report['kernels']} kernels, {report['threads']} threads; {args.prompts} prompts from "
          f"{' '.join(args.prompt_sets)}, {args.repeats} repeats; "
          + ("greedy" if sampling.greedy else f"temperature {args.temperature}, top-k {args.top_k}, top-p "
             f"{args.top_p}, seeds from {args.seed}"))
    print(f"{'concurrency':>11}  " + "  ".join(f"{m:>36}" for m in methods))
    rounds_log = open(args.rounds_log, "w") if args.rounds_log else None
    for concurrency in args.concurrency:
        for method in methods:  # untimed: cost curves, kernels and caches warm
            run(engine, method, prompts[:2], concurrency, config, seed=args.seed)
        rates: dict[str, list[float]] = {m: [] for m in methods}
        busy: dict[str, list[float]] = {m: [] for m in methods}  # tokens per second while every slot was taken
        identical = dict.fromkeys(methods, True if sampling.greedy else None)  # None: not compared (sampled)
        reference = None
        spent: dict[str, list[tuple[int, int, float, float]]] = {m: [] for m in methods}
        for repeat in range(args.repeats):
            for method in (methods if repeat % 2 == 0 else methods[::-1]):
                rounds: list[RoundRecord] = []
                result = run(engine, method, prompts, concurrency, config, rounds, seed=args.seed)
                answers = result.answers
                rates[method].append(result.tokens / result.seconds)
                if result.busy_seconds > 0:
                    busy[method].append(result.busy_tokens / result.busy_seconds)
                spent[method].append((len(rounds), sum(r.rows for r in rounds),
                                      sum(r.forward_seconds for r in rounds), result.seconds))
                if rounds_log is not None:
                    for record in rounds:
                        rounds_log.write(json.dumps({"method": method, "concurrency": concurrency, "repeat": repeat,
                                                     **asdict(record)}) + "\n")
                if method == methods[0] and reference is None:
                    reference = answers
                elif method != methods[0] and sampling.greedy:
                    identical[method] = identical[method] and reference is not None and answers == reference
        level = {"concurrency": concurrency, "tokens_per_second": {m: max(rates[m]) for m in methods},
                 "repeats": rates, "ratio": {}, "identical": identical}
        cells = []
        for method in methods:
            ratio, low, high = paired_ratio([a / b for a, b in zip(rates[method], rates[methods[0]])])
            level["ratio"][method] = {"ratio": ratio, "low": low, "high": high}
            interval = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
            cells.append(f"{max(rates[method]):7.1f} tok/s {ratio:5.3f}x{interval}" +
                         (" !=" if identical[method] is False else ""))
        print(f"{concurrency:>11}  " + "  ".join(f"{c:>36}" for c in cells), flush=True)
        if all(len(busy[m]) == args.repeats for m in methods):
            level["busy_tokens_per_second"] = {m: max(busy[m]) for m in methods}
            level["busy_ratio"] = {}
            cells = []
            for method in methods:
                ratio, low, high = paired_ratio([a / b for a, b in zip(busy[method], busy[methods[0]])])
                level["busy_ratio"][method] = {"ratio": ratio, "low": low, "high": high}
                interval = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
                cells.append(f"{max(busy[method]):7.1f} tok/s {ratio:5.3f}x{interval}")
            print(f"{'all busy':>11}  " + "  ".join(f"{c:>36}" for c in cells), flush=True)
        if rounds_log is not None:
            for method in methods:
                n, rows, forward, total = (statistics.fmean(x[i] for x in spent[method]) for i in range(4))
                print(f"{'':>11}  {method}: {n:.0f} rounds, {rows:.0f} rows, forwards {forward:.2f} s of "
                      f"{total:.2f} s a run ({forward / total:.0%})", flush=True)
        level["rounds"] = {m: [{"rounds": n, "rows": rows, "forward_seconds": f, "seconds": t}
                               for n, rows, f, t in spent[m]] for m in methods}
        report["levels"].append(level)
    if rounds_log is not None:
        rounds_log.close()
    for kind, curve in engine.batch_curves.items():  # one a process each: what every level's drafts were priced by
        costs = {n: round(cost * 1e3, 3) for n, cost in curve.target_cost.items()}
        report[f"batch_curve_ms_{kind}"] = costs
        print(f"batch cost curve ({kind} rows), ms by rows: " + " ".join(f"{n}:{ms:.1f}" for n, ms in costs.items()))
    if engine.supervisor is not None and engine.supervisor.rates():
        # What the supervisor measured last at each batch size (decayed rates) and which kind of round it runs there.
        rates = sorted(engine.supervisor.rates().items())
        report["supervisor"] = {str(size): {"drafted": round(d, 1), "held": round(h, 1),
                                            "prefers_drafts": engine.supervisor.prefers_drafts(size)}
                                for size, (d, h) in rates}
        print("draft supervisor, tok/s of its last rounds by batch size (with drafts / held off): " + "  ".join(
            f"{size}: {d:.0f}/{h:.0f}{'' if engine.supervisor.prefers_drafts(size) else ' off'}"
            for size, (d, h) in rates))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
