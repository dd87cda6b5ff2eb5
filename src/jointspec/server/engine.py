"""The engine behind the server: text in, text chunks out, every request sharing one batched engine.

A background thread owns the :class:`~jointspec.batch.engine.BatchEngine` and runs its rounds; nothing else touches it.
Requests and cancellations reach that thread through a queue and join or leave between rounds; each round's tokens
go back to the request's asyncio loop, where :class:`TextStream` turns them into UTF-8-safe text deltas and applies
stop strings. The routes in :mod:`jointspec.server.app` see only :class:`ServingEngine`'s small protocol, so tests
can hand them a fake.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import IncrementalDetokenizer, eos_token_ids
from jointspec.batch.engine import BatchEngine, BatchEvent, BatchRequest
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpecStats
from jointspec.core.sampling import SamplingConfig
from jointspec.methods import MethodConfig, method_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompletionRequest:
    """One request, already validated by the route. Exactly one of ``prompt`` / ``messages`` is set."""

    prompt: str | list[int] | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None  # None: the server's default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    method: dict | None = None  # the request's "jointspec" options, overriding the server's method

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a request has either a prompt or messages")
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates


@dataclass
class Chunk:
    text: str
    num_tokens: int
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error" on the last chunk
    stats: SpecStats | None = None


class Generation(Protocol):
    num_prompt_tokens: int

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    def cancel(self) -> None: ...


class Engine(Protocol):
    """What the routes need. ``submit`` raises JointspecError / ValueError for requests it refuses."""

    model_id: str

    async def submit(self, request: CompletionRequest) -> Generation: ...

    def spec_stats(self) -> SpecStats: ...

    def gauges(self) -> dict[str, float]: ...


class TextStream:
    """Token ids in, text deltas out: no broken UTF-8 characters, and text stops before any ``stop`` string."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # every complete character decoded so far
        self.num_sent = 0  # characters of ``text`` already returned
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.text += self.detokenizer.push(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The held-back rest, at the end (undecodable bytes then show as U+FFFD, as a full decode would)."""
        if self.stopped:
            return ""
        full = self.tokenizer.decode(self.detokenizer.token_ids, skip_special_tokens=True)
        if full.startswith(self.text):
            self.text = full
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if self.stop:
            search_from = max(0, self.num_sent - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                end, self.stopped = min(hits), True
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
                 num_prompt_tokens: int) -> None:
        self.owner = owner
        self.loop = loop
        self.events: asyncio.Queue[BatchEvent] = asyncio.Queue()
        self.text = TextStream(owner.tokenizer, stop)
        self.num_prompt_tokens = num_prompt_tokens
        self.seq_id: int | None = None
        self.done = False

    def deliver(self, event: BatchEvent) -> None:  # called from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone: nobody is listening
            self.cancel()

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            while not self.done:
                event = await self.events.get()
                delta = self.text.push(event.token_ids)
                finish = event.finish_reason
                if self.text.stopped:
                    finish = "stop"
                if finish is not None:
                    delta += self.text.finish()
                    self.done = True
                yield Chunk(delta, len(event.token_ids), finish, event.stats)
        finally:
            if not self.done:
                self.cancel()

    def cancel(self) -> None:
        self.done = True
        if self.seq_id is not None:
            self.owner._inbox.put(("cancel", self.seq_id))


class ServingEngine:
    """A target, a tokenizer and a default method, served by one batched engine on a background thread."""

    def __init__(self, target: CausalLM, tokenizer, method: MethodConfig = MethodConfig(), *,
                 model_id: str = "jointspec", max_batch_size: int = 16, default_max_tokens: int = 256,
                 load_draft=None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.method = method
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self._make_engine = lambda: BatchEngine(target, tokenizer, max_batch_size=max_batch_size,
                                                load_draft=load_draft)
        self._engine = self._make_engine()
        self._engine.method(method)  # build (and load a draft) now, and refuse an unbatchable default early
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, _Stream] = {}
        self._stats_lock = threading.Lock()
        self._stats = SpecStats()
        self._num_cancelled = 0
        self._gauges = {"running_sequences": 0.0, "waiting_sequences": 0.0}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jointspec-engine", daemon=True)
        self._thread.start()

    # -- the request side (event loop threads) ------------------------------------------------------------------

    def encode(self, request: CompletionRequest) -> list[int]:
        if request.messages is not None:
            messages = [dict(m) for m in request.messages]
            if getattr(self.tokenizer, "chat_template", None):
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            else:  # no template: a plain transcript the model can continue
                text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(request.prompt, list):
            return list(request.prompt)
        return self.tokenizer(request.prompt)["input_ids"]

    def method_for(self, options: dict | None) -> MethodConfig:
        """The server's method with the request's overrides; requests may not name arbitrary draft models."""
        if not options:
            return self.method
        if "method" in options and options["method"] not in method_names():
            raise UnsupportedOptionError(f"unknown method '{options['method']}'; choose one of: "
                                         f"{', '.join(method_names())}")
        draft = options.get("draft", self.method.draft)
        if draft not in (None, "self", self.method.draft):
            raise UnsupportedOptionError(f"draft '{draft}' is not served here; use 'self' or the server's "
                                         f"draft ({self.method.draft or 'none'})")
        fields = {"method": "name"}
        return dataclasses.replace(self.method, **{fields.get(k, k): v for k, v in options.items()})

    async def submit(self, request: CompletionRequest) -> Generation:
        prompt_ids = self.encode(request)
        if not prompt_ids:
            raise ValueError("the prompt is empty after tokenisation")
        room = self.target.max_context - len(prompt_ids)
        max_tokens = request.max_tokens or min(self.default_max_tokens, max(room, 1))
        config = DecodeConfig(max_tokens, SamplingConfig(request.temperature, request.top_k, request.top_p),
                              self.eos_token_ids)
        batch_request = BatchRequest(prompt_ids, config, self.method_for(request.method), request.seed)
        stream = _Stream(self, asyncio.get_running_loop(), request.stop, len(prompt_ids))
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._inbox.put(("submit", batch_request, stream, future))
        try:
            stream.seq_id = await asyncio.shield(future)  # raises what the engine raised (bad method, too long)
        except asyncio.CancelledError:  # the client left while we waited: cancel the sequence once it exists
            future.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                     or self._inbox.put(("cancel", f.result())))
            raise
        return stream

    def spec_stats(self) -> SpecStats:
        with self._stats_lock:
            copy = SpecStats()
            copy.merge(self._stats)
            return copy

    def gauges(self) -> dict[str, float]:
        return {**self._gauges, "cancelled_sequences": float(self._num_cancelled)}

    def close(self, timeout: float = 10.0) -> None:
        self._closed.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.is_set():
            self._drain(block=not self._engine.has_work)
            if not self._engine.has_work:
                self._gauges = {"running_sequences": 0.0, "waiting_sequences": 0.0}
                continue
            try:
                events = self._engine.step()
            except Exception:  # a bug: fail the running requests, start afresh, keep serving
                log.exception("batched engine failed; failing %d requests", len(self._streams))
                for stream in self._streams.values():
                    stream.deliver(BatchEvent(stream.seq_id, [], "error"))
                self._streams.clear()
                self._engine = self._make_engine()
                continue
            with self._stats_lock:
                self._stats = SpecStats()
                self._stats.merge(self._engine.stats)
            self._gauges = {"running_sequences": float(len(self._engine.active)),
                            "waiting_sequences": float(len(self._engine.waiting))}
            for event in events:
                stream = self._streams.get(event.seq_id)
                if stream is None:
                    continue
                if event.finish_reason is not None:
                    del self._streams[event.seq_id]
                stream.deliver(event)

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
                    result, error = None, exc
                self._resolve(stream.loop, future, result, error)
            elif item[0] == "cancel":
                if self._streams.pop(item[1], None) is not None:  # still decoding: free its row
                    self._engine.cancel(item[1])
                    self._num_cancelled += 1
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
