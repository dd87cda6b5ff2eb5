"""How wide a one-level tree of the draft's top w next tokens should be on a target, and what it is expected to gain.

A round verifies the pending token plus w draft tokens as one (w + 1)-token target forward, after one draft call, and
yields 1 + P(the target's next token is among the draft's top w) tokens. Which w pays depends on the target's cost
curve (on kernels where a 4-token forward costs about a step, w = 3; where it costs 1.6 steps, w = 2). P comes from
the draft itself: ``jointspec`` heads carry it in their ``draft.json`` (``measured.top_w_hit_rate``, teacher-forced
on the target's own answers); a draft without it gets :data:`PRIOR_TOP_W_HIT_RATE`.
"""

from __future__ import annotations

from jointspec.drafts.artifact import measured_top_w_hit_rate

# For drafts that carry no measurement: the shipped SmolLM2 head's own rates (docs/methods.md). A better draft shifts
# all three up, which moves the chosen width little.
PRIOR_TOP_W_HIT_RATE = {1: 0.442, 2: 0.573, 3: 0.634}


def top_w_hit_rate(draft_source: str | None) -> dict[int, float]:
    """The draft's measured top-w hit rates (w = 1..3) when ``draft_source`` is a trained draft's folder that records
    them, else the prior."""
    measured = measured_top_w_hit_rate(draft_source) if draft_source and draft_source != "self" else None
    return measured or PRIOR_TOP_W_HIT_RATE


def default_tree_width(curve, draft_cost: float, hit_rate: dict[int, float] = PRIOR_TOP_W_HIT_RATE) -> int:
    """The width w of the one-level tree that gives the most tokens per unit of cost on ``curve``."""
    return max(hit_rate, key=lambda w: (1 + hit_rate[w]) / (curve.cost(w + 1) + draft_cost))


def tree_branching(tree: tuple[int, ...] | None, curve, draft_cost: float,
                   hit_rate: dict[int, float] = PRIOR_TOP_W_HIT_RATE) -> tuple[int, ...]:
    """The k-config a tree method drafts: ``tree`` as given (``--tree``), else the one-level tree of
    :func:`default_tree_width`."""
    return tree or (default_tree_width(curve, draft_cost, hit_rate),)


def expected_tree_gain(curve, draft_cost: float, hit_rate: dict[int, float] = PRIOR_TOP_W_HIT_RATE) -> float:
    """The rate of the :func:`default_tree_width` tree relative to plain decoding, by the same rates: tokens per
    round over a round's cost, in plain steps."""
    width = default_tree_width(curve, draft_cost, hit_rate)
    return (1 + hit_rate[width]) * curve.cost(1) / (curve.cost(width + 1) + draft_cost)
