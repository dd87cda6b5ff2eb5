"""Turning runs into numbers: per method, overall and per category; a terminal table, report.md, results.json, plots.

Aggregates are over the same prompts for every method: tokens/s = all new tokens / the sum of per-prompt median
times (the range uses per-prompt min and max times); speedup = tokens/s over the baseline's tokens/s; mean accepted
tokens = 1 + accepted / rounds (for transformers' generate: new tokens per target call); perplexity = exp(-mean
log-probability) of every generated token under the raw target. Against the baseline, the overall speedup and
perplexity ratio also get 95 % paired bootstrap intervals over prompts (:mod:`jointspec.bench.intervals`).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import statistics
from pathlib import Path

import torch

from jointspec.analysis.quality import distinct_n
from jointspec.bench.costmodel import TargetCost, predict
from jointspec.bench.intervals import LEVEL, MIN_PROMPTS, paired_ratio_interval
from jointspec.bench.runner import BenchResult, PromptRun, perplexity_of
from jointspec.bench.specs import PLACEMENT_KEYS, MethodSpecError, parse_spec
from jointspec.core.loop import SpecStats
from jointspec.methods.registry import cost_aware_by_default

CONTRACT_KEYS = ("tokens_per_second", "speedup", "mean_accepted_tokens", "num_identical", "num_prompts",
                 "perplexity")


def _rounded(value: float | None, digits: int = 4) -> float | None:
    """None for missing or non-finite values (JSON has no NaN)."""
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


def accepted_histogram(stats: SpecStats) -> list[int]:
    """Rounds that accepted exactly 0, 1, 2, ... draft tokens (from the per-position counts: a round that
    accepted ``a`` tokens counts at positions 0..a-1)."""
    at_least = [stats.num_rounds] + list(stats.accepted_per_position)
    return [at_least[a] - (at_least[a + 1] if a + 1 < len(at_least) else 0) for a in range(len(at_least))]


def mean_distinct_2(runs: list[PromptRun]) -> float:
    """Mean over answers of distinct bigrams / bigrams: low perplexity that is only repetition shows up here."""
    values = [distinct_n(out, 2) for r in runs for out in r.output_ids if len(out) >= 2]
    return sum(values) / len(values) if values else float("nan")


def summarise_group(runs: list[PromptRun], baseline_runs: list[PromptRun], cost: TargetCost | None) -> dict:
    """Every number for one method over ``runs``; ``baseline_runs`` are the baseline's runs on the same prompts."""
    tokens = sum(r.num_new_tokens for r in runs)
    seconds = sum(r.median_seconds for r in runs)
    tps = tokens / seconds if seconds > 0 else 0.0
    base_tokens = sum(r.num_new_tokens for r in baseline_runs)
    base_seconds = sum(r.median_seconds for r in baseline_runs)
    base_tps = base_tokens / base_seconds if base_seconds > 0 else 0.0
    slowest, fastest = sum(max(r.seconds) for r in runs), sum(min(r.seconds) for r in runs)
    summary: dict = {
        "tokens_per_second": _rounded(tps, 3),
        "speedup": _rounded(tps / base_tps if base_tps > 0 else None),
        "num_identical": sum(r.identical for r in runs),
        "num_prompts": len(runs),
        "perplexity": _rounded(perplexity_of(runs)),
        "distinct_2": _rounded(mean_distinct_2(runs)),
        "tokens_per_second_min": _rounded(tokens / slowest if slowest > 0 else None, 3),
        "tokens_per_second_max": _rounded(tokens / fastest if fastest > 0 else None, 3),
        "num_new_tokens": tokens,
        "seconds": _rounded(seconds),
        "num_target_calls": sum(r.num_target_calls for r in runs),
        "peak_rss_mb": _rounded(max(r.peak_rss_bytes for r in runs) / 2**20, 1),
        "added_rss_mb": (None if any(r.added_rss_bytes is None for r in runs)
                         else _rounded(max(r.added_rss_bytes for r in runs) / 2**20, 1)),
        "cuda_max_allocated_mb": (_rounded(max(r.cuda_peak_bytes for r in runs) / 2**20, 1)
                                  if all(r.cuda_peak_bytes is not None for r in runs) else None),
        "prompt_seconds": None, "decode_tokens_per_second": None, "decode_speedup": None,
    }
    # Long inputs: reading the prompt and decoding after it, apart (the speedup above is over both).
    if all(r.decode_seconds is not None for r in runs + baseline_runs):
        decode = sum(r.decode_seconds for r in runs)
        base_decode = sum(r.decode_seconds for r in baseline_runs)
        decode_tps = tokens / decode if decode > 0 else None
        base_decode_tps = base_tokens / base_decode if base_decode > 0 else None
        summary.update({
            "prompt_seconds": _rounded(sum(statistics.median(r.prefill_seconds) for r in runs) / len(runs), 3),
            "decode_tokens_per_second": _rounded(decode_tps, 3),
            "decode_speedup": _rounded(decode_tps / base_decode_tps if decode_tps and base_decode_tps else None),
        })
    if all(r.stats is not None for r in runs):
        stats = SpecStats()
        for r in runs:
            stats.merge(r.stats)
        summary.update({
            "mean_accepted_tokens": _rounded(stats.mean_accepted_tokens),
            "acceptance_rate": _rounded(stats.acceptance_rate),
            "acceptance_per_position": [_rounded(x) for x in stats.acceptance_per_position],
            "drafted_per_position": list(stats.drafted_per_position),
            "accepted_histogram": accepted_histogram(stats),
            "draft_seconds": _rounded(stats.draft_seconds),
            "verify_seconds": _rounded(stats.verify_seconds),
            "prefill_seconds": _rounded(stats.prefill_seconds),
        })
        if cost is not None:
            predictions = [predict(cost, r.stats) for r in runs]
            if all(p is not None for p in predictions):
                # Counters come from the first timed repeat: compare with that repeat's time.
                predicted = sum(p.seconds for p in predictions)
                first = sum(r.seconds[0] for r in runs)
                summary["predicted_tokens_per_second"] = _rounded(tokens / predicted, 3)
                summary["loop_efficiency"] = _rounded(predicted / first)
    else:
        calls = summary["num_target_calls"]
        summary["mean_accepted_tokens"] = _rounded(tokens / calls if calls else None)
    return summary


def summarise(result: BenchResult) -> dict:
    """{method: {...overall..., "per_category": {category: {...}}}}."""
    by_method = {m: [r for r in result.runs if r.method == m] for m in result.methods}
    base = by_method[result.baseline]
    categories = list(dict.fromkeys(r.category for r in base))
    out: dict = {}
    for method, runs in by_method.items():
        summary = summarise_group(runs, base, result.target_cost)
        summary["per_category"] = {c: summarise_group([r for r in runs if r.category == c],
                                                      [r for r in base if r.category == c], result.target_cost)
                                   for c in categories}
        out[method] = summary
    for method, runs in by_method.items():
        out[method].update(against_baseline(runs, base, result.config.seed))
        if _memory(method) == "online":
            out[method]["learning"] = learning_curve(runs)
    base_predicted = out[result.baseline].get("predicted_tokens_per_second")
    for summary in [s for m in out.values() for s in [m, *m["per_category"].values()]]:
        predicted = summary.get("predicted_tokens_per_second")
        summary["predicted_speedup"] = _rounded(predicted / base_predicted) if predicted and base_predicted else None
    return out


def _memory(label: str) -> str | None:
    """A row's ``memory`` option, None for a label that is not a method spec (results made by hand)."""
    try:
        return parse_spec(label).memory
    except MethodSpecError:
        return None


# The share of a run's prompts at each end that a learning curve compares (at least one prompt each).
LEARNING_SLICE = 0.1


def learning_curve(runs: list[PromptRun]) -> dict | None:
    """Tokens per target call over the first and the last ``LEARNING_SLICE`` of the prompts, in the order they
    ran: for a row that learns online (``memory=online``), what the earlier answers taught it. Pooled over the
    slice (all tokens / all calls)."""
    ordered = sorted((r for r in runs if r.stats is not None), key=lambda r: r.prompt_index)
    size = max(1, int(len(ordered) * LEARNING_SLICE))
    if len(ordered) < 2 * size:
        return None

    def per_call(part: list[PromptRun]) -> float:
        rounds = sum(r.stats.num_rounds for r in part)
        return (rounds + sum(r.stats.num_accepted_tokens for r in part)) / rounds if rounds else 0.0

    first, last = per_call(ordered[:size]), per_call(ordered[-size:])
    return {"num_prompts_each": size, "first_tokens_per_call": round(first, 4), "last_tokens_per_call": round(last, 4),
            "last_over_first": _rounded(last / first) if first else None}


def learning_lines(summary: dict, by_method: dict[str, list[PromptRun]]) -> list[str]:
    """report.md's section on rows that learn online, each beside the same method without the memory when that
    ran too (whose ratio is the prompts' own drift between the two ends)."""
    lines = []
    for method, s in summary.items():
        curve = s.get("learning")
        if not curve:
            continue
        lines.append(f"- `{method}`: {curve['first_tokens_per_call']:.2f} tokens per call over the first "
                     f"{curve['num_prompts_each']} prompts, {curve['last_tokens_per_call']:.2f} over the last "
                     f"{curve['num_prompts_each']}: **{curve['last_over_first']:.2f}x**")
        name = parse_spec(method).name
        plain = next((m for m in by_method if _memory(m) == "off" and parse_spec(m).name == name), None)
        reference = learning_curve(by_method[plain]) if plain else None
        if reference:
            lines[-1] += (f"; `{plain}` on the same prompts: {reference['first_tokens_per_call']:.2f} and "
                          f"{reference['last_tokens_per_call']:.2f} ({reference['last_over_first']:.2f}x)")
    return lines


def against_baseline(runs: list[PromptRun], baseline_runs: list[PromptRun], seed: int) -> dict:
    """Speedup and perplexity ratio to the baseline with 95 % paired bootstrap intervals over prompts (None where
    there are too few prompts, or no perplexity was scored); see :mod:`jointspec.bench.intervals`."""
    by_prompt = {r.prompt_index: r for r in runs}
    pairs = [(by_prompt[b.prompt_index], b) for b in baseline_runs]
    speed = paired_ratio_interval(torch.tensor([[r.num_new_tokens, r.median_seconds] for r, _ in pairs]),
                                  torch.tensor([[b.num_new_tokens, b.median_seconds] for _, b in pairs]),
                                  "rate", seed=seed)
    quality = paired_ratio_interval(torch.tensor([[r.logprob_sum, r.num_scored_tokens] for r, _ in pairs]),
                                    torch.tensor([[b.logprob_sum, b.num_scored_tokens] for _, b in pairs]),
                                    "perplexity", seed=seed)
    decode = None
    if all(r.decode_seconds is not None and b.decode_seconds is not None for r, b in pairs):
        decode = paired_ratio_interval(torch.tensor([[r.num_new_tokens, r.decode_seconds] for r, _ in pairs]),
                                       torch.tensor([[b.num_new_tokens, b.decode_seconds] for _, b in pairs]),
                                       "rate", seed=seed)
    return {"speedup_interval": speed.to_list() if speed else None,
            "decode_speedup_interval": decode.to_list() if decode else None,
            "perplexity_ratio": _rounded(quality.ratio) if quality else None,
            "perplexity_ratio_interval": quality.to_list() if quality else None}


def contract(result: BenchResult, summary: dict) -> dict:
    """The last stdout line: a fixed set of keys per method, for machines."""
    def pick(d: dict) -> dict:
        return {key: d.get(key) for key in CONTRACT_KEYS}

    return {"baseline": result.baseline,
            "methods": {m: {**pick(s), "per_category": {c: pick(cs) for c, cs in s["per_category"].items()}}
                        for m, s in summary.items()}}


COLUMNS = """## Columns

- `tok/s`: every new token over the sum of each prompt's median time (prompt reading included); `min-max`: the same
  over each prompt's slowest and fastest repeat. `speedup`: tok/s over the baseline's.
- `acc.tok`: tokens committed per target call, 1 + accepted draft tokens / rounds (1.00 for plain decoding; for
  transformers' rows, new tokens per target call).
- `identical`: prompts whose answer is the baseline's, token for token (`*`: a row on another target; sampled
  runs: the notes above).
- `ppl`: perplexity of the row's answers under the bench's target as loaded; `dist-2`: distinct bigrams over all
  bigrams of each answer, averaged.
- `draft s`, `verify s`: seconds spent drafting and verifying, summed over the prompts of the first timed repeat.
- `pred.speedup`: the speedup the measured T(k) (below) predicts from the row's rounds, against the baseline's
  prediction; `loop eff`: predicted over measured time (below 1: time outside drafting and the target's forwards).
- `RSS MB`: the process's peak resident memory while the row ran (the weights and every row's state included); `+MB`:
  the most one of the row's answers raised it.
- `prompt s`: mean seconds reading a prompt; `decode x`: the speedup after the prompt was read.
"""


# The placement keys (row_settings') that choose the model a row decodes: its weights, cache and kernels. A row whose
# differ from the baseline's decodes another model (an int4 copy, another cache), so its answers are that model's.
TARGET_KEYS = tuple(key for key in PLACEMENT_KEYS if key not in ("attention", "memory"))


def other_target_rows(result: BenchResult) -> list[str]:
    """The jointspec rows that run another target than the baseline's (``default``'s quantize=auto on a float target):
    their `identical` count compares two models' answers."""
    base = result.settings.get(result.baseline, {})
    if not all(key in base for key in TARGET_KEYS):  # a reference engine as the baseline: no placement to compare
        return []
    return [label for label, row in result.settings.items()
            if label != result.baseline and all(key in row for key in TARGET_KEYS)
            and any(row[key] != base[key] for key in TARGET_KEYS)]


def other_target_note(result: BenchResult, moved: list[str]) -> str | None:
    """What the `*` after the `identical` count of the rows ``moved`` (other_target_rows) means, where there are any."""
    if not moved:
        return None
    base = result.settings[result.baseline]
    placed = "; ".join(f"{label}: " + ", ".join(f"{key} {result.settings[label][key]}" for key in TARGET_KEYS
                                                if result.settings[label][key] != base[key]) for label in moved)
    return (f"* runs another target than the baseline ({placed}): its answers are that model's and may differ from "
            "the baseline's even where the method is lossless; a row on the same target (e.g. ar:quantize=int4) is "
            "what they equal.")


def notes(result: BenchResult, summary: dict) -> list[str]:
    """What the table's figures do not say by themselves for this run: how sure few prompts' intervals are, and which
    answers sampling lets differ from the baseline's or from a rerun's."""
    lines = []
    num_prompts = summary[result.baseline]["num_prompts"]
    if MIN_PROMPTS <= num_prompts < 24:
        lines.append(f"With {num_prompts} prompts a percentile bootstrap is narrow: read the {LEVEL:.0%} intervals as "
                     "nearer 85-90 % (docs/cli.md, `jointspec bench`).\n")
    if result.config.temperature > 0:
        timed = ", ".join(f"`{name}`" for name in cost_aware_by_default())
        lines.append("Sampled: each prompt draws with its own seed. A lossless row's answers follow the target's "
                     "law, but are the baseline's token for token only where its drafts take no random draws and their "
                     "lengths do not follow timing (lookup drafts: `pld`, `corpus`, `lookahead`, and `default` where "
                     f"it drafts by lookup). Rows whose draft lengths follow the measured cost of a draft ({timed} "
                     "unless `cost_aware=false`) can also answer otherwise in a rerun with the same seed.\n")
    return lines


def _penalties(config) -> str:
    """The run's penalties for the report's settings line ("" where none)."""
    if not config.penalties.active:
        return ""
    bias = config.penalties.bias
    return (f", penalties: repetition {config.repetition_penalty}, presence {config.presence_penalty}, frequency "
            f"{config.frequency_penalty}" + (f", logit bias {dict(bias)}" if bias else ""))


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


def _fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(result: BenchResult, summary: dict) -> str:
    """A plain-text table for the terminal (also used in report.md)."""
    header = ["method", "tok/s", "min-max", "speedup", "acc.tok", "identical", "ppl", "dist-2", "draft s", "verify s",
              "pred.speedup", "loop eff", "RSS MB", "+MB", "prompt s", "decode x"]
    rows = [header]
    moved = other_target_rows(result)
    for method, s in summary.items():
        rows.append([method, _fmt(s["tokens_per_second"], ".1f"),
                     f"{_fmt(s['tokens_per_second_min'], '.1f')}-{_fmt(s['tokens_per_second_max'], '.1f')}",
                     _fmt(s["speedup"], ".2f") + "x", _fmt(s["mean_accepted_tokens"]),
                     f"{s['num_identical']}/{s['num_prompts']}" + ("*" if method in moved else ""),
                     _fmt(s["perplexity"]), _fmt(s["distinct_2"]),
                     _fmt(s.get("draft_seconds")), _fmt(s.get("verify_seconds")),
                     _fmt(s.get("predicted_speedup")), _fmt(s.get("loop_efficiency")),
                     _fmt(s["peak_rss_mb"], ".0f"), _fmt(s.get("added_rss_mb"), ".0f"), _fmt(s["prompt_seconds"]),
                     _fmt(s["decode_speedup"], ".2f") + ("x" if s["decode_speedup"] is not None else "")])
    lines = _align(rows)
    categories = list(next(iter(summary.values()))["per_category"])
    if len(categories) > 1:
        cat_rows = [["speedup by category (after the prompt in brackets)"] + list(summary)]
        for c in categories:
            cat_rows.append([f"{c} (n={summary[result.baseline]['per_category'][c]['num_prompts']})"]
                            + [_category_speedup(s["per_category"][c]) for s in summary.values()])
        lines += [""] + _align(cat_rows)
    note = other_target_note(result, moved)
    if note is not None:
        lines += [note]
    intervals = interval_lines(result, summary)
    if intervals:
        lines += [""] + intervals
    return "\n".join(lines)


def _category_speedup(s: dict) -> str:
    """The speedup, and after reading the prompt in brackets where the bench timed that apart."""
    decode = s.get("decode_speedup")
    return _fmt(s["speedup"]) + "x" + (f" ({decode:.2f}x)" if decode is not None else "")


def interval_lines(result: BenchResult, summary: dict) -> list[str]:
    """Each method against the baseline, with the paired bootstrap intervals and what they do (not) show."""
    num_prompts = summary[result.baseline]["num_prompts"]
    if len(summary) == 1:  # the baseline alone: nothing to compare it with
        return []
    if num_prompts < MIN_PROMPTS:
        prompts = "1 prompt" if num_prompts == 1 else f"{num_prompts} prompts"
        return [f"(no {LEVEL:.0%} intervals against the baseline: {prompts}, fewer than {MIN_PROMPTS})"]
    rows = [[f"vs {result.baseline}, {LEVEL:.0%} paired bootstrap over {num_prompts} prompts", "speedup", "",
             "perplexity ratio", "", "decode speedup (after the prompt)", ""]]
    for method, s in summary.items():
        if method == result.baseline:
            continue
        rows.append([method, *_with_interval(s["speedup"], s["speedup_interval"], "slower", "faster"),
                     *_with_interval(s["perplexity_ratio"], s["perplexity_ratio_interval"], "lower", "higher"),
                     *_with_interval(s["decode_speedup"], s.get("decode_speedup_interval"), "slower", "faster")])
    return _align(rows)


def _with_interval(ratio: float | None, interval: list[float] | None, below: str, above: str) -> list[str]:
    """[ratio with its interval, what the interval says]; a difference is claimed only when it excludes 1."""
    if ratio is None or interval is None:
        return ["-", ""]
    low, high = interval
    verdict = below if high < 1.0 else above if low > 1.0 else "no clear difference"
    return [f"{ratio:.3f} [{low:.3f}, {high:.3f}]", verdict]


def _align(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
            for r in rows]


# Every plot a report may hold (write_plots).
REPORT_PLOTS = frozenset({"speedup_by_category.png", "accepted_length.png", "speed_vs_perplexity.png"})


def write_report(result: BenchResult, summary: dict, folder: Path, command: str) -> list[Path]:
    """report.md, results.json and PNG plots in ``folder``; returns the files written. They are written aside first
    and moved in together at the end, so that a run stopped while writing (the plots take a second or two) does not
    leave a new results.json beside an older run's report.md."""
    import shutil
    import tempfile

    made = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=".report-", dir=folder))
    moved = False
    try:
        written = _write_report(result, summary, aside, command)
        for path in written:
            path.replace(folder / path.name)
            moved = True
        # An earlier run's plots that this one did not draw (no matplotlib, --no-perplexity) would sit beside this
        # run's report as if they were its own.
        for name in REPORT_PLOTS - {path.name for path in written}:
            (folder / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(aside, ignore_errors=True)
        if not moved:  # stopped before anything was moved in: the folders made for it go too
            for parent in made:
                with contextlib.suppress(OSError):
                    parent.rmdir()
    return [folder / path.name for path in written]


def _write_report(result: BenchResult, summary: dict, folder: Path, command: str) -> list[Path]:
    env, config = result.environment, result.config
    results = {"command": command, "environment": env, "config": vars(config), "baseline": result.baseline,
               "target_cost": result.target_cost.to_dict() if result.target_cost else None,
               "settings": result.settings, "methods": summary,
               "runs": [{"prompt_index": r.prompt_index, "question_id": r.question_id, "category": r.category,
                         "method": r.method, "seconds": [round(s, 4) for s in r.seconds],
                         "prefill_seconds": (None if r.prefill_seconds is None
                                             else [round(s, 4) for s in r.prefill_seconds]),
                         "num_new_tokens": r.num_new_tokens, "num_target_calls": r.num_target_calls,
                         "identical": r.identical, "output_ids": r.output_ids, "output_text": r.output_text,
                         "logprob_sum": round(r.logprob_sum, 4), "num_scored_tokens": r.num_scored_tokens,
                         "stats": r.stats.to_dict() if r.stats else None} for r in result.runs]}
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plots = write_plots(summary, folder, result.baseline)

    md = ["# jointspec bench\n", f"`{command}`\n",
          f"Model **{env['model']}**, {env['dtype']}"
          f"{' (linear layers on ' + env['kernels'] + ')' if env.get('kernels') else ''}"
          f"{', attention ' + env['attention'] if env.get('attention') else ''}, "
          f"on {env['device']} ({env['device_name']}, "
          f"{env['num_threads']} threads); torch {env['torch']}, transformers {env['transformers']}, "
          f"jointspec {env['jointspec']}"
          f"{' (commit ' + env['jointspec_commit'] + ')' if env.get('jointspec_commit') else ''}, "
          f"Python {env['python']}.\n",
          f"{_count(len(summary[result.baseline]['per_category']), 'category', 'categories')}, "
          f"{_count(summary[result.baseline]['num_prompts'], 'prompt', 'prompts')}, max_new_tokens "
          f"{config.max_new_tokens}, temperature {config.temperature} (top-k {config.top_k}, top-p {config.top_p}"
          f"{f', min-p {config.min_p}' if config.min_p else ''}{_penalties(config)}), "
          f"seed {config.seed}, {_count(config.repeats, 'timed repeat', 'timed repeats')}"
          f"{' after a discarded warm-up' if config.warmup else ' (no warm-up)'}; "
          f"baseline `{result.baseline}`. Times are medians over repeats; min-max is the range.\n",
          "```", table(result, summary), "```\n", *notes(result, summary), COLUMNS]
    load = [env.get("load_average_start"), env.get("load_average_end")]
    if None not in load:
        busy = max(load) > (env.get("cpu_count") or 1)
        md.append(f"1-minute load average at start / end: {load[0]} / {load[1]} on {env.get('cpu_count')} CPUs"
                  + (" — **the machine was busy with other work: timings are unreliable.**\n" if busy else ".\n"))
    if result.target_cost:
        md.append("## Target cost T(k)\n")
        md.append("| k | " + " | ".join(result.target_cost.to_dict()["ms_by_k"]) + " |")
        md.append("|---" * (len(result.target_cost.seconds_by_k) + 1) + "|")
        cost = result.target_cost.to_dict()
        md.append("| ms | " + " | ".join(f"{v:.1f}" for v in cost["ms_by_k"].values()) + " |")
        md.append("| × T(1) | " + " | ".join(f"{v:.2f}" for v in cost["relative_to_k1"].values()) + " |\n")
        md.append(f"Measured after a {result.target_cost.prefill_tokens}-token prefill. Predicted time = prefill + "
                  "rounds × (draft time per round + T(draft tokens per round + 1)); loop efficiency = predicted / "
                  "measured time.\n")
    learning = learning_lines(summary, {m: [r for r in result.runs if r.method == m] for m in result.methods})
    if learning:
        md.append("## Online memory: the first prompts against the last\n")
        md += learning + [""]
    md.append("## Acceptance per draft position\n")
    md.append("Of the rounds that drafted a token at depth d (their number in brackets), the share in which it was "
              "accepted; a tree counts a depth once per round.\n")
    for method, s in summary.items():
        if s.get("acceptance_per_position"):
            counts = s.get("drafted_per_position") or [None] * len(s["acceptance_per_position"])
            md.append(f"- `{method}`: " + ", ".join(f"{x:.2f}" + (f" ({n})" if n is not None else "")
                                                   for x, n in zip(s["acceptance_per_position"], counts)))
    md.append("")
    if result.settings:
        md.append("## Rows as run\n")
        md.append("Each row's settings as resolved from the shared options and its spec (`cost_aware` as the method "
                  "takes it; `quantize: as loaded` is the model line's target itself).\n")
        for label, settings in result.settings.items():
            md.append(f"- `{label}`: " + ", ".join(f"{key} {value}" for key, value in settings.items()))
        md.append("")
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (folder / "report.md").write_text("\n".join(md) + "\n")
    return [folder / "report.md", folder / "results.json", *plots]


def plots_available() -> bool:
    """Whether matplotlib (the ``bench`` extra) is installed: the report then has plots."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plots(summary: dict, folder: Path, baseline: str) -> list[Path]:
    """The report's plots; none where matplotlib is not installed (report.md and results.json do not need it)."""
    if not plots_available():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary)
    categories = list(next(iter(summary.values()))["per_category"]) + ["overall"]
    paths = []

    # Wide enough for the bars, but capped: past ~14 inches a PNG stops being readable on a screen.
    fig, ax = plt.subplots(figsize=(min(14, max(6, 0.6 * len(categories) * max(1, len(methods) / 3))), 5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [summary[method]["per_category"][c]["speedup"] or 0 for c in categories[:-1]]
        values.append(summary[method]["speedup"] or 0)
        ax.bar([j + i * width for j in range(len(categories))], values, width, label=short_label(method))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("speedup (tokens/s vs baseline)")
    ax.set_title("Speedup by category")
    ax.legend(fontsize="small", ncol=min(len(methods), 4))
    paths.append(_save(fig, folder / "speedup_by_category.png"))

    with_stats = [m for m in methods if summary[m].get("accepted_histogram")]
    fig, ax = plt.subplots(figsize=(6, 4))
    longest = max((len(summary[m]["accepted_histogram"]) for m in with_stats), default=1)
    width = 0.8 / max(1, len(with_stats))
    for i, method in enumerate(with_stats):
        counts = summary[method]["accepted_histogram"]
        total = sum(counts) or 1
        ax.bar([a + i * width for a in range(len(counts))], [c / total for c in counts], width,
               label=short_label(method))
    ax.set_xticks([a + 0.4 - width / 2 for a in range(longest)], [str(a) for a in range(longest)])
    ax.set_xlabel("draft tokens accepted in a round")
    ax.set_ylabel("share of rounds")
    ax.set_title("Accepted length")
    if with_stats:
        ax.legend(fontsize="small")
    paths.append(_save(fig, folder / "accepted_length.png"))

    if all(summary[method]["perplexity"] is None for method in methods):  # --no-perplexity: nothing to plot
        return paths
    fig, ax = plt.subplots(figsize=(7, 5))
    base_ppl, base_tps = summary[baseline]["perplexity"], summary[baseline]["tokens_per_second"]
    with_bars = False
    for method in methods:
        s = summary[method]
        if s["perplexity"] is None:
            continue
        # Error bars: the 95 % paired interval of the ratio to the baseline, on the baseline's scale.
        ppl_interval, speed_interval = s.get("perplexity_ratio_interval"), s.get("speedup_interval")
        xerr = yerr = None
        if method != baseline and ppl_interval and base_ppl:
            xerr = [[max(0.0, s["perplexity"] - ppl_interval[0] * base_ppl)],
                    [max(0.0, ppl_interval[1] * base_ppl - s["perplexity"])]]
        if method != baseline and speed_interval and base_tps:
            yerr = [[max(0.0, s["tokens_per_second"] - speed_interval[0] * base_tps)],
                    [max(0.0, speed_interval[1] * base_tps - s["tokens_per_second"])]]
        with_bars = with_bars or xerr is not None or yerr is not None
        ax.errorbar(s["perplexity"], s["tokens_per_second"], xerr=xerr, yerr=yerr, fmt="o", capsize=3,
                    label=short_label(method))
    if with_bars:  # where the baseline stands: a bar crossing its line is no clear difference
        ax.axvline(base_ppl, color="grey", linestyle=":", linewidth=0.8)
        ax.axhline(base_tps, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("perplexity of the answers under the target (lower: likelier to the target)")
    ax.set_ylabel("tokens/s")
    ax.set_title("Speed vs perplexity" + (f" (bars: 95 % paired intervals against {short_label(baseline)})"
                                          if with_bars else ""), fontsize="medium")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1)
    paths.append(_save(fig, folder / "speed_vs_perplexity.png"))
    return paths


def short_label(method: str) -> str:
    """A method's label for a plot: a draft given as a path is named by its last folder."""
    return re.sub(r"draft=[^,]*/([^,/]+)/?(?=,|$)", r"draft=\1", method)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps a legend placed outside the axes
    plt.close(fig)
    return path
