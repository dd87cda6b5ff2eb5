"""The lossless chain and tree methods built from lookup, a draft model or a trained head: ``ar`` (the baseline),
``sps``, ``pearl``, ``pld``, ``corpus``, ``hybrid`` and ``hybrid-tree``."""

from __future__ import annotations

from jointspec.core.draft import Drafter, NoDrafter
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.verdict import Verifier
from jointspec.drafters.corpus import CorpusLookupDrafter, shipped_table_for, table_for
from jointspec.drafters.costaware import CostAwareDrafter
from jointspec.drafters.dynamic_tree import DynamicTreeDrafter
from jointspec.drafters.hybrid import HybridDrafter
from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
from jointspec.drafters.model import ModelDrafter
from jointspec.drafters.ngram import PromptLookupDrafter
from jointspec.drafters.pearl import ParallelDrafter
from jointspec.drafters.tree import TreeDrafter
from jointspec.methods.costs import draft_cost_per_call, target_cost_curve
from jointspec.methods.registry import MethodConfig, MethodContext, register_method
from jointspec.methods.tree_width import top_w_hit_rate, tree_branching
from jointspec.verifiers.block import BlockVerifier
from jointspec.verifiers.rejection import RejectionSamplingVerifier
from jointspec.verifiers.tree import TreeRejectionVerifier


def chain_verifier(config: MethodConfig) -> Verifier:
    """Token-wise speculative sampling, or block verification (``--verify block``) of the same drafts: the same output
    law, more tokens kept per round where the draft rows differ from the target's."""
    return BlockVerifier() if config.verify == "block" else RejectionSamplingVerifier()


@register_method("ar", "plain autoregressive decoding through the same loop (the baseline)", lossless=True,
                 reads=())
def _build_ar(context: MethodContext) -> tuple[Drafter, Verifier]:
    return NoDrafter(), RejectionSamplingVerifier()


# sps and hybrid choose each round's length unless told otherwise (cost_aware=False): at a fixed 4 draft tokens with
# the shipped head they ran at 1.04x / 1.02x of plain sampling on the float32 target and 0.60x on the int4 one,
# cost-aware at 1.21x / 1.24x and 0.93x (docs/lab/benchmarks.md, section 14).
@register_method("sps", "speculative sampling with a draft model or trained head (lossless)",
                 lossless=True, cost_aware=True, cost_aware_by_default=True,
                 reads=("draft", "head_weights", "num_draft_tokens", "max_num_draft_tokens", "cost_aware", "verify"))
def _build_sps(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    # Cost-aware: the wrapper picks each round's length, so the drafter must be allowed the longest one.
    length = max(config.num_draft_tokens, config.max_num_draft_tokens) if config.cost_aware else config.num_draft_tokens
    return ModelDrafter(context.draft_model(), length), chain_verifier(config)


@register_method("pearl", "PEARL: the draft model or head drafts on while the target verifies (worker thread), one "
                 "token after a rejection, the drafted chain after a full acceptance (lossless)", lossless=True,
                 cost_aware=False, batched=False,  # its own thread would compete with a batch's forward for the cores
                 reads=("draft", "head_weights", "num_draft_tokens", "verify"))
def _build_pearl(context: MethodContext) -> tuple[Drafter, Verifier]:
    return ParallelDrafter(context.draft_model(), context.config.num_draft_tokens), chain_verifier(context.config)


@register_method("pld", "prompt lookup: n-gram drafts copied from the context, adaptive length (lossless)",
                 lossless=True, cost_aware=True, learns_online=True,
                 reads=("num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram", "cost_aware"))
def _build_pld(context: MethodContext) -> tuple[Drafter, Verifier]:
    # Draft length starts at num_draft_tokens and doubles while whole drafts are accepted, up to
    # max_num_draft_tokens (docs/lab/benchmarks.md has the side-by-side measurement that chose 4 -> 16).
    return _prompt_lookup(context), RejectionSamplingVerifier()


def _prompt_lookup(context: MethodContext) -> PromptLookupDrafter:
    config = context.config
    return PromptLookupDrafter(config.num_draft_tokens, config.max_ngram, config.min_ngram,
                               max(config.max_num_draft_tokens, config.num_draft_tokens), output_memory=context.memory)


@register_method("corpus", "prompt lookup, else an n-gram table of the target's own answers (--draft TABLE, default: "
                 "the one shipped for its tokenizer) (lossless)", lossless=True, cost_aware=True,
                 learns_online=True,
                 reads=("draft", "num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram", "cost_aware"))
def _build_corpus(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    table = (table_for(config.draft, context.tokenizer, context.target.vocab_size) if config.draft else
             shipped_corpus_table(context))
    if table is None:
        raise UnsupportedOptionError("method 'corpus' needs an n-gram table for this target's tokenizer and none is "
                                     "shipped for it: build one with `jointspec build-corpus --target ... --out DIR` "
                                     "and pass --draft DIR")
    return _corpus_lookup(context, table), RejectionSamplingVerifier()


def _corpus_lookup(context: MethodContext, table) -> Drafter:
    config = context.config
    # The context's matches come first from 2 tokens on; --max-ngram 1 asks for 1-token matches alone, --min-ngram
    # for longer ones only.
    min_context = max(min(2, config.max_ngram), config.min_ngram)
    return CorpusLookupDrafter(table, config.num_draft_tokens,
                               max(config.max_num_draft_tokens, config.num_draft_tokens), max_ngram=config.max_ngram,
                               min_context_ngram=min_context, output_memory=context.memory)


@register_method("hybrid", "prompt lookup when the context repeats, else the draft model or head (lossless)",
                 lossless=True, cost_aware=True, cost_aware_by_default=True, learns_online=True,
                 reads=("draft", "head_weights", "num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram",
                        "cost_aware", "verify"))
def _build_hybrid(context: MethodContext) -> tuple[Drafter, Verifier]:
    config = context.config
    length = max(config.num_draft_tokens, config.max_num_draft_tokens) if config.cost_aware else config.num_draft_tokens
    return HybridDrafter(_prompt_lookup(context), ModelDrafter(context.draft_model(), length)), chain_verifier(config)


@register_method("hybrid-tree", "prompt lookup where it beats a token tree from the draft, else the tree (--tree; "
                 "default: the draft's top 1-3 tokens); cost-aware (lossless)", lossless=True, cost_aware=True,
                 learns_online=True,
                 reads=("draft", "head_weights", "num_draft_tokens", "max_num_draft_tokens", "max_ngram", "min_ngram",
                        "tree", "tree_budget"), drafts_trees=True)
def _build_hybrid_tree(context: MethodContext) -> tuple[Drafter, Verifier]:
    return hybrid_tree(context)


def hybrid_tree(context: MethodContext, table=None) -> tuple[Drafter, Verifier]:
    """hybrid-tree; with an n-gram ``table`` (drafters/corpus.py) its lookup half drafts as ``corpus`` does."""

    config = context.config
    draft = context.draft_model()
    lookup = _corpus_lookup(context, table) if table is not None else _prompt_lookup(context)
    curve = target_cost_curve(context.target)
    aware_lookup = CostAwareDrafter(lookup, curve, max_num_draft_tokens=config.max_num_draft_tokens)
    eos = context.eos_token_ids()
    draft_cost = draft_cost_per_call(draft, target=context.target)
    if config.tree_budget:
        if config.tree is not None:
            raise UnsupportedOptionError("give either --tree (a static tree) or --tree-budget (a dynamic one), "
                                         "not both")
        tree = DynamicTreeDrafter(draft, config.tree_budget, eos_token_ids=eos)
    else:
        branching = tree_branching(config.tree, curve, draft_cost, top_w_hit_rate(config.draft))
        tree = TreeDrafter(draft, branching, replacement=True, eos_token_ids=eos)
    drafter = LookupOrTreeDrafter(aware_lookup, tree, curve, draft_cost_per_call=draft_cost)
    # Chains (lookup, one-hot drafts) and i.i.d. trees alike: recursive rejection is lossless for both.
    return drafter, TreeRejectionVerifier(replacement=True)


def shipped_corpus_table(context: MethodContext):
    """The n-gram table shipped for the target's tokenizer, loaded, or None."""
    folder = shipped_table_for(context.tokenizer)
    return None if folder is None else table_for(folder, context.tokenizer, context.target.vocab_size)
