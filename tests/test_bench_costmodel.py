"""The bench's cost model (``jointspec.bench.costmodel``): a measured target cost, interpolated and extrapolated, and
the predicted time of a decode from its stats; the accepted-length histogram of the report.

Arithmetic on given numbers, written out by hand in the test: no false-failure odds.
"""

from __future__ import annotations

import pytest


def test_cost_model_prediction_and_histogram():
    from jointspec.bench.costmodel import TargetCost, expected_tokens_per_round, predict
    from jointspec.bench.report import accepted_histogram
    from jointspec.core.loop import SpecStats

    cost = TargetCost({1: 0.010, 2: 0.012, 4: 0.020}, prefill_tokens=200)
    assert cost.seconds(3) == pytest.approx(0.016)  # interpolated
    assert cost.seconds(6) == pytest.approx(0.028)  # extrapolated from the last two
    stats = SpecStats()
    for accepted in (0, 1, 3, 3):  # four rounds of 3-token chains
        stats.record([0, 1, 2], accepted)
    stats.draft_seconds, stats.prefill_seconds = 0.004, 0.05
    # 4 rounds x (1 ms drafting + T(4) = 20 ms) + 50 ms prefill.
    assert predict(cost, stats).seconds == pytest.approx(0.05 + 4 * 0.021)
    assert accepted_histogram(stats) == [1, 1, 0, 2]
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
