"""Lossy and opt-in: a target that keeps, of a long prompt's cache, the entries a lookahead's attention points to
(SpecKV-style; :class:`SpecKVTarget`).

SpecKV (Galim et al., 2025, "Draft-based Approximate Inference for LLMs") drops key/value entries of a long input by
how much attention they get from *lookahead* queries: a cheap draft writes the first tokens of the answer, the target
reads them, and the attention their queries pay each input position says which entries the answer will need. Heuristics
such as SnapKV look only at the prompt's last tokens; the lookahead looks at what comes next.

Here, when decoding starts after a prompt of at least ``min_context`` tokens (after a shorter one the target sees its
whole cache for the whole answer):

1. the lookahead: ``lookahead`` tokens drafted greedily by the target itself over the token-chosen sparse view of
   drafters/sparse_self.py (sinks, the last tokens, the spans the context points to), the way ``sparse-self``
   drafts; they are cropped again;
2. the scores: the target's attention from those tokens' queries to every prompt position, in every layer and query
   head (:meth:`~jointspec.backends.hf.CausalLM.attention_mass`), averaged over layers and heads (or their maximum,
   ``reduce="max"``) and widened by a max-pool over neighbouring positions (a kept token brings its neighbours, as
   SnapKV and SpecKV do);
3. the selection: the first ``sinks`` and last ``window`` prompt tokens, and the best-scored others up to
   ``capacity`` prompt positions in all.

Every later forward (decoding and verification alike) sees that selection and every token after the prompt. The
selection is fixed for the whole answer, so on this approximate target a speculative method's greedy output equals
plain decoding's: the rows of a verified draft see exactly what they see when decoded one by one.

How this departs from SpecKV, and why: the lookahead is drafted by the target over a sparse view, not by a separate
smaller model (the embedded model is the smallest of its family here); and one selection serves every layer and head,
where SpecKV keeps a set per head, because the compiled attention takes one list of visible positions per forward.
The entries not selected stay in memory (attention skips them), so this saves time, not memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.target import TargetLM
from jointspec.drafters.sparse_self import SparseView, SparseViewTarget


@dataclass(frozen=True)
class LookaheadSelection:
    """What :class:`SpecKVTarget` keeps of a long prompt (module docstring). The default capacity equals what the
    default :class:`SparseView` sees (16 + 1,024 + 4 x 64 positions), so the two compare at one budget."""

    lookahead: int = 16
    capacity: int = 1296
    sinks: int = 16
    window: int = 32
    pool: int = 7  # odd: a kept position brings pool // 2 neighbours on each side
    reduce: str = "mean"  # over layers and heads: "mean" (the attention the cache gets in all) or "max"
    min_context: int = 2048

    def __post_init__(self) -> None:
        for name in ("lookahead", "capacity", "pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("sinks", "window"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.pool % 2 == 0:
            raise ValueError(f"pool must be odd, got {self.pool}")
        if self.reduce not in ("mean", "max"):
            raise ValueError(f"reduce must be 'mean' or 'max', got {self.reduce!r}")
        if self.sinks + self.window > self.capacity:
            raise ValueError(f"sinks + window ({self.sinks} + {self.window}) exceed capacity {self.capacity}")

    def positions(self, mass: torch.Tensor) -> torch.Tensor:
        """The prompt positions kept, increasing, from ``mass`` ([layers, heads, prompt length]: the lookahead's
        attention to each position)."""
        return select_positions(mass, capacity=self.capacity, sinks=self.sinks, window=self.window, pool=self.pool,
                                reduce=self.reduce)


def select_positions(mass: torch.Tensor, *, capacity: int, sinks: int, window: int, pool: int,
                     reduce: str) -> torch.Tensor:
    """The positions kept of ``mass``'s ([layers, heads, length]: attention paid to each position), increasing: the
    first ``sinks`` and last ``window``, then the best-scored others up to ``capacity`` in all, scored by the mean
    (or maximum) over layers and heads widened by a max-pool of width ``pool`` (a kept position brings its
    neighbours). Shared by the SpecKV-style selection above and the SpecPC-style one (drafters/specpc.py)."""
    length = mass.shape[-1]
    keep = torch.zeros(length, dtype=torch.bool)
    keep[:sinks] = True
    keep[max(0, length - window):] = True
    free = min(capacity, length) - int(keep.sum())
    if free > 0:
        flat = mass.reshape(-1, length).float().cpu()
        score = flat.mean(0) if reduce == "mean" else flat.amax(0)
        score = F.max_pool1d(score[None, None], pool, stride=1, padding=pool // 2)[0, 0]
        score[keep] = float("-inf")
        keep[score.topk(free).indices] = True
    return keep.nonzero().flatten()


class SpecKVTarget(SparseViewTarget):
    """An approximate target for long inputs: ``inner`` decoding over the prompt entries a lookahead's attention
    selects (module docstring). Not lossless, never a default: ``generate --attention speckv``, the bench spec option
    ``attention=speckv``, or by wrapping a target in Python. Needs the torch backend on a Llama-family model."""

    def __init__(self, inner: TargetLM, selection: LookaheadSelection = LookaheadSelection(),
                 view: SparseView = SparseView(), name: str | None = None) -> None:
        if not getattr(inner, "reads_attention", False):
            raise UnsupportedOptionError(f"target '{inner.name}' cannot report its attention; SpecKV-style "
                                         "attention needs the torch backend on a Llama-family model")
        super().__init__(inner, view, name or f"{inner.name} (SpecKV-style attention)")
        self.selection = selection
        # Decided at the first decoding forward after a prompt, for the whole answer: where the prompt ends (None:
        # not decided yet) and the prompt positions kept (None: all, the prompt being shorter than min_context).
        # A selection made later, once an answer grew past min_context, would fall on whichever forward crossed it,
        # and a speculative method would no longer give plain decoding's tokens.
        self._prompt_end: int | None = None
        self._kept: torch.Tensor | None = None

    def _view_for(self, ids: list[int]) -> torch.Tensor | None:
        cached = self.inner.num_cached
        if self._prompt_end is None:
            self._prompt_end = cached
            self._kept = self._select(ids[0], cached) if cached >= self.selection.min_context else None
        if self._kept is None:
            return None
        # A later prompt (a new turn, read with full attention) and the answers so far are all after the prompt.
        return torch.cat([self._kept, torch.arange(self._prompt_end, cached)])

    def _select(self, first: int, cached: int) -> torch.Tensor:
        """Draft the lookahead after ``first`` and keep the prompt entries its attention points to."""
        # One token a forward, not sparse-self's drafter: its lookup guesses make the same tokens, but the extra rows
        # they add did not pay for themselves when measured (lab notes, section 24).
        inner = self.inner
        view = self.view.positions(np.asarray(self._tokens + [first], dtype=np.int64), cached)
        argmax_only = inner.capabilities.argmax_screen
        feed, lookahead = first, []
        try:
            while len(lookahead) < self.selection.lookahead:
                seen = torch.cat([view, torch.arange(cached, inner.num_cached)])
                feed = int(inner.forward([feed], attend_to=seen, argmax_only=argmax_only).logits[-1].argmax())
                lookahead.append(feed)
        finally:
            inner.crop(cached)
        mass = inner.attention_mass([first] + lookahead[:-1])
        return self.selection.positions(mass)

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        super().reset(plain=plain, length=length)
        self._prompt_end = self._kept = None

    def crop(self, length: int) -> None:
        super().crop(length)
        if self._prompt_end is not None and length < self._prompt_end:
            self._prompt_end = self._kept = None

    def keep(self, positions: list[int]) -> None:
        super().keep(positions)
        end = self._prompt_end  # positions increase, so the prompt stays whole iff its last entry stays put
        if end and (len(positions) < end or int(positions[end - 1]) != end - 1):
            self._prompt_end = self._kept = None

    def fork(self, name: str | None = None) -> SpecKVTarget:
        return SpecKVTarget(self.inner.fork(name), self.selection, self.view, name)
