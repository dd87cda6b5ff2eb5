"""Anthropic's Messages API (``POST /v1/messages``) on top of the chat route, as server/responses.py does OpenAI's
Responses API: a request is read into a chat request (:func:`chat_request`), decoded as one, and its answer written
back as a message (:class:`MessageShaper`), for the clients and agent tools that speak this API to a local server.

What is served. ``messages`` (text blocks; an assistant's ``tool_use`` and ``thinking`` blocks; a user's
``tool_result`` blocks), ``system`` (text or text blocks), ``max_tokens`` (required, as the API requires it),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``tools`` (custom tools: ``name``, ``description``,
``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool`` by name, ``none``; ``disable_parallel_tool_use``),
``thinking`` (``enabled`` or ``disabled``, given to the template as ``enable_thinking``: Qwen3's reads it),
``metadata.user_id`` (the request's user), ``stream``, and this server's extensions as on chat (``min_p``, ``seed``,
``chat_template_kwargs``, ``jointspec``). The answer: a ``thinking`` block where a reasoning model thought
(server/reasoning.py; its ``signature`` empty: nothing here signs), a ``text`` block, a ``tool_use`` block per call;
``stop_reason`` ``end_turn``, ``max_tokens``, ``stop_sequence`` (with the one that matched) or ``tool_use``.
Streamed, the API's events (``message_start`` ... ``message_stop``). Errors in the API's own envelope.

What is not: images and documents, server tools (web search, code execution), MCP servers and containers are refused
by name (400); ``thinking.budget_tokens`` is read and not acted on (a model thinks as long as it does).
"""

from __future__ import annotations

import json
import re
import uuid

from jointspec.server.translate import ChatRequest, ChunkShaper, TranslationError

# Fields of a Messages request that ask for what this server does not do: each a 400 naming it.
REFUSED = {
    "mcp_servers": "MCP servers are not served here: call the tools from the client",
    "container": "containers are not served here",
}
SAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "chat_template_kwargs", "jointspec",
        "presence_penalty", "frequency_penalty", "repetition_penalty")
# A chat request's names, as a Messages request names what they came from.
RENAMES = ((re.compile(r"max_completion_tokens"), "max_tokens"),
           (re.compile(r"\btools\.(\d+)\.function\.parameters"), r"tools.\1.input_schema"),
           (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
           (re.compile(r"\bstop(?=[.:]|$)"), "stop_sequences"),
           (re.compile(r"^user(?=[.:]|$)"), "metadata.user_id"),
           (re.compile(r"\bresponse_format(\.json_schema)?"), "output_config.format"),
           (re.compile(r"\bcontinue_final_message\b"), "messages"))
# Chat's finish reasons as this API's stop reasons (a stop string's: "stop_sequence", where one matched).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
# The HTTP statuses of errors, as this API's error types.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}
# A stream's failure (chat's error code) as this API's error type.
STREAM_ERROR_TYPES = {"timeout": "timeout_error", "shutting_down": "overloaded_error",
                      "invalid_request": "invalid_request_error"}


class MessagesError(TranslationError):
    """A Messages request that cannot be served; ``param`` names its field."""


def error_body(status: int, message: str) -> dict:
    """An error in this API's envelope."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def chat_request(data: dict) -> ChatRequest:
    """A Messages request body as the chat request that decodes it; MessagesError names the field at fault."""
    for name, why in REFUSED.items():
        if data.get(name):
            raise MessagesError(f"{name}: {why}", name)
    if not isinstance(data.get("max_tokens"), int) or isinstance(data.get("max_tokens"), bool):
        raise MessagesError("max_tokens is required: the most tokens the answer may have", "max_tokens")
    chat = {name: data[name] for name in SAME if name in data}
    chat["max_completion_tokens"] = data["max_tokens"]
    if data.get("stop_sequences") is not None:
        chat["stop"] = data["stop_sequences"]
    user = (data.get("metadata") or {}).get("user_id") if isinstance(data.get("metadata"), dict) else None
    if user is not None:
        chat["user"] = user
    thinking = data.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise MessagesError("thinking must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}", "thinking")
        given = chat.get("chat_template_kwargs") or {}
        if not isinstance(given, dict):
            raise MessagesError("chat_template_kwargs must be an object", "chat_template_kwargs")
        chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled", **given}
    fmt = (data.get("output_config") or {}).get("format") if isinstance(data.get("output_config"), dict) else None
    if fmt is not None:  # (structured output: a JSON schema the answer follows)
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise MessagesError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                                "output_config.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    messages, origins = _messages(data.get("system"), data.get("messages"))
    chat["messages"] = messages
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        chat["continue_final_message"] = True  # (a prefill: the answer goes on from the assistant's text)
    if data.get("tools") is not None:
        if not isinstance(data["tools"], list):
            raise MessagesError("tools must be a list", "tools")
        chat["tools"] = [_chat_tool(tool, f"tools.{index}") for index, tool in enumerate(data["tools"])]
    if data.get("tool_choice") is not None:
        chat["tool_choice"], parallel = _chat_tool_choice(data["tool_choice"])
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    return ChatRequest(chat, tuple(origins), RENAMES, ".tool_use_id")


def _texts(content, where: str, kinds: tuple[str, ...]) -> list[dict]:
    """A message's content as blocks (text is one text block), each of an allowed kind."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise MessagesError(f"{where} must be text or a list of content blocks", where)
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in kinds:
            raise MessagesError(f"{where}.{index}: a {json.dumps(kind)} block is not served here ({', '.join(kinds)} "
                                "are)", f"{where}.{index}")
    return content


def _text_of(blocks: list[dict], where: str) -> str:
    """Text blocks' text, each a paragraph of its own."""
    for index, block in enumerate(blocks):
        if not isinstance(block.get("text"), str):
            raise MessagesError(f"{where}.{index}: a text block needs its text", f"{where}.{index}.text")
    return "\n\n".join(block["text"] for block in blocks)


def _messages(system, given) -> tuple[list[dict], list[str]]:
    """``system`` and ``messages`` as chat messages, and where each came from (``system``, ``messages.N``): a user
    turn's tool results as tool messages (first, as the API orders them) then its text; an assistant turn's text, its
    calls and its thinking (as reasoning_content) one message."""
    messages: list[dict] = []
    origins: list[str] = []
    if system is not None:
        messages.append({"role": "system", "content": _text_of(_texts(system, "system", ("text",)), "system")})
        origins.append("system")
    if not isinstance(given, list) or not given:
        raise MessagesError("messages is required: a list of at least one message", "messages")
    calls: set[str] = set()
    for index, message in enumerate(given):
        where = f"messages.{index}"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            blocks = _texts(message.get("content"), f"{where}.content", ("text", "tool_result"))
            for number, block in enumerate(blocks):
                if block["type"] != "tool_result":
                    continue
                block_where = f"{where}.content.{number}"
                if not isinstance(block.get("tool_use_id"), str) or block["tool_use_id"] not in calls:
                    raise MessagesError(f"{block_where}.tool_use_id: no tool_use block before it has id "
                                        f"{json.dumps(block.get('tool_use_id'))}", f"{block_where}.tool_use_id")
                result = block.get("content", "")
                text = result if isinstance(result, str) else _text_of(
                    _texts(result, f"{block_where}.content", ("text",)), f"{block_where}.content")
                if block.get("is_error") is True:  # (the model should tell a failure from a result)
                    text = f"Error: {text}"
                messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
                origins.append(block_where)
            texts = [block for block in blocks if block["type"] == "text"]
            if texts or not any(block["type"] == "tool_result" for block in blocks):
                text = _text_of(texts, f"{where}.content")
                if messages and messages[-1]["role"] == "user":  # (consecutive user turns are one, as the API reads)
                    messages[-1]["content"] += "\n\n" + text
                else:
                    messages.append({"role": "user", "content": text})
                    origins.append(where)
        elif role == "assistant":
            blocks = _texts(message.get("content"), f"{where}.content",
                            ("text", "tool_use", "thinking", "redacted_thinking"))
            turn: dict = {"role": "assistant", "content": _text_of([b for b in blocks if b["type"] == "text"],
                                                                   f"{where}.content")}
            for number, block in enumerate(blocks):
                if block["type"] == "thinking" and not isinstance(block.get("thinking"), str):
                    raise MessagesError(f"{where}.content.{number}: a thinking block needs its thinking text",
                                        f"{where}.content.{number}.thinking")
            thought = "".join(block["thinking"] for block in blocks if block["type"] == "thinking")
            if thought:
                turn["reasoning_content"] = thought
            for number, block in enumerate(blocks):
                if block["type"] != "tool_use":
                    continue
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(
                        block.get("input", {}), dict):
                    raise MessagesError(f"{where}.content.{number}: a tool_use block needs its id, name and input "
                                        "object", f"{where}.content.{number}")
                turn.setdefault("tool_calls", []).append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
                calls.add(block["id"])
            previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
            if previous is not None and not previous.get("tool_calls"):  # (consecutive assistant turns are one)
                previous["content"] = "\n\n".join(filter(None, [previous["content"], turn["content"]]))
                for key in ("reasoning_content", "tool_calls"):
                    if key in turn:
                        previous[key] = turn[key]
            else:
                messages.append(turn)
                origins.append(where)
        else:
            raise MessagesError(f"{where}.role must be user or assistant, got {json.dumps(role)}", f"{where}.role")
    return messages, origins


def _chat_tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise MessagesError(f"{where}: only custom tools are served (a name and an input_schema), got "
                            f"{json.dumps(kind)}", where)
    function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice) -> tuple[object, bool | None]:
    """``tool_choice`` as chat's, and whether parallel calls are allowed (None: as chat's default)."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    chosen = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        chosen = {"type": "function", "function": {"name": choice.get("name")}}
    if chosen is None:
        raise MessagesError("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", "
                            "\"name\": ...} or {\"type\": \"none\"}", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    return chosen, (not parallel if isinstance(parallel, bool) else None)


# -- the answer -----------------------------------------------------------------------------------------------------

class MessageShaper(ChunkShaper):
    """One request's answer in this API's shapes: :meth:`whole` from the chat route's whole reply, or, for a stream,
    :meth:`start`, then :meth:`events` from each chat chunk in order, then :meth:`end`."""

    def __init__(self) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks = 0  # blocks begun so far
        self.open: str | None = None  # the kind of the block streaming now: "thinking" or "text"
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def _stop(self, choice: dict) -> None:
        finish = choice.get("finish_reason")
        if finish in ("tool_calls", "function_call"):  # (calls made: a stop string after them ended nothing else)
            self.stop_reason, self.stop_sequence = "tool_use", None
        elif choice.get("stop_reason") is not None:  # (chat's own extension: the stop string that matched)
            self.stop_reason, self.stop_sequence = "stop_sequence", choice["stop_reason"]
        elif finish is not None:
            self.stop_reason = STOP_REASONS.get(finish, "end_turn")

    @staticmethod
    def usage_of(usage: dict) -> dict:
        """Chat's usage in this API's terms: the input read afresh, apart from the prompt cache's (the API's total
        input is their sum)."""
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def whole(self, chat_reply: dict) -> dict:
        """The message for the chat route's whole reply."""
        choice = chat_reply["choices"][0]
        message = choice["message"]
        content = []
        if message.get("reasoning_content"):  # (an empty block, thinking turned off, is none: as streamed)
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        self._stop(choice)
        reply = {"id": self.id, "type": "message", "role": "assistant", "model": chat_reply["model"],
                 "content": content, "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                 "usage": self.usage_of(chat_reply["usage"])}
        if "jointspec" in chat_reply:
            reply["jointspec"] = chat_reply["jointspec"]  # (the engine's figures, as on chat)
        return reply

    # -- streamed --

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def start(self, model: str, input_tokens: int) -> list[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return [self._event("message_start", message=message)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # (the API closes thinking with its signature: none here)
            events.append(self._event("content_block_delta", index=self.blocks - 1,
                                      delta={"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*events, self._event("content_block_stop", index=self.blocks - 1)]

    def _begin(self, block: dict) -> list[str]:
        events = self._close()
        self.blocks += 1
        return [*events, self._event("content_block_start", index=self.blocks - 1, content_block=block)]

    def failed(self, error: dict) -> list[str]:
        kind = STREAM_ERROR_TYPES.get(error.get("code"), "api_error")
        return [*self._close(), self._event("error", error={"type": kind, "message": error["message"]})]

    def choice(self, choice: dict) -> list[str]:
        events = []
        delta = choice.get("delta", {})
        for kind, key, delta_kind in (("thinking", "reasoning_content", "thinking_delta"),
                                      ("text", "content", "text_delta")):
            if not delta.get(key):
                continue
            if self.open != kind:
                events += self._begin({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                      else {"type": "text", "text": ""})
                self.open = kind
            events.append(self._event("content_block_delta", index=self.blocks - 1,
                                      delta={"type": delta_kind, kind: delta[key]}))
        for call in delta.get("tool_calls") or []:
            events += self._begin({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                                   "input": {}})
            events += [self._event("content_block_delta", index=self.blocks - 1, delta={
                           "type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                       self._event("content_block_stop", index=self.blocks - 1)]
        self._stop(choice)
        return events

    def end(self, model: str | None = None) -> list[str]:
        """The stream's last events, once the chat stream ended (its usage chunk read; the model was named at the
        start)."""
        return [*self._close(),
                self._event("message_delta", delta={"stop_reason": self.stop_reason,
                                                     "stop_sequence": self.stop_sequence},
                            usage=self.usage or {"output_tokens": 0}),
                self._event("message_stop")]
