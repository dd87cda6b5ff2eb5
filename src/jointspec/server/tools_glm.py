"""GLM-4.5-4.7's tool-call format (``glm``, server/tools.py): a call inside ``<tool_call>`` tags is its name, then
each argument as a key and a value in tags of their own::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.6's template puts each part on a line of its own, GLM-4.7's writes them without line breaks; both are read.)
The templates write a string value as it is and any other with ``tojson``, so a value is typed by the tool's schema
as Qwen3-Coder's are (server/tools_xml.py's :func:`typed_arguments`). This module reads a call back
(:func:`read_call`) and writes the grammar that holds a call to its schema (:func:`call_rules`).
"""

from __future__ import annotations

import json

from jointspec.core.grammar import JSON_STYLE
from jointspec.server.tool_text import marker, skip_space, text_without
from jointspec.server.tools_xml import keyed_call_rules, takes_text, text_choices

CALL_CLOSE = "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
# (added tokens of GLM's tokenizers, named by id where they are)
MARKERS = (KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE)


def read_call(text: str, at: int) -> tuple[dict, int]:
    """The call at ``at`` (after ``<tool_call>``: a name, then key and value pairs) as ``{"name", "arguments"}``, its
    values as text, and where it ends (at the block's closing tag, not read). A key written twice keeps its last
    value. ValueError where it does not read so."""
    ends = [found for found in (text.find(KEY_OPEN, at), text.find(CALL_CLOSE, at)) if found >= 0]
    if not ends:
        raise ValueError("an unended call")
    # (a name that is no offered tool's makes the whole answer text, as any block that does not read)
    name = text[at:min(ends)].strip()
    at, arguments = min(ends), {}
    while not text.startswith(CALL_CLOSE, at):
        key, at = _tagged(text, at, KEY_OPEN, KEY_CLOSE)
        value, at = _tagged(text, skip_space(text, at), VALUE_OPEN, VALUE_CLOSE)
        arguments[key.strip()] = value
        at = skip_space(text, at)
    return {"name": name, "arguments": arguments}, at


def _tagged(text: str, at: int, opening: str, closing: str) -> tuple[str, int]:
    if not text.startswith(opening, at):
        raise ValueError(f"no {opening}")
    end = text.find(closing, at + len(opening))
    if end < 0:
        raise ValueError(f"no {closing}")
    return text[at + len(opening):end], end + len(closing)


def call_rules(name: str, schema: dict | None, index: int, ids: dict[str, int]) -> list[str]:
    """The grammar of a call of function ``name`` as the templates write one (rule ``call{index}``, up to the
    block's closing tag): its name, then each argument's key and value in their tags, a line break before each key
    and after the last value optional, in the order of the schema's properties (the required ones always, the
    others where the model writes them; any other keys after them, text, where the schema allows more). A value is
    text where it is (an enum's strings: one of them), else JSON its schema accepts. ``schema`` None: any keys, text.
    ``ids``: the tags that are added tokens, named by id. Add :func:`value_rules` once."""
    key_open, key_close = marker(KEY_OPEN, ids), marker(KEY_CLOSE, ids)
    value_open, value_close = marker(VALUE_OPEN, ids), marker(VALUE_CLOSE, ids)
    # (a text value and its closing tag: one lexeme where the tag is text, as a lexer cannot end a lexeme it has
    # already extended past the tag's start)
    text_value = f"GLMVALUE {value_close}" if VALUE_CLOSE in ids else "GLMVALUED"

    def spell(rule: str, key: str, prop: dict, kinds: frozenset[str] | None) -> list[str]:
        rules = []
        if takes_text(kinds):
            choices = text_choices(prop, kinds, ("null",))  # (the template writes None with tojson)
            value = f"({' | '.join(choices)}) {value_close}" if choices else text_value
        else:
            rules.append(f"{rule}v: %json {json.dumps({**prop, 'x-guidance': dict(JSON_STYLE)})}")
            value = f"{rule}v {value_close}"
        return [f'{rule}: "\\n"? {key_open} {json.dumps(key)} {key_close} "\\n"? {value_open} {value}', *rules]

    return keyed_call_rules(index, schema, json.dumps(name), '"\\n"?', "a", spell,
                            f'"\\n"? {key_open} GLMKEY{index} {key_close} "\\n"? {value_open} {text_value}',
                            f"GLMKEY{index}")


def value_rules(ids: dict[str, int]) -> list[str]:
    """A text value: anything without the value's closing tag (which ends it); with the tag where that is text."""
    if VALUE_CLOSE in ids:
        return [text_without(VALUE_CLOSE, "GLMVALUE")]
    return [f"GLMVALUED: GLMTEXT {json.dumps(VALUE_CLOSE)}", text_without(VALUE_CLOSE, "GLMTEXT")]
