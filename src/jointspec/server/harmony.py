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

from jointspec.server.tool_text import marker, partial_tail, text_without

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
    """One answer in Harmony read into reasoning and content as it comes (module docstring)."""

    def __init__(self) -> None:
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
                if self.kind == "reasoning":
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
                if self.kind == "call":
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
        if self.kind == "call":  # (the arguments, as written, after the call's opening)
            out["content"].append(ready)
            return
        part = self.kind
        if not self.body_sent and self.sent[part]:
            out[part].append(APART)
        out[part].append(ready)
        self.sent[part] = self.body_sent = True


def split(text: str) -> tuple[str | None, str]:
    """A whole answer's reasoning (None where it began no analysis message) and content."""
    stream = HarmonyStream()
    reasoning, content = stream.feed(text, final=True)
    return (reasoning if stream.reasoned else None), content


# -- calls: read back from the content, and held by a grammar -------------------------------------------------------

def read_calls(rest: str, cut: bool) -> tuple[list[dict] | None, str]:
    """The calls after the content's first :data:`CALL_OPENING` (``rest``: what follows it) as records (name and
    arguments; None where they do not read), and the text after them. ``cut``: the answer ran out of tokens, so an
    unfinished last call is dropped and the calls before it stand."""
    records, after = [], ""
    pieces = rest.split(CALL_OPENING)
    for number, piece in enumerate(pieces):
        name, head, body = piece.partition(CALL_HEAD)
        arguments, closed, after = body.partition(END)
        last = number == len(pieces) - 1
        try:
            value = json.loads(arguments) if head else None
        except ValueError:
            value = None
        if not isinstance(value, dict):
            if cut and last and not closed:
                break
            return None, ""
        if False:  # (text between two calls: not as the model writes them)
            return None, ""
        records.append({"name": name, "arguments": value})
    return (records or None), after


def call_grammar(calls: list[tuple[str, str]], strict_auto: bool, ids: dict[str, int]) -> str:
    """The lark grammar of an answer in Harmony that calls one of ``calls`` (each its name and its arguments' JSON
    schema as the grammar takes it): an analysis message or none, then the call, its recipient before or after its
    channel as gpt-oss writes either; ``strict_auto``: or a final message of any text instead. One call: the model ends
    its answer after it."""
    channel, message = marker(CHANNEL, ids), marker(MESSAGE, ids)
    kind = f'(" " {marker(CONSTRAIN, ids)}? "json")?'
    rules = []
    for index, (name, schema) in enumerate(calls):
        recipient = json.dumps(f"to={FUNCTIONS}{name}")
        rules += [f'call{index}: (" " {recipient} {channel} "commentary" | {channel} "commentary " {recipient}) {kind} '
                  f"{message} args{index}", f"args{index}: %json {schema}"]
    either = " | ".join(f"call{index}" for index in range(len(calls)))
    then = f"({either} | {channel} \"final\" {message} FINAL_TEXT)" if strict_auto else f"({either})"
    extra = ["FINAL_TEXT: /(?s:.*)/"] if strict_auto else []
    return "\n".join([f"start: analysis? {then}", *analysis_rules(ids), *rules, *extra]) + "\n"


def analysis_rules(ids: dict[str, int]) -> list[str]:
    """The grammar's rule ``analysis``: an analysis message and the next message's start."""
    channel, message, end, start = (marker(spelling, ids) for spelling in (CHANNEL, MESSAGE, END, START))
    lines = [text_without(END, "ANALYSIS_TEXT")]
    if END in ids:
        body = f"ANALYSIS_TEXT {end}"
    else:  # (text and marker one lexeme, as reasoning_first has them where the closing tag is text)
        lines.append(f"ANALYSIS_CLOSED: ANALYSIS_TEXT {end}")
        body = "ANALYSIS_CLOSED"
    return [f'analysis: {channel} "analysis" {message} {body} {start} "assistant"', *lines]


def final_rules(ids: dict[str, int]) -> str:
    """The grammar's start of an answer whose content follows ``reasoning_answer``: in a final message, after an
    analysis message or none."""
    return f'start: analysis? {marker(CHANNEL, ids)} "final" {marker(MESSAGE, ids)} reasoning_answer'


def native_turns(messages: list[dict]) -> list[dict]:
    """The conversation as gpt-oss's template takes it: an assistant's earlier reasoning as ``thinking`` (the field it
    reads, which it writes back before that turn's call), and a call turn's text with it (the template refuses a call
    turn with both; it writes either as the call's analysis)."""
    out = []
    for message in messages:
        thought = message.get("reasoning_content")
        if message.get("role") != "assistant" or not thought:
            out.append(message)
            continue
        turned = {key: value for key, value in message.items() if key != "reasoning_content"}
        if message.get("tool_calls") and message.get("content"):
            thought = thought + APART + turned.pop("content")
        out.append({**turned, "thinking": thought})
    return out
