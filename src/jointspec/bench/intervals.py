"""How sure a bench is of each method's difference from the baseline: paired bootstrap intervals over prompts.

A bench's speedup and perplexity are ratios of sums over prompts, and prompts differ far more than methods do: on
16 MT-Bench prompts x 64 sampled tokens, two lossless rows whose expected perplexity is equal landed 14 % apart
(docs/lab/benchmarks.md, section 6). So the bench also reports, for every method against the baseline, a 95 %
percentile-bootstrap interval that resamples *prompts* with replacement and recomputes the ratio from the same
resampled prompts for both methods. Pairing by prompt removes how hard a prompt is from the comparison, which is most
of the variance.

What the intervals cover: which prompts were drawn, and, when sampling, which tokens were drawn for each (each prompt
carries its own draws). What they do not cover: the machine's speed drifting during the run (the bench interleaves
methods within a prompt for that), or another CPU. With fewer than :data:`MIN_PROMPTS` prompts no interval is given:
a percentile bootstrap over a handful of prompts is too narrow to mean anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_PROMPTS = 8
NUM_RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class RatioInterval:
    """A method's ratio to the baseline with its paired bootstrap interval."""

    ratio: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.ratio <= self.high:
            raise ValueError(f"interval [{self.low}, {self.high}] does not contain its ratio {self.ratio}")

    @property
    def excludes_one(self) -> bool:
        """The bench's evidence that the method differs from the baseline (at the interval's level)."""
        return self.low > 1.0 or self.high < 1.0

    def to_list(self, digits: int = 4) -> list[float]:
        return [round(self.low, digits), round(self.high, digits)]


def paired_ratio_interval(method_parts: torch.Tensor, baseline_parts: torch.Tensor, kind: str,
                          num_resamples: int = NUM_RESAMPLES, level: float = LEVEL,
                          seed: int = 0) -> RatioInterval | None:
    """The ratio of one method to the baseline over paired prompts, with a percentile bootstrap interval.

    ``method_parts`` and ``baseline_parts`` are ``[num_prompts, 2]``, row i the same prompt for both:
    - ``kind="rate"``: columns (new tokens, seconds); ratio = method tokens/s over baseline tokens/s (the speedup);
    - ``kind="perplexity"``: columns (summed log-probability, scored tokens); ratio = method perplexity over
      baseline perplexity, each exp(-sum log-prob / sum tokens).

    None when there are fewer than :data:`MIN_PROMPTS` prompts or a ratio is undefined (no seconds, no tokens).
    The resampling is seeded, so a report recomputed from the same runs gives the same interval.
    """
    if kind not in ("rate", "perplexity"):
        raise ValueError(f"kind must be 'rate' or 'perplexity', got {kind!r}")
    if method_parts.shape != baseline_parts.shape or method_parts.dim() != 2 or method_parts.shape[1] != 2:
        raise ValueError(f"expected two [num_prompts, 2] tensors of the same shape, got "
                         f"{tuple(method_parts.shape)} and {tuple(baseline_parts.shape)}")
    if not 0 < level < 1 or num_resamples < 100:
        raise ValueError(f"level must be in (0, 1) and num_resamples >= 100, got {level} and {num_resamples}")
    num_prompts = method_parts.shape[0]
    if num_prompts < MIN_PROMPTS:
        return None
    parts = torch.cat([method_parts, baseline_parts], dim=1).double()  # [num_prompts, 4]
    if not torch.isfinite(parts).all() or (parts[:, [1, 3]].sum(0) <= 0).any():
        return None

    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(num_prompts, (num_resamples, num_prompts), generator=generator)
    resampled = parts[picks].sum(dim=1)  # [num_resamples, 4]: the four sums over each resample's prompts
    ratios = ratio_of_sums(resampled, kind)
    ratios = ratios[torch.isfinite(ratios)]  # a resample with no seconds / tokens for a side has no ratio
    if ratios.numel() < num_resamples // 2:
        return None
    ratio = float(ratio_of_sums(parts.sum(dim=0, keepdim=True), kind)[0])
    tail = (1 - level) / 2
    low, high = torch.quantile(ratios, torch.tensor([tail, 1 - tail], dtype=ratios.dtype)).tolist()
    # The percentile interval of a skewed ratio can miss the point estimate by rounding; keep the contract.
    return RatioInterval(ratio, min(low, ratio), max(high, ratio))


def ratio_of_sums(sums: torch.Tensor, kind: str) -> torch.Tensor:
    """``sums`` [n, 4] = (method a, method b, baseline a, baseline b) -> [n] ratios (inf / nan where undefined)."""
    if kind == "rate":
        return (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
    return torch.exp(-sums[:, 0] / sums[:, 1] + sums[:, 2] / sums[:, 3])
