"""Lossless multi-candidate methods over a draft model or head: ``specinfer`` (a token tree by a k-config, recursive
rejection sampling) and ``spectr`` (independent draft chains, SpecTr's k-sequential selection)."""

from __future__ import annotations

from jointspec.drafters.tree import TreeDrafter
from jointspec.methods.registry import MethodContext, register_method
from jointspec.verifiers.spectr import SpecTrVerifier
from jointspec.verifiers.traversal import TraversalVerifier
from jointspec.verifiers.tree import TreeRejectionVerifier

# specinfer's tree when --tree is not given: 4 + 8 + 16 = 28 nodes, the SpecInfer/MCSD papers' kind of k-config.
SPECINFER_TREE = (4, 2, 2)


@register_method("specinfer", "SpecInfer/MCSD token tree (--tree k-config, default 4,2,2) with recursive rejection, "
                 "or traversal verification with --verify traversal (lossless)", lossless=True)
def _build_specinfer(context: MethodContext):
    drafter = TreeDrafter(context.draft_model(), context.config.tree or SPECINFER_TREE, replacement=True,
                          eos_token_ids=context.eos_token_ids())
    verifier = TraversalVerifier if context.config.verify == "traversal" else TreeRejectionVerifier
    return drafter, verifier(replacement=True)


@register_method("spectr", "SpecTr: --beam-width i.i.d. draft chains, k-sequential selection (lossless)", lossless=True)
def _build_spectr(context: MethodContext):
    config = context.config
    branching = (config.beam_width,) + (1,) * (config.num_draft_tokens - 1)
    drafter = TreeDrafter(context.draft_model(), branching, replacement=True, eos_token_ids=context.eos_token_ids())
    return drafter, SpecTrVerifier()
