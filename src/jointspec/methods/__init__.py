"""Decoding methods: each name builds a (drafter, verifier) pair for the one loop.

A method is registered with :func:`register_method`; nothing else in the library branches on method names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from jointspec.core.draft import Drafter, NoDrafter
from jointspec.drafters.model import ModelDrafter, check_same_vocabulary
from jointspec.drafters.ngram import PromptLookupDrafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.backends.hf import CausalLM
from jointspec.core.verdict import Verifier
from jointspec.verifiers.rejection import RejectionSamplingVerifier

log = logging.getLogger(__name__)


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
    tree: tuple[int, ...] | None = None  # None: the method's own (hybrid-tree: default_tree_width, specinfer: 4,2,2)
    tree_budget: int = 0  # hybrid-tree: > 0 drafts a dynamic tree of this many nodes instead (greedy only)
    cost_aware: bool = False  # choose each round's draft length (or none) from the target's measured cost curve
    head_weights: str = "auto"  # a trained EAGLE head's weights: auto / float32 / int8 (drafts/eagle.py)

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
        if self.tree is not None and (not self.tree or any(k < 1 for k in self.tree)):
            raise ValueError(f"tree must be a non-empty list of branching factors >= 1, got {self.tree}")
        if self.tree_budget < 0:
            raise ValueError(f"tree_budget must be >= 0 (0: the static tree), got {self.tree_budget}")
        from jointspec.drafts.artifact import HEAD_WEIGHT_CHOICES

        if self.head_weights not in HEAD_WEIGHT_CHOICES:
            raise ValueError(f"head_weights must be one of {', '.join(HEAD_WEIGHT_CHOICES)}, got "
                             f"'{self.head_weights}'")


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
            if hasattr(self.target, "fork"):  # a llama.cpp target: a second context over the same weights
                return self.target.fork(f"{self.target.name} (self-draft)")
            return CausalLM(self.target.model, name=f"{self.target.name} (self-draft)",
                            lean=self.target.lean is not None)
        from jointspec.drafts.registry import bind_trained_draft
        from jointspec.drafts.artifact import is_head_artifact

        if is_head_artifact(self.config.draft):  # a draft from `jointspec train-draft`: bound to this target
            return bind_trained_draft(self.config.draft, self.target, self.config.head_weights)
        draft, draft_tokenizer = self.load_draft(self.config.draft)
        check_same_vocabulary(self.tokenizer, draft_tokenizer, self.target, draft)
        return draft


Builder = Callable[[MethodContext], tuple[Drafter, Verifier]]
_METHODS: dict[str, tuple[Builder, str, bool]] = {}


def register_method(name: str, summary: str, cost_aware: bool = False) -> Callable[[Builder], Builder]:
    """Register a builder. ``cost_aware``: its drafter drafts chains, so ``MethodConfig.cost_aware`` may wrap it."""
    def decorate(builder: Builder) -> Builder:
        _METHODS[name] = (builder, summary, cost_aware)
        return builder
    return decorate


def method_names() -> list[str]:
    _load_builtin_methods()
    return sorted(_METHODS)


def method_summaries() -> dict[str, str]:
    _load_builtin_methods()
    return {name: summary for name, (_, summary, _) in sorted(_METHODS.items())}


def build_method(context: MethodContext) -> tuple[Drafter, Verifier]:
    _load_builtin_methods()
    name = context.config.name
    if name not in _METHODS:
        raise UnsupportedOptionError(f"unknown method '{name}'; choose one of: {', '.join(sorted(_METHODS))}")
    builder, _, cost_aware_ok = _METHODS[name]
    if context.config.cost_aware and not cost_aware_ok:
        cost_aware = sorted(n for n, entry in _METHODS.items() if entry[2])
        raise UnsupportedOptionError(f"method '{name}' cannot be made cost-aware (it drafts trees or measures the "
                                     f"loop itself); cost-aware methods: {', '.join(cost_aware)}")
    drafter, verifier = builder(context)
    # A drafter that already weighs drafting against the cost curve ("default" builds one) is not wrapped again.
    if context.config.cost_aware and not getattr(drafter, "cost_aware", False):
        drafter = make_cost_aware(drafter, context)
    return drafter, verifier


def target_cost_curve(target: CausalLM):
    """The target's measured cost curve (memoised per model: a few seconds once)."""
    from jointspec.drafters.costaware import DEFAULT_SIZES, measure_cost_curve

    # Verification, and so its cost, runs on a llama.cpp adapter's exact context; an `ar` decode leaves the plain one.
    if getattr(target, "plain", False):
        target.reset()
    # A model with a short context (tiny test models) is measured on the sizes that fit; the curve extrapolates.
    room = getattr(target, "max_context", 1 << 30) - target.num_cached
    return measure_cost_curve(target, sizes=tuple(n for n in DEFAULT_SIZES if n < room) or (1,))


def draft_cost_per_call(draft: CausalLM) -> float:
    """Seconds of one 1-token forward of a draft model or head (memoised per model, like the target's curve)."""
    from jointspec.drafters.costaware import measure_cost_curve

    return measure_cost_curve(draft, sizes=(1, 2), repeats=5).cost(1)


def make_cost_aware(drafter: Drafter, context: MethodContext) -> Drafter:
    """Wrap a chain drafter so each round drafts the length the target's measured cost curve says pays, or none.

    The curve is measured once per target model (a few seconds, memoised); a model drafter's per-token cost is its
    own one-token forward, prompt lookup's is zero.
    """
    from jointspec.drafters.costaware import CostAwareDrafter

    curve = target_cost_curve(context.target)
    draft = getattr(drafter, "draft", None)
    if draft is not None:
        curve = curve.with_draft_cost(draft_cost_per_call(draft))
    return CostAwareDrafter(drafter, curve, max_num_draft_tokens=context.config.max_num_draft_tokens)


@register_method("ar", "plain autoregressive decoding through the same loop (the baseline)")
def _build_ar(context: MethodContext) -> tuple[Drafter, Verifier]:
    return NoDrafter(), RejectionSamplingVerifier()


@register_method("sps", "speculative sampling with a draft model or trained head (lossless)", cost_aware=True)
def _build_sps(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    # Cost-aware: the wrapper picks each round's length, so the drafter must be allowed the longest one.
    length = max(config.num_draft_tokens, config.max_num_draft_tokens) if config.cost_aware else config.num_draft_tokens
    return ModelDrafter(context.draft_model(), length), RejectionSamplingVerifier()


@register_method("pld", "prompt lookup: n-gram drafts copied from the context, adaptive length (lossless)",
                 cost_aware=True)
def _build_pld(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    # Draft length starts at num_draft_tokens and doubles while whole drafts are accepted, up to
    # max_num_draft_tokens (docs/lab/benchmarks.md has the side-by-side measurement that chose 4 -> 16).
    drafter = PromptLookupDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram,
                                  max(config.max_num_draft_tokens, config.num_draft_tokens))
    return drafter, RejectionSamplingVerifier()


@register_method("corpus", "prompt lookup, else the continuation an n-gram table of the target's own answers makes "
                 "most likely (--draft TABLE_FOLDER from `build-corpus`; default: the table shipped for the target's "
                 "tokenizer), adaptive length (lossless)", cost_aware=True)
def _build_corpus(context: MethodContext) -> tuple[Drafter, Verifier]:
    from jointspec.drafters.corpus import table_for

    config = context.config
    table = (table_for(config.draft, context.tokenizer, context.target.vocab_size) if config.draft else
             shipped_corpus_table(context))
    if table is None:
        raise UnsupportedOptionError("method 'corpus' needs an n-gram table for this target's tokenizer and none is "
                                     "shipped for it: build one with `jointspec build-corpus --target ... --out DIR` "
                                     "and pass --draft DIR")
    return _corpus_lookup(config, table), RejectionSamplingVerifier()


def _corpus_lookup(config: MethodConfig, table) -> Drafter:
    from jointspec.drafters.corpus import CorpusLookupDrafter

    return CorpusLookupDrafter(table, config.num_draft_tokens,
                               max(config.max_num_draft_tokens, config.num_draft_tokens), max_ngram=config.max_ngram)


@register_method("hybrid", "prompt lookup when the context repeats, else the draft model or head (lossless)",
                 cost_aware=True)
def _build_hybrid(context: MethodContext) -> tuple[Drafter, Verifier]:
    from jointspec.drafters.hybrid import HybridDrafter

    config = context.config
    length = max(config.num_draft_tokens, config.max_num_draft_tokens) if config.cost_aware else config.num_draft_tokens
    lookup = PromptLookupDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram,
                                 max(config.max_num_draft_tokens, config.num_draft_tokens))
    return HybridDrafter(lookup, ModelDrafter(context.draft_model(), length)), RejectionSamplingVerifier()


@register_method("hybrid-tree", "prompt lookup where it beats a token tree from the draft model or head, else the "
                 "tree (--tree; default: the draft's top 1-3 next tokens, as many as the target's measured cost curve "
                 "pays for); always cost-aware (lossless)", cost_aware=True)
def _build_hybrid_tree(context: MethodContext) -> tuple[Drafter, Verifier]:
    return _hybrid_tree(context)


def _hybrid_tree(context: MethodContext, table=None) -> tuple[Drafter, Verifier]:
    """hybrid-tree; with an n-gram ``table`` (drafters/corpus.py) its lookup half drafts as ``corpus`` does."""
    from jointspec.backends.tokens import eos_token_ids
    from jointspec.drafters.costaware import CostAwareDrafter
    from jointspec.drafters.dynamic_tree import DynamicTreeDrafter
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafters.tree import TreeDrafter
    from jointspec.verifiers.tree import TreeRejectionVerifier

    config = context.config
    draft = context.draft_model()
    lookup = (_corpus_lookup(config, table) if table is not None else
              PromptLookupDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram,
                                  max(config.max_num_draft_tokens, config.num_draft_tokens)))
    curve = target_cost_curve(context.target)
    aware_lookup = CostAwareDrafter(lookup, curve, max_num_draft_tokens=config.max_num_draft_tokens)
    eos = eos_token_ids(context.target, context.tokenizer)
    draft_cost = draft_cost_per_call(draft)
    if config.tree_budget:
        if config.tree is not None:
            raise UnsupportedOptionError("give either --tree (a static tree) or --tree-budget (a dynamic one), "
                                         "not both")
        tree = DynamicTreeDrafter(draft, config.tree_budget, eos_token_ids=eos)
    else:
        branching = config.tree or (default_tree_width(curve, draft_cost),)
        tree = TreeDrafter(draft, branching, replacement=True, eos_token_ids=eos)
    drafter = LookupOrTreeDrafter(aware_lookup, tree, curve, draft_cost_per_call=draft_cost)
    # Chains (lookup, one-hot drafts) and i.i.d. trees alike: recursive rejection is lossless for both.
    return drafter, TreeRejectionVerifier(replacement=True)


# The tree `hybrid-tree` (and so `default`) drafts unless --tree says otherwise: the draft's top w next tokens, one
# level, verified with the pending token as a (w + 1)-token forward. Which w pays depends on the target's cost curve:
# on the AMD machine's oneDNN kernels a 4-token forward costs about one step and w = 3 wins; on an Intel Xeon with
# PyTorch's kernels it costs 1.57x a step and w = 2 ran 1.20x over `ar` where w = 3 ran 1.11x (docs/lab/benchmarks.md).
# The chance that the top w hold the target's next token, measured for the shipped (stage-5) SmolLM2 head,
# teacher-forced on the target's MT-Bench answers (24 prompts, 2,950 tokens; scripts/head_agreement.py): top 1 / 2 / 3
# = 44.2 / 57.3 / 63.4 % (the stage-4 head: 40.9 / 55.2 / 62.7 %). Other drafts get the same prior (a better draft
# shifts all three up, which moves the choice little).
TOP_W_HIT_RATE = {1: 0.442, 2: 0.573, 3: 0.634}


def default_tree_width(curve, draft_cost: float) -> int:
    """The width w of the one-level tree that gives the most tokens per unit of cost on ``curve``: a round costs a
    (w + 1)-token target forward plus one draft call and yields 1 + P(the target's token is in the top w)."""
    return max(TOP_W_HIT_RATE, key=lambda w: (1 + TOP_W_HIT_RATE[w]) / (curve.cost(w + 1) + draft_cost))


def expected_tree_gain(curve, draft_cost: float) -> float:
    """The rate of the :func:`default_tree_width` tree relative to plain decoding, by the same prior: tokens per
    round over a round's cost, in plain steps."""
    width = default_tree_width(curve, draft_cost)
    return (1 + TOP_W_HIT_RATE[width]) * curve.cost(1) / (curve.cost(width + 1) + draft_cost)


def shipped_corpus_table(context: MethodContext):
    """The n-gram table shipped for the target's tokenizer, loaded, or None."""
    from jointspec.drafters.corpus import shipped_table_for, table_for

    folder = shipped_table_for(context.tokenizer)
    return None if folder is None else table_for(folder, context.tokenizer, context.target.vocab_size)


# Below this expected gain `default` leaves the head out and drafts by cost-aware lookup alone. Measured on the
# embedded SmolLM2 (2-core Xeon with AMX, docs/lab/benchmarks.md section 5): on its int4 model (a 4-token forward 1.37x
# a step, a head call 16 % of one) the head's tree was expected at about 1.10x (1.13x with the stage-5 head) and ran
# no faster than lookup alone in four runs of 14 to 28 prompts (within 1-4 %, lookup ahead in every set); on float32
# it is expected at about 1.35x and pays (1.45x over `ar` on MT-Bench with it).
MIN_TREE_GAIN = 1.15


@register_method("default", "the fastest exact configuration for this target: hybrid-tree (lookup, else the top 1-3 "
                 "tokens of the head shipped for it, as many as the measured cost curve pays for; the embedded SmolLM2 "
                 "has one; its lookup drafts as corpus where a table is shipped), else (no head, or a tree not "
                 "expected to pay on this target's cost curve, as on the int4 model) cost-aware lookup: corpus where "
                 "an n-gram table is shipped for the target's tokenizer (the embedded SmolLM2 has one), else pld",
                 cost_aware=True)
def _build_default(context: MethodContext) -> tuple[Drafter, Verifier]:
    from dataclasses import replace

    from jointspec.drafts.artifact import shipped_head_for

    from jointspec.drafters.corpus import shipped_table_for

    def lookup() -> MethodConfig:
        """Cost-aware lookup: with the n-gram table shipped for the target's tokenizer where there is one (corpus),
        else prompt lookup alone (pld)."""
        table = shipped_table_for(context.tokenizer) if context.config.draft is None else None
        return replace(context.config, name="corpus" if table is not None else "pld", cost_aware=True)

    # Only the torch adapter verifies trees and feeds heads (llama.cpp's refuses trees and has no hidden states).
    torch_target = isinstance(context.target, CausalLM)
    head = context.config.draft
    if head is None and torch_target:
        head = shipped_head_for(context.target)
    if head is None:
        config = lookup()
    elif not torch_target:
        config = replace(context.config, name="hybrid", draft=str(head), cost_aware=True)
    else:
        config = replace(context.config, name="hybrid-tree", draft=str(head), cost_aware=False)
        # Its lookup half drafts as `corpus` where a table is shipped for the tokenizer: on the float32 SmolLM2,
        # 1.44x over `ar` on MT-Bench against 1.38x with prompt lookup alone (docs/lab/benchmarks.md, section 5).
        drafter, verifier = _hybrid_tree(MethodContext(config, context.target, context.tokenizer, context.load_draft),
                                         table=shipped_corpus_table(context))
        if context.config.draft is not None or context.config.tree or context.config.tree_budget:
            return drafter, verifier  # a draft or a tree asked for: keep them
        draft = drafter.draft
        gain = expected_tree_gain(drafter.curve, draft_cost_per_call(draft))
        if gain >= MIN_TREE_GAIN:
            return drafter, verifier
        log.info("default: the head's tree is expected at %.2fx of plain decoding on this target (under %.2fx): "
                 "drafting by cost-aware lookup alone", gain, MIN_TREE_GAIN)
        if hasattr(draft, "mirror"):
            context.target.detach_feature_mirror(draft.mirror)
        config = lookup()
    return build_method(MethodContext(config, context.target, context.tokenizer, context.load_draft))


# Modules that register more methods when imported. Each adds itself here.
_BUILTIN_METHOD_MODULES: list[str] = ["jointspec.methods.joint", "jointspec.drafters.oracle"]
_loaded = False


def _load_builtin_methods() -> None:
    global _loaded
    if _loaded:
        return
    import importlib

    for module in _BUILTIN_METHOD_MODULES:
        importlib.import_module(module)
    _loaded = True
