"""Cost curve and quality of the quantised targets: fp32 vs ``--quantize int8|int4`` (and llama.cpp), same model.

For each configuration: the seconds of one forward of k tokens with all k rows of logits (k = 1 is a decode step, k > 1
a verification), relative to k = 1; then quality against the fp32 target on chat prompts from the built-in MT-Bench set:
how many greedy outputs (``--max-new-tokens``) are token-identical to fp32's, where they first differ, the perplexity of
each configuration's outputs under the fp32 target (``jointspec.analysis.quality``), and, teacher forced on fp32's
outputs, the share of positions whose argmax agrees with fp32 and the perplexity the configuration gives fp32's outputs
(how much the model itself changed). Perplexities pool every scored token of every prompt.

Run on a quiet machine (timings on a busy one mean nothing):

    python benchmarks/cost_curve.py --threads 2 --configs none,int8,int4,int4-float-head,llamacpp \\
        --num-prompts 20 --max-new-tokens 128 --repeats 20 --json-out cost_curve.json

Timing method: every configuration prefills the same ``--context`` random tokens into its own cache; then each of
``--repeats`` passes runs every (configuration, k) pair once in a shuffled order, cropping back to the context after
each forward, so drift in machine speed hits all pairs alike; the first pass is a discarded warm-up; the median is
reported. Greedy decoding runs jointspec's ``ar`` loop (the baseline every lossless method must reproduce). The last
stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time

import torch

from jointspec.analysis.quality import token_logprobs
from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.loading import load_model
from jointspec.bench.engines import synchronize
from jointspec.bench.prompts import chat_prompt_ids, load_prompts
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig

CONFIGS = ("none", "int8", "int4", "int8-float-head", "int4-float-head", "llamacpp")


def load_config(name: str, model: str, threads: int):
    """(adapter, seconds to load and quantise) for a configuration name."""
    start = time.perf_counter()
    if name == "llamacpp":
        adapter, _ = load_model(model, backend="llamacpp", threads=threads, name="llamacpp")
    elif name.endswith("-float-head"):
        adapter, _ = load_model(model, name=name)
        quantize_model(adapter.model, name.removesuffix("-float-head"), quantize_head=False)
    else:
        adapter, _ = load_model(model, quantize=name, name=name)
    return adapter, time.perf_counter() - start


def measure_curves(adapters: dict, ks: list[int], context: int, repeats: int, seed: int) -> dict[str, dict[int, float]]:
    """Median seconds of a k-token forward after ``context`` cached tokens, per configuration and k."""
    rng = random.Random(seed)
    vocab = min(a.vocab_size for a in adapters.values())
    prompt = [rng.randrange(vocab) for _ in range(context)]
    for adapter in adapters.values():
        adapter.reset()
        adapter.forward(prompt, num_logits=0)
    samples: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in adapters}
    for timed in [False] + [True] * repeats:
        pairs = [(name, k) for name in adapters for k in ks]
        rng.shuffle(pairs)
        for name, k in pairs:
            adapter = adapters[name]
            tokens = [rng.randrange(vocab) for _ in range(k)]
            synchronize(adapter.device)
            start = time.perf_counter()
            adapter.forward(tokens)  # all k rows of logits, as verification needs
            synchronize(adapter.device)
            elapsed = time.perf_counter() - start
            adapter.crop(context)
            if timed:
                samples[name][k].append(elapsed)
    for adapter in adapters.values():
        adapter.reset()
    return {name: {k: statistics.median(v) for k, v in by_k.items()} for name, by_k in samples.items()}


def chat_prompts(tokenizer, num_prompts: int) -> list[tuple[str, list[int]]]:
    """First turns of built-in MT-Bench prompts, taken round-robin over categories so a few cover them all."""
    by_category: dict[str, list] = {}
    for prompt in load_prompts("builtin:mt_bench"):
        by_category.setdefault(prompt.category, []).append(prompt)
    picked = []
    while len(picked) < num_prompts and any(by_category.values()):
        for prompts in by_category.values():
            if prompts and len(picked) < num_prompts:
                picked.append(prompts.pop(0))
    return [(p.question_id, chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}])) for p in picked]


@torch.inference_mode()
def teacher_forced(adapter, prompt_ids: list[int], reference_ids: list[int],
                   reference_argmax: torch.Tensor | None) -> tuple[float, int, torch.Tensor]:
    """(sum of log p(reference_ids), positions whose argmax equals ``reference_argmax``, argmax per position).

    Through the adapter's own forward, so llama.cpp scores exactly as it decodes."""
    adapter.reset()
    logits = adapter.forward(prompt_ids + reference_ids[:-1], num_logits=len(reference_ids)).logits.float()
    adapter.reset()
    logprobs = logits.log_softmax(-1).gather(-1, torch.tensor(reference_ids)[:, None])[:, 0]
    argmax = logits.argmax(-1)
    agree = int((argmax == reference_argmax).sum()) if reference_argmax is not None else len(reference_ids)
    return float(logprobs.sum()), agree, argmax


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2) or a model source; "
                                                           "llamacpp needs 'default' or a .gguf file")
    parser.add_argument("--configs", default="none,int8,int4",
                        help="comma-separated, from: " + ", ".join(CONFIGS) + " (none = fp32, the reference)")
    parser.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    parser.add_argument("--ks", default="1,2,4,8,16", help="forward sizes; must include 1")
    parser.add_argument("--context", type=int, default=200, help="cached tokens before each timed forward")
    parser.add_argument("--repeats", type=int, default=20, help="timed passes (median)")
    parser.add_argument("--num-prompts", type=int, default=20, help="MT-Bench first turns for the quality part")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    ks = sorted({int(k) for k in args.ks.split(",")})
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if ks[0] != 1:
        parser.error("--ks must include 1 (the curve is relative to one step)")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    load_at_start = os.getloadavg()[0]

    reference, tokenizer = load_model(args.model, name="fp32")
    adapters, load_seconds = {"none": reference}, {"none": None}
    for name in configs:
        if name != "none":
            adapters[name], load_seconds[name] = load_config(name, args.model, threads)
    print(f"loaded {', '.join(adapters)}; timing {len(ks)} sizes x {args.repeats} passes", file=sys.stderr)
    curves = measure_curves(adapters, ks, args.context, args.repeats, args.seed)

    prompts = chat_prompts(tokenizer, args.num_prompts)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0)
    outputs: dict[str, list[list[int]]] = {}
    for name, adapter in adapters.items():
        pipeline = Pipeline(adapter, tokenizer, MethodConfig(name="ar"))
        outputs[name] = [pipeline.generate_ids(ids, generation).token_ids for _, ids in prompts]
        print(f"decoded {len(prompts)} prompts with {name}", file=sys.stderr)

    results = {}
    reference_argmax: list[torch.Tensor] = []
    for name, adapter in adapters.items():
        differences = [first_difference(out, ref) for out, ref in zip(outputs[name], outputs["none"])]
        logprob_sum = agree = scored = 0
        for index, ((_, ids), ref) in enumerate(zip(prompts, outputs["none"])):
            if not ref:
                continue
            logprob, hits, argmax = teacher_forced(adapter, ids, ref,
                                                   reference_argmax[index] if name != "none" else None)
            if name == "none":
                reference_argmax.append(argmax)
            logprob_sum, agree, scored = logprob_sum + logprob, agree + hits, scored + len(ref)
        own = [token_logprobs(reference, ids, out) for (_, ids), out in zip(prompts, outputs[name])]
        own_count = sum(len(logprobs) for logprobs in own)
        curve = curves[name]
        results[name] = {
            "ms_by_k": {str(k): round(s * 1e3, 3) for k, s in curve.items()},
            "relative_to_k1": {str(k): round(s / curve[1], 3) for k, s in curve.items()},
            "load_seconds": None if load_seconds[name] is None else round(load_seconds[name], 2),
            "num_identical": sum(d is None for d in differences),
            "num_prompts": len(prompts),
            "first_difference": differences,
            "perplexity_under_fp32": (round(math.exp(-sum(float(lp.sum()) for lp in own) / own_count), 4)
                                      if own_count else None),
            "teacher_forced_argmax_agreement": round(agree / scored, 4) if scored else None,
            "teacher_forced_perplexity": round(math.exp(-logprob_sum / scored), 4) if scored else None,
        }

    print(f"\n{args.model}, {threads} threads, context {args.context}, {args.repeats} passes; quality on "
          f"{len(prompts)} MT-Bench prompts x {args.max_new_tokens} new tokens, greedy\n")
    print("| config | step (k=1) | " + " | ".join(f"k={k}" for k in ks[1:]) + " | identical to fp32 | "
          "ppl of own outputs (fp32 scores) | teacher-forced argmax agreement | ppl of fp32 outputs |")
    print("|---|---:|" + "---:|" * (len(ks) - 1) + "---:|---:|---:|---:|")
    for name, r in results.items():
        relative = " | ".join(f"{r['relative_to_k1'][str(k)]:.2f}x" for k in ks[1:])
        print(f"| {name} | {r['ms_by_k']['1']:.1f} ms | {relative} | {r['num_identical']}/{r['num_prompts']} | "
              f"{r['perplexity_under_fp32']} | {r['teacher_forced_argmax_agreement']} | "
              f"{r['teacher_forced_perplexity']} |")
    load_at_end = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if max(load_at_start, load_at_end) > cpus:
        print(f"warning: load average {max(load_at_start, load_at_end):.2f} on {cpus} CPUs: other work competed, "
              "timings are unreliable", file=sys.stderr)
    record = {"model": args.model, "threads": threads, "context": args.context, "repeats": args.repeats,
              "max_new_tokens": args.max_new_tokens, "prompts": [q for q, _ in prompts],
              "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "cpu_count": cpus,
              "load_average": [round(load_at_start, 2), round(load_at_end, 2)], "configs": results}
    line = json.dumps(record)
    if args.json_out:
        with open(args.json_out, "w") as handle:
            handle.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
