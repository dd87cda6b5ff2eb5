"""Qwen3-Coder's and Qwen3.5's tool-call format (``qwen3_coder``, server/tools.py): a call inside ``<tool_call>`` tags
is XML, its values bare text on lines of their own::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The templates write a value with ``tojson`` where it is an object or a list and as Python's ``str`` otherwise (so a
boolean is ``True``, a null ``None``). This module reads a call back (:func:`read_call`), types its values by the
tool's schema (:func:`typed_arguments`), and writes the grammar that holds a call to that schema
(:func:`call_rules`). A property's schema decides: where every type it takes but null is a string (or it names
none), its value is text; else the JSON it spells, Python's spellings of booleans and null read as those.
"""

from __future__ import annotations

import json

from jointspec.core.grammar import JSON_STYLE
from jointspec.server.tool_schemas import json_kinds, listed_values, property_schema
from jointspec.server.tool_text import other_key, skip_space

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
# Python's spellings that the templates write for JSON's true, false and null.
PYTHON_CONSTANTS = {"True": True, "False": False, "None": None}
# What ends a value whose closing tag is missing: the next parameter, or the function's end, on a line of its own.
UNCLOSED = ("\n" + PARAMETER_OPEN, "\n" + FUNCTION_CLOSE)
# The grammar's text values: anything without a parameter's closing tag or what :data:`UNCLOSED` reads as its end,
# the tag with it as one lexeme (a lexer cannot end a lexeme it has already extended past the tag's start).
VALUE_RULES = ['VALUE: TEXTVALUE "\\n</parameter>"',
               r"TEXTVALUE: /(?s:.*)/ & ~/(?s:.*(<\/parameter>|\n<parameter=|\n<\/function>).*)/"]


# -- reading ------------------------------------------------------------------------------------------------------

def read_call(text: str, at: int) -> tuple[dict, int]:
    """The call at ``at`` (``<function=NAME>``, its parameters, ``</function>``) as ``{"name", "arguments"}``, each
    value as text less one newline at either end (as the templates write them), and where it ends. A parameter's
    value ends at a closing tag that a parameter or the function's end follows (so a value may hold the tag's text),
    or, where its closing tag is missing, at the next parameter or the function's end on a line of its own; a
    parameter written twice keeps its last value (as vLLM's reader does). ValueError where it does not read so."""
    if not text.startswith(FUNCTION_OPEN, at):
        raise ValueError("not a function")
    name, at = _tag_name(text, at, FUNCTION_OPEN)
    arguments: dict[str, str] = {}
    while True:
        at = skip_space(text, at)
        if text.startswith(FUNCTION_CLOSE, at):
            return {"name": name, "arguments": arguments}, at + len(FUNCTION_CLOSE)
        if not text.startswith(PARAMETER_OPEN, at):
            raise ValueError("not a parameter")
        key, at = _tag_name(text, at, PARAMETER_OPEN)
        end, after = _value_end(text, at)
        value = text[at:end]
        value = value[1:] if value.startswith("\n") else value
        arguments[key] = value[:-1] if value.endswith("\n") else value
        at = after


def _tag_name(text: str, at: int, opening: str) -> tuple[str, int]:
    close = text.find(">", at)
    name = text[at + len(opening):close]
    if close < 0 or not name.strip() or "\n" in name or "<" in name:
        raise ValueError("not a tag")
    return name.strip(), close + 1


def _value_end(text: str, at: int) -> tuple[int, int]:
    """Where the value that starts at ``at`` ends, and where reading goes on after it: at its closing tag, or, where
    the next parameter or the function's end comes first on a line of its own, there (its closing tag missing)."""
    unclosed = [found for found in (text.find(start, at) for start in UNCLOSED) if found >= 0]
    close = text.find(PARAMETER_CLOSE, at)
    while close >= 0 and not (unclosed and min(unclosed) < close):
        after = close + len(PARAMETER_CLOSE)
        if text.startswith((PARAMETER_OPEN, FUNCTION_CLOSE), skip_space(text, after)):
            return close, after
        close = text.find(PARAMETER_CLOSE, after)
    if not unclosed:
        raise ValueError("an unended value")
    return min(unclosed), min(unclosed)


def typed_arguments(arguments: dict[str, str], schema: dict) -> dict:
    """A call's text values typed by its arguments' ``schema`` (:func:`typed_value`); a parameter the schema does not
    name stays text."""
    properties = schema.get("properties") or {}
    return {key: typed_value(raw, property_schema(properties[key], schema) if key in properties else None)
            for key, raw in arguments.items()}


def typed_value(raw: str, prop: dict | None):
    """``raw`` as the value ``prop`` (a property's schema, references followed) takes: text where every type it
    takes but null is a string, or where it names none (``None``: an unknown parameter); null for ``null`` or
    ``None`` where it takes null; else the JSON ``raw`` spells (Python's ``True``, ``False`` and ``None`` read as
    JSON's), or, where ``raw`` spells none, the text itself (the call is read as written, not validated)."""
    kinds = json_kinds(prop) if prop is not None else None
    if kinds is not None and "null" in kinds and raw.strip() in ("null", "None"):
        return None
    if takes_text(kinds):
        return raw
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except ValueError:
        return PYTHON_CONSTANTS.get(raw.strip(), raw)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # (NaN and Infinity: json.loads takes them, JSON does not)


def text_choices(prop: dict, kinds: frozenset[str] | None, nulls: tuple[str, ...]) -> list[str]:
    """The grammar's literals of a text value held to an enum's (or a const's) strings, with ``nulls`` (how the
    format's template writes a null) where it takes null; empty where it is held to none."""
    choices = [json.dumps(value) for value in listed_values(prop) or () if isinstance(value, str)]
    return choices + [json.dumps(null) for null in nulls] if choices and "null" in (kinds or ()) else choices


def takes_text(kinds: frozenset[str] | None) -> bool:
    """Whether a value of these types is written as bare text: every type but null a string, or no type said."""
    return kinds is None or kinds - {"null"} == {"string"}


# -- the grammar ----------------------------------------------------------------------------------------------

def call_rules(name: str, schema: dict | None, index: int) -> list[str]:
    """The grammar of a call of function ``name`` as the templates write one: ``<function=NAME>``, then each
    parameter as ``<parameter=KEY>``, its value and ``</parameter>`` on lines of their own, in the order of the
    schema's properties (the required ones always, the others where the model writes them; any other parameters after
    them, text, where the schema allows more: none of its own properties again), then ``</function>``. A value is
    text where it is (:func:`takes_text`; an enum's strings: one of them), else JSON its schema accepts, or Python's
    spelling of a boolean or null where it takes one. ``schema`` None: any parameters, text (strict auto's other
    tools). Add :data:`VALUE_RULES` once."""
    closed = json.dumps(f"\n{PARAMETER_CLOSE}\n")

    def spell(rule: str, key: str, prop: dict, kinds: frozenset[str] | None) -> list[str]:
        opened = json.dumps(f"{PARAMETER_OPEN}{key}>\n")
        if takes_text(kinds):
            choices = text_choices(prop, kinds, ("None", "null"))
            return [f"{rule}: {opened} ({' | '.join(choices)}) {closed}" if choices
                    else f'{rule}: {opened} VALUE "\\n"']
        spelled = (['"True"', '"False"'] if "boolean" in (kinds or ()) else []) + (
            ['"None"'] if "null" in (kinds or ()) else [])
        held = json.dumps({**prop, "x-guidance": dict(JSON_STYLE)})
        return [f"{rule}: {opened} {rule}v {closed}", f"{rule}v: {' | '.join([f'%json {held}', *spelled])}"]

    return keyed_call_rules(index, schema, json.dumps(f"{FUNCTION_OPEN}{name}>\n"), json.dumps(FUNCTION_CLOSE), "p",
                            spell, f'{json.dumps(PARAMETER_OPEN)} OTHERKEY{index} ">\\n" VALUE "\\n"',
                            f"OTHERKEY{index}")


def keyed_call_rules(index: int, schema: dict | None, head: str, tail: str, prefix: str, spell, other: str,
                     key_lexeme: str) -> list[str]:
    """The grammar of a call whose arguments are written key by key (Qwen3-Coder's, GLM's): rule ``call{index}``,
    ``head``, each of the schema's properties in its order as ``spell(rule, key, property, types)`` writes it (its
    rules, the first named ``rule``; the required ones always, the others optional), then any other keys, each as
    ``other`` spells one with the key lexeme ``key_lexeme`` (none of the schema's own), where the schema allows more,
    then ``tail``. ``schema`` None: any keys."""
    other_rules = [f"other{index}: {other}"]
    if schema is None:
        return [f"call{index}: {head} other{index}* {tail}", *other_rules, other_key(key_lexeme, ())]
    required = set(schema.get("required") or ())
    parts, rules = [], []
    for number, (key, prop) in enumerate((schema.get("properties") or {}).items()):
        rule = f"{prefix}{index}_{number}"
        prop = property_schema(prop, schema)
        rules += spell(rule, key, prop, json_kinds(prop))
        parts.append(rule if key in required else f"{rule}?")
    if schema.get("additionalProperties", True) is not False:
        parts.append(f"other{index}*")
        rules += [*other_rules, other_key(key_lexeme, (schema.get("properties") or {}).keys())]
    return [f"call{index}: {head} {' '.join(parts)} {tail}", *rules]
