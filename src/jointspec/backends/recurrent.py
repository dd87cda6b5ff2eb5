"""Taking drafted tokens back out of a model with recurrent layers.

Granite 4's, Falcon-H1's and Bamba's state-space layers, Qwen3.5's and Qwen3-Next's linear attention: each
keeps one state that sums every token it has read, so a crop cannot take a rejected draft back out of it the way it
drops keys and values. vLLM and SGLang keep such a state per drafted token inside their kernels; transformers' layers
return only the state after a forward's last token. So the adapter (backends/hf.py) does this instead:

- before each forward it copies the recurrent states (:meth:`~jointspec.backends.kvcache.BufferedCache.
  recurrent_snapshot`), at most ``MAX_SNAPSHOTS`` of them kept; a crop to ``length`` lets go of the copies before the
  latest one at or before ``length``, since the loop never takes back tokens it has kept (a target holds one or two
  copies, a draft model one per token of its round's draft);
- a crop back to ``length`` puts back the latest copy taken at or before ``length``, cuts every other layer (keys and
  values, a convolution's recorded inputs) to the same place, and notes the tokens between that copy and ``length``
  as still to read (``replay``). They count as cached: the loop sees a cache of ``length`` tokens;
- the next forward reads those tokens first, in the same pass as its own, and returns only its own tokens' rows.
  Each recurrent layer of that forward reads them apart from the forward's own tokens and hands back its state
  between the two (:func:`states_after`): the copy for the next crop, so that no round reads again more than the
  round before it kept.

A crop further back than every copy (a decode that drafts nothing keeps none) empties the cache and reads all the
kept tokens again: never wrong, only slow, and no method of the loop's crops so far back.

A round whose draft was kept whole costs nothing more; a round that rejected part of one makes the next forward a few
rows longer (the pending token and the accepted ones read again), not a forward more.

**Short chains without padding.** transformers reads a forward of more than one token through a layer's chunked
form, written for prompts, and pads the tokens to a whole chunk: Mamba-2's of 256, Gated DeltaNet's of 64, so a
verification of 2 to 34 tokens paid for a chunk of 256 or 64 (the costs are in docs/methods.md, "Hybrid models").
:func:`install_short_chain_forms` has the chunked forms of a model's module read a chain that starts from a state
and is shorter than a chunk as one chunk of its own length (the same sums, no padding); Gated DeltaNet's chains of at
most ``TOKEN_BY_TOKEN`` tokens go to its one-token form a token at a time instead, cheaper there, and the operations
plain decoding makes for each token.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# The most copies kept of the recurrent states, one per forward: a draft model drafts one token a forward, and a crop
# may go back over all of a round's drafts. Each copy is every recurrent state's size (Qwen3.5-2B: about 19 MB); a
# crop lets go of those before the kept length, so only a draft model's long drafts hold many.
MAX_SNAPSHOTS = 64


@dataclass
class Snapshot:
    length: int  # the tokens the cache held when it was taken
    states: list[torch.Tensor]


class StateHistory:
    """One sequence's copies of its recurrent states, the tokens it holds, and those still to read again.

    ``plain``: a decode that drafts nothing (``reset(plain=True)``) never takes tokens back, and keeps no copies.
    ``length``: the most tokens the sequence will hold, where known (what a new cache takes its room for).
    ``recurrent``: False for a model whose layers keep convolution inputs alone (LFM2): those are taken back out of
    the inputs the cache records, with no copies; a crop past them reads the kept tokens again too."""

    def __init__(self, plain: bool = False, length: int | None = None, *, recurrent: bool = True) -> None:
        self.plain = plain
        self.length = length
        self.recurrent = recurrent  # False: convolutions alone (LFM2), whose recorded inputs take tokens back
        self.tokens: list[int] = []  # every token counted as cached, in order (what a rollback reads again)
        self.replay: list[int] = []  # the last of them, counted as cached but not in the cache yet
        self.snapshots: list[Snapshot] = []
        self._spare: list[list[torch.Tensor]] = []  # released copies' tensors, written over by the next copies

    def before_forward(self, cache, length: int) -> None:
        """Copy ``cache``'s recurrent states, which hold ``length`` tokens, before a forward changes them (nothing
        before the first forward has made them)."""
        if self.plain or not self.recurrent:
            return
        if self.snapshots and self.snapshots[-1].length == length:  # (a crop put these states back: the same ones)
            return
        # (a released copy's tensors, or the oldest copy's, are written over: fresh ones would cost fresh pages)
        if len(self.snapshots) >= MAX_SNAPSHOTS:
            self._release(self.snapshots.pop(0))
        states = cache.recurrent_snapshot(into=self._spare.pop() if self._spare else None)
        if states:
            self._keep(Snapshot(length, states))

    def add(self, length: int, states: list[torch.Tensor], cache) -> None:
        """Keep ``states``, the recurrent states after ``length`` tokens that a forward's layers handed back
        (:func:`states_after`), if there is one for each of ``cache``'s recurrent states, shaped as it is."""
        held = cache.recurrent_states()
        if len(states) == len(held) and all(a.shape == b.shape for a, b in zip(states, held)):
            self._keep(Snapshot(length, states))

    def latest_at_most(self, length: int) -> Snapshot | None:
        """The latest copy taken with at most ``length`` tokens cached, the copies after it dropped (their tokens are
        being taken back); None: no copy goes back that far."""
        while self.snapshots and self.snapshots[-1].length > length:
            self._release(self.snapshots.pop())
        return self.snapshots[-1] if self.snapshots else None

    def release_before(self, length: int) -> None:
        """Let go of the copies before the latest one taken with at most ``length`` tokens cached: ``length`` tokens
        are kept, and the loop takes no kept token back (a caller that did would read them again, backends/hf.py)."""
        kept = [i for i, snapshot in enumerate(self.snapshots) if snapshot.length <= length]
        if len(kept) > 1:
            for snapshot in self.snapshots[:kept[-1]]:
                self._release(snapshot)
            del self.snapshots[:kept[-1]]

    def _keep(self, snapshot: Snapshot) -> None:
        if len(self.snapshots) >= MAX_SNAPSHOTS:  # (the oldest let go of)
            self._release(self.snapshots.pop(0))
        self.snapshots.append(snapshot)

    def _release(self, snapshot: Snapshot) -> None:
        if len(self._spare) < 2:
            self._spare.append(snapshot.states)


# Gated DeltaNet's chains read a token at a time up to this length: cheaper there than its chunked form.
TOKEN_BY_TOKEN = 4


def install_short_chain_forms(model) -> None:
    """Have the chunked recurrent forms of ``model``'s modelling module read a chain that starts from a state and is
    shorter than a chunk without padding it (the module docstring). Once per module; a module without such forms is
    left alone. On the CPU only: a GPU kernel (``mamba_ssm``, ``fla``) may be behind the chunked name there."""
    module = sys.modules.get(type(model).__module__)
    for chunked, one, wrap in (("mamba2_chunk_scan", None, _mamba2_scan),
                               ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", _delta_rule)):
        form = getattr(module, chunked, None)
        if form is not None and (one is None or hasattr(module, one)) and not getattr(form, "short_chains", False):
            wrapped = wrap(form, getattr(module, one)) if one else wrap(form)
            wrapped.short_chains, wrapped.chunked = True, form  # (the form it wraps: benchmarks/hybrid_costs.py)
            setattr(module, chunked, wrapped)


# The forward in flight's split (states_after): how many of its first tokens are read again, and the states after them.
_SPLIT = threading.local()


@contextmanager
def states_after(count: int) -> Iterator[list[torch.Tensor]]:
    """While a forward runs whose first ``count`` tokens are read again after a crop (0: none), the recurrent forms
    it calls (the wrapped ones, :func:`install_short_chain_forms`) read those tokens apart from the rest and append
    their state between the two to the list this yields, one per call, in the layers' order."""
    _SPLIT.count, _SPLIT.states = count, []
    try:
        yield _SPLIT.states
    finally:
        _SPLIT.count = 0


def _split_at(tokens: torch.Tensor) -> int:
    # (with or without a state before them: after a crop past every copy the tokens are read from an empty cache)
    count = getattr(_SPLIT, "count", 0)
    return count if 0 < count < tokens.shape[1] else 0


def _short(states: torch.Tensor | None, tokens: torch.Tensor, chunk_size: int) -> bool:
    return states is not None and tokens.shape[1] < chunk_size and tokens.device.type == "cpu"


def _mamba2_scan(chunked):
    def read(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=None, **kwargs):
        if _short(initial_states, hidden_states, chunk_size):
            chunk_size = hidden_states.shape[1]
        return chunked(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=initial_states, **kwargs)

    def scan(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=None, return_final_states=False,
             **kwargs):
        count = _split_at(hidden_states)
        if not count:
            return read(hidden_states, dt, A, B, C, chunk_size, *args, initial_states=initial_states,
                        return_final_states=return_final_states, **kwargs)
        head, middle = read(hidden_states[:, :count], dt[:, :count], A, B[:, :count], C[:, :count], chunk_size,
                            *args, initial_states=initial_states, return_final_states=True, **kwargs)
        _SPLIT.states.append(middle.clone())
        tail = read(hidden_states[:, count:], dt[:, count:], A, B[:, count:], C[:, count:], chunk_size, *args,
                    initial_states=middle, return_final_states=return_final_states, **kwargs)
        if return_final_states:
            return torch.cat([head, tail[0]], dim=1), tail[1]
        return torch.cat([head, tail], dim=1)
    return scan


def _delta_rule(chunked, one):
    def read(query, key, value, g, beta, chunk_size=64, initial_state=None, **kwargs):
        if _short(initial_state, query, chunk_size):
            if query.shape[1] <= TOKEN_BY_TOKEN:
                return one(query, key, value, g=g, beta=beta, initial_state=initial_state, **kwargs)
            chunk_size = query.shape[1]
        return chunked(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state, **kwargs)

    def rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, **kwargs):
        count = _split_at(query)
        if not count:
            return read(query, key, value, g, beta, chunk_size, initial_state,
                        output_final_state=output_final_state, **kwargs)
        head, middle = read(query[:, :count], key[:, :count], value[:, :count], g[:, :count], beta[:, :count],
                            chunk_size, initial_state, output_final_state=True, **kwargs)
        _SPLIT.states.append(middle.clone())
        tail, final = read(query[:, count:], key[:, count:], value[:, count:], g[:, count:], beta[:, count:],
                           chunk_size, middle, output_final_state=output_final_state, **kwargs)
        return torch.cat([head, tail], dim=1), final
    return rule
