"""OpenAI tool calling for the server: the tools a request offers, the prompt that shows them, the calls read back.

Calls are read in one of thirteen formats, the one the model's chat template writes (:func:`native_call_format`),
else Hermes's (each format's reader and grammar is a class of server/call_formats.py). Hermes's, the one Qwen2.5 and
Qwen3, the Hermes models and many small instruction-tuned models were trained on: each call a block of its own,
parallel calls one block after another::

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
``<|"|>`` markers, read and held likewise (server/tools_gemma.py). Granite 3's (``granite``; the template names
``<|tool_call|>`` and ``<|start_of_role|>``) writes ``<|tool_call|>`` and one JSON list of the calls, as Mistral's v3.
LFM2's (``lfm2``; the template lists the tools after ``List of tools: ``) writes one Python list of calls between
``<|tool_call_start|>`` and ``<|tool_call_end|>`` (server/tools_pythonic.py). NVIDIA Nemotron Nano 2's
(``nemotron``; the template names ``<TOOLCALL>`` and ``</TOOLCALL>``) writes one JSON list of the calls between
those markers, as Mistral's v3 writes its list. Apertus's (``apertus``; the template names ``<|tools_prefix|>``)
writes one JSON list between ``<|tools_prefix|>`` and ``<|tools_suffix|>`` whose items name the function as their
one key: ``{"get_weather": {"city": "Paris"}}``. ServiceNow Apriel 1.5's (``apriel``; the template writes calls as
``<tool_calls>[`` ... ``]</tool_calls>``) writes one JSON list between those markers, as Nemotron's. GLM-4.5-4.7's
(``glm``; the template names ``<arg_key>`` besides ``<tool_call>``) writes the function's name inside the tags and each
argument as ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``, a string as it is and any other value as JSON
(server/tools_glm.py). gpt-oss's Harmony (``harmony``; the template names ``<|channel|>`` and ``<|call|>``) writes a
call as a message addressed ``to=functions.NAME``, its arguments JSON, read after the answer's messages are split
(server/harmony.py); its grammar holds the whole answer, the analysis message before the call included.

A template that renders the tools but drops an assistant's earlier calls (Granite 3's, SmolLM3's;
:func:`template_shows_calls`) is given them after the turn's text, in the format as the model wrote them. SmolLM3's
first template reads the tools from ``xml_tools``, not ``tools`` (:func:`template_tools_variable`): it is given them
there, each as its function's JSON, which it lists between ``<tools>`` tags as its model card's example does.

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
from dataclasses import dataclass

from jointspec.backends.tokens import TEMPLATE_TAIL
from jointspec.core.grammar import GrammarError, OutputFormat, one_line
from jointspec.server import harmony
from jointspec.server import tools_gemma as gemma
from jointspec.server import tools_glm as glm
from jointspec.server import tools_mistral as mistral
from jointspec.server.call_formats import (
    APERTUS,
    APRIEL,
    CALL_CLOSE,
    CALL_FORMATS,
    CALL_OPEN,
    FORMATS,
    GEMMA4,
    GLM,
    GRANITE,
    GRANITE_CALL,
    HARMONY_CALLS,
    HERMES,
    LFM2,
    LLAMA3_JSON,
    MISTRAL_V3,
    MISTRAL_V11,
    NEMOTRON,
    PYTHON_TAG,
    QWEN3_CODER,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOLCALL_CLOSE,
    TOOLCALL_OPEN,
    TOOLS_PREFIX,
    TOOLS_SUFFIX,
    CallFormat,
    Calls,
    Held,
    Tool,
    call_record,
)
from jointspec.server.tool_text import partial_tail
from jointspec.server.tools_xml import FUNCTION_OPEN, PARAMETER_OPEN

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A request's tools, tool choice or tool messages that cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
        """The grammar the answer follows, or None where it is free text. ``required``: one call of an allowed tool, or
        with ``parallel`` one or more, each one's arguments held to its schema. ``auto`` where a tool is ``strict``
        (OpenAI's promise that a strict function's arguments match its schema): text that does not begin a call, then
        such calls or nothing (Llama 3's: the text or the calls), a strict function's arguments held to its schema and
        the others' any object. Each format writes its own grammar (server/call_formats.py)."""
        strict_auto = self.choice == "auto" and any(tool.strict for tool in self.tools)
        if self.choice != "required" and not strict_auto:
            return None
        allowed = [tool for tool in self.tools if self.function in (None, tool.name)]
        several = self.parallel and self.function is None
        # (strict, as OpenAI reads it, is a function's own: in auto, the others' arguments are anything)
        calls = [Held(tool.name, tool.arguments_schema() if tool.strict or not strict_auto else None)
                 for tool in allowed]
        return OutputFormat("lark", self.call_format.grammar(calls, several, strict_auto, dict(self.special)))

    @property
    def call_format(self) -> CallFormat:
        return CALL_FORMATS[self.format]


def read_tool_use(tools: list | None, tool_choice, parallel_tool_calls, *, functions: list | None = None,
                  function_call=None, call_format: str = HERMES,
                  special: tuple[tuple[str, int], ...] = ()) -> ToolUse | None:
    """A chat request's ``tools`` and ``tool_choice`` (or the deprecated ``functions`` and ``function_call``) as a
    :class:`ToolUse` whose calls the model writes in ``call_format`` (:func:`native_call_format`, else Hermes's),
    ``special`` being its markers that are tokens of the model's tokenizer (:func:`call_markers`); None where it offers
    no tools. ToolError names the field at fault."""
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
                if not use.call_format.writes_name(tool.name):
                    raise ToolError(f"{param}.{index}.function.name: the model's call format ({call_format}) cannot "
                                    f"write a function named {json.dumps(tool.name)}", f"{param}.{index}.function.name")
                key = use.call_format.unwritable_key(tool.arguments_schema())
                if key is not None:
                    raise ToolError(f"{where}: the model's call format ({call_format}) cannot write a parameter "
                                    f"named {json.dumps(key)}", where)
                try:
                    use.call_format.arguments_format(tool).check()
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

def chat_template_text(tokenizer) -> str | None:
    """The tokenizer's chat template (of several named ones, its ``tool_use`` one, which transformers renders where
    tools are given), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else None


def template_tools_variable(template: str | None) -> str:
    """The variable a chat template reads the offered tools from: ``tools`` (transformers' argument), or
    ``xml_tools`` where the template reads that and not ``tools`` (SmolLM3's first template, which also reads
    ``python_tools``, its own code-tools mode, not OpenAI's)."""
    import jinja2
    import jinja2.meta

    if not template:
        return "tools"
    # transformers' own tag ({% generation %}, around an assistant's text) is no syntax plain jinja2 reads.
    plain = re.sub(r"{%-?\s*(?:end)?generation\s*-?%}", "", template)
    try:
        names = jinja2.meta.find_undeclared_variables(
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(plain))
    except jinja2.TemplateError:  # (a template jinja2 cannot read: transformers will say so when it renders it)
        return "tools"
    return "xml_tools" if "xml_tools" in names and "tools" not in names else "tools"


def xml_tools(tools: list[dict]) -> list[str]:
    """The offered tools (OpenAI's form) as SmolLM3's first template takes them in ``xml_tools``: each function (its
    name, description and parameters) as JSON text, which the template writes as it is."""
    return [json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools]


def native_call_format(tokenizer) -> str | None:
    """The call format the tokenizer's chat template renders tools and calls in itself (:data:`FORMATS`), or None
    where it renders them in none of them (of a tokenizer with several named templates, its ``tool_use`` one, which
    transformers renders where tools are given)."""
    template = chat_template_text(tokenizer)
    if template is None or "tools" not in template:
        return None
    if harmony.CHANNEL in template and harmony.CALL in template:  # (gpt-oss's: calls are messages to functions)
        return HARMONY_CALLS
    if TOOL_CALLS_OPEN + "[" in template and "]" + TOOL_CALLS_CLOSE in template:  # (its instructions name <tool_call>)
        return APRIEL
    if CALL_OPEN in template and glm.KEY_OPEN in template:  # (GLM's name and <arg_key> pairs inside the tags)
        return GLM
    if CALL_OPEN in template:  # (Qwen3-Coder's and Qwen3.5's write <function=...> blocks inside the tags)
        return QWEN3_CODER if FUNCTION_OPEN in template and PARAMETER_OPEN in template else HERMES
    if gemma.CALL_OPEN in template and gemma.CALL_PREFIX in template:
        return GEMMA4
    if GRANITE_CALL in template and "<|start_of_role|>" in template:  # (Granite 4's names <tool_call>: Hermes's)
        return GRANITE
    if "<|tool_list_start|>" in template or "List of tools: " in template:  # (LFM2's, and LFM2.5's)
        return LFM2
    if TOOLCALL_OPEN in template and TOOLCALL_CLOSE in template:
        return NEMOTRON
    if TOOLS_PREFIX in template and TOOLS_SUFFIX in template:
        return APERTUS
    if mistral.TOOL_CALLS in template:  # Mistral's: v11 and later name the arguments' marker
        return MISTRAL_V11 if mistral.ARGS in template else MISTRAL_V3
    # (Llama 4's template writes calls so too, but several a turn, unseparated, after <|python_start|>: not read)
    if '"parameters": ' in template and "ipython" in template and "<|python_start|>" not in template:
        return LLAMA3_JSON
    return None


def call_markers(tokenizer, call_format: str) -> tuple[tuple[str, int], ...]:
    """Of ``call_format``'s markers (Mistral's ``[TOOL_CALLS]`` and ``[ARGS]``, Gemma's ``<|tool_call>``...), those
    that are one added token of ``tokenizer`` (its control tokens), with its id: an answer read for calls keeps them in
    its text (a decode skips those that are special tokens), and a grammar names them by id (a special token has no
    text to match, and llguidance reads some added tokens, such as ``<...>`` ones, as special whatever their flag)."""
    try:
        added = tokenizer.get_added_vocab()
    except (AttributeError, TypeError):  # (a tokenizer that is not transformers')
        return ()
    return tuple((spelling, int(added[spelling])) for spelling in CALL_FORMATS[call_format].markers
                 if spelling in added)


def prompt_messages(messages: list[dict], tools: tuple[dict, ...], native: bool,
                    call_format: str = HERMES, shows_calls: bool = True) -> tuple[list[dict], list | None]:
    """The conversation as the chat template gets it, and the ``tools`` it gets (None: none). ``messages`` are
    OpenAI's, as dicts (assistant messages may hold ``tool_calls``, ``tool`` messages a result); ``native``: the
    template renders tools and calls itself (:func:`native_call_format`), in ``call_format``; ``shows_calls``: it
    renders an assistant's earlier calls (:func:`template_shows_calls`). Where it does not (Granite 3's, SmolLM3's),
    each such turn's calls are written after its text in the format, as the model wrote them
    (backends/tokens.py's TEMPLATE_TAIL)."""
    if native:
        call_writer = CALL_FORMATS[call_format]
        rendered = [_native_message(message, call_format) for message in messages]
        if not shows_calls:
            for index, message in enumerate(messages):
                written = call_writer.write(message["tool_calls"]) if message.get("tool_calls") else None
                if written is not None:
                    gap = call_writer.after_text if message.get("content") else ""
                    rendered[index] = {**rendered[index], TEMPLATE_TAIL: gap + written}
        return call_writer.native_turns(rendered), (list(tools) or None)
    rendered: list[dict] = []
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            text = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if index and messages[index - 1]["role"] == "tool":  # results of one turn's calls: one user turn
                rendered[-1] = {"role": "user", "content": rendered[-1]["content"] + "\n" + text}
            else:
                rendered.append({"role": "user", "content": text})
        elif message.get("tool_calls"):
            blocks = CALL_FORMATS[HERMES].write(message["tool_calls"])
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


# An earlier call, named as no offered tool is, that a template which renders calls writes into the prompt.
_PROBE_CALL = {"id": "call0probe", "type": "function", "function": {"name": "probe_call_7q", "arguments": "{}"}}
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}


def template_shows_calls(tokenizer, call_format: str) -> bool:
    """Whether the tokenizer's chat template, given a conversation in ``call_format`` with an earlier call, writes that
    call into the prompt (Granite 3's and SmolLM3's drop an assistant's calls and keep its text). A template that
    refuses the probe is taken to show them."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]},
             {"role": "tool", "tool_call_id": _PROBE_CALL["id"], "content": "ok"}, {"role": "user", "content": "Go"}]
    messages, tools = prompt_messages(probe, (_PROBE_TOOL,), True, call_format)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             **template_variables(messages, tools, call_format))
    except Exception:  # noqa: BLE001 - any template's own refusal: nothing learned
        return True
    return not isinstance(text, str) or _PROBE_CALL["function"]["name"] in text


def template_variables(messages: list[dict], tools: list | None, call_format: str) -> dict:
    """Variables a native template needs for ``messages`` besides the request's own (``chat_template_kwargs`` win)."""
    return CALL_FORMATS[call_format].template_variables(messages, tools)


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


def _native_message(message: dict, call_format: str = HERMES) -> dict:
    """A message as a template that renders calls itself takes it: calls with their arguments as objects, and (for
    Mistral's templates, which refuse any other where they show ids) call ids of 9 letters and digits."""
    ids = CALL_FORMATS[call_format].message_id
    if message.get("tool_calls"):
        calls = [{"type": "function", "id": ids(call.get("id")), "function": call_record(call)}
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

def read_calls(text: str, use: ToolUse, cut: bool = False) -> Calls:
    """``text`` read as :mod:`this module <jointspec.server.tools>` says, in ``use``'s format: every call of an offered
    tool, or the whole text content. ``cut``: the answer ran out of tokens, so a call it left unfinished (or the
    start of one's opening) is dropped, and the calls before it stand."""
    return use.call_format.read(text, use.tools, use.parallel, cut) if use.reads_calls else Calls(text, ())


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
        opening = self.use.call_format.opening
        if opening is None:
            return self._feed_json()
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


