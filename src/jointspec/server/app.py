"""An OpenAI-compatible HTTP face over an engine: ``create_app(settings, engine)``.

A route only validates a request, turns it into one :class:`~jointspec.server.engine.CompletionRequest` and
formats what the engine streams back, as OpenAI does (plain JSON or server-sent events). Bad requests get OpenAI's
error envelope ``{"error": {"message", "type", "param", "code"}}`` with status 400; unknown fields in standard
places are ignored, as OpenAI ignores them. Decoding options travel in an extra body field::

    {"model": "...", "messages": [...], "jointspec": {"method": "pld", "num_draft_tokens": 4}}

A client that disconnects cancels its sequence in the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jointspec.core.errors import ContextTooLongError, JointspecError
from jointspec.server.engine import Chunk, CompletionRequest, Engine, Generation
from jointspec.server.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000


# -- request bodies ---------------------------------------------------------------------------------------------

class _Body(BaseModel):
    # strict: a string where a number belongs is a 400, as with OpenAI; unknown fields are ignored.
    model_config = ConfigDict(extra="ignore", strict=True)


class JointspecOptions(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)  # our own namespace: a typo should not pass silently

    method: str | None = None
    num_draft_tokens: int | None = Field(None, ge=1, le=64)
    max_ngram: int | None = Field(None, ge=1, le=64)
    min_ngram: int | None = Field(None, ge=1, le=64)
    draft: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    jointspec: JointspecOptions | None = None


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int]
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = None
    echo: bool = False
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None


# -- errors -----------------------------------------------------------------------------------------------------

class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_


def error_response(error: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"message": error.message, "type": error.type, "param": error.param,
                                   "code": error.code}}, status_code=error.status)


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "TextPart"}


def _from_validation(error: ValidationError) -> RequestError:
    first = error.errors()[0]
    # Union members add their type to the location ("stop.str"); OpenAI names only the field.
    param = ".".join(str(part) for part in first["loc"]
                     if not (isinstance(part, str) and ("[" in part or part in _TYPE_TAGS))) or None
    return RequestError(f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _from_engine(error: Exception) -> RequestError:
    if isinstance(error, ContextTooLongError):
        return RequestError(str(error), code="context_length_exceeded")
    if isinstance(error, (JointspecError, ValueError, TypeError)):
        return RequestError(str(error))
    log.exception("engine failed on a request", exc_info=error)
    return RequestError("internal error in the engine", status=500, type_="server_error")


# -- the app ----------------------------------------------------------------------------------------------------

def create_app(settings: ServerSettings, engine: Engine) -> FastAPI:
    app = FastAPI(title="jointspec", docs_url=None, redoc_url=None)
    app.state.settings, app.state.engine = settings, engine
    app.state.metrics = metrics = Metrics()

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=error)
        return error_response(RequestError("internal server error", status=500, type_="server_error"))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": engine.model_id, "object": "model", "created": 0,
                                            "owned_by": "jointspec"}]}

    @app.get("/metrics")
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(engine.spec_stats(), engine.gauges()), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completions", CompletionBody)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat", ChatBody)

    async def _serve(request: Request, endpoint: str, model: type[_Sampling]):
        try:
            body = await _parse(request, model)
            engine_request = _engine_request(body)
            arrived = time.perf_counter()
            try:
                generation = await engine.submit(engine_request)
            except Exception as error:
                raise _from_engine(error) from error
        except RequestError as error:
            metrics.count_request(endpoint, "rejected" if error.status < 500 else "error")
            return error_response(error)
        metrics.count_request(endpoint, "accepted")
        metrics.count_tokens(num_prompt_tokens=generation.num_prompt_tokens)
        timed = _timed(generation, arrived)
        reply = _Reply(endpoint, engine.model_id, generation.num_prompt_tokens)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(reply, timed, generation, include_usage), media_type="text/event-stream")
        return await _whole(request, reply, timed, generation)

    async def _timed(generation: Generation, arrived: float) -> AsyncIterator[Chunk]:
        """The engine's chunks, recording latency and token counts on the way."""
        last = None
        async for chunk in generation:
            now = time.perf_counter()
            if chunk.num_tokens:
                if last is None:
                    metrics.observe_first_token(now - arrived)
                else:
                    metrics.observe_chunk(now - last, chunk.num_tokens)
                last = now
                metrics.count_tokens(num_generated_tokens=chunk.num_tokens)
            yield chunk

    async def _whole(request: Request, reply: _Reply, chunks: AsyncIterator[Chunk], generation: Generation):
        async def collect() -> list[Chunk]:
            return [chunk async for chunk in chunks]

        collecting = asyncio.ensure_future(collect())
        leaving = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not collecting.done():  # the client left: stop decoding for it
                collecting.cancel()
                generation.cancel()
        if not collecting.done() or collecting.cancelled():
            return JSONResponse({}, status_code=499)
        return JSONResponse(reply.whole(collecting.result()))

    async def _sse(reply: _Reply, chunks: AsyncIterator[Chunk], generation: Generation,
                   include_usage: bool) -> AsyncIterator[str]:
        finished = False
        try:
            yield _event(reply.first_chunk())
            async for chunk in chunks:
                finished = chunk.finish_reason is not None
                if chunk.text or finished:  # rounds whose text is held back (half a character) send nothing
                    yield _event(reply.chunk(chunk))
                else:
                    reply.num_tokens += chunk.num_tokens
            if include_usage:
                yield _event(reply.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client disconnected (or something broke): free the row
                generation.cancel()

    return app


async def _parse(request: Request, model: type[_Sampling]) -> _Sampling:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object")
    try:
        body = model.model_validate(data)
    except ValidationError as error:
        raise _from_validation(error) from None
    if body.n != 1:
        raise RequestError("n > 1 is not supported: send one request per choice", param="n")
    if getattr(body, "best_of", None) not in (None, 1):
        raise RequestError("best_of > 1 is not supported", param="best_of")
    if getattr(body, "logprobs", None):
        raise RequestError("logprobs are not supported", param="logprobs")
    if getattr(body, "echo", False):
        raise RequestError("echo is not supported", param="echo")
    if isinstance(body, CompletionBody) and isinstance(body.prompt, list) and body.prompt \
            and isinstance(body.prompt[0], str):
        if len(body.prompt) != 1:
            raise RequestError("one prompt per request: a list of prompts is not supported", param="prompt")
        body.prompt = body.prompt[0]
    if isinstance(body, CompletionBody) and not body.prompt:
        raise RequestError("the prompt is empty", param="prompt")
    return body


def _engine_request(body: _Sampling) -> CompletionRequest:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    options = body.jointspec.model_dump(exclude_none=True) if body.jointspec else None
    common = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed or 0,
                  stop=stop, method=options)
    try:
        if isinstance(body, ChatBody):
            messages = tuple({"role": m.role, "content": m.content if isinstance(m.content, str) or m.content is None
                              else "".join(part.text for part in m.content)} for m in body.messages)
            messages = tuple({**m, "content": m["content"] or ""} for m in messages)
            return CompletionRequest(messages=messages, max_tokens=body.max_completion_tokens or body.max_tokens,
                                     **common)
        return CompletionRequest(prompt=body.prompt, max_tokens=body.max_tokens, **common)
    except ValueError as error:
        raise RequestError(str(error)) from None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Reply:
    """OpenAI's response shapes for one request."""

    def __init__(self, endpoint: str, model_id: str, num_prompt_tokens: int) -> None:
        self.chat = endpoint == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = 0

    def _envelope(self, kind: str, choice: dict) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def usage(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}

    @staticmethod
    def _finish(reason: str | None) -> str | None:
        return {"cancelled": "stop", "error": "error"}.get(reason, reason)

    def first_chunk(self) -> dict:
        if self.chat:
            return self._envelope("chat.completion.chunk",
                                  {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        return self._envelope("text_completion", {"index": 0, "text": "", "logprobs": None, "finish_reason": None})

    def chunk(self, chunk: Chunk) -> dict:
        self.num_tokens += chunk.num_tokens
        finish = self._finish(chunk.finish_reason)
        if self.chat:
            delta = {"content": chunk.text} if chunk.text else {}
            return self._envelope("chat.completion.chunk", {"index": 0, "delta": delta, "finish_reason": finish})
        return self._envelope("text_completion", {"index": 0, "text": chunk.text, "logprobs": None,
                                                  "finish_reason": finish})

    def usage_chunk(self) -> dict:
        payload = self._envelope("chat.completion.chunk" if self.chat else "text_completion", {})
        payload["choices"] = []
        payload["usage"] = self.usage()
        return payload

    def whole(self, chunks: list[Chunk]) -> dict:
        self.num_tokens = sum(c.num_tokens for c in chunks)
        text = "".join(c.text for c in chunks)
        finish = self._finish(chunks[-1].finish_reason if chunks else "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        payload = self._envelope("chat.completion" if self.chat else "text_completion", choice)
        payload["usage"] = self.usage()
        stats = chunks[-1].stats if chunks else None
        if stats is not None:
            payload["jointspec"] = stats.to_dict()  # an extension field: OpenAI clients ignore it
        return payload
