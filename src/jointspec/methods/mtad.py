"""Multi-token assisted decoding (MTAD, arXiv 2407.09722): the draft beam-samples a block, the target keeps the longest
prefix whose joint likelihood ratio passes ``accept_threshold`` (approximates joint decoding; not lossless).

``mtad``       the best of ``beam_width`` beams, ``num_draft_tokens`` deep, verified as a chain
``mtad-tree``  every beam of every level verified in one target pass
"""

from __future__ import annotations

from jointspec.drafters.beam import BeamDrafter
from jointspec.drafters.costaware import CostAwareDrafter
from jointspec.methods.costs import draft_cost_per_call, target_cost_curve
from jointspec.methods.registry import MethodContext, register_method
from jointspec.verifiers.mtad import MTADVerifier


def _beam_drafter(context: MethodContext, tree: bool) -> BeamDrafter:
    config = context.config
    return BeamDrafter(context.draft_model(), config.num_draft_tokens, config.beam_width, tree=tree,
                       eos_token_ids=context.eos_token_ids())


def _cost_aware_beams(context: MethodContext, drafter: BeamDrafter) -> CostAwareDrafter:
    """Each round's depth γ (1 up to ``num_draft_tokens``) from the target's measured cost curve, the draft's cost of
    one beam level (a forward of ``beam_width`` rows) and the running acceptance of the joint test. Never 0: MTAD's
    output law is its point, so it chooses how deep to draft, not whether to."""
    config = context.config
    beam_level = draft_cost_per_call(drafter.cache.draft, rows=config.beam_width, target=context.target)
    curve = target_cost_curve(context.target).with_draft_cost(beam_level)
    return CostAwareDrafter(drafter, curve, max_num_draft_tokens=config.num_draft_tokens, min_num_draft_tokens=1)


@register_method("mtad", "MTAD: draft beam sampling + joint-likelihood verification of the best beam (not lossless); "
                 "each round's depth from the cost curve (--no-cost-aware: always --num-draft-tokens)",
                 lossless=False, cost_aware=True, cost_aware_by_default=True,
                 reads=("draft", "head_weights", "num_draft_tokens", "beam_width", "accept_threshold", "cost_aware"))
def _build_mtad(context: MethodContext):
    drafter = _beam_drafter(context, tree=False)
    # Cost-aware unless told otherwise: at a fixed depth of 4 it ran at about half of plain sampling's speed on the
    # int4 target, where a draft call costs a fifth to a third of a step (docs/mtad.md).
    if context.config.cost_aware:
        drafter = _cost_aware_beams(context, drafter)
    return drafter, MTADVerifier(context.config.accept_threshold)


@register_method("mtad-tree", "tree MTAD: every draft beam of every level verified in one pass (not lossless)",
                 lossless=False,
                 reads=("draft", "head_weights", "num_draft_tokens", "beam_width", "accept_threshold"),
                 drafts_trees=True)
def _build_mtad_tree(context: MethodContext):
    return _beam_drafter(context, tree=True), MTADVerifier(context.config.accept_threshold)
