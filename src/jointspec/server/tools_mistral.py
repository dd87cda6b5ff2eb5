"""Mistral's tool-call formats (server/tools.py): calls after the special token ``[TOOL_CALLS]``, after any text, in
one of two layouts by the tokenizer's version::

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]     v3 (7B v0.3, Nemo, Small up to 3.1)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                             v11 (Small 3.2, Magistral, Ministral 3)

v3's tekken models (Nemo, Small) write no space before the list; a v11 model may write ``[CALL_ID]`` and its call's
id before ``[ARGS]``. Mistral's templates that show call ids take ids of 9 letters and digits alone
(:func:`mistral_id`). :func:`read_calls` reads the calls after the first marker; :func:`grammar` writes the grammar
of required and strict calls.
"""

from __future__ import annotations

import hashlib
import json
import string

from jointspec.server.tool_text import marker, skip_space, start_rules

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
MARKERS_V3, MARKERS_V11 = (TOOL_CALLS,), (TOOL_CALLS, ARGS, CALL_ID)
_ID_CHARACTERS = string.ascii_letters + string.digits


def mistral_id(call_id) -> str:
    """A call id as Mistral's templates take one, 9 letters and digits: the id itself where it is one, else 9 such
    characters derived from it (the same for a call and the result that names it)."""
    if isinstance(call_id, str) and len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    number = int.from_bytes(hashlib.sha256(str(call_id or "").encode()).digest()[:8], "big")
    out = []
    for _ in range(9):
        number, digit = divmod(number, len(_ID_CHARACTERS))
        out.append(_ID_CHARACTERS[digit])
    return "".join(out)


def read_calls(body: str, v11: bool, cut: bool) -> list[dict] | None:
    """What follows the first ``[TOOL_CALLS]``, read as the layout writes calls: their records (``{"name",
    "arguments"}``), or None where it does not read so. ``cut``: the answer ran out of tokens, so the call it left
    unfinished is dropped and the calls before it stand."""
    return (_v11_calls if v11 else list_calls)(body, cut)


def list_calls(body: str, cut: bool) -> list[dict] | None:
    """v3 (and Granite 3's and Nemotron's, after their own markers): one JSON list of call objects, then nothing but
    whitespace."""
    decoder = json.JSONDecoder()
    at = skip_space(body, 0)
    if not body.startswith("[", at):
        return None
    calls, at = [], at + 1
    while True:
        try:
            value, at = decoder.raw_decode(body, skip_space(body, at))
        except ValueError:
            return calls if cut and calls else None
        calls.append(value)
        at = skip_space(body, at)
        if at == len(body):
            return calls if cut else None
        if body[at] == "]":
            return calls if not body[at + 1:].strip() else None
        if body[at] != ",":
            return None
        at += 1


def _v11_calls(body: str, cut: bool) -> list[dict] | None:
    """v11: a name (and ``[CALL_ID]`` and an id, where the model writes one), ``[ARGS]`` and a JSON arguments object,
    then the next call's marker or the end (whitespace around each part allowed)."""
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while True:
        args = body.find(ARGS, at)
        if args < 0:
            return calls if cut and calls else None
        name = body[at:args].split(CALL_ID)[0].strip()
        try:
            arguments, at = decoder.raw_decode(body, skip_space(body, args + len(ARGS)))
        except ValueError:
            return calls if cut and calls else None
        calls.append({"name": name, "arguments": arguments})
        at = skip_space(body, at)
        if at == len(body):
            return calls
        if not body.startswith(TOOL_CALLS, at):
            return None
        at += len(TOOL_CALLS)


def grammar(calls: list[tuple[str, str]], v11: bool, several: bool, strict_auto: bool, ids: dict[str, int],
            opening: str = TOOL_CALLS, closing: str | None = None) -> str:
    """The lark grammar of an answer of ``calls`` (each a function's name and its arguments' JSON schema, as the
    grammar's ``%json`` takes it), written as the templates write them: ``[TOOL_CALLS] [`` and the calls joined by
    ``, `` then ``]`` (v3, the space optional); each call ``[TOOL_CALLS]``, its name, ``[ARGS]`` and its arguments
    (v11). ``several``: more than one call; ``strict_auto``: any text first, then such calls or nothing (else the
    calls alone); ``ids``: the markers that are added tokens, named by id (server/tool_text.py); ``opening``: v3's
    list after another marker (Granite 3's ``<|tool_call|>``); ``closing``: a marker after the list (Nemotron's
    ``</TOOLCALL>``)."""
    mark, args_mark = marker(opening, ids), marker(ARGS, ids)
    # (a model whose tokenizer has [CALL_ID] may write its call's id, 9 letters and digits, before [ARGS])
    call_id = f" ({marker(CALL_ID, ids)} /[A-Za-z0-9]{{9}}/)?" if CALL_ID in ids else ""
    rules = []
    for index, (name, schema) in enumerate(calls):
        if v11:
            rules.append(f"call{index}: {json.dumps(name)}{call_id} {args_mark} args{index}")
        else:
            head = json.dumps(f'{{"name": {json.dumps(name)}, "arguments": ')
            rules.append(f'call{index}: {head} args{index} "}}"')
        rules.append(f"args{index}: %json {schema}")
    either = " | ".join(f"call{index}" for index in range(len(calls)))
    # ("following" is what follows the first marker)
    if v11:
        following = f"call ({mark} call)*" if several else "call"
    else:
        following = '" "? "[" call (", " call)* "]"' if several else '" "? "[" call "]"'
        if closing is not None:
            following += f" {marker(closing, ids)}"
    return "\n".join([*start_rules(opening, ids, following, strict_auto), f"call: {either}", *rules]) + "\n"
