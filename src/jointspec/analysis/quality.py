"""Quality of generated text: perplexity under the raw target, diversity, repetition.

Perplexity is measured under the *raw* target distribution (temperature 1, no top-k/top-p), whatever decoding
produced the tokens, so methods are compared on the same yardstick (MTAD's paper does the same).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from jointspec.core.target import TargetLM


@torch.inference_mode()
def token_logprobs(target: TargetLM, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> torch.Tensor:
    """log p_target(new_ids[i] | prompt, new_ids[:i]) for every generated token, in one forward pass ([len(new_ids)]).

    Uses a fresh forward without touching ``target``'s decode cache.
    """
    if not new_ids:
        return torch.zeros(0)
    if not target.capabilities.torch_module:  # llama.cpp: score in a second context over the same weights
        scorer = target.fork(f"{target.name} (scoring)")
        scorer.reset()
        logits = scorer.forward(list(prompt_ids) + list(new_ids), num_logits=len(new_ids) + 1).logits[:-1]
    else:
        ids = torch.tensor([list(prompt_ids) + list(new_ids)], dtype=torch.long, device=target.device)
        logits = target.model(input_ids=ids, use_cache=False,
                              logits_to_keep=len(new_ids) + 1).logits[0, :-1].float()
    logprobs = logits.log_softmax(dim=-1)  # [len(new_ids), vocab]
    chosen = torch.tensor(list(new_ids), device=logprobs.device)
    return logprobs.gather(-1, chosen[:, None])[:, 0].cpu()


def perplexity(target: TargetLM, prompt_ids: Sequence[int], new_ids: Sequence[int]) -> float:
    """exp(-mean log-probability) of the generated tokens under the raw target; nan when nothing was generated."""
    if not new_ids:
        return float("nan")
    return math.exp(-float(token_logprobs(target, prompt_ids, new_ids).mean()))


def distinct_n(token_ids: Sequence[int], n: int = 2) -> float:
    """Distinct n-grams / all n-grams (1.0 = no repeated n-gram); nan for fewer than n tokens."""
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else float("nan")


def repetition_rate(token_ids: Sequence[int], n: int = 4) -> float:
    """Share of n-grams that already occurred earlier in the same output (0.0 = none)."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(token_ids) - n + 1):
        gram = tuple(token_ids[i:i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else float("nan")


def quality_report(target: TargetLM, prompt_ids: Sequence[int], new_ids: Sequence[int],
                   energy_joules: float | None = None) -> dict:
    """The quality block of ``jointspec generate --json``: one extra target forward over prompt + output."""
    def finite(x: float) -> float | None:
        return round(x, 4) if math.isfinite(x) else None

    return {
        "perplexity": finite(perplexity(target, prompt_ids, new_ids)),
        "distinct_2": finite(distinct_n(new_ids, 2)),
        "repetition_rate_4": finite(repetition_rate(new_ids, 4)),
        # Only a hardware counter (RAPL, NVML) is reported; never an estimate.
        "energy_joules_per_token": (round(energy_joules / len(new_ids), 6)
                                    if energy_joules is not None and new_ids else "unavailable"),
    }
