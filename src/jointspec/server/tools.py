"""OpenAI tool calling for the server: the tools a request offers, the prompt that shows them, the calls read back.

Calls are read in one of six formats, the one the model's chat template writes (:func:`native_call_format`), else
Hermes's. Hermes's, the one Qwen2.5 and Qwen3, the Hermes models and many small instruction-tuned models were trained
on: each call a block of its own, parallel calls one block after another::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

How the prompt shows the tools. A chat template that takes ``tools`` and writes this format itself (its text names
``<tool_call>``) renders them, with the conversation's earlier calls and results, as the model was trained to read
them. Any other template, and a model without one, gets them as text (:func:`prompt_messages`): a system message that
lists the tools' JSON schemas and shows the format, earlier calls as these blocks in the assistant's text, results as
a user turn in ``<tool_response>`` tags (as Qwen's template writes them).

Llama 3.1-3.3's templates render tools in a format of their own (``llama3_json``): the answer *is* the call, one JSON
object with the arguments under ``parameters``, and the results come back in ``ipython`` turns::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

A template that writes calls so (its text names ``"parameters": `` and the ``ipython`` role) renders the tools, the
earlier calls and the results itself, and its answers are read and constrained in that format: an answer is a call
where it begins with ``{`` (after Llama 3.1's ``<|python_tag|>``, where that is spelled out) and is one such object, or
several joined by ``;``; text otherwise. Those templates hold one call an assistant turn, so an earlier turn's
parallel calls are given to them as consecutive turns of one call each, each followed by its result.

Mistral's templates open calls with the special token ``[TOOL_CALLS]``, after any text, in one of two formats by the
tokenizer's version: up to v7 (Mistral 7B v0.3, Nemo, Small 22B-3.1) one JSON list of the calls (``mistral_v3``);
from v11 (Small 3.2, Magistral, Devstral, Ministral 3) each call its own marker, its name, ``[ARGS]`` and its
arguments (``mistral_v11``)::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

(v3's tekken models write no space before the list; a v11 model may write ``[CALL_ID]`` and its call's id before
``[ARGS]``.) A template that names ``[TOOL_CALLS]`` renders the tools, calls and results itself (Mistral's templates
that show call ids take ids of 9 letters and digits alone, so other ids are given to them as 9 such characters
derived from the id), and its answers are read and constrained in its format; their markers, which a decode skips
as special tokens, are kept in the text of an answer read for calls (:func:`call_markers`). A template that takes
tools in yet another format (Llama 4's) is given the Hermes text form.

Qwen3-Coder's and Qwen3.5's templates (``qwen3_coder``, as vLLM names it; the template names ``<function=`` and
``<parameter=`` besides ``<tool_call>``) write a call as XML inside the same tags, ``<function=NAME>`` and a
``<parameter=KEY>`` block of text a value. They are read as Hermes's blocks are, each value typed by the tool's
schema, and constrained by a grammar of that layout (server/tools_xml.py). Gemma 4's (``gemma4``; the template
names ``<|tool_call>`` and ``call:``) writes ``<|tool_call>call:NAME{key:value}<tool_call|>`` with strings between
``<|"|>`` markers, read and held likewise (server/tools_gemma.py).

What ``tool_choice`` does to the answer (in Hermes's format; the others read and hold their own alike):

- ``"none"``: the tools are not shown and no call is read; the answer is text.
- ``"auto"`` (the default where tools are given): the model writes freely. Each block whose JSON names an offered
  tool and holds an arguments object is a call, and the text outside the blocks is the message's content. Where a
  block does not read so, nothing is taken for a call: the whole answer is content, as the model wrote it.
- ``"required"``, or one function by name: a grammar (core/grammar.py) lets the model write only calls (of that
  function) whose arguments the tool's JSON schema accepts. Every method decodes a grammar losslessly, so a greedy
  answer is the call plain constrained decoding writes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from jointspec.core.grammar import JSON_STYLE, GrammarError, OutputFormat, one_line
from jointspec.server import tools_gemma as gemma
from jointspec.server import tools_mistral as mistral
from jointspec.server.tool_text import partial_tail, skip_space
from jointspec.server.tools_xml import (
    FUNCTION_OPEN,
    PARAMETER_OPEN,
    VALUE_RULES,
    call_rules,
    read_call,
    typed_arguments,
    unwritable_key,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# The call formats read here (module docstring): Hermes's blocks, Llama 3's bare JSON, Mistral's two
# (server/tools_mistral.py), Qwen3-Coder's XML (server/tools_xml.py) and Gemma 4's (server/tools_gemma.py).
HERMES, LLAMA3_JSON = "hermes", "llama3_json"
MISTRAL_V3, MISTRAL_V11 = "mistral_v3", "mistral_v11"
QWEN3_CODER, GEMMA4 = "qwen3_coder", "gemma4"
FORMATS = (HERMES, LLAMA3_JSON, MISTRAL_V3, MISTRAL_V11, QWEN3_CODER, GEMMA4)
# Llama 3.1 opens a call with this special token; a tokenizer that spells special tokens out leaves it in the text.
PYTHON_TAG = "<|python_tag|>"
# What Python's str.strip() (the reader's) takes for whitespace, as a grammar's regex: \s and the four separators
# (\x1c-\x1f) that Python counts and the grammar's \s does not.
SPACE = r"[\s\x1c-\x1f]*"
# Llama 3's calls joined in one answer (as vLLM's llama3_json parser reads them).
LLAMA_CALL_SEPARATOR = "; "
# Mistral's markers (module docstring), special tokens in Mistral's tokenizers.
MISTRAL = (MISTRAL_V3, MISTRAL_V11)
# The formats' markers that are added tokens in their models' tokenizers (call_markers).
MARKERS = {MISTRAL_V3: mistral.MARKERS_V3, MISTRAL_V11: mistral.MARKERS_V11, GEMMA4: gemma.MARKERS}
# Where calls begin in an answer, in the formats that may write text before them.
OPENINGS = {HERMES: CALL_OPEN, MISTRAL_V3: mistral.TOOL_CALLS, MISTRAL_V11: mistral.TOOL_CALLS, QWEN3_CODER: CALL_OPEN,
            GEMMA4: gemma.CALL_OPEN}
# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A request's tools, tool choice or tool messages that cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
class ToolUse:
    """The tools a request offers and what it lets the model do with them. ``choice``: ``none``, ``auto`` or
    ``required``; ``function``: the one function the answer must call, once (``choice`` is then ``required``);
    ``parallel``: several calls in one answer; ``legacy``: asked in the older form (``functions``), which is answered
    in that form (one ``function_call``); ``format``: how the model writes calls (:data:`FORMATS`, module
    docstring); ``special``: the format's markers that are added tokens of the model's tokenizer, with their ids
    (:func:`call_markers`), which a grammar names by id (a special token has no text to match)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True
    legacy: bool = False
    format: str = HERMES
    special: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.choice not in CHOICES:
            raise ValueError(f"tool choice must be one of {', '.join(CHOICES)}, got {self.choice!r}")
        if self.format not in FORMATS:
            raise ValueError(f"call format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.function is not None and (self.choice != "required"
                                          or self.function not in {tool.name for tool in self.tools}):
            raise ValueError(f"function {self.function!r} must be an offered tool, with choice 'required'")

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def shown(self) -> tuple[dict, ...]:
        """The tools the prompt shows (none where the answer may not call them)."""
        return tuple(tool.spec() for tool in self.tools) if self.reads_calls else ()

    def output_format(self) -> OutputFormat | None:
        """The grammar the answer follows, or None where it is free text. ``required``: one call, or with ``parallel``
        one or more, each a block (Llama 3's format: an object; several joined by ``"; "``) whose JSON names an allowed
        tool and whose arguments its schema accepts; then (Hermes) a newline at most, and the end of the answer.
        ``auto`` where a tool is ``strict`` (OpenAI's promise that a strict function's arguments match its schema):
        text without a call's opening tag (Llama 3: text that does not begin with ``{``), or (Hermes) such text and
        then calls as ``required`` writes them (a strict function's arguments held to its schema, the others' any
        object), or (Llama 3) those calls alone. The other formats' grammars are their modules' (Mistral's, Gemma's)
        or written alike (Qwen3-Coder's, its calls' rules from server/tools_xml.py)."""
        strict_auto = self.choice == "auto" and any(tool.strict for tool in self.tools)
        if self.choice != "required" and not strict_auto:
            return None
        allowed = [tool for tool in self.tools if self.function in (None, tool.name)]
        several = self.parallel and self.function is None
        ids = dict(self.special)
        # (strict, as OpenAI reads it, is a function's own: in auto, the others' arguments are anything)
        held = [(tool.name, tool.arguments_schema() if tool.strict or not strict_auto else None) for tool in allowed]
        if self.format == GEMMA4:
            return OutputFormat("lark", gemma.grammar(held, several, strict_auto, ids))
        # In the JSON formats each call's arguments are a JSON schema of their own: the arguments' references
        # ("#/$defs/...", "#") then resolve against their own schema, as the tool's author wrote them.
        json_held = [arguments_grammar(tool) if schema is not None
                     else json.dumps({"type": "object", "x-guidance": JSON_STYLE})
                     for tool, (_, schema) in zip(allowed, held, strict=True)]
        if self.format in MISTRAL:
            return OutputFormat("lark", mistral.grammar([(tool.name, arguments) for tool, arguments in
                                                         zip(allowed, json_held, strict=True)],
                                                        self.format == MISTRAL_V11, several, strict_auto, ids))
        # Each call's name and keys as text, its arguments as above.
        key = "arguments" if self.format == HERMES else "parameters"
        rules = []
        for index, tool in enumerate(allowed):
            if self.format == QWEN3_CODER:
                rules += call_rules(*held[index], index)
                continue
            head = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{key}": ')
            rules += [f"call{index}: {head} args{index} \"}}\"", f"args{index}: %json {json_held[index]}"]
        if self.format == QWEN3_CODER:
            rules += VALUE_RULES
        either = " | ".join(f"call{index}" for index in range(len(allowed)))
        if self.format == LLAMA3_JSON:
            # The answer is the calls: text (in strict auto) is what would not be read as calls, an answer that
            # does not begin with a call's "{" (after whitespace and the python tag, as read_calls reads it).
            calls = f"call ({json.dumps(LLAMA_CALL_SEPARATOR)} call)*" if several else "call"
            start = ([f"start: TEXT | {calls}",
                      f"TEXT: /(?s:.*)/ & ~/(?s:{SPACE}({re.escape(PYTHON_TAG)}{SPACE})?\\{{.*)/"] if strict_auto
                     else [f"start: {calls}"])
            return OutputFormat("lark", "\n".join([*start, f"call: {either}", *rules]) + "\n")
        # (then a newline at most: a model that ends its calls with one is not made to write another call)
        after = (' ("\\n" call)*' if several else "") + ' "\\n"?'
        opening, closing = json.dumps(CALL_OPEN + "\n"), json.dumps("\n" + CALL_CLOSE)
        if strict_auto:
            # TEXT: anything without the opening tag. OPENED: such text and the tag, one lexeme, so that the text
            # ends where the tag begins (a lexer cannot end a lexeme it has already extended past the tag's start).
            start = [f"start: TEXT | OPENED ({either}) {closing}{after}", f"OPENED: TEXT {opening}",
                     f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(CALL_OPEN)}.*)/"]
        else:
            start = [f"start: call{after}"]
        return OutputFormat("lark", "\n".join([*start, f"call: {opening} ({either}) {closing}", *rules]) + "\n")

def arguments_grammar(tool: Tool) -> str:
    """A tool's arguments schema as the grammar's JSON takes it: JSON written one way (core/grammar.py's style)."""
    return json.dumps({**tool.arguments_schema(), "x-guidance": dict(JSON_STYLE)})


def read_tool_use(tools: list | None, tool_choice, parallel_tool_calls, *, functions: list | None = None,
                  function_call=None, call_format: str = HERMES,
                  special: tuple[tuple[str, int], ...] = ()) -> ToolUse | None:
    """A chat request's ``tools`` and ``tool_choice`` (or the deprecated ``functions`` and ``function_call``) as a
    :class:`ToolUse` whose calls the model writes in ``call_format`` (:func:`call_format_of`), ``special`` being its
    markers that are tokens of the model's tokenizer (:func:`call_markers`); None where it offers no tools.
    ToolError names the field at fault."""
    if tools and functions:
        raise ToolError("send tools or functions (their older form), not both", "functions")
    param, choice_param = "tools", "tool_choice"
    if functions:
        tools = [{"type": "function", "function": function} for function in functions]
        param = "functions"
    if tool_choice is None and function_call is not None:  # the older form: {"name": ...} for one function
        choice_param = "function_call"
        tool_choice = ({"type": "function", "function": function_call} if isinstance(function_call, dict)
                       else function_call)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ToolError(f"{choice_param} asks for a tool call, but the request offers no tools", choice_param)
        return None
    offered = tuple(_read_tool(tool, f"{param}.{index}") for index, tool in enumerate(tools))
    names = [tool.name for tool in offered]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ToolError(f"tool names must differ: {', '.join(twice)} is offered twice", param)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    # The older form answers with one function_call (OpenAI's functions API had no parallel calls).
    legacy = bool(functions)
    parallel = parallel_tool_calls is not False and not legacy
    if tool_choice is None or tool_choice in CHOICES:
        use = ToolUse(offered, tool_choice or "auto", parallel=parallel, legacy=legacy, format=call_format,
                      special=special)
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ToolError(f"{choice_param} names function {name!r}, which the request does not offer (it offers "
                            f"{', '.join(names)})", choice_param)
        use = ToolUse(offered, "required", function=name, parallel=parallel, legacy=legacy, format=call_format,
                      special=special)
    else:
        raise ToolError(f"{choice_param} must be none, auto, required or {{\"type\": \"function\", \"function\": "
                        f"{{\"name\": ...}}}}, got {json.dumps(tool_choice)}", choice_param)
    if use.output_format() is not None:  # the grammar holds the schemas: one it cannot compile is that tool's fault
        for index, tool in enumerate(offered):
            if use.function in (None, tool.name) and (use.choice == "required" or tool.strict):
                where = f"{param}.{index}.function.parameters"
                try:
                    if call_format in (QWEN3_CODER, GEMMA4):  # (its calls' own grammar, a value at a time)
                        key = (unwritable_key if call_format == QWEN3_CODER else gemma.unwritable_key)(
                            tool.arguments_schema())
                        if key is not None:
                            raise ToolError(f"{where}: the model's call format ({call_format}) cannot write a "
                                            f"parameter named {json.dumps(key)}", where)
                        ToolUse((tool,), "required", format=call_format).output_format().check()
                    else:
                        OutputFormat.json_schema(arguments_grammar(tool)).check()
                except GrammarError as error:
                    raise ToolError(f"{param}.{index}.function.parameters cannot hold the call's arguments: "
                                    f"{one_line(str(error))}", f"{param}.{index}.function.parameters") from None
    return use


def _read_tool(raw, where: str) -> Tool:
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" or not isinstance(
            raw.get("function"), dict):
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": "
                        "...}}: functions are the only tools served", where)
    function = raw["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                        f"{json.dumps(name)}", f"{where}.function.name")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be text", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict)
                                   or parameters.get("type", "object") != "object"):
        raise ToolError(f"{where}.function.parameters must be the JSON schema of an object (a call's arguments are "
                        "one)", f"{where}.function.parameters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
    return Tool(name, description, parameters, bool(strict))


# -- the prompt ----------------------------------------------------------------------------------------------------

def native_call_format(tokenizer) -> str | None:
    """The call format the tokenizer's chat template renders tools and calls in itself (:data:`FORMATS`), or None
    where it renders them in none of them (of a tokenizer with several named templates, its ``tool_use`` one, which
    transformers renders where tools are given)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        return None
    if CALL_OPEN in template:  # (Qwen3-Coder's and Qwen3.5's write <function=...> blocks inside the tags)
        return QWEN3_CODER if FUNCTION_OPEN in template and PARAMETER_OPEN in template else HERMES
    if gemma.CALL_OPEN in template and gemma.CALL_PREFIX in template:
        return GEMMA4
    if mistral.TOOL_CALLS in template:  # Mistral's: v11 and later name the arguments' marker
        return MISTRAL_V11 if mistral.ARGS in template else MISTRAL_V3
    # (Llama 4's template writes calls so too, but several a turn, unseparated, after <|python_start|>: not read)
    if '"parameters": ' in template and "ipython" in template and "<|python_start|>" not in template:
        return LLAMA3_JSON
    return None


def call_format_of(tokenizer) -> str:
    """The format a model behind ``tokenizer`` writes calls in: its template's own where that is one read here, else
    Hermes's, which :func:`prompt_messages` then shows it as text."""
    return native_call_format(tokenizer) or HERMES


def call_markers(tokenizer, call_format: str) -> tuple[tuple[str, int], ...]:
    """Of ``call_format``'s markers (Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, Gemma's ``<|tool_call>``...), those
    that are one added token of ``tokenizer`` (its control tokens), with its id: an answer read for calls keeps them in
    its text (a decode skips those that are special tokens), and a grammar names them by id (a special token has no
    text to match, and llguidance reads some added tokens, such as ``<...>`` ones, as special whatever their flag)."""
    try:
        added = tokenizer.get_added_vocab()
    except (AttributeError, TypeError):  # (a tokenizer that is not transformers')
        return ()
    return tuple((spelling, int(added[spelling])) for spelling in MARKERS.get(call_format, ()) if spelling in added)


def prompt_messages(messages: list[dict], tools: tuple[dict, ...], native: bool,
                    call_format: str = HERMES) -> tuple[list[dict], list | None]:
    """The conversation as the chat template gets it, and the ``tools`` it gets (None: none). ``messages`` are
    OpenAI's, as dicts (assistant messages may hold ``tool_calls``, ``tool`` messages a result); ``native``: the
    template renders tools and calls itself (:func:`native_call_format`), in ``call_format``."""
    if native:
        rendered = [_native_message(message, call_format) for message in messages]
        if call_format == LLAMA3_JSON:
            rendered = _llama_turns(rendered)
        return rendered, (list(tools) or None)
    rendered: list[dict] = []
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            text = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if index and messages[index - 1]["role"] == "tool":  # results of one turn's calls: one user turn
                rendered[-1] = {"role": "user", "content": rendered[-1]["content"] + "\n" + text}
            else:
                rendered.append({"role": "user", "content": text})
        elif message.get("tool_calls"):
            blocks = "\n".join(f"{CALL_OPEN}\n{json.dumps(_call_record(call), ensure_ascii=False)}\n{CALL_CLOSE}"
                               for call in message["tool_calls"])
            content = message.get("content") or ""
            rendered.append({**_kept(message), "content": f"{content}\n{blocks}" if content else blocks})
        else:
            rendered.append({**_kept(message), "content": message.get("content") or ""})
    if tools:
        preamble = _tools_preamble(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{preamble}"}
        else:
            rendered.insert(0, {"role": "system", "content": preamble})
    return rendered, None


def template_variables(messages: list[dict], tools: list | None, call_format: str) -> dict:
    """Variables a native template needs for ``messages`` besides the request's own (``chat_template_kwargs`` win):
    Llama 3's templates put the tools into the first user turn, and refuse a conversation that has none (a system
    message alone); there they are told to put them into the system turn."""
    if call_format != LLAMA3_JSON or not tools:
        return {}
    first = next((message for message in messages if message["role"] != "system"), None)
    return {} if first is not None and first["role"] == "user" else {"tools_in_user_message": False}


def _kept(message: dict) -> dict:
    """What a message shown as text keeps of its own: all but its calls (an assistant's earlier reasoning, which a
    template may show, included)."""
    return {key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")}


def _tools_preamble(tools: tuple[dict, ...]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to help with the user's request. The functions, as JSON schemas:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and its arguments between the tags:\n"
            f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CALL_CLOSE}')


def _call_record(call: dict) -> dict:
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


def _llama_turns(messages: list[dict]) -> list[dict]:
    """The conversation as Llama 3's templates take it: one call a turn (they refuse more), so a turn of several calls
    becomes turns of one call each, each followed by its result where the results that follow answer those calls by
    id (the template's ``ipython`` turns name no call); a call turn's text is dropped, as the templates drop it (so
    that a text they do not render is not looked for in their output)."""
    out: list[dict] = []
    at = 0
    while at < len(messages):
        message = messages[at]
        at += 1
        calls = message.get("tool_calls") or []
        if not calls:
            out.append(message)
            continue
        turns = [dict(message, tool_calls=[call], content="") for call in calls]
        results = []
        while at < len(messages) and messages[at]["role"] == "tool":
            results.append(messages[at])
            at += 1
        by_id = {result.get("tool_call_id"): result for result in results}
        ids = [call.get("id") for call in calls]
        if len(calls) > 1 and len(by_id) == len(results) == len(calls) and set(by_id) == set(ids):
            out += [part for turn, id_ in zip(turns, ids) for part in (turn, by_id[id_])]
        else:
            out += turns + results
    return out


def _native_message(message: dict, call_format: str = HERMES) -> dict:
    """A message as a template that renders calls itself takes it: calls with their arguments as objects, and (for
    Mistral's templates, which refuse any other where they show ids) call ids of 9 letters and digits."""
    ids = mistral.mistral_id if call_format in MISTRAL else (lambda id_: id_)
    if message.get("tool_calls"):
        calls = [{"type": "function", "id": ids(call.get("id")), "function": _call_record(call)}
                 for call in message["tool_calls"]]
        return {**message, "tool_calls": calls}
    if message["role"] == "tool" and "tool_call_id" in message:
        return {**message, "tool_call_id": ids(message["tool_call_id"])}
    return message


def check_message(message: dict, where: str) -> None:
    """Refuse an assistant message's ``tool_calls`` (or older ``function_call``) or a ``tool`` message OpenAI's API
    would not take."""
    older = message.get("function_call")
    if older is not None:
        if message["role"] != "assistant" or not isinstance(older.get("name"), str) or not isinstance(
                older.get("arguments", ""), str):
            raise ToolError(f"{where}.function_call must be an assistant's {{\"name\": ..., \"arguments\": \"<JSON "
                            "text>\"}", f"{where}.function_call")
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant":
            raise ToolError(f"{where}.tool_calls: only assistant messages hold tool calls", f"{where}.tool_calls")
        for index, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                    or not isinstance(function.get("arguments", ""), str)):
                raise ToolError(f"{where}.tool_calls.{index} must be {{\"id\": ..., \"type\": \"function\", "
                                "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}",
                                f"{where}.tool_calls.{index}")
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ToolError(f"{where}: a tool message needs the tool_call_id of the call it answers",
                        f"{where}.tool_call_id")


# -- the answer ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Calls:
    """An answer read for calls: its content (where it made calls, the text outside the call blocks, without the
    whitespace beside a block; None where that is empty) and its calls in OpenAI's shape (empty where it made none:
    the content is then the answer as written)."""

    content: str | None
    calls: tuple[dict, ...]


def _blocks(text: str, xml: bool = False) -> tuple[list[str], list[object]] | None:
    """``text`` split at its call blocks: (the pieces outside them, each block's JSON value), or None where a block
    is not an opening tag, one JSON value and a closing tag (whitespace around the value allowed). The JSON is read
    as JSON, so a closing tag inside one of its strings does not end the block. ``xml``: each block holds a call in
    Qwen3-Coder's format instead (server/tools_xml.py), the last block's closing tag allowed to be missing."""
    decoder = json.JSONDecoder()
    pieces, values, at = [], [], 0
    while (start := text.find(CALL_OPEN, at)) >= 0:
        pieces.append(text[at:start])
        inside = start + len(CALL_OPEN)
        inside = skip_space(text, inside)
        try:
            value, end = read_call(text, inside) if xml else decoder.raw_decode(text, inside)
        except ValueError:
            return None
        end = skip_space(text, end)
        if xml and end == len(text):  # (a model that ends the answer after its last call's function)
            values.append(value)
            at = end
            break
        if not text.startswith(CALL_CLOSE, end):
            return None
        values.append(value)
        at = end + len(CALL_CLOSE)
    pieces.append(text[at:])
    return pieces, values


def _content(pieces: list[str]) -> str:
    """The text outside the blocks: the first piece less its trailing whitespace, the others less theirs on both
    sides, joined by newlines (how :class:`CallStream` can send it)."""
    first, rest = pieces[0].rstrip(), [piece.strip() for piece in pieces[1:] if piece.strip()]
    return "\n".join(([first] if first else []) + rest) if rest else first


def read_calls(text: str, use: ToolUse, cut: bool = False) -> Calls:
    """``text`` read as :mod:`this module <jointspec.server.tools>` says: every block a call of an offered tool, or
    the whole text content. ``cut``: the answer ran out of tokens, so a block it left open (or the start of one's
    tag) is dropped, and the calls before it stand. In Llama 3's format the answer is its calls or text (a cut call
    leaves it text)."""
    if use.reads_calls and use.format == LLAMA3_JSON:
        return _read_json_calls(text, use, cut)
    if use.reads_calls and (use.format == GEMMA4 or use.format in MISTRAL):
        return _read_marked_calls(text, use, cut)
    if not use.reads_calls or CALL_OPEN not in text:
        return Calls(text, ())
    kept = text
    xml = use.format == QWEN3_CODER
    if cut:
        kept = kept[:len(kept) - partial_tail(kept, CALL_OPEN)]
        # (a last block left open is dropped; in Qwen3-Coder's format, only where its call does not read whole)
        if kept.rfind(CALL_OPEN) > kept.rfind(CALL_CLOSE) and not (xml and _blocks(kept, xml=True)):
            kept = kept[:kept.rfind(CALL_OPEN)]
    split = _blocks(kept, xml=xml)
    names = {tool.name for tool in use.tools}
    values = split[1] if split else ()
    if use.format == QWEN3_CODER:
        schemas = {tool.name: tool.arguments_schema() for tool in use.tools}
        values = [{"name": value["name"], "arguments": typed_arguments(value["arguments"],
                                                                        schemas.get(value["name"], {}))}
                  for value in values]
    calls = [_read_call(value, names) for value in values]
    if not calls or None in calls:
        return Calls(text, ())
    if not use.parallel:
        calls = calls[:1]
    return Calls(_content(split[0]) or None, tuple(calls))


def _read_json_calls(text: str, use: ToolUse, cut: bool = False) -> Calls:
    """``text`` read in Llama 3's format: the whole answer (less the whitespace around it and a leading
    ``<|python_tag|>``) one call object, or several joined by ``;``, each naming an offered tool; else text.
    ``cut``: the answer ran out of tokens, so what follows the last whole call's ``;`` is dropped and the calls
    before it stand."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].lstrip()
    decoder = json.JSONDecoder()
    names = {tool.name for tool in use.tools}
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
    return Calls(None, tuple(calls if use.parallel else calls[:1]))


def _read_marked_calls(text: str, use: ToolUse, cut: bool = False) -> Calls:
    """``text`` read in a format whose calls follow a marker after any text (Mistral's, Gemma 4's): the text before
    the first marker (less its trailing whitespace) the content, and all that follows it the calls of offered tools,
    as the format's module reads them (server/tools_mistral.py, server/tools_gemma.py); else the whole text content.
    ``cut``: the answer ran out of tokens, so the call it left unfinished is dropped and the calls before it
    stand."""
    opening = OPENINGS[use.format]
    start = text.find(opening)
    if start < 0:
        return Calls(text, ())
    rest = text[start + len(opening):]
    records = (gemma.read_calls(rest, cut) if use.format == GEMMA4
               else mistral.read_calls(rest, use.format == MISTRAL_V11, cut)) or []
    names = {tool.name for tool in use.tools}
    calls = [_read_call(record, names) for record in records]
    if not calls or None in calls:
        return Calls(text, ())
    return Calls(text[:start].rstrip() or None, tuple(calls if use.parallel else calls[:1]))


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


class CallStream:
    """One streamed choice's text split into what may be sent as content now and the calls read at its end. Text
    before the first call block streams as it comes, less what it cannot yet tell apart: a tail that may begin a
    block, and trailing whitespace (dropped where a block follows, as :func:`read_calls` drops it). The rest waits for
    the end, where :func:`read_calls` reads it, so that the content streamed equals the content of the whole answer.
    In Llama 3's format an answer is its calls or text: one that begins with ``{`` waits for its end, any other
    streams as it comes."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.text = ""  # everything received
        self.sent = ""  # content sent so far: a prefix of the text before the first block
        self.in_calls = False

    def feed(self, text: str) -> str:
        """The content ``text`` lets through now."""
        self.text += text
        if self.in_calls:
            return ""
        if self.use.format == LLAMA3_JSON:
            return self._feed_json()
        opening = OPENINGS[self.use.format]
        start = self.text.find(opening)
        if start >= 0:
            self.in_calls = True
            ready = self.text[:start].rstrip()
        else:
            ready = self.text[:len(self.text) - partial_tail(self.text, opening)].rstrip()
        out = ready[len(self.sent):] if len(ready) > len(self.sent) else ""
        self.sent += out
        return out

    def _feed_json(self) -> str:
        """Llama 3's format: an answer that begins with ``{`` (or the python tag) may be calls, and waits for its end;
        any other streams whole once its first character that is not whitespace shows which it is."""
        begun = self.text.lstrip()
        if not begun or (PYTHON_TAG.startswith(begun) and len(begun) < len(PYTHON_TAG)):
            return ""
        if begun.startswith(("{", PYTHON_TAG)):
            self.in_calls = True
            return ""
        out = self.text[len(self.sent):]
        self.sent = self.text
        return out

    def finish(self, cut: bool = False) -> tuple[str, tuple[dict, ...]]:
        """At the end of the answer (``cut``: by its length): the content still to send, and the calls."""
        read = read_calls(self.text, self.use, cut)
        whole = read.content or "" if read.calls else read.content
        assert whole.startswith(self.sent), "sent content that the whole answer does not begin with"
        return whole[len(self.sent):], read.calls
