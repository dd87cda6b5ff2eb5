"""Forward cost of the lean Llama forward (backends/lean_forward.py) next to transformers' own, on the same model.

Two adapters over one loaded model (``--kernels``, default ``auto``): one runs :mod:`jointspec.backends.lean_forward`,
the other transformers' ``LlamaForCausalLM.forward``; both use the same linears, attention and in-place KV cache, so the
difference is transformers' per-module overhead alone. For each ``--contexts`` length both prefill the same random
tokens; then each of ``--repeats`` passes times every (forward, k) pair once in a shuffled order (a forward of k tokens
with all k rows of logits, cropped back after; benchmarks/interleaved.py), the first pass a discarded warm-up. It also
checks that the two give equal logits. Reports the 20th percentile in ms. Run on a quiet machine:

    python benchmarks/fast_forward_cost.py --threads 2 --contexts 200,1000 --ks 1,3,4
"""

from __future__ import annotations

import argparse
import random

from interleaved import time_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--contexts", default="200,1000")
    parser.add_argument("--ks", default="1,3,4")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from jointspec.backends.hf import CausalLM
    from jointspec.backends.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded, _ = load_model(args.model, kernels=args.kernels)
    adapters = {"lean": CausalLM(loaded.model, name="lean"),
                "transformers": CausalLM(loaded.model, name="transformers", lean=False)}
    if adapters["lean"].lean is None:
        raise SystemExit(f"{args.model} cannot take the lean forward (not transformers' Llama, or --kernels stock)")
    rng = random.Random(args.seed)
    ks = [int(k) for k in args.ks.split(",")]
    print("| context | " + " | ".join(f"{name} k={k}" for name in adapters for k in ks) + " | lean / transformers |")
    print("|---:|" + "---:|" * (len(adapters) * len(ks) + 1))
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = [rng.randrange(loaded.vocab_size) for _ in range(context)]
        for adapter in adapters.values():
            adapter.reset()
            adapter.forward(prompt, num_logits=0)
        check = [rng.randrange(loaded.vocab_size) for _ in range(3)]
        lean_logits, stock_logits = (adapters[name].forward(check).logits for name in ("lean", "transformers"))
        if not torch.equal(lean_logits, stock_logits):
            raise SystemExit("the lean forward's logits differ from transformers' (a bug: they must be bit-equal)")
        for adapter in adapters.values():
            adapter.crop(context)
        cells = time_forwards(adapters, ks, context, args.repeats, rng)
        ratios = " / ".join(f"{cells['lean', k] / cells['transformers', k]:.2f}" for k in ks)
        print(f"| {context} | " + " | ".join(f"{c:.1f}" for c in cells.values()) + f" | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
