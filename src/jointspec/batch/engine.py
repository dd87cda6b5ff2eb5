"""Batched speculative decoding: many sequences, one target forward per round, continuous batching.

The round is the single-sequence loop's (:mod:`jointspec.core.loop`), run for every active sequence at once:

1. each method group's :class:`~jointspec.batch.drafters.BatchDrafter` drafts for its sequences, each within its own
   budget (``max_new_tokens`` and the context);
2. the target scores every row's pending token plus its draft in one forward over a
   :class:`~jointspec.batch.cache.RaggedCache`; drafts of different lengths are padded with dummy tokens;
3. each row's logits slice goes to the row's verifier with the row's sampling settings and its own
   ``torch.Generator`` (seeded from the request's seed), exactly as in the single-sequence loop;
4. each row keeps a different number of tokens: the ragged cache keeps each row's committed tokens but the last
   and masks the rest (see :mod:`jointspec.batch.cache`); rows that hit an end-of-sequence token or their length
   limit leave, and waiting requests join before the next round.

Sequences decode independently: in fp32, a sequence's tokens are the ones
:class:`~jointspec.core.loop.SpeculativeDecoder`
produces for it alone, up to float rounding of padded matmuls (see ``tests/test_batch.py``).

Requests choose their method (a :class:`~jointspec.methods.MethodConfig`); sequences with the same method share one
batched drafter and verifier, and every sequence shares the target forward. Methods whose drafter has no batched
form are refused with :class:`~jointspec.core.errors.UnsupportedOptionError`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch.cache import RaggedCache
from jointspec.batch.drafters import BatchDrafter, batch_drafter_for
from jointspec.core.choices import dynamic_tree_refusal
from jointspec.core.draft import Draft, tree_depths
from jointspec.core.errors import ContextTooLongError, UnsupportedOptionError
from jointspec.core.grammar import GrammarState
from jointspec.core.logprobs import TokenLogprob, token_logprobs
from jointspec.core.loop import (
    DecodeConfig,
    SpecStats,
    committed_rows,
    committed_tokens,
    kept_draft_tokens,
    verified_logits,
)
from jointspec.core.verdict import Verifier
from jointspec.drafters.memory import OutputMemory
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers.greedy import GreedyVerifier
from jointspec.verifiers.rejection import RejectionSamplingVerifier

log = logging.getLogger(__name__)

# Verifiers that judge one chain per call and keep no state between calls: safe to share across rows.
BATCHABLE_VERIFIERS: tuple[type, ...] = (GreedyVerifier, RejectionSamplingVerifier)


@dataclass(frozen=True)
class BatchRequest:
    prompt_ids: tuple[int, ...]
    config: DecodeConfig = DecodeConfig()
    method: MethodConfig = MethodConfig()
    seed: int = 0
    memory: OutputMemory | None = None  # earlier answers its drafter may copy from (online adaptation)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))


@dataclass
class BatchEvent:
    """What one round did for one sequence. ``finish_reason``: None while it runs, else "stop" (end-of-sequence
    token), "length" (``max_new_tokens`` or the context), "cancelled", or "error", which ends it alone: the request's
    own method refused a round (``error`` a :class:`JointspecError` saying why; a draft too large for the target, say)
    or its drafting or verification failed (any other exception: a fault, which the engine logs; on the ragged engine
    a fault in fitting its draft to its grammar or in its verification, while one in a group's drafter fails the
    round)."""

    seq_id: int
    token_ids: list[int]
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    stats: SpecStats | None = None  # the sequence's whole-generation stats, on its last event
    depths: list[int] | None = None  # the round's draft nodes' depths (None: a chain of num_drafted)
    error: Exception | None = None  # why, where finish_reason is "error"
    num_forced: int = 0  # of num_accepted, the tokens a grammar forced (structured output)
    # One per token in token_ids, where the request's config asks for log-probabilities (core/logprobs.py).
    logprobs: list[TokenLogprob] | None = None


@dataclass
class _Method:
    drafter: BatchDrafter
    verifier: Verifier
    never_drafts: bool = False  # plain decoding: a grammar's forced tokens are read one a step, not drafted


@dataclass
class _Sequence:
    seq_id: int
    request: BatchRequest
    method: _Method
    generator: torch.Generator
    tokens: list[int]
    end: int  # the sequence stops growing at this length
    stats: SpecStats = field(default_factory=SpecStats)
    grammar: GrammarState | None = None  # structured output: where the answer stands in its grammar
    masks: torch.Tensor | None = None  # the round's allowed tokens per row (grammar only)
    own_nodes: int = 0  # the round's draft nodes that are the drafter's (not tokens a grammar forced)


class EngineBase:
    """What both batched engines share: the request queue, draft models loaded once, cancelling, ``generate``.
    Subclasses define ``method`` (raise for a config they cannot run), ``_new_sequence``, ``_join``,
    ``_drop_active`` and ``step``."""

    def __init__(self, target: CausalLM, tokenizer=None, *, max_batch_size: int = 16,
                 load_draft: Callable[[str], tuple[CausalLM, object]] | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.target = target
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._load_draft = load_draft
        self._drafts: dict[str, tuple[CausalLM, object]] = {}
        self.waiting: deque = deque()
        self.active: dict = {}
        self._ids = itertools.count()
        self._cancelled: list = []
        self.stats = SpecStats()  # every round of every sequence since the engine started

    def method(self, config: MethodConfig):
        raise NotImplementedError

    def _new_sequence(self, seq_id: int, request: BatchRequest, generator: torch.Generator):
        raise NotImplementedError

    def _drop_active(self, seq_id: int) -> None:
        raise NotImplementedError

    def step(self) -> list[BatchEvent]:
        raise NotImplementedError

    def _join(self) -> None:
        raise NotImplementedError

    def _admit(self) -> list[BatchEvent]:
        """A round's start: the "cancelled" events due, then waiting requests join while rows are free."""
        events = [BatchEvent(seq.seq_id, [], "cancelled", stats=seq.stats) for seq in self._cancelled]
        self._cancelled = []
        self._join()
        return events

    def _draft_model(self, source: str) -> tuple[CausalLM, object]:
        if self._load_draft is None:
            raise UnsupportedOptionError(f"this engine loads no draft models; cannot use draft '{source}'")
        if source not in self._drafts:
            self._drafts[source] = self._load_draft(source)
        draft, tokenizer = self._drafts[source]
        # Each method config (or request) gets its own adapter (and cache) around the shared weights.
        return draft.fork(draft.name), tokenizer

    def check(self, request: BatchRequest) -> None:
        """Raise the error ``submit`` would, without queueing anything."""
        if len(request.prompt_ids) >= self.target.max_context:
            raise ContextTooLongError.for_prompt(len(request.prompt_ids), self.target.max_context)
        refusal = dynamic_tree_refusal(request.method.name, request.method.tree_budget,
                                       request.config.sampling.temperature)
        if refusal:  # now, not by the drafter once the answer's first tokens are out
            raise UnsupportedOptionError(refusal)
        self.method(request.method)

    def submit(self, request: BatchRequest) -> int:
        """Queue a request; it joins the batch at the next round with room. Returns its sequence id."""
        self.check(request)
        seq_id = next(self._ids)
        generator = torch.Generator(device="cpu").manual_seed(request.seed)
        self.waiting.append(self._new_sequence(seq_id, request, generator))
        return seq_id

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence; its "cancelled" event comes with the next ``step``. Unknown ids are ignored."""
        for seq in list(self.waiting):
            if seq.seq_id == seq_id:
                self.waiting.remove(seq)
                self._cancelled.append(seq)
        if seq_id in self.active:
            self._cancelled.append(self.active[seq_id])
            self._drop_active(seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active or self._cancelled)

    def generate(self, requests: Iterable[BatchRequest]) -> list[list[int]]:
        """Decode ``requests`` to the end; the new tokens of each, in order. A request its own method refuses
        mid-way raises that error."""
        ids = [self.submit(request) for request in requests]
        out: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
        while self.has_work:
            for event in self.step():
                if event.error is not None:
                    raise event.error
                out[event.seq_id].extend(event.token_ids)
        return [out[seq_id] for seq_id in ids]


# Methods the ragged engine keeps built, of each kind: by config, and with a memory of earlier answers by config and
# memory (per user where the server keeps a memory per user).
MAX_BUILT_METHODS = 64


def recently_used(cache: OrderedDict, key, make: Callable[[], object]):
    """``cache[key]``, made by ``make()`` on first use; past :data:`MAX_BUILT_METHODS` entries the least recently
    used leave."""
    if key not in cache:
        cache[key] = make()
        while len(cache) > MAX_BUILT_METHODS:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return cache[key]


class BatchEngine(EngineBase):
    """Decodes many requests together. Not thread-safe: one thread calls ``submit``/``cancel``/``step``."""

    def __init__(self, target: CausalLM, tokenizer=None, *, max_batch_size: int = 16,
                 load_draft: Callable[[str], tuple[CausalLM, object]] | None = None) -> None:
        super().__init__(target, tokenizer, max_batch_size=max_batch_size, load_draft=load_draft)
        # Built methods by config, the least recently used past MAX_BUILT_METHODS: each request may name its own
        # options, and a server must not keep a method for every set ever asked for.
        self._methods: OrderedDict[MethodConfig, _Method] = OrderedDict()
        # Methods that draft from a memory, by config and memory; the least recently used go past
        # MAX_BUILT_METHODS (a sequence in flight keeps its own method).
        self._memory_methods: OrderedDict[tuple[MethodConfig, OutputMemory], _Method] = OrderedDict()
        self.cache = RaggedCache(target)

    # -- requests -----------------------------------------------------------------------------------------------

    def method(self, config: MethodConfig, memory: OutputMemory | None = None) -> _Method:
        """The batched drafter + verifier for ``config`` (drafting from ``memory`` too, if given), built once;
        raises if the method cannot batch."""
        if memory is not None:
            return recently_used(self._memory_methods, (config, memory), lambda: self._build(config, memory))
        return recently_used(self._methods, config, lambda: self._build(config, None))

    def _build(self, config: MethodConfig, memory: OutputMemory | None) -> _Method:
        mirrors = list(self.target.mirrors)
        try:
            drafter, verifier = build_method(MethodContext(config, self.target, self.tokenizer, self._draft_model,
                                                           memory))
            if not isinstance(verifier, BATCHABLE_VERIFIERS):
                raise UnsupportedOptionError(
                    f"method '{config.name}' cannot run batched: its verifier ({type(verifier).__name__}) is not a "
                    "chain verifier; batched methods are ar, pld, corpus and sps")
            return _Method(batch_drafter_for(drafter, config.name), verifier,
                           bool(getattr(drafter, "never_drafts", False)))
        except BaseException:
            # A head bound for a method then refused had attached a feature mirror to the shared target, one more
            # per refused request: the target would fill every one of them on its next forward.
            for mirror in [m for m in self.target.mirrors if not any(m is kept for kept in mirrors)]:
                self.target.detach_feature_mirror(mirror)
            raise

    def _new_sequence(self, seq_id: int, request: BatchRequest, generator: torch.Generator) -> _Sequence:
        end = min(len(request.prompt_ids) + request.config.max_new_tokens, self.target.max_context)
        grammar = request.config.grammar
        return _Sequence(seq_id, request, self.method(request.method, request.memory), generator,
                         list(request.prompt_ids), end, grammar=None if grammar is None else grammar.start())

    def _drop_active(self, seq_id: int) -> None:
        self._leave({seq_id})

    def _join(self) -> None:
        while self.waiting and len(self.active) < self.max_batch_size:
            seq = self.waiting.popleft()
            start = time.perf_counter()
            self.cache.add(seq.seq_id, seq.tokens[:-1])  # the cache holds every committed token but the last
            seq.method.drafter.add(seq.seq_id, seq.tokens)
            seq.stats.prefill_seconds = time.perf_counter() - start
            self.active[seq.seq_id] = seq

    def _leave(self, seq_ids: set[int]) -> None:
        self.cache.remove(seq_ids)
        for seq_id in seq_ids:
            seq = self.active.pop(seq_id)
            seq.method.drafter.remove({seq_id})

    # -- the round ----------------------------------------------------------------------------------------------

    def step(self) -> list[BatchEvent]:
        """Admit waiting requests, run one round for every active sequence, return what each one got."""
        events = self._admit()
        if not self.active:
            return events
        rows = [self.active[seq_id] for seq_id in self.cache.row_ids]

        # 1. Draft, per method group, each sequence leaving room for the token the target always adds.
        t0 = time.perf_counter()
        drafts: dict[int, object] = {}
        groups: dict[int, list[_Sequence]] = {}
        # A fault in one request's grammar fit or verification ends that request alone (its row still goes through
        # the round's forward, with no draft, and leaves the batch at the end of the round); the others go on.
        failed: dict[int, Exception] = {}
        for seq in rows:
            groups.setdefault(id(seq.method), []).append(seq)
        for group in groups.values():
            proposed = group[0].method.drafter.propose(
                [s.seq_id for s in group], [s.tokens for s in group], [s.end - len(s.tokens) - 1 for s in group],
                [s.request.config.sampling for s in group], [s.generator for s in group])
            for seq, draft in zip(group, proposed):
                if not draft.is_chain:
                    raise UnsupportedOptionError("the batched engine verifies chain drafts only")
                assert draft.num_nodes <= seq.end - len(seq.tokens) - 1, "drafter exceeded its draft budget"
                seq.own_nodes = draft.num_nodes
                if seq.grammar is not None:  # as the single-sequence loop does (core/grammar.py)
                    try:
                        fitted = seq.grammar.fit(draft, 0 if seq.method.never_drafts else seq.end - len(seq.tokens) - 1)
                        draft, seq.masks, seq.own_nodes = fitted.draft, fitted.masks, fitted.own
                    except Exception as error:
                        log.exception("request %d failed in its drafting", seq.seq_id)
                        failed[seq.seq_id] = error
                        draft = Draft([])  # its row in the forward, which nothing reads
                drafts[seq.seq_id] = draft
        t1 = time.perf_counter()

        # 2. Score every row's pending token and draft in one forward (dummy tokens pad the shorter drafts).
        logits = self.cache.forward([[seq.tokens[-1]] + drafts[seq.seq_id].token_ids for seq in rows])

        # 3. Verify each row on its own slice, with its own sampling settings and generator.
        keep: list[int] = []
        num_accepted: dict[int, int] = {}
        finished: dict[int, str] = {}
        for r, seq in enumerate(rows):
            draft = drafts[seq.seq_id]
            config = seq.request.config
            before = len(seq.tokens)
            if seq.seq_id not in failed:
                try:
                    rows_logits = verified_logits(logits[r, :draft.num_nodes + 1], draft, seq.tokens,
                                                  len(seq.request.prompt_ids), config, seq.masks)
                    verdict = seq.method.verifier.verify(draft, rows_logits, config.sampling, seq.generator)
                    new_tokens, stopped = committed_tokens(verdict.token_ids, config.eos_token_ids)
                    if seq.grammar is not None:
                        seq.grammar.advance(new_tokens[:-1] if stopped else new_tokens)
                except Exception as error:
                    log.exception("request %d failed in its verification", seq.seq_id)
                    failed[seq.seq_id] = error
            if seq.seq_id in failed:
                keep.append(before)
                finished[seq.seq_id] = "error"
                events.append(BatchEvent(seq.seq_id, [], "error", stats=seq.stats, error=failed[seq.seq_id]))
                continue
            seq.masks = None
            keep.append(before + verdict.num_accepted)
            num_accepted[seq.seq_id] = min(verdict.num_accepted, seq.own_nodes)  # what its drafter proposed
            seq.tokens.extend(new_tokens)
            if stopped or len(seq.tokens) >= seq.end:
                finished[seq.seq_id] = "stop" if stopped else "length"
            depths = tree_depths(draft.node_parents())
            kept = kept_draft_tokens(verdict.num_accepted, new_tokens)
            forced = max(0, kept - seq.own_nodes)  # a grammar's forced tokens follow the drafter's own
            for stats in (seq.stats, self.stats):
                stats.record(depths, kept, len(new_tokens), forced)
            # (the rows are whole here: no screen)
            logprobs = (None if config.logprobs is None else token_logprobs(
                logits[r, committed_rows(verdict.accepted, new_tokens)], new_tokens, config.logprobs))
            events.append(BatchEvent(seq.seq_id, new_tokens, finished.get(seq.seq_id), draft.num_nodes, kept,
                                     seq.stats if seq.seq_id in finished else None, num_forced=forced,
                                     logprobs=logprobs))
        t2 = time.perf_counter()
        for stats in [self.stats] + [seq.stats for seq in rows]:
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1

        # 4. Commit: rows keep what they accepted; finished rows leave; drafters learn what each row kept.
        self.cache.truncate(keep)
        self._leave(set(finished))
        for group in groups.values():
            alive = [s for s in group if s.seq_id not in finished]
            if alive:
                alive[0].method.drafter.commit([s.seq_id for s in alive], [s.tokens for s in alive],
                                               [num_accepted[s.seq_id] for s in alive])
        return events
