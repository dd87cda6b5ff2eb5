"""The method registry: each name builds a (drafter, verifier) pair for the one loop.

A method is registered with :func:`register_method`; nothing else in the library branches on method names. Importing
:mod:`jointspec.methods` registers every built-in method.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from jointspec.backends.tokens import eos_token_ids
from jointspec.core.draft import Drafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.target import TargetLM
from jointspec.core.verdict import VERIFY_CHOICES, Verifier
from jointspec.drafters.corpus import CONFIG_FILE as TABLE_CONFIG_FILE
from jointspec.drafters.memory import OutputMemory
from jointspec.drafters.model import check_same_vocabulary
from jointspec.drafts.artifact import HEAD_WEIGHT_CHOICES, is_head_artifact, shipped_head_for
from jointspec.drafts.registry import bind_trained_draft
from jointspec.methods.costs import make_cost_aware
from jointspec.verifiers.block import BlockVerifier
from jointspec.verifiers.traversal import TraversalVerifier

log = logging.getLogger(__name__)


# The most nodes a static tree may have: far past what any round verifies (a CPU round: 255 draft tokens), so that a
# mistyped tree is refused before a drafter builds millions of nodes.
MAX_TREE_NODES = 4096


def tree_nodes(branching) -> int:
    """Nodes of a static tree with these branching factors per depth, b1 + b1*b2 + ...; past MAX_TREE_NODES the count
    stops (any number above it is refused alike)."""
    total, level = 0, 1
    for width in branching:
        level *= int(width)
        total += level
        if total > MAX_TREE_NODES:
            break
    return total


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
    # None: the method's own (tree_width.tree_branching; specinfer with --no-cost-aware: 4,2,2)
    tree: tuple[int, ...] | None = None
    tree_budget: int = 0  # hybrid-tree: > 0 drafts a dynamic tree of this many nodes instead (greedy only)
    # Choose each round's draft length (or none) from the target's measured cost curve. None: the method's own default
    # (register_method's cost_aware_by_default), which build_method resolves to True or False before a builder runs.
    cost_aware: bool | None = None
    head_weights: str = "auto"  # a trained EAGLE head's weights: auto / float32 / int8 (drafts/eagle.py)
    # chains with draft rows: token-wise speculative sampling or block verification; sampled trees: recursive rejection
    # ("token") or traversal verification
    verify: str = "token"

    def __post_init__(self) -> None:
        # Types first: a 2.5-token draft or a string threshold passed here used to fail at generate time, deep in a
        # drafter, with Python's own message.
        for name in ("num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram", "beam_width", "tree_budget"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if isinstance(self.accept_threshold, bool) or not isinstance(self.accept_threshold, numbers.Real):
            raise TypeError(f"accept_threshold must be a number, got {self.accept_threshold!r}")
        if self.cost_aware is not None and not isinstance(self.cost_aware, bool):
            raise TypeError(f"cost_aware must be true, false or None, got {self.cost_aware!r}")
        if self.tree is not None and (isinstance(self.tree, str | bytes) or not hasattr(self.tree, "__iter__")
                                      or not all(isinstance(k, numbers.Integral) and not isinstance(k, bool)
                                                 for k in self.tree)):
            raise TypeError(f"tree must be a list of ints (branching factors), got {self.tree!r}")
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
        if self.tree is not None and tree_nodes(self.tree) > MAX_TREE_NODES:
            # Checked here: a drafter builds the whole tree before the loop can refuse its verification.
            raise ValueError(f"tree {','.join(map(str, self.tree))} has over {MAX_TREE_NODES} nodes; at most "
                             f"{MAX_TREE_NODES} (a CPU round verifies at most 255)")
        if self.tree_budget < 0:
            raise ValueError(f"tree_budget must be >= 0 (0: the static tree), got {self.tree_budget}")
        if self.verify not in VERIFY_CHOICES:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_CHOICES)}, got '{self.verify}'")
        if self.head_weights not in HEAD_WEIGHT_CHOICES:
            raise ValueError(f"head_weights must be one of {', '.join(HEAD_WEIGHT_CHOICES)}, got "
                             f"'{self.head_weights}'")


@dataclass
class MethodContext:
    """What a method builder may use: the target, its tokenizer, a way to load the draft model, and the target's
    earlier answers to copy from (``memory``: online adaptation, for the methods registered ``learns_online``)."""

    config: MethodConfig
    target: TargetLM
    tokenizer: object | None
    load_draft: Callable[[str], tuple[TargetLM, object | None]]
    memory: OutputMemory | None = None

    def draft_model(self) -> TargetLM:
        """The draft model named by ``config.draft`` (required), checked against the target's vocabulary."""
        if self.config.draft is None:
            # The head shipped for the target where there is one (heads read the target's hidden states).
            features = self.target.capabilities.features
            head = shipped_head_for(self.target) if features else None
            if head is None:
                why = ("no draft head ships for target" if features else
                       "a draft head reads the target's hidden states, which this backend does not expose, for target")
                raise UnsupportedOptionError(f"method '{self.config.name}' needs a draft model and {why} "
                                             f"'{self.target.name}': pass --draft PATH (or --draft "
                                             "self to use the target as its own draft; in a request to `jointspec "
                                             "serve`, \"draft\": \"self\" or the server's --draft)")
            log.info("method %s: drafting with the head shipped for the target (%s); --draft chooses another",
                     self.config.name, head)
            return bind_trained_draft(str(head), self.target, self.config.head_weights)
        if self.config.draft == "self":
            if not self.target.capabilities.fork:
                raise UnsupportedOptionError(f"target '{self.target.name}' cannot open a second cache over its "
                                             "weights, so it cannot be its own draft: pass --draft PATH")
            return self.target.fork(f"{self.target.name} (self-draft)")
        if is_head_artifact(self.config.draft):  # a draft from `jointspec train-draft`: bound to this target
            if not self.target.capabilities.features:
                raise UnsupportedOptionError(
                    f"'{self.config.draft}' is a trained draft (`jointspec train-draft`): it is bound to the target's "
                    f"weights and hidden states, which target '{self.target.name}' does not expose (neither the "
                    "llama.cpp backend nor --attention specpc does); use --backend torch, or draft with a model "
                    "(--draft a model folder or .gguf, or --draft self)")
            return bind_trained_draft(self.config.draft, self.target, self.config.head_weights)
        if (Path(self.config.draft).expanduser() / TABLE_CONFIG_FILE).is_file():
            raise UnsupportedOptionError(f"'{self.config.draft}' is an n-gram table (`jointspec build-corpus`), not "
                                         f"a draft model: method '{self.config.name}' drafts with a model or head; "
                                         "a table goes with --method corpus --draft DIR")
        draft, draft_tokenizer = self.load_draft(self.config.draft)
        check_same_vocabulary(self.tokenizer, draft_tokenizer, self.target, draft)
        return draft

    def eos_token_ids(self) -> frozenset[int]:
        """EOS ids the drafters must not expand past: the same set the loop stops at."""
        return eos_token_ids(self.target, self.tokenizer)


Builder = Callable[[MethodContext], tuple[Drafter, Verifier]]


@dataclass(frozen=True)
class MethodEntry:
    builder: Builder
    summary: str
    lossless: bool  # greedy output equals plain decoding's; samples follow the target's law (tests prove each)
    cost_aware: bool  # drafts chains, so ``MethodConfig.cost_aware`` may wrap its drafter
    learns_online: bool = False  # its drafters copy from ``MethodContext.memory`` (drafters/memory.py)
    cost_aware_by_default: bool = False  # what ``MethodConfig.cost_aware = None`` means for it
    reads: frozenset[str] = frozenset()  # the MethodConfig fields it reads (tests/test_methods.py records them)
    batched: bool = True  # whether `serve` may batch it (an engine may still refuse it for its target or draft)
    drafts_trees: bool = False  # its drafts may branch: its target must score trees (TargetCapabilities.trees)


_METHODS: dict[str, MethodEntry] = {}


def register_method(name: str, summary: str, *, lossless: bool, reads: tuple[str, ...], cost_aware: bool = False,
                    learns_online: bool = False, cost_aware_by_default: bool = False,
                    batched: bool = True, drafts_trees: bool = False) -> Callable[[Builder], Builder]:
    """Register a builder under ``name``: a one-line ``summary``, whether the method is ``lossless``, the
    :class:`MethodConfig` fields it ``reads`` (a setting of any other is refused where a user gives it, not ignored),
    whether it may be made ``cost_aware`` (and is unless told otherwise: ``cost_aware_by_default``), whether it
    drafts from a memory of earlier answers (``learns_online``), whether the server may batch it (``batched``), and
    whether its drafts may branch (``drafts_trees``: refused on a target that scores chains only)."""
    if cost_aware_by_default and not cost_aware:
        raise ValueError(f"method '{name}' cannot be cost-aware by default without being cost-aware")
    if "cost_aware" in reads and not cost_aware:
        raise ValueError(f"method '{name}' reads cost_aware but cannot be made cost-aware")

    def decorate(builder: Builder) -> Builder:
        _METHODS[name] = MethodEntry(builder, summary, lossless, cost_aware, learns_online, cost_aware_by_default,
                                     frozenset(reads), batched, drafts_trees)
        return builder
    return decorate


def method_reads(name: str) -> frozenset[str]:
    """The settings method ``name`` reads (:class:`MethodConfig` fields, and its own config class's)."""
    return _METHODS[name].reads


def options_set(config: MethodConfig) -> list[str]:
    """The fields of ``config`` that differ from their defaults: what a user set (the CLI's defaults are these)."""
    return [field.name for field in fields(config)
            if field.name != "name" and getattr(config, field.name) != field.default]


def unread_options_error(name: str, options: list[str], spell=lambda option: option) -> str | None:
    """The refusal for settings ``options`` that method ``name`` does not read (None where it reads them all), each
    named as ``spell`` writes it (a CLI flag, a request's key)."""
    unread = [option for option in options if option not in _METHODS[name].reads]
    if not unread:
        return None
    reads = sorted(_METHODS[name].reads)
    return (f"method '{name}' does not read {', '.join(spell(option) for option in unread)}, so it would be "
            f"ignored; {name} reads {', '.join(spell(option) for option in reads) if reads else 'no method options'}"
            " (`jointspec methods` lists what each method is)")


def method_names() -> list[str]:
    return sorted(_METHODS)


# Systems of the family that are not built, and why: asking for one says so instead of "unknown method".
NOT_BUILT: dict[str, str] = {}


def unknown_method_error(name: str, choices: list[str] | None = None) -> str:
    """The message for a method name that is not registered: why, for a system not built; else the ``choices``
    (default: every registered method)."""
    if name in NOT_BUILT:
        return f"method '{name}': {NOT_BUILT[name]}"
    return f"unknown method '{name}'; choose one of: {', '.join(sorted(_METHODS) if choices is None else choices)}"


def batched_methods() -> list[str]:
    """The methods the server may batch (each engine may still refuse one for its target or draft, saying why)."""
    return sorted(name for name, entry in _METHODS.items() if entry.batched)


def method_is_batched(name: str) -> bool:
    """Whether the server may batch method ``name`` (False for a name not registered)."""
    entry = _METHODS.get(name)
    return entry is not None and entry.batched


def method_summaries() -> dict[str, str]:
    return {name: entry.summary for name, entry in sorted(_METHODS.items())}


def lossless_methods() -> list[str]:
    """The methods registered as lossless: the equivalence and bench tests hold every one of them to plain decoding."""
    return sorted(name for name, entry in _METHODS.items() if entry.lossless)


def method_is_lossless(name: str) -> bool:
    """Whether method ``name`` is registered as lossless (False for a name not registered)."""
    entry = _METHODS.get(name)
    return entry is not None and entry.lossless


def resolved_cost_aware(config: MethodConfig) -> bool:
    """Whether ``config``'s drafts are chosen by the cost curve: as asked, else the method's own default; `default`
    and `hybrid-tree` weigh every draft against the curve whatever is asked."""
    entry = _METHODS.get(config.name)
    if entry is None:
        return False
    if config.name in ("default", "hybrid-tree"):
        return True
    return entry.cost_aware_by_default if config.cost_aware is None else config.cost_aware and entry.cost_aware


def cost_aware_by_default() -> list[str]:
    """The methods that choose their draft lengths from the cost curve unless told ``cost_aware=False``."""
    return [name for name, entry in _METHODS.items() if entry.cost_aware_by_default]


def online_methods() -> list[str]:
    """The methods whose drafters copy from a memory of the target's earlier answers."""
    return sorted(name for name, entry in _METHODS.items() if entry.learns_online)


def build_method(context: MethodContext) -> tuple[Drafter, Verifier]:
    name = context.config.name
    if name not in _METHODS:
        raise UnsupportedOptionError(unknown_method_error(name))
    entry = _METHODS[name]
    if context.config.cost_aware is None:
        context = replace(context, config=replace(context.config, cost_aware=entry.cost_aware_by_default))
    if context.config.cost_aware and not entry.cost_aware:
        cost_aware = sorted(n for n, other in _METHODS.items() if other.cost_aware)
        raise UnsupportedOptionError(f"method '{name}' cannot be made cost-aware (it drafts trees or measures the "
                                     f"loop itself); cost-aware methods: {', '.join(cost_aware)}")
    if entry.drafts_trees and not context.target.capabilities.trees:
        why = context.target.capabilities.chains_only or "this backend"
        raise UnsupportedOptionError(f"method '{name}' drafts token trees, and target '{context.target.name}' scores "
                                     f"chains only ({why}); use a chain method such as pld, corpus, sps, hybrid or "
                                     "default (which drafts chains there)")
    if context.memory is not None and not entry.learns_online:
        raise UnsupportedOptionError(f"method '{name}' does not draft from earlier answers; methods that learn "
                                     f"online: {', '.join(online_methods())}")
    drafter, verifier = entry.builder(context)
    if context.config.verify == "block" and not isinstance(verifier, BlockVerifier):
        raise UnsupportedOptionError(f"method '{name}' has no block verification; it is for chain methods whose "
                                     "drafts carry their probabilities: sps, hybrid, pearl and sparse-self "
                                     "(--verify block)")
    if context.config.verify == "traversal" and not isinstance(verifier, TraversalVerifier):
        raise UnsupportedOptionError(f"method '{name}' has no traversal verification; it is for sampled token "
                                     "trees: specinfer (--verify traversal)")
    # A drafter that already weighs drafting against the cost curve ("default" builds one) is not wrapped again.
    if context.config.cost_aware and not getattr(drafter, "cost_aware", False):
        drafter = make_cost_aware(drafter, context.target, context.config.max_num_draft_tokens)
    return drafter, verifier
