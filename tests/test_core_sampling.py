"""Sampling conventions (``jointspec.core.sampling``), on hand-computed examples: temperature, then top-k, then
top-p, on ``processed_probs``; ``SamplingConfig``'s validation; the helpers every sampler draws with.

Every expected distribution is written by hand (or, for the partial sort, by a full sort written here), never by
the function under test. Deterministic: no false-failure odds.
"""

from __future__ import annotations

import math

import pytest
import torch

from jointspec.core.sampling import SamplingConfig, processed_probs


def probs_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_temperature_divides_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    e = [math.exp(0.5), math.exp(1.0), math.exp(1.5)]
    probs_close(processed_probs(logits, SamplingConfig(temperature=2.0)), [x / sum(e) for x in e])


def test_temperature_zero_is_one_hot_argmax_lowest_id_on_ties():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 5.0]])
    probs_close(processed_probs(logits, SamplingConfig(temperature=0.0)), [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_top_k_keeps_the_k_largest():
    probs = [0.1, 0.4, 0.2, 0.3]
    logits = torch.tensor(probs).log()
    # Top 2 are tokens 1 and 3 (0.4, 0.3), renormalised to 4/7 and 3/7; the rest get exactly 0.
    probs_close(processed_probs(logits, SamplingConfig(temperature=1.0, top_k=2)), [0, 4 / 7, 0, 3 / 7])
    # top_k = 0 and top_k >= vocab keep everything.
    probs_close(processed_probs(logits, SamplingConfig(temperature=1.0, top_k=0)), probs)
    probs_close(processed_probs(logits, SamplingConfig(temperature=1.0, top_k=4)), probs)


@pytest.mark.parametrize("top_p, expected", [
    # Sorted: 0.5 (token 1), 0.3 (token 3), 0.15 (token 0), 0.05 (token 2).
    (0.10, [0, 1, 0, 0]),            # the most likely token alone already reaches it
    (0.50, [0, 1, 0, 0]),            # reaching top_p exactly is enough: 0.5 >= 0.5, token 3 is not needed
    (0.75, [0, 0.625, 0, 0.375]),    # 0.5 < 0.75 <= 0.8: tokens 1 and 3
    (0.81, [0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95]),  # needs the third token (0.95), not the fourth
    (1.00, [0.15, 0.5, 0.05, 0.3]),  # keeps all
])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p, expected):
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    probs_close(processed_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p)), expected)


def test_order_temperature_then_top_k_then_top_p():
    # Top-p is computed on the distribution left by temperature and top-k, not on the raw one.
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # After top_k=2 the kept mass is 4/7 and 3/7: top_p=0.5 keeps token 0 alone (on the raw distribution 0.4 < 0.5
    # would have kept tokens 0 and 1).
    probs_close(processed_probs(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=0.5)), [1, 0, 0, 0])
    # Temperature 0.5 squares the probabilities: 0.5, 0.3, 0.2 -> 0.25, 0.09, 0.04 (of 0.38), so top_p=0.6 keeps
    # token 0 alone (0.658); at temperature 1 it would need tokens 0 and 1.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    probs_close(processed_probs(logits, SamplingConfig(temperature=0.5, top_p=0.6)), [1, 0, 0])
    probs_close(processed_probs(logits, SamplingConfig(temperature=1.0, top_p=0.6)), [0.625, 0.375, 0])


def test_processed_probs_keeps_leading_dimensions():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))  # [2, 3, vocab]
    probs = processed_probs(logits, SamplingConfig(temperature=0.8, top_k=3, top_p=0.9))
    assert probs.shape == (2, 3, 7) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert ((probs > 0).sum(-1) <= 3).all()


def test_top_p_sorts_only_finite_logits_and_matches_a_full_sort():
    """processed_probs orders only the finite logits (a partial sort); a full-vocabulary sort must agree."""

    def full_sort_reference(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        logits = logits / sampling.temperature
        if sampling.top_k:
            kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf")).softmax(dim=-1)

    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 500, generator=generator)
    logits[0, 40:] = float("-inf")  # a head's draft vocabulary: only some tokens are finite
    logits[1, 1:] = float("-inf")  # a single finite token
    for sampling in (SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_k=10, top_p=0.8),
                     SamplingConfig(1.3, top_k=450, top_p=0.95)):
        fast, reference = processed_probs(logits, sampling), full_sort_reference(logits, sampling)
        assert torch.equal(fast > 0, reference > 0)  # the same kept set, row by row
        torch.testing.assert_close(fast, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}])
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_sample_draws_on_the_generators_device():
    """The helper every sampler uses draws exactly what torch.multinomial draws for the same seed, and returns ids on
    the probabilities' device. (The cross-device case, CUDA logits with the CPU generator, needs a GPU to run.)"""
    from jointspec.core.sampling import multinomial, sample

    probs = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert sample(probs, g1).tolist() == torch.multinomial(probs, 1, generator=g2).squeeze(-1).tolist()
    draws = multinomial(probs[0], 2, replacement=False, generator=torch.Generator().manual_seed(1))
    assert draws.device == probs.device and sorted(set(draws.tolist())) == sorted(draws.tolist())
