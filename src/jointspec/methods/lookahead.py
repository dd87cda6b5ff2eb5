"""``lookahead``: Lookahead's trie drafts (Zhao et al., 2023), every continuation the context offers merged into one
token tree, as many nodes as the target's cost curve says pay (:mod:`jointspec.drafters.trie`). ``lade``: lookahead
decoding (Fu et al., 2024), Jacobi iterations and the n-grams they leave behind (:mod:`jointspec.drafters.jacobi`)."""

from __future__ import annotations

from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafters.jacobi import JacobiLookaheadDrafter
from jointspec.drafters.trie import TrieLookupDrafter
from jointspec.methods.costs import target_cost_curve
from jointspec.methods.registry import MethodContext, register_method
from jointspec.verifiers.tree import TreeRejectionVerifier


@register_method("lookahead", "Lookahead (Zhao et al. 2023): a trie of every earlier continuation of the context's "
                 "last n-gram, drafted as one token tree sized by the cost curve (--tree-budget caps the nodes, "
                 "default 16) (lossless)", lossless=True, learns_online=True,
                 reads=("num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram", "tree_budget"),
                 drafts_trees=True)
def _build_lookahead(context: MethodContext):
    config = context.config
    drafter = TrieLookupDrafter(target_cost_curve(context.target),
                                max_depth=max(config.num_draft_tokens, config.max_num_draft_tokens),
                                max_nodes=config.tree_budget or 16, max_ngram=config.max_ngram,
                                min_ngram=config.min_ngram, output_memory=context.memory)
    # Distinct deterministic siblings: one-hot draft rows, so replacement or not gives the same law.
    return drafter, TreeRejectionVerifier(replacement=True)


@register_method("lade", "lookahead decoding (Fu et al. 2024): Jacobi guesses scored in the verification forward, "
                 "the target's n-grams from every scored row drafted when the context reaches their first token; "
                 "one token tree sized by the cost curve (--num-draft-tokens: the window, --max-ngram: the n-gram "
                 "length, --tree-budget: the most nodes) (lossless)", lossless=True,
                 reads=("num_draft_tokens", "max_ngram", "tree_budget"), drafts_trees=True)
def _build_lade(context: MethodContext):
    config = context.config
    if config.max_ngram < 2:  # an n-gram is drafted after its first token: one token drafts nothing
        raise UnsupportedOptionError(f"lade's n-grams hold their first token and what follows it: --max-ngram (the "
                                     f"n-gram length N) must be >= 2 for lade, got {config.max_ngram}")
    drafter = JacobiLookaheadDrafter(target_cost_curve(context.target), window=config.num_draft_tokens,
                                     ngram=config.max_ngram, max_nodes=config.tree_budget or 16)
    return drafter, TreeRejectionVerifier(replacement=True)
