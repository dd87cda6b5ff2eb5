"""Lossy and opt-in: a target that reads only the part of a long prompt a cheap scorer's attention points to
(SpecPC-style prompt compression; :class:`PromptCompressedTarget`).

SpecPC (Galim et al., 2025, "Draft-based Approximate Inference for LLMs", the second of its two methods) drops
prompt tokens before the target reads them: a small draft model reads the whole prompt, and the attention that its
last queries pay each input position says which tokens the answer will need; the target then reads only those. Unlike
SpecKV (drafters/speckv.py), which chooses after the target has read everything, this also saves most of the
target's prefill: the time to the first token falls with the prompt, and every later step attends to a short cache.

Here, when a prompt of at least ``min_context`` tokens is read into an empty cache:

1. the scorer reads the prompt but its last ``window`` tokens. By default the scorer is the target's own leading
   decoder layers, ``scorer_layers`` of them (a quarter unless set; :func:`leading_layers`: a view of the same
   weights, costing that share of a prefill and no weight memory); any model of the same tokenizer that reports its
   attention will do (a smaller model of the family, as the paper uses);
2. the scores: the attention those last ``window`` tokens pay each earlier position, in every scorer layer and query
   head, reduced over them and widened as SpecKV's are (:func:`~jointspec.drafters.speckv.select_positions`);
3. the target reads, as a prompt of its own, the first ``sinks`` tokens, the best-scored others and the last
   ``window`` tokens, ``capacity`` in all, at consecutive positions: the rotary positions of what follows continue
   from the end of the compressed prompt, which the target sees as a plain (shorter) text.

Every later forward sees the compressed prompt and everything after it, so on this approximate target a speculative
method's greedy output equals plain decoding's. The loop keeps counting in the full prompt's positions (the wrapper
maps them to the cache's), so the stop rules, the length limit and lookup drafters read the whole prompt as before.
Drafts that read the target's features (trained heads) are refused: their positions are no longer the cache's.

Why the scorer is the target's first layers by default: the embedded model is the smallest of its family, so no
smaller model with its tokenizer ships; GemFilter (Shi et al., 2024, "Discovering the Gems in Early Layers") selects
input tokens by an early layer's attention the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.target import ForwardOutput, TargetCapabilities, TargetLM
from jointspec.drafters.sparse_self import WrappedTarget
from jointspec.drafters.speckv import select_positions


@dataclass(frozen=True)
class PromptCompression:
    """What :class:`PromptCompressedTarget` keeps of a long prompt and how it chooses (module docstring). The default
    capacity equals what SpecKV's selection and the sparse view keep (16 + 1,024 + 4 x 64 positions), so the three
    approximate modes compare at one budget."""

    capacity: int = 1296
    sinks: int = 16
    window: int = 32  # the last prompt tokens: always kept, and their queries score the others
    pool: int = 7  # odd: a kept position brings pool // 2 neighbours on each side
    reduce: str = "mean"  # over layers and heads: "mean" or "max"
    # The target's leading layers that score, where no scorer model is given (None: a quarter of them, rounded up:
    # 8 of SmolLM2-135M's 30).
    scorer_layers: int | None = None
    min_context: int = 2048

    def __post_init__(self) -> None:
        for name in ("capacity", "window", "pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.scorer_layers is not None and self.scorer_layers < 1:
            raise ValueError(f"scorer_layers must be >= 1 or None, got {self.scorer_layers}")
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")
        if self.pool % 2 == 0:
            raise ValueError(f"pool must be odd, got {self.pool}")
        if self.reduce not in ("mean", "max"):
            raise ValueError(f"reduce must be 'mean' or 'max', got {self.reduce!r}")
        if self.sinks + self.window >= self.capacity:
            raise ValueError(f"sinks + window ({self.sinks} + {self.window}) must be below capacity {self.capacity}, "
                             "leaving room for the tokens the scores choose")
        if self.min_context <= self.capacity:
            raise ValueError(f"min_context ({self.min_context}) must exceed capacity ({self.capacity}): a prompt "
                             "that fits the capacity is read whole")


def leading_layers(target, count: int):
    """A :class:`~jointspec.backends.hf.CausalLM` over the first ``count`` decoder layers of ``target``'s model and
    its own cache: the same weight objects (nothing is copied but the module containers and the config), so it costs
    ``count`` layers' share of a forward. Its logits mean little (the final norm and head follow an early layer); it
    is for reading attention (:meth:`~jointspec.backends.hf.CausalLM.attention_mass`)."""
    from jointspec.backends.hf import CausalLM

    model = target.model
    total = model.config.num_hidden_layers
    if not 1 <= count <= total:
        raise ValueError(f"the scorer's layers must be 1..{total} (the target's decoder layers), got {count}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:count]
    base = copy.copy(model.model)
    base._modules = dict(base._modules)  # a shallow module copy would share its children's dict with the original
    base.config = config
    base.layers = nn.ModuleList(list(model.model.layers)[:count])
    top = copy.copy(model)
    top._modules = dict(top._modules)
    top.config = config
    top.model = base
    return CausalLM(top, f"{target.name} (first {count} of {total} layers)")


class PromptCompressedTarget(WrappedTarget):
    """An approximate target for long inputs: ``inner`` reading, of a long prompt, only the tokens ``scorer``'s
    attention selects (module docstring). Not lossless, never a default: ``generate --attention specpc``, the bench
    spec option ``attention=specpc``, or by wrapping a target in Python. ``scorer``: a model of the same tokenizer
    that reports its attention (None: ``inner``'s leading layers, ``compression.scorer_layers`` of them, which needs
    the torch backend on a Llama-family model)."""

    def __init__(self, inner: TargetLM, compression: PromptCompression = PromptCompression(), scorer=None,
                 name: str | None = None) -> None:
        if scorer is None:
            if not getattr(inner, "reads_attention", False):
                raise UnsupportedOptionError(f"target '{inner.name}' cannot report its attention; SpecPC-style prompt "
                                             "compression needs the torch backend on a Llama-family model")
            layers = compression.scorer_layers or math.ceil(inner.model.config.num_hidden_layers / 4)
            scorer = leading_layers(inner, layers)
        elif not getattr(scorer, "reads_attention", False):
            raise UnsupportedOptionError(f"the scorer '{scorer.name}' cannot report its attention; give a "
                                         "Llama-family model on the torch backend")
        if scorer.vocab_size != inner.vocab_size:
            raise UnsupportedOptionError(f"the scorer's vocabulary ({scorer.vocab_size}) is not the target's "
                                         f"({inner.vocab_size}): it must read the same token ids")
        self.inner = inner
        self.compression = compression
        self.scorer = scorer
        self.name = name or f"{inner.name} (SpecPC-style prompt)"
        self._tokens: list[int] = []  # every id fed, in the loop's positions
        self._dropped = 0  # prompt tokens the inner target never read
        self._prompt_end = 0  # where the compressed prompt ends, in the loop's positions (0: nothing dropped)
        self.kept: torch.Tensor | None = None  # the prompt positions read, increasing (None: the whole prompt)
        self._progress = None  # called as (tokens done, tokens in all) while a prompt is read

    # --- what the loop, drafters and bench read ---------------------------------------------------------------

    @property
    def capabilities(self) -> TargetCapabilities:
        # Features and views are by cache position, which is no longer the loop's position past a compressed prompt.
        return dataclasses.replace(self.inner.capabilities, features=False, sparse_view=False)

    @property
    def num_cached(self) -> int:
        return self.inner.num_cached + self._dropped

    @property
    def prefill_progress(self):
        return self._progress

    @prefill_progress.setter
    def prefill_progress(self, hook) -> None:  # generate's bar while a prompt is read
        self._progress = self.inner.prefill_progress = hook

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        self.inner.reset(plain=plain, length=length)  # (a bound: the inner cache holds the compressed prompt)
        self._tokens, self._dropped, self._prompt_end, self.kept = [], 0, 0, None

    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False, argmax_only: bool = False,
                top_k_only: int = 0, attend_to: torch.Tensor | None = None, draws=None) -> ForwardOutput:
        if attend_to is not None:
            raise UnsupportedOptionError("a target reading a compressed prompt cannot restrict its attention further")
        ids = [int(t) for t in token_ids]
        if (num_logits == 0 and parents is None and self.num_cached == 0
                and len(ids) >= self.compression.min_context):
            return self._read_compressed(ids)
        out = self.inner.forward(ids, parents=parents, num_logits=num_logits, output_hidden=output_hidden,
                                 argmax_only=argmax_only,
                                 **({"top_k_only": top_k_only} if top_k_only else {}),
                                 **({"draws": draws} if draws is not None else {}))
        self._tokens.extend(ids)
        return out

    def _read_compressed(self, ids: list[int]) -> ForwardOutput:
        """Score ``ids`` (a prompt read into the empty cache) with the scorer and read the tokens it keeps."""
        c = self.compression
        head, tail = ids[:-c.window], ids[-c.window:]
        scorer, inner, hook = self.scorer, self.inner, self._progress
        # One bar over both reads, in tokens read: the scorer's of the head, then the target's of what is kept.
        total = len(head) + c.capacity
        scorer.reset()
        try:
            scorer.prefill_progress = None if hook is None else (lambda done, _: hook(done, total))
            scorer.forward(head, num_logits=0)
            mass = scorer.attention_mass(tail)  # [layers, heads, len(head)]
        finally:
            scorer.prefill_progress = None
            scorer.reset()  # its cache is the size of the whole prompt: do not hold it through the answer
        kept = select_positions(mass, capacity=c.capacity - len(tail), sinks=c.sinks, window=0, pool=c.pool,
                                reduce=c.reduce)
        self.kept = torch.cat([kept, torch.arange(len(head), len(ids))])
        inner.prefill_progress = None if hook is None else (lambda done, _: hook(len(head) + done, total))
        try:
            out = inner.forward([ids[i] for i in self.kept.tolist()], num_logits=0)
        finally:
            inner.prefill_progress = hook
        if hook is not None:
            hook(total, total)
        self._dropped = len(ids) - len(self.kept)
        self._prompt_end = len(ids)
        self._tokens.extend(ids)
        return out

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot crop a cache of {self.num_cached} tokens to {length}")
        if length >= self._prompt_end:
            self.inner.crop(length - self._dropped)
            del self._tokens[length:]
            return
        # Into the compressed prompt (no decode loop does this): the first ``length`` tokens, read whole.
        tokens = self._tokens[:length]
        self.reset()
        if tokens:
            self.inner.forward(tokens, num_logits=0)
            self._tokens = tokens

    def keep(self, positions: list[int]) -> None:
        end = self._prompt_end
        if end and (len(positions) < end or positions[end - 1] != end - 1):
            raise ValueError("keep() would drop part of the compressed prompt; only entries after it can go")
        shift = self._dropped
        self.inner.keep(list(range(end - shift)) + [p - shift for p in positions[end:]])
        self._tokens = [self._tokens[i] for i in positions]

    def fork(self, name: str | None = None) -> PromptCompressedTarget:
        return PromptCompressedTarget(self.inner.fork(name), self.compression, self.scorer.fork(), name)

    def attach_feature_mirror(self, layers: tuple[int, ...] = (-1,)):
        raise UnsupportedOptionError("a target reading a compressed prompt has no features at the loop's positions; "
                                     "drafts that read them (trained heads) cannot run on it: use a lookup method")
