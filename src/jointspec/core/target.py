"""What the loop, the methods, the batched engine and the bench may ask of a model: the ``TargetLM`` protocol.

A target holds one sequence's KV cache. It knows how many tokens are cached (``num_cached``), feeds new tokens after
them in one forward pass (a chain, or a tree given by ``parents``), and rolls the cache back to exactly the tokens the
loop kept (``crop`` for a prefix, ``keep`` for a tree path). Every backend implements it (``backends/hf.py`` for
transformers models, ``backends/llamacpp.py`` for GGUF files through llama.cpp). Trained drafts that run as models
(``drafts/``) implement the part drafters call (``forward``, ``crop``, ``keep``, ``reset``, ``capabilities``); a
distilled draft is a full ``CausalLM``.

What a backend can do beyond that core it declares in :class:`TargetCapabilities`; callers read those fields instead
of probing the object for attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from jointspec.core.sampling import RowDraws, SamplingConfig


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, vocab], float32
    hidden: torch.Tensor | None  # [num_logits, hidden] last-layer hidden states (after the final norm), if asked


@dataclass(frozen=True)
class ForwardCall:
    """One :meth:`TargetLM.forward` call's arguments, as a value: what the decode loop asks of its target each round,
    so that a batched engine can run many sequences' calls together (``forward_many`` in the backends)."""

    token_ids: list[int]
    parents: list[int] | None = None
    num_logits: int | None = None
    output_hidden: bool = False
    argmax_only: bool = False
    top_k_only: int = 0
    draws: RowDraws | None = None  # draw each row's token through the screen (TargetCapabilities.draw_screen)
    allowed: torch.Tensor | None = None  # a grammar's allowed tokens per row, for the screens (screen_masks)

    def run(self, target: TargetLM) -> ForwardOutput:
        # top_k_only, draws and allowed only where set: a target without the capability need not take them.
        extra = {"top_k_only": self.top_k_only} if self.top_k_only else {}
        if self.draws is not None:
            extra["draws"] = self.draws
        if self.allowed is not None:
            extra["allowed"] = self.allowed
        return target.forward(self.token_ids, parents=self.parents, num_logits=self.num_logits,
                              output_hidden=self.output_hidden, argmax_only=self.argmax_only, **extra)


@dataclass(frozen=True)
class TargetCapabilities:
    """What a target can do beyond chains of tokens and logits.

    ``trees``: ``forward(parents=...)`` scores a token tree in one pass (each node sees its ancestors only).
    ``features``: hidden states (``output_hidden``, feature mirrors), which EAGLE-style heads and Medusa read.
    ``fork``: :meth:`TargetLM.fork` gives a second cache over the same weights (a self-draft, a cost probe).
    ``argmax_screen``: ``forward(argmax_only=True)`` finds each row's argmax through a cheaper screened head. Such a
    target also has ``logits_of(hidden)``: the exact head's logits [n, vocab] of final-normed hidden rows (a screened
    forward's ``ForwardOutput.hidden``), the whole rows that log-probabilities need (core/logprobs.py).
    ``top_k_screen``: the largest k for which ``forward(top_k_only=k)`` computes each row's k largest logits through
    the screened head (exact near the k-th best, the rest of the row approximate; as the argmax screen, not
    guaranteed to hold the exact top k); 0: none.
    ``plain_decode``: ``reset(plain=True)`` switches to faster kernels for decodes that verify nothing (whose rows
    then need not equal batched rows); such a target says in ``plain`` which kernels the current decode runs on.
    ``torch_module``: ``.model`` is a torch module that jointspec may quantise or give other kernels.
    ``sparse_view``: ``forward(attend_to=...)`` lets the new tokens see only some of the cached ones (a target
    drafting for itself over part of its own cache, drafters/sparse_self.py).
    ``draw_screen``: ``forward(draws=RowDraws(...))`` draws each row's token from softmax(logits / temperature)
    through the screened head (temperature alone; core/sampling.py, "draws"), returning rows one-hot at the draws.
    ``max_verify_rows``: the most rows a forward may have and still compute each row as it would alone (past it a
    forward is read as a prompt, in other kernels); None: no such limit. A round verifying more would not be exact.
    ``chains_only``: why a target without ``trees`` scores chains only, for the errors that refuse a tree.
    ``screen_masks``: ``forward(allowed=...)`` (bool [rows, vocab], structured output) makes the screens (argmax,
    top-k, draws) find each row's best among its allowed tokens, or draw among them, the others at minus infinity.
    """

    trees: bool = False
    features: bool = False
    fork: bool = False
    argmax_screen: bool = False
    top_k_screen: int = 0
    plain_decode: bool = False
    torch_module: bool = False
    sparse_view: bool = False
    draw_screen: bool = False
    max_verify_rows: int | None = None
    chains_only: str = ""
    screen_masks: bool = False

    def screened_top_k(self, sampling: SamplingConfig) -> int:
        """The k of the top k that rows sampled with ``sampling`` may read through this target's screen
        (``forward(top_k_only=k)``); 0 where they read every logit (greedy rows have their own screen)."""
        k = sampling.top_k
        return k if not sampling.greedy and 0 < k <= self.top_k_screen else 0


@runtime_checkable
class TargetLM(Protocol):
    name: str
    num_cached: int

    @property
    def capabilities(self) -> TargetCapabilities: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        """Empty the cache for a new sequence; ``plain``: see :attr:`TargetCapabilities.plain_decode`. ``length``:
        the most tokens the sequence will hold (None: not known), so that a cache may take its room at once."""

    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False,
                argmax_only: bool = False, top_k_only: int = 0, draws: RowDraws | None = None) -> ForwardOutput:
        """Feed ``token_ids`` after the cache (they stay cached); the last ``num_logits`` rows of logits (all if
        None). A target without a capability refuses the option that needs it with a clear error (``top_k_only``
        is passed only to a target with ``top_k_screen``, ``draws`` only to one with ``draw_screen``, ``allowed``
        only to one with ``screen_masks``)."""

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens."""

    def keep(self, positions: list[int]) -> None:
        """Keep the cached tokens at ``positions`` (increasing) and drop the rest."""

    def fork(self, name: str | None = None) -> TargetLM:
        """A new target over the same weights with its own empty cache (where ``capabilities.fork``)."""
