"""How close the approximate long-input targets stay to exact decoding: each variant of ``attention=sparse``,
``attention=speckv`` and ``attention=specpc`` against the model with its whole cache, on the long prompts.

Per prompt the prompt is read once; then exact greedy decoding, and each variant from the same cache (a ``specpc``
variant reads the prompt itself, into a cache of its own, since it reads only part of it):

- ``forced``: along the exact answer (teacher forcing), the share of its tokens that are the variant's argmax too:
  per-token agreement, which does not hinge on where the first difference sends the rest of the answer (one
  forward of the whole answer: ``sparse`` then sees the view found at the answer's start);
- ``agree``: the tokens the variant's own greedy answer shares with the exact one before they part;
- ``ppl``: the perplexity of the variant's own answer under the exact model (whole cache);
- ``step ms``: the median decoding step; ``select ms``: the first step, where ``speckv`` drafts its lookahead and
  chooses what to keep; ``read s``: the time to read the prompt (the exact model's, or a ``specpc`` variant's own:
  its scorer's read, the choice, and the target's read of what is kept).

A variant is ``sparse``, ``speckv`` or ``specpc`` with optional fields of ``SparseView`` / ``LookaheadSelection`` /
``PromptCompression`` (drafters/sparse_self.py, drafters/speckv.py, drafters/specpc.py), e.g.
``speckv:capacity=528,reduce=max``, ``sparse:window=256`` or ``specpc:scorer_layers=15``.

    python benchmarks/approximate_attention.py --categories 4k,7k \
        --variants sparse speckv speckv:capacity=528,reduce=max

Ends with one JSON line: per variant, the means over prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time

import torch

from jointspec.backends.loading import load_model
from jointspec.bench.prompts import chat_prompt_ids, load_prompts, select_prompts
from jointspec.drafters.sparse_self import SparseView, SparseViewTarget
from jointspec.drafters.speckv import LookaheadSelection, SpecKVTarget
from jointspec.drafters.specpc import PromptCompressedTarget, PromptCompression

KINDS = {"sparse": (SparseView, SparseViewTarget), "speckv": (LookaheadSelection, SpecKVTarget),
         "specpc": (PromptCompression, PromptCompressedTarget)}


def make_variant(spec: str, target):
    kind, _, options = spec.partition(":")
    if kind not in KINDS:
        raise SystemExit(f"variant '{spec}': the kind must be one of {', '.join(KINDS)}")
    config, wrapper = KINDS[kind]
    types = {field.name: field.type for field in dataclasses.fields(config)}
    fields = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"variant '{spec}': {key} is not one of {', '.join(types)}")
        fields[key] = value if types[key] == "str" else int(value)
    if wrapper is PromptCompressedTarget:  # it reads the prompt itself: a cache of its own
        return wrapper(target.fork(spec), config(**fields))
    return wrapper(target, config(**fields))


def decode(target, first: int, max_new_tokens: int, eos: set[int]) -> tuple[list[int], list[float]]:
    out, steps, feed = [], [], first
    for _ in range(max_new_tokens):
        start = time.perf_counter()
        feed = int(target.forward([feed], argmax_only=True).logits[-1].argmax())
        steps.append(time.perf_counter() - start)
        out.append(feed)
        if feed in eos:
            break
    return out, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompts", default="builtin:long")
    parser.add_argument("--categories", default="4k,7k")
    parser.add_argument("--variants", nargs="+", default=["sparse", "speckv"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model, quantize="auto")
    prompts = select_prompts(load_prompts(args.prompts), categories=args.categories.split(","))
    variants = args.variants
    for spec in variants:
        make_variant(spec, target)  # refuse a bad spec before the first prompt is read
    eos = {tokenizer.eos_token_id}
    rows: dict[str, list[dict]] = {spec: [] for spec in variants}
    for prompt in prompts:
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        target.reset()
        start = time.perf_counter()
        target.forward(ids[:-1], num_logits=0)
        exact_read = time.perf_counter() - start
        end = len(ids) - 1
        exact, steps = decode(target, ids[-1], args.max_new_tokens, eos)
        print(f"{prompt.question_id}: {len(ids)} tokens; exact step {statistics.median(steps) * 1e3:.1f} ms, "
              f"read {exact_read:.1f} s", flush=True)
        for spec in variants:
            target.crop(end)
            variant = make_variant(spec, target)
            start = time.perf_counter()
            if isinstance(variant, PromptCompressedTarget):
                variant.forward(ids[:-1], num_logits=0)
            else:
                variant._tokens = list(ids[:-1])  # the prompt it would have read itself
            read = time.perf_counter() - start if isinstance(variant, PromptCompressedTarget) else exact_read
            out, steps = decode(variant, ids[-1], args.max_new_tokens, eos)
            variant.crop(end)  # speckv keeps its selection: the prompt is still whole
            forced = variant.forward([ids[-1]] + exact[:-1], argmax_only=True).logits.argmax(-1).tolist()
            target.crop(end)
            logits = target.forward([ids[-1]] + out[:-1]).logits
            logprob = float(torch.log_softmax(logits.float(), -1)[torch.arange(len(out)), torch.tensor(out)].sum())
            agree = next((i for i, (a, b) in enumerate(zip(exact, out)) if a != b), min(len(exact), len(out)))
            row = {"forced": sum(a == b for a, b in zip(forced, exact)) / len(exact), "agree": agree,
                   "identical": out == exact, "logprob": logprob, "tokens": len(out),
                   "step_ms": statistics.median(steps) * 1e3, "select_ms": steps[0] * 1e3, "read_s": read}
            rows[spec].append(row)
            print(f"  {spec:32s} forced {row['forced']:.3f}  agree {agree:3d}  ppl {math.exp(-logprob / len(out)):.3f}"
                  f"  step {row['step_ms']:5.1f} ms  select {row['select_ms']:5.0f} ms  read {read:5.1f} s", flush=True)
    summary = {}
    for spec, runs in rows.items():
        summary[spec] = {
            "forced": statistics.mean(r["forced"] for r in runs),
            "agree": statistics.mean(r["agree"] for r in runs),
            "identical": sum(r["identical"] for r in runs),
            "ppl": math.exp(-sum(r["logprob"] for r in runs) / sum(r["tokens"] for r in runs)),
            "step_ms": statistics.median(r["step_ms"] for r in runs),
            "select_ms": statistics.median(r["select_ms"] for r in runs),
            "read_s": statistics.mean(r["read_s"] for r in runs),
            "prompts": len(runs),
        }
        print(f"{spec:32s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in summary[spec].items()))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
