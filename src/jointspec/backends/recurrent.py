"""Taking drafted tokens back out of a model with recurrent layers.

Granite 4's and Falcon-H1's state-space layers, Qwen3.5's and Qwen3-Next's linear attention, Jamba's Mamba: each
keeps one state that sums every token it has read, so a crop cannot take a rejected draft back out of it the way it
drops keys and values. vLLM and SGLang keep such a state per drafted token inside their kernels; transformers' layers
return only the state after a forward's last token. So the adapter (backends/hf.py) does this instead:

- before each forward it copies the recurrent states (:meth:`~jointspec.backends.kvcache.BufferedCache.
  recurrent_snapshot`), the last ``MAX_SNAPSHOTS`` of them kept;
- a crop back to ``length`` puts back the latest copy taken at or before ``length``, cuts every other layer (keys and
  values, a convolution's recorded inputs) to the same place, and notes the tokens between that copy and ``length``
  as still to read (``replay``). They count as cached: the loop sees a cache of ``length`` tokens;
- the next forward reads those tokens first, in the same pass as its own, and returns only its own tokens' rows.

A crop further back than every copy (a decode that drafts nothing keeps none) empties the cache and reads all the
kept tokens again: never wrong, only slow, and no method of the loop's crops so far back.

A round whose draft was kept whole costs nothing more; a round that rejected part of one makes the next forward a few
rows longer (the pending token and the accepted ones read again), not a forward more. The state after them is then
computed by the layers' chunked form instead of token by token, the same function of the same tokens, to
rounding: greedy decoding stays plain decoding's (the tests check it on each kind of layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Copies kept of the recurrent states, one per forward: a draft model drafts one token a forward, and a crop may go
# back over all of a round's drafts. Each copy is every recurrent state's size (Qwen3.5-2B: about 19 MB).
MAX_SNAPSHOTS = 16


@dataclass
class Snapshot:
    length: int  # the tokens the cache held when it was taken
    states: list[torch.Tensor]


class StateHistory:
    """One sequence's copies of its recurrent states, the tokens it holds, and those still to read again.

    ``plain``: a decode that drafts nothing (``reset(plain=True)``) never takes tokens back, and keeps no copies.
    ``length``: the most tokens the sequence will hold, where known (what a new cache takes its room for)."""

    def __init__(self, plain: bool = False, length: int | None = None) -> None:
        self.plain = plain
        self.length = length
        self.tokens: list[int] = []  # every token counted as cached, in order (what a rollback reads again)
        self.replay: list[int] = []  # the last of them, counted as cached but not in the cache yet
        self.snapshots: list[Snapshot] = []

    def before_forward(self, cache, length: int) -> None:
        """Copy ``cache``'s recurrent states, which hold ``length`` tokens, before a forward changes them (nothing
        before the first forward has made them)."""
        if self.plain:
            return
        if self.snapshots and self.snapshots[-1].length == length:  # (a crop put these states back: the same ones)
            return
        # (the oldest copy's tensors are written over: a copy a forward would otherwise cost fresh pages)
        reuse = self.snapshots.pop(0).states if len(self.snapshots) >= MAX_SNAPSHOTS else None
        states = cache.recurrent_snapshot(into=reuse)
        if states:
            self.snapshots.append(Snapshot(length, states))

    def latest_at_most(self, length: int) -> Snapshot | None:
        """The latest copy taken with at most ``length`` tokens cached, the copies after it dropped (their tokens are
        being taken back); None: no copy goes back that far."""
        while self.snapshots and self.snapshots[-1].length > length:
            self.snapshots.pop()
        return self.snapshots[-1] if self.snapshots else None
