"""Lossless multi-candidate methods over a draft model or head: ``specinfer`` (a token tree by a k-config, recursive
rejection sampling) and ``spectr`` (independent draft chains, SpecTr's k-sequential selection).

A tree round verifies every node in one target forward, which on a CPU's quantised target or llama.cpp costs several
plain steps for the papers' trees. So both are cost-aware unless told otherwise (``--no-cost-aware``): ``specinfer``
without ``--tree`` drafts the one-level tree of the draft's top w tokens that the target's measured cost curve says
pays best (:func:`~jointspec.methods.tree_width.default_tree_width`, as `default` sizes its tree), and ``spectr`` its
chains, each only while it runs faster than plain decoding (:mod:`jointspec.drafters.tree_gate`). A tree given with
``--tree`` is drafted every round, as given; ``--no-cost-aware`` drafts every round too, ``(4, 2, 2)`` for
``specinfer`` without ``--tree``.
"""

from __future__ import annotations

from jointspec.drafters.tree import TreeDrafter
from jointspec.drafters.tree_gate import GatedTreeDrafter
from jointspec.methods.costs import draft_cost_per_call, target_cost_curve
from jointspec.methods.registry import MethodContext, register_method
from jointspec.methods.tree_width import top_w_hit_rate, tree_branching
from jointspec.verifiers.spectr import SpecTrVerifier
from jointspec.verifiers.traversal import TraversalVerifier
from jointspec.verifiers.tree import TreeRejectionVerifier

# specinfer's tree with --no-cost-aware and no --tree: 4 + 8 + 16 = 28 nodes, the SpecInfer/MCSD papers' kind of
# k-config. On the int4 CPU target it ran at a quarter of plain sampling's speed (docs/lab/benchmarks.md, section 40).
SPECINFER_TREE = (4, 2, 2)


def _tree(context: MethodContext, branching: tuple[int, ...] | None, every_round: bool) -> GatedTreeDrafter:
    """The tree drafter of ``branching`` (None: the curve's one-level width) behind the cost gate, open every round
    where ``every_round``."""
    draft = context.draft_model()
    curve = target_cost_curve(context.target)
    draft_cost = draft_cost_per_call(draft, target=context.target)
    hit_rate = top_w_hit_rate(context.config.draft)
    branching = tree_branching(branching, curve, draft_cost, hit_rate)
    tree = TreeDrafter(draft, branching, replacement=True, eos_token_ids=context.eos_token_ids())
    # The prior: how often the draft's top tokens, as many as the first level has, hold the target's next token.
    prior = hit_rate[min(branching[0], max(hit_rate))]
    return GatedTreeDrafter(tree, curve, draft_cost_per_call=draft_cost, every_round=every_round,
                            prior_tree_tokens=prior)


def _every_round(context: MethodContext, branching: tuple[int, ...]) -> TreeDrafter:
    """``--no-cost-aware``: the tree alone, no cost curve measured."""
    return TreeDrafter(context.draft_model(), branching, replacement=True, eos_token_ids=context.eos_token_ids())


@register_method("specinfer", "SpecInfer/MCSD token tree with recursive rejection, or traversal verification with "
                 "--verify traversal (lossless); --tree k-config every round, else the one-level tree the cost curve "
                 "pays best, drafted while it beats plain decoding (--no-cost-aware: 4,2,2 every round)", lossless=True,
                 cost_aware=True, cost_aware_by_default=True,
                 reads=("draft", "head_weights", "tree", "cost_aware", "verify"), drafts_trees=True)
def _build_specinfer(context: MethodContext):
    config = context.config
    drafter = (_tree(context, config.tree, every_round=config.tree is not None) if config.cost_aware
               else _every_round(context, config.tree or SPECINFER_TREE))
    verifier = TraversalVerifier if context.config.verify == "traversal" else TreeRejectionVerifier
    return drafter, verifier(replacement=True)


@register_method("spectr", "SpecTr: --beam-width i.i.d. draft chains of --num-draft-tokens, k-sequential selection, "
                 "drafted only while they beat plain decoding (--no-cost-aware: every round) (lossless)",
                 lossless=True, cost_aware=True, cost_aware_by_default=True,
                 reads=("draft", "head_weights", "num_draft_tokens", "beam_width", "cost_aware"), drafts_trees=True)
def _build_spectr(context: MethodContext):
    config = context.config
    chains = (config.beam_width,) + (1,) * (config.num_draft_tokens - 1)
    drafter = _tree(context, chains, every_round=False) if config.cost_aware else _every_round(context, chains)
    return drafter, SpecTrVerifier()
