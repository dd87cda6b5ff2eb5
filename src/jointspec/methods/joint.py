"""Multi-token joint decoding methods (MTAD) and the multi-candidate lossless baselines they are compared with.

``mtad``       chain MTAD: beam-sample ``beam_width`` beams ``num_draft_tokens`` deep with the draft, verify the best
               beam by joint likelihood ratio ``accept_threshold`` (approximates joint decoding; not lossless)
``mtad-tree``  tree MTAD: every beam of every level verified in one target pass
``specinfer``  token tree by the k-config ``tree`` (e.g. 4,2,2), recursive rejection sampling (lossless)
``spectr``     ``beam_width`` independent draft chains ``num_draft_tokens`` long, SpecTr's k-sequential selection
               (lossless)
"""

from __future__ import annotations

from jointspec.drafters.beam import BeamDrafter
from jointspec.drafters.tree import TreeDrafter
from jointspec.methods import MethodContext, register_method
from jointspec.verifiers.mtad import MTADVerifier
from jointspec.verifiers.tree import SpecTrVerifier, TreeRejectionVerifier


def _eos_token_ids(context: MethodContext) -> frozenset[int]:
    """EOS ids the drafters must not expand past: the same set the loop stops at."""
    from jointspec.backends.tokens import eos_token_ids

    return eos_token_ids(context.target, context.tokenizer)


def _beam_drafter(context: MethodContext, tree: bool) -> BeamDrafter:
    config = context.config
    return BeamDrafter(context.draft_model(), config.num_draft_tokens, config.beam_width, tree=tree,
                       eos_token_ids=_eos_token_ids(context))


@register_method("mtad", "MTAD: draft beam sampling + joint-likelihood verification of the best beam (not lossless)")
def _build_mtad(context: MethodContext):
    return _beam_drafter(context, tree=False), MTADVerifier(context.config.accept_threshold)


@register_method("mtad-tree", "tree MTAD: every draft beam of every level verified in one pass (not lossless)")
def _build_mtad_tree(context: MethodContext):
    return _beam_drafter(context, tree=True), MTADVerifier(context.config.accept_threshold)


# specinfer's tree when --tree is not given: 4 + 8 + 16 = 28 nodes, the SpecInfer/MCSD papers' kind of k-config.
SPECINFER_TREE = (4, 2, 2)


@register_method("specinfer", "SpecInfer/MCSD token tree (--tree k-config, default 4,2,2) with recursive rejection "
                 "(lossless)")
def _build_specinfer(context: MethodContext):
    drafter = TreeDrafter(context.draft_model(), context.config.tree or SPECINFER_TREE, replacement=True,
                          eos_token_ids=_eos_token_ids(context))
    return drafter, TreeRejectionVerifier(replacement=True)


@register_method("spectr", "SpecTr: --beam-width i.i.d. draft chains, k-sequential selection (lossless)")
def _build_spectr(context: MethodContext):
    config = context.config
    branching = (config.beam_width,) + (1,) * (config.num_draft_tokens - 1)
    drafter = TreeDrafter(context.draft_model(), branching, replacement=True, eos_token_ids=_eos_token_ids(context))
    return drafter, SpecTrVerifier()
