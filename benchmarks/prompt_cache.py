"""Multi-turn conversations on the lockstep engine (what ``jointspec serve`` runs on the int4 kernels), with the prompt
cache (``serve --prompt-cache-mb``) and without, one conversation at a time, without HTTP.

A chat client sends the whole conversation with each turn. Each conversation of the chosen sets is played turn by
turn: the model's answer (greedy, ``--max-new-tokens``) goes into the next turn's prompt, rendered by the model's chat
template as the server renders messages. Sets whose prompts have one turn get ``--follow-up`` as a second. Each
conversation runs with the cache and without, in alternating order, on two engines over the same model. Reported per
turn: prompt tokens, those the cache served, and the time from submitting the turn to its first token (the prompt's
reading and one round), each the median over the conversations, with the ratio of the two times paired by
conversation; and whether every answer was the same both ways (it must be: the reused entries are the bits the
prompt's own reading writes).

    python benchmarks/prompt_cache.py --conversations 16                         # MT-Bench's two-turn questions
    python benchmarks/prompt_cache.py --prompt-sets builtin:long --categories 2k --conversations 4
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def turn(engine: LockstepEngine, prompt: list[int], config: DecodeConfig, method: MethodConfig):
    """One turn alone on ``engine``: (answer ids, seconds to the first token, prompt tokens the cache served)."""
    start = time.perf_counter()
    seq_id = engine.submit(BatchRequest(tuple(prompt), config, method))
    answer, first, reused = [], None, 0
    while engine.has_work:
        for event in engine.step():
            if event.seq_id != seq_id:
                continue
            if event.error is not None:
                raise event.error
            if event.token_ids and first is None:
                first = time.perf_counter() - start
            answer.extend(event.token_ids)
            if event.finish_reason is not None:
                reused = event.stats.prompt_tokens_reused
    return answer, first, reused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--method", default="default")
    parser.add_argument("--prompt-sets", nargs="+", default=["builtin:mt_bench"], metavar="SET")
    parser.add_argument("--categories", default=None, help="comma-separated categories of the sets (default: all)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--follow-up", default="Now say the same in three short bullet points.",
                        help="the second turn of a set whose prompts have one")
    parser.add_argument("--prompt-cache-mb", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, quantize=args.quantize)
    categories = set(args.categories.split(",")) if args.categories else None
    chats = [p.turns if len(p.turns) > 1 else [*p.turns, args.follow_up]
             for source in args.prompt_sets for p in load_prompts(source)
             if categories is None or p.category in categories][:args.conversations]
    config = DecodeConfig(max_new_tokens=args.max_new_tokens, eos_token_ids=frozenset(
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))
    method = MethodConfig(args.method)
    engines = {"cached": LockstepEngine(model, tokenizer, max_batch_size=1,
                                        prompt_cache_bytes=args.prompt_cache_mb * 2 ** 20),
               "uncached": LockstepEngine(model, tokenizer, max_batch_size=1)}
    turn(engines["uncached"], chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hello"}]), config, method)
    rows: dict[int, dict[str, list]] = {}
    same = True
    for index, chat in enumerate(chats):
        order = ["cached", "uncached"] if index % 2 == 0 else ["uncached", "cached"]
        answers = {}
        for name in order:
            messages, texts = [], []
            for number, question in enumerate(chat):
                messages.append({"role": "user", "content": question})
                prompt = chat_prompt_ids(tokenizer, messages)
                answer, first, reused = turn(engines[name], prompt, config, method)
                text = tokenizer.decode(answer, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                texts.append(answer)
                cell = rows.setdefault(number, {"prompt": [], "reused": [], "cached": [], "uncached": []})
                cell[name].append(first)
                if name == "cached":
                    cell["prompt"].append(len(prompt))
                    cell["reused"].append(reused)
            answers[name] = texts
        same = same and answers["cached"] == answers["uncached"]
    report = {"cpu": _cpu_name(), "kernels": selected_isa(), "threads": torch.get_num_threads(),
              "conversations": len(chats), "prompt_sets": args.prompt_sets, "method": args.method,
              "max_new_tokens": args.max_new_tokens, "answers_identical": same, "turns": []}
    print(f"{_cpu_name()}, {selected_isa()} kernels, {torch.get_num_threads()} threads; {len(chats)} conversations, "
          f"method {args.method}; answers identical with and without the cache: {same}")
    print("turn  prompt tokens  served by cache  first token: cached / uncached (s)  ratio (paired)")
    for number, cell in sorted(rows.items()):
        ratios = [c / u for c, u in zip(cell["cached"], cell["uncached"])]
        ratio = statistics.geometric_mean(ratios)
        line = {"turn": number + 1, "prompt_tokens": statistics.median(cell["prompt"]),
                "served_by_cache": statistics.median(cell["reused"]),
                "first_token_cached_s": statistics.median(cell["cached"]),
                "first_token_uncached_s": statistics.median(cell["uncached"]), "ratio": ratio}
        report["turns"].append(line)
        print(f"{number + 1:>4}  {line['prompt_tokens']:>13.0f}  {line['served_by_cache']:>15.0f}  "
              f"{line['first_token_cached_s']:>17.3f} / {line['first_token_uncached_s']:.3f}  {ratio:>14.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
