"""Small pieces the tool-call formats share (server/tools.py and its format modules), and reasoning's stream
(server/reasoning.py): reading past whitespace, the tail of a text that may yet become a tag, and writing a marker
and the text before it into a grammar.
"""

from __future__ import annotations

import json
import re


def skip_space(text: str, at: int) -> int:
    """Where the first character from ``at`` on that is not whitespace is (``len(text)`` where none is)."""
    return len(text) - len(text[at:].lstrip())


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` without being all of it (0: none): what a stream
    holds back, as it may yet become the tag."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def marker(spelling: str, ids: dict[str, int]) -> str:
    """A marker as a grammar element: by its token id where it is an added token of the tokenizer (``ids``: a special
    token has no text to match, and llguidance reads added ``<...>`` tokens as special), else by its text."""
    return f"<[{ids[spelling]}]>" if spelling in ids else json.dumps(spelling)


def start_rules(opening: str, ids: dict[str, int], following: str, strict_auto: bool, lead: str = "") -> list[str]:
    """The start of an answer whose calls begin at the marker ``opening`` and go on as ``following`` (a grammar
    expression): the calls alone (after ``lead``, a grammar expression: what the format may write first); or
    ``strict_auto``: any text that does not spell the marker, then the calls or nothing."""
    mark = marker(opening, ids)
    if not strict_auto:
        return [f"start: {lead}{mark} {following}"]
    if opening in ids:
        return [f"start: TEXT | TEXT {mark} {following}", text_without(opening)]
    # (a marker that is text: the text and the marker one lexeme, as Hermes's grammar has its tag, since a lexer
    # cannot end a lexeme it has already extended past the marker's start)
    return [f"start: TEXT | OPENED {following}", f"OPENED: TEXT {mark}", text_without(opening)]


def text_without(spelling: str, name: str = "TEXT") -> str:
    """A grammar lexeme ``name`` of any text that does not spell ``spelling`` (the reader takes its first spelling
    for where the calls begin)."""
    escaped = re.escape(spelling).replace("/", "\\/")  # (a lark regex ends at a bare slash)
    return f"{name}: /(?s:.*)/ & ~/(?s:.*{escaped}.*)/"


def other_key(name: str, known) -> str:
    """A grammar lexeme ``name`` of a key that is none of ``known`` (a schema's own properties, which their own rules
    hold, so that "any other key" cannot carry one of them with a value its schema refuses): one line of text without
    ``<`` or ``>``, and without whitespace at either end (the readers strip a key, so " city" would be "city")."""
    key = "/[^<>\\s]([^<>\\n]*[^<>\\s])?/"
    known = sorted(known)
    if not known:
        return f"{name}: {key}"
    either = "|".join(re.escape(known_key).replace("/", "\\/") for known_key in known)
    return f"{name}: {key} & ~/(?:{either})/"


def unwritable_key(schema: dict) -> str | None:
    """A property name that a format writing keys between tags cannot write (Qwen3-Coder's, GLM's): one that is
    empty, holds ``<``, ``>`` or a line break, or has whitespace at either end (the readers strip keys), or None."""
    return next((key for key in schema.get("properties") or {}
                 if not key or key != key.strip() or any(c in key for c in "<>\n")), None)


def one_call_a_turn(messages: list[dict], turns_of) -> list[dict]:
    """The conversation for a template that writes one call an assistant turn: each message that ``turns_of`` splits
    (it gives the turns, one call each, or None to keep the message) followed by the results that come after it, each
    turn by its own result where those answer the calls by id, else the turns and then the results."""
    out: list[dict] = []
    at = 0
    while at < len(messages):
        message = messages[at]
        at += 1
        turns = turns_of(message)
        if turns is None:
            out.append(message)
            continue
        results = []
        while at < len(messages) and messages[at]["role"] == "tool":
            results.append(messages[at])
            at += 1
        calls = message["tool_calls"]
        by_id = {result.get("tool_call_id"): result for result in results}
        ids = [call.get("id") for call in calls]
        if len(calls) > 1 and len(by_id) == len(results) == len(calls) and set(by_id) == set(ids):
            out += [part for turn, id_ in zip(turns, ids) for part in (turn, by_id[id_])]
        else:
            out += turns + results
    return out
