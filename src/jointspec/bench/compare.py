"""Paired 95 % intervals between any two methods of a finished bench run, from its ``results.json``.

The bench reports every method against its baseline. To ask "is MTAD faster than ``sps``, does it lower perplexity
against it" without running again, :func:`compare_methods` reads the per-prompt times, token counts and
log-probabilities that ``results.json`` keeps and applies the bench's own paired bootstrap
(:mod:`jointspec.bench.intervals`, seeded with the run's seed). Methods may be named by their full label or by a
unique part of it. Perplexity needs a run scored with perplexity on; without it only the speedup has an interval.

Several runs over disjoint prompts (shards: one process per category group, or one machine each) pool into one
comparison with :func:`pool_results`. A prompt draws with a seed derived from its question id, not from its position
(``runner.prompt_seed``), so sharded runs with the same settings sample exactly what one run over all the prompts
would; timings stay paired within the run that made them.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import torch

from jointspec.bench.intervals import MIN_PROMPTS, RatioInterval, paired_ratio_interval, ratio_of_sums
from jointspec.core.errors import JointspecError


class ResultsError(JointspecError):
    """A results.json that cannot be read, or a method it does not hold."""


def load_results(path: str | Path) -> dict:
    """A bench run's results.json (``jointspec bench --report-dir``), with a clear error when it is not one."""
    try:
        results = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise ResultsError(f"cannot read '{path}': {error.strerror or error}") from None
    except ValueError as error:
        raise ResultsError(f"'{path}' is not JSON ({error})") from None
    if not isinstance(results, dict) or not isinstance(results.get("methods"), dict) or "runs" not in results:
        raise ResultsError(f"'{path}' is not a bench results.json (no 'methods' and 'runs'); jointspec bench "
                           "--report-dir DIR writes one")
    return results


# Settings that change what a run samples or scores; shards with different values do not pool.
POOLED_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "logit_bias", "seed", "perplexity", "repeats", "quantize",
                   "auto_quantize", "kv_cache", "chat_template_kwargs")
# What a results.json written before a setting existed ran with.
SETTING_DEFAULTS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "logit_bias": [], "chat_template_kwargs": None}


def _model_name(model):
    """A model as shards on several machines name it alike: a folder or file by its last component (each machine
    keeps its copy at its own path)."""
    from jointspec.backends.loading import looks_like_path

    return Path(model).name if isinstance(model, str) and looks_like_path(model) else model  # a hub id: as given


def _machine_free(settings: dict) -> dict:
    """A row's settings with the GGUF it ran named as _model_name names a model."""
    return {key: _model_name(value) if key == "model" else value for key, value in settings.items()}


def pool_results(results: list[dict], names: list[str] | None = None) -> dict:
    """One results dict from bench runs over disjoint prompts with the same methods and settings.

    Runs are renumbered so their prompt indices stay distinct; the config is the first run's. Refused, naming the
    file: methods or a sampling setting that differ, and a prompt (question id and category) in two runs."""
    if not results:
        raise ResultsError("no results to pool")
    names = names or [f"run {i + 1}" for i in range(len(results))]
    first, first_config = results[0], results[0].get("config", {})
    pooled_runs: list[dict] = []
    owner: dict[tuple, str] = {}
    offset = 0
    for name, result in zip(names, results):
        if list(result["methods"]) != list(first["methods"]):
            raise ResultsError(f"{name} ran methods {', '.join(result['methods'])}, {names[0]} ran "
                               f"{', '.join(first['methods'])}; only runs of the same methods pool")
        config = result.get("config", {})
        for key in POOLED_SETTINGS:
            mine, theirs = (c.get(key, SETTING_DEFAULTS.get(key)) for c in (config, first_config))
            if mine != theirs:
                raise ResultsError(f"{name} has {key}={mine!r}, {names[0]} has {key}={theirs!r}; only runs with the "
                                   "same settings pool")
        model, first_model = (r.get("environment", {}).get("model") for r in (result, first))
        if _model_name(model) != _model_name(first_model):
            raise ResultsError(f"{name} ran model {model!r}, {names[0]} ran {first_model!r}; only runs of one target "
                               "pool")
        for label, row in (result.get("settings") or {}).items():  # a method's own settings as run (its spec)
            theirs = (first.get("settings") or {}).get(label)
            if theirs is not None and _machine_free(row) != _machine_free(theirs):
                differing = sorted(key for key in {*row, *theirs} if row.get(key) != theirs.get(key))
                raise ResultsError(f"{name} ran '{label}' with other settings than {names[0]} "
                                   f"({', '.join(differing)}); only runs with the same settings pool")
        indices = sorted({run["prompt_index"] for run in result["runs"]})
        renumber = {index: offset + i for i, index in enumerate(indices)}
        for index in indices:
            run = next(r for r in result["runs"] if r["prompt_index"] == index)
            key = (run.get("question_id"), run.get("category"))
            if key in owner:
                raise ResultsError(f"prompt {key[0]!r} ({key[1]}) is in both {owner[key]} and {name}; pooled "
                                   "runs must hold disjoint prompts")
            owner[key] = name
        pooled_runs += [{**run, "prompt_index": renumber[run["prompt_index"]]} for run in result["runs"]]
        offset += len(indices)
    return {**first, "runs": pooled_runs}


def pick_method(labels: list[str], wanted: str) -> str:
    """The label ``wanted`` names: itself, or the one label that contains it."""
    if wanted in labels:
        return wanted
    matches = [label for label in labels if wanted in label]
    if len(matches) != 1:
        raise ResultsError(f"'{wanted}' matches {len(matches)} of the run's methods"
                           + (f" ({', '.join(matches)})" if matches else "") + f"; the run has: {', '.join(labels)}")
    return matches[0]


def _parts(runs: list[dict], kind: str) -> torch.Tensor:
    """[num_prompts, 2] in ``runs``' order: (tokens, median seconds), (tokens, median seconds after the prompt was
    read: ``decode``, as the bench's PromptRun.decode_seconds) or (log-prob sum, scored tokens)."""
    if kind == "rate":
        return torch.tensor([[r["num_new_tokens"], statistics.median(r["seconds"])] for r in runs],
                            dtype=torch.float64)
    if kind == "decode":
        return torch.tensor([[r["num_new_tokens"], statistics.median(s - p for s, p in zip(r["seconds"],
                                                                                          r["prefill_seconds"]))]
                             for r in runs], dtype=torch.float64)
    return torch.tensor([[r.get("logprob_sum", 0.0), r.get("num_scored_tokens", 0)] for r in runs],
                        dtype=torch.float64)


def _interval_dict(interval: RatioInterval | None, mine: torch.Tensor, theirs: torch.Tensor, kind: str) -> dict | None:
    """The ratio with its interval; under MIN_PROMPTS prompts the ratio alone (interval None); None where the ratio
    is undefined (nothing scored, no time)."""
    if interval is not None:
        return {"ratio": round(interval.ratio, 4), "interval": interval.to_list(),
                "excludes_1": interval.excludes_one}
    sums = torch.cat([mine.sum(0), theirs.sum(0)]).double()[None]
    if not len(mine) or not torch.isfinite(sums).all() or (sums[0, [1, 3]] <= 0).any():
        return None
    ratio = float(ratio_of_sums(sums, kind)[0])
    return {"ratio": round(ratio, 4), "interval": None, "excludes_1": None} if math.isfinite(ratio) else None


def compare_methods(results: dict, method: str, reference: str) -> dict:
    """``method`` against ``reference`` over the prompts both ran: the speedup and the perplexity ratio, each with
    its paired bootstrap interval (the ratio alone with fewer than :data:`~jointspec.bench.intervals.MIN_PROMPTS`
    prompts; None where nothing was scored). Both may be given as unique parts of their labels."""
    labels = list(results["methods"])
    method, reference = pick_method(labels, method), pick_method(labels, reference)
    if method == reference:
        raise ResultsError(f"both names pick '{method}': compare two different methods of the run "
                           f"({', '.join(labels)})")
    by_prompt = {label: {r["prompt_index"]: r for r in results["runs"] if r["method"] == label}
                 for label in (method, reference)}
    prompts = sorted(by_prompt[method])
    if prompts != sorted(by_prompt[reference]):
        raise ResultsError(f"'{method}' and '{reference}' ran different prompts; they cannot be paired")
    seed = results.get("config", {}).get("seed", 0)
    out: dict = {"method": method, "reference": reference, "num_prompts": len(prompts)}
    # After the prompt: where both methods' engines timed their prompt reading apart (the bench's "decode x").
    timed_apart = all(by_prompt[label][p].get("prefill_seconds") for label in (method, reference) for p in prompts)
    for kind, name in (("rate", "speedup"), ("perplexity", "perplexity_ratio"), ("decode", "decode_speedup")):
        if kind == "decode" and not timed_apart:
            out[name] = None
            continue
        mine = _parts([by_prompt[method][p] for p in prompts], kind)
        theirs = _parts([by_prompt[reference][p] for p in prompts], kind)
        rate = "perplexity" if kind == "perplexity" else "rate"
        out[name] = _interval_dict(paired_ratio_interval(mine, theirs, rate, seed=seed), mine, theirs, rate)
    return out


def describe(comparison: dict) -> list[str]:
    """Lines for people: one per ratio, ``-`` where it has no interval."""
    lines = [f"{comparison['method']} against {comparison['reference']}, {comparison['num_prompts']} prompts"]
    # The speedup after the prompt where the run timed it (every jointspec engine and llama.cpp's loop do).
    names = ("speedup", "perplexity_ratio") + (("decode_speedup",) if comparison.get("decode_speedup") else ())
    for name in names:
        row = comparison[name]
        if row is None:
            lines.append(f"{name}: -")
        elif row["interval"] is None:
            lines.append(f"{name}: {row['ratio']:.3f}")
        else:
            lines.append(f"{name}: {row['ratio']:.3f} [{row['interval'][0]:.3f}, {row['interval'][1]:.3f}]")
    if comparison["num_prompts"] < MIN_PROMPTS:
        lines.append(f"(no intervals under {MIN_PROMPTS} prompts)")
    else:
        bare = [name for name in names if comparison[name] is not None and comparison[name]["interval"] is None]
        if bare:  # the ratio is defined over all the prompts, but not over most resamples of them
            lines.append(f"({' and '.join(bare)}: no interval, the ratio being undefined in most bootstrap resamples "
                         "of these prompts)")
    return lines
