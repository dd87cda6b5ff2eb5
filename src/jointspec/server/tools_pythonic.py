"""LiquidAI LFM2's tool-call format (``lfm2``, server/call_formats.py): the calls as one Python list of calls with
keyword arguments, between two special tokens, after any text (and before any more)::

    <|tool_call_start|>[get_weather(city="Paris"), add(a=1, b=[2, 3])]<|tool_call_end|>

Values are Python literals (strings quoted either way, ``True``, ``False``, ``None``, lists and dicts). The calls are
read as vLLM's ``lfm2`` parser reads them, with Python's own parser (never evaluated): a list of calls of plain names
with keyword arguments whose values are literals, else nothing is taken for a call. JSON's ``true``, ``false`` and
``null``, which a model trained on both writes at times, are read as Python's (as llama.cpp reads LFM2's calls).
:func:`grammar` holds required and strict calls to their schemas, each value spelled as a Python literal of its type.
"""

from __future__ import annotations

import ast
import json
import keyword
import math

from jointspec.server.tool_schemas import ValueRules
from jointspec.server.tool_text import marker, start_rules

CALL_START, CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
MARKERS = (CALL_START, CALL_END)


def read_calls(body: str, cut: bool) -> tuple[list[dict] | None, str]:
    """What follows the first ``<|tool_call_start|>``: the call records (``{"name", "arguments"}``) of the list up to
    ``<|tool_call_end|>`` (a model that ends the answer without the marker may leave it out), or None where it does not
    read so; and the text after the end marker (LFM2 may say what it does after its calls). ``cut``: the answer ran
    out of tokens, so the calls before the one it left unfinished stand."""
    end = body.find(CALL_END)
    segment, after = (body[:end], body[end + len(CALL_END):]) if end >= 0 else (body, "")
    calls = _calls(segment)
    if calls is None and cut and end < 0:  # (the longest run of whole calls, the list closed after it)
        calls = next((found for at in reversed(_call_ends(segment)) if (found := _calls(segment[:at + 1] + "]"))),
                     None)
    return calls, after


def _call_ends(segment: str) -> list[int]:
    """Where the list's calls end: each ``)`` that closes a bracket opened inside the list, outside strings (one pass:
    a cut answer is tried at these places alone)."""
    ends, depth, quote, escaped = [], 0, "", False
    for at, char in enumerate(segment):
        if quote:
            escaped, quote = (False, quote) if escaped else (char == "\\", "" if char == quote else quote)
        elif char in "\"'":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
            if char == ")" and depth == 1:
                ends.append(at)
    return ends


def _calls(segment: str) -> list[dict] | None:
    try:
        tree = ast.parse(segment.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        names = [argument.arg for argument in node.keywords] if isinstance(node, ast.Call) else []
        # (a call with a positional argument, **, a name given twice, which Python refuses, or of no plain name)
        if (not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name) or None in names
                or len(set(names)) != len(names)):
            return None
        try:
            arguments = {argument.arg: _json_value(ast.literal_eval(_JsonNames().visit(argument.value)))
                         for argument in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        calls.append({"name": node.func.id, "arguments": arguments})
    return calls


class _JsonNames(ast.NodeTransformer):
    """JSON's ``true``, ``false`` and ``null`` in a value as the constants Python spells otherwise (any other name
    stays a name, which no literal takes)."""

    CONSTANTS = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.CONSTANTS:
            return ast.copy_location(ast.Constant(self.CONSTANTS[node.id]), node)
        return node


def _json_value(value, depth: int = 0):
    """A literal as JSON's value (a tuple as a list); ValueError for what JSON has not (complex numbers, sets, bytes,
    infinities, keys that are not strings)."""
    if depth > 64:
        raise ValueError("nested too deep")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, list | tuple):
        return [_json_value(item, depth + 1) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_value(item, depth + 1) for key, item in value.items()}
    raise ValueError(f"{type(value).__name__} is no JSON value")


def python_literal(value) -> str:
    """``value`` (JSON's) as a Python literal: strings as JSON writes them (Python reads them alike), ``True``,
    ``False``, ``None``, lists and dicts of such."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(key))}: {python_literal(item)}" for key, item in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def write(calls: list[dict]) -> str:
    """Call records (name, arguments as an object) as the model writes them."""
    written = [f"{call['name']}(" + ", ".join(f"{key}={python_literal(value)}" for key, value in (
        call["arguments"] if isinstance(call["arguments"], dict) else {}).items()) + ")" for call in calls]
    return f"{CALL_START}[{', '.join(written)}]{CALL_END}"


def writable_name(name: str) -> bool:
    """Whether a function's name can be written as a call (a Python identifier, not a keyword)."""
    return name.isidentifier() and not keyword.iskeyword(name)


def unwritable_key(schema: dict) -> str | None:
    """A parameter name that is no Python keyword argument (not an identifier, or a keyword), or None."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return next((key for key in properties if not writable_name(key)), None)


# -- the grammar ---------------------------------------------------------------------------------------------------

class _Rules(ValueRules):
    """The grammar of one tool's calls, each value spelled as a Python literal, an object's properties in its order."""

    prefix, any_value = "p", "pyvalue"

    def simple(self, kind) -> str | None:
        return {"string": "PYSTRING", "integer": "INT", "number": "NUMBER", "boolean": '("True" | "False")',
                "null": '"None"'}.get(kind)

    def literal(self, value) -> str:
        return json.dumps(python_literal(value))

    def pair(self, key: str, prop: dict) -> str:
        return f"{json.dumps(json.dumps(key) + ': ')} {self.value(prop)}"


def call_rules(name: str, schema: dict | None, index: int) -> list[str]:
    """The grammar of a call of function ``name`` (rule ``call{index}``): ``NAME(``, its keyword arguments held to
    ``schema`` (in its properties' order, the required ones always; None: any arguments), ``)``."""
    rules = _Rules(index, schema or {})
    if schema is None:
        arguments = '(PYKEY "=" pyvalue (", " PYKEY "=" pyvalue)*)?'
    elif not isinstance(schema.get("properties"), dict) or not schema["properties"]:
        arguments = ""
    else:
        pairs = {key: f"{json.dumps(key + '=')} {rules.value(prop)}" for key, prop in schema["properties"].items()}
        arguments = rules.sequence(pairs, set(schema.get("required") or ()))
    return [f'call{index}: {json.dumps(name + "(")} {arguments} ")"'.replace("  ", " "), *rules.rules]


SHARED_RULES = [
    "INT: /-?(0|[1-9][0-9]*)/",
    r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    # (Python's string literals, either quote, with the escapes JSON's strings have but \/; no line break, CR or NUL)
    r'''PYSTRING: /"([^"\\\n\r\x00]|\\[\\"'nrtbf]|\\u[0-9a-fA-F]{4})*"/'''
    r'''    | /'([^'\\\n\r\x00]|\\[\\"'nrtbf]|\\u[0-9a-fA-F]{4})*'/''',
    # (a name, not one of Python's keywords, which its parser refuses as an argument's name)
    "PYKEY: /[A-Za-z_][A-Za-z0-9_]*/ & ~/(" + "|".join(keyword.kwlist) + ")/",
    'pyvalue: PYSTRING | NUMBER | "True" | "False" | "None" | "[" (pyvalue (", " pyvalue)*)? "]" '
    '| "{" (PYSTRING ": " pyvalue (", " PYSTRING ": " pyvalue)*)? "}"',
]


def grammar(calls: list[tuple[str, dict | None]], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
    """The lark grammar of an answer of ``calls`` (each a function's name and its arguments' schema, None: any
    arguments): the start marker, a list of one call (``several``: one or more) and the end marker. ``strict_auto``:
    any text that does not spell the start marker first, then such calls or nothing (else the calls alone); ``ids``:
    the markers that are added tokens, named by id (server/tool_text.py)."""
    rules = [rule for index, (name, schema) in enumerate(calls) for rule in call_rules(name, schema, index)]
    either = "(" + " | ".join(f"call{index}" for index in range(len(calls))) + ")"
    following = f'"[" {either}' + (f' (", " {either})*' if several else "") + f' "]" {marker(CALL_END, ids)}'
    return "\n".join([*start_rules(CALL_START, ids, following, strict_auto), *rules, *SHARED_RULES]) + "\n"
