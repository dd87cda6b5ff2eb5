"""Not a benchmark: the interleaved forward timing the cost benchmarks share (kv_cache_cost, fast_forward_cost, ...).

Every (setting, k) pair is timed once per pass, in a shuffled order, so that drift on a shared machine hits all
settings alike: a forward of k random tokens with all k rows of logits after ``context`` cached ones, cropped back
after. The first pass is a discarded warm-up. Returns the 20th percentile of each pair in ms.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


def time_forwards(adapters: dict, ks: list[int], context: int, repeats: int, rng: random.Random,
                  before: Callable[[str], None] | None = None) -> dict[tuple[str, int], float]:
    """``adapters``: setting name -> adapter holding ``context`` cached tokens; ``before(name)`` runs untimed before
    each forward of that setting (e.g. to switch the model's attention)."""
    samples: dict[tuple[str, int], list[float]] = {(name, k): [] for name in adapters for k in ks}
    for timed in [False] + [True] * repeats:
        pairs = list(samples)
        rng.shuffle(pairs)
        for name, k in pairs:
            adapter = adapters[name]
            if before is not None:
                before(name)
            tokens = [rng.randrange(adapter.vocab_size) for _ in range(k)]
            start = time.perf_counter()
            adapter.forward(tokens)
            elapsed = time.perf_counter() - start
            adapter.crop(context)
            if timed:
                samples[(name, k)].append(elapsed)
    return {key: sorted(values)[len(values) // 5] * 1e3 for key, values in samples.items()}
