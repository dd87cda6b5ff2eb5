"""OpenAI's Harmony format, which gpt-oss writes: an answer is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>The user asks for the weather. I should call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}

(the answer's first header follows the prompt's ``<|start|>assistant``; the markers are special tokens, which the
engine keeps in the text). A header names the message's channel and, for a tool call, its recipient, before or after
the channel, and the arguments' type. The answer ends with ``<|return|>`` after a final message or ``<|call|>`` after
a call, both ends of sequence, so an answer holds one call at most.

How the server reads it (as llama.cpp's gpt-oss parser does): a message on the ``analysis`` channel is reasoning; one on
``final``, or on ``commentary`` without a recipient (a preamble shown to the user), is content; one addressed
``to=functions.NAME`` is a call of NAME. A message to any other recipient (gpt-oss's built-in ``browser`` and
``python`` tools, which the server does not offer), and text between messages, are dropped. An answer that does not
begin with a header (a model that does not write Harmony) is content as written. Bodies are kept as written; the
bodies of one part are joined by a blank line.

:class:`HarmonyStream` reads an answer piece by piece, holding back only a header until it is whole and a tail that
may begin a marker, so that what it sends adds up to the whole answer's parts (the whole is read by the same stream).
A call is passed on in the content in one spelling, :data:`CALL_OPENING`, the function's name, ``<|channel|>commentary
json<|message|>`` and the arguments, which the ``harmony`` call format (server/call_formats.py) reads back: as the
template writes an earlier call into the prompt.
"""

from __future__ import annotations

import json
import re

from jointspec.server.tool_text import marker, one_call_a_turn, partial_tail, text_without

START, CHANNEL, MESSAGE, END, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
# The markers an answer's text keeps (its ends, <|return|> and <|call|>, end the decode instead).
MARKERS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
FUNCTIONS = "functions."
# A call as the content carries it, and as gpt-oss's template writes an earlier one: this, the name, CALL_HEAD, the
# arguments, and <|end|> where the model closed the message so.
CALL_OPENING = f"{START}assistant to={FUNCTIONS}"
CALL_HEAD = f"{CHANNEL}commentary json{MESSAGE}"
# The bodies of one part (reasoning, or content) joined.
APART = "\n\n"

_WORD = r"[A-Za-z0-9_.\-]+"
_HEADER = re.compile(rf"\s*(?:assistant)?\s*(?:to=(?P<before>[^<\s]+)\s*)?{re.escape(CHANNEL)}(?P<channel>{_WORD})"
                     rf"(?:\s+to=(?P<after>[^<\s]+))?(?:\s*(?:{re.escape(CONSTRAIN)})?(?P<type>{_WORD}))?\s*")


def message_kind(header: str) -> tuple[str, str | None]:
    """What a message with ``header`` (the text between its start and ``<|message|>``) is: ``reasoning``,
    ``content``, ``call`` (with the function's name) or ``dropped``."""
    match = _HEADER.fullmatch(header)
    if match is None:
        return "dropped", None
    channel, recipient = match["channel"], match["before"] or match["after"]
    if recipient is not None:
        if recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS) and channel in ("commentary",
                                                                                               "analysis"):
            return "call", recipient[len(FUNCTIONS):]
        return "dropped", None
    if channel == "analysis":
        return "reasoning", None
    return ("content", None) if channel in ("final", "commentary") else ("dropped", None)


class HarmonyStream:
    """One answer in Harmony read into reasoning and content as it comes (module docstring). ``raw_reasoning``: the
    analysis messages stay in the content as written (``--reasoning-format none``, as llama.cpp leaves them there),
    the other messages read as they are otherwise, so that calls are still read."""

    def __init__(self, raw_reasoning: bool = False) -> None:
        self.raw_reasoning = raw_reasoning
        self.state = "start"  # then "header", "body" and "between" (messages), or "plain" (no Harmony)
        self.held = ""  # received and not yet read
        self.kind: str | None = None  # the current message's (message_kind)
        self.reasoned = False  # a reasoning message was begun (the answer's reasoning is then not None)
        self.sent = {"reasoning": False, "content": False}  # each part has sent some text
        self.body_sent = False  # the current message's body has

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the next piece; ``final``: the last) lets through now."""
        self.held += text
        out = {"reasoning": [], "content": []}
        while True:
            if self.state == "start":
                begun = self.held.lstrip()
                if begun.startswith((CHANNEL, "to=")):
                    self.state, self.held = "header", begun
                elif not final and (CHANNEL.startswith(begun) or "to=".startswith(begun)):
                    break  # (it may yet begin a header)
                else:
                    self.state = "plain"
            if self.state == "plain":
                out["content"].append(self.held)
                self.held = ""
                break
            if self.state == "header":
                at = self.held.find(MESSAGE)
                if at < 0:
                    if final:  # (a header the answer's end cut: no message)
                        self.held = ""
                    break
                self.kind, name = message_kind(self.held[:at])
                self.held, self.state, self.body_sent = self.held[at + len(MESSAGE):], "body", False
                if self.kind == "reasoning" and self.raw_reasoning:
                    self.kind = "raw"
                    out["content"].append(CHANNEL + "analysis" + MESSAGE)
                elif self.kind == "reasoning":
                    self.reasoned = True
                elif self.kind == "call":
                    out["content"].append(CALL_OPENING + name + CALL_HEAD)
                    self.sent["content"] = True
            elif self.state == "body":
                at = self.held.find(END)
                if at < 0:
                    keep = 0 if final else partial_tail(self.held, END)
                    self._body(self.held[:len(self.held) - keep], out)
                    self.held = self.held[len(self.held) - keep:]
                    break
                self._body(self.held[:at], out)
                if self.kind in ("call", "raw"):
                    out["content"].append(END)
                self.held, self.state = self.held[at + len(END):], "between"
            else:  # between messages: what comes before the next one's start is dropped
                at = self.held.find(START)
                if at < 0:
                    keep = 0 if final else partial_tail(self.held, START)
                    self.held = self.held[len(self.held) - keep:]
                    break
                self.held, self.state = self.held[at + len(START):], "header"
        return "".join(out["reasoning"]), "".join(out["content"])

    def _body(self, ready: str, out: dict[str, list[str]]) -> None:
        """A piece of the current message's body, sent to its part (a body after another of its part's, apart)."""
        if not ready or self.kind == "dropped":
            return
        if self.kind in ("call", "raw"):  # (the arguments, or a kept analysis, as written after their opening)
            out["content"].append(ready)
            return
        part = self.kind
        if not self.body_sent and self.sent[part]:
            out[part].append(APART)
        out[part].append(ready)
        self.sent[part] = self.body_sent = True


def split(text: str, raw_reasoning: bool = False) -> tuple[str | None, str]:
    """A whole answer's reasoning (None where it began no analysis message, or ``raw_reasoning`` left it in the
    content) and content."""
    stream = HarmonyStream(raw_reasoning)
    reasoning, content = stream.feed(text, final=True)
    return (reasoning if stream.reasoned else None), content


# -- calls: read back from the content, and held by a grammar -------------------------------------------------------

def read_calls(rest: str, cut: bool) -> tuple[list[dict] | None, str]:
    """The calls after the content's first :data:`CALL_OPENING` (``rest``: what follows it) as records (name and
    arguments; None where one does not read), and the text after and between them (a final message or a preamble
    that followed a call the model closed with ``<|end|>``), joined as the content's parts are. ``cut``: the answer
    ran out of tokens, so an unfinished last call is dropped and the calls before it stand."""
    records, said = [], []
    pieces = rest.split(CALL_OPENING)
    for number, piece in enumerate(pieces):
        name, head, body = piece.partition(CALL_HEAD)
        arguments, closed, after = body.partition(END)
        try:
            value = json.loads(arguments) if head else None
        except ValueError:
            value = None
        if not isinstance(value, dict):
            if cut and number == len(pieces) - 1 and not closed:
                break
            return None, ""
        records.append({"name": name, "arguments": value})
        if after.strip():
            said.append(after.strip())
    return (records or None), APART.join(said)


def call_grammar(calls: list[tuple[str, str]], strict_auto: bool, ids: dict[str, int]) -> str:
    """The lark grammar of an answer in Harmony that calls one of ``calls`` (each its name and its arguments' JSON
    schema as the grammar takes it): analysis messages and commentary preambles or none, then the call on the
    commentary or analysis channel, its recipient before or after the channel, as gpt-oss writes any of them;
    ``strict_auto``: or a final message of any text instead. One call: the model ends its answer after it."""
    channel, message = marker(CHANNEL, ids), marker(MESSAGE, ids)
    rules = []
    for index, (name, schema) in enumerate(calls):
        recipient = json.dumps(f"to={FUNCTIONS}{name}")
        rules += [f'call{index}: (" " {recipient} {channel} call_channel | {channel} call_channel " " {recipient}) '
                  f"kind? {message} args{index}", f"args{index}: %json {schema}"]
    either = " | ".join(f"call{index}" for index in range(len(calls)))
    then = f'({either} | {channel} "final" kind? {message} FINAL_TEXT)' if strict_auto else f"({either})"
    extra = ["FINAL_TEXT: /(?s:.*)/"] if strict_auto else []
    shared = ['call_channel: "commentary" | "analysis"']
    return "\n".join([f"start: earlier* {then}", *earlier_rules(ids), *shared, *rules, *extra]) + "\n"


def earlier_rules(ids: dict[str, int]) -> list[str]:
    """The grammar's rules ``earlier`` (an analysis message, or a commentary preamble, and the next message's start)
    and ``kind`` (a header's content type: ``json``, after ``<|constrain|>`` or not)."""
    channel, message, end, start, constrain = (marker(spelling, ids)
                                               for spelling in (CHANNEL, MESSAGE, END, START, CONSTRAIN))
    lines = [text_without(END, "MESSAGE_TEXT")]
    if END in ids:
        body = f"MESSAGE_TEXT {end}"
    else:  # (text and marker one lexeme, as reasoning_first has them where the closing tag is text)
        lines.append(f"MESSAGE_CLOSED: MESSAGE_TEXT {end}")
        body = "MESSAGE_CLOSED"
    return [f'earlier: {channel} ("analysis" | "commentary") {message} {body} {start} "assistant"',
            f'kind: " "? {constrain} "json" | " json"', *lines]


def final_rules(ids: dict[str, int]) -> str:
    """The grammar's start of an answer whose content follows ``reasoning_answer``: in a final message (its type
    named or not), after analysis messages and preambles or none."""
    return f'start: earlier* {marker(CHANNEL, ids)} "final" kind? {marker(MESSAGE, ids)} reasoning_answer'


def native_turns(messages: list[dict]) -> list[dict]:
    """The conversation as gpt-oss's template takes it. An assistant's earlier reasoning as ``thinking`` (the field it
    reads, which it writes back before that turn's call), and a call turn's text with it (the template refuses a call
    turn with both; it writes either as the call's analysis). The template writes one call a turn and names each
    result after the last call: a turn of several calls becomes turns of one call each, its reasoning on the first,
    each followed by its result where the results answer those calls by id."""
    def turns_of(message: dict) -> list[dict] | None:
        calls = message.get("tool_calls") or []
        if len(calls) < 2:
            return None
        return [dict(message, tool_calls=[call]) if number == 0 else
                {"role": "assistant", "content": "", "tool_calls": [call]} for number, call in enumerate(calls)]

    return one_call_a_turn([_thought(message) for message in messages], turns_of)


def _thought(message: dict) -> dict:
    """An assistant message with its ``reasoning_content`` as ``thinking`` (a call turn's text joined to it)."""
    thought = message.get("reasoning_content")
    if message.get("role") != "assistant" or not thought:
        return message
    turned = {key: value for key, value in message.items() if key != "reasoning_content"}
    if message.get("tool_calls") and message.get("content"):
        thought = thought + APART + turned.pop("content")
    return {**turned, "thinking": thought}
