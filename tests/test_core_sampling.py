"""Sampling conventions (``jointspec.core.sampling``), on hand-computed examples: temperature, then top-k, then
top-p, on ``processed_probs``; ``SamplingConfig``'s validation; the helpers every sampler draws with.

Every expected distribution is written by hand (or, for the partial sorts, by a full sort written here), never by
the function under test. Deterministic except the chi-square test of ``sample``, whose false-failure odds it
states.
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


def test_min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_best_after_the_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])  # probabilities relative to the best: 1, e^-1, e^-2, e^-3
    e = [math.exp(x) for x in (2.0, 1.0)]
    probs_close(processed_probs(logits, SamplingConfig(1.0, min_p=0.3)), [e[0] / sum(e), e[1] / sum(e), 0, 0])
    probs_close(processed_probs(logits, SamplingConfig(0.5, min_p=0.3)), [1, 0, 0, 0])  # tempered: e^-2 < 0.3
    probs_close(processed_probs(logits, SamplingConfig(1.0, min_p=1.0)), [1, 0, 0, 0])  # the best alone
    assert torch.equal(processed_probs(logits, SamplingConfig(1.0, min_p=0.0)), processed_probs(logits,
                                                                                                SamplingConfig(1.0)))
    # With top-k and top-p: min-p between the temperature and top-k, as vLLM applies it (top-k gives the same set in
    # either order; top-p runs over what min-p left).
    generator = torch.Generator().manual_seed(2)
    rows = 2 * torch.randn(3, 500, generator=generator)
    for sampling in (SamplingConfig(0.8, top_k=40, min_p=0.05), SamplingConfig(1.2, top_p=0.9, min_p=0.1),
                     SamplingConfig(1.0, top_k=100, top_p=0.8, min_p=0.02)):
        scaled = rows / sampling.temperature
        kept = scaled.masked_fill(scaled < scaled.max(dim=-1, keepdim=True).values + math.log(sampling.min_p),
                                  float("-inf"))
        reference = _full_vocabulary_reference(kept, SamplingConfig(1.0, sampling.top_k, sampling.top_p))
        got = processed_probs(rows, sampling)
        assert torch.equal(got > 0, reference > 0), sampling
        torch.testing.assert_close(got, reference, atol=1e-6, rtol=0)
        without = processed_probs(rows, SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p))
        assert int((got > 0).sum()) < int((without > 0).sum())  # it dropped some
        if not sampling.top_p < 1.0:  # top-k alone: min-p last, on what top-k left, is the same
            last = without.masked_fill(without < sampling.min_p * without.max(dim=-1, keepdim=True).values, 0.0)
            torch.testing.assert_close(got, last / last.sum(dim=-1, keepdim=True), atol=1e-6, rtol=0)


def test_processed_probs_keeps_leading_dimensions():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))  # [2, 3, vocab]
    probs = processed_probs(logits, SamplingConfig(temperature=0.8, top_k=3, top_p=0.9))
    assert probs.shape == (2, 3, 7) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3))
    assert ((probs > 0).sum(-1) <= 3).all()


def test_top_p_sorts_only_finite_logits_and_matches_a_full_sort():
    """processed_probs orders only the finite logits (a partial sort); a full-vocabulary sort must agree."""

    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 500, generator=generator)
    logits[0, 40:] = float("-inf")  # a head's draft vocabulary: only some tokens are finite
    logits[1, 1:] = float("-inf")  # a single finite token
    for sampling in (SamplingConfig(0.7, top_p=0.9), SamplingConfig(1.0, top_k=10, top_p=0.8),
                     SamplingConfig(1.3, top_k=450, top_p=0.95)):
        fast, reference = processed_probs(logits, sampling), _full_vocabulary_reference(logits, sampling)
        assert torch.equal(fast > 0, reference > 0)  # the same kept set, row by row
        torch.testing.assert_close(fast, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"temperature": float("nan")}, {"top_k": -1},
                                    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"min_p": -0.1},
                                    {"min_p": 1.5}])
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_sample_returns_ids_on_the_probabilities_device_and_multinomial_draws_distinct_ids():
    """Ids come back on the probabilities' device (the cross-device case, CUDA logits with the CPU generator, needs a
    GPU to run), one per row; without replacement a row's draws are distinct and drawn from its support."""
    from jointspec.core.sampling import multinomial, sample

    probs = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]])
    ids = sample(probs, torch.Generator().manual_seed(5))
    assert ids.shape == (2,) and ids.device == probs.device
    sparse = torch.tensor([0.0, 0.3, 0.0, 0.0, 0.2, 0.5, 0.0])
    for seed in range(20):
        draws = multinomial(sparse, 3, replacement=False, generator=torch.Generator().manual_seed(seed)).tolist()
        assert sorted(draws) == [1, 4, 5]


def _inverse_cdf_off_by_one(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A deliberately broken sampler: ``searchsorted`` without ``right=True``, so a threshold that lands exactly on a
    cumulative sum picks the token before it, and a zero-probability token at the start of a run of zeros can be
    drawn (here made likely by rounding the uniform to a coarse grid)."""
    cumulative = probs.float().cumsum(dim=-1)
    uniform = (torch.rand(1, generator=generator) * 10).floor() / 10
    return torch.searchsorted(cumulative, uniform * cumulative[-1:], right=False)


@pytest.mark.parametrize("row", [
    [0.0, 0.1, 0.0, 0.0, 0.3, 0.2, 0.0, 0.4, 0.0],  # zeros between, before and after the support
    [0.25, 0.25, 0.25, 0.25],                         # cumulative sums that land on the grid a broken sampler uses
])
def test_sample_draws_the_rows_law_and_never_a_zero_probability_token(row):
    """Chi-square over 20,000 seeded draws from ``sample`` against the row itself; the off-by-one mutant above fails
    the same test. False-failure odds: the p-value threshold, 1e-4, per row."""
    from scipy import stats

    from jointspec.core.sampling import sample

    probs = torch.tensor(row)
    law = torch.tensor(row, dtype=torch.float64).numpy()
    law /= law.sum()

    def p_value(draw) -> float:
        generator = torch.Generator().manual_seed(0)
        counts = torch.bincount(torch.stack([draw(probs, generator).reshape(()) for _ in range(20_000)]),
                                minlength=len(row)).numpy()
        if counts[law == 0].sum() > 0:
            return 0.0  # a token the law forbids was drawn
        keep = law > 0
        expected = law[keep] / law[keep].sum() * counts.sum()
        return float(stats.chisquare(counts[keep], expected).pvalue)

    assert p_value(sample) > 1e-4
    assert p_value(_inverse_cdf_off_by_one) < 1e-4


def test_sample_keeps_the_last_token_with_mass_when_the_threshold_rounds_up(monkeypatch):
    """A uniform within one float step of 1 times the total can round to the total itself; the draw must then be the
    last token that carries mass, never one past the support or past the row."""
    from jointspec.core.sampling import sample

    probs = torch.tensor([[0.0, 0.6, 0.4, 0.0, 0.0]])
    for uniform in (1.0 - 2 ** -24, 1.0):  # the largest float32 below 1, and the extreme: exactly the total
        monkeypatch.setattr(torch, "rand", lambda *args, value=uniform, **kwargs: torch.full((1, 1), value))
        assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [2]


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [float("nan"), 0.5, 0.5]])
def test_sample_refuses_a_row_without_a_positive_finite_sum(row):
    from jointspec.core.sampling import sample

    with pytest.raises(ValueError, match="positive, finite sum"):
        sample(torch.tensor([[0.2, 0.8, 0.0], row]), torch.Generator().manual_seed(0))


def test_fast_paths_match_the_full_vocabulary_computation():
    """Top-k over a large vocabulary runs in the k kept tokens, and top-p alone in the few hundred or thousand most
    likely: both must give what masking and a softmax over the whole row give, including ties at the k-th logit
    (where every tied token stays) and rows whose nucleus is wider than the candidates (the full sort)."""
    generator = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(4, 6000, generator=generator)
    logits[1, :] = 0.01 * torch.randn(6000, generator=generator)  # nearly flat: the nucleus holds most of the row
    logits[2, :50] = 30.0  # a 50-way tie at the top: top-k 10 keeps all 50
    for sampling in (SamplingConfig(1.0, top_k=10), SamplingConfig(0.8, top_k=10, top_p=0.7),
                     SamplingConfig(1.0, top_p=0.9), SamplingConfig(0.6, top_p=0.5)):
        # Which of 50 tied tokens top-p keeps is the sort's choice, in both computations: the tie row is compared
        # under top-k alone.
        rows = logits if sampling.top_p == 1.0 else logits[[0, 1, 3]]
        fast, reference = processed_probs(rows, sampling), _full_vocabulary_reference(rows, sampling)
        assert torch.equal(fast > 0, reference > 0), sampling
        torch.testing.assert_close(fast, reference, atol=1e-6, rtol=0)
        if sampling.top_p == 1.0:
            assert int((fast[2] > 0).sum()) == 50  # the tie kept every tied token


def _full_vocabulary_reference(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    scaled = logits / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf")).softmax(dim=-1)


def test_each_row_gets_the_bits_it_gets_alone_whatever_rows_come_with_it():
    """A verification round processes its pending row with the draft's rows. The shortcuts (exactly k kept, a
    nucleus within 256 or 4,096 candidates, the finite logits only) sum a row's terms in other orders than the general
    path, so a row must take the path it takes alone, whatever its companions need: else a seeded lookup draft would
    sample other bits than ``ar`` does. Each pair below mixes a row of one path with a row of another."""
    generator = torch.Generator().manual_seed(5)
    peaked = 4 * torch.randn(6000, generator=generator)
    flat = 0.01 * torch.randn(6000, generator=generator)  # its nucleus needs more than 4,096 candidates
    mid = 0.6 * torch.randn(6000, generator=generator)  # within 4,096 but not 256
    tied = peaked.clone()
    tied[torch.topk(tied, 11).indices[-1]] = torch.topk(tied, 10).values[-1]  # an 11th token tied with the 10th
    masked = peaked.masked_fill(torch.arange(6000) % 3 == 0, float("-inf"))  # fewer finite logits
    cases = [(SamplingConfig(1.0, top_k=10), peaked, tied), (SamplingConfig(0.8, top_k=10, top_p=0.7), peaked, tied),
             (SamplingConfig(1.0, top_p=0.9), peaked, flat), (SamplingConfig(1.0, top_p=0.9), mid, peaked),
             (SamplingConfig(1.0, top_p=0.9), flat, masked), (SamplingConfig(0.7, top_k=10, top_p=0.8), tied, masked),
             (SamplingConfig(1.0, top_p=0.9, min_p=0.05), peaked, flat), (SamplingConfig(1.0, min_p=0.01), mid, flat)]
    for sampling, first, second in cases:
        together = processed_probs(torch.stack([first, second]), sampling)
        for row, alone in zip(together, (processed_probs(first[None], sampling), processed_probs(second, sampling))):
            assert torch.equal(row, alone.reshape(row.shape)), sampling
