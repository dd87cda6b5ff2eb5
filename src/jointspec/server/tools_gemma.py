"""Gemma 4's tool-call format (``gemma4``, server/tools.py): calls one after another after any text, each in its
markers, its arguments written the way Gemma's templates write values, not JSON::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>

Keys are bare (the templates write them in sorted order), strings sit between ``<|"|>`` markers, objects and lists
are written as JSON's but for those two, booleans as JSON's, numbers and null as Python writes them (``None``).
The three markers are special tokens in Gemma's tokenizer: an answer read for calls keeps them in its text
(server/tools.py, ``call_markers``), and a grammar names them by id.

:func:`read_calls` reads the calls back; :func:`call_rules` writes the grammar that holds a call to its tool's schema.
"""

from __future__ import annotations

import json
import re

from jointspec.server.tool_schemas import ValueRules
from jointspec.server.tool_text import marker, skip_space, start_rules

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
MARKERS = (CALL_OPEN, CALL_CLOSE, QUOTE)
CALL_PREFIX = "call:"
# A function's name as vLLM's reader takes it; a bare key (up to its colon, as vLLM's reader takes one; the grammar's
# keys hold no surrounding space).
_CALL_NAME = re.compile(r"[\w\-.]+")
_KEY = re.compile(r"[^:{}\[\],\n]+")
# A number as Python writes one, and as float() reads one (.5, 1., 1e-05).
_NUMBER = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
# Bare words for true and false, and (any case) for null: the templates write Python's None; vLLM's reader takes these.
BARE = {"true": True, "false": False}
NULLS = ("null", "none", "nil")


# -- reading ------------------------------------------------------------------------------------------------------

def read_calls(text: str, cut: bool) -> list[dict] | None:
    """``text`` from just after the first call marker: the calls as ``{"name", "arguments"}``, or None where a call
    does not read so. Text between calls and after the last is passed over, as vLLM's reader passes it (a model may go
    on after its calls: the result's marker, where it does not end the answer). ``cut``: the answer ran out of
    tokens, so a call it left unfinished is dropped and the calls before it stand."""
    calls, at = [], 0
    while True:
        try:
            call, at = _call(text, at)
        except ValueError:
            return calls if cut and calls else None
        calls.append(call)
        at = text.find(CALL_OPEN, at)
        if at < 0:
            return calls
        at += len(CALL_OPEN)


def _call(text: str, at: int) -> tuple[dict, int]:
    """``call:NAME{...}<tool_call|>`` at ``at``: the call, and where it ends."""
    at = skip_space(text, at)
    if not text.startswith(CALL_PREFIX, at):
        raise ValueError("not a call")
    name = _CALL_NAME.match(text, at + len(CALL_PREFIX))
    if name is None:
        raise ValueError("no function name")
    arguments, at = _object(text, name.end())
    at = skip_space(text, at)
    if not text.startswith(CALL_CLOSE, at):
        raise ValueError("an unclosed call")
    return {"name": name.group(), "arguments": arguments}, at + len(CALL_CLOSE)


def _object(text: str, at: int) -> tuple[dict, int]:
    if not text.startswith("{", at):
        raise ValueError("not an object")
    values, at = {}, skip_space(text, at + 1)
    if text.startswith("}", at):
        return values, at + 1
    while True:
        if text.startswith(QUOTE, at):
            key, at = _string(text, at)
        else:
            bare = _KEY.match(text, at)
            if bare is None or not bare.group().strip():
                raise ValueError("no key")
            key, at = bare.group().strip(), bare.end()
        at = skip_space(text, at)
        if not text.startswith(":", at):
            raise ValueError("no colon")
        values[key], at = _value(text, at + 1)
        ended, at = _after_item(text, at, "}")
        if ended:
            return values, at


def _array(text: str, at: int) -> tuple[list, int]:
    items, at = [], skip_space(text, at + 1)
    if text.startswith("]", at):
        return items, at + 1
    while True:
        item, at = _value(text, at)
        items.append(item)
        ended, at = _after_item(text, at, "]")
        if ended:
            return items, at


def _after_item(text: str, at: int, close: str) -> tuple[bool, int]:
    """After an object's pair or a list's item: whether ``close`` ends the object or list there (a trailing comma
    before it allowed, as vLLM's reader takes one), and where reading goes on."""
    at = skip_space(text, at)
    if text.startswith(close, at):
        return True, at + 1
    if not text.startswith(",", at):
        raise ValueError("no comma")
    at = skip_space(text, at + 1)
    if text.startswith(close, at):
        return True, at + 1
    return False, at


def _string(text: str, at: int) -> tuple[str, int]:
    end = text.find(QUOTE, at + len(QUOTE))
    if end < 0:
        raise ValueError("an unended string")
    return text[at + len(QUOTE):end], end + len(QUOTE)


def _value(text: str, at: int):
    at = skip_space(text, at)
    if text.startswith(QUOTE, at):
        return _string(text, at)
    if text.startswith("{", at):
        return _object(text, at)
    if text.startswith("[", at):
        return _array(text, at)
    end = at
    while end < len(text) and text[end] not in ",}]" and not text.startswith(QUOTE, end):
        end += 1
    word = text[at:end].strip()
    if not word:
        raise ValueError("no value")
    if word in BARE:
        return BARE[word], end
    if word.lower() in NULLS:
        return None, end
    if _NUMBER.fullmatch(word):
        return (float(word) if any(c in word for c in ".eE") else int(word)), end
    return word, end  # (a bare word: text, as vLLM's reader takes it)


# -- the grammar ----------------------------------------------------------------------------------------------

class _Rules(ValueRules):
    """The grammar of one tool's calls in Gemma's syntax: strings between its quote markers, keys bare and in the
    templates' order (Jinja's ``dictsort``: by key, case ignored), a comma between two items."""

    prefix, separator, any_value = "g", '","', "gvalue"

    def __init__(self, index: int, marks: dict[str, str], root: dict) -> None:
        super().__init__(index, root)
        self.marks = marks

    def string(self, literal: str | None = None) -> str:
        quote = self.marks["quote"]
        if literal is not None:
            return f"{quote} {json.dumps(literal)} {quote}" if quote.startswith("<[") else json.dumps(
                QUOTE + literal + QUOTE)
        return f"{quote} STRTEXT? {quote}" if quote.startswith("<[") else "QSTRING"

    def lists(self, values: list) -> bool:
        return not any(isinstance(value, dict | list) for value in values)  # (else any value, as written)

    def ordered(self, properties: dict) -> list[tuple[str, dict]]:
        return sorted(properties.items(), key=lambda item: item[0].lower())

    def simple(self, kind) -> str | None:
        if kind == "string":
            return self.string()
        return {"integer": "INT", "number": "NUMBER", "boolean": '("true" | "false")',
                "null": '("None" | "null")'}.get(kind)

    def literal(self, value) -> str:
        if isinstance(value, str):
            return self.string(value)
        if value is None:
            return '"None"'
        return json.dumps(json.dumps(value))

    def pair(self, key: str, prop: dict) -> str:
        return f"{json.dumps(key + ':')} {self.value(prop)}"


def call_rules(name: str, schema: dict | None, index: int, marks: dict[str, str]) -> list[str]:
    """The grammar of a call of function ``name`` after its opening marker: ``call:NAME{``, its arguments as
    :class:`_Rules` holds them to ``schema`` (None: any arguments, strict auto's other tools), ``}`` and the closing
    marker (``marks``: each marker's grammar element: ``open``, ``close``, ``quote``). Add :func:`shared_rules`
    once."""
    rules = _Rules(index, marks, schema or {})
    head = json.dumps(f"{CALL_PREFIX}{name}{{")
    if schema is None or not schema.get("properties"):
        arguments = '(gpair ("," gpair)*)?' if schema is None or schema.get("additionalProperties", True) is not \
            False else ""
    else:
        arguments = rules.pairs(schema)
    body = f'{head} {arguments} "}}" {marks["close"]}'.replace("  ", " ")
    return [f"call{index}: {body}", *rules.rules]


def shared_rules(marks: dict[str, str]) -> list[str]:
    """What every tool's call rules use: numbers, strings, and any value (a key, and a value its schema leaves
    open)."""
    quote = marks["quote"]
    rules = ["INT: /-?(0|[1-9][0-9]*)/", r"NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/",
             r'STRTEXT: /(?s:.+)/ & ~/(?s:.*<\|"\|>.*)/',
             f"GKEY: /{_KEY.pattern}/",
             'gvalue: gstring | NUMBER | "true" | "false" | "None" | "null" | "{" (gpair ("," gpair)*)? "}" | '
             '"[" (gvalue ("," gvalue)*)? "]"',
             'gpair: GKEY ":" gvalue']
    if quote.startswith("<["):
        rules.append(f"gstring: {quote} STRTEXT? {quote}")
    else:  # (a marker that is text: the string and its markers one lexeme)
        rules += ["gstring: QSTRING", f"QSTRING: {json.dumps(QUOTE)} STRTEXT? {json.dumps(QUOTE)}"]
    return rules


def unwritable_key(schema, depth: int = 0) -> str | None:
    """A property name, at any depth of the schema, that the format cannot write as a bare key (one with a colon, a
    bracket, a comma, a line break or space around it), or None."""
    if depth > 32:
        return None
    if isinstance(schema, list):
        return next((key for item in schema if (key := unwritable_key(item, depth + 1)) is not None), None)
    if not isinstance(schema, dict):
        return None
    for key in schema.get("properties") or {} if isinstance(schema.get("properties"), dict) else {}:
        if not _KEY.fullmatch(key) or key != key.strip():
            return key
    return next((key for name, value in schema.items() if name != "enum" and name != "const"
                 and (key := unwritable_key(value, depth + 1)) is not None), None)




def grammar(calls: list[tuple[str, dict | None]], several: bool, strict_auto: bool, ids: dict[str, int]) -> str:
    """The lark grammar of an answer of ``calls`` (each a function's name and its arguments' schema, None: any
    arguments), one after another, each after its opening marker. ``several``: more than one call; ``strict_auto``:
    any text that does not spell the opening marker first, then such calls or nothing (else the calls alone);
    ``ids``: the markers that are added tokens, named by id (server/tool_text.py)."""
    marks = {role: marker(spelling, ids) for role, spelling in zip(("open", "close", "quote"), MARKERS, strict=True)}
    rules = [rule for index, (name, schema) in enumerate(calls) for rule in call_rules(name, schema, index, marks)]
    either = " | ".join(f"call{index}" for index in range(len(calls)))
    following = f"({either})" + (" call*" if several else "")
    return "\n".join([*start_rules(CALL_OPEN, ids, following, strict_auto), f"call: {marks['open']} ({either})",
                      *rules, *shared_rules(marks)]) + "\n"
