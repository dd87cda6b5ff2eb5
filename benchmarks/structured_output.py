"""Structured output through speculation: methods side by side on extraction requests answered as schema-valid JSON.

Each prompt gives a short text and asks for its facts as JSON; each is decoded greedily under its JSON schema
(``GenerationConfig.output_format``, core/grammar.py) by every ``--methods`` entry, the methods alternating prompt by
prompt and their order reversed every other repeat. Reported per method: tokens a second after the prompt (the best of
``--repeats``), tokens per target call, answers that parse and carry the schema's required keys, and the ratio to the
first method (the geometric mean of per-prompt ratios, with a 95 % t interval over prompts), plus whether every answer
equals the first method's (greedy: a lossless method must). ``--free`` adds each method without the schema, for
what the grammar itself costs or gives. ``--temperature T`` samples instead (each prompt's seed its index, the same
for every method: with temperature alone, rows drawn by position, prompt lookup's drafts give plain sampling's
tokens)::

    python benchmarks/structured_output.py --methods ar,default --repeats 3 --threads 2 --free
    python benchmarks/structured_output.py --methods ar,default --repeats 3 --threads 2 --temperature 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch
from scipy import stats

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.loading import load_model
from jointspec.core.grammar import OutputFormat
from jointspec.methods import MethodConfig

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {"product": {"type": "string"}, "price": {"type": "number"},
                                            "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
                                            "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "currency", "in_stock"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"title": {"type": "string"}, "date": {"type": "string"},
                                          "place": {"type": "string"},
                                          "speakers": {"type": "array", "items": {"type": "string"}}},
         "required": ["title", "date", "place", "speakers"], "additionalProperties": False}
TASK = {"type": "object", "properties": {"task": {"type": "string"},
                                         "priority": {"type": "string", "enum": ["low", "medium", "high"]},
                                         "due": {"type": "string"}, "owner": {"type": "string"}},
        "required": ["task", "priority", "due", "owner"], "additionalProperties": False}

# (text, schema): short texts written for this benchmark.
PROMPTS = [
    ("Maria Lopez is 34 years old and lives in Valencia, where she teaches music.", PERSON),
    ("Our new neighbour, Tom Becker, moved to Hamburg last spring. He turned 51 in May.", PERSON),
    ("Kenji Sato, 27, works as a nurse in Osaka and plays the drums on weekends.", PERSON),
    ("The Trailrunner 3 backpack costs 89.90 euros and is currently sold out everywhere.", PRODUCT),
    ("Get the Aurora desk lamp for $45.00 today: plenty left in our warehouse.", PRODUCT),
    ("A pack of Highland green tea sells for 6.50 GBP; the shop has it in stock.", PRODUCT),
    ("On 14 March 2027 the Lisbon Data Forum takes place at the Tagus Hall, with talks by Ana Silva and Rui Costa.",
     EVENT),
    ("Join us at the Riverside Library on June 2nd for 'Gardens in Small Spaces', presented by Claire Dubois.",
     EVENT),
    ("Priya must send the quarterly report to finance by Friday; this is urgent.", TASK),
    ("Whenever he has time, Marco could tidy the shared drive. No deadline, really; maybe end of month.", TASK),
]


def prompt_text(text: str, schema: dict) -> str:
    keys = ", ".join(schema["properties"])
    return f"Read the text and give its facts as a JSON object with the keys {keys}.\n\nText: {text}"


def valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(schema["required"]) <= set(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--methods", default="ar,default", help="comma-separated; the first is the reference")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--free", action="store_true", help="also each method without the schema")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model, quantize=args.quantize)
    names = args.methods.split(",")
    rows = [(name, True) for name in names] + ([(name, False) for name in names] if args.free else [])
    pipelines = {name: Pipeline(target, tokenizer, MethodConfig(name=name)) for name in names}
    # best seconds after the prompt, tokens, calls, text, per (row, prompt)
    results: dict[tuple[str, bool], list[dict]] = {row: [dict() for _ in PROMPTS] for row in rows}
    for repeat in range(args.repeats + 1):  # the first pass warms up and is not kept
        for i, (text, schema) in enumerate(PROMPTS):
            order = rows if (repeat + i) % 2 == 0 else rows[::-1]
            for name, shaped in order:
                config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=i,
                                          output_format=OutputFormat.json_schema(schema) if shaped else None)
                result = pipelines[name].generate(prompt_text(text, schema), config)
                seconds = result.seconds - result.stats.prefill_seconds
                cell = results[(name, shaped)][i]
                if repeat and seconds < cell.get("seconds", math.inf):
                    cell.update(seconds=seconds, tokens=len(result.token_ids), calls=result.stats.num_rounds,
                                ids=result.token_ids, text=result.text)
        print(f"pass {repeat} done", file=sys.stderr, flush=True)
    reference = results[rows[0]]
    report = {}
    decoding = f"temperature {args.temperature:g}" if args.temperature else "greedy"
    print(f"{len(PROMPTS)} extraction prompts, {decoding}, {args.max_new_tokens} tokens at most, "
          f"best of {args.repeats}")
    for row in rows:
        cells = results[row]
        tokens = sum(c["tokens"] for c in cells)
        seconds = sum(c["seconds"] for c in cells)
        ratios = [math.log((c["tokens"] / c["seconds"]) / (r["tokens"] / r["seconds"]))
                  for c, r in zip(cells, reference)]
        mean = statistics.fmean(ratios)
        half = stats.t.ppf(0.975, len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios))
        same = sum(c["ids"] == r["ids"] for c, r in zip(cells, reference))
        ok = sum(valid(c["text"], schema) for c, (_, schema) in zip(cells, PROMPTS))
        label = f"{row[0]}{'' if row[1] else ' (free text)'}"
        per_call = tokens / sum(c["calls"] for c in cells)
        print(f"{label:24} {tokens / seconds:7.1f} tok/s  {per_call:4.2f} tokens a call  "
              f"{math.exp(mean):.3f}x [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]  "
              f"same as {rows[0][0]}: {same}/{len(PROMPTS)}  schema-valid JSON: {ok}/{len(PROMPTS)}")
        report[label] = {"tokens_per_second": tokens / seconds, "ratio": math.exp(mean),
                         "low": math.exp(mean - half), "high": math.exp(mean + half), "identical": same,
                         "valid": ok, "texts": [c["text"] for c in cells]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
