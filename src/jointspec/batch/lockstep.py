"""Batched decoding on the single-sequence loop: each request its own decoder, every round's target forwards as one.

:class:`~jointspec.batch.engine.BatchEngine` batches by rewriting the round for a ragged batch, so it runs only the
methods it has batched forms for. This engine batches the other way round: every request gets exactly what
``jointspec generate`` runs for it (a :class:`~jointspec.core.loop.SpeculativeDecoder` over its own fork of the
target, with the method's own drafter and verifier: ``default``, trees, trained heads, lookup, anything), and the
engine runs the rounds of all of them in lockstep:

1. each sequence drafts (``SpeculativeDecoder.begin_round``) and says what its target must score;
2. one call scores every sequence's pending token and draft (:func:`jointspec.backends.hf.forward_many`): on
   jointspec's compiled CPU layers the decoder weights are read once for all of them, and every row is computed
   alone, so each sequence's logits are the bits its own forward would give;
3. each sequence verifies and commits (``SpeculativeDecoder.finish_round``).

So a request's tokens are the tokens ``generate`` gives it with the same model, method and seed, whatever else is in
the batch and whenever it joined (``tests/test_batch_lockstep.py``). Prompts are read one at a time before they
join (a prefill takes GEMM kernels that are not row by row, and ``generate`` runs it alone too), about
``PREFILL_CHUNK`` tokens a round: a long prompt is read over several rounds, in the very chunks ``generate`` reads it
in, while the requests already decoding keep getting tokens. With a prompt cache (``prompt_cache_bytes``), a prompt
that begins with a finished request's tokens (a chat's next turn) takes that request's cache and reads only the rest
(:mod:`jointspec.batch.prompt_cache`: the entries it reuses are the bits its own prefill would write).

Where the target has no compiled layers (a float32 model), step 2 runs the forwards one after another: still
correct, with none of the batching gain; :func:`engine_for` then picks the ragged engine, unless the method is one
only this engine runs.

Load-aware drafting: a draft that pays for one sequence alone can cost the batch more than it gains once the forward is
busy with other rows. Each round the engine tells every cost-aware drafter (chains, and Lookahead's trie) the cost curve
that its draft tokens have at the current batch size (:func:`batch_cost_curve`), so drafts shrink, and stop, as the
batch fills. The curve is of the request's own kind of rows: a sampled row without a top-k reads every logit of the
exact head, and costs more than a greedy one, which may read the screened head's argmax (or a sampled one with a top-k,
its k largest; rows drawn through the screen with temperature alone are priced as exact ones, the dearer kind their
rounds with model drafts read). A stopped drafter must still learn
when drafting starts to pay again; a probe that tells it costs a whole extra row in a batch, so a lookup drafter
learns instead from shadow tests (its skipped drafts scored against the tokens the target commits, at no cost;
:mod:`jointspec.drafters.costaware`), and any other cost-aware drafter probes within :data:`BATCH_PROBE_BUDGET`.
The curve is a model measured once; the engine also measures its own rounds at each batch size of two or more with
the drafts of such rows run and held off, and holds them off where rounds without them commit more tokens a second
(:mod:`jointspec.batch.supervisor`; batches of greedy rows of lossless methods drafting by lookup, whose tokens that
cannot change).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from jointspec.backends import hf
from jointspec.backends.hf import CausalLM, forward_many
from jointspec.batch.engine import BatchEngine, BatchEvent, BatchRequest, EngineBase, recently_used
from jointspec.batch.prompt_cache import PromptCache
from jointspec.batch.supervisor import DraftSupervisor
from jointspec.core.errors import JointspecError, UnsupportedOptionError
from jointspec.core.loop import DecodeState, SpecStats, SpeculativeDecoder
from jointspec.drafters.beam import BeamDrafter
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve, measure_cost_curve
from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
from jointspec.drafters.memory import OutputMemory
from jointspec.drafters.ngram import PromptLookupDrafter
from jointspec.drafters.tree_gate import GatedTreeDrafter
from jointspec.drafters.treecache import DraftTreeCache
from jointspec.drafters.trie import TrieLookupDrafter
from jointspec.drafts.eagle import context_logits_many
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.methods.registry import method_is_batched, method_is_lossless, method_names

log = logging.getLogger(__name__)


def compiled_target(target) -> bool:
    """Whether ``target`` runs on jointspec's compiled CPU layers, where :func:`forward_many` batches."""
    lean = getattr(target, "lean", None)
    return isinstance(target, CausalLM) and lean is not None and lean.compiled is not None


def prompt_rows_alone(target) -> bool:
    """Whether ``target`` computes every row of a prompt alone (the compiled layers reading prompts row by row), so a
    cache entry's bits do not depend on the forward that wrote it (:mod:`jointspec.batch.prompt_cache`). The AVX2
    builds do so for a prompt's first positions only (``CausalLM.alone_positions``)."""
    return compiled_target(target) and target.lean.prefill_gemm_rows == math.inf


def engine_description(engine) -> str:
    """What batching ``engine`` gives, in a few words (the server says it at start-up)."""
    if isinstance(engine, LockstepEngine):
        if compiled_target(engine.target):
            return "lockstep engine: each request decoded as generate decodes it, one pass of the weights a round"
        return "lockstep engine without compiled layers: each request decoded as generate does, one after another"
    return "ragged engine: one transformers forward over the padded batch (chain methods)"


def engine_for(target, tokenizer=None, method: MethodConfig | None = None, *, max_batch_size: int = 16,
               load_draft=None, prompt_cache_bytes: int = 0):
    """The batched engine for ``target`` (and the server's ``method``): lockstep on the compiled CPU layers (every
    method, ``generate``'s tokens, one pass of the weights a round); elsewhere the ragged-cache engine (chain methods,
    one transformers forward over the padded batch), unless ``method`` is one it cannot batch: then lockstep too, whose
    rounds there run the sequences' forwards one after another (correct, without the batching gain).
    ``prompt_cache_bytes``: the lockstep engine's prompt cache (the ragged engine keeps none)."""
    options = dict(max_batch_size=max_batch_size, load_draft=load_draft)
    if compiled_target(target):
        return LockstepEngine(target, tokenizer, **options, prompt_cache_bytes=prompt_cache_bytes)
    if not target.capabilities.trees:  # keys placed by cache slot (backends/hf.py, slot_position_reason): the
        # ragged cache's holes would move them
        log.warning("%s: decoding every request with its own loop and cache, the sequences of a round one after "
                    "another", target.capabilities.chains_only)
        return LockstepEngine(target, tokenizer, **options, prompt_cache_bytes=prompt_cache_bytes)
    try:
        ragged = BatchEngine(target, tokenizer, **options)
    except UnsupportedOptionError:  # (sliding-window layers, gpt-oss's and Gemma-3's, or Gemma 3n's shared ones)
        log.warning("%s: its sliding-window or shared cache layers are not batched; decoding every request with its "
                    "own loop and cache, the sequences of a round one after another", target.name)
        return LockstepEngine(target, tokenizer, **options, prompt_cache_bytes=prompt_cache_bytes)
    if method is not None:
        try:
            ragged.method(method)
        except UnsupportedOptionError as error:
            lockstep = LockstepEngine(target, tokenizer, **options, prompt_cache_bytes=prompt_cache_bytes)
            lockstep.method(method)  # a method neither engine runs is refused with its own reason, and no warning
            log.warning("%s; decoding every request with its own loop, the sequences of a round one after another",
                        error)
            return lockstep
    return ragged


# Drafters that read their ``curve`` afresh every round, so the batch's can replace it: cost-aware chains choose their
# length from it, Lookahead's trie its number of nodes, `default`'s lookup-or-tree and the gated trees of `specinfer`
# and `spectr` whether their tree pays.
LOAD_AWARE_DRAFTERS = (CostAwareDrafter, TrieLookupDrafter, LookupOrTreeDrafter, GatedTreeDrafter)

# The batch's cost curve reaches past one sequence's drafts: a full batch scores tens of rows a forward. Every size up
# to 17 and both sides of the larger multiples of 8: the kernels take input rows in tiles (8 on AVX-512, 4 elsewhere),
# and a forward one row past a whole tile costs a step more (a ninth row about 1.6 rows' time), which a curve
# interpolated across it hid: a batch of eight then drafted rows that cost more than they gained.
BATCH_CURVE_SIZES = (*range(1, 18), 24, 25, 32, 33, 48, 49, 64, 65)

# In a round of several sequences a cost-aware drafter's probes may cost at most this share of the rounds
# (CostAwareDrafter.probe_budget): an extra row costs there about what a row's share of the round does
# (docs/lab/serving.md, "Probes that wait out their cost").
BATCH_PROBE_BUDGET = 0.1

# And the lookups behind its shadow tests at most this share (CostAwareDrafter.shadow_budget): on a small model a
# lookup drafter's peek costs a few per cent of a batch row's share of a round.
BATCH_SHADOW_BUDGET = 0.02


def batch_cost_curve(curve: CostCurve, other_rows: int) -> CostCurve:
    """The cost curve one sequence's draft sees in a batch forward that also scores ``other_rows`` other rows.

    ``curve`` gives the cost of one forward of n rows. In the batch, a sequence that feeds n rows pays its share of
    the rows the forward scores anyway plus what its extra rows add: ``T_b(n) = T(b + 1) / (b + 1) + T(b + n) -
    T(b + 1)`` for ``b`` other rows. Alone (b = 0) that is ``T(n)``; in a full batch an extra row costs about what a
    row's share does, so a draft pays only where its tokens are accepted nearly as often as they cost, and
    :func:`~jointspec.drafters.costaware.choose_num_draft_tokens` then drafts nothing: the batch decodes as
    batched ``ar`` would. The draft cost per token stays the drafter's own.
    """
    if other_rows <= 0:
        return curve
    base = curve.cost(other_rows + 1)
    share = base / (other_rows + 1)
    return CostCurve({n: share + curve.cost(other_rows + n) - base for n in curve.sizes},
                     curve.draft_cost_per_token)


def sampled_rows_curve(greedy: CostCurve, sampled: CostCurve) -> CostCurve:
    """The batch's cost of sampled rows: the greedy rows' curve plus the exact head's share, a line ``a + h n`` fitted
    by least squares to the two measured curves' difference at every size they share.

    A sampled row differs from a greedy one only in its head (every logit of the exact head, not the screened
    argmax), whose cost grows with the rows as a line. The sampled curve measured alone has the noise of each size's
    own median: a size measured high makes the next ones flat under the running maximum, and a full batch then prices
    its next rows as free and drafts rows that cost it more than they gain (docs/lab/benchmarks.md, section 49).
    Fitted over every size, one noisy median moves the line little.
    """
    sizes = [n for n in greedy.sizes if n in sampled.target_cost]
    if len(sizes) < 2:
        return sampled
    differences = [sampled.target_cost[n] - greedy.target_cost[n] for n in sizes]
    mean_n, mean_d = sum(sizes) / len(sizes), sum(differences) / len(sizes)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = max(0.0, sum((n - mean_n) * (d - mean_d) for n, d in zip(sizes, differences)) / spread)
    base = mean_d - slope * mean_n
    # Never below the greedy rows' own cost: the exact head does not make a forward cheaper.
    return CostCurve({n: cost + max(0.0, base + slope * n) for n, cost in greedy.target_cost.items()},
                     greedy.draft_cost_per_token)


def load_aware_parts(drafter) -> list:
    """The parts of a request's drafter that take the batch's cost curve: the drafter itself where it is load-aware,
    and the lookup half of `default`'s lookup-or-tree drafter as well."""
    if not isinstance(drafter, LOAD_AWARE_DRAFTERS):
        return []
    return [drafter.lookup, drafter] if isinstance(drafter, LookupOrTreeDrafter) else [drafter]


def drafts_by_lookup(drafter) -> bool:
    """Whether a load-aware drafter drafts by lookup alone (cost-aware prompt or corpus lookup, Lookahead's trie and
    its kin), with no draft model or head: a round whose drafts are held off then costs it nothing later, so rounds
    with and without drafts compare fairly (batch/supervisor.py). A model's drafter catches up on the tokens of the
    rounds it skipped in its next draft, which would be measured against drafting."""
    if isinstance(drafter, CostAwareDrafter):
        return isinstance(drafter.inner, PromptLookupDrafter)
    return isinstance(drafter, TrieLookupDrafter)  # (sized by the cost curve: load-aware itself)


def beam_context_cache(drafter) -> DraftTreeCache | None:
    """The draft cache of MTAD's beam drafter (cost-aware or not), whose every draft begins with the draft's logits
    after the committed text; None for any other drafter."""
    inner = drafter.inner if isinstance(drafter, CostAwareDrafter) else drafter
    return inner.cache if isinstance(inner, BeamDrafter) else None


@dataclass(frozen=True)
class RoundRecord:
    """One round of the lockstep engine, for whoever studies what its forwards cost (``LockstepEngine.on_round``):
    how many sequences it scored, how many input rows (each sequence's pending token plus its draft), the seconds of
    the one batched forward and of the whole round (drafting, the forward, verifying and committing; not the
    reading of prompts that joined before it), and the draft tokens the round accepted in all."""

    sequences: int
    rows: int
    forward_seconds: float
    accepted: int
    seconds: float
    drafted: bool = True  # False: the supervisor held every row's draft off (batch/supervisor.py)


@dataclass
class _Sequence:
    seq_id: int
    request: BatchRequest
    decoder: SpeculativeDecoder
    generator: torch.Generator
    state: DecodeState | None = None  # set when it joins
    # Each load-aware part of its drafter (by id): its own curve and probe budget, before the batch's replace them.
    own_settings: dict[int, tuple[CostCurve, float | None]] = field(default_factory=dict)
    stats: SpecStats = field(default_factory=SpecStats)
    prefilled: int = 0  # prompt tokens read so far (while waiting)
    prefill_seconds: float = 0.0
    reused: int | None = None  # prompt tokens whose entries came from the prompt cache (None: not looked yet)
    supervised: bool = False  # a lossless method's lookup drafts: they may be held off (batch/supervisor.py)


class LockstepEngine(EngineBase):
    """Decodes many requests together, each by its own decoder (module docstring). The same interface as
    :class:`~jointspec.batch.engine.BatchEngine`. Not thread-safe: one thread calls ``submit``/``cancel``/``step``."""

    def __init__(self, target: CausalLM, tokenizer=None, *, max_batch_size: int = 16,
                 load_draft: Callable[[str], tuple[CausalLM, object]] | None = None,
                 prompt_cache_bytes: int = 0, supervise_drafts: bool = True) -> None:
        super().__init__(target, tokenizer, max_batch_size=max_batch_size, load_draft=load_draft)
        # Rounds with drafts held off where they measure faster (batch/supervisor.py); None: drafts as chosen.
        self.supervisor = DraftSupervisor() if supervise_drafts else None
        self.prefill_tokens_per_round = hf.PREFILL_CHUNK
        # Finished requests' caches for prompts that begin with their tokens (0 bytes: none kept).
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        # Configs whose method was checked, the most recently used MAX_BUILT_METHODS (each request may name its own),
        # and whether each is load-aware.
        self._checked: OrderedDict[MethodConfig, bool] = OrderedDict()
        # The batch's cost curves, measured once each: greedy rows (read through the screened head where the target
        # has one) and sampled rows (every row's exact logits), by whether they are sampled (_batch_curve).
        self._curves: dict[bool, CostCurve] = {}
        self._costs_set_for: tuple[int, ...] = ()  # the sequences whose drafters got this batch's costs
        # Called with each round's RoundRecord where set (benchmarks/lockstep_methods.py --rounds-log); None: nothing.
        self.on_round: Callable[[RoundRecord], None] | None = None
        # MTAD's first head call a round made for every request in one pass (_batch_head_calls); False: each alone.
        self.batch_head_calls = True

    # -- requests -----------------------------------------------------------------------------------------------

    def _decoder(self, config: MethodConfig, memory: OutputMemory | None = None) -> SpeculativeDecoder:
        """A decoder for one request: the method built on a fork of the target, as ``generate`` builds it."""
        fork = self.target.fork(self.target.name)
        drafter, verifier = build_method(MethodContext(config, fork, self.tokenizer, self._draft_model, memory))
        return SpeculativeDecoder(fork, drafter, verifier)

    def method(self, config: MethodConfig) -> bool:
        """Raise the error ``config`` would meet (an unknown method, a draft this engine cannot load), once; return
        whether it is load-aware. A load-aware method also has the batch's cost curve measured now (a few seconds,
        once), not in a round."""
        return recently_used(self._checked, config, lambda: self._check(config))

    def check(self, request: BatchRequest) -> None:
        # A sampled request's drafts are priced by the sampled rows' curve: measured now too, not in a round.
        super().check(request)
        if self._reads_exact_rows(request) and self.method(request.method):
            self._batch_curve(sampled=True)

    def _reads_exact_rows(self, request: BatchRequest) -> bool:
        """Whether ``request``'s verified rows are priced as reading every logit of the exact head: sampled, without a
        top-k that the target's screen completes (SpeculativeDecoder.start says which rows read what). Rows drawn
        through the screen (temperature alone, drafts without probabilities) cost less, but the same request's rounds
        with model drafts read the exact head: they are priced as exact rows, the dearer."""
        sampling, capabilities = request.config.sampling, self.target.capabilities
        if request.config.grammar is not None and not capabilities.screen_masks:  # masked rows: every logit
            return True
        if request.config.penalties.active:  # penalised rows: every logit (core/penalties.py)
            return True
        return not sampling.greedy and not capabilities.screened_top_k(sampling)

    def _check(self, config: MethodConfig) -> bool:
        if config.name in method_names() and not method_is_batched(config.name):  # (an unknown name: the build says)
            raise UnsupportedOptionError(f"method '{config.name}' is not batched: it drafts on a thread of its own "
                                         "while its target verifies, and a batch's forward already takes every core; "
                                         "use 'default' or 'sps'")
        drafter = self._decoder(config).drafter
        if isinstance(drafter, LOAD_AWARE_DRAFTERS):
            self._batch_curve()
            return True
        return False

    def _new_sequence(self, seq_id: int, request: BatchRequest, generator: torch.Generator) -> _Sequence:
        decoder = self._decoder(request.method, request.memory)
        supervised = method_is_lossless(request.method.name) and drafts_by_lookup(decoder.drafter)
        return _Sequence(seq_id, request, decoder, generator, supervised=supervised)

    def _drop_active(self, seq_id: int) -> None:
        del self.active[seq_id]

    def _join(self) -> None:
        """Read waiting prompts, at most about ``prefill_tokens_per_round`` tokens a round; a request whose prompt
        is read joins the batch. A long prompt is read in the chunks ``generate`` reads it in (the target's
        ``prefill_chunk_end``), about ``prefill_tokens_per_round`` tokens of them a round, so that the requests already
        decoding keep getting tokens meanwhile, and its cache holds the same bits as ``generate``'s."""
        budget = self.prefill_tokens_per_round
        while self.waiting and len(self.active) < self.max_batch_size:
            seq = self.waiting[0]
            prompt = list(seq.request.prompt_ids)
            end = len(prompt) - 1  # the loop caches every prompt token but the last
            if seq.reused is None:
                seq.reused = self._reuse(seq.decoder.target, prompt, end)
                seq.prefilled = seq.reused
            if seq.prefilled < end:
                if budget <= 0:
                    return
                start = time.perf_counter()
                stop = seq.decoder.target.prefill_chunk_end(seq.prefilled, end)
                seq.decoder.target.forward(prompt[seq.prefilled:stop], num_logits=0)
                budget -= stop - seq.prefilled
                seq.prefilled = stop
                seq.prefill_seconds += time.perf_counter() - start
            if seq.prefilled == end:
                self.waiting.popleft()
                seq.state = seq.decoder.start(prompt, seq.request.config, seq.generator, prefilled=True)
                seq.stats = seq.decoder.stats
                seq.stats.prefill_seconds += seq.prefill_seconds
                seq.stats.prompt_tokens_reused = seq.reused
                self.active[seq.seq_id] = seq

    def _caches_prompts(self, target: CausalLM) -> bool:
        """Whether ``target``'s finished caches are kept and its new ones taken from the kept: not where a head's
        mirror would need the features too, nor a hybrid model's convolution or recurrent states, which a kept
        cache's keys and values do not carry and a crop into its prompt could not take back."""
        return bool(self.prompt_cache.max_bytes) and not target.mirrors and not getattr(target.cache, "convolutions",
                                                                                          None)

    def _reuse(self, target: CausalLM, prompt: list[int], end: int) -> int:
        """Give ``target`` (a new request's, empty) the kept cache serving most of ``prompt[:end]``; returns how many
        of its entries it now holds."""
        if not self._caches_prompts(target):
            return 0
        taken = self.prompt_cache.take(prompt, end, None if prompt_rows_alone(target) else target.prefill_chunk,
                                       alone=target.alone_positions)
        if taken is None:
            return 0
        cache, length, owned = taken
        if owned:
            target.cache, target.num_cached = cache, cache.get_seq_length()
            target.crop(length)
            return length
        with torch.inference_mode():  # the same entries, into the new request's own (empty) cache
            for mine, theirs in zip(target.cache.layers, cache.layers):
                if theirs.keys is not None:  # (not a layer that holds none: Gemma 3n's that read another's entries)
                    mine.update(theirs.keys[..., :length, :], theirs.values[..., :length, :])
        target.num_cached = length
        return length

    def _keep_cache(self, seq: _Sequence) -> None:
        """Offer a finished request's cache to the prompt cache, with the tokens its entries hold."""
        target, state = seq.decoder.target, seq.state
        if not self._caches_prompts(target) or state is None:
            return
        held = min(target.num_cached, len(state.tokens))
        target.crop(held)
        # Rows not computed alone: past the leading positions read row by row (target.alone_positions, AVX2), only
        # its prompt's whole chunks are what another prompt's prefill writes for the same tokens.
        chunk, end, alone = target.prefill_chunk, len(seq.request.prompt_ids) - 1, target.alone_positions
        canonical = None if prompt_rows_alone(target) else alone + max(0, end - alone) // chunk * chunk
        self.prompt_cache.keep(state.tokens[:held], target.cache, canonical)
        target.reset()  # the cache is the prompt cache's now

    # -- the round ----------------------------------------------------------------------------------------------

    def step(self) -> list[BatchEvent]:
        """Admit waiting requests, run one round for every active sequence, return what each one got."""
        events = self._admit()
        if not self.active:
            return events
        round_start = time.perf_counter()
        self._set_draft_costs(list(self.active.values()))
        key = self._supervision_key()
        drafts = key is None or self.supervisor.drafts(key)
        shared = self._batch_head_calls(list(self.active.values())) if self.batch_head_calls and drafts else {}
        rows, calls = [], []
        for seq in list(self.active.values()):
            try:
                calls.append(seq.decoder.begin_round(seq.state, hold_draft=not drafts))
                seq.state.draft_seconds += shared.get(seq.seq_id, 0.0)  # its share of the head call made for all
                rows.append(seq)
            except Exception as error:  # its own options refused (say, a draft past the target's rows), or a fault
                if not isinstance(error, JointspecError):
                    log.exception("request %d failed in its drafting", seq.seq_id)
                del self.active[seq.seq_id]
                events.append(BatchEvent(seq.seq_id, [], "error", stats=seq.stats, error=error))
        if not rows:
            return events
        start = time.perf_counter()
        outputs = forward_many([seq.decoder.target for seq in rows], calls)
        forward_seconds = time.perf_counter() - start
        accepted = committed = 0
        for seq, output in zip(rows, outputs):
            state = seq.state
            try:
                new_tokens = seq.decoder.finish_round(state, output, defer_logprobs=True)
            except Exception as error:  # a fault in this request's verification: it ends alone, the round goes on
                log.exception("request %d failed in its verification", seq.seq_id)
                state.pending_logprobs = None  # (it gets its error, not figures)
                del self.active[seq.seq_id]
                events.append(BatchEvent(seq.seq_id, [], "error", stats=seq.stats, error=error))
                continue
            self.stats.record(state.depths, state.num_accepted, len(new_tokens), state.num_forced)
            self.stats.draft_seconds += state.draft_seconds
            accepted += state.num_accepted
            committed += len(new_tokens)
            finish = None
            if state.done:
                finish = "stop" if state.stopped else "length"
                del self.active[seq.seq_id]
                self._keep_cache(seq)
            events.append(BatchEvent(seq.seq_id, new_tokens, finish, len(state.depths), state.num_accepted,
                                     seq.stats if finish else None, depths=list(state.depths),
                                     num_forced=state.num_forced,
                                     logprobs=state.logprobs if state.config.logprobs is not None else None))
        self._complete_logprobs(rows, events)  # (each event's figures list, filled in place)
        round_seconds = time.perf_counter() - round_start
        if key is not None and len(rows) == key:  # (a row refused its round: not the batch that was decided)
            self.supervisor.record(key, drafts, committed, round_seconds)
        if self.on_round is not None:
            self.on_round(RoundRecord(len(rows), sum(len(call.token_ids) for call in calls), forward_seconds,
                                      accepted, round_seconds, drafts))
        return events

    def _complete_logprobs(self, rows: list[_Sequence], events: list[BatchEvent]) -> None:
        """The committed tokens' log-probabilities of every sequence whose round left them pending (a screened
        forward: core/loop.py, ``finish_round(defer_logprobs=True)``), their rows' exact logits read in one call of
        the head for all of them rather than one a sequence: each row is computed alone there, so every sequence
        gets the bits its own call gives. A sequence whose figures cannot be made ends with an error, alone."""
        pending = [seq for seq in rows if seq.state is not None and seq.state.pending_logprobs is not None]
        if not pending:
            return
        from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

        hidden = [seq.state.pending_logprobs[0] for seq in pending]
        try:
            whole = torch.cat([self.target.logits_of(piece) for piece in torch.cat(hidden).split(ROWWISE_MAX_ROWS)])
            parts = whole.split([len(h) for h in hidden])
        except Exception:  # a fault: each sequence alone, so that one that fails ends alone
            log.exception("the round's log-probabilities failed in one call; reading them a sequence at a time")
            parts = [None] * len(pending)
        for seq, part in zip(pending, parts):
            state = seq.state
            rows_hidden, new_tokens = state.pending_logprobs
            try:
                seq.decoder.complete_logprobs(state, part if part is not None else
                                              seq.decoder.target.logits_of(rows_hidden), new_tokens)
            except Exception as error:
                log.exception("request %d failed in its log-probabilities", seq.seq_id)
                self.active.pop(seq.seq_id, None)
                events[:] = [e for e in events if e.seq_id != seq.seq_id]
                events.append(BatchEvent(seq.seq_id, [], "error", stats=seq.stats, error=error))

    def _batch_head_calls(self, rows: list[_Sequence]) -> dict[int, float]:
        """The first head call of this round's MTAD drafts (each request's head's logits after its committed text,
        :func:`beam_context_cache`), made for every such request in one pass of the head's weights: each request's
        drafter then finds its logits there, the bits its own call gives (drafts/eagle.py, ``context_logits_many``).
        A request alone calls its head itself, as ``generate`` does. Returns each served request's share of the
        pass's seconds (by its rows), which its drafting is charged: its round's draft time, and what a cost-aware
        drafter learns its draft's cost from."""
        # (request, its draft cache, the tokens its head call feeds), grouped by head: requests may name other heads.
        groups: dict[int, list[tuple[_Sequence, DraftTreeCache, list[int]]]] = {}
        for seq in rows:
            cache = beam_context_cache(seq.decoder.drafter)
            state = seq.state
            if cache is None or state.end - len(state.tokens) - 1 < 1:  # (no budget: it drafts nothing this round)
                continue
            tokens = cache.pending(state.tokens)
            if tokens:
                groups.setdefault(id(getattr(cache.draft, "head", cache.draft)), []).append((seq, cache, tokens))
        shares: dict[int, float] = {}
        for group in groups.values():
            if len(group) < 2:
                continue
            start = time.perf_counter()
            logits = context_logits_many([cache.draft for _, cache, _ in group], [tokens for *_, tokens in group])
            if logits is None:
                continue
            seconds = time.perf_counter() - start
            rows_fed = sum(len(tokens) for *_, tokens in group)
            for (seq, cache, tokens), out in zip(group, logits):
                cache.prime(seq.state.tokens, out)
                shares[seq.seq_id] = seconds * len(tokens) / rows_fed
                if isinstance(seq.decoder.drafter, CostAwareDrafter):
                    seq.decoder.drafter.outside_seconds = shares[seq.seq_id]
        return shares

    def _supervision_key(self) -> int | None:
        """The supervisor's key for this round's batch (its size), or None where the batch is not supervised: one
        request alone (it drafts as ``generate`` does, on its own curve), a row whose drafts are not load-aware
        lookups (fixed drafts, a model's or a head's, MTAD's), or a sampled row (the server repeats a seed's text)."""
        if self.supervisor is None or len(self.active) < 2 or not all(
                seq.supervised and seq.request.config.sampling.greedy for seq in self.active.values()):
            return None
        return len(self.active)

    def _set_draft_costs(self, rows: list[_Sequence]) -> None:
        """Give each cost-aware drafter the cost its draft tokens have in this round's batch (module docstring): its
        own curve alone, as ``generate`` gives it, else :func:`batch_cost_curve` of the engine's wider curve, and
        then also :data:`BATCH_PROBE_BUDGET` for its probes and shadow tests in their place where it can have
        them."""
        members = tuple(seq.seq_id for seq in rows)
        if members == self._costs_set_for:  # the same batch as last round: every setting still stands
            return
        self._costs_set_for = members
        # By draft cost per token and by sampled rows or not: the rows of one method and kind share one curve.
        curves: dict[tuple[float, bool], CostCurve] = {}
        alone = len(rows) == 1
        for seq in rows:
            # What its rows read, as its decoder chose it when it started (before that, from its request).
            state = getattr(seq, "state", None)
            sampled = (not (state.argmax_only or state.top_k_only) if state is not None
                       else self._reads_exact_rows(seq.request))
            for part in load_aware_parts(seq.decoder.drafter):
                own_curve, own_budget = seq.own_settings.setdefault(
                    id(part), (part.curve, getattr(part, "probe_budget", None)))
                if isinstance(part, CostAwareDrafter):
                    part.probe_budget = own_budget if alone else BATCH_PROBE_BUDGET
                    part.shadow_tests = not alone
                    part.shadow_budget = None if alone else BATCH_SHADOW_BUDGET
                if alone:
                    part.curve = own_curve
                    continue
                key = (own_curve.draft_cost_per_token, sampled)
                if key not in curves:
                    curves[key] = batch_cost_curve(self._batch_curve(sampled).with_draft_cost(key[0]), len(rows) - 1)
                part.curve = curves[key]

    @property
    def batch_curves(self) -> dict[str, CostCurve]:
        """The target's measured costs by rows per forward that a full batch's drafts were priced by (seconds): by
        "greedy" and "sampled" rows, those measured so far (none before a load-aware method first needed one;
        "greedy" alone prices both where the target has no screened head). What a benchmark records beside the rounds
        it priced."""
        return {("sampled" if sampled else "greedy"): curve for sampled, curve in sorted(self._curves.items())}

    def _batch_curve(self, sampled: bool = False) -> CostCurve:
        """The target's cost by rows per forward up to a full batch's, measured once (memoised per model). Sampled
        rows (``sampled``) are timed with every row's exact logits, as sampled verification reads them: on a target
        whose greedy rows take a screened head, a sampled row costs the exact head's row besides, which a sampled
        request's extra rows must be priced by (docs/lab/serving.md, section 11, "Sampled requests under load"): the
        greedy curve plus that share, fitted (:func:`sampled_rows_curve`)."""
        key = sampled and self.target.capabilities.argmax_screen  # without a screen the two kinds are one curve
        if key not in self._curves:
            room = self.target.max_context - 1
            sizes = tuple(n for n in BATCH_CURVE_SIZES if 2 * n <= room) or (1, 2)
            measured = measure_cost_curve(self.target.fork("cost probe"), sizes=sizes,
                                          context_tokens=min(128, room - sizes[-1]), argmax_only=not key)
            self._curves[key] = sampled_rows_curve(self._batch_curve(), measured) if key else measured
        return self._curves[key]
