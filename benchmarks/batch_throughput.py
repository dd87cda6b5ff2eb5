"""Throughput of jointspec's batched engine vs transformers' batched ``generate`` (issue 6).

Greedy decoding on the default model (SmolLM2-135M-Instruct), a fixed prompt list (first turns of the built-in
``grounded`` and ``mt_bench`` sets, chat template applied), every configuration decodes the same prompts:

* ``jointspec ar/pld, batch B``: one :class:`~jointspec.batch.engine.BatchEngine` with ``max_batch_size=B``; all prompts
  are submitted at once and continuous batching keeps up to B sequences in flight;
* ``transformers, batch B``: ``model.generate`` on consecutive chunks of B prompts, left padding + attention mask,
  greedy. transformers decodes every row until the longest row stops, so only each row's real new tokens (up to and
  including its first end-of-sequence token) are counted;
* ``single ar``: the single-sequence :class:`~jointspec.api.Pipeline` with method ``ar``, one prompt at a time: the
  reference the ``identical`` column compares each configuration's outputs with.

One warm-up per configuration is discarded; times are ``time.perf_counter`` wall-clock for the whole prompt list.

    python benchmarks/batch_throughput.py                       # 16 prompts, 128 new tokens, batch 1,4,8,16
    python benchmarks/batch_throughput.py --num-prompts 2 --max-new-tokens 8 --batch-sizes 1,2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.loading import load_model
from jointspec.backends.tokens import eos_token_ids
from jointspec.batch.engine import BatchEngine, BatchRequest
from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.core.loop import DecodeConfig
from jointspec.methods import MethodConfig


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    """Alternate grounded (summarise/extract: copy-friendly) and mt_bench first turns (open-ended)."""
    grounded = [p.turns[0] for p in load_prompts("builtin:grounded")]
    mt_bench = [p.turns[0] for p in load_prompts("builtin:mt_bench")]
    texts = [t for pair in zip(grounded, mt_bench) for t in pair][:count]
    if len(texts) < count:
        raise SystemExit(f"only {len(texts)} prompts available")
    return [chat_prompt_ids(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def trim(ids: list[int], eos: frozenset[int]) -> list[int]:
    """Tokens up to and including the first end-of-sequence token (what jointspec returns)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


def run_single(pipe: Pipeline, prompts, max_new: int):
    pipe.generate_ids(prompts[0], GenerationConfig(max_new_tokens=4))  # warm-up, discarded
    start = time.perf_counter()
    outs = [pipe.generate_ids(p, GenerationConfig(max_new_tokens=max_new)).token_ids for p in prompts]
    return outs, time.perf_counter() - start


def run_engine(target, tokenizer, prompts, max_new: int, batch: int, method: MethodConfig, eos):
    engine = BatchEngine(target, tokenizer, max_batch_size=batch)
    engine.generate([BatchRequest(p, DecodeConfig(4, eos_token_ids=eos), method)
                     for p in prompts[:batch]])  # warm-up, discarded
    engine.stats = type(engine.stats)()
    config = DecodeConfig(max_new, eos_token_ids=eos)
    start = time.perf_counter()
    outs = engine.generate([BatchRequest(p, config, method) for p in prompts])
    seconds = time.perf_counter() - start
    return outs, seconds, engine.stats.mean_accepted_tokens


@torch.inference_mode()
def hf_generate(model, pad_id: int, chunk, max_new: int, eos) -> list[list[int]]:
    width = max(map(len, chunk))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], dtype=torch.long)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, temperature=None,
                         top_k=None, top_p=None, eos_token_id=sorted(eos), pad_token_id=pad_id)
    return [trim(row[width:].tolist(), eos) for row in out]


def run_hf(model, pad_id, prompts, max_new: int, batch: int, eos):
    hf_generate(model, pad_id, prompts[:batch], 4, eos)  # warm-up, discarded
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs.extend(hf_generate(model, pad_id, prompts[i:i + batch], max_new, eos))
    return outs, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,4,8,16")
    parser.add_argument("--methods", default="ar,pld", help="jointspec methods, comma-separated (e.g. ar,pld,sps)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' batched generate")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    target, tokenizer = load_model(args.model)
    eos = eos_token_ids(target, tokenizer)
    prompts = build_prompts(tokenizer, args.num_prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    print(f"{len(prompts)} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{args.max_new_tokens} new tokens, greedy, torch threads {torch.get_num_threads()}", flush=True)

    rows = []

    def record(name, batch, outs, seconds, reference, accepted=None):
        tokens = sum(map(len, outs))
        row = {"method": name, "batch": batch, "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(tokens / seconds, 2),
               "identical_to_single_ar": sum(a == b for a, b in zip(outs, reference)), "prompts": len(outs)}
        if accepted is not None:
            row["mean_accepted_tokens"] = round(accepted, 3)
        rows.append(row)
        print(f"{name:14s} batch {batch:3d}: {row['tokens_per_s']:8.2f} tok/s  ({tokens} tokens, {seconds:7.2f} s, "
              f"identical {row['identical_to_single_ar']}/{len(outs)})"
              + (f", {accepted:.2f} tokens/round" if accepted is not None else ""), flush=True)

    pipe = Pipeline(target, tokenizer, MethodConfig("ar"))
    reference, seconds = run_single(pipe, prompts, args.max_new_tokens)
    record("single-ar", 1, reference, seconds, reference)

    for name in args.methods.split(","):
        method = MethodConfig(name, draft="self") if name == "sps" else MethodConfig(name)
        for batch in sizes:
            outs, seconds, accepted = run_engine(target, tokenizer, prompts, args.max_new_tokens, batch, method, eos)
            record(name, batch, outs, seconds, reference, accepted)
    if not args.no_hf:
        for batch in sizes:
            outs, seconds = run_hf(target.model, pad_id, prompts, args.max_new_tokens, batch, eos)
            record("transformers", batch, outs, seconds, reference)

    # The table: tokens/s, speedup vs the same method at batch 1, vs transformers at the same batch size.
    by = {(r["method"], r["batch"]): r for r in rows}
    print("\n| method | batch | tokens/s | vs batch 1 | vs transformers (same batch) | identical to single ar |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        base = by.get((r["method"], 1))
        hf = by.get(("transformers", r["batch"]))
        r["speedup_vs_batch1"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2) if base else None
        r["speedup_vs_transformers"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 2) if hf else None
        print(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_batch1'] or '-'}x | "
              f"{r['speedup_vs_transformers'] or '-'}x | {r['identical_to_single_ar']}/{r['prompts']} |")
    print(json.dumps({"model": args.model, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "machine": platform.machine(), "rows": rows}))


if __name__ == "__main__":
    main()
