"""The target's attention after a long prompt: the whole cache (exact), or one of the approximate (lossy, opt-in)
targets that read or see only part of it. ``generate --attention`` and the bench spec option ``attention=`` pick
one here."""

from __future__ import annotations

from jointspec.core.target import TargetLM
from jointspec.drafters.sparse_self import SparseViewTarget
from jointspec.drafters.speckv import SpecKVTarget
from jointspec.drafters.specpc import PromptCompressedTarget

ATTENTION_MODES = ("full", "sparse", "speckv", "specpc")


def with_attention(target: TargetLM, mode: str) -> TargetLM:
    """``target`` itself for ``full``; wrapped to decode over part of its cache for ``sparse`` (a view chosen from the
    tokens, :class:`SparseViewTarget`) or ``speckv`` (chosen by a lookahead's attention, :class:`SpecKVTarget`); or
    to read only part of a long prompt for ``specpc`` (chosen by its first layers' attention,
    :class:`PromptCompressedTarget`)."""
    if mode == "full":
        return target
    if mode == "sparse":
        return SparseViewTarget(target)
    if mode == "speckv":
        return SpecKVTarget(target)
    if mode == "specpc":
        return PromptCompressedTarget(target)
    raise ValueError(f"attention '{mode}' must be one of: {', '.join(ATTENTION_MODES)}")
