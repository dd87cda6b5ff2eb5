"""Decoding methods: each name builds a (drafter, verifier) pair for the one loop.

A method is registered with :func:`register_method`; nothing else in the library branches on method names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .drafters.base import Drafter, NoDrafter
from .drafters.model import ModelDrafter, check_same_vocabulary
from .drafters.ngram import PromptLookupDrafter
from .errors import UnsupportedOptionError
from .models.adapter import CausalLM
from .verifiers.base import Verifier
from .verifiers.rejection import RejectionSamplingVerifier


@dataclass(frozen=True)
class MethodConfig:
    """Every knob a method may read. ``draft`` names a draft model source ("self" = the target itself)."""

    name: str = "ar"
    draft: str | None = None
    num_draft_tokens: int = 4
    max_num_draft_tokens: int = 16
    max_ngram: int = 3
    min_ngram: int = 1
    beam_width: int = 4
    accept_threshold: float = 0.5
    tree: tuple[int, ...] = (4, 2, 2)

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be >= 1, got {self.max_num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not self.accept_threshold > 0:
            raise ValueError(f"accept_threshold must be > 0, got {self.accept_threshold}")
        if not self.tree or any(k < 1 for k in self.tree):
            raise ValueError(f"tree must be a non-empty list of branching factors >= 1, got {self.tree}")


@dataclass
class MethodContext:
    """What a method builder may use: the target, its tokenizer, and a way to load the draft model."""

    config: MethodConfig
    target: CausalLM
    tokenizer: object | None
    load_draft: Callable[[str], tuple[CausalLM, object | None]]

    def draft_model(self) -> CausalLM:
        """The draft model named by ``config.draft`` (required), checked against the target's vocabulary."""
        if self.config.draft is None:
            raise UnsupportedOptionError(f"method '{self.config.name}' needs a draft model: pass --draft PATH "
                                         "(or --draft self to use the target as its own draft)")
        if self.config.draft == "self":
            return CausalLM(self.target.model, name=f"{self.target.name} (self-draft)")
        from .models.eagle import bind_head, is_head_artifact

        if is_head_artifact(self.config.draft):  # a head from `jointspec train-draft`: bound to this target
            return bind_head(self.config.draft, self.target)
        draft, draft_tokenizer = self.load_draft(self.config.draft)
        check_same_vocabulary(self.tokenizer, draft_tokenizer, self.target, draft)
        return draft


Builder = Callable[[MethodContext], tuple[Drafter, Verifier]]
_METHODS: dict[str, tuple[Builder, str]] = {}


def register_method(name: str, summary: str) -> Callable[[Builder], Builder]:
    def decorate(builder: Builder) -> Builder:
        _METHODS[name] = (builder, summary)
        return builder
    return decorate


def method_names() -> list[str]:
    _load_builtin_methods()
    return sorted(_METHODS)


def method_summaries() -> dict[str, str]:
    _load_builtin_methods()
    return {name: summary for name, (_, summary) in sorted(_METHODS.items())}


def build_method(context: MethodContext) -> tuple[Drafter, Verifier]:
    _load_builtin_methods()
    name = context.config.name
    if name not in _METHODS:
        raise UnsupportedOptionError(f"unknown method '{name}'; choose one of: {', '.join(sorted(_METHODS))}")
    return _METHODS[name][0](context)


@register_method("ar", "plain autoregressive decoding through the same loop (the baseline)")
def _build_ar(context: MethodContext) -> tuple[Drafter, Verifier]:
    return NoDrafter(), RejectionSamplingVerifier()


@register_method("sps", "speculative sampling with a draft model (lossless)")
def _build_sps(context: MethodContext) -> tuple[Drafter, Verifier]:
    return ModelDrafter(context.draft_model(), context.config.num_draft_tokens), RejectionSamplingVerifier()


@register_method("pld", "prompt lookup: n-gram drafts copied from the context, adaptive length (lossless)")
def _build_pld(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    # Draft length starts at num_draft_tokens and doubles while whole drafts are accepted, up to
    # max_num_draft_tokens (docs/benchmarks.md has the side-by-side measurement that chose 4 -> 16).
    drafter = PromptLookupDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram,
                                  max(config.max_num_draft_tokens, config.num_draft_tokens))
    return drafter, RejectionSamplingVerifier()


# Modules that register more methods when imported. Each adds itself here.
_BUILTIN_METHOD_MODULES: list[str] = ["jointspec.methods_joint", "jointspec.drafters.oracle"]
_loaded = False


def _load_builtin_methods() -> None:
    global _loaded
    if _loaded:
        return
    import importlib

    for module in _BUILTIN_METHOD_MODULES:
        importlib.import_module(module)
    _loaded = True
