"""Forward cost of the torch adapter's KV cache and attention choices, side by side.

Three settings on one loaded model: ``DynamicCache`` with transformers' ``sdpa`` attention (what transformers
runs: appends with ``torch.cat``, copying the whole cache each forward, and copies key/value heads per query head
under a mask), the adapter's in-place :class:`jointspec.backends.kvcache.BufferedCache` with ``sdpa``, and the
in-place cache with jointspec's grouped-query attention (what ``--kernels auto`` runs). For each ``--contexts``
length the two adapters prefill the same random tokens; then each of ``--repeats`` passes times every (setting, k)
pair once in a shuffled order, a forward of k tokens with all k rows of logits (switching the model's attention
before it), cropping back after each; the first pass is a discarded warm-up. Reports the 20th percentile in ms.
Run on a quiet machine:

    python benchmarks/kv_cache_cost.py --threads 2 --contexts 200,1000,2000,4000 --ks 1,3
"""

from __future__ import annotations

import argparse
import random

from interleaved import time_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--contexts", default="200,1000,2000,4000")
    parser.add_argument("--ks", default="1,3")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from transformers import DynamicCache

    from jointspec.backends.hf import CausalLM
    from jointspec.backends.loading import load_model
    from jointspec.kernels.fp32 import use_gqa_attention, use_stock_attention

    if args.threads:
        torch.set_num_threads(args.threads)
    buffered, _ = load_model(args.model, kernels="stock")

    class Concatenating(CausalLM):
        def reset(self, *, plain: bool = False) -> None:
            super().reset(plain=plain)
            self.cache = DynamicCache(config=self.model.config)

    concatenating = Concatenating(buffered.model, name="cat", lean=False)
    # setting -> (adapter, grouped attention?)
    settings = {"DynamicCache+sdpa": (concatenating, False), "in place+sdpa": (buffered, False),
                "in place+grouped": (buffered, True)}
    adapters = {"in place": buffered, "DynamicCache": concatenating}
    rng = random.Random(args.seed)
    ks = [int(k) for k in args.ks.split(",")]
    print("| context | " + " | ".join(f"{name} k={k}" for name in settings for k in ks) + " |")
    print("|---:|" + "---:|" * (len(settings) * len(ks)))
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = [rng.randrange(buffered.vocab_size) for _ in range(context)]
        for adapter in adapters.values():
            adapter.reset()
            adapter.forward(prompt, num_logits=0)
        cells = time_forwards({name: adapter for name, (adapter, _) in settings.items()}, ks, context, args.repeats,
                              rng, before=lambda name: (use_gqa_attention if settings[name][1]
                                                        else use_stock_attention)(buffered.model)).values()
        print(f"| {context} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
