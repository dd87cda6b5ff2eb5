"""``default``: the fastest exact configuration this library knows for a target, chosen from its measured cost curve.

A head shipped for the target (or ``--draft``) drafts a one-level tree of its top w next tokens where the curve says
that tree pays, with lookup where the text repeats (``hybrid-tree``); else cost-aware lookup (``corpus`` where an
n-gram table is shipped for the tokenizer, else ``pld``). The tree's expected gain needs how often the draft's top w
hold the target's next token: a head carries that measurement in its own ``draft.json``.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import replace

from jointspec.core.draft import Drafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.verdict import Verifier
from jointspec.drafters.corpus import shipped_table_for
from jointspec.drafts.artifact import shipped_head_for
from jointspec.methods.costs import draft_cost_per_call
from jointspec.methods.lossless import hybrid_tree, shipped_corpus_table
from jointspec.methods.registry import MethodConfig, MethodContext, build_method, register_method
from jointspec.methods.tree_width import expected_tree_gain, top_w_hit_rate

log = logging.getLogger(__name__)


# Below this expected gain over plain decoding `default` leaves the head out and drafts by cost-aware lookup alone:
# the estimate is a prior that leaves out the tree's own round overheads, and in the benchmarks trees expected up to
# about 1.17x ran slower than lookup alone, while those expected at 1.33x and above paid. The bar sits between, clear
# of the spread of one machine's measured curves (docs/methods.md, "default").
MIN_TREE_GAIN = 1.25


# The expected tree gain per (target weights, head), once measured: a server builds `default` for every request, and
# loading the head to measure it again costs more than a short answer takes to decode.
_TREE_GAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@register_method("default", "what `generate` runs: hybrid-tree with the head shipped for the target where its measured "
                 "cost curve says the tree pays, else cost-aware corpus or pld (lossless)",
                 lossless=True, cost_aware=True, learns_online=True,
                 reads=("draft", "head_weights", "num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram",
                        "tree", "tree_budget"))
def _build_default(context: MethodContext) -> tuple[Drafter, Verifier]:
    # What the methods `default` builds start from. Verified token-wise, as everywhere `default` runs: it does not read
    # `verify` (a --verify is refused by name), so no method it builds may obey one that reached its config otherwise.
    own = replace(context.config, verify="token")

    def lookup() -> MethodConfig:
        """Cost-aware lookup: with the n-gram table shipped for the target's tokenizer where there is one (corpus),
        else prompt lookup alone (pld)."""
        table = shipped_table_for(context.tokenizer) if own.draft is None else None
        return replace(own, name="corpus" if table is not None else "pld", cost_aware=True)

    # Trees and heads need a target that scores trees and exposes hidden states (llama.cpp's adapter does neither).
    capabilities = context.target.capabilities
    trees_and_heads = capabilities.trees and capabilities.features
    head = context.config.draft
    if head is None and trees_and_heads:
        head = shipped_head_for(context.target)
    asked = context.config
    shaped = [option for option, value in (("--tree", asked.tree), ("--tree-budget", asked.tree_budget)) if value]
    if shaped and not trees_and_heads:
        raise UnsupportedOptionError(f"{' and '.join(shaped)} shape `default`'s head tree, and this target scores "
                                     "chains only (llama.cpp's backend): `default` drafts chains by lookup here, so "
                                     "drop them")
    if shaped and head is None:
        raise UnsupportedOptionError(f"{' and '.join(shaped)} shape `default`'s head tree, but no draft head ships for "
                                     "this target: pass one with --draft DIR (jointspec train-draft makes one), or "
                                     "drop them")
    # What the remembered decision depends on besides the weights: the head, and the functions and bar that judge it.
    key = (str(head), expected_tree_gain, draft_cost_per_call, top_w_hit_rate, MIN_TREE_GAIN)
    remembered = _TREE_GAINS.get(context.target.model, {}).get(key) if capabilities.torch_module else None
    if head is None or (remembered is not None and remembered < MIN_TREE_GAIN and context.config.draft is None
                        and not context.config.tree and not context.config.tree_budget):
        config = lookup()
    elif not trees_and_heads:
        config = replace(own, name="hybrid", draft=str(head), cost_aware=True)
    else:
        config = replace(own, name="hybrid-tree", draft=str(head), cost_aware=False)
        # Its lookup half drafts as `corpus` where a table is shipped for the tokenizer: on the float32 SmolLM2 that
        # ran faster than with prompt lookup alone (docs/lab/benchmarks.md, section 5).
        drafter, verifier = hybrid_tree(replace(context, config=config), table=shipped_corpus_table(context))
        if context.config.draft is not None or context.config.tree or context.config.tree_budget:
            return drafter, verifier  # a draft or a tree asked for: keep them
        draft = drafter.draft
        gain = expected_tree_gain(drafter.curve, draft_cost_per_call(draft, target=context.target),
                                  top_w_hit_rate(config.draft))
        if capabilities.torch_module:
            _TREE_GAINS.setdefault(context.target.model, {})[key] = gain
        if gain >= MIN_TREE_GAIN:
            return drafter, verifier
        log.info("default: the head's tree is expected at %.2fx of plain decoding on this target (under %.2fx): "
                 "drafting by cost-aware lookup alone", gain, MIN_TREE_GAIN)
        if hasattr(draft, "mirror"):
            context.target.detach_feature_mirror(draft.mirror)
        config = lookup()
    return build_method(replace(context, config=config))
