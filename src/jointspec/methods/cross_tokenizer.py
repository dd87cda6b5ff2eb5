"""``cross``: speculative decoding with a draft model that has another tokenizer (OmniDraft; transformers' universal
assisted generation), lossless. The drafter (:mod:`jointspec.drafters.cross_tokenizer`) hands the verifier one-hot
drafts in the target's vocabulary, so token-wise speculative sampling checks them unchanged."""

from __future__ import annotations

import logging

from jointspec.backends.tokens import eos_token_ids
from jointspec.core.draft import Drafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.verdict import Verifier
from jointspec.drafters.cross_tokenizer import CrossTokenizerDrafter
from jointspec.drafts.artifact import is_head_artifact
from jointspec.methods.registry import MethodContext, register_method
from jointspec.verifiers.rejection import RejectionSamplingVerifier

log = logging.getLogger(__name__)


@register_method("cross", "a draft model with its own tokenizer (--draft SOURCE), its text re-encoded for the target; "
                 "adaptive length (lossless)", lossless=True, cost_aware=True,
                 reads=("draft", "num_draft_tokens", "max_num_draft_tokens", "cost_aware"))
def _build_cross(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    source = config.draft
    if source is None:
        raise UnsupportedOptionError("method 'cross' needs a draft model: pass --draft SOURCE (a model folder, a "
                                     ".gguf file or a model id on this machine), whatever its tokenizer")
    if context.tokenizer is None:
        raise UnsupportedOptionError(f"method 'cross' reads the target's tokens as text, but target "
                                     f"'{context.target.name}' was given without a tokenizer")
    if is_head_artifact(source):
        raise UnsupportedOptionError(f"draft '{source}' is a trained head, which drafts in the target's own "
                                     "vocabulary: use it with method 'sps' (or 'hybrid'), not 'cross'")
    if source == "self":
        draft, draft_tokenizer = context.draft_model(), context.tokenizer
    else:
        draft, draft_tokenizer = context.load_draft(source)
    if draft_tokenizer is None or not callable(getattr(draft_tokenizer, "decode", None)):
        raise UnsupportedOptionError(f"draft '{source}' has no tokenizer, and method 'cross' needs one to read the "
                                     "draft's tokens as text: give a model folder with its tokenizer files, or a "
                                     ".gguf file (which carries its own)")
    if draft_tokenizer.get_vocab() == context.tokenizer.get_vocab():
        log.info("method cross: draft '%s' shares the target's vocabulary; 'sps' drafts with it without the detour "
                 "through text", source)
    # Cost-aware: the wrapper picks each round's budget, so the drafter must be allowed the longest one.
    longest = max(config.num_draft_tokens, config.max_num_draft_tokens)
    drafter = CrossTokenizerDrafter(draft, draft_tokenizer, context.tokenizer,
                                    longest if config.cost_aware else config.num_draft_tokens, longest,
                                    target_eos_ids=context.eos_token_ids(),
                                    draft_eos_ids=eos_token_ids(draft, draft_tokenizer))
    return drafter, RejectionSamplingVerifier()
