"""Turning target/draft logits into the distribution a decoder samples from.

Convention (the same for every method, drafter and verifier, and the same as Hugging Face's default warper order):
1. divide the logits by ``temperature``;
2. keep the ``top_k`` largest logits (``top_k=0`` keeps all);
3. keep the smallest set of the most likely remaining tokens whose probability sums to at least ``top_p``
   (the most likely token is always kept; ``top_p=1`` keeps all);
4. softmax over the kept tokens; every other token gets probability exactly 0.

``temperature == 0`` means greedy: the distribution is one-hot on the argmax (ties go to the lowest token id, as
``torch.argmax`` does), and top-k/top-p are irrelevant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no top-k), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, in float32.

    logits: [..., vocab]. Returns [..., vocab] rows that sum to 1.
    """
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        # Only finite logits can be kept, so only they need ordering: after top-k a few dozen (a head restricted to
        # its draft vocabulary leaves a third). A partial sort (topk returns its values in descending order) replaces
        # the full-vocabulary one; the -inf entries it leaves out would add exactly 0 to every sum.
        num_finite = int(torch.isfinite(logits).sum(dim=-1).max())
        sorted_logits, order = torch.topk(logits, max(num_finite, 1), dim=-1)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Mass strictly before each token: a token is dropped once the tokens before it already reach top_p.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def multinomial(probs: torch.Tensor, num_samples: int, *, replacement: bool = False,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """``torch.multinomial`` drawn on the generator's device, returned on ``probs``' device.

    The library seeds one CPU generator per request, and ``torch.multinomial`` refuses a generator that lives on
    another device than its input (CUDA logits with a CPU generator).
    """
    source = probs if generator is None or generator.device == probs.device else probs.to(generator.device)
    return torch.multinomial(source, num_samples, replacement=replacement, generator=generator).to(probs.device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row of ``probs`` ([..., vocab] -> [...]), drawn with ``generator``."""
    draws = multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).squeeze(-1)
    return draws.reshape(probs.shape[:-1])


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token per row of ``logits`` ([..., vocab] -> [...]): argmax when greedy, else a sample."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample(processed_probs(logits, sampling), generator)
