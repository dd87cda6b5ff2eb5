"""How each tool-call format reads, writes and holds calls (server/tools.py's docstring shows them): one
:class:`CallFormat` a format, the grammar that holds an answer's calls and the reader of an answer, with what the
formats share. The formats' own syntaxes are in server/tools_mistral.py, server/tools_xml.py, server/tools_gemma.py
and server/tools_pythonic.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from jointspec.core.grammar import JSON_STYLE, OutputFormat
from jointspec.server import harmony
from jointspec.server import tools_gemma as gemma
from jointspec.server import tools_glm as glm_format
from jointspec.server import tools_mistral as mistral
from jointspec.server import tools_pythonic as pythonic
from jointspec.server.tool_text import (
    marker,
    one_call_a_turn,
    partial_tail,
    skip_space,
    start_rules,
    unwritable_key,
)
from jointspec.server.tools_xml import VALUE_RULES, call_rules, read_call, typed_arguments

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# The call formats read here (server/tools.py's docstring): Hermes's blocks, Llama 3's bare JSON, Mistral's two
# (server/tools_mistral.py), Qwen3-Coder's XML (server/tools_xml.py), Gemma 4's (server/tools_gemma.py), Granite 3's,
# LFM2's Python calls (server/tools_pythonic.py), and the JSON lists between markers of Nemotron Nano 2, Apertus and
# Apriel 1.5, and gpt-oss's Harmony messages (server/harmony.py).
HERMES, LLAMA3_JSON = "hermes", "llama3_json"
MISTRAL_V3, MISTRAL_V11 = "mistral_v3", "mistral_v11"
QWEN3_CODER, GEMMA4, GRANITE, LFM2, NEMOTRON = "qwen3_coder", "gemma4", "granite", "lfm2", "nemotron"
APERTUS, APRIEL, GLM, HARMONY_CALLS = "apertus", "apriel", "glm", "harmony"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL_V3, MISTRAL_V11, QWEN3_CODER, GEMMA4, GRANITE, LFM2, NEMOTRON, APERTUS, APRIEL,
           GLM, HARMONY_CALLS)
# Granite 3's opening of its calls (a special token in its tokenizer).
GRANITE_CALL = "<|tool_call|>"
# The markers around a list of calls: NVIDIA Nemotron Nano 2's, Apertus's (special tokens of its tokenizer) and
# ServiceNow Apriel 1.5's.
TOOLCALL_OPEN, TOOLCALL_CLOSE = "<TOOLCALL>", "</TOOLCALL>"
TOOLS_PREFIX, TOOLS_SUFFIX = "<|tools_prefix|>", "<|tools_suffix|>"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = "<tool_calls>", "</tool_calls>"
# Llama 3.1 opens a call with this special token; a tokenizer that spells special tokens out leaves it in the text.
PYTHON_TAG = "<|python_tag|>"
# What Python's str.strip() (the reader's) takes for whitespace, as a grammar's regex: \s and the four separators
# (\x1c-\x1f) that Python counts and the grammar's \s does not.
SPACE = r"[\s\x1c-\x1f]*"
# Llama 3's calls joined in one answer (as vLLM's llama3_json parser reads them).
LLAMA_CALL_SEPARATOR = "; "


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name, what it does, and the JSON schema of its arguments object."""

    name: str
    description: str = ""
    parameters: dict | None = None  # None: no arguments (OpenAI's reading of a function without parameters)
    strict: bool = False  # OpenAI's structured outputs for functions: its calls' arguments held to the schema

    def spec(self) -> dict:
        """The tool as OpenAI's API and chat templates write it."""
        function = {"name": self.name, "description": self.description, "parameters": self.arguments_schema()}
        return {"type": "function", "function": function}

    def arguments_schema(self) -> dict:
        """The JSON schema of its arguments object."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


@dataclass(frozen=True)
class Calls:
    """An answer read for calls: its content (where it made calls, the text outside the call blocks, without the
    whitespace beside a block; None where that is empty) and its calls in OpenAI's shape (empty where it made none:
    the content is then the answer as written)."""

    content: str | None
    calls: tuple[dict, ...]


@dataclass(frozen=True)
class Held:
    """A function an answer may call, as a grammar holds its calls: its name and its arguments' schema (None: any
    object)."""

    name: str
    schema: dict | None

    def json(self) -> str:
        """The arguments' schema as a grammar's JSON takes it, JSON written one way (core/grammar.py's style): a
        schema of its own, so that its references ("#/$defs/...", "#") resolve as the tool's author wrote them."""
        schema = self.schema if self.schema is not None else {"type": "object"}
        return json.dumps({**schema, "x-guidance": dict(JSON_STYLE)})


class CallFormat:
    """How a model writes tool calls (server/tools.py's docstring), one subclass a format: where its calls begin after
    any text (``opening``; None: the answer is its calls or text), its markers that may be added tokens of the
    tokenizer (server/tools.py's ``call_markers``), the grammar that holds an answer's calls, the reader of an answer,
    and the writer of earlier calls."""

    name = HERMES
    opening: str | None = CALL_OPEN
    markers: tuple[str, ...] = ()
    writes_values = False  # (its grammar writes each argument's value itself, rather than a JSON object)
    # (its grammar holds the whole answer, reasoning included, rather than the content after any reasoning block)
    reasons_itself = False
    after_text = ""  # what the model writes between a turn's text and its calls

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        """The lark grammar of an answer of one of ``calls`` (``several``: one or more); ``strict_auto``: any text
        that does not begin a call first, then such calls or nothing; ``ids``: the markers that are added tokens,
        which the grammar names by id (server/tool_text.py)."""
        raise NotImplementedError

    def read(self, text: str, tools: tuple[Tool, ...], parallel: bool, cut: bool) -> Calls:
        """An answer's calls of ``tools`` (the first alone unless ``parallel``) and its content (server/tools.py's
        ``read_calls``)."""
        raise NotImplementedError

    def unwritable_key(self, schema: dict) -> str | None:
        """A parameter name in ``schema`` that this format cannot write (None: it writes any)."""
        return None

    def writes_name(self, name: str) -> bool:
        """Whether this format can write a call of a function so named (OpenAI's names: letters, digits, ``_``,
        ``-``)."""
        return True

    def arguments_format(self, tool: Tool) -> OutputFormat:
        """What must compile for a grammar to hold ``tool``'s calls: its arguments' JSON schema, or the format's
        grammar of its calls where that writes the values itself."""
        held = Held(tool.name, tool.arguments_schema())
        if self.writes_values:
            return OutputFormat("lark", self.grammar([held], False, False, {}))
        return OutputFormat.json_schema(held.json())

    def write(self, calls: list[dict]) -> str | None:
        """An assistant's earlier ``calls`` (OpenAI's) as the model writes them, for a template that renders no calls
        (server/tools.py's prompt_messages); None where this format is not written here."""
        return None

    def message_id(self, call_id):
        """An earlier call's id as the format's template takes it."""
        return call_id

    def native_turns(self, messages: list[dict]) -> list[dict]:
        """The conversation's messages as the format's template takes them."""
        return messages

    def template_variables(self, messages: list[dict], tools: list | None) -> dict:
        """Variables the format's template needs (:func:`template_variables`)."""
        return {}


def call_record(call: dict) -> dict:
    """An earlier call as the call format writes it: its name and its arguments as an object (OpenAI sends them as
    JSON text; text that is no JSON object stays text)."""
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    return {"name": function["name"], "arguments": arguments if arguments is not None else {}}


def _read_call(record, names: set[str]) -> dict | None:
    if not isinstance(record, dict) or record.get("name") not in names:
        return None
    arguments = record.get("arguments", record.get("parameters"))
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI's API sends them
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": record["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


# -- Hermes's blocks, and Qwen3-Coder's XML in them ----------------------------------------------------------------

class _Hermes(CallFormat):
    """Hermes's blocks: ``<tool_call>`` JSON ``</tool_call>``, after any text."""

    xml = False  # (a block holds Qwen3-Coder's XML call instead of JSON)
    after_text = "\n"
    # (added tokens in the tokenizers of the models that write them: Qwen2.5's, Qwen3's, Granite 4's)
    markers = (CALL_OPEN, CALL_CLOSE)

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        either = " | ".join(f"call{index}" for index in range(len(calls)))
        # Each block's tags by token id where they are tokens (server/tool_text.py); between blocks a newline, and
        # after the last a newline at most (a model that ends its calls with one is not made to write another call).
        block = f'"\\n" ({either}) "\\n" {marker(CALL_CLOSE, ids)}'
        following = block + (f' ("\\n" {marker(CALL_OPEN, ids)} {block})*' if several else "") + ' "\\n"?'
        rules = [rule for index, call in enumerate(calls) for rule in self.call_rules(call, index)]
        return "\n".join([*start_rules(CALL_OPEN, ids, following, strict_auto), *rules]) + "\n"

    def call_rules(self, call: Held, index: int) -> list[str]:
        """The grammar's rules of a call of ``call`` (rule ``call{index}``): its name and keys as text, its arguments
        as its schema's JSON."""
        head = json.dumps(f'{{"name": {json.dumps(call.name)}, "arguments": ')
        return [f"call{index}: {head} args{index} \"}}\"", f"args{index}: %json {call.json()}"]

    def read(self, text: str, tools: tuple[Tool, ...], parallel: bool, cut: bool) -> Calls:
        if CALL_OPEN not in text:
            return Calls(text, ())
        kept = text
        glm = self.name == GLM
        if cut:
            kept = kept[:len(kept) - partial_tail(kept, CALL_OPEN)]
        split = _blocks(kept, xml=self.xml, glm=glm)
        if cut and isinstance(split, int):
            # The block the length cut off is dropped, with whatever followed its opening tag: the blocks are read in
            # order up to the first that does not read whole (in Qwen3-Coder's format a last call without its closing
            # tag reads), so a tag the unfinished call's own text spells (a value quoting it) is never taken for one.
            split = _blocks(kept[:split], xml=self.xml, glm=glm)
        names = {tool.name for tool in tools}
        calls = [_read_call(value, names) for value in self.records([] if isinstance(split, int) else split[1], tools)]
        if not calls or None in calls:
            return Calls(text, ())
        if not parallel:
            calls = calls[:1]
        return Calls(_content(split[0]) or None, tuple(calls))

    def records(self, values: list, tools: tuple[Tool, ...]) -> list:
        """The blocks' values as call records (name and arguments)."""
        return values

    def write(self, calls: list[dict]) -> str | None:
        return "\n".join(f"{CALL_OPEN}\n{json.dumps(call_record(call), ensure_ascii=False)}\n{CALL_CLOSE}"
                         for call in calls)


class _Qwen3Coder(_Hermes):
    """Qwen3-Coder's and Qwen3.5's XML calls inside Hermes's tags (server/tools_xml.py)."""

    name, xml, writes_values = QWEN3_CODER, True, True

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return super().grammar(calls, several, strict_auto, ids) + "\n".join(VALUE_RULES) + "\n"

    def call_rules(self, call: Held, index: int) -> list[str]:
        return call_rules(call.name, call.schema, index)

    def records(self, values: list, tools: tuple[Tool, ...]) -> list:
        # (each value typed by the tool's schema: the XML holds text)
        schemas = {tool.name: tool.arguments_schema() for tool in tools}
        return [{"name": value["name"],
                 "arguments": typed_arguments(value["arguments"], schemas.get(value["name"], {}))} for value in values]

    def unwritable_key(self, schema: dict) -> str | None:
        return unwritable_key(schema)

    def write(self, calls: list[dict]) -> str | None:
        return None  # (its XML calls are not written here)


class _Glm(_Qwen3Coder):
    """GLM-4.5-4.7's calls inside Hermes's tags: the function's name, then each argument's key and value in tags of
    their own (server/tools_glm.py), typed by the tool's schema as Qwen3-Coder's values are."""

    name, xml = GLM, False
    markers = (CALL_OPEN, CALL_CLOSE, *glm_format.MARKERS)

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        either = " | ".join(f"call{index}" for index in range(len(calls)))
        block = f"({either}) {marker(CALL_CLOSE, ids)}"
        following = block + (f' ("\\n"? {marker(CALL_OPEN, ids)} {block})*' if several else "")
        rules = [rule for index, call in enumerate(calls)
                 for rule in glm_format.call_rules(call.name, call.schema, index, ids)]
        # (GLM-4.6's template writes a line break before its first call)
        return "\n".join([*start_rules(CALL_OPEN, ids, following, strict_auto, lead='"\\n"? '), *rules,
                          *glm_format.value_rules(ids)]) + "\n"


def _blocks(text: str, xml: bool = False, glm: bool = False) -> tuple[list[str], list[object]] | int:
    """``text`` split at its call blocks: (the pieces outside them, each block's JSON value), or, where a block is
    not an opening tag, one JSON value and a closing tag (whitespace around the value allowed), the position of the
    first such block's opening tag. The JSON is read as JSON, so a closing tag inside one of its strings does not end
    the block. ``xml``: each block holds a call in Qwen3-Coder's format instead (server/tools_xml.py), the last
    block's closing tag allowed to be missing; ``glm``: a call in GLM's (server/tools_glm.py)."""
    decoder = json.JSONDecoder()
    pieces, values, at = [], [], 0
    while (start := text.find(CALL_OPEN, at)) >= 0:
        pieces.append(text[at:start])
        inside = start + len(CALL_OPEN)
        inside = skip_space(text, inside)
        try:
            value, end = (read_call(text, inside) if xml else glm_format.read_call(text, inside) if glm
                          else decoder.raw_decode(text, inside))
        except ValueError:
            return start
        end = skip_space(text, end)
        if xml and end == len(text):  # (a model that ends the answer after its last call's function)
            values.append(value)
            at = end
            break
        if not text.startswith(CALL_CLOSE, end):
            return start
        values.append(value)
        at = end + len(CALL_CLOSE)
    pieces.append(text[at:])
    return pieces, values


def _content(pieces: list[str]) -> str:
    """The text outside the blocks: the first piece less its trailing whitespace, the others less theirs on both
    sides, joined by newlines (how :class:`CallStream` can send it)."""
    first, rest = pieces[0].rstrip(), [piece.strip() for piece in pieces[1:] if piece.strip()]
    return "\n".join(([first] if first else []) + rest) if rest else first


# -- Llama 3's bare JSON -------------------------------------------------------------------------------------------

class _Llama3Json(CallFormat):
    """Llama 3's bare JSON: the answer is one call object, with its arguments under ``parameters``, or several joined
    by ``;``; text otherwise."""

    name, opening = LLAMA3_JSON, None

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        rules = []
        for index, call in enumerate(calls):
            head = json.dumps(f'{{"name": {json.dumps(call.name)}, "parameters": ')
            rules += [f"call{index}: {head} args{index} \"}}\"", f"args{index}: %json {call.json()}"]
        either = " | ".join(f"call{index}" for index in range(len(calls)))
        # The answer is the calls: text (in strict auto) is what would not be read as calls, an answer that does not
        # begin with a call's "{" (after whitespace and the python tag, as the reader reads it).
        joined = f"call ({json.dumps(LLAMA_CALL_SEPARATOR)} call)*" if several else "call"
        start = ([f"start: TEXT | {joined}",
                  f"TEXT: /(?s:.*)/ & ~/(?s:{SPACE}({re.escape(PYTHON_TAG)}{SPACE})?\\{{.*)/"] if strict_auto
                 else [f"start: {joined}"])
        return "\n".join([*start, f"call: {either}", *rules]) + "\n"

    def read(self, text: str, tools: tuple[Tool, ...], parallel: bool, cut: bool) -> Calls:
        """The whole answer (less the whitespace around it and a leading ``<|python_tag|>``) one call object, or
        several joined by ``;``, each naming an offered tool; else text. ``cut``: what follows the last whole call's
        ``;`` is dropped and the calls before it stand."""
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        decoder = json.JSONDecoder()
        names = {tool.name for tool in tools}
        calls, at = [], 0
        while True:
            if cut and calls and at == len(body):  # (cut right after a ";")
                break
            if not body.startswith("{", at):
                return Calls(text, ())
            try:
                value, at = decoder.raw_decode(body, at)
            except ValueError:
                if cut and calls:  # (the call the length cut off)
                    break
                return Calls(text, ())
            call = _read_call(value, names)
            if call is None:
                return Calls(text, ())
            calls.append(call)
            rest = body[at:].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):
                return Calls(text, ())
            at = len(body) - len(rest[1:].lstrip())
        return Calls(None, tuple(calls if parallel else calls[:1]))

    def native_turns(self, messages: list[dict]) -> list[dict]:
        return _llama_turns(messages)

    def template_variables(self, messages: list[dict], tools: list | None) -> dict:
        """Llama 3's templates put the tools into the first user turn, and refuse a conversation that has none (a
        system message alone); there they are told to put them into the system turn."""
        if not tools:
            return {}
        first = next((message for message in messages if message["role"] != "system"), None)
        return {} if first is not None and first["role"] == "user" else {"tools_in_user_message": False}


def _llama_turns(messages: list[dict]) -> list[dict]:
    """The conversation as Llama 3's templates take it: one call a turn (they refuse more), so a turn of several calls
    becomes turns of one call each, each followed by its result where the results that follow answer those calls by
    id (the template's ``ipython`` turns name no call); a call turn's text is dropped, as the templates drop it (so
    that a text they do not render is not looked for in their output)."""
    return one_call_a_turn(messages, lambda message: [dict(message, tool_calls=[call], content="")
                                                      for call in message["tool_calls"]]
                           if message.get("tool_calls") else None)


# -- calls after a marker: Mistral's, Gemma 4's, Granite 3's, JSON lists between markers, LFM2's --------------------

class _Marked(CallFormat):
    """A format whose calls follow a marker after any text (Mistral's, Gemma 4's, Granite 3's, the JSON lists between
    markers, LFM2's): the text before the first marker (less its trailing whitespace) the content, and all that
    follows it the calls, as the format's module reads them (those with a closing marker may end them and say more:
    that text joins the content, on a line of its own)."""

    def read(self, text: str, tools: tuple[Tool, ...], parallel: bool, cut: bool) -> Calls:
        start = text.find(self.opening)
        if start < 0:
            return Calls(text, ())
        records, after = self.split(text[start + len(self.opening):], cut)
        names = {tool.name for tool in tools}
        calls = [_read_call(record, names) for record in records or []]
        if not calls or None in calls:
            return Calls(text, ())
        content = "\n".join(part for part in (text[:start].rstrip(), after.strip()) if part)
        return Calls(content or None, tuple(calls if parallel else calls[:1]))

    def split(self, rest: str, cut: bool) -> tuple[list[dict] | None, str]:
        """The call records written after the first marker (None: they do not read), and the text after them."""
        return self.records(rest, cut), ""

    def records(self, rest: str, cut: bool) -> list[dict] | None:
        """The call records written after the first marker (None: they do not read)."""
        raise NotImplementedError


class _Mistral(_Marked):
    """Mistral's, after ``[TOOL_CALLS]`` (server/tools_mistral.py): v3's JSON list, or v11's name and ``[ARGS]``."""

    opening = mistral.TOOL_CALLS

    def __init__(self, v11: bool) -> None:
        self.v11 = v11
        self.name, self.markers = (MISTRAL_V11, mistral.MARKERS_V11) if v11 else (MISTRAL_V3, mistral.MARKERS_V3)

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return mistral.grammar([(call.name, call.json()) for call in calls], self.v11, several, strict_auto, ids)

    def records(self, rest: str, cut: bool) -> list[dict] | None:
        return mistral.read_calls(rest, self.v11, cut)

    def message_id(self, call_id) -> str:
        return mistral.mistral_id(call_id)


class _Gemma4(_Marked):
    """Gemma 4's ``<|tool_call>call:NAME{key:value}<tool_call|>`` (server/tools_gemma.py)."""

    name, opening, markers, writes_values = GEMMA4, gemma.CALL_OPEN, gemma.MARKERS, True

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return gemma.grammar([(call.name, call.schema) for call in calls], several, strict_auto, ids)

    def records(self, rest: str, cut: bool) -> list[dict] | None:
        return gemma.read_calls(rest, cut)

    def unwritable_key(self, schema: dict) -> str | None:
        return gemma.unwritable_key(schema)


class _Granite(_Marked):
    """IBM Granite 3's: ``<|tool_call|>`` and one JSON list of the calls, as Mistral's v3 writes its list."""

    name, opening, markers = GRANITE, GRANITE_CALL, (GRANITE_CALL,)

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return mistral.grammar([(call.name, call.json()) for call in calls], False, several, strict_auto, ids,
                               opening=GRANITE_CALL)

    def records(self, rest: str, cut: bool) -> list[dict] | None:
        return mistral.list_calls(rest, cut)

    def write(self, calls: list[dict]) -> str | None:
        return GRANITE_CALL + json.dumps([call_record(call) for call in calls], ensure_ascii=False)


class _JsonList(_Marked):
    """One JSON list of the calls between an opening and a closing marker, as Mistral's v3 writes its list:
    NVIDIA Nemotron Nano 2's ``<TOOLCALL>`` ... ``</TOOLCALL>``, ServiceNow Apriel 1.5's ``<tool_calls>`` ...
    ``</tool_calls>``. The list is read as JSON first, so a marker's spelling inside an argument is text; text after
    the closing marker joins the content, and an answer that ends (or is cut) after its list without the marker
    still reads."""

    def __init__(self, name: str, opening: str, closing: str) -> None:
        self.name, self.opening, self.closing, self.markers = name, opening, closing, (opening, closing)

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return mistral.grammar([(call.name, call.json()) for call in calls], False, several, strict_auto, ids,
                               opening=self.opening, closing=self.closing)

    def split(self, rest: str, cut: bool) -> tuple[list[dict] | None, str]:
        try:
            items, end = json.JSONDecoder().raw_decode(rest, skip_space(rest, 0))
        except ValueError:  # (an unfinished list: the calls before the one the cut left unfinished stand)
            items = mistral.list_calls(rest, cut) if cut else None
            return (None if items is None else self.records(items)), ""
        tail = rest[end:].lstrip()
        if not isinstance(items, list):
            return None, ""
        if tail.startswith(self.closing):
            return self.records(items), tail[len(self.closing):]
        if not tail or (cut and self.closing.startswith(tail)):
            return self.records(items), ""
        return None, ""

    def records(self, items: list) -> list[dict] | None:
        """The call records (``{"name", "arguments"}``) the list's items are."""
        return items

    def write(self, calls: list[dict]) -> str | None:
        return self.opening + json.dumps([call_record(call) for call in calls], ensure_ascii=False) + self.closing


class _Apertus(_JsonList):
    """Swiss AI Apertus's: the list between ``<|tools_prefix|>`` and ``<|tools_suffix|>`` (special tokens), each item
    naming the function as its one key, ``{"get_weather": {"city": "Paris"}}``."""

    def __init__(self) -> None:
        super().__init__(APERTUS, TOOLS_PREFIX, TOOLS_SUFFIX)

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        rules = []
        for index, call in enumerate(calls):
            rules += [f'call{index}: {json.dumps("{" + json.dumps(call.name) + ": ")} args{index} "}}"',
                      f"args{index}: %json {call.json()}"]
        either = " | ".join(f"call{index}" for index in range(len(calls)))
        following = ('"[" call (", " call)* "]"' if several else '"[" call "]"') + f" {marker(TOOLS_SUFFIX, ids)}"
        return "\n".join([*start_rules(TOOLS_PREFIX, ids, following, strict_auto), f"call: {either}", *rules]) + "\n"

    def records(self, items: list) -> list[dict] | None:
        if not all(isinstance(item, dict) and len(item) == 1 for item in items):
            return None
        return [{"name": name, "arguments": arguments} for item in items for name, arguments in item.items()]

    def write(self, calls: list[dict]) -> str | None:
        items = [{record["name"]: record["arguments"]} for record in map(call_record, calls)]
        return TOOLS_PREFIX + json.dumps(items, ensure_ascii=False) + TOOLS_SUFFIX


class _Lfm2(_Marked):
    """LiquidAI LFM2's: one Python list of calls between ``<|tool_call_start|>`` and ``<|tool_call_end|>``
    (server/tools_pythonic.py)."""

    name, opening, markers, writes_values = LFM2, pythonic.CALL_START, pythonic.MARKERS, True

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return pythonic.grammar([(call.name, call.schema) for call in calls], several, strict_auto, ids)

    def split(self, rest: str, cut: bool) -> tuple[list[dict] | None, str]:
        return pythonic.read_calls(rest, cut)

    def unwritable_key(self, schema: dict) -> str | None:
        return pythonic.unwritable_key(schema)

    def writes_name(self, name: str) -> bool:
        return pythonic.writable_name(name)

    def write(self, calls: list[dict]) -> str | None:
        return pythonic.write([call_record(call) for call in calls])


class _Harmony(_Marked):
    """gpt-oss's Harmony (server/harmony.py): a call is a message addressed to the function, which the content carries
    after :data:`harmony.CALL_OPENING`. Its grammar holds the whole answer: an analysis message or none, then the
    call (one: the model ends its answer after a call)."""

    name, opening, markers, reasons_itself = HARMONY_CALLS, harmony.CALL_OPENING, harmony.MARKERS, True

    def read(self, text: str, tools: tuple[Tool, ...], parallel: bool, cut: bool) -> Calls:
        read = super().read(text, tools, parallel, cut)
        start = text.find(self.opening)
        if cut and not read.calls and start >= 0:  # (the call the length cut: its opening is this reader's own)
            return Calls(text[:start].rstrip(), ())
        return read

    def grammar(self, calls: list[Held], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
        return harmony.call_grammar([(call.name, call.json()) for call in calls], strict_auto, ids)

    def split(self, rest: str, cut: bool) -> tuple[list[dict] | None, str]:
        return harmony.read_calls(rest, cut)

    def native_turns(self, messages: list[dict]) -> list[dict]:
        return harmony.native_turns(messages)


CALL_FORMATS: dict[str, CallFormat] = {call_format.name: call_format for call_format in (
    _Hermes(), _Llama3Json(), _Mistral(v11=False), _Mistral(v11=True), _Qwen3Coder(), _Gemma4(), _Granite(),
    _Lfm2(), _JsonList(NEMOTRON, TOOLCALL_OPEN, TOOLCALL_CLOSE), _Apertus(),
    _JsonList(APRIEL, TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE), _Glm(), _Harmony())}
