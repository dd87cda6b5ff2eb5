"""Corpus lookup: where the context has nothing to copy, draft what the target's own past answers make most likely.

Prompt lookup drafts only when the context repeats itself, which open-ended chat rarely does: on MT-Bench it adds
about 14 % over plain decoding on the int4 SmolLM2, against 50-75 % on input-grounded tasks. But a small model's
answers repeat *each other*: the same openings, list markers, transitions and closing lines come back from one
answer to the next. REST (He et al., 2023, "REST: Retrieval-Based Speculative Decoding") drafts from a datastore of
text by the longest suffix match of the context; this module keeps the idea and makes the datastore small: a table
of n-grams from a corpus of the target's own greedy answers to prompts that are not benchmark prompts
(``jointspec build-corpus``, :mod:`jointspec.cli.corpus`, writes one), each mapped to the token that most often
followed it.

Drafting, one token at a time (each drafted token joins the context for the next):

1. the context's own continuation, if its last ``n >= min_context_ngram`` tokens occurred earlier in it (prompt
   lookup, longest n first, most recent match), or the continuation in the target's earlier answers where an
   online memory is given and matches a longer n-gram (:mod:`jointspec.drafters.memory`);
2. else the table's continuation of the longest final n-gram it holds (``n >= min_order``), if that continuation
   had at least ``min_share`` of the n-gram's occurrences in the corpus;
3. else the draft ends.

Under a cost-aware wrapper the bar ``min_share`` follows the price of a drafted row (:meth:`CorpusLookupDrafter.
price_rows`): alone, where an extra row costs a few per cent of a step, entries from a share of about 0.2 pay; in a
batch, where a row costs about half a sequence's share of the round, only entries from about 0.6.

Example: the corpus has "Here are some tips" 30 times and "Here are some ideas" 10 times, so the table maps
(Here, are, some) to "tips" with share 0.75; a context ending in "Here are some" drafts "tips" when ``min_share <=
0.75``. A draft is verified like any other (one-hot drafts), so the output is the target's, whatever the table says;
the table only decides how often drafts are accepted.

The table: for each order ``n`` (1 .. ``max_order``) sorted uint64 keys, each packing ``n`` token ids exactly (so
``max_order`` is at most 64 // bits per id: 4 for a 49,152-token vocabulary), with the most frequent next token, its
share and the n-gram's count. A lookup is one binary search per order. N-grams seen fewer than ``min_count`` times
are dropped when the table is built: a single occurrence predicts little and most of a table would be such.
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.files import replacing_together
from jointspec.drafters.memory import OutputMemory
from jointspec.drafters.ngram import PromptLookupDrafter, lookup

TABLE_FILE = "table.npz"
CONFIG_FILE = "corpus.json"
# Tables shipped inside the package (next to the shipped draft heads), found by tokenizer fingerprint.
SHIPPED_TABLES = Path(__file__).resolve().parent.parent / "data" / "drafts"


_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (its vocabulary size, hash)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id): a table's ids mean something only under it. Hashing a
    vocabulary of tens of thousands of tokens takes tens of milliseconds, and building `default` asks up to three
    times, so a sized tokenizer's hash is kept while the tokenizer lives (and made again if tokens were added to it
    since)."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    try:
        kept_size, fingerprint = _fingerprints[tokenizer]
        if size is not None and kept_size == size:
            return fingerprint
    except (KeyError, TypeError):  # TypeError: a tokenizer that cannot be weakly referenced
        pass
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    fingerprint = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
    if size is not None:
        try:
            _fingerprints[tokenizer] = (size, fingerprint)
        except TypeError:
            pass
    return fingerprint


def shipped_table_for(tokenizer) -> Path | None:
    """The table shipped inside the package for ``tokenizer``'s vocabulary, if there is one."""
    if tokenizer is None or not SHIPPED_TABLES.is_dir():
        return None
    fingerprint = None
    for folder in sorted(SHIPPED_TABLES.iterdir()):
        try:
            wanted = json.loads((folder / CONFIG_FILE).read_text())["tokenizer_fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        fingerprint = fingerprint or tokenizer_fingerprint(tokenizer)
        if wanted == fingerprint:
            return folder
    return None


def table_for(folder: str | Path, tokenizer, vocab_size: int) -> NgramTable:
    """The table in ``folder``, refused (clearly) if it was built for another vocabulary."""
    table, config = _load_cached(str(Path(folder).expanduser().resolve()))
    if table.vocab_size != vocab_size:
        raise UnsupportedOptionError(f"the n-gram table in '{folder}' was built for a {table.vocab_size}-token "
                                     f"vocabulary, this target has {vocab_size}; build one for it with "
                                     "`jointspec build-corpus --target ...`")
    wanted = config.get("tokenizer_fingerprint")
    if tokenizer is not None and wanted and wanted != tokenizer_fingerprint(tokenizer):
        raise UnsupportedOptionError(f"the n-gram table in '{folder}' was built under another tokenizer (same "
                                     "vocabulary size, other tokens); build one for this target with "
                                     "`jointspec build-corpus --target ...`")
    return table


@functools.lru_cache(maxsize=4)  # a bench builds a method per row: read a table (megabytes) once
def _load_cached(folder: str) -> tuple[NgramTable, dict]:
    return NgramTable.load(folder)


def _bits(vocab_size: int) -> int:
    """Bits per token id in a key: room for every id and for one separator value (vocab_size)."""
    return max(1, int(vocab_size).bit_length())


def _pack(windows: np.ndarray, bits: int) -> np.ndarray:
    """[m, n] token ids -> [m] uint64 keys, first id in the highest bits."""
    keys = np.zeros(windows.shape[0], dtype=np.uint64)
    for column in range(windows.shape[1]):
        keys = (keys << np.uint64(bits)) | windows[:, column].astype(np.uint64)
    return keys


@dataclass(frozen=True)
class NgramTable:
    """Per order n (index n - 1): sorted keys, the most frequent next token, its share, the n-gram's count."""

    vocab_size: int
    keys: tuple[np.ndarray, ...]  # uint64 [entries]
    next_ids: tuple[np.ndarray, ...]  # int32 [entries]
    shares: tuple[np.ndarray, ...]  # float32 [entries], in (0, 1]
    counts: tuple[np.ndarray, ...]  # int32 [entries]

    def __post_init__(self) -> None:
        if not self.keys or not len(self.keys) == len(self.next_ids) == len(self.shares) == len(self.counts):
            raise ValueError("an n-gram table needs the same number (>= 1) of key, next-token, share and count arrays")
        if len(self.keys) > 64 // _bits(self.vocab_size):
            raise ValueError(f"order {len(self.keys)} does not fit a 64-bit key at {_bits(self.vocab_size)} bits "
                             "per id")

    @property
    def max_order(self) -> int:
        return len(self.keys)

    @property
    def num_entries(self) -> int:
        return sum(int(k.size) for k in self.keys)

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, max_order: int = 4,
              min_count: int = 2) -> NgramTable:
        """Count every (n-gram, next token) pair of ``sequences`` (n = 1 .. max_order; pairs never cross from one
        sequence to the next) and keep, per n-gram seen at least ``min_count`` times, its most frequent next token
        (ties: the lowest id)."""
        bits = _bits(vocab_size)
        if not 1 <= max_order <= 64 // bits:
            raise ValueError(f"max_order must be 1 .. {64 // bits} for a vocabulary of {vocab_size}, got {max_order}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        separator = vocab_size
        parts = []
        for sequence in sequences:
            ids = np.asarray(sequence, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token ids must lie in [0, {vocab_size}); got {ids.min()} .. {ids.max()}")
            parts += [ids, np.array([separator])]
        corpus = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        tables: list[tuple[np.ndarray, ...]] = []
        for n in range(1, max_order + 1):
            windows = np.zeros((0, n + 1), dtype=np.int64)
            if corpus.size > n:
                windows = np.lib.stride_tricks.sliding_window_view(corpus, n + 1)  # [m, n + 1]: n-gram, then next
                windows = windows[(windows != separator).all(axis=1)]
            if not windows.shape[0]:
                tables.append((np.zeros(0, np.uint64), np.zeros(0, np.int32), np.zeros(0, np.float32),
                               np.zeros(0, np.int32)))
                continue
            keys = _pack(windows[:, :n], bits)
            following = windows[:, n].astype(np.int64)
            order = np.lexsort((following, keys))  # by key, then next token
            keys, following = keys[order], following[order]
            # Runs of equal (key, next) pairs, then per key the run with the most pairs (the first, lowest id, on ties).
            pair_start = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (following[1:] != following[:-1])])
            pair_count = np.diff(np.r_[pair_start, keys.size])
            pair_key, pair_next = keys[pair_start], following[pair_start]
            key_start = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
            key_total = np.add.reduceat(pair_count, key_start)
            best = np.maximum.reduceat(pair_count, key_start)
            # The first pair of each key reaching its maximum: rank pairs by (key index, -count, next id).
            key_index = np.repeat(np.arange(key_start.size), np.diff(np.r_[key_start, pair_key.size]))
            first = np.lexsort((pair_next, -pair_count, key_index))
            pick = first[np.r_[True, key_index[first][1:] != key_index[first][:-1]]]
            keep = key_total >= min_count
            tables.append((pair_key[key_start][keep], pair_next[pick][keep].astype(np.int32),
                           (best / key_total)[keep].astype(np.float32), key_total[keep].astype(np.int32)))
        return cls(vocab_size, *(tuple(t[i] for t in tables) for i in range(4)))

    def continuation(self, context: Sequence[int], min_order: int = 1) -> tuple[int, float, int] | None:
        """(next token, its share, order) for the longest final n-gram of ``context`` in the table, else None."""
        bits = _bits(self.vocab_size)
        top = min(self.max_order, len(context))
        # Drafting asks this for every drafted token: the keys are packed as _pack packs them, in Python integers
        # (an array per order cost more than the search itself).
        tail = [int(token) for token in context[len(context) - top:]] if top > 0 else []
        for n in range(top, min_order - 1, -1):
            keys = self.keys[n - 1]
            if not keys.size:
                continue
            key = 0
            for token in tail[top - n:]:
                key = (key << bits) | token
            key = np.uint64(key)
            at = int(keys.searchsorted(key))
            if at < keys.size and keys[at] == key:
                return int(self.next_ids[n - 1][at]), float(self.shares[n - 1][at]), n
        return None

    def save(self, folder: str | Path, metadata: dict) -> None:
        """``folder``/table.npz and ``folder``/corpus.json (``metadata`` plus the table's shape)."""
        folder = Path(folder)
        arrays = {}
        for n in range(self.max_order):
            arrays.update({f"keys{n + 1}": self.keys[n], f"next{n + 1}": self.next_ids[n],
                           f"share{n + 1}": self.shares[n].astype(np.float16), f"count{n + 1}": self.counts[n]})
        config = dict(metadata, vocab_size=self.vocab_size, max_order=self.max_order, num_entries=self.num_entries)
        with replacing_together([folder / TABLE_FILE, folder / CONFIG_FILE], "n-gram table", folder,
                                "the answers it was built from are kept: free some room and run the same command "
                                "again") as (table, settings):
            np.savez_compressed(table, **arrays)
            settings.write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> tuple[NgramTable, dict]:
        folder = Path(folder).expanduser()
        if not (folder / CONFIG_FILE).is_file() or not (folder / TABLE_FILE).is_file():
            raise UnsupportedOptionError(f"'{folder}' holds no n-gram table ({CONFIG_FILE} and {TABLE_FILE}); build "
                                         "one with `jointspec build-corpus`")
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())
            with np.load(folder / TABLE_FILE) as data:
                orders = range(1, int(config["max_order"]) + 1)
                table = cls(int(config["vocab_size"]), tuple(data[f"keys{n}"] for n in orders),
                            tuple(data[f"next{n}"] for n in orders),
                            tuple(data[f"share{n}"].astype(np.float32) for n in orders),
                            tuple(data[f"count{n}"] for n in orders))
        except (ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as error:
            # jointspec writes both atomically: only damage from outside (a copy cut short, a full disk) lands here.
            raise UnsupportedOptionError(
                f"the n-gram table in '{folder}' is damaged ({type(error).__name__}: {error}); build it again with "
                "`jointspec build-corpus`") from None
        return table, config


# The bar for a table entry where nothing prices a drafted row (a drafter without a cost-aware wrapper).
DEFAULT_MIN_SHARE = 0.4

# How much less often the target takes a table entry's token than the entry's share says: on the shipped SmolLM2 table
# and MT-Bench, entries of share 0.4-0.9 were accepted about 0.1 less often than their share (docs/lab/serving.md,
# section 10).
SHARE_OVER_ACCEPTANCE = 0.1


class CorpusLookupDrafter(PromptLookupDrafter):
    """Prompt lookup first, the corpus table where the context has no match of ``min_context_ngram`` tokens or more
    (module docstring). Draft length as prompt lookup's (``num_draft_tokens``, doubled after a draft accepted
    whole, up to ``max_num_draft_tokens``, back after any rejection); a draft also ends at the first position
    neither source fills.

    ``min_share``: the least share a table entry needs to be drafted; None (the default) lets a cost-aware wrapper
    set it from the price of a row (:meth:`price_rows`), :data:`DEFAULT_MIN_SHARE` until one does."""

    def __init__(self, table: NgramTable, num_draft_tokens: int = 3, max_num_draft_tokens: int | None = None, *,
                 max_ngram: int = 3, min_context_ngram: int = 2, min_order: int = 1,
                 min_share: float | None = None, output_memory: OutputMemory | None = None) -> None:
        super().__init__(num_draft_tokens, max_ngram, min_context_ngram, max_num_draft_tokens,
                         output_memory=output_memory)
        if not 1 <= min_order <= table.max_order:
            raise ValueError(f"min_order must be 1 .. {table.max_order} for this table, got {min_order}")
        if min_share is not None and not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share}")
        self.table = table
        self.min_order = min_order
        self.priced = min_share is None
        self.min_share = DEFAULT_MIN_SHARE if min_share is None else min_share

    def price_rows(self, row_cost: float | None) -> None:
        """Draft table entries whose share, less :data:`SHARE_OVER_ACCEPTANCE`, pays for the row a drafted token
        adds. ``row_cost``: that row's cost as a fraction of a plain round (a one-token draft pays where its token is
        accepted more often than that); a cost-aware wrapper calls this whenever its curve changes. Above 0.9 no
        entry pays. None: no price known (a batch that runs the drafter without its wrapper), the bar
        :data:`DEFAULT_MIN_SHARE`. A ``min_share`` given at construction stays."""
        if row_cost is not None and not row_cost >= 0:
            raise ValueError(f"row_cost must be >= 0, got {row_cost}")
        if self.priced:
            self.min_share = DEFAULT_MIN_SHARE if row_cost is None else row_cost + SHARE_OVER_ACCEPTANCE

    def next_token(self, context: np.ndarray) -> int | None:
        """The drafted token after ``context`` (int64 token ids): from the context itself (or the memory of earlier
        answers, where it matches longer), else from the table, else None."""
        copied = lookup(context, 1, self.max_ngram, self.min_ngram, self.output_memory)
        if copied:
            return copied[0]
        found = self.table.continuation(context, self.min_order)
        if found is not None and found[1] >= self.min_share:
            return found[0]
        return None

    def peek(self, context_ids: list[int], num_tokens: int) -> list[int]:
        """The draft of up to ``num_tokens`` tokens after ``context_ids`` (``propose`` drafts through it), with no
        change to the drafter's state."""
        budget = max(0, num_tokens)
        if budget == 0:  # a round that drafts nothing (cost-aware, or no room left) reads nothing
            return []
        # The context as one array with room for the draft (not converted again for every drafted token).
        length = len(context_ids)
        context = np.empty(length + budget, dtype=np.int64)
        context[:length] = context_ids
        tokens: list[int] = []
        while len(tokens) < budget:
            token = self.next_token(context[:length])
            if token is None:
                break
            tokens.append(token)
            context[length] = token
            length += 1
        return tokens
