"""The engine behind the server: text in, text chunks out, every request sharing one batched engine.

A background thread owns the batched engine (:func:`~jointspec.batch.lockstep.engine_for`: lockstep on the compiled
CPU layers, else the ragged-cache engine) and runs its rounds; nothing else touches it.
Requests and cancellations reach that thread through a queue and join or leave between rounds; each round's tokens
go back to the request's asyncio loop, where :class:`TextStream` turns them into UTF-8-safe text deltas and applies
stop strings. The routes in :mod:`jointspec.server.app` see only :class:`ServingEngine`'s small protocol, so tests
can hand them a fake.

Overload and shutdown are decided here, not in the routes, because only this class knows what is in flight: at most
``max_batch_size + max_queue`` requests are admitted at once and the next one is refused at once with
:class:`QueueFullError` (the route answers 429); :meth:`ServingEngine.close` ends every request still in flight with a
:class:`Failure` and refuses later ones with :class:`ShuttingDownError`, so no request is left waiting for an answer
that will never come.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Protocol

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import (
    IncrementalDetokenizer,
    TokenSpelling,
    chat_template_ids,
    decode_text,
    eos_token_ids,
)
from jointspec.batch.engine import BatchEvent, BatchRequest
from jointspec.batch.lockstep import engine_description, engine_for
from jointspec.core.errors import ContextTooLongError, JointspecError, UnsupportedOptionError
from jointspec.core.grammar import Grammar, GrammarError, OutputFormat, RecentGrammars
from jointspec.core.logprobs import TokenLogprob, check_top_logprobs, token_logprobs
from jointspec.core.loop import DecodeConfig, SpecStats
from jointspec.core.penalties import NO_PENALTIES, Penalties
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.memory import OutputMemory, forget_if_unused, memory_for
from jointspec.methods import MethodConfig, method_names, online_methods
from jointspec.methods.registry import batched_methods, method_reads, unknown_method_error, unread_options_error
from jointspec.server.metrics import EngineSnapshot, MethodStats
from jointspec.server.reasoning import (
    THINK,
    Tags,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
    reasoning_first,
    template_reasons,
)
from jointspec.server.tools import (
    HERMES,
    call_markers,
    chat_template_text,
    native_call_format,
    prompt_messages,
    template_shows_calls,
    template_tools_variable,
    template_variables,
    xml_tools,
)

log = logging.getLogger(__name__)


# Whether the server keeps a memory of earlier answers for the lookup drafters (drafters/memory.py): never, one per
# request's ``user``, or one that every request shares.
ONLINE_MEMORY_CHOICES = ("off", "user", "shared")
# The method settings a request's ``jointspec`` field may set (server/app.py's JointspecOptions checks their values),
# by the MethodConfig field each sets where its key differs from the field's name; and the settings only the server's
# command line sets. What a refusal names a setting by.
REQUEST_KEYS = ("num_draft_tokens", "max_draft_tokens", "max_ngram", "min_ngram", "draft", "beam_width",
                "accept_threshold", "cost_aware", "verify", "tree", "tree_budget")
REQUEST_FIELDS = {"max_draft_tokens": "max_num_draft_tokens"}
SERVER_ONLY_FLAGS = {"head_weights": "--head-weights"}


def request_key(field: str) -> str:
    """How a request names MethodConfig ``field``; a field no request sets is named as such."""
    key = next((key for key, name in REQUEST_FIELDS.items() if name == field), field)
    if key in REQUEST_KEYS:
        return key
    flag = SERVER_ONLY_FLAGS.get(field)
    return f"{field} (not set per request{f'; the server sets it: {flag}' if flag else ''})"


class QueueFullError(JointspecError):
    """Every row is busy and the queue is full: the request is refused at once (429 with Retry-After)."""


class ShuttingDownError(JointspecError):
    """The server is draining or closed: the request is refused (503 with Retry-After)."""


@dataclass(frozen=True)
class CompletionRequest:
    """One request, already validated by the route. Exactly one of ``prompt`` / ``messages`` is set."""

    prompt: str | list[int] | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None  # None: the server's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    penalties: Penalties = NO_PENALTIES  # repetition, presence and frequency (core/penalties.py)
    seed: int = 0
    stop: tuple[str, ...] = ()
    method: dict | None = None  # the request's "jointspec" options, overriding the server's method
    user: str | None = None  # OpenAI's end-user id: the scope of the online memory where the server keeps one per user
    output_format: OutputFormat | None = None  # structured output (response_format)
    # Each answer token's log-probability, with this many of the most likely tokens beside it; None: none.
    logprobs: int | None = None
    # Completions' echo: the answer begins with the prompt (and, with logprobs, the prompt's tokens' own figures);
    # max_tokens 0 then asks for the prompt alone (a text scored, not continued).
    echo: bool = False
    # The tools a chat's prompt shows, as OpenAI writes them (server/tools.py); empty: none.
    tools: tuple[dict, ...] = ()
    # Further variables a chat's template reads (vLLM's chat_template_kwargs: Qwen3's enable_thinking); None: none.
    template_kwargs: dict | None = None
    # The last message, an assistant's, is continued rather than answered (Anthropic's prefill).
    continue_final: bool = False
    # A chat's output_format is its content's: a reasoning model's block may come first (server/reasoning.py).
    reasoning_first: bool = False

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a request has either a prompt or messages")
        SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p)  # validates
        check_top_logprobs(self.logprobs)


@dataclass(frozen=True)
class Failure:
    """Why the engine ended a request without an answer. ``code``: "shutting_down" (the server closed under it),
    "invalid_request" (its own method refused a round: its options, not the server, are at fault; the other
    requests go on) or "engine_error" (a round raised; the other requests in that round failed too)."""

    code: str
    message: str


@dataclass
class Chunk:
    """What one round (or the end) gave a request: text, and the round's speculation figures."""

    text: str
    num_tokens: int  # the round's tokens the answer keeps: all, or those up to the one that completed a stop string
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" on the last chunk
    stats: SpecStats | None = None  # the whole request's statistics so far, on the last chunk where the engine has them
    num_rounds: int = 0  # target forwards behind this chunk: 1 for a decoded round, 0 for an end with no tokens
    num_drafted: int = 0
    num_accepted: int = 0
    num_forced: int = 0  # of num_accepted, the tokens a grammar forced (structured output)
    failure: Failure | None = None  # set when finish_reason is "error"
    token_ids: tuple[int, ...] = ()  # the round's generated ids the answer keeps (as num_tokens)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per id in token_ids, where the request asked for them
    text_cut: bool = False  # a stop string ended the text inside the ids: they say more than the text
    stop_string: str | None = None  # the stop string that ended the answer (its last chunk's), where one did


class Generation(Protocol):
    num_prompt_tokens: int
    method: str  # the method that decodes it (the server's, or the request's override)
    echo_text: str  # an echo request's prompt as text ("" otherwise)
    # A chat answer's reasoning (server/reasoning.py): whether its prompt leaves it inside a reasoning block; None
    # where the model's template writes none (and for completions).
    opens_reasoning: bool | None
    # An echo request's prompt tokens with their log-probabilities: the first token's None (nothing precedes it),
    # each later one's under the model given the tokens before it; None where the request asked for none.
    prompt_logprobs: list[tuple[int, TokenLogprob | None]] | None

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    """What the routes need. ``submit`` raises JointspecError / ValueError for requests it refuses, QueueFullError
    when full, ShuttingDownError once closed; ``close`` ends what is in flight with a Failure."""

    model_id: str
    call_format: str  # the format the model writes tool calls in (server/tools.py)
    call_markers: tuple[tuple[str, int], ...]  # that format's markers that are added tokens of the tokenizer, by id
    context_length: int  # the most tokens a sequence may hold

    async def submit(self, request: CompletionRequest) -> Generation: ...

    def encode(self, request: CompletionRequest) -> list[int]:
        """A request's prompt as the model reads it (/v1/messages/count_tokens, /tokenize)."""

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text as the tokenizer reads it (/tokenize)."""

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens spelled (/detokenize)."""

    async def submit_many(self, requests: list[CompletionRequest]) -> list[Generation]:
        """Several sequences (a request's choices, a batch of prompts), admitted together or refused together."""

    def snapshot(self) -> EngineSnapshot: ...

    def close(self) -> None: ...


async def _all_or_none(coroutines: list) -> list:
    """The coroutines' results, run side by side; the first to raise cancels the others and is raised (where
    ``asyncio.gather`` would leave them running for a caller that has already given up)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled: so are they
        for task in tasks:
            task.cancel()
        raise
    failed = next((task for task in tasks if task.done() and not task.cancelled() and task.exception()), None)
    if failed is not None:
        for task in pending:
            task.cancel()
        for task in done:  # (their errors retrieved: no "never retrieved" warnings)
            if not task.cancelled():
                task.exception()
        raise failed.exception()
    return [task.result() for task in tasks]


class TextStream:
    """Token ids in, text deltas out: no broken UTF-8 characters, and text stops before any ``stop`` string."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # every complete character decoded so far
        self.num_sent = 0  # characters of ``text`` already returned
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def push(self, token_ids: list[int]) -> tuple[str, int]:
        """The text ``token_ids`` add, and how many of them it takes: all, or those up to the one that completed a
        stop string. With stop strings the ids go in one at a time, so that a round that commits several tokens
        stops where one token a round would have: at the same token, and at the stop string that completed first."""
        if self.stopped:
            return "", 0
        if not self.stop:
            self.text += self.detokenizer.push(token_ids)
            return self._release(final=False), len(token_ids)
        delta = ""
        for used, token in enumerate(token_ids, 1):
            self.text += self.detokenizer.push([token])
            delta += self._release(final=False)
            if self.stopped:
                return delta, used
        return delta, len(token_ids)

    def finish(self) -> str:
        """The held-back rest, at the end (undecodable bytes then show as U+FFFD, as a full decode would)."""
        if self.stopped:
            return ""
        self.text += self.detokenizer.finish()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if self.stop:
            search_from = max(0, self.num_sent - max(len(s) for s in self.stop))
            hits = [(at, s) for at, s in ((self.text.find(s, search_from), s) for s in self.stop) if at >= 0]
            if hits:
                (end, self.matched), self.stopped = min(hits, key=lambda hit: hit[0]), True
            elif not final:
                # Hold back a tail that could still grow into a stop string.
                for keep in range(min(len(self.text), max(len(s) for s in self.stop) - 1), 0, -1):
                    if any(s.startswith(self.text[-keep:]) for s in self.stop):
                        end -= keep
                        break
        delta = self.text[self.num_sent:max(end, self.num_sent)]
        self.num_sent = max(end, self.num_sent)
        return delta


class _Stream:
    """One request's side of the thread hand-off, and its text layer."""

    def __init__(self, owner: ServingEngine, loop: asyncio.AbstractEventLoop, stop: tuple[str, ...],
                 num_prompt_tokens: int, method: str) -> None:
        self.owner = owner
        self.memory: OutputMemory | None = None  # where the engine thread remembers the whole answer, if anywhere
        self.prompt_ids: list[int] = []
        self.answer_ids: list[int] = []  # the engine thread's: every token committed so far
        self.loop = loop
        self.events: asyncio.Queue[BatchEvent | Failure] = asyncio.Queue()
        self.text = TextStream(owner.tokenizer, stop)
        self.num_prompt_tokens = num_prompt_tokens
        self.method = method
        self.echo_text = ""
        self.opens_reasoning: bool | None = None
        self.reasoning_tags: Tags = THINK  # (the template's, where it writes reasoning)
        self.prompt_logprobs: list[tuple[int, TokenLogprob | None]] | None = None
        self.seq_id: int | None = None
        self.submitted = time.perf_counter()
        self.joined = False  # set by the engine thread at the sequence's first round
        self.done = False  # the consumer wants no more events
        self.ended = False  # the engine is done with the sequence: nothing to cancel

    def deliver(self, event: BatchEvent | Failure) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone: nobody is listening
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            while not self.done:
                event = await self.events.get()
                if isinstance(event, Failure):
                    self.done = self.ended = True
                    yield Chunk(self.text.finish(), 0, "error", failure=event)
                    return
                if event.error is not None:  # it ends, with the text so far
                    self.done = self.ended = True
                    if isinstance(event.error, JointspecError):  # its own options refused a round
                        failure = Failure("invalid_request", str(event.error))
                    else:  # a fault in its drafting or verification (logged by the engine), the others unharmed
                        failure = Failure("engine_error", "the engine failed while decoding this request")
                    yield Chunk(self.text.finish(), 0, "error", failure=failure)
                    return
                delta, used = self.text.push(event.token_ids)
                finish = event.finish_reason
                self.ended = finish is not None
                if finish is not None:
                    delta += self.text.finish()  # which may still find a stop string, in a held-back last character
                if self.text.stopped:
                    finish = "stop"
                if finish is not None:
                    self.done = True
                    if (self.memory is not None and self.text.stop and not self.text.stopped
                            and event.finish_reason in ("stop", "length")):
                        self.owner._inbox.put(("remember", self))  # whole: no stop string cut it
                yield Chunk(delta, used, finish, event.stats, num_rounds=int(bool(event.token_ids)),
                            num_drafted=event.num_drafted, num_accepted=event.num_accepted,
                            num_forced=event.num_forced, token_ids=tuple(event.token_ids[:used]),
                            text_cut=self.text.stopped, logprobs=tuple((event.logprobs or ())[:used]),
                            stop_string=self.text.matched if finish is not None else None)
        finally:
            # A consumer that leaves early, or a stop string the text hit before the engine's own end: free the row
            # now rather than decode to max_tokens for nobody.
            if not self.ended:
                self.cancel()

    def cancel(self) -> None:
        self.done = True
        if self.seq_id is not None and not self.ended:
            self.ended = True
            self.owner._inbox.put(("cancel", self.seq_id))


def _naming(option: str, error: Exception) -> Exception:
    """``error``, naming the request's ``jointspec`` option it is about (the 400's ``param``)."""
    error.param = f"jointspec.{option}"
    return error


class ServingEngine:
    """A target, a tokenizer and a default method, served by one batched engine on a background thread.

    ``max_queue``: how many admitted requests may wait for a row when all ``max_batch_size`` rows are busy; past
    ``max_batch_size + max_queue`` requests in flight, :meth:`submit` raises :class:`QueueFullError` at once.

    ``prompt_cache_bytes``: the lockstep engine keeps finished requests' caches, up to this many bytes, for prompts
    that begin with their tokens (:mod:`jointspec.batch.prompt_cache`); 0 keeps none.

    ``load`` (instead of ``target`` and ``tokenizer``): a function that loads them, called on the engine thread, so
    that every torch computation of the process runs on that one thread. OpenMP keeps a team of worker threads for
    each thread that starts parallel regions; once two teams exist (the loading thread's and the engine's) a small
    machine's cores are oversubscribed, libgomp stops spinning between regions, and every kernel call then waits for
    its workers to wake: a decode step on 2 cores took 1.6x as long (docs/lab/serving.md, section 4).
    """

    def __init__(self, target: CausalLM | None, tokenizer=None, method: MethodConfig = MethodConfig(), *,
                 model_id: str = "jointspec", max_batch_size: int = 16, max_queue: int = 64,
                 default_max_tokens: int = 256, load_draft=None, load=None, online_memory: str = "off",
                 prompt_cache_bytes: int = 0) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if online_memory not in ONLINE_MEMORY_CHOICES:
            raise ValueError(f"online_memory must be one of {', '.join(ONLINE_MEMORY_CHOICES)}, got "
                             f"'{online_memory}'")
        self.online_memory = online_memory
        if (target is None) == (load is None):
            raise ValueError("give the engine a target (and tokenizer) or a function that loads them, not both")
        self.target = target
        self.tokenizer = tokenizer
        self._spelling: TokenSpelling | None = None  # built at the first request that asks for log-probabilities
        self.method = method
        self.model_id = model_id
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.default_max_tokens = default_max_tokens
        self._make_engine = lambda: engine_for(self.target, self.tokenizer, method, max_batch_size=max_batch_size,
                                               load_draft=load_draft, prompt_cache_bytes=prompt_cache_bytes)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, _Stream] = {}  # the engine thread's: sequences still decoding
        # Admission: guards _admitted and _closing, and orders every "submit" put before the thread's last look at
        # its inbox, so a request either reaches the thread or is refused: none waits forever.
        self._admission = threading.Lock()
        self._encoding = threading.Lock()  # (encode, tokenize: one at a time)
        self._grammars = RecentGrammars()  # output formats compiled for the tokenizer
        self._admitted = 0  # requests submitted and not yet ended (decoding, queued, or on their way to the thread)
        self._closing = False
        self._stats_lock = threading.Lock()
        self._snapshot = EngineSnapshot(max_batch_size=max_batch_size, max_queue=max_queue)
        self._closed = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), name="jointspec-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    # -- the request side (event loop threads) ------------------------------------------------------------------

    @functools.cached_property
    def native_format(self) -> str | None:
        """The call format the chat template renders tools and calls in itself (server/tools.py), or None."""
        return native_call_format(self.tokenizer)

    @functools.cached_property
    def tools_variable(self) -> str:
        """The variable the chat template reads the offered tools from: ``tools``, or SmolLM3's ``xml_tools``
        (server/tools.py)."""
        return template_tools_variable(chat_template_text(self.tokenizer))

    @property
    def call_format(self) -> str:
        """The format the model writes tool calls in (server/tools.py): its chat template's own, else Hermes's."""
        return self.native_format or HERMES

    @functools.cached_property
    def reasoning_tags(self) -> Tags | None:
        """The tags of the reasoning blocks the chat template writes (server/reasoning.py), or None."""
        return template_reasons(self.tokenizer)

    @functools.cached_property
    def reasoning_tokens(self) -> dict[str, int]:
        """The reasoning tags' pieces that are added tokens of the tokenizer (special or not), by spelling: a grammar
        names them by id (server/reasoning.py's reasoning_first)."""
        tags = self.reasoning_tags
        try:
            added = self.tokenizer.get_added_vocab() if tags is not None else {}
        except (AttributeError, TypeError):
            return {}
        pieces = (tags.open, tags.close, *tags.kept) if tags else ()
        return {spelling: int(added[spelling]) for spelling in pieces if spelling in added}

    @functools.cached_property
    def reasoning_markers(self) -> dict[str, int]:
        """The reasoning tags' special tokens that are added tokens of the tokenizer, by spelling (Gemma 4's), which
        a decode keeps."""
        kept = self.reasoning_tags.kept if self.reasoning_tags else ()
        return {spelling: id_ for spelling, id_ in self.reasoning_tokens.items() if spelling in kept}

    @functools.cached_property
    def shows_calls(self) -> bool:
        """Whether the chat template renders an assistant's earlier calls, where it renders a call format itself
        (server/tools.py's template_shows_calls; where it does not, the prompt writes them)."""
        return self.native_format is None or template_shows_calls(self.tokenizer, self.native_format)

    @functools.cached_property
    def call_markers(self) -> tuple[tuple[str, int], ...]:
        """The call format's markers that are added tokens of the tokenizer, with their ids (server/tools.py): the
        text of an answer read for calls keeps them, and a grammar names them by id."""
        return call_markers(self.tokenizer, self.call_format)

    @property
    def context_length(self) -> int:
        """The most tokens a sequence (prompt and answer) may hold."""
        return self.target.max_context

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` as the tokenizer reads it (``add_special_tokens``: with the tokens it adds, such as a BOS)."""
        with self._encoding:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens spelled out (as vLLM's and llama.cpp's /detokenize give it);
        ValueError naming an id outside the vocabulary."""
        bad = [token for token in token_ids if not 0 <= token < self.target.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0 to {self.target.vocab_size - 1})")
        return self.tokenizer.decode(token_ids)

    def encode(self, request: CompletionRequest) -> list[int]:
        """``request``'s prompt as the model reads it. One encode at a time: an encode may set the fast tokenizer's
        per-call options (split_special_tokens) on it, which another thread's encode would then read."""
        with self._encoding:
            return self._encode(request)

    def _encode(self, request: CompletionRequest) -> list[int]:
        try:  # a bias on a token the model lacks: this request's 400, not an error inside the batch's round
            request.penalties.check_vocab(self.target.vocab_size)
        except UnsupportedOptionError as error:
            error.param = "logit_bias"
            raise
        if request.messages is not None:
            # Tools, earlier calls and their results as the template renders them, or as text (server/tools.py).
            call_format = self.call_format
            messages, tools = prompt_messages([dict(m) for m in request.messages], request.tools,
                                              self.native_format is not None, call_format, self.shows_calls)
            if getattr(self.tokenizer, "chat_template", None):  # the template writes the special tokens itself
                variables = template_variables(messages, tools, call_format) | (request.template_kwargs or {})
                if tools is not None and self.tools_variable == "xml_tools":
                    variables, tools = {"xml_tools": xml_tools(tools), **variables}, None
                return chat_template_ids(self.tokenizer, messages, tools=tools,  # (message text read as text)
                                         template_kwargs=variables, continue_final=request.continue_final)
            # No template: a plain transcript the model can continue, read as any prompt is (with its BOS token:
            # without it a base model such as Gemma-3's continues the text as noise), a special token's spelling in
            # it as characters.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.tokenizer(text, split_special_tokens=True)["input_ids"]
        if isinstance(request.prompt, list):
            # Checked here: an id past the vocabulary would fail the whole batch's forward, not just this request.
            vocab = self.target.vocab_size
            bad = [t for t in request.prompt if not 0 <= t < vocab]
            if bad:
                error = ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0 to {vocab - 1})")
                error.param = "prompt"  # what the 400 names
                raise error
            return list(request.prompt)
        return self.tokenizer(request.prompt)["input_ids"]

    def method_for(self, options: dict | None) -> MethodConfig:
        """The server's method with the request's overrides; requests may not name arbitrary draft models. A request
        naming another method starts from that method's defaults: of the server's settings it keeps only the draft
        and how a head's weights run, not the knobs of the server's own method (a server run with ``--verify block``
        for ``sps`` must not refuse ``pld`` for a verifier the request never asked for)."""
        if not options:
            return self.method
        if "method" in options and options["method"] not in method_names():
            raise _naming("method", UnsupportedOptionError(unknown_method_error(options["method"],
                                                                                batched_methods())))
        draft = options.get("draft", self.method.draft)
        if draft not in (None, "self", self.method.draft):
            raise _naming("draft", UnsupportedOptionError(f"draft '{draft}' is not served here; use 'self' or the "
                                                          f"server's draft ({self.method.draft or 'none'})"))
        name = options.get("method", self.method.name)
        settings = {REQUEST_FIELDS.get(key, key): value for key, value in options.items() if key != "method"}
        if "tree" in settings:
            settings["tree"] = tuple(settings["tree"])
        # A setting the method does not read is refused, not ignored (the server's own draft is given to every method),
        # each named as a request names it.
        error = unread_options_error(name, list(settings), spell=request_key)
        if error:
            unread = next(key for key in options if REQUEST_FIELDS.get(key, key) in set(settings) - method_reads(name))
            raise _naming(unread, UnsupportedOptionError(error))
        base = self.method
        if name != base.name:
            base = MethodConfig(draft=base.draft, head_weights=base.head_weights)
        return replace(base, name=name, **settings)

    def memory_for(self, user: str | None, method: MethodConfig) -> OutputMemory | None:
        """The memory of earlier answers this request drafts from and joins: none unless the server keeps one
        (``online_memory``) and the method learns online; per user (a request without ``user`` gets none), or one
        that every request shares."""
        if self.online_memory == "off" or method.name not in online_methods():
            return None
        if self.online_memory == "user":
            return None if not user else memory_for(self.target.model, f"user:{user}")
        return memory_for(self.target.model, "shared")

    def _full(self) -> bool:
        return self._admitted >= self.max_batch_size + self.max_queue

    def _full_error(self) -> QueueFullError:
        return QueueFullError(f"the server is full: {self.max_batch_size} requests decoding and {self.max_queue} "
                              "waiting; retry later")

    def grammar(self, output_format: OutputFormat | None) -> Grammar | None:
        """``output_format`` compiled for the server's tokenizer (GrammarError, a 400, where it cannot be used)."""
        if output_format is None:
            return None
        try:
            return self._grammars.get(output_format, lambda: Grammar(output_format, self.tokenizer,
                                                                     self.target.vocab_size, self.eos_token_ids))
        except GrammarError as error:
            error.param = "response_format"  # what the route's 400 names
            raise

    async def submit(self, request: CompletionRequest) -> Generation:
        return (await self.submit_many([request]))[0]

    async def submit_many(self, requests: list[CompletionRequest]) -> list[Generation]:
        """Several sequences (a request's choices, a batch of prompts), admitted together or refused together: all
        join the batch at the same round, or the request gets the refusal (429 where the server lacks room for all
        of them now; 400 where it never has room for so many)."""
        capacity = self.max_batch_size + self.max_queue
        decoding = sum(1 for request in requests if not (request.echo and request.max_tokens == 0))
        if decoding > capacity:
            error = JointspecError(f"{decoding} sequences (prompts x n) are more than this server holds at once "
                                   f"(--max-batch-size {self.max_batch_size} + --max-queue {self.max_queue}): send "
                                   "fewer prompts or choices a request")
            prompts = {(r.prompt if isinstance(r.prompt, str) else tuple(r.prompt or ()), id(r.messages))
                       for r in requests}  # (a chat's choices share one messages tuple)
            error.param = "n" if len(prompts) == 1 else "prompt"
            raise error
        # A full server refuses at once, before the tokenisation it would waste (the check below decides).
        if self._full() and not self._closing:
            raise self._full_error()
        prepared = await _all_or_none([self._prepare(request) for request in requests])
        # Echoed prompts scored one after another: each holds one place while it waits and is read, and the engine
        # thread reads one between rounds, as for requests sent one by one.
        for (stream, _), request in zip(prepared, requests):
            if request.echo and request.logprobs is not None:
                stream.prompt_logprobs = await self._score(stream.prompt_ids, request.logprobs)
        loop = asyncio.get_running_loop()
        admitted: list[tuple[_Stream, asyncio.Future]] = []
        with self._admission:
            if self._closing:
                raise ShuttingDownError("the server is shutting down; retry on another instance or later")
            waiting = [item for item in prepared if item[1] is not None]
            if self._admitted + len(waiting) > capacity:
                raise self._full_error()
            for stream, (request, prompt_ids, config, method) in waiting:
                stream.memory = self.memory_for(request.user, method)  # admitted: a refused request makes no memory
                future: asyncio.Future = loop.create_future()
                self._admitted += 1
                self._inbox.put(("submit", BatchRequest(prompt_ids, config, method, request.seed, stream.memory),
                                 stream, future))
                admitted.append((stream, future))

        def cancel_when_known(future: asyncio.Future) -> None:  # the sequence once it exists
            future.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                     or self._inbox.put(("cancel", f.result())))

        try:
            results = await asyncio.shield(asyncio.gather(*(future for _, future in admitted),
                                                          return_exceptions=True))
        except asyncio.CancelledError:  # the client left while we waited
            for _, future in admitted:
                cancel_when_known(future)
            raise
        refusal = next((result for result in results if isinstance(result, BaseException)), None)
        for (stream, _), result in zip(admitted, results):
            if refusal is not None and not isinstance(result, BaseException):
                self._inbox.put(("cancel", result))  # a sibling was refused (bad method, too long): none runs
            elif refusal is None:
                stream.seq_id = result
        if refusal is not None:
            raise refusal
        return [stream for stream, _ in prepared]

    async def _prepare(self, request: CompletionRequest):
        """``request`` read into a stream and what its admission needs: (stream, (request, prompt ids, decode
        config, method)), or (stream, None) for an echo that asks for no answer."""
        # On a worker thread: a long prompt's chat template and tokenisation take seconds, which on the event loop
        # would hold up every other request and stream (encodes run one at a time; the streams' decodes on the loop
        # set no per-call options, and may run beside an encode).
        prompt_ids = await asyncio.to_thread(self.encode, request)
        tags = self.reasoning_tags if request.messages is not None else None
        # (the prompt's last tokens hold the template's tag where it opens a block, or closes an empty one: enough of
        # them for the longer tag spelled a character a token, with room for the whitespace and an empty block's open)
        window = 16 + len(tags.open) + len(tags.close) if tags is not None else 0
        tail = self.tokenizer.decode(prompt_ids[-window:]) if tags is not None else ""
        opened = tags is not None and prompt_opens_reasoning(tail, tags)
        output_format = request.output_format
        if (output_format is not None and tags is not None and request.reasoning_first
                and not prompt_closes_reasoning(tail, tags)):
            output_format = reasoning_first(output_format, tags, self.reasoning_tokens, opened)
        grammar = None if output_format is None else await asyncio.to_thread(self.grammar, output_format)
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenisation")
        room = self.target.max_context - len(prompt_ids)
        if request.max_tokens is not None and request.max_tokens > room:
            # OpenAI's API refuses what the context cannot hold rather than cut the answer short.
            raise ContextTooLongError(
                f"the model's context holds {self.target.max_context} tokens, but the request asks for "
                f"{len(prompt_ids) + request.max_tokens} ({len(prompt_ids)} in the prompt, {request.max_tokens} to "
                "generate): shorten the prompt or ask for fewer tokens")
        if request.max_tokens == 0 and not request.echo:
            raise ValueError("max_tokens 0 asks for no answer: it needs echo (the prompt alone, scored with logprobs)")
        max_tokens = request.max_tokens if request.max_tokens is not None else min(self.default_max_tokens,
                                                                                   max(room, 1))
        config = DecodeConfig(max(max_tokens, 1), SamplingConfig(request.temperature, request.top_k, request.top_p,
                                                            request.min_p),
                              self.eos_token_ids, grammar, logprobs=request.logprobs, penalties=request.penalties)
        method = self.method_for(request.method)
        stream = _Stream(self, asyncio.get_running_loop(), request.stop, len(prompt_ids), method.name)
        stream.prompt_ids = prompt_ids
        # Markers a decode would skip as special tokens, and with them an answer's calls or its reasoning's bounds.
        kept = dict(self.call_markers) if request.tools else {}
        if tags is not None:
            kept |= self.reasoning_markers
            stream.opens_reasoning, stream.reasoning_tags = opened, tags
        if kept:
            stream.text.detokenizer = IncrementalDetokenizer(self.tokenizer,
                                                             kept={id_: text for text, id_ in kept.items()})
        if request.echo:
            # The answer's text as it follows the prompt's (a SentencePiece answer keeps its first space).
            stream.text.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
            # (A prompt past the context was refused above; one as long as the context may be scored alone, with
            # max_tokens 0, and is refused for decoding, as the engine refuses it.)
            if max_tokens != 0 and len(prompt_ids) >= self.target.max_context:
                raise ContextTooLongError.for_prompt(len(prompt_ids), self.target.max_context)
            stream.echo_text = (request.prompt if isinstance(request.prompt, str)
                                else decode_text(self.tokenizer, prompt_ids))
            # (its prompt's figures, where asked for, are scored by submit_many once every prompt is prepared)
            if max_tokens == 0:  # the prompt alone: nothing for the engine to decode
                stream.ended = True
                stream.events.put_nowait(BatchEvent(-1, [], "length"))
                return stream, None
        return stream, (request, prompt_ids, config, method)

    @property
    def spelling(self) -> TokenSpelling:
        """Each token's own text and UTF-8 bytes, as a request's log-probabilities list them."""
        if self._spelling is None or self._spelling.tokenizer is not self.tokenizer:
            self._spelling = TokenSpelling(self.tokenizer)
        return self._spelling

    async def _score(self, prompt_ids: list[int], top: int) -> list[tuple[int, TokenLogprob | None]]:
        """Each prompt token with its log-probability under the model given the tokens before it (the first: None),
        computed on the engine thread between rounds, which owns the model. It holds a place in flight while it waits
        and is read (a full server refuses it, as it refuses a request); one whose caller is gone by then (its client
        left, its timeout passed) is not read."""
        with self._admission:
            if self._closing:
                raise ShuttingDownError("the server is shutting down; retry on another instance or later")
            if self._full():
                raise self._full_error()
            self._admitted += 1
            future: asyncio.Future = asyncio.get_running_loop().create_future()
            self._inbox.put(("score", prompt_ids, top, asyncio.get_running_loop(), future))
        figures = await future
        return [(prompt_ids[0], None)] + [(figure.token_id, figure) for figure in figures]

    def _score_now(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        """The engine thread's side of :meth:`_score`: the prompt read on a fork of the target a chunk at a time,
        every row's whole logits kept (the rows of a chunk of ``prefill_chunk`` tokens at most)."""
        fork = self.target.fork("score")
        fork.reset(length=len(prompt_ids))
        figures: list[TokenLogprob] = []
        total = len(prompt_ids) - 1  # the last token's row would score the answer's first
        start = 0
        while start < total:
            stop = fork.prefill_chunk_end(start, total)
            out = fork.forward(prompt_ids[start:stop], num_logits=stop - start)
            figures += token_logprobs(out.logits, prompt_ids[start + 1:stop + 1], top)
            start = stop
        return figures

    @property
    def keeps_prompts(self) -> bool:
        """Whether a prompt that begins with a finished request's tokens may take that request's cache: the lockstep
        engine with a prompt cache (a request whose method reads a head's features still neither takes nor leaves
        one, :mod:`jointspec.batch.lockstep`)."""
        cache = getattr(self._engine, "prompt_cache", None)
        return cache is not None and cache.max_bytes > 0

    def is_idle(self) -> bool:
        """Whether every request submitted has ended and left its row (a cancelled one leaves when the engine thread
        next looks at its inbox)."""
        with self._admission:
            return self._admitted == 0

    @property
    def description(self) -> str:
        """Which batched engine serves, and what its batching gives."""
        return engine_description(self._engine)

    def snapshot(self) -> EngineSnapshot:
        with self._stats_lock:
            return self._snapshot.copy()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread. Requests still in flight end with a "shutting_down" failure; later ones are
        refused with ShuttingDownError. Safe to call more than once."""
        with self._admission:
            self._closing = True
        self._closed.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------------------------

    def _start(self, load) -> None:
        if load is not None:
            self.target, self.tokenizer = load()
        self.eos_token_ids = eos_token_ids(self.target, self.tokenizer)
        self._engine = self._make_engine()
        self._engine.method(self.method)  # build (and load a draft) now, and refuse an unbatchable default early
        self._update_gauges()  # the prompt cache's budget is a gauge from the start

    def _run(self, load) -> None:
        try:
            self._start(load)
        except BaseException as error:  # handed to the constructor, which raises it
            self._start_error = error
            return
        finally:
            self._started.set()
        while not self._closed.is_set():
            self._drain(block=not self._engine.has_work)
            if self._engine.has_work:
                self._round()
            self._update_gauges()
        self._fail_all(Failure("shutting_down", "the server shut down before this request finished"), free_rows=True)
        with self._admission:  # _closing is set: nothing more can arrive
            leftovers = []
            while not self._inbox.empty():
                leftovers.append(self._inbox.get_nowait())
        for item in leftovers:
            if item[0] == "score":
                self._admitted_done(1)
                self._resolve(item[3], item[4], None, ShuttingDownError("the server is shutting down"))
            if item[0] == "submit":
                self._admitted_done(1)
                if item[2].memory is not None:
                    forget_if_unused(self.target.model, item[2].memory)
                self._resolve(item[2].loop, item[3], None, ShuttingDownError("the server is shutting down"))
        self._update_gauges()

    def _round(self) -> None:
        started = time.perf_counter()
        try:
            events = self._engine.step()
        except Exception:  # a bug: fail the running requests, start afresh, keep serving
            log.exception("batched engine failed; failing %d requests", len(self._streams))
            # The failed engine is dropped whole, its rows with it.
            self._fail_all(Failure("engine_error", "the engine failed while decoding this request"), free_rows=False)
            self._engine = self._make_engine()
            return
        num_rows = 0
        with self._stats_lock:
            for event in events:
                stream = self._streams.get(event.seq_id)
                if stream is None or not event.token_ids:  # an end with no round behind it (a cancel)
                    continue
                num_rows += 1
                stats = self._snapshot.methods.setdefault(stream.method, MethodStats())
                # A chain's draft nodes sit at depths 0..num_drafted-1; a tree's come with the event.
                depths = event.depths if event.depths is not None else list(range(event.num_drafted))
                stats.spec.record(depths, event.num_accepted, len(event.token_ids), event.num_forced)
                stats.tokens_per_round.observe(len(event.token_ids))
                if not stream.joined:  # its first round: it waited from submission to the start of this step
                    stream.joined = True
                    stats.queue_seconds.observe(started - stream.submitted)
            if num_rows:
                self._snapshot.batch_size.observe(num_rows)
        deliveries = [(self._streams[e.seq_id], e) for e in events if e.seq_id in self._streams]
        for stream, event in deliveries:
            if stream.memory is not None:
                stream.answer_ids.extend(event.token_ids)
                # A whole answer: later requests may copy from it. One that may meet a stop string is whole only if
                # its text layer found none; that layer's stream then says so (_Stream.__aiter__).
                if event.finish_reason in ("stop", "length") and not stream.text.stop:
                    stream.memory.add(stream.prompt_ids, stream.answer_ids)
            if event.finish_reason is not None:
                self._forget(event.seq_id)
        self._update_gauges()  # before the tokens go out: a client that sees them also sees the rows they came from
        for stream, event in deliveries:
            if event.stats is None and stream.text.stop and event.seq_id in self._engine.active:
                # A stop string may end this answer before the engine does: the round then is its last chunk, and
                # carries the statistics so far, copied here, where the engine's own copy changes.
                event = replace(event, stats=self._engine.active[event.seq_id].stats.copy())
            stream.deliver(event)

    def _update_gauges(self) -> None:
        running = len(self._engine.active)
        prompt_cache = getattr(self._engine, "prompt_cache", None)  # the lockstep engine's (the ragged keeps none)
        with self._stats_lock:
            self._snapshot.running_sequences = running
            self._snapshot.waiting_sequences = max(self._admitted - running, 0)
            if prompt_cache is not None:
                self._snapshot.prompt_cache_bytes = prompt_cache.nbytes
                self._snapshot.prompt_cache_entries = len(prompt_cache)
                self._snapshot.prompt_cache_max_bytes = prompt_cache.max_bytes

    def _forget(self, seq_id: int) -> _Stream | None:
        stream = self._streams.pop(seq_id, None)
        if stream is not None:
            self._admitted_done(1)
        return stream

    def _admitted_done(self, count: int) -> None:
        with self._admission:
            self._admitted -= count

    def _fail_all(self, failure: Failure, free_rows: bool) -> None:
        for seq_id in list(self._streams):
            if free_rows:
                self._engine.cancel(seq_id)
            self._forget(seq_id).deliver(failure)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item[0] == "submit":
                _, batch_request, stream, future = item
                try:
                    seq_id = self._engine.submit(batch_request)
                    self._streams[seq_id] = stream
                    result, error = seq_id, None
                except Exception as exc:  # handed to the route, which answers 400 or 500
                    self._admitted_done(1)
                    if stream.memory is not None:
                        forget_if_unused(self.target.model, stream.memory)
                    result, error = None, exc
                self._resolve(stream.loop, future, result, error)
            elif item[0] == "score":  # an echo request's prompt, scored before it is decoded
                _, prompt_ids, top, loop, future = item
                result, error = None, None
                if self._closed.is_set():
                    error = ShuttingDownError("the server is shutting down")
                elif not future.done():  # (done: its caller was cancelled, nobody waits for it)
                    try:
                        result = self._score_now(prompt_ids, top)
                    except Exception as exc:  # a bug: the route answers 500
                        log.exception("scoring a prompt failed")
                        error = exc
                self._admitted_done(1)
                self._resolve(loop, future, result, error)
            elif item[0] == "remember":  # a whole answer, as its client got it: later requests may copy from it
                stream = item[1]
                stream.memory.add(stream.prompt_ids, stream.answer_ids)
            elif item[0] == "cancel":
                if self._forget(item[1]) is not None:  # still decoding: free its row
                    self._engine.cancel(item[1])
                    with self._stats_lock:
                        self._snapshot.num_cancelled += 1
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result, error) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass
