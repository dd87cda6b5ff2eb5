"""``aded``: ADED (Liu et al., 2024), token trees from an adaptive tri-gram model of the request, found by best-first
search and sized by the target's cost curve (:mod:`jointspec.drafters.aded`)."""

from __future__ import annotations

from jointspec.drafters.aded import AdedDrafter
from jointspec.drafters.corpus import table_for
from jointspec.methods.costs import target_cost_curve
from jointspec.methods.lossless import shipped_corpus_table
from jointspec.methods.registry import MethodContext, register_method
from jointspec.verifiers.tree import TreeRejectionVerifier

# --draft value that turns the n-gram table prior off.
NO_PRIOR = "none"


@register_method("aded", "ADED (Liu et al. 2024): an adaptive tri-gram model of the prompt and output, searched "
                 "best-first into one token tree sized by the cost curve (--tree-budget caps the nodes, default 16; "
                 "--draft TABLE or 'none' for its n-gram prior, default: the one shipped for the tokenizer) "
                 "(lossless)", lossless=True, learns_online=True,
                 reads=("draft", "num_draft_tokens", "max_num_draft_tokens", "tree_budget"), drafts_trees=True)
def _build_aded(context: MethodContext):
    config = context.config
    if config.draft == NO_PRIOR:
        prior = None
    elif config.draft:
        prior = table_for(config.draft, context.tokenizer, context.target.vocab_size)
    else:
        # The request's own counts carry ADED where the text repeats; the table of the target's past answers gives
        # open-ended chat (no repetition yet) something to draft, as it does for `corpus`.
        prior = shipped_corpus_table(context)
    drafter = AdedDrafter(target_cost_curve(context.target),
                          max_depth=max(config.num_draft_tokens, config.max_num_draft_tokens),
                          max_nodes=config.tree_budget or 16, eos_token_ids=context.eos_token_ids(), prior=prior,
                          answers=context.memory)
    # Distinct deterministic siblings: one-hot draft rows, so replacement or not gives the same law.
    return drafter, TreeRejectionVerifier(replacement=True)
