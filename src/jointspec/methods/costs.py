"""What drafting costs on a target: its measured cost curve, a draft's per-call cost, and the cost-aware wrapper."""

from __future__ import annotations

from jointspec.core.draft import Drafter
from jointspec.drafters.costaware import DEFAULT_SIZES, CostAwareDrafter, measure_cost_curve


def target_cost_curve(target):
    """The target's measured cost curve (memoised per model: a few seconds once)."""
    # Verification, and so its cost, runs on the exact kernels: a target left on its plain-decode ones by an `ar` decode
    # goes back to them first.
    if target.capabilities.plain_decode and target.plain:
        target.reset()
    # A model with a short context (tiny test models) is measured on the sizes that fit; the curve extrapolates.
    room = target.max_context - target.num_cached
    return measure_cost_curve(target, sizes=tuple(n for n in DEFAULT_SIZES if n < room) or (1,))


def draft_cost_per_call(draft, rows: int = 1, *, target=None) -> float:
    """Seconds of one forward of ``rows`` tokens of a draft model or head (memoised per model, like the target's
    curve): a chain's draft step is 1 row, a beam search's level one row per beam.

    A draft over the target's own weights (``--draft self``) costs what the target's forward of ``rows`` does, read
    from the target's curve: measured apart (or kept on disk from another process, curve_store.py), a quieter
    moment made the same forward look cheaper than a plain step, and drafting look as if it paid."""
    if target is not None and same_weights(draft, target):
        return target_cost_curve(target).cost(rows)
    sizes = (1, 2) if rows <= 2 else (1, 2, rows)
    return measure_cost_curve(draft, sizes=sizes, repeats=5).cost(rows)


def same_weights(draft, target) -> bool:
    """Whether ``draft`` runs the target's own weights (a fork of it, or the target itself)."""
    return draft is target or (draft.capabilities.fork and target.capabilities.fork
                               and getattr(draft, "model", None) is getattr(target, "model", object()))


def make_cost_aware(drafter: Drafter, target, max_num_draft_tokens: int) -> Drafter:
    """Wrap a chain drafter so each round drafts the length the target's measured cost curve says pays, or none.

    The curve is measured once per target model (a few seconds, memoised); a model drafter's per-token cost is its
    own one-token forward, prompt lookup's is zero.
    """
    curve = target_cost_curve(target)
    draft = getattr(drafter, "draft", None)
    if draft is not None:
        curve = curve.with_draft_cost(draft_cost_per_call(draft, target=target))
    return CostAwareDrafter(drafter, curve, max_num_draft_tokens=max_num_draft_tokens)
