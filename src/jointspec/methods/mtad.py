"""Multi-token assisted decoding (MTAD, arXiv 2407.09722): the draft beam-samples a block, the target keeps the longest
prefix whose joint likelihood ratio passes ``accept_threshold`` (approximates joint decoding; not lossless).

``mtad``       the best of ``beam_width`` beams, ``num_draft_tokens`` deep, verified as a chain
``mtad-tree``  every beam of every level verified in one target pass
"""

from __future__ import annotations

from jointspec.drafters.beam import BeamDrafter
from jointspec.methods.registry import MethodContext, register_method
from jointspec.verifiers.mtad import MTADVerifier


def _beam_drafter(context: MethodContext, tree: bool) -> BeamDrafter:
    config = context.config
    return BeamDrafter(context.draft_model(), config.num_draft_tokens, config.beam_width, tree=tree,
                       eos_token_ids=context.eos_token_ids())


@register_method("mtad", "MTAD: draft beam sampling + joint-likelihood verification of the best beam (not lossless)",
                 lossless=False)
def _build_mtad(context: MethodContext):
    return _beam_drafter(context, tree=False), MTADVerifier(context.config.accept_threshold)


@register_method("mtad-tree", "tree MTAD: every draft beam of every level verified in one pass (not lossless)",
                 lossless=False)
def _build_mtad_tree(context: MethodContext):
    return _beam_drafter(context, tree=True), MTADVerifier(context.config.accept_threshold)
