"""A cost model of speculative decoding, from measured target costs, and what it predicts for each method.

``T(k)``: seconds for one target forward of ``k`` new tokens after a ~200-token cache (measured: prefill, then each
``k`` in shuffled order, cropping back after each pass; median of several passes). A round of a method that drafts
``d`` tokens on average costs ``draft_per_round + T(d + 1)`` and commits ``a`` tokens on average (mean accepted
tokens), so the decode part of a generation should take

    predicted_seconds = prefill_seconds + num_rounds * (draft_seconds / num_rounds + T(d + 1))

and the *loop efficiency* is predicted_seconds / measured_seconds (= measured tokens/s / predicted tokens/s):
1.0 means the loop adds nothing beyond the forwards and the drafter; the rest is Python, sampling, cache
bookkeeping. The ``oracle`` method, whose acceptance is known, isolates that overhead. For ``ar`` the prediction is
simply ``T(1)`` per token. Fractional ``d`` is interpolated linearly between measured ``k``.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from jointspec.backends.hf import CausalLM
from jointspec.bench.engines import synchronize
from jointspec.core.loop import SpecStats

DEFAULT_KS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


@dataclass
class TargetCost:
    """Median seconds of one target forward of ``k`` tokens, by ``k``."""

    seconds_by_k: dict[int, float]
    prefill_tokens: int

    def seconds(self, num_tokens: float) -> float:
        """T(num_tokens), interpolated (and extrapolated past the largest k) linearly."""
        ks = sorted(self.seconds_by_k)
        if num_tokens <= ks[0]:
            return self.seconds_by_k[ks[0]]
        for low, high in zip(ks, ks[1:]):  # noqa: B007 (the pair it stops at, or the last, is used below)
            if num_tokens <= high:
                break
        t_low, t_high = self.seconds_by_k[low], self.seconds_by_k[high]
        return t_low + (t_high - t_low) * (num_tokens - low) / (high - low)

    def relative(self) -> dict[int, float]:
        return {k: s / self.seconds_by_k[min(self.seconds_by_k)] for k, s in sorted(self.seconds_by_k.items())}

    def to_dict(self) -> dict:
        return {"prefill_tokens": self.prefill_tokens,
                "ms_by_k": {str(k): round(s * 1e3, 3) for k, s in sorted(self.seconds_by_k.items())},
                "relative_to_k1": {str(k): round(r, 3) for k, r in self.relative().items()}}


@torch.inference_mode()
def measure_target_cost(target: CausalLM, ks: tuple[int, ...] = DEFAULT_KS, prefill_tokens: int = 200,
                        repeats: int = 7, seed: int = 0) -> TargetCost:
    """Measure T(k) on a separate cache over the target's weights (the target's own cache is left alone)."""
    model = target.fork(f"{target.name} (cost model)")
    prefill_tokens = max(1, min(prefill_tokens, target.max_context - max(ks) - 1))
    rng = random.Random(seed)
    prompt = [rng.randrange(target.vocab_size) for _ in range(prefill_tokens)]
    model.forward(prompt, num_logits=0)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    schedule = [k for _ in range(repeats + 1) for k in ks]
    rng.shuffle(schedule)  # interleaved, so drift in machine speed hits every k alike
    warmed: set[int] = set()
    for k in schedule:
        tokens = [rng.randrange(target.vocab_size) for _ in range(k)]
        synchronize(target.device)
        start = time.perf_counter()
        model.forward(tokens)  # all k rows of logits, as verification needs
        synchronize(target.device)
        elapsed = time.perf_counter() - start
        model.crop(prefill_tokens)
        if k in warmed:
            samples[k].append(elapsed)
        warmed.add(k)  # the first pass of each k is a warm-up
    return TargetCost({k: statistics.median(v) for k, v in samples.items()}, prefill_tokens)


@dataclass
class Prediction:
    seconds: float
    mean_draft_tokens: float  # draft tokens (nodes) per round

    def to_dict(self, measured_seconds: float) -> dict:
        return {"predicted_seconds": round(self.seconds, 4),
                "mean_draft_tokens_per_round": round(self.mean_draft_tokens, 3),
                "loop_efficiency": round(self.seconds / measured_seconds, 4) if measured_seconds > 0 else None}


def predict(cost: TargetCost, stats: SpecStats) -> Prediction | None:
    """Predicted seconds of a generation with these counters (None without any round)."""
    if stats.num_rounds == 0:
        return None
    mean_draft = stats.num_draft_tokens / stats.num_rounds
    per_round = stats.draft_seconds / stats.num_rounds + cost.seconds(mean_draft + 1)
    return Prediction(stats.prefill_seconds + stats.num_rounds * per_round, mean_draft)


def expected_tokens_per_round(acceptance: float, num_draft_tokens: int) -> float:
    """Mean tokens per round for a chain whose every token is accepted with probability ``acceptance``."""
    return sum(acceptance ** i for i in range(num_draft_tokens + 1))
