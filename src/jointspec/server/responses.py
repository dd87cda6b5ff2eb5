"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat route: a request is read into a chat request
(:func:`chat_body`), decoded as one, and its answer written back as a response (:class:`ResponseShaper`).

What is served. ``input`` (text, or items: messages with text parts, earlier ``function_call`` items and their
``function_call_output``), ``instructions`` (a system message first), ``max_output_tokens``, ``temperature``,
``top_p``, ``tools`` (functions; Responses writes a function's fields at the top level of the tool),
``tool_choice``, ``parallel_tool_calls``, ``text.format`` (text, ``json_object`` or ``json_schema``: structured
output), ``metadata`` (echoed), ``user``, ``stream``, and this server's extensions as on chat (``top_k``, ``min_p``,
``seed``, ``chat_template_kwargs``, ``jointspec``). The output: a ``reasoning`` item where a reasoning model thought
(server/reasoning.py), a ``message`` item with its ``output_text``, and a ``function_call`` item per call; streamed,
the typed events OpenAI's clients read (``response.created`` ... ``response.completed``, each with its
``sequence_number``; no ``[DONE]``).

Stored responses. A response that ends (completed or incomplete; not one that failed) is kept in memory (``store``,
true by default as in OpenAI's API; at most the server's ``--stored-responses`` and ``--stored-responses-mb``, the
least recently used dropped first), with the conversation it ended: a later request's
``previous_response_id`` continues it (that conversation, then the new ``input``; the earlier ``instructions`` are not
carried over, as OpenAI's API does), ``GET`` / ``DELETE /v1/responses/{id}`` fetch and delete it
(:class:`ResponseStore`), and ``GET /v1/responses/{id}/input_items`` lists its input as items
(:func:`input_items_page`). Nothing survives a restart.

What is not. ``conversation`` (a stored conversation object) and ``background`` are refused (400, named). Built-in
tools (web search, files, computer use), images and files in the input are refused by name. ``reasoning.effort`` is
given to the chat template as chat's ``reasoning_effort`` is (gpt-oss's reads it; other templates think as they let
a model, ``chat_template_kwargs``); its ``summary`` and ``include`` are read and not acted on.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from jointspec.server.translate import ChatRequest, ChunkShaper, TranslationError

# Fields of a Responses request that ask for what this server does not do: each a 400 naming it.
REFUSED = {
    "conversation": "conversations are not stored here: send the whole conversation as input",
    "background": "background responses are not served: send the request and wait for it (or stream it)",
    "prompt": "stored prompt templates are not served: send the instructions and input themselves",
    "top_logprobs": "log-probabilities are not served on /v1/responses: ask /v1/chat/completions with logprobs",
}
# What passes to the chat request unchanged.
SAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "user", "parallel_tool_calls",
        "chat_template_kwargs", "jointspec", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "stop")
TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's limits on metadata: so many pairs of text, keys and values so long.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
# A chat request's names, as a Responses request names what they came from (errors name what the client sent).
RENAMES = ((re.compile(r"\bmessages\b"), "input"),
           (re.compile(r"max_completion_tokens"), "max_output_tokens"),
           (re.compile(r"response_format\.json_schema\.schema"), "text.format.schema"),
           (re.compile(r"response_format(\.json_schema)?"), "text.format"),
           (re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
           (re.compile(r"\breasoning_effort\b"), "reasoning.effort"))


class ResponsesError(TranslationError):
    """A Responses request that cannot be served; ``param`` names its field."""


@dataclass(frozen=True)
class StoredResponse:
    """A response kept for later: the response as it was returned, and the conversation it ended as chat messages
    (the input it continued and its own, its answer last, without its instructions), which a request that names it
    as ``previous_response_id`` continues. The messages are never changed: later requests copy what they extend.
    ``size``: the characters it holds of its own (its response, and the messages it does not share with the response
    it continued), what a store's budget charges it."""

    response: dict
    messages: tuple[dict, ...]
    size: int = 0
    inputs: int = 0  # of the messages, those that went into it (the rest: its answer)

    @classmethod
    def of(cls, response: dict, conversation: tuple[dict, ...], continued: int = 0) -> StoredResponse:
        """``response`` kept with ``conversation`` (the request's messages, without its instructions, the first
        ``continued`` those of the response it continued) and the answer its output holds as an assistant turn (its
        reasoning with its text or calls; none where it wrote neither, as a reasoning item sent back with no turn after
        it is read)."""
        output = response.get("output") or []
        reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning"
                            for part in item.get("content") or [])
        text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
        calls = [{"id": item["call_id"], "type": "function",
                  "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in output if item["type"] == "function_call"]
        turn: dict = {"role": "assistant", "content": text or None}
        if reasoning:
            turn["reasoning_content"] = reasoning
        if calls:
            turn["tool_calls"] = calls
        messages = tuple(conversation) + ((turn,) if text or calls else ())
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(messages[continued:], ensure_ascii=False))
        return cls(response, messages, size, len(conversation))

    def input_items(self) -> list[dict]:
        """What went into the response (the conversation it continued and its own input, less its instructions) as
        the Responses API's items, each with an id of its own that stays the same from one listing to the next."""
        items: list[dict] = []

        def item_id(prefix: str) -> str:  # (from the response's id and the item's place)
            place = f"{self.response['id']}/{len(items)}"
            return f"{prefix}_{hashlib.sha256(place.encode()).hexdigest()[:32]}"

        for message in self.messages[:self.inputs]:
            role = message["role"]
            if role == "tool":
                items.append({"type": "function_call_output", "id": item_id("fco"), "call_id": message["tool_call_id"],
                              "output": message["content"], "status": "completed"})
            elif role != "assistant":
                items.append({"type": "message", "id": item_id("msg"), "status": "completed", "role": role,
                              "content": [{"type": "input_text", "text": message["content"]}]})
            else:
                if message.get("reasoning_content"):
                    items.append(ResponseShaper._reasoning_item(message["reasoning_content"], "completed",
                                                                item_id("rs")))
                if message.get("content"):
                    items.append(ResponseShaper._message_item(message["content"], "completed", item_id("msg")))
                for call in message.get("tool_calls") or ():
                    items.append(ResponseShaper._call_item(call, item_id("fc")))
        return items


class ResponseStore:
    """Stored responses by id, at most ``capacity`` of them and ``budget`` characters of their own (each's
    :attr:`StoredResponse.size`; the least recently used dropped first); safe to share between threads (requests are
    read on worker threads)."""

    def __init__(self, capacity: int, budget: int | None = None) -> None:
        if capacity < 0 or (budget is not None and budget < 0):
            raise ValueError(f"a response store holds 0 or more responses and characters, got {capacity} and {budget}")
        self.capacity, self.budget = capacity, budget
        self.held = 0  # characters held
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            old = self._kept.pop(stored.response["id"], None)
            self.held -= old.size if old is not None else 0
            self._kept[stored.response["id"]] = stored
            self.held += stored.size
            while self._kept and (len(self._kept) > self.capacity or (self.budget is not None
                                                                      and self.held > self.budget)):
                self.held -= self._kept.popitem(last=False)[1].size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._kept.get(response_id)
            if stored is not None:
                self._kept.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            stored = self._kept.pop(response_id, None)
            self.held -= stored.size if stored is not None else 0
            return stored is not None


def chat_request(data: dict, stored: Callable[[str], StoredResponse | None] | None = None) -> ChatRequest:
    """A Responses request body as the chat request that decodes it; ResponsesError names the field at fault.
    ``stored``: the server's stored responses by id (None: none are stored), which ``previous_response_id`` names."""
    for name, why in REFUSED.items():
        if data.get(name) not in (None, False, ""):
            raise ResponsesError(f"{name}: {why}", name)
    if data.get("n") not in (None, 1):
        raise ResponsesError("the Responses API has no n: send one request per answer", "n")
    if data.get("truncation") not in (None, "disabled"):
        raise ResponsesError("truncation: only \"disabled\" is served (an input past the context is refused, not "
                             "cut)", "truncation")
    include = data.get("include") or []
    if not isinstance(include, list) or "message.output_text.logprobs" in include:
        raise ResponsesError("include: log-probabilities are not served on /v1/responses (ask /v1/chat/completions "
                             "with logprobs); other include values are read and not acted on", "include")
    _check_metadata(data.get("metadata"))
    chat = {name: data[name] for name in SAME if name in data}
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesError("instructions must be text", "instructions")
    if "input" not in data or data["input"] is None:
        raise ResponsesError("input is required: text, or a list of messages and items", "input")
    if data.get("store") is not None and not isinstance(data["store"], bool):
        raise ResponsesError("store must be true or false", "store")
    history = _previous(data.get("previous_response_id"), stored)
    conversation, origins = _messages(data["input"], history)
    messages, origins = _instructed(conversation, origins, instructions)
    chat["messages"] = messages
    if data.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = data["max_output_tokens"]
    if data.get("tools") is not None:
        chat["tools"] = [_chat_tool(tool, f"tools.{index}") for index, tool in enumerate(_list(data["tools"], "tools"))]
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(data["tool_choice"])
    if data.get("text") is not None and not isinstance(data["text"], dict):
        raise ResponsesError("text must be an object such as {\"format\": {\"type\": \"text\"}}", "text")
    fmt = (data.get("text") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _chat_format(fmt)
    reasoning = data.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise ResponsesError("reasoning must be an object such as {\"effort\": \"low\"}", "reasoning")
    if (reasoning or {}).get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]  # (checked by the chat route)
    return ChatRequest(chat, tuple(origins), RENAMES, ".call_id", tuple(conversation), len(history))


def _instructed(conversation: list[dict], origins: list[str],
                instructions: str | None) -> tuple[list[dict], list[str]]:
    """The conversation with the request's instructions first: a system message of their own, or joined to the
    system message the conversation begins with (one system message: some templates take no second one)."""
    if instructions is None:
        return conversation, origins
    if conversation and conversation[0]["role"] == "system":
        first = {"role": "system", "content": f"{instructions}\n\n{conversation[0]['content']}"}
        return [first, *conversation[1:]], ["instructions", *origins[1:]]
    return [{"role": "system", "content": instructions}, *conversation], ["instructions", *origins]


def _previous(response_id, stored: Callable[[str], StoredResponse | None] | None) -> tuple[dict, ...]:
    """The conversation a request's ``previous_response_id`` continues (none where it names none)."""
    if response_id in (None, ""):
        return ()
    if not isinstance(response_id, str):
        raise ResponsesError("previous_response_id must be a response's id", "previous_response_id")
    if stored is None:
        raise ResponsesError("previous_response_id: responses are not stored on this server (--stored-responses 0): "
                             "send the whole conversation as input", "previous_response_id")
    previous = stored(response_id)
    if previous is None:  # (OpenAI's code, which clients read to send the whole conversation instead)
        raise ResponsesError(f"previous_response_id: no stored response has id {json.dumps(response_id)} (it was "
                             "stored with store: false, failed, was deleted or dropped for newer ones, or was made "
                             "before the server started): send the whole conversation as input",
                             "previous_response_id", "previous_response_not_found")
    return previous.messages


def chat_body(data: dict) -> dict:
    """:func:`chat_request`'s chat body alone."""
    return chat_request(data).body


def _check_metadata(metadata) -> None:
    if metadata is None:
        return
    rule = (f"metadata must be an object of at most {METADATA_PAIRS} pairs of text, keys up to {METADATA_KEY} "
            f"characters and values up to {METADATA_VALUE}")
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS or any(
            not isinstance(value, str) or len(key) > METADATA_KEY or len(value) > METADATA_VALUE
            for key, value in metadata.items()):
        raise ResponsesError(rule, "metadata")


def _list(value, param: str) -> list:
    if not isinstance(value, list):
        raise ResponsesError(f"{param} must be a list", param)
    return value


def _text(content, param: str) -> str:
    """A message's content (text, or a list of text parts) as text."""
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(_list(content, param)):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ResponsesError(f"{param}.{index}: only text parts are served ({', '.join(TEXT_PARTS)}), got "
                                 f"{json.dumps(kind)}", f"{param}.{index}")
        if not isinstance(part.get("text"), str):
            raise ResponsesError(f"{param}.{index}: a {kind} part needs its text", f"{param}.{index}.text")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict) -> str:
    """An earlier reasoning item's text: its content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(part.get("text", "") for part in parts if isinstance(part, dict) and isinstance(part.get("text"),
                                                                                                     str))


def _messages(given, history: tuple[dict, ...] = ()) -> tuple[list[dict], list[str]]:
    """``input`` after the ``history`` a previous response ended, as chat messages, and where each came from
    (``input.N``, ``previous_response_id``). Text is a user message; items keep their order: the system or developer
    messages before any other item one system message, an assistant's calls joined to its turn, earlier reasoning
    given to the assistant turn it preceded (as reasoning_content, which a template may show). ``history``'s messages
    are copied where they are extended, never changed."""
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    messages: list[dict] = list(history)
    origins: list[str] = ["previous_response_id"] * len(history)
    calls: set[str] = {call["id"] for message in history for call in message.get("tool_calls") or ()}
    thought: str | None = None  # reasoning waiting for its assistant turn

    def assistant(where: str, content: str | None) -> dict:
        nonlocal thought
        turn = {"role": "assistant", "content": content}
        if thought is not None:
            turn["reasoning_content"], thought = thought, None
        messages.append(turn)
        origins.append(where)
        return turn

    for index, item in enumerate(_list(given, "input")):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise ResponsesError(f"{where} must be an object (a message or an item)", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesError(f"{where}.role must be user, system, developer or assistant, got "
                                     f"{json.dumps(role)}", f"{where}.role")
            text = _text(item.get("content", ""), f"{where}.content")
            leading = messages and all(m["role"] == "system" for m in messages)
            if role in ("system", "developer") and (leading or not messages):
                if messages:  # (one system message: some templates take no second one)
                    messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
                else:
                    messages.append({"role": "system", "content": text})
                    origins.append(where)
            elif role == "assistant":
                assistant(where, text)
            else:
                messages.append({"role": role, "content": text})
                origins.append(where)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise ResponsesError(f"{where}: a function_call item needs its call_id and name", where)
            if not isinstance(arguments, str):
                raise ResponsesError(f"{where}.arguments must be the arguments as JSON text", f"{where}.arguments")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant" and thought is None:
                turn = messages[-1] = dict(messages[-1])  # (a copy: a stored conversation's turn is never changed)
            else:
                turn = assistant(where, None)
            turn["tool_calls"] = [*turn.get("tool_calls", ()), call]
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                before = "no function_call item before it" + (
                    ", nor the response that previous_response_id names," if history else "")
                raise ResponsesError(f"{where}.call_id: {before} has call_id {json.dumps(call_id)}: send the call "
                                     "too", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(item.get("output", ""), f"{where}.output")})
            origins.append(where)
        elif kind == "reasoning":
            text = _reasoning_text(item)
            thought = (thought or "") + text if text else thought
        else:
            raise ResponsesError(f"{where}.type {json.dumps(kind)} is not served: send messages, function_call and "
                                 "function_call_output items", f"{where}.type")
    if not messages[len(history):] or all(m["role"] == "system" for m in messages):
        raise ResponsesError("input is empty: send text or at least one message", "input")
    return messages, origins


def _chat_tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ResponsesError(f"{where}: only function tools are served, got {json.dumps(kind)}", where)
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _chat_format(fmt) -> dict:
    if not isinstance(fmt, dict):
        raise ResponsesError("text.format must be an object such as {\"type\": \"text\"}", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "schema", "strict",
                                                                                  "description") if key in fmt}}
    return fmt


def input_items_page(stored: StoredResponse, limit: int = 20, order: str = "desc", after: str | None = None,
                     before: str | None = None) -> dict:
    """A page of a stored response's input items, as OpenAI's API lists them: ``order`` ``desc`` (its default: the
    last item first) or ``asc``; the first ``limit`` (1 to 100) items after the item ``after`` (and before the item
    ``before``), or with ``before`` alone the last ``limit`` items before it (a page back). ResponsesError names a
    bad value."""
    if not isinstance(limit, int) or not 1 <= limit <= 100:
        raise ResponsesError(f"limit must be an integer from 1 to 100, got {json.dumps(limit)}", "limit")
    if order not in ("asc", "desc"):
        raise ResponsesError(f"order must be asc or desc, got {json.dumps(order)}", "order")
    items = stored.input_items()
    if order == "desc":
        items.reverse()
    ids = [item["id"] for item in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise ResponsesError(f"{name}: response {stored.response['id']} has no input item {json.dumps(cursor)}",
                                 name)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    if before is not None and after is None:  # the page before the cursor (a client paging back)
        low = max(start, end - limit)
        page, more = items[low:end], low > start
    else:
        page = items[start:end][:limit]
        more = start + len(page) < end
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": more}


# -- the answer -----------------------------------------------------------------------------------------------------

def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseShaper(ChunkShaper):
    """One request's answer in the Responses API's shapes: :meth:`whole` from the chat route's whole reply, or, for a
    stream, :meth:`events` from each chat chunk in order and :meth:`end` once the chat stream ends."""

    def __init__(self, data: dict, chat: dict, keep: Callable[[dict], None] | None = None) -> None:
        """``data``: the Responses request; ``chat``: the chat request it was read into; ``keep``: called with the
        response once it ends, where it is stored (None: it is not)."""
        self.keep = keep
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.data, self.chat = data, chat
        self.sequence = 0
        self.output: list[dict] = []  # the items so far, in order
        self.open: dict | None = None  # the item streaming now: reasoning or message
        self.finish: str | None = None

    def response(self, status: str, output: list[dict] | None = None, usage: dict | None = None,
                 model: str | None = None) -> dict:
        data, chat = self.data, self.chat
        tools = [{"type": "function", **tool["function"]} for tool in chat.get("tools", [])]
        for tool in tools:
            tool.setdefault("strict", False)
            tool.setdefault("parameters", None)
        text_format = (data.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": data.get("instructions"), "max_output_tokens": data.get("max_output_tokens"),
            "model": model or data.get("model") or "", "output": output if output is not None else [],
            "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
            "previous_response_id": data.get("previous_response_id") or None,
            "reasoning": {"effort": (data.get("reasoning") or {}).get("effort"), "summary": None},
            "store": self.keep is not None,
            "temperature": data.get("temperature") if data.get("temperature") is not None else 1.0,
            "text": {"format": text_format},
            "tool_choice": data.get("tool_choice") or "auto", "tools": tools,
            "top_p": data.get("top_p") if data.get("top_p") is not None else 1.0,
            "truncation": "disabled", "usage": usage, "user": data.get("user"), "metadata": data.get("metadata") or {},
        }

    @staticmethod
    def usage_of(chat_usage: dict) -> dict:
        cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        # (cache writes and reasoning tokens are not counted apart here: 0, as the API's required fields ask)
        usage = {"input_tokens": chat_usage["prompt_tokens"],
                 "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                 "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": chat_usage["total_tokens"]}
        if "jointspec" in chat_usage:  # (the request's speculation figures: an extension, as on chat)
            usage["jointspec"] = chat_usage["jointspec"]
        return usage

    @staticmethod
    def _status(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    # -- whole --

    def whole(self, chat_reply: dict) -> dict:
        """The response for the chat route's whole reply."""
        choice = chat_reply["choices"][0]
        message, status = choice["message"], self._status(choice["finish_reason"])
        output = []
        if message.get("reasoning_content") is not None:
            # (thinking that an answer or a call followed is complete, whatever cut the answer after it)
            followed = bool(message.get("content") or message.get("tool_calls"))
            output.append(self._reasoning_item(message["reasoning_content"], "completed" if followed else status))
        if message.get("content"):
            output.append(self._message_item(message["content"], status))
        for call in message.get("tool_calls") or []:
            output.append(self._call_item(call))
        response = self.response(status, output, self.usage_of(chat_reply["usage"]), chat_reply.get("model"))
        if "jointspec" in chat_reply:
            response["jointspec"] = chat_reply["jointspec"]  # (the engine's figures, as on chat)
        return self._ended(response)

    def _ended(self, response: dict) -> dict:
        """``response``, its last form, kept where it is stored."""
        if self.keep is not None:
            self.keep(response)
        return response

    @staticmethod
    def _reasoning_item(text: str, status: str, item_id: str | None = None) -> dict:
        return {"type": "reasoning", "id": item_id or _new_id("rs"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    @staticmethod
    def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
        return {"type": "message", "id": item_id or _new_id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call: dict, item_id: str | None = None) -> dict:
        return {"type": "function_call", "id": item_id or _new_id("fc"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}

    # -- streamed --

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self, model: str, input_tokens: int = 0) -> list[str]:
        """The stream's first events (``model``: the served model's name, as the last event names it; the input's
        tokens are counted in the last event's usage)."""
        begun = self.response("in_progress", model=model)
        return [self._event("response.created", response=begun), self._event("response.in_progress", response=begun)]

    def _close_open(self, status: str | None = None) -> list[str]:
        """The events that end the item streaming now, if any (``status``: the item's, where not the answer's)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        status = status or self._status(self.finish)
        where = dict(item_id=item["id"], output_index=index, content_index=0)
        if item["type"] == "reasoning":
            done = self._reasoning_item(item["text"], status, item["id"])
            events = [self._event("response.reasoning_text.done", **where, text=item["text"])]
        else:
            done = self._message_item(item["text"], status, item["id"])
            events = [self._event("response.output_text.done", **where, text=item["text"], logprobs=[])]
        events += [self._event("response.content_part.done", **where, part=done["content"][0]),
                   self._event("response.output_item.done", output_index=index, item=done)]
        self.output.append(done)
        return events

    def _open(self, kind: str) -> list[str]:
        """The events that begin an item of ``kind`` (closing another that was streaming)."""
        events = self._close_open() if self.open is not None and self.open["type"] != kind else []
        if self.open is not None:
            return events
        index = len(self.output)
        if kind == "reasoning":
            self.open = {"type": kind, "id": _new_id("rs"), "text": ""}
            item = {"type": "reasoning", "id": self.open["id"], "summary": [], "content": [],
                    "status": "in_progress"}
            return [*events, self._event("response.output_item.added", output_index=index, item=item),
                    self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part={"type": "reasoning_text", "text": ""})]
        self.open = {"type": kind, "id": _new_id("msg"), "text": ""}
        item = {"type": "message", "id": self.open["id"], "status": "in_progress", "role": "assistant",
                "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [*events, self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=index,
                            content_index=0, part=part)]

    def failed(self, error: dict) -> list[str]:
        events = self._close_open("incomplete")  # (what it had written, as written)
        failed = self.response("failed", self.output)
        # (the API's codes are a fixed set: a request's own method refusing a round is its prompt's fault, all else
        # the server's; this server's own code goes as the type)
        code = error.get("code")
        failed["error"] = {"code": "invalid_prompt" if code == "invalid_request" else "server_error",
                           "message": error["message"], "type": code}
        return [*events, self._event("response.failed", response=failed)]  # (not kept: its answer is partial)

    def choice(self, choice: dict) -> list[str]:
        events = []
        delta = choice.get("delta", {})
        for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
            if delta.get(key):
                events += self._open(kind)
                self.open["text"] += delta[key]
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                events.append(self._event(name, item_id=self.open["id"], output_index=len(self.output),
                                          content_index=0, delta=delta[key], **extra))
        for call in delta.get("tool_calls") or []:
            events += self._close_open()
            index, item_id = len(self.output), _new_id("fc")
            done = self._call_item(call, item_id)
            events += [self._event("response.output_item.added", output_index=index,
                                   item={**done, "arguments": "", "status": "in_progress"}),
                       self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                   delta=done["arguments"]),
                       self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                   name=done["name"], arguments=done["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=done)]
            self.output.append(done)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        return events

    def end(self, model: str) -> list[str]:
        """The stream's last events, once the chat stream ended (its usage chunk read)."""
        events = self._close_open()
        status = self._status(self.finish)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self._ended(self.response(status, self.output, self.usage,
                                                                              model)))]
