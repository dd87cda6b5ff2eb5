"""Sampled decoding's fast paths against the code before them, side by side in one process.

``--compare screen`` (the default): a sampled row with a top-k of at most ``SCREEN_TOP_K_MAX`` reads the screen's top
k (``ScreenedInt8Head.top_k_logits``: exact logits for every token near the row's k-th best score) instead of every
logit of the exact head; the "old" side is the same adapter, its head's ``top_k_logits`` replaced by the exact head
for the run. Where the screen held every token of the exact top k, both sides sample the same tokens.

``--compare row-kernels``: sampling's top-k search and inverse-transform draw run on the compiled kernels
(``top_k_rows``, ``sample_rows``: core/sampling.py) instead of PyTorch's full-row operations; both sides sample the
same tokens by construction (tests/test_sampling_kernels.py), which the count of differing answers checks again.

``--compare draws`` (with ``--top-k 0 --top-p 1``: temperature alone): plain sampling's rows, and lookup drafts', are
drawn through the screen by the Gumbel-max trick (``ScreenedInt8Head.draw_tokens``) instead of from every exact
logit; the "old" side is the same adapter without ``draw_tokens``. Both follow the target's law, with other noise:
their answers differ for the same seed.

The script decodes the same prompts with the same seeds both ways, alternating per prompt and method (the order
reversed every other prompt, so drift hits both alike), and reports for each method tokens per second both ways, the
paired ratio with a 95 % bootstrap interval over prompts (``jointspec.bench.intervals``), and how many answers differ.

    python benchmarks/sampled_top_k_ab.py                                     # ar,sps,mtad,default; top-k 10
    python benchmarks/sampled_top_k_ab.py --methods ar --top-k 40 --top-p 1 --prompts 8
    python benchmarks/sampled_top_k_ab.py --compare row-kernels --top-k 0 --top-p 0.95
    python benchmarks/sampled_top_k_ab.py --compare draws --methods ar,default --top-k 0 --top-p 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.loading import load_model
from jointspec.bench.intervals import paired_ratio_interval
from jointspec.bench.prompts import chat_prompt_ids, load_prompts, select_prompts
from jointspec.core import sampling
from jointspec.kernels.grouped import ScreenedInt8Head


@contextlib.contextmanager
def pytorch_sampling_rows():
    """Within it sampling runs PyTorch's full-row operations, not the compiled row kernels (what it ran before)."""
    kernels = sampling._row_kernels
    sampling._row_kernels = lambda rows: None
    try:
        yield
    finally:
        sampling._row_kernels = kernels


@contextlib.contextmanager
def exact_top_k_rows():
    """Within it a screened head answers a top-k read with every exact logit (what sampling read before)."""
    screened = ScreenedInt8Head.top_k_logits
    ScreenedInt8Head.top_k_logits = lambda self, x, k: self.forward(x)
    try:
        yield
    finally:
        ScreenedInt8Head.top_k_logits = screened


@contextlib.contextmanager
def exact_draws():
    """Within it a screened head draws nothing (no ``draw_tokens``): rows sampled with temperature alone read every
    exact logit, as before draws through the screen."""
    draw = ScreenedInt8Head.draw_tokens
    del ScreenedInt8Head.draw_tokens
    try:
        yield
    finally:
        ScreenedInt8Head.draw_tokens = draw


OLD_SIDE = {"screen": exact_top_k_rows, "row-kernels": pytorch_sampling_rows,  # --compare: the code before
            "draws": exact_draws}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=sorted(OLD_SIDE), default="screen",
                        help="the fast path to compare with the code before it (module docstring)")
    parser.add_argument("--methods", default="ar,sps,mtad,default")
    parser.add_argument("--prompts", type=int, default=24, help="MT-Bench first turns, 3 a category for 24")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_model("default", quantize="auto")
    per_category = max(1, -(-args.prompts // 8))
    prompts = select_prompts(load_prompts("builtin:mt_bench"), num_per_category=per_category)[:args.prompts]
    prompt_ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    methods = args.methods.split(",")
    pipelines = {method: Pipeline(target, tokenizer, method) for method in methods}
    print(f"top-k {args.top_k}, top-p {args.top_p}, temperature {args.temperature}; target screens top k up to "
          f"{target.capabilities.top_k_screen}; {len(prompts)} prompts x {args.max_new_tokens} tokens", flush=True)

    def run(method: str, ids: list[int], seed: int, old: bool) -> tuple[list[int], float]:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=seed)
        with OLD_SIDE[args.compare]() if old else contextlib.nullcontext():
            start = time.perf_counter()
            result = pipelines[method].generate_ids(ids, config)
            return result.token_ids, time.perf_counter() - start

    for method in methods:  # untimed: kernels, cost curves, the draft's first calls
        run(method, prompt_ids[0], 0, False)
        run(method, prompt_ids[0], 0, True)
    parts = {(m, side): [] for m in methods for side in ("new", "old")}
    differ = {m: 0 for m in methods}
    for i, ids in enumerate(prompt_ids):
        for method in methods:
            sides = ("new", "old") if i % 2 == 0 else ("old", "new")
            tokens = {}
            for side in sides:
                tokens[side], seconds = run(method, ids, i, side == "old")
                parts[(method, side)].append((len(tokens[side]), seconds))
            differ[method] += tokens["new"] != tokens["old"]
        print(f"prompt {i + 1}/{len(prompt_ids)}", flush=True)
    report = {}
    for method in methods:
        new, old = (torch.tensor(parts[(method, side)], dtype=torch.float64) for side in ("new", "old"))
        interval = paired_ratio_interval(new, old, "rate")
        rate = {side: float(t[:, 0].sum() / t[:, 1].sum()) for side, t in (("new", new), ("old", old))}
        report[method] = {"tok_s_new": round(rate["new"], 1), "tok_s_old": round(rate["old"], 1),
                          "ratio": None if interval is None else round(interval.ratio, 3),
                          "interval": None if interval is None else interval.to_list(3),
                          "answers_differing": differ[method], "prompts": len(prompt_ids)}
        print(f"{method:10s} new {rate['new']:6.1f} tok/s, old {rate['old']:6.1f} tok/s, "
              f"ratio {report[method]['ratio']} {report[method]['interval']}, "
              f"{differ[method]}/{len(prompt_ids)} answers differ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "methods": report}, f, indent=1)


if __name__ == "__main__":
    main()
