"""Required tool calls (``tool_choice: "required"``) decoded by several methods on the engine ``jointspec serve`` runs.

A call is mostly text the grammar forces (``<tool_call>``, the keys, the function's name where one fits the start
written so far, the closing tags), which speculation commits without a forward of its own, and arguments the model
chooses. This times what that is worth: each request is a user message with three tools offered
(``server/tools.py`` renders them as the server does, as a system message on the embedded model), greedy, one call
(``parallel_tool_calls: false``), one request in flight, on the
:class:`~jointspec.batch.lockstep.LockstepEngine` without HTTP, each method once untimed and then ``--repeats``
times, methods alternating. It checks that every method wrote the same calls, and prints each method's tokens per
second, its ratio to the first method per repeat, and tokens per forward (the engine's rounds), then one JSON line::

    python benchmarks/tool_calls.py                                  # ar,default, 12 requests, 3 repeats
    python benchmarks/tool_calls.py --methods ar,pld,default --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lockstep_methods import run  # noqa: E402

from jointspec.backends.loading import load_model  # noqa: E402
from jointspec.backends.tokens import chat_template_ids, eos_token_ids  # noqa: E402
from jointspec.batch.lockstep import LockstepEngine  # noqa: E402
from jointspec.bench.runner import _cpu_name  # noqa: E402
from jointspec.core.grammar import Grammar  # noqa: E402
from jointspec.core.loop import DecodeConfig  # noqa: E402
from jointspec.server.tools import prompt_messages, read_calls, read_tool_use  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "The sum of two numbers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "number"}, "b": {"type": "number"}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web for pages on a topic",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 80},
                                          "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                                          "required": ["query", "max_results"], "additionalProperties": False}}},
]
REQUESTS = [
    "What is the weather like in Paris right now?", "Is it raining in Tokyo? Use fahrenheit.",
    "How warm is it in Cairo today?", "Tell me the temperature in Oslo in celsius.",
    "What is 1234 plus 5678?", "Add 3.5 and 17.25 for me.", "What do 999 and 1 make together?",
    "Sum 42 and 58.", "Find me three pages about the history of the printing press.",
    "Search for recent news on fusion energy, five results.", "Look up the best hiking trails near Denver.",
    "Find a tutorial on Python decorators.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--methods", default="ar,default", help="comma-separated; the first is the reference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    methods = args.methods.split(",")

    model, tokenizer = load_model(args.model, quantize=args.quantize)
    use = read_tool_use(TOOLS, "required", False)
    prompts = [chat_template_ids(tokenizer, prompt_messages([{"role": "user", "content": text}], use.shown(),
                                                            native=False)[0]) for text in REQUESTS]
    eos = eos_token_ids(model, tokenizer)
    grammar = Grammar(use.output_format(), tokenizer, model.vocab_size, eos)
    config = DecodeConfig(args.max_new_tokens, eos_token_ids=eos, grammar=grammar)
    engine = LockstepEngine(model, tokenizer, max_batch_size=1)

    results: dict[str, list] = {method: [] for method in methods}
    for repeat in range(args.repeats + 1):  # the first untimed
        order = methods if repeat % 2 == 0 else methods[::-1]
        for method in order:
            rounds: list = []
            result = run(engine, method, prompts, 1, config, rounds)
            if repeat:
                results[method].append((result, len(rounds)))
    reference = results[methods[0]][0][0].answers
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in reference]
    calls = [read_calls(text, use).calls for text in texts]
    report = {"cpu": _cpu_name(), "methods": {}, "calls_read": sum(1 for c in calls if c),
              "requests": len(REQUESTS)}
    print(f"{len(REQUESTS)} requests, greedy, one call each; {report['calls_read']} answers read as a call; "
          f"CPU: {report['cpu']}")
    for method in methods:
        runs = [result for result, _ in results[method]]
        same = all(r.answers == reference for r in runs)
        rate = max(r.tokens / r.seconds for r in runs)
        ratios = [ref.seconds / r.seconds for (ref, _), r in zip(results[methods[0]], runs)]
        mean = statistics.geometric_mean(ratios)
        per_forward = runs[0].tokens / results[method][0][1]
        report["methods"][method] = {"tokens_per_second": round(rate, 1), "ratio": round(mean, 3),
                                     "ratios": [round(r, 3) for r in ratios], "tokens_per_forward":
                                     round(per_forward, 2), "same_calls": same}
        print(f"{method:10} {rate:7.1f} tok/s  {mean:.3f}x of {methods[0]} (repeats "
              f"{', '.join(f'{r:.3f}' for r in ratios)}), {per_forward:.2f} tokens a forward, same calls as "
              f"{methods[0]}: {same}")
    print(f"first call: {calls[0][0]['function'] if calls[0] else texts[0]!r}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
