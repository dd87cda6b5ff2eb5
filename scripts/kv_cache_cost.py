"""Forward cost with the adapter's in-place KV cache against transformers' ``DynamicCache``, side by side.

Two adapters share one loaded model: one keeps its cache in :class:`jointspec.models.kvcache.BufferedCache` (what
jointspec runs), the other in ``DynamicCache`` (which appends with ``torch.cat``, copying the whole cache each
forward). For each ``--contexts`` length both prefill the same random tokens; then each of ``--repeats`` passes
times every (cache, k) pair once in a shuffled order, a forward of k tokens with all k rows of logits, cropping back
after each; the first pass is a discarded warm-up. Reports the 20th percentile in ms. Run on a quiet machine:

    python scripts/kv_cache_cost.py --threads 2 --contexts 200,1000,2000,4000 --ks 1,3
"""

from __future__ import annotations

import argparse
import random
import time


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

    from jointspec.models.adapter import CausalLM
    from jointspec.models.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    buffered, _ = load_model(args.model)

    class Concatenating(CausalLM):
        def reset(self, *, plain: bool = False) -> None:
            super().reset(plain=plain)
            self.cache = DynamicCache(config=self.model.config)

    adapters = {"buffered": buffered, "DynamicCache": Concatenating(buffered.model, name="cat")}
    rng = random.Random(args.seed)
    ks = [int(k) for k in args.ks.split(",")]
    print("| context | " + " | ".join(f"{name} k={k}" for name in adapters for k in ks) + " |")
    print("|---:|" + "---:|" * (len(adapters) * len(ks)))
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = [rng.randrange(buffered.vocab_size) for _ in range(context)]
        for adapter in adapters.values():
            adapter.reset()
            adapter.forward(prompt, num_logits=0)
        samples: dict[tuple[str, int], list[float]] = {(name, k): [] for name in adapters for k in ks}
        for timed in [False] + [True] * args.repeats:
            pairs = list(samples)
            rng.shuffle(pairs)
            for name, k in pairs:
                adapter = adapters[name]
                tokens = [rng.randrange(buffered.vocab_size) for _ in range(k)]
                start = time.perf_counter()
                adapter.forward(tokens)
                elapsed = time.perf_counter() - start
                adapter.crop(context)
                if timed:
                    samples[(name, k)].append(elapsed)
        cells = [sorted(v)[len(v) // 5] * 1e3 for v in samples.values()]
        print(f"| {context} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
