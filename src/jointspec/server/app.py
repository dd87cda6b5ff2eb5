"""An OpenAI-compatible HTTP face over an engine: ``create_app(settings, engine)``.

A route only validates a request, turns it into one :class:`~jointspec.server.engine.CompletionRequest` and
formats what the engine streams back, as OpenAI does (plain JSON or server-sent events). Bad requests get OpenAI's
error envelope ``{"error": {"message", "type", "param", "code"}}`` with status 400; unknown fields in standard
places are ignored, as OpenAI ignores them. Decoding options travel in an extra body field::

    {"model": "...", "messages": [...], "jointspec": {"method": "pld", "num_draft_tokens": 4}}

and each answer's ``usage`` carries the request's speculation figures in an extra ``jointspec`` field.

Every request ends one way, counted on ``/metrics``: a full answer; cancelled, when its client leaves (its row is
freed at once); or an error envelope: 400 for a bad request, 429 (queue full) or 503 (shutting down) with
Retry-After, 504 past ``request_timeout``, 500 when the engine fails. A stream that fails after it started sends the
envelope as its last event, with no ``[DONE]``. :func:`drain` (SIGTERM, or the app's shutdown) stops admitting,
lets the requests in flight finish, then ends the rest with an error: none is left without an answer.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from jointspec.backends.tokens import TokenSpelling, check_template_kwargs
from jointspec.core.errors import ContextTooLongError, JointspecError
from jointspec.core.grammar import OutputFormat
from jointspec.core.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, json_logprob
from jointspec.core.penalties import Penalties, checked_bias
from jointspec.core.sampling import MIN_TEMPERATURE, fresh_seed
from jointspec.core.verdict import VERIFY_CHOICES
from jointspec.methods.registry import tree_nodes
from jointspec.server import anthropic
from jointspec.server.engine import (
    Chunk,
    CompletionRequest,
    Engine,
    Failure,
    Generation,
    QueueFullError,
    ShuttingDownError,
)
from jointspec.server.keys import API_KEY_RULE, valid_api_key
from jointspec.server.metrics import CONTENT_TYPE, Metrics
from jointspec.server.reasoning import HARMONY_IN_CONTENT, THINK, Parts, ReasoningStream, Tags, split_reasoning
from jointspec.server.responses import (
    ResponsesError,
    ResponseShaper,
    ResponseStore,
    StoredResponse,
    chat_request,
    input_items_page,
)
from jointspec.server.tools import (
    HERMES,
    CallStream,
    ToolError,
    ToolUse,
    check_message,
    read_calls,
    read_tool_use,
)
from jointspec.server.translate import ChatRequest, TranslationError

log = logging.getLogger(__name__)

# After the engine closes, how long the routes get to write the errors it handed them.
FLUSH_SECONDS = 5.0
# The most draft tokens a request's tree may hold: what one CPU round verifies (the compiled kernels compute up to
# 256 rows alone: the pending token and 255 drafted).
MAX_REQUEST_DRAFT = 255


REASONING_FORMATS = ("auto", "none")
# OpenAI's reasoning efforts (gpt-oss's template takes low, medium and high).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    request_timeout: float | None = None  # seconds from arrival to the last token; None: no limit
    drain_timeout: float = 30.0  # at shutdown, how long requests in flight may take to finish before they fail
    retry_after: int = 1  # seconds, the Retry-After header of a 429 or 503
    # A request body past this many bytes is refused (413) unread: a prompt the context holds is far smaller, and
    # reading and tokenising a huge one costs the server seconds and memory.
    max_request_bytes: int = 4 << 20
    body_timeout: float = 30.0  # seconds for a request's body to arrive, once its headers have (past it: 408)
    # Where set, every request but /health and /metrics (open to load balancers and scrapers) must carry
    # ``Authorization: Bearer <api_key>``, as vLLM's and llama.cpp's servers ask. Kept out of the repr: settings get
    # logged.
    api_key: str | None = field(default=None, repr=False)
    # Reasoning (server/reasoning.py): "auto" returns a reasoning model's <think> block (or Gemma 4's thinking
    # channel) as reasoning_content, apart from the content; "none" leaves it in the content, as written.
    reasoning_format: str = "auto"
    # The Responses API's stored responses (server/responses.py): at most this many kept, in memory, and at most
    # this many MB of their text; 0: none.
    stored_responses: int = 1000
    stored_responses_mb: int = 256

    def __post_init__(self) -> None:
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 (or None), got {self.request_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.retry_after < 0:
            raise ValueError(f"retry_after must be >= 0, got {self.retry_after}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be > 0, got {self.body_timeout}")
        if self.api_key is not None and not valid_api_key(self.api_key):
            raise ValueError(API_KEY_RULE)
        if self.stored_responses < 0 or self.stored_responses_mb < 0:
            raise ValueError(f"stored_responses and stored_responses_mb must be >= 0, got {self.stored_responses} and "
                             f"{self.stored_responses_mb}")
        if self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}, got "
                             f"{self.reasoning_format!r}")


# -- request bodies ---------------------------------------------------------------------------------------------

class _Body(BaseModel):
    # strict: a string where a number belongs is a 400, as with OpenAI; unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class JointspecOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)  # our own namespace: a typo should not pass silently

    method: str | None = None
    num_draft_tokens: int | None = Field(None, ge=1, le=64)
    max_draft_tokens: int | None = Field(None, ge=1, le=64)  # cost-aware chains' longest draft (--max-draft-tokens)
    max_ngram: int | None = Field(None, ge=1, le=64)
    min_ngram: int | None = Field(None, ge=1, le=64)
    draft: str | None = None
    beam_width: int | None = Field(None, ge=1, le=16)  # mtad, spectr
    accept_threshold: float | None = Field(None, gt=0.0)  # mtad's tau
    cost_aware: bool | None = None  # choose each round's draft length from the batch's cost curve
    verify: Literal[VERIFY_CHOICES] | None = None  # checked here: a 400
    # Tree methods: branching per depth (--tree), and a dynamic tree's node budget (--tree-budget); a tree past the
    # rows a round verifies is refused by the request's first round (a 400 that names the limit).
    tree: list[Annotated[int, Field(ge=1, le=64)]] | None = Field(None, min_length=1, max_length=16)
    tree_budget: int | None = Field(None, ge=0, le=MAX_REQUEST_DRAFT)

    @field_validator("tree")
    @classmethod
    def _tree_fits_a_round(cls, tree: list[int] | None) -> list[int] | None:
        # Refused here, not by the round: the request's drafter would build the whole tree first.
        if tree is not None and tree_nodes(tree) > MAX_REQUEST_DRAFT:
            raise ValueError(f"a tree of {','.join(map(str, tree))} has more than {MAX_REQUEST_DRAFT} nodes, the "
                             "most draft tokens a round verifies")
        return tree


class StreamOptions(_Body):
    include_usage: bool = False


MAX_STOP_STRINGS = 32  # stop strings a request may give (OpenAI takes 4)
# The routes that read another API's request into a chat request (_parse's api): OpenAI's Responses, Anthropic's
# Messages.
TRANSLATED = ("responses", "messages")
# What writes a translated route's answer in its API's shapes (server/responses.py, server/anthropic.py).
Shaper = ResponseShaper | anthropic.MessageShaper
MAX_CHOICES = 16  # choices a request may ask for (n): each is a sequence of the batch
MAX_SEQUENCES = 64  # sequences one request may take: its prompts times its choices


class _Sampling(_Body):
    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data):
        """OpenAI's API reads an explicit null in a field that has a default as the field left out (clients send
        ``"temperature": null``); so does this server, where strict types would refuse it."""
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, field in cls.model_fields.items() if field.default is not None}
        return {key: value for key, value in data.items() if value is not None or key not in defaulted}

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, ge=0.0, le=1.0)  # 0: the top token alone (_engine_requests)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    # As the Python API's GenerationConfig takes, and -1: "a fresh seed", as clients of llama.cpp's server send it.
    seed: int | None = Field(None, ge=-1, lt=2 ** 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    jointspec: JointspecOptions | None = None
    user: str | None = None  # OpenAI's end-user id: scopes the online memory (serve --online-memory user)
    # OpenAI's penalties (core/penalties.py, as vLLM applies them).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    response_format: dict | None = None
    # OpenAI's logit_bias: token id (as text) to an amount in [-100, 100], added to the logit before the penalties.
    logit_bias: dict[str, float] | None = None
    # OpenAI's tool calling (server/tools.py), chat only: a completions request offering tools is refused (_parse).
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None  # the deprecated form of tools
    function_call: str | dict | None = None
    _tools_read: ToolUse | None = PrivateAttr(None)  # the four above as read once (_parse: their schemas compiled)
    # Another API's request (Responses, Anthropic's Messages): its own body and its reading, where it was one (_parse).
    _translated: tuple[dict, ChatRequest] | None = PrivateAttr(None)
    # vLLM's sampling extensions: min_p (tokens less than min_p times as likely as the most likely one dropped,
    # after the temperature, as vLLM drops them) and repetition_penalty (core/penalties.py).
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    # vLLM's extension: the generated token ids beside the text (what `train-draft --answers-from` reads), in a whole
    # (non-streamed) reply, and not after a stop string cut the text short.
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        # Every stop string is looked for after every token, on the event loop that streams every request: a few
        # thousand would slow them all. OpenAI takes 4; clients of vLLM send more.
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        return stop



class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # (a list: one prompt in it, as batching clients send)
    best_of: int | None = Field(None, ge=1)
    logprobs: int | bool | None = None  # an int (how many), or false as chat takes it: none
    echo: bool = False
    suffix: str | None = None  # insertion (text to fit before it): refused (_parse)
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0: the prompt alone (echo)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the older tool
    content: str | list[TextPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (server/tools.py)
    function_call: dict | None = None  # the older form of an assistant's earlier call (one)
    tool_call_id: str | None = None  # a tool message's: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning, sent back (a template may read it)


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    modalities: list[str] | None = None  # output kinds: text only here (_parse)
    audio: dict | None = None  # audio output: refused (_parse)
    web_search_options: dict | None = None  # web search: refused (_parse)
    # vLLM's and SGLang's extension: further variables for the chat template (Qwen3's enable_thinking), checked by
    # _parse against the names the template call takes itself.
    chat_template_kwargs: dict | None = None
    # vLLM's extension: the last message, an assistant's, is continued rather than answered (a prefill).
    continue_final_message: bool = False
    # OpenAI's: how long a reasoning model thinks, given to the chat template as ``reasoning_effort`` (gpt-oss's
    # writes it into its system message) unless chat_template_kwargs names it; a template that reads none ignores it.
    reasoning_effort: str | None = None


# -- errors -----------------------------------------------------------------------------------------------------

class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @property
    def outcome(self) -> str:
        """How /metrics counts a request refused with this error before it started."""
        return {429: "overloaded", 503: "overloaded", 504: "timeout"}.get(
            self.status, "error" if self.status >= 500 else "rejected")


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote a request's string, and a lone
    surrogate in it (valid JSON, not UTF-8) would fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
    return _AsciiJSONResponse(error.body(), status_code=error.status, headers=headers)


class _ApiKeyGate:
    """ASGI middleware: a request without ``Authorization: Bearer <key>`` gets 401 in OpenAI's envelope, before its
    body is read; only /health and /metrics are open. Pure ASGI, not Starlette's BaseHTTPMiddleware, which would
    buffer the event streams. The path is read as the router reads it, under any root path (a proxy's prefix, or the
    app mounted in another), so no spelling of a route passes without the key."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str) -> None:
        self.app = app
        self.key = key.encode()

    def _allowed(self, given: bytes, bearer: bool = True) -> bool:
        scheme, _, token = given.partition(b" ") if bearer else (b"bearer", b"", given)
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)  # (constant time)

    async def __call__(self, scope, receive, send) -> None:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if scope["type"] == "http" and path.rstrip("/") not in self.OPEN:  # (/health/: the router's 404, keyless)
            given = next((value for name, value in scope["headers"] if name == b"authorization"), None)
            # (Anthropic's clients send their key as x-api-key: either header may hold it)
            other = next((value for name, value in scope["headers"] if name == b"x-api-key"), None)
            allowed = ((given is not None and self._allowed(given))
                       or (other is not None and self._allowed(other, bearer=False)))
            given = given if given is not None else other
            if not allowed:
                message = ("no API key given: send the header 'Authorization: Bearer <key>' (OpenAI clients send "
                           "their api_key so; Anthropic's send x-api-key)" if given is None
                           else "incorrect API key")  # never echo it
                error = RequestError(message, code="invalid_api_key", status=401)
                response = error_response(error) if not path.startswith("/v1/messages") else _AsciiJSONResponse(
                    anthropic.error_body(401, message), status_code=401)  # (in the envelope of the API asked)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ClientLeft(Exception):
    """The client disconnected before its request's body had arrived."""


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "TextPart"}


# How a message names the members of a union field (``prompt``: a string or token ids) that a value fitted none of.
_TAG_WORDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "none": "null",
              "list[str]": "a list of strings", "list[int]": "a list of integers",
              "list[list[int]]": "a list of one list of integers", "list[TextPart]": "a list of text parts"}


def _is_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _from_validation(error: ValidationError) -> RequestError:
    errors = error.errors()
    first = errors[0]
    # Union members add their type to the location ("stop.str"); OpenAI names only the field.
    param = ".".join(str(part) for part in first["loc"] if not _is_tag(part)) or None
    # The union member each error is about, for the errors on the first one's field (the path up to its tag).
    field = first["loc"][:next((i for i, part in enumerate(first["loc"]) if _is_tag(part)), len(first["loc"]))]
    tags = [e["loc"][len(field)] for e in errors if e["loc"][:len(field)] == field and len(e["loc"]) > len(field)]
    if field and len(tags) > 1 and all(tag in _TAG_WORDS for tag in tags):
        # A value that fits no member of a union: name every member, not only the first one's complaint.
        words = list(dict.fromkeys(_TAG_WORDS[tag] for tag in tags))
        name = ".".join(str(part) for part in field)
        return RequestError(f"{name}: should be {', '.join(words[:-1])} or {words[-1]}", param=name)
    message = first["msg"].removeprefix("Value error, ")  # a validator's own message, without pydantic's label
    return RequestError(f"{param}: {message}" if param else message, param=param)


def _from_engine(error: Exception, retry_after: int, prompt_param: str | None = None) -> RequestError:
    """``prompt_param``: what the request named its prompt (``messages``, ``prompt``), for errors about it."""
    if isinstance(error, QueueFullError):
        return RequestError(str(error), code="queue_full", status=429, type_="server_overloaded",
                            retry_after=retry_after)
    if isinstance(error, ShuttingDownError):
        return _shutting_down(str(error), retry_after)
    if isinstance(error, ContextTooLongError):
        return RequestError(str(error), param=prompt_param, code="context_length_exceeded")
    if isinstance(error, (JointspecError, ValueError, TypeError)):
        return RequestError(str(error), param=getattr(error, "param", None))
    log.exception("engine failed on a request", exc_info=error)
    return RequestError("internal error in the engine", code="engine_error", status=500, type_="server_error")


def _from_failure(failure: Failure, retry_after: int) -> RequestError:
    if failure.code == "shutting_down":
        return _shutting_down(failure.message, retry_after)
    if failure.code == "invalid_request":
        return RequestError(failure.message, code=failure.code, status=400)
    return RequestError(failure.message, code=failure.code, status=500, type_="server_error")


def _failure_outcome(failure: Failure) -> str:
    """The metrics' outcome of a request that failed once decoding: its own method refusing a round is a 400 to the
    client, so ``rejected``, as other 400s; anything else ``error``."""
    return "rejected" if failure.code == "invalid_request" else "error"


def _shutting_down(message: str, retry_after: int) -> RequestError:
    return RequestError(message, code="shutting_down", status=503, type_="server_error", retry_after=retry_after)


def _internal_error() -> RequestError:
    """What a request gets where the server failed in a way no rule names (a bug; the server logs it)."""
    return RequestError("internal server error", code="internal_error", status=500, type_="server_error")


def _timeout(seconds: float) -> RequestError:
    return RequestError(f"the request took longer than the server's request timeout ({seconds:g} s) and was "
                        "stopped", code="timeout", status=504, type_="server_error")


class _InFlight:
    """Requests the routes admitted and have not finished answering; and whether they still admit new ones.
    Thread-safe: drain() may run on another thread's loop than the requests (tests do that)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.admitting = True

    def enter(self) -> _Ticket | None:
        with self._lock:
            if not self.admitting:
                return None
            self.count += 1
            return _Ticket(self)

    def stop_admitting(self) -> None:
        with self._lock:
            self.admitting = False

    def leave(self) -> None:
        with self._lock:
            self.count -= 1

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return not self.count


class _Ticket:
    """One request's place in :class:`_InFlight`, given back exactly once."""

    def __init__(self, owner: _InFlight) -> None:
        self.owner, self.closed = owner, False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner.leave()


# -- the app ----------------------------------------------------------------------------------------------------

def create_app(settings: ServerSettings, engine: Engine) -> FastAPI:
    metrics = Metrics()
    in_flight = _InFlight()
    call_format = engine.call_format  # (the model's, read once)
    special = engine.call_markers  # (its markers that are tokens of the tokenizer)
    # (Harmony's headers are its answers' structure, not a block they may leave out: a format is held in the final
    # message whatever the reasoning format)
    harmony_answers = getattr(getattr(engine, "reasoning_tags", None), "harmony", False)
    stored = ResponseStore(settings.stored_responses if settings.stored_responses_mb else 0,
                           settings.stored_responses_mb << 20)
    lookup = stored.get if stored.capacity else None  # (what previous_response_id may name)

    async def drain(timeout: float | None = None) -> None:
        """Shut down without losing a request: refuse new ones (503), give those in flight up to ``timeout``
        seconds (default: ``settings.drain_timeout``) to finish, then close the engine, which ends the rest with an
        error that their routes write. Safe to call more than once."""
        in_flight.stop_admitting()
        grace = settings.drain_timeout if timeout is None else timeout
        if not await in_flight.wait_idle(grace):
            log.warning("draining: %d requests still running after %g s; ending them with an error",
                        in_flight.count, grace)
        await asyncio.to_thread(engine.close)  # blocks on the engine thread: keep the event loop free meanwhile
        if not await in_flight.wait_idle(FLUSH_SECONDS):
            log.warning("draining: %d requests unanswered after the engine closed", in_flight.count)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await drain()  # under plain uvicorn this runs once its connections have closed: it closes the engine

    # No schema page (it lists internal names) and no redirect of a trailing slash (its Location echoes the request's
    # Host header): such a path is a 404 with the envelope, as any unknown path is.
    app = FastAPI(title="jointspec", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  lifespan=lifespan)
    app.state.settings, app.state.engine, app.state.metrics, app.state.drain = settings, engine, metrics, drain
    if settings.api_key is not None:
        app.add_middleware(_ApiKeyGate, key=settings.api_key)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def _routing_error(request: Request, error: HTTPException) -> JSONResponse:
        # An unknown path or method: OpenAI's envelope (clients read error.message), not FastAPI's {"detail": ...}.
        message = (f"Invalid URL ({request.method} {request.url.path}); this server answers POST /v1/completions, "
                   "/v1/chat/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens, /tokenize and "
                   "/detokenize, GET /v1/models, GET and DELETE /v1/responses/{id}, GET "
                   "/v1/responses/{id}/input_items, /health and /metrics"
                   if error.status_code in (404, 405) else str(error.detail))
        body = (anthropic.error_body(error.status_code, message) if request.url.path.startswith("/v1/messages")
                else RequestError(message, status=error.status_code).body())  # (the envelope of the API asked)
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=error)
        return error_response(_internal_error())

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some load balancers probe with
    async def health() -> JSONResponse:
        if not in_flight.admitting:  # load balancers: send no more here
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        """The served model as OpenAI's clients read it, and (type, display_name, created_at, lifecycle) as
        Anthropic's read it: one object both take."""
        return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "jointspec", "type": "model",
                "display_name": engine.model_id, "created_at": "1970-01-01T00:00:00Z", "lifecycle": "active"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        # (the list as both APIs write it: OpenAI's object and data, Anthropic's page fields)
        return {"object": "list", "data": [model_card()], "has_more": False, "first_id": engine.model_id,
                "last_id": engine.model_id}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != engine.model_id:
            return error_response(RequestError(f"this server serves the model '{engine.model_id}', not '{model_id}'",
                                               param="model", code="model_not_found", status=404))
        return model_card()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(engine.snapshot(), in_flight.count), media_type=CONTENT_TYPE)

    def stored_response(response_id: str) -> StoredResponse:
        kept = stored.get(response_id)
        if kept is None:
            why = ("responses are not stored on this server (--stored-responses 0)" if not stored.capacity else
                   "it was stored with store: false, failed, was deleted or dropped for newer ones, or was made "
                   "before the server started")
            raise RequestError(f"no stored response has id {json.dumps(response_id)}: {why}", status=404)
        return kept

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        if request.query_params.get("stream") not in (None, "false"):
            raise RequestError("stream: a stored response is returned whole (its events are not kept)",
                               param="stream")
        return stored_response(response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request):
        query = request.query_params
        limit = query.get("limit", "20")
        try:
            return input_items_page(stored_response(response_id), int(limit) if re.fullmatch(r"[0-9]+", limit)
                                    else limit, query.get("order", "desc"), query.get("after"), query.get("before"))
        except ResponsesError as error:
            raise RequestError(str(error), param=error.param) from None

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        stored_response(response_id)
        stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions", CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat", ChatBody)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await _serve(request, "responses", ChatBody)  # (read into a chat request: server/responses.py)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await _serve(request, "messages", ChatBody)  # (Anthropic's API, read likewise: server/anthropic.py)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        """Anthropic's token count: the request's prompt as the model reads it, nothing decoded."""
        def work(raw: bytes) -> dict:
            body = _parse_count(raw, call_format, special)
            return {"input_tokens": len(engine.encode(_engine_requests(body)[0]))}

        return await _tokenizer_route(request, work, "messages")

    async def _tokenizer_route(request: Request, work, endpoint: str) -> JSONResponse | Response | dict:
        """A route that reads a request and decodes nothing (a token count, the tokenizer's routes): ``work(raw)`` on
        the request's body, off the loop; refusals in ``endpoint``'s API's envelope."""
        try:
            raw = await _read_body(request, settings.max_request_bytes, settings.body_timeout)
            return await asyncio.to_thread(work, raw)
        except RequestError as error:
            return refusal(endpoint, error)
        except _ClientLeft:
            return Response(status_code=400)  # (nobody reads it)
        except Exception as error:  # noqa: BLE001 - the engine's refusals (a template's, a bad bias), as on the chat route
            translated = _from_engine(error, settings.retry_after, "messages")
            if translated.status >= 500:
                log.exception("unhandled error", exc_info=error)
            return refusal(endpoint, translated)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's and llama.cpp's tokenizer route: a text (``prompt``; llama.cpp's ``content``) or a chat's
        ``messages`` (with its tools) as the model reads it, nothing decoded."""
        def work(raw: bytes) -> dict:
            data = _json_object(raw)
            if data.get("messages") is not None:
                if data.get("add_generation_prompt", True) is not True:
                    raise RequestError("add_generation_prompt false is not served: the prompt counted is the one the "
                                       "chat route reads, which opens the assistant's turn",
                                       param="add_generation_prompt")
                body = _parse(json.dumps({**data, "max_tokens": 1}).encode(), ChatBody, call_format, None, special)
                tokens = engine.encode(_engine_requests(body)[0])
            else:
                text = data.get("prompt", data.get("content"))
                if not isinstance(text, str):
                    raise RequestError("send the text to count as prompt (llama.cpp's content), or a chat's messages",
                                       param="prompt")
                # (vLLM adds the tokenizer's special tokens to a prompt by default, llama.cpp none to its content)
                add = data.get("add_special_tokens", data.get("add_special", "prompt" in data))
                if not isinstance(add, bool):
                    raise RequestError("add_special_tokens must be true or false", param="add_special_tokens")
                tokens = engine.tokenize(text, add)
            reply: dict = {"count": len(tokens), "max_model_len": engine.context_length, "tokens": tokens}
            if data.get("return_token_strs") is True:
                reply["token_strs"] = [engine.spelling(token)[0] for token in tokens]
            if data.get("with_pieces") is True:  # (llama.cpp's form)
                reply["tokens"] = [{"id": token, "piece": engine.spelling(token)[0]} for token in tokens]
            return reply

        return await _tokenizer_route(request, work, "tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's and llama.cpp's: token ids back to text (``prompt``, and llama.cpp's ``content``)."""
        def work(raw: bytes) -> dict:
            tokens = _json_object(raw).get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in tokens):
                raise RequestError("tokens must be a list of token ids", param="tokens")
            try:
                text = engine.detokenize(tokens)
            except ValueError as error:
                raise RequestError(str(error), param="tokens") from None
            return {"prompt": text, "content": text}

        return await _tokenizer_route(request, work, "tokenize")

    def refusal(endpoint: str, error: RequestError) -> JSONResponse:
        """An error in the envelope of the API the route speaks (Anthropic's on /v1/messages, else OpenAI's)."""
        response = error_response(error)
        if endpoint != "messages":
            return response
        return _AsciiJSONResponse(anthropic.error_body(error.status, error.message), status_code=error.status,
                                  headers={k: v for k, v in response.headers.items() if k.lower() == "retry-after"})

    async def _serve(request: Request, endpoint: str, model: type[_Sampling]):
        arrived = time.perf_counter()
        deadline = arrived + settings.request_timeout if settings.request_timeout else None
        try:
            # The body before a place in flight: a client that never sends it holds no place (nor the drain).
            raw = await _read_body(request, settings.max_request_bytes, settings.body_timeout)
        except RequestError as error:
            metrics.count_request(endpoint, error.outcome)
            return refusal(endpoint, error)
        except _ClientLeft:
            metrics.count_request(endpoint, "cancelled")
            return Response(status_code=400)  # (nobody reads it)
        ticket = in_flight.enter()
        if ticket is None:
            metrics.count_request(endpoint, "overloaded")
            return refusal(endpoint, _shutting_down("the server is shutting down; retry on another instance or later",
                                                 settings.retry_after))
        streaming = False
        body = None
        try:
            try:
                # (a large body's parse takes its time: off the loop)
                body = await asyncio.to_thread(_parse, raw, model, call_format,
                                               endpoint if endpoint in TRANSLATED else None, special, lookup)
                engine_requests = _engine_requests(body, reasoning_first=settings.reasoning_format == "auto"
                                                   or harmony_answers)
                generations = await _submit_choices(engine_requests, body.n, deadline)
            except RequestError as error:
                metrics.count_request(endpoint, error.outcome)
                if body is not None and body._translated is not None:  # (named as the client named it)
                    error = _as_translated(error, body._translated[1])
                return refusal(endpoint, error)
            except Exception as error:  # noqa: BLE001 - a bug: a 500 envelope, counted, the connection kept
                # (answered here: Starlette's catch-all handler re-raises after its reply, and uvicorn then drops
                # the connection, and the next request a client sends on it)
                log.exception("unhandled error", exc_info=error)
                metrics.count_request(endpoint, "error")
                return refusal(endpoint, _internal_error())
            for generation in generations:  # (each choice reads its prompt)
                metrics.count_tokens(num_prompt_tokens=generation.num_prompt_tokens)
            shared = engine_requests[0]  # (the settings every prompt's request shares)
            sampled = shared.temperature > 0 and shared.max_tokens != 0  # (a prompt scored alone samples nothing)
            # usage counts each prompt once, however many choices read it
            shaper = None
            if endpoint == "responses":
                data, translated = body._translated
                keep = None
                if stored.capacity and data.get("store") is not False:  # (true unless sent false, as OpenAI's)
                    def keep(response: dict, request: ChatRequest = translated) -> None:
                        stored.put(StoredResponse.of(response, request.conversation, request.continued))
                shaper = ResponseShaper(data, body.model_dump(exclude_none=True), keep)
            elif endpoint == "messages":
                shaper = anthropic.MessageShaper()
            reply = _Reply("chat" if shaper else endpoint, engine.model_id,
                           sum(generation.num_prompt_tokens for generation in generations[::body.n]),
                           shared.seed if sampled else None,
                           engine.spelling if shared.logprobs is not None else None)
            reply.choices_per_prompt = body.n
            use = body._tools_read
            reply.tools = use if use is not None and use.reads_calls else None
            # (a format, a response_format's or calls', is the content's: its grammar lets reasoning come first)
            if endpoint != "completions" and settings.reasoning_format == "auto":
                reply.reasoning = {index: generation.opens_reasoning for index, generation in enumerate(generations)
                                   if generation.opens_reasoning is not None}
                reply.reasoning_tags = {index: getattr(generation, "reasoning_tags", THINK)
                                        for index, generation in enumerate(generations)}
            elif endpoint != "completions":  # (Harmony's messages are read apart all the same: its calls are some)
                reply.reasoning_tags = {index: HARMONY_IN_CONTENT for index, generation in enumerate(generations)
                                        if getattr(generation, "reasoning_tags", THINK).harmony}
                reply.reasoning = {index: False for index in reply.reasoning_tags}
            if shared.echo:
                reply.echo = {index: (generation.echo_text, generation.prompt_logprobs)
                              for index, generation in enumerate(generations)}
            chunks = [_timed(generation, arrived, deadline) for generation in generations]
            if not body.stream:
                return await _whole(request, endpoint, reply, chunks, generations, body.return_token_ids, shaper)
            include_usage = bool(body.stream_options and body.stream_options.include_usage) or shaper is not None
            events = _sse(endpoint, reply, chunks, generations, include_usage, ticket, shaper)
            # Start the generator here: a body that never starts never runs its finally (which frees the row and
            # the ticket), and Starlette drops a response's body unstarted when the client is gone before it.
            first = await anext(events)
            streaming = True
            # no-cache: proxies that buffer cacheable responses would hold the events back.
            return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        finally:
            if not streaming:  # a stream gives its ticket back when it ends
                ticket.close()

    async def _submit_choices(engine_requests: list[CompletionRequest], n: int,
                              deadline: float | None) -> list[Generation]:
        """``n`` choices for each prompt's request, each a sequence of its own, in OpenAI's order (prompt i's choice j
        has index i * n + j): the choice of index k samples with the request's seed + k (a greedy request's choices of
        one prompt are the same answer). Several are admitted together or refused together (``submit_many``)."""
        requests = [replace(request, seed=(request.seed + i * n + j) % 2 ** 63)
                    for i, request in enumerate(engine_requests) for j in range(n)]
        one = len(requests) == 1
        submitting = engine.submit(requests[0]) if one else engine.submit_many(requests)
        try:
            if deadline is not None:
                submitting = asyncio.wait_for(submitting, max(deadline - time.perf_counter(), 0))
            generations = await submitting
        except TimeoutError:
            raise _timeout(settings.request_timeout) from None
        except Exception as error:
            prompt_param = "messages" if requests[0].messages is not None else "prompt"
            raise _from_engine(error, settings.retry_after, prompt_param) from error
        return [generations] if one else generations

    async def _timed(generation: Generation, arrived: float, deadline: float | None) -> AsyncIterator[Chunk]:
        """The engine's chunks until ``deadline``, recording latency and token counts on the way. Past the
        deadline the generation is cancelled (its row freed) and a 504 RequestError raised."""
        last = None
        chunks = aiter(generation)
        while True:
            try:
                if deadline is None:
                    chunk = await anext(chunks)
                else:
                    chunk = await asyncio.wait_for(anext(chunks), max(deadline - time.perf_counter(), 0))
            except StopAsyncIteration:
                return
            except TimeoutError:
                generation.cancel()
                raise _timeout(settings.request_timeout) from None
            now = time.perf_counter()
            if chunk.num_tokens:
                if last is None:
                    metrics.observe_first_token(generation.method, now - arrived)
                else:
                    metrics.observe_chunk(generation.method, now - last, chunk.num_tokens)
                last = now
                metrics.count_tokens(num_generated_tokens=chunk.num_tokens)
            if chunk.stats is not None and chunk.finish_reason is not None:
                metrics.count_tokens(num_cached_prompt_tokens=chunk.stats.prompt_tokens_reused)
            yield chunk

    async def _whole(request: Request, endpoint: str, reply: _Reply, chunks: list[AsyncIterator[Chunk]],
                     generations: list[Generation], return_token_ids: bool,
                     shaper: Shaper | None = None) -> JSONResponse:
        async def collect(choice: AsyncIterator[Chunk]) -> list[Chunk]:
            return [chunk async for chunk in choice]

        async def collect_all() -> list[list[Chunk]]:  # (a task: cancelled, it takes its gather's error with it)
            return await asyncio.gather(*(collect(choice) for choice in chunks))

        collecting = asyncio.ensure_future(collect_all())
        leaving = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            left = not collecting.done()
            if left:  # the client left (or this task was cancelled): stop decoding for it
                collecting.cancel()
                for generation in generations:
                    generation.cancel()
                metrics.count_request(endpoint, "cancelled")
        if left:
            return JSONResponse({}, status_code=499)  # nobody reads it
        if isinstance(collecting.exception(), RequestError):  # past the request timeout
            for generation in generations:
                generation.cancel()
            metrics.count_request(endpoint, "timeout")
            return refusal(endpoint, collecting.exception())
        collected = collecting.result()
        failure = next((c[-1].failure for c in collected if c and c[-1].failure is not None), None)
        if failure is not None:
            metrics.count_request(endpoint, _failure_outcome(failure))
            return refusal(endpoint, _from_failure(failure, settings.retry_after))
        metrics.count_request(endpoint, "completed")
        whole = reply.whole(collected, return_token_ids=return_token_ids)
        return JSONResponse(shaper.whole(whole) if shaper is not None else whole)

    async def _sse(endpoint: str, reply: _Reply, chunks: list[AsyncIterator[Chunk]], generations: list[Generation],
                   include_usage: bool, ticket: _Ticket, shaper: Shaper | None = None) -> AsyncIterator[str]:
        """The stream's events: the chat or completions chunks, or (``shaper``) another API's events made from them
        (OpenAI's Responses, Anthropic's Messages)."""
        def send(payload: dict) -> list[str]:
            return shaper.events(payload) if shaper is not None else [_event(payload)]

        outcome = "cancelled"  # unless it gets to an end of its own: the client left
        try:
            if shaper is not None:
                for event in shaper.start(engine.model_id, reply.num_prompt_tokens):
                    yield event
            for index in range(len(chunks)):
                for event in send(reply.first_chunk(index)):
                    yield event
                if index in reply.echo:
                    yield _event(reply.echo_chunk(index))
            try:
                async for index, chunk in _merged(chunks):
                    reply.add(chunk, index)
                    if chunk.failure is not None:
                        outcome = _failure_outcome(chunk.failure)
                        for event in send(_from_failure(chunk.failure, settings.retry_after).body()):
                            yield event
                        return
                    # Rounds whose text is held back (half a character) send nothing, unless they carry the
                    # log-probabilities of their tokens.
                    if chunk.text or chunk.finish_reason or chunk.logprobs:
                        for payload in reply.events(chunk, index):
                            for event in send(payload):
                                yield event
            except RequestError as error:  # past the request timeout
                outcome = "timeout"
                for event in send(error.body()):
                    yield event
                return
            if include_usage:
                for event in send(reply.usage_chunk()):
                    yield event
            if shaper is not None:
                for event in shaper.end(engine.model_id):
                    yield event
            else:
                yield "data: [DONE]\n\n"
            outcome = "completed"
        finally:
            if outcome != "completed":  # the client left, or the stream failed: free the rows
                for generation in generations:
                    generation.cancel()
            metrics.count_request(endpoint, outcome)
            ticket.close()

    return app


async def _merged(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, chunk) from every stream as each chunk arrives (one stream: its chunks in turn); an error any stream
    raises ends the merge, raised here, its siblings' reads cancelled."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                index = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, chunk
    finally:
        for task in pending:
            task.cancel()


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield first
    async for item in rest:
        yield item


async def _read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The request's body: refused (413) past ``max_bytes``, unread where its Content-Length says so; 408 if it has
    not arrived within ``timeout`` seconds; :class:`_ClientLeft` if the client went away meanwhile."""
    too_large = RequestError(f"the request body is larger than this server takes ({max_bytes} bytes)",
                             code="request_too_large", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    parts: list[bytes] = []

    async def read() -> None:
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > max_bytes:
                raise too_large
            parts.append(part)

    try:
        await asyncio.wait_for(read(), timeout)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout:g} s", code="timeout",
                           status=408) from None
    except ClientDisconnect:
        raise _ClientLeft from None
    return b"".join(parts)


def _lone_surrogate(data) -> str | None:
    """Where ``data`` (parsed JSON) holds a string with a lone UTF-16 surrogate (``"\\ud800"``: valid JSON, not
    text): its field's name, as errors name fields; None where every string is text."""
    stack = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
            stack.extend(("body", key) for key in value)  # a key is text too
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}" if path else str(i), item) for i, item in enumerate(value))
    return None


# JSON escapes of UTF-16 surrogates: how a lone one reaches a parsed string from a UTF-8 body.
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def _parse(raw: bytes, model: type[_Sampling], call_format: str = HERMES, api: str | None = None,
           special: tuple[tuple[str, int], ...] = (),
           stored: Callable[[str], StoredResponse | None] | None = None) -> _Sampling:
    """A request's body, read and checked; ``call_format``: the format the model writes tool calls in
    (server/tools.py), ``special`` its markers that are special tokens; ``api``: another API's body ("responses":
    OpenAI's Responses API; "messages": Anthropic's), read into the chat body that decodes it (server/responses.py,
    server/anthropic.py; the original is kept as the body's ``_translated``); ``stored``: the stored responses a
    Responses request may continue (None: none)."""
    data = _json_object(raw)
    if api is None:
        return _checked(data, model, call_format, special)
    try:
        request = chat_request(data, stored) if api == "responses" else anthropic.chat_request(data)
    except TranslationError as error:
        raise RequestError(str(error), param=error.param, code=error.code) from None
    try:
        body = _checked(request.body, model, call_format, special)
    except RequestError as error:
        raise _as_translated(error, request) from None
    body._translated = (data, request)
    return body


def _json_object(raw: bytes) -> dict:
    """A request's body read as a JSON object of text (RequestError where it is not one)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad bytes, a 5,000-digit number, deep nesting
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise RequestError(f"the body is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    # The walk only where a surrogate may be: an escape of one in a UTF-8 body, or any body json.loads read as
    # UTF-16 or UTF-32 (a NUL among its first bytes), where the escape's bytes are spread out.
    maybe = b"\x00" in raw[:4] or _SURROGATE_ESCAPE.search(raw)
    where = _lone_surrogate(data) if maybe else None
    if where is not None:
        raise RequestError(f"{where}: a string holds a lone UTF-16 surrogate (an escape such as \\ud800 that is no "
                           "character): send text", param=where)
    return data


def _parse_count(raw: bytes, call_format: str, special: tuple[tuple[str, int], ...] = ()) -> _Sampling:
    """A count_tokens body (a Messages request without max_tokens, which counting needs not) read as /v1/messages
    reads one."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and "max_tokens" not in data:
        raw = json.dumps({**data, "max_tokens": 1}).encode()
    return _parse(raw, ChatBody, call_format, "messages", special)


def _as_translated(error: RequestError, request: ChatRequest) -> RequestError:
    """A chat request's error as the other API's request it came from names its fields."""
    error.param, error.message = request.wording(error.param), request.wording(error.message)
    return error


def _checked(data: dict, model: type[_Sampling], call_format: str,
             special: tuple[tuple[str, int], ...] = ()) -> _Sampling:
    """A request's body, already read as JSON, checked (``_parse``)."""
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise _from_validation(error) from None
    if body.n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES} (each choice takes a row of the batch), got {body.n}",
                           param="n")
    if getattr(body, "best_of", None) not in (None, 1):
        raise RequestError("best_of > 1 is not supported", param="best_of")
    _requested_logprobs(body)  # refused here where out of range
    if body.max_tokens == 0 and not getattr(body, "echo", False):
        raise RequestError("max_tokens 0 asks for no answer: it needs echo: true (the prompt alone, scored with "
                           "logprobs)", param="max_tokens")
    if getattr(body, "suffix", None):
        raise RequestError("suffix (insertion) is not supported: the answer would ignore it", param="suffix")
    if any(kind != "text" for kind in getattr(body, "modalities", None) or ()):
        raise RequestError("audio output is not supported: this server answers text", param="modalities")
    if getattr(body, "audio", None):
        raise RequestError("audio output is not supported: this server answers text", param="audio")
    if getattr(body, "web_search_options", None) is not None:
        raise RequestError("web search is not supported: the answer would ignore it", param="web_search_options")
    if getattr(body, "continue_final_message", False) and (body.messages[-1].role != "assistant"
                                                           or body.messages[-1].tool_calls):
        raise RequestError("continue_final_message continues the last message, which must be an assistant's text",
                           param="continue_final_message")
    if getattr(body, "chat_template_kwargs", None) is not None:
        try:
            check_template_kwargs(body.chat_template_kwargs)
        except ValueError as error:
            raise RequestError(str(error), param="chat_template_kwargs") from None
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {json.dumps(effort)}",
                           param="reasoning_effort")
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed when stream is true", param="stream_options")
    _logit_bias(body.logit_bias)  # refused here where malformed or out of range
    response_format = _output_format(body.response_format)  # refused here, before anything is queued
    use = body._tools_read = _tool_use(body, call_format, special)  # refused here where malformed
    if use is not None and use.reads_calls and response_format is not None:
        raise RequestError("response_format and tools together: an answer cannot be both the schema's JSON and tool "
                           "calls; send tool_choice: none, or no response_format", param="response_format")
    for index, message in enumerate(getattr(body, "messages", ())):
        try:
            check_message(message.model_dump(), f"messages.{index}")
        except ToolError as error:
            raise RequestError(str(error), param=error.param) from None
    if isinstance(body, CompletionBody):
        prompts = _prompts(body)
        if not prompts:
            raise RequestError("the prompt is empty", param="prompt")
        for index, prompt in enumerate(prompts):
            if not prompt:
                raise RequestError(f"prompt {index} is empty", param="prompt")
        if len(prompts) * body.n > MAX_SEQUENCES:
            raise RequestError(f"{len(prompts)} prompts x n = {body.n} choices ask for more than the {MAX_SEQUENCES} "
                               "sequences a request may take: send fewer at a time", param="prompt")
    return body


def _tool_use(body: _Sampling, call_format: str = HERMES,
              special: tuple[tuple[str, int], ...] = ()) -> ToolUse | None:
    """The request's tools and tool choice (server/tools.py); RequestError naming the field at fault."""
    if isinstance(body, CompletionBody):
        for name in ("tools", "functions"):
            if getattr(body, name):
                raise RequestError(f"{name} are for chat completions (/v1/chat/completions), where a chat template "
                                   "shows them to the model", param=name)
    try:
        return read_tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, functions=body.functions,
                             function_call=body.function_call, call_format=call_format, special=special)
    except ToolError as error:
        raise RequestError(str(error), param=error.param) from None


def _prompts(body: CompletionBody) -> list[str | list[int]]:
    """A completions body's prompts: one (a string or token ids), or a batch (a list of strings or of token id
    lists)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return list(prompt)
    return [prompt]


def _requested_logprobs(body: _Sampling) -> int | None:
    """How many of the most likely tokens a request wants listed beside each answer token's log-probability, or None
    where it wants no log-probabilities: chat's ``logprobs: true`` with ``top_logprobs`` (0 where left out), or
    completions' ``logprobs`` count (0: the chosen tokens' own alone)."""
    if isinstance(body, ChatBody):
        top = body.top_logprobs
        if top is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
        return (top or 0) if body.logprobs else None
    value = getattr(body, "logprobs", None)
    if value is None or value is False:
        return None
    if value is True or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS} (the most likely tokens to "
                           f"list beside each chosen one), got {json.dumps(value)}", param="logprobs")
    return value


def _output_format(response_format: dict | None) -> OutputFormat | None:
    """OpenAI's ``response_format``: ``text`` (free text), ``json_object`` (any JSON object; JSON its ``schema`` accepts
    where it has one, llama.cpp's servers' form) or ``json_schema`` (JSON its ``json_schema.schema`` accepts), as the
    structured output every method decodes (core/grammar.py)."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":  # with a "schema", as llama.cpp's servers (and Anyscale's) take one there
        schema = response_format.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise RequestError("response_format.schema must be a JSON schema object", param="response_format.schema")
        return OutputFormat.json_schema(schema)
    if kind != "json_schema":
        raise RequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise RequestError("response_format json_schema needs a JSON schema object at response_format.json_schema."
                           "schema", param="response_format.json_schema")
    return OutputFormat.json_schema(spec["schema"])


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token ids as strings, amounts in [-100, 100]) as checked pairs; RequestError naming
    the bad entry."""
    pairs: dict[int, float] = {}
    for token, amount in (bias or {}).items():
        if not re.fullmatch(r"[0-9]+", token):  # (int() takes " 5", "+5", "5_0" and other digits too)
            raise RequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
        key = int(token)
        if key in pairs:
            raise RequestError(f"logit_bias lists token {key} twice", param="logit_bias")
        pairs[key] = amount
    try:
        return checked_bias(pairs)
    except (TypeError, ValueError) as error:
        raise RequestError(str(error), param="logit_bias") from None


def _engine_requests(body: _Sampling, reasoning_first: bool = False) -> list[CompletionRequest]:
    """The engine's request for each of ``body``'s prompts (chat: one); ``reasoning_first``: a chat's format is its
    content's, after any reasoning (server/reasoning.py)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    options = body.jointspec.model_dump(exclude_none=True) if body.jointspec else None
    # Without a seed a request samples afresh, as OpenAI's API does: its own seed, which its usage reports.
    seed = body.seed if body.seed is not None and body.seed != -1 else fresh_seed()
    top_p, top_k = body.top_p, body.top_k
    if top_p == 0:  # OpenAI's API takes it: the smallest set of tokens holding probability 0 is the top one alone
        top_p, top_k = 1.0, 1
    # OpenAI's API takes any temperature in [0, 2]; one too small to sample with is greedy decoding, its limit.
    temperature = body.temperature if body.temperature >= MIN_TEMPERATURE else 0.0
    penalties = Penalties(body.repetition_penalty, body.presence_penalty, body.frequency_penalty,
                          _logit_bias(body.logit_bias))
    use = body._tools_read  # (read by _parse)
    output_format = use.output_format() if use is not None else None
    if output_format is not None and use.call_format.reasons_itself:
        reasoning_first = False  # (Harmony's call grammar holds the whole answer, its analysis included)
    common = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=body.min_p, seed=seed, penalties=penalties,
                  stop=stop, method=options, user=body.user,
                  output_format=output_format or _output_format(body.response_format),
                  logprobs=_requested_logprobs(body))
    try:
        if isinstance(body, ChatBody):
            messages = tuple(_message(m) for m in body.messages)
            return [CompletionRequest(messages=messages, max_tokens=body.max_completion_tokens or body.max_tokens,
                                      tools=use.shown() if use is not None else (),
                                      template_kwargs=_template_kwargs(body),
                                      continue_final=body.continue_final_message, reasoning_first=reasoning_first,
                                      **common)]
        return [CompletionRequest(prompt=prompt, max_tokens=body.max_tokens, echo=body.echo, **common)
                for prompt in _prompts(body)]
    except ValueError as error:
        raise RequestError(str(error)) from None


def _template_kwargs(body: ChatBody) -> dict | None:
    """The chat template's further variables: the request's ``chat_template_kwargs``, and its ``reasoning_effort``
    where those do not name it."""
    if body.reasoning_effort is None:
        return body.chat_template_kwargs
    return {"reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}


def _message(message: Message) -> dict:
    """A chat message as the engine reads it: its text joined, OpenAI's `developer` as chat templates' `system` and
    its older `function` result as a `tool` message, an assistant's calls and a tool result's call id kept
    (server/tools.py renders them)."""
    content = message.content
    if not isinstance(content, str) and content is not None:
        content = "".join(part.text for part in content)
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    read = {"role": role, "content": content or ""}
    if message.tool_calls:
        read["tool_calls"] = message.tool_calls
    elif message.function_call:
        read["tool_calls"] = [{"id": "", "type": "function", "function": message.function_call}]
    if role == "tool":  # (the older function message answers by the function's name, not a call id)
        read["tool_call_id"] = message.tool_call_id or ""
    if role == "assistant" and message.reasoning_content is not None:
        read["reasoning_content"] = message.reasoning_content  # (Qwen3's template reads it; others ignore it)
    return read


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Reply:
    """OpenAI's response shapes for one request, and the running totals its usage reports."""

    def __init__(self, endpoint: str, model_id: str, num_prompt_tokens: int, seed: int | None,
                 spell: TokenSpelling | None = None) -> None:
        self.chat = endpoint == "chat"
        # token id -> (its text, its UTF-8 bytes), for the log-probabilities (backends/tokens.py, TokenSpelling);
        # None: the request asked for none.
        self.spell = spell
        # completions' logprobs: each choice's UTF-8 decoder and the characters its text holds so far, by index, for
        # each token's text_offset
        self.written: dict[int, tuple[codecs.IncrementalDecoder, int]] = {}
        # Completions' echo, by choice: its prompt's text, and its tokens' figures where logprobs were asked for
        # (Generation); empty without echo.
        self.echo: dict[int, tuple[str, list[tuple[int, TokenLogprob | None]] | None]] = {}
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model_id
        self.num_prompt_tokens = num_prompt_tokens
        self.seed = seed  # a sampled request's (None: greedy)
        self.num_tokens = 0
        self.num_rounds = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.num_forced = 0
        self.cached: dict[int, int] = {}  # by prompt: its tokens read from the prompt cache, not again
        self.choices_per_prompt = 1
        # The tools whose calls each choice's answer is read for (server/tools.py); None: the answer is text.
        self.tools: ToolUse | None = None
        self.call_streams: dict[int, CallStream] = {}  # by choice, while streaming with tools
        # By choice, where its answer is read for reasoning (server/reasoning.py): whether it begins inside a block.
        self.reasoning: dict[int, bool] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}  # by choice, while streaming
        self.reasoning_tags: dict[int, Tags] = {}  # by choice: its template's reasoning tags (default <think>)

    def add(self, chunk: Chunk, index: int = 0) -> None:
        self.num_tokens += chunk.num_tokens
        self.num_rounds += chunk.num_rounds
        self.num_drafted += chunk.num_drafted
        self.num_accepted += chunk.num_accepted
        self.num_forced += chunk.num_forced
        if chunk.stats is not None:  # each prompt's: the most any of its choices took from the prompt cache
            prompt = index // self.choices_per_prompt
            self.cached[prompt] = max(self.cached.get(prompt, 0), chunk.stats.prompt_tokens_reused)

    def _envelope(self, kind: str, *choices: dict) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": list(choices)}

    def usage(self) -> dict:
        # "jointspec" is an extension: OpenAI's clients keep unknown usage fields (or drop them) without failing.
        mean = 1 + self.num_accepted / self.num_rounds if self.num_rounds else 0.0
        rate = self.num_accepted / self.num_drafted if self.num_drafted else 0.0
        figures = {"drafted_tokens": self.num_drafted, "accepted_tokens": self.num_accepted, "rounds": self.num_rounds,
                   "mean_accepted_tokens": round(mean, 4), "acceptance_rate": round(rate, 4),
                   "forced_tokens": self.num_forced}
        if self.seed is not None:
            figures["seed"] = self.seed
        # OpenAI's own field for prompt tokens served from a cache.
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}, "jointspec": figures}

    @staticmethod
    def _finish(reason: str | None) -> str | None:
        return {"cancelled": "stop"}.get(reason, reason)

    def first_chunk(self, index: int = 0) -> dict:
        if self.chat:
            # (with tools, no empty content yet: an answer that only calls has none, as a whole answer says)
            delta = {"role": "assistant"} if self.tools is not None else {"role": "assistant", "content": ""}
            return self._envelope("chat.completion.chunk", {"index": index, "delta": delta, "finish_reason": None})
        return self._envelope("text_completion", {"index": index, "text": "", "logprobs": None, "finish_reason": None})

    def logprobs(self, figures: list[TokenLogprob], index: int = 0) -> dict | None:
        """OpenAI's ``logprobs`` of choice ``index`` (or of a streamed chunk of it) for ``figures``, in the
        endpoint's shape: chat's ``content`` list (each token with its text, bytes and ``top_logprobs``), or
        completions' parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as text -> log-probability with
        the chosen token among them, ``text_offset``). None where the request asked for none."""
        if self.spell is None:
            return None
        if self.chat:
            def entry(token_id: int, value: float) -> dict:
                text, data = self.spell(token_id)
                return {"token": text, "logprob": json_logprob(value), "bytes": list(data)}
            return {"content": [{**entry(f.token_id, f.logprob), "top_logprobs": [entry(*pair) for pair in f.top]}
                                for f in figures], "refusal": None}
        return self._completion_logprobs([(f.token_id, f) for f in figures], index)

    def _completion_logprobs(self, entries: list[tuple[int, TokenLogprob | None]], index: int) -> dict:
        """Completions' lists for choice ``index``'s tokens given as (id, figures), figures None for an echoed
        prompt's first token (which nothing precedes): its entries are then null, as OpenAI writes them."""
        tokens, offsets = [], []
        decoder, written = self.written.get(index) or (codecs.getincrementaldecoder("utf-8")("replace"), 0)
        for token_id, _ in entries:
            text, data = self.spell(token_id)
            tokens.append(text)
            # Where its text starts in the answer, as the text decodes it: a whole token's characters are the last
            # its bytes add (before them, the U+FFFD of bytes before it that it shows were no character); a token
            # holding part of a character points where the text stood before it; special tokens write none.
            if self.spell.is_special(token_id):
                offsets.append(written)
                continue
            if written == 0 and self.spell.starts_text_without_its_space(token_id):
                data, text = data[1:], text[1:]  # the text's first token: its word marker's space is not in the text
            added = len(decoder.decode(data))
            offsets.append(written if text.startswith("bytes:") else written + max(0, added - len(text)))
            written += added
        self.written[index] = (decoder, written)
        top = [None if f is None else
               {self.spell(token_id)[0]: json_logprob(value) for token_id, value in (*f.top, (f.token_id, f.logprob))}
               for _, f in entries]
        return {"tokens": tokens, "token_logprobs": [None if f is None else json_logprob(f.logprob)
                                                     for _, f in entries], "top_logprobs": top,
                "text_offset": offsets}

    def _prompt_logprobs(self, index: int) -> dict | None:
        """An echoed prompt's entries in choice ``index``'s lists (None where none were asked for)."""
        figures = self.echo.get(index, ("", None))[1]
        if self.spell is None or figures is None:
            return None
        return self._completion_logprobs(figures, index)

    def echo_chunk(self, index: int = 0) -> dict:
        """A streamed completion's echo: choice ``index``'s prompt text (and figures), before its answer's chunks."""
        return self._envelope("text_completion", {"index": index, "text": self.echo[index][0],
                                                  "logprobs": self._prompt_logprobs(index), "finish_reason": None})

    def chunk(self, chunk: Chunk, index: int = 0, reasoning: str = "") -> dict:
        """A streamed chunk; ``reasoning``: the reasoning it sends beside its text (chat)."""
        finish = self._finish(chunk.finish_reason)
        logprobs = self.logprobs(list(chunk.logprobs), index)
        if self.chat:
            delta = {"reasoning_content": reasoning} if reasoning else {}
            if chunk.text:
                delta["content"] = chunk.text
            choice = {"index": index, "delta": delta, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = logprobs
            if chunk.stop_string is not None:
                choice["stop_reason"] = chunk.stop_string
            return self._envelope("chat.completion.chunk", choice)
        choice = {"index": index, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}
        if chunk.stop_string is not None:
            choice["stop_reason"] = chunk.stop_string
        return self._envelope("text_completion", choice)

    def events(self, chunk: Chunk, index: int = 0) -> list[dict]:
        """What a streamed chunk sends: itself; with reasoning (server/reasoning.py) its reasoning and content
        apart; with tools (server/tools.py) its content less the text a call may be in, and at the end the calls,
        each whole, then the finish."""
        reasoning = ""
        if index in self.reasoning:
            split = self.reasoning_streams.setdefault(index, ReasoningStream(self.reasoning[index],
                                                                              self.reasoning_tags.get(index, THINK)))
            reasoning, text = split.feed(chunk.text, final=chunk.finish_reason is not None)
            chunk = replace(chunk, text=text)
        if self.tools is None:
            if index in self.reasoning and not (chunk.text or reasoning or chunk.logprobs or chunk.finish_reason):
                return []  # (all held back: the start of a tag, whitespace that may end the reasoning)
            return [self.chunk(chunk, index, reasoning)]
        stream = self.call_streams.setdefault(index, CallStream(self.tools))
        text = stream.feed(chunk.text)
        if chunk.finish_reason is None:
            return [self.chunk(replace(chunk, text=text), index, reasoning)] if (
                text or reasoning or chunk.logprobs) else []
        rest, calls = stream.finish(cut=chunk.finish_reason == "length")
        if not calls:
            return [self.chunk(replace(chunk, text=text + rest), index, reasoning)]
        events = []
        if text + rest or reasoning or chunk.logprobs:  # (calls ended it: no stop string is named)
            events.append(self.chunk(replace(chunk, text=text + rest, finish_reason=None, stop_string=None), index,
                                     reasoning))
        events.append(self._envelope("chat.completion.chunk", {"index": index, "delta": self._calls(calls, True),
                                                                "finish_reason": None}))
        events.append(self._envelope("chat.completion.chunk", {
            "index": index, "delta": {}, "finish_reason": self._call_finish(chunk.finish_reason)}))
        return events

    def _calls(self, calls: tuple[dict, ...], streamed: bool) -> dict:
        """An answer's calls as its message (or a streamed delta) carries them: ``tool_calls`` (streamed, each with its
        index), or the older form's one ``function_call``."""
        if self.tools.legacy:
            return {"function_call": calls[0]["function"]}
        return {"tool_calls": [{"index": number, **call} if streamed else call for number, call in enumerate(calls)]}

    def _call_finish(self, reason: str | None) -> str | None:
        """An answer that made calls ends with ``tool_calls`` (``function_call`` in the older form) where it ended by
        itself (not cut by its length)."""
        if reason not in ("stop", "cancelled"):
            return self._finish(reason)
        return "function_call" if self.tools is not None and self.tools.legacy else "tool_calls"

    def usage_chunk(self) -> dict:
        payload = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        payload["usage"] = self.usage()
        return payload

    def _choice(self, chunks: list[Chunk], index: int, return_token_ids: bool) -> dict:
        for chunk in chunks:
            self.add(chunk, index)
        text = self.echo.get(index, ("", None))[0] + "".join(c.text for c in chunks)  # (echo: the prompt first)
        finish = self._finish(chunks[-1].finish_reason if chunks else "stop")
        # The echoed prompt's entries first: the answer's text offsets then count from the prompt's start.
        prompt_part = self._prompt_logprobs(index)
        logprobs = self.logprobs([figure for c in chunks for figure in c.logprobs], index)
        if prompt_part is not None:
            logprobs = {key: prompt_part[key] + logprobs[key] for key in logprobs}
        if self.chat:
            parts = (split_reasoning(text, self.reasoning[index], self.reasoning_tags.get(index, THINK))
                     if index in self.reasoning else Parts(None, text))
            # (an answer that reasoned and wrote nothing after: no content, as an answer of calls alone has none)
            message = {"role": "assistant", "content": parts.content or (None if parts.reasoning is not None else "")}
            if parts.reasoning is not None:
                message["reasoning_content"] = parts.reasoning
            cut = bool(chunks) and chunks[-1].finish_reason == "length"
            read = read_calls(parts.content, self.tools, cut) if self.tools is not None else None
            if read is not None and read.calls:
                message.update(content=read.content, **self._calls(read.calls, False))
                finish = self._call_finish(chunks[-1].finish_reason if chunks else "stop")
            elif read is not None and read.content != parts.content:  # (Harmony's reader drops a call the length cut)
                message["content"] = read.content or (None if parts.reasoning is not None else "")
            choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if return_token_ids and not any(c.text_cut for c in chunks):
            choice["token_ids"] = [token for c in chunks for token in c.token_ids]
        if chunks and chunks[-1].stop_string is not None:  # (vLLM's extension: which stop string ended it)
            choice["stop_reason"] = chunks[-1].stop_string
        return choice

    def whole(self, choices: list[list[Chunk]], return_token_ids: bool = False) -> dict:
        """The whole answer: one choice per list of chunks (each choice's, in order)."""
        payload = self._envelope("chat.completion" if self.chat else "text_completion",
                                 *(self._choice(chunks, index, return_token_ids)
                                   for index, chunks in enumerate(choices)))
        payload["usage"] = self.usage()
        # The engine's full statistics, an extension field OpenAI clients ignore: the request's, or with several
        # choices each choice's own.
        stats = [chunks[-1].stats if chunks else None for chunks in choices]
        if len(choices) == 1:
            if stats[0] is not None:
                payload["jointspec"] = stats[0].to_dict()
        else:
            for choice, own in zip(payload["choices"], stats):
                if own is not None:
                    choice["jointspec"] = own.to_dict()
        return payload
