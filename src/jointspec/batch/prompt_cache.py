"""Reusing a finished request's cache for a prompt that begins with its tokens.

A chat client sends the whole conversation with every turn, so the next turn's prompt begins with the tokens of the
last one: its prompt, and mostly its answer. Reading them again costs the server a prefill per turn, which grows with
the conversation (about 8 s for 7,000 tokens on 2 cores). The lockstep engine keeps the caches of finished requests,
within a byte budget, the least recently used leaving first, and a new request takes the one that shares the longest
prefix with its prompt: those entries are not read again. A prompt that holds all of a kept cache's tokens (the next
turn of that conversation) takes the cache itself; one that shares only a part (a system prompt) copies those
entries, and the cache stays for others.

It must not change a token. A cache entry is a function of its token, its position and the entries before it,
computed the way the forward that wrote it computes rows. Where the target reads a prompt row by row (the compiled
AVX-512 layers), every row of every forward, a prompt's, a verification's or a decoding step's, is computed alone,
so any shared prefix holds exactly the bits this request's own prefill would write. Where a prompt is read in chunks
whose rows are not computed alone (a GEMM), the entries written by a chunk are those of that chunk's forward: a
request reuses only whole prompt chunks both prompts read alike, up to the end of the earlier prompt's last whole
chunk (``canonical``), and reads the rest itself, in the chunks its own prefill reads. The compiled layers' AVX2
builds read a prompt's first 1,024 positions row by row and the rest in GEMM chunks counted from there (``alone``):
any shared prefix within those positions is reused, past them whole chunks only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from jointspec.backends.kvcache import BufferedCache, BufferedLayer
from jointspec.drafters.model import common_prefix_length

log = logging.getLogger(__name__)


@dataclass
class KeptCache:
    tokens: list[int]  # the tokens whose entries ``cache`` holds, in order
    cache: BufferedCache
    canonical: int | None  # leading entries any prompt's own prefill writes alike (None: every one)
    nbytes: int


def cache_bytes(cache: BufferedCache) -> int:
    """The bytes a cache's layers hold: their buffers' whole capacity (cropping gives none back; ``fit`` does)."""
    total = 0
    for layer in cache.layers:
        if isinstance(layer, BufferedLayer) and layer._length is not None:
            tensors = (layer._key_buffer, layer._value_buffer)
        else:
            tensors = (layer.keys, layer.values)
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


class PromptCache:
    """Finished requests' caches, at most ``max_bytes`` of them, for prompts that begin with their tokens (module
    docstring). Not thread-safe: the engine's thread alone uses it."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prompt cache's budget must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, KeptCache] = OrderedDict()
        self._next = 0
        self.nbytes = 0
        self._said_too_large = False

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, tokens: list[int], cache: BufferedCache, canonical: int | None) -> None:
        """Keep ``cache`` (which holds the entries of ``tokens``; its spare room is given back first), leaving out
        the kept caches it serves every prompt of (their tokens begin its own: an answer regenerated, a conversation's
        earlier turn) and then the least recently used past the budget; a cache larger than the whole budget, or one
        with sliding-window layers (their windows drop entries), is not kept."""
        if not tokens or cache.sliding_window is not None:
            return
        cache.fit()
        nbytes = cache_bytes(cache)
        if nbytes > self.max_bytes:
            if not self._said_too_large:
                log.warning("a finished request's cache (%.0f MB) is larger than the prompt cache's %.0f MB "
                            "(--prompt-cache-mb): caches that large are not kept", nbytes / 2 ** 20,
                            self.max_bytes / 2 ** 20)
                self._said_too_large = True
            return
        for key, kept in list(self._kept.items()):
            if common_prefix_length(kept.tokens, tokens) == len(kept.tokens) and (
                    canonical is None or (kept.canonical is not None and kept.canonical <= canonical)):
                self._drop(key)
        while self._kept and self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._kept)))  # the least recently used
        self._kept[self._next] = KeptCache(list(tokens), cache, canonical, nbytes)
        self._next += 1
        self.nbytes += nbytes

    def take(self, prompt: list[int], end: int, chunk: int | None,
             alone: int = 0) -> tuple[BufferedCache, int, bool] | None:
        """The kept cache whose entries serve most of ``prompt[:end]``, how many of them do, and whether it leaves the
        store (the prompt holds all of its tokens: the caller's sequence supersedes it and owns it now; otherwise the
        caller copies the entries it uses, and the cache stays for other prompts that share them, such as a system
        prompt); None where none serves any. ``chunk``: the prompt chunk of a target whose prompt rows are not computed
        alone (only whole chunks are reused there); ``alone``: its leading positions that are (any prefix within them
        is reused, and the chunks are counted from there)."""
        best, best_length, best_whole = None, 0, False
        for key, kept in self._kept.items():
            shared = common_prefix_length(kept.tokens, prompt[:end])
            length = shared
            if kept.canonical is not None:
                length = min(length, kept.canonical)
                if length > alone:
                    length = alone + (length - alone) // chunk * chunk if chunk else alone
            if length > best_length:
                best, best_length, best_whole = key, length, shared == len(kept.tokens)
        if best is None:
            return None
        if not best_whole:
            self._kept.move_to_end(best)  # recently used: the last to leave
            return self._kept[best].cache, best_length, False
        return self._drop(best).cache, best_length, True

    def _drop(self, key: int) -> KeptCache:
        kept = self._kept.pop(key)
        self.nbytes -= kept.nbytes
        return kept
