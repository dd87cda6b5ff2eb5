"""The target drafts for itself over a sparse view of its own cache (TriForce-style self-speculation); and, lossy
and opt-in, a target that decodes over that view (:class:`SparseViewTarget`).

At long context a decoding step reads the whole key/value cache: on SmolLM2-135M at 7k tokens that is four times the
bytes of its int4 weights. TriForce (Sun et al., 2024) lets the target draft with only part of its cache, then verifies
the draft with all of it. Here the part is chosen without looking inside the model:

- the first ``sinks`` tokens (attention sinks: softmax mass parks there, StreamingLLM);
- the last ``window`` tokens (what the next tokens mostly attend to);
- ``chunks`` spans of ``chunk`` tokens where the context's last n-gram occurred earlier, each starting a little before
  the occurrence (the text the answer is copying or discussing: a long input's relevant part, found the way prompt
  lookup finds its drafts).

The draft runs the target itself (``forward(attend_to=...)``, no second cache and no second copy of the weights): its
entries are written after the committed ones and cropped before the verification rewrites them with full attention.
So the draft is the target's own distribution under a restricted view, and the loop's verifier makes the output
exactly the target's (greedy: token for token; sampling: the speculative-sampling law, with the draft rows carried).

When decoding greedily the draft itself speculates one level down, as TriForce's hierarchy does: each sparse
forward also scores the tokens prompt lookup guesses next, and keeps those that are the view's own argmax. Where the
answer copies from the input, one sparse forward then drafts several tokens. A guess is kept only when it is the
token the view drafts, so the draft is the one token-by-token drafting gives (bit for bit on the compiled layers,
whose rows are computed alone; to float rounding elsewhere): only its cost changes.

Below ``min_context`` cached tokens the view would be most of the cache, and drafting would cost as much as decoding:
the drafter proposes nothing and the loop decodes plainly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.target import ForwardOutput, TargetCapabilities, TargetLM
from jointspec.drafters.ngram import lookup, suffix_matches


@dataclass(frozen=True)
class SparseView:
    """Which cached tokens the draft sees (module docstring)."""

    sinks: int = 16
    window: int = 1024
    chunk: int = 64
    chunks: int = 4
    lead: int = 8  # a retrieved span starts this many tokens before the occurrence it was found by
    max_ngram: int = 3
    min_ngram: int = 2
    min_context: int = 2048

    def __post_init__(self) -> None:
        for name in ("sinks", "window", "chunk", "chunks", "lead"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")

    def positions(self, context: np.ndarray, cached: int) -> torch.Tensor:
        """The cached positions (below ``cached``) the draft sees after ``context``, increasing."""
        seen = np.zeros(cached, dtype=bool)
        seen[:self.sinks] = True
        seen[max(0, cached - self.window):] = True
        if self.chunks:
            _, starts = suffix_matches(context[:cached + 1], self.max_ngram, self.min_ngram, self.chunks)
            for start in starts:
                seen[max(0, start - self.lead):start - self.lead + self.chunk] = True
        return torch.from_numpy(np.flatnonzero(seen))


class SparseSelfDrafter:
    """Drafts ``num_draft_tokens`` tokens with the target over :class:`SparseView`'s part of its cache."""

    def __init__(self, target: TargetLM, num_draft_tokens: int, view: SparseView = SparseView(),
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        if not target.capabilities.sparse_view:
            why = target.capabilities.chains_only or "use the torch backend"
            raise UnsupportedOptionError(f"target '{target.name}' cannot restrict its attention to part of its "
                                         f"cache, so it cannot draft for itself over a sparse view ({why})")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.target = target
        self.num_draft_tokens = num_draft_tokens
        self.view = view
        self.eos_token_ids = eos_token_ids
        self._context = np.zeros(0, dtype=np.int64)

    def start(self, prompt_ids: list[int]) -> None:
        self._context = np.asarray(prompt_ids, dtype=np.int64)

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        target = self.target
        cached = target.num_cached
        count = min(self.num_draft_tokens, max_num_draft_tokens)
        if count <= 0 or cached < self.view.min_context:
            return EMPTY_DRAFT
        assert cached == len(context_ids) - 1, "the loop's cache holds every committed token but the last"
        if len(self._context) != len(context_ids):
            self._context = np.asarray(context_ids, dtype=np.int64)
        view = self.view.positions(self._context, cached)
        token_ids: list[int] = []
        rows: list[torch.Tensor] = []
        feed = context_ids[-1]
        # A greedy draft reads only each row's argmax, which a screened head finds more cheaply.
        argmax_only = sampling.greedy and target.capabilities.argmax_screen
        try:
            while len(token_ids) < count:
                # The draft's own earlier tokens sit after the committed ones: it sees them all.
                seen = torch.cat([view, torch.arange(cached, target.num_cached)])
                # Greedy: tokens prompt lookup guesses ride along and are kept while they are the view's argmax.
                guess = self._guess(token_ids, count - len(token_ids) - 1) if sampling.greedy else []
                logits = target.forward([feed] + guess, attend_to=seen, argmax_only=argmax_only).logits
                if sampling.greedy:
                    best = logits.argmax(-1).tolist()
                    kept = 0
                    while kept < len(guess) and guess[kept] == best[kept]:
                        kept += 1
                    new = guess[:kept] + [best[kept]]
                    target.crop(target.num_cached - (len(guess) - kept))  # the guesses not kept
                else:
                    probs = processed_probs(logits[-1], sampling)
                    new = [int(sample(probs, generator))]
                    rows.append(probs)
                stop = next((i + 1 for i, token in enumerate(new) if token in self.eos_token_ids), None)
                token_ids.extend(new[:stop])
                if stop is not None:
                    break
                feed = token_ids[-1]
        finally:
            target.crop(cached)  # the verification writes these entries again, seeing the whole cache
        return Draft(token_ids=token_ids, draft_probs=torch.stack(rows) if rows else None)

    def _guess(self, drafted: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens that prompt lookup says follow the context and the draft so far."""
        if count <= 0:
            return []
        sequence = np.concatenate([self._context, np.asarray(drafted, dtype=np.int64)])
        return lookup(sequence, count, self.view.max_ngram, self.view.min_ngram)

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self._context = np.asarray(context_ids, dtype=np.int64)


class WrappedTarget:
    """What a target wrapping ``inner`` passes through unchanged: the weights, the vocabulary, the context limit, the
    device and dtype. The approximate targets (this module's, drafters/speckv.py, drafters/specpc.py) build on it."""

    inner: TargetLM

    @property
    def model(self):
        return self.inner.model

    vocab_size = property(lambda self: self.inner.vocab_size)
    max_context = property(lambda self: self.inner.max_context)
    device = property(lambda self: self.inner.device)
    dtype = property(lambda self: self.inner.dtype)

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.logits_of(hidden)


class SparseViewTarget(WrappedTarget):
    """An approximate target for long inputs: ``inner`` (with ``capabilities.sparse_view``), every forward after
    the prompt seeing only ``view``'s part of the cache. Not lossless, never a default: opt-in with ``generate
    --attention sparse``, the bench spec option ``attention=sparse``, or by wrapping a target in Python.

    The prompt is read with full attention, so the cache starts with the model's exact keys and values; each later
    forward (decoding, verification) sees only the view, and writes its new entries from that restricted attention.
    A step then reads about 1,300 cached tokens whatever the context's length: decoding at short-context speed, with
    output that drifts from the model's wherever the left-out part of the input mattered. The bench reports how far
    (answers identical to exact decoding; perplexity under the full-cache target). This is the trade of
    StreamingLLM-style and retrieval-style cache selection; SpecKV / SpecPC choose what to keep by a draft model's
    attention, this view is chosen from the tokens. Any method runs on it: ``ar`` is plain approximate decoding; a
    speculative method verifies against the approximate target (a round's rows share the view found from its first
    token, so its output can differ from ``ar``'s on it). It keeps the cached token ids, to find the view's spans."""

    def __init__(self, inner: TargetLM, view: SparseView = SparseView(), name: str | None = None) -> None:
        if not inner.capabilities.sparse_view:
            why = inner.capabilities.chains_only or "sparse attention needs the torch backend"
            raise UnsupportedOptionError(f"target '{inner.name}' cannot restrict its attention to part of its cache "
                                         f"({why})")
        self.inner = inner
        self.view = view
        self.name = name or f"{inner.name} (sparse attention)"
        self._tokens: list[int] = []  # the ids in the cache, in cache order

    # --- what the loop, drafters and bench read ---------------------------------------------------------------

    @property
    def capabilities(self) -> TargetCapabilities:
        return self.inner.capabilities

    @property
    def prefill_progress(self):
        return self.inner.prefill_progress

    @prefill_progress.setter
    def prefill_progress(self, hook) -> None:  # generate's progress bar while the prompt is read
        self.inner.prefill_progress = hook

    num_cached = property(lambda self: self.inner.num_cached)

    def reset(self, *, plain: bool = False, length: int | None = None) -> None:
        self.inner.reset(plain=plain, length=length)
        self._tokens = []

    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False, argmax_only: bool = False,
                top_k_only: int = 0, attend_to: torch.Tensor | None = None, draws=None) -> ForwardOutput:
        ids = [int(t) for t in token_ids]
        if attend_to is None and num_logits != 0:  # a prompt (no logits) is read with full attention
            attend_to = self._view_for(ids)
        out = self.inner.forward(ids, parents=parents, num_logits=num_logits, output_hidden=output_hidden,
                                 argmax_only=argmax_only,
                                 **({"top_k_only": top_k_only} if top_k_only else {}),
                                 **({"draws": draws} if draws is not None else {}), attend_to=attend_to)
        self._tokens.extend(ids)
        return out

    def _view_for(self, ids: list[int]) -> torch.Tensor | None:
        """The cached positions a decoding forward of ``ids`` sees (None: all of them)."""
        cached = self.inner.num_cached
        if cached < self.view.min_context:
            return None
        # The context the view is found from: the cache, then this forward's first token (a chain's or a tree's
        # root: what every new row follows).
        return self.view.positions(np.asarray(self._tokens + ids[:1], dtype=np.int64), cached)

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        del self._tokens[length:]

    def keep(self, positions: list[int]) -> None:
        self.inner.keep(positions)
        self._tokens = [self._tokens[i] for i in positions]

    def fork(self, name: str | None = None) -> SparseViewTarget:
        return SparseViewTarget(self.inner.fork(name), self.view, name)

    def attach_feature_mirror(self, layers: tuple[int, ...] = (-1,)):
        return self.inner.attach_feature_mirror(layers)

    def detach_feature_mirror(self, mirror) -> None:
        self.inner.detach_feature_mirror(mirror)
