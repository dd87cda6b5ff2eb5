"""Sampling's row kernels (csrc/grouped_linear.cpp: ``top_k_rows``, ``sample_rows``) against the PyTorch operations
they stand in for in core/sampling.py, in every build this CPU runs.

Deterministic (seeded rows, and uniforms placed where a draw changes): no false-failure odds. The rows are chosen
where a shortcut would show: ties at and inside the top k, -inf and NaN entries, lengths that are not a multiple of
sixteen, zero entries before and between the mass, partial sums that a float32 running sum rounds differently from
PyTorch's double one, and uniforms at the partial sums' boundaries.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.core import sampling
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.kernels.grouped import kernels, runnable_isas


def reference_top_k(rows: torch.Tensor, k: int):
    """The definition: the k largest, largest first, ties to the lower id, and how many entries are >= the k-th."""
    values, indices = [], []
    for row in rows:
        order = sorted(range(len(row)), key=lambda j: (-float(row[j]), j))[:k]
        indices.append(order)
        values.append([float(row[j]) for j in order])
    values = torch.tensor(values, dtype=torch.float32)
    return values, torch.tensor(indices), (rows >= values[:, -1:]).sum(dim=-1)


def top_k_cases():
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(3, 1000, generator=generator) * 3
    ties = (torch.randn(3, 203, generator=generator) * 2).round()  # few distinct values: ties everywhere
    draft_vocab = torch.full((2, 517), float("-inf"))  # a head's draft vocabulary: most of the row -inf
    draft_vocab[:, ::3] = torch.randn(2, 173, generator=generator)
    few = torch.full((1, 64), float("-inf"))  # fewer finite entries than k
    few[0, [5, 40]] = torch.tensor([1.0, 2.0])
    flat = torch.zeros(1, 100)
    for rows in (normal, ties, draft_vocab, few, flat):
        for k in (1, 2, 10, 17, 64):
            yield rows, k
    yield normal[:1, :16], 16  # k == V
    yield normal[:1, :23], 23


@pytest.mark.parametrize("isa", runnable_isas())
def test_top_k_rows_is_the_k_largest_ties_to_the_lower_id(isa):
    module = kernels(isa)
    for rows, k in top_k_cases():
        values, indices, counts = module.top_k_rows(rows.contiguous(), k)
        want_values, want_indices, want_counts = reference_top_k(rows, k)
        assert torch.equal(values, want_values), (rows.shape, k)
        assert torch.equal(indices, want_indices), (rows.shape, k)
        assert torch.equal(counts, want_counts), (rows.shape, k)


@pytest.mark.parametrize("isa", runnable_isas())
def test_top_k_rows_hands_a_row_with_a_nan_back(isa):
    rows = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    rows[1, 57] = float("nan")
    counts = kernels(isa).top_k_rows(rows, 5)[2]
    assert counts.tolist()[1] == -1 and min(counts.tolist()[::2]) == 5


def reference_sample(rows: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """sample()'s PyTorch path, with given uniforms."""
    cumulative = rows.cumsum(dim=-1)
    total = cumulative[:, -1:].contiguous()
    draws = torch.searchsorted(cumulative, uniform[:, None] * total, right=True)
    return torch.minimum(draws, torch.searchsorted(cumulative, total, right=False)).reshape(-1)


def sample_cases():
    generator = torch.Generator().manual_seed(2)
    dense = torch.rand(2, 4099, generator=generator) ** 6  # many small terms: float and double sums part ways
    sparse = torch.zeros(2, 1000)
    sparse[:, [0, 3, 17, 500, 999]] = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25])
    late = torch.zeros(1, 300)  # all the mass after a run of zeros, some of it in denormal entries
    late[0, 250:] = torch.rand(50, generator=generator)
    late[0, 260] = 1e-42
    lone = torch.zeros(1, 37)
    lone[0, 36] = 1.0
    for rows in (dense, sparse, late, lone):
        cumulative = rows.cumsum(dim=-1)
        total = cumulative[:, -1]
        # The uniforms at each partial sum (and an ulp each side): where `>` against `>=`, or a float running sum,
        # would draw another token.
        for j in torch.linspace(0, rows.shape[1] - 1, 40).long().tolist():
            u = (cumulative[:, j] / total).clamp(max=1 - 2 ** -24)
            for nudge in (-1, 0, 1):
                yield rows, torch.nextafter(u, torch.full_like(u, nudge * 2.0)) if nudge else u
        for u in (0.0, 1 - 2 ** -24):
            yield rows, torch.full((rows.shape[0],), u)


@pytest.mark.parametrize("isa", runnable_isas())
def test_sample_rows_draws_what_cumsum_and_searchsorted_draw(isa):
    module = kernels(isa)
    drawn = set()
    for rows, uniform in sample_cases():
        uniform = uniform.float().clamp(0, 1 - 2 ** -24).contiguous()
        got = module.sample_rows(rows.contiguous(), uniform)
        assert torch.equal(got, reference_sample(rows, uniform)), (rows.shape, uniform)
        drawn.update(got.tolist())
    assert len(drawn) > 50  # the uniforms reached across the rows


@pytest.mark.parametrize("isa", runnable_isas())
def test_sample_rows_hands_rows_sample_refuses_back(isa):
    rows = torch.rand(5, 40, generator=torch.Generator().manual_seed(3))
    rows[1] = 0.0
    rows[2, 7] = -0.5
    rows[3, 9] = float("nan")
    rows[4, 2] = float("inf")
    assert kernels(isa).sample_rows(rows, torch.full((5,), 0.5)).tolist()[1:] == [-1, -1, -1, -1]
    assert kernels(isa).sample_rows(rows, torch.full((5,), 0.5)).tolist()[0] >= 0


CONFIGS = [SamplingConfig(1.0, 10, 0.9), SamplingConfig(0.7, 40, 1.0), SamplingConfig(1.0, 0, 0.9),
           SamplingConfig(1.3, 0, 1.0), SamplingConfig(1.0, 5, 0.5), SamplingConfig(1.0, 0, 0.5)]


def logit_rows() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    rows = [torch.randn(3, 2048, generator=generator) * 4]
    tied = (torch.randn(2, 2048, generator=generator) * 3).round()  # ties inside and at the top k
    rows.append(tied)
    draft = torch.full((2, 2048), float("-inf"))
    draft[:, :700] = torch.randn(2, 700, generator=generator) * 4
    rows.append(draft)
    # 300 tokens tied at the top: top-p alone cuts its 256 candidates inside the tie, where torch.topk picks as it
    # likes which tied tokens make the cut.
    straddle = torch.full((1, 2048), -30.0)
    straddle[0, torch.randperm(2048, generator=generator)[:300]] = 0.0
    rows.append(straddle)
    return rows


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_processed_probabilities_and_draws_are_the_same_with_and_without_the_kernels(config, monkeypatch):
    kernels()  # loaded, as a model on the int4 kernels loads them
    assert sampling._row_kernels(torch.zeros(1, 8)) is not None  # so the first pass below runs on them
    with_kernels = []
    for logits in logit_rows():
        probs = processed_probs(logits, config)
        with_kernels.append((probs, [sample(probs, torch.Generator().manual_seed(s)) for s in range(20)]))
    monkeypatch.setattr(sampling, "_row_kernels", lambda rows: None)
    for logits, (probs, draws) in zip(logit_rows(), with_kernels):
        assert torch.equal(processed_probs(logits, config), probs)
        assert all(torch.equal(sample(probs, torch.Generator().manual_seed(s)), d) for s, d in enumerate(draws))


def test_the_pytorch_path_orders_ties_as_the_kernels_do(monkeypatch):
    monkeypatch.setattr(sampling, "_row_kernels", lambda rows: None)
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.5, 2.0, -1.0, 2.0]])
    values, indices, exact = sampling._top_k(logits, 5)
    assert indices.tolist() == [[1, 3, 5, 7, 4]] and values.tolist() == [[2.0, 2.0, 2.0, 2.0, 1.5]]
    assert exact.tolist() == [True]
    assert sampling._top_k(logits, 3)[2].tolist() == [False]  # the 3rd is tied with the 4th: top-k keeps all four
    # Of tokens tied at the k-th, the lowest ids make the cut.
    assert sampling._top_k(logits, 3)[1].tolist() == [[1, 3, 5]]
    # Each row alone: a row with a NaN beside it (which keeps torch.topk's own answer) changes nothing.
    beside = torch.cat([logits, torch.full_like(logits, float("nan"))])
    assert sampling._top_k(beside, 5)[1][0].tolist() == [1, 3, 5, 7, 4]
    # Top-p runs over the tokens in that order: of three tokens tied at the top, the lowest ids are kept, after a
    # top-k and alone (a vocabulary this small takes the general path).
    for top_k in (3, 0):
        probs = processed_probs(torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]]), SamplingConfig(1.0, top_k, 0.5))
        assert probs[0].nonzero().reshape(-1).tolist() == [1, 2], top_k
