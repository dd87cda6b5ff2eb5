"""``sparse-self``: the target drafts for itself over a sparse view of its own cache, then verifies with all of it
(TriForce-style self-speculation for long inputs, :mod:`jointspec.drafters.sparse_self`)."""

from __future__ import annotations

from jointspec.drafters.sparse_self import SparseSelfDrafter
from jointspec.methods.lossless import chain_verifier
from jointspec.methods.registry import MethodContext, register_method


@register_method("sparse-self", "TriForce-style self-speculation for long inputs: the target drafts seeing only "
                 "attention sinks, its recent window and the spans of the input its last n-gram points to, then "
                 "verifies with its whole cache; drafts nothing below 2,048 tokens of context (lossless)",
                 lossless=True,
                 reads=("num_draft_tokens", "verify"))
def _build_sparse_self(context: MethodContext):
    config = context.config
    return (SparseSelfDrafter(context.target, config.num_draft_tokens, eos_token_ids=context.eos_token_ids()),
            chain_verifier(config))
