"""Reasoning kept apart from the answer: the ``<think>`` ... ``</think>`` block that Qwen3, QwQ and DeepSeek-R1's
distilled models write before their answer, returned as ``reasoning_content`` (the field DeepSeek's API, vLLM, SGLang
and llama.cpp's server return it in) and the rest as ``content``.

Where a server reads reasoning. A model whose chat template names ``</think>`` writes it: Qwen3's template opens no
block (the model writes ``<think>`` itself, or the template writes an empty block where ``enable_thinking`` is false),
DeepSeek-R1's opens one at the end of the prompt (the answer begins inside it and closes it). So each answer is read
from where its prompt leaves it (:func:`prompt_opens_reasoning`):

- begun inside a block: the text up to ``</think>`` is reasoning, the rest content; an answer that never closes it
  (cut by its length) is all reasoning;
- otherwise: an answer that begins with ``<think>`` (after whitespace) is read so from past the tag; any other answer
  is content as written, and a ``<think>`` later in it is text.

Gemma 4's templates write the block in its own tags, ``<|channel>thought`` ... ``<channel|>`` (:data:`CHANNEL`; special
tokens, which the engine keeps in the text where the template names them), read alike, except that its markers are
read wherever they stand (``Tags.anywhere``): a block later in the answer is reasoning too, and a marker that opens
or closes nothing is dropped, so that none is left in either part as text (as llama.cpp's Gemma 4 parser reads
them, and the template's own strip_thinking reads an earlier answer). Read alike, as ``<think>`` is, are Mistral's
reasoning models' ``[THINK]`` ... ``[/THINK]`` (:data:`MISTRAL_THINK`, control tokens too), Apertus's
``<|inner_prefix|>`` ... ``<|inner_suffix|>`` (:data:`INNER`), and Apriel 1.6 Thinker's, which its template opens
with "Here are my reasoning steps:" and the model ends with "[BEGIN FINAL RESPONSE]" (:data:`APRIEL_THINK`).
gpt-oss's template writes OpenAI's Harmony messages (:data:`HARMONY`): its ``analysis`` channel is the reasoning and
its ``final`` channel the content, read by server/harmony.py, which this module hands such an answer to whole.
Granite 3.3's template, with thinking on, asks for the answer in tags of its own after the block, ``<response>`` ...
``</response>`` (:data:`THINK_RESPONSE`): a content that begins with them has them taken off, up to the last closing
tag (llama.cpp's template analyser names the same tags for Granite 3.3 as the content's wrapper).

The reasoning drops the whitespace around it, the content the whitespace before it (Qwen3 writes ``\\n\\n`` after the
block), and a content in tags the whitespace inside them too. A stream (:class:`ReasoningStream`) sends each part as
it comes, holding back only what it cannot yet tell apart (whitespace that may end a part, a tail that may begin a
tag), so that what it sends adds up to the whole answer's two parts. Tool calls are read from the content alone
(server/tools.py).

A format an answer must follow (a ``response_format``, tool calls a grammar holds) is the content's: the grammar lets a
reasoning block come first (:func:`reasoning_first`), as vLLM and SGLang apply structured output after the reasoning,
so that a reasoning model thinks before it writes the format rather than being held from its first token; where the
prompt ends with a closed block (thinking turned off, :func:`prompt_closes_reasoning`) the format begins at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from jointspec.core.grammar import JSON_STYLE, OutputFormat
from jointspec.server import harmony
from jointspec.server.tool_text import partial_tail, text_without

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Tags:
    """A reasoning block's opening and closing tags, the special tokens among them that a decode must keep
    (``kept``: their spellings), and the tags the content is written in where the template asks for some
    (``answer``: opening and closing). ``anywhere``: the tags' markers are tokens read wherever they stand (Gemma
    4's, :data:`CHANNEL`): the opening marker (``kept[0]``, its label after it optional) opens a block at any point
    of the answer, the closing one closes it, and a marker that opens or closes nothing is dropped, so that no
    marker is left in either part as text."""

    open: str
    close: str
    kept: tuple[str, ...] = ()
    answer: tuple[str, str] | None = None
    anywhere: bool = False
    harmony: bool = False  # (gpt-oss's Harmony messages: read by server/harmony.py, the tags naming its analysis)
    in_content: bool = False  # (Harmony's analysis left in the content as written: --reasoning-format none)


THINK = Tags(THINK_OPEN, THINK_CLOSE)
# Gemma 4's thinking channel: the model writes "<|channel>thought\n" ... "<channel|>", both markers special tokens,
# which it may also write elsewhere: another block after its answer, a closing marker left over, an opening one doubled
# (the cases llama.cpp's Gemma 4 parser reads; its template's strip_thinking drops every block and stray marker).
CHANNEL = Tags("<|channel>thought", "<channel|>", ("<|channel>", "<channel|>"), anywhere=True)
# gpt-oss's Harmony format (server/harmony.py): the reasoning is the analysis channel's messages.
HARMONY = Tags(harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.END, harmony.MARKERS, harmony=True)
# The same read with the reasoning left in the content (--reasoning-format none): its messages, the calls among them,
# are still read apart.
HARMONY_IN_CONTENT = replace(HARMONY, in_content=True)
# Mistral's reasoning models (Magistral, Ministral 3 Reasoning): "[THINK]" ... "[/THINK]", both control tokens.
MISTRAL_THINK = Tags("[THINK]", "[/THINK]", ("[THINK]", "[/THINK]"))
# Apertus's, with deliberation on: "<|inner_prefix|>" ... "<|inner_suffix|>", special tokens.
INNER = Tags("<|inner_prefix|>", "<|inner_suffix|>", ("<|inner_prefix|>", "<|inner_suffix|>"))
# ServiceNow Apriel 1.6 Thinker's: the template opens the reasoning with this text at the end of the prompt, and the
# model ends it with the marker, all of it text.
APRIEL_THINK = Tags("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]")
# Granite 3.3 with thinking on: "<think>...</think><response>...</response>", all of it text.
RESPONSE_OPEN, RESPONSE_CLOSE = "<response>", "</response>"
THINK_RESPONSE = Tags(THINK_OPEN, THINK_CLOSE, answer=(RESPONSE_OPEN, RESPONSE_CLOSE))


def template_reasons(tokenizer) -> Tags | None:
    """The tags of the reasoning blocks the tokenizer's chat template writes (it names ``</think>``, Gemma 4's
    channel, Mistral's ``[THINK]``, Apertus's inner block or Apriel 1.6's, or it writes Harmony's channels; of a
    tokenizer with named templates, any of them), or None where it writes none."""
    template = getattr(tokenizer, "chat_template", None)
    templates = [text for text in (template.values() if isinstance(template, dict) else [template])
                 if isinstance(text, str)]
    if any(harmony.CHANNEL in text and harmony.MESSAGE in text for text in templates):
        return HARMONY
    for tags in (THINK, CHANNEL, MISTRAL_THINK, INNER, APRIEL_THINK):
        if any(tags.open in text and tags.close in text for text in templates) or (
                tags is THINK and any(THINK_CLOSE in text for text in templates)):
            # (the instruction Granite 3.3's template gives, naming both tags; MiniMax's wraps tool results in them)
            if tags is THINK and any(RESPONSE_OPEN + RESPONSE_CLOSE in text for text in templates):
                return THINK_RESPONSE
            return tags
    return None


def prompt_opens_reasoning(prompt_text: str, tags: Tags = THINK) -> bool:
    """Whether a rendered prompt leaves its answer inside a reasoning block: it ends with the opening tag (and
    whitespace), as DeepSeek-R1's template ends it with ``<think>``."""
    return prompt_text.rstrip().endswith(tags.open)


def reasoning_first(answer: OutputFormat, tags: Tags, ids: dict[str, int], opened: bool) -> OutputFormat:
    """``answer`` (the format the content follows) after a reasoning block written in ``tags``: where the prompt
    ``opened`` one, the rest of it and its closing tag, else a whole block or none; then whitespace at most, and the
    answer, alone or in the tags the template asks the content to be written in (``tags.answer``). ``ids``: the
    tags' leading pieces that are added tokens of the tokenizer, named by id (llguidance reads added ``<...>`` tokens
    as special: no text matches them). The block's text never spells the closing tag, as the reader
    (:func:`split_reasoning`) ends it at the first such spelling."""
    if tags.harmony:  # (an analysis message or none, then the answer in a final message)
        rules = [harmony.final_rules(ids), *harmony.earlier_rules(ids), *_answer_rules(answer)]
        return OutputFormat("lark", "\n".join(rules) + "\n")
    lines = [text_without(tags.close, "REASONING_TEXT"), "REASONING_GAP: /[ \\t\\r\\n]{1,8}/", *_answer_rules(answer)]
    close = _tag(tags.close, ids)
    if any(tags.close.startswith(spelling) for spelling in ids):
        block = f"REASONING_TEXT {close}"
    else:  # (text and tag one lexeme: a lexer cannot end a lexeme it has already extended past the tag's start)
        lines.append(f"REASONING_CLOSED: REASONING_TEXT {close}")
        block = "REASONING_CLOSED"
    content = "reasoning_answer"
    if tags.answer:  # (or in the tags the template asks the content to be written in, which the reader takes off)
        opening, closing = (json.dumps(tag) for tag in tags.answer)
        lines.append(f"wrapped_answer: reasoning_answer | {opening} REASONING_GAP? reasoning_answer REASONING_GAP? "
                     f"{closing}")
        content = "wrapped_answer"
    then = f"{block} REASONING_GAP? {content}"
    start = f"start: {then}" if opened else f"start: {content} | {_tag(tags.open, ids)} {then}"
    return OutputFormat("lark", "\n".join([start, *lines]) + "\n")


def _tag(tag: str, ids: dict[str, int]) -> str:
    """A tag as a grammar element: its leading piece by token id where that piece is an added token, the rest as
    text (Gemma 4's "<|channel>" and "thought"), else all of it as text."""
    for spelling, id_ in ids.items():
        if tag.startswith(spelling):
            rest = tag[len(spelling):]
            return f"<[{id_}]>" + (f" {json.dumps(rest)}" if rest else "")
    return json.dumps(tag)


def _answer_rules(answer: OutputFormat) -> list[str]:
    """``answer`` as lark rules whose start is ``reasoning_answer`` (a lark format nested whole, its names its own)."""
    if answer.kind == "json":
        schema = json.loads(answer.spec) if answer.spec else {"type": "object"}
        # (the house style, under whatever the schema's own x-guidance sets, as grammar_from_json_schema's defaults)
        own = schema.get("x-guidance")
        style = {**JSON_STYLE, **own} if isinstance(own, dict) else JSON_STYLE if own is None else own
        return [f"reasoning_answer: %json {json.dumps({**schema, 'x-guidance': style})}"]
    if answer.kind == "regex":
        # (lark's regex literal ends at a bare slash, and at a line's end: escape those)
        pattern = re.sub(r"(?<!\\)((?:\\\\)*)/", r"\1\\/", answer.spec).replace("\n", "\\n").replace("\r", "\\r")
        return [f"reasoning_answer: /{pattern}/"]
    return [f"reasoning_answer: %lark {{\n{answer.spec.rstrip()}\n}}"]


def prompt_closes_reasoning(prompt_text: str, tags: Tags = THINK) -> bool:
    """Whether a rendered prompt ends with a closed reasoning block (and whitespace): thinking turned off, where
    Qwen3's and Gemma 4's templates write an empty block for the answer to follow."""
    return prompt_text.rstrip().endswith(tags.close)


@dataclass(frozen=True)
class Parts:
    """An answer's reasoning (None where it wrote no block) and its content."""

    reasoning: str | None
    content: str


def split_reasoning(text: str, opened: bool, tags: Tags = THINK) -> Parts:
    """A whole answer's reasoning and content; ``opened``: its prompt left it inside a block
    (:func:`prompt_opens_reasoning`; an answer that opens it again has that tag dropped too); ``tags``: the block's."""
    if tags.harmony:
        return Parts(*harmony.split(text, tags.in_content))
    if tags.anywhere:
        return _split_anywhere(text, opened, tags)
    begun = text.lstrip()
    if begun.startswith(tags.open):
        body = begun[len(tags.open):]
    elif opened:
        body = text
    else:
        return Parts(None, _unwrapped(text, tags))
    end = body.find(tags.close)
    if end < 0:
        return Parts(body.strip(), "")
    return Parts(body[:end].strip(), _unwrapped(body[end + len(tags.close):].lstrip(), tags))


# Between the reasoning of an answer's blocks, where tags that open anywhere (Tags.anywhere) let it write several.
BLOCKS_APART = "\n\n"


def _split_anywhere(text: str, opened: bool, tags: Tags) -> Parts:
    """:func:`split_reasoning` for tags whose markers are tokens read wherever they stand (``tags.anywhere``, Gemma
    4's): each block, however many and wherever they are, is reasoning (stripped, the blocks' reasoning joined by
    :data:`BLOCKS_APART`), the text outside them content; an opening marker (or several in a row), its label after it
    optional, opens a block, or inside one is dropped; a closing marker closes one, or outside any is dropped. An
    unclosed block is reasoning to the end. The content is as written, less its leading whitespace where a block
    came first (as :func:`split_reasoning`'s: an answer that begins with a block, or inside one)."""
    opening, close = tags.kept[0], tags.close
    label = tags.open[len(opening):]
    if not opened and text.lstrip().startswith(opening):
        text = text.lstrip()
    starts_with_block = opened or text.startswith(opening)
    pieces = re.split(f"((?:{re.escape(opening)})+(?:{re.escape(label)})?|{re.escape(close)})", text)
    blocks: list[list[str]] = [[]] if opened else []  # (each block's text, its markers left out)
    content: list[str] = []
    inside = opened
    for number, piece in enumerate(pieces):  # (text, marker, text, ...)
        if number % 2 == 0:
            (blocks[-1] if inside else content).append(piece)
        elif piece == close:
            inside = False  # (a stray closing marker: dropped)
        elif not inside:  # (an opening marker opens a block; inside one it is dropped)
            inside = True
            blocks.append([])
    said = "".join(content)
    thoughts = [thought for block in blocks if (thought := "".join(block).strip())]
    return Parts(BLOCKS_APART.join(thoughts) if blocks else None, said.lstrip() if starts_with_block else said)


def _unwrapped(content: str, tags: Tags) -> str:
    """``content`` less the tags the template asks it to be written in (``tags.answer``), where it begins with them:
    the text inside, stripped, then whatever followed the closing tag as written. The last closing tag closes them:
    the answer inside may spell it (a JSON string a grammar lets through)."""
    if tags.answer is None or not (begun := content.lstrip()).startswith(tags.answer[0]):
        return content
    inner = begun[len(tags.answer[0]):]
    end = inner.rfind(tags.answer[1])
    if end < 0:
        return inner.strip()
    return inner[:end].strip() + inner[end + len(tags.answer[1]):]


class ReasoningStream:
    """One streamed answer's text split into reasoning and content as it comes (module docstring): what it sends
    adds up to :func:`split_reasoning`'s parts of the whole answer. Each piece is looked at once (with the few
    characters held back before it), so a long answer costs what its length does."""

    def __init__(self, opened: bool, tags: Tags = THINK) -> None:
        self.opened, self.tags = opened, tags
        # then "reasoning", and "content"; where the content may be in tags, "answer" (not yet told) and "wrapped"
        self.state = "start"
        self.held = ""  # received and not yet sent: the start, or a part's trailing whitespace and tag start
        self.sent_any = False  # of the current part (its leading whitespace is dropped until then)
        # Where the tags open anywhere (tags.anywhere): a block was opened (the reasoning is not None); just past an
        # opening marker (inside the block: its label, or the marker again, may follow); a block's trailing
        # whitespace, held until more of it comes; whether the block sent some reasoning, any block did, the
        # content did (its leading whitespace is dropped until then, where a block came first).
        self.blocks, self.label, self.gap = opened, False, ""
        self.block_sent = self.thought = self.content_sent = False
        self.harmony = harmony.HarmonyStream(tags.in_content) if tags.harmony else None

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the next piece; ``final``: the last) lets through now."""
        if self.harmony is not None:
            return self.harmony.feed(text, final)
        if self.tags.anywhere:
            return self._feed_anywhere(text, final)
        self.held += text
        reasoning = ""
        if self.state == "start":
            begun = self.held.lstrip()
            if begun.startswith(self.tags.open):
                self.state, self.held = "reasoning", begun[len(self.tags.open):]
            elif not final and self.tags.open.startswith(begun):
                return "", ""  # (it may yet open a block)
            elif self.opened:
                self.state = "reasoning"
            else:
                self.state = "answer" if self.tags.answer else "content"
                self.sent_any = True  # (an answer without reasoning is content as written, its whitespace too)
        if self.state == "reasoning":
            end = self.held.find(self.tags.close)
            if end < 0:
                return self._part(self._ready(self.tags.close, final), final), ""
            reasoning = self._part(self.held[:end], True)
            self.state = "answer" if self.tags.answer else "content"
            self.held, self.sent_any = self.held[end + len(self.tags.close):], False
        if self.state == "answer":
            begun, opening = self.held.lstrip(), self.tags.answer[0]
            if begun.startswith(opening):
                self.state, self.held, self.sent_any = "wrapped", begun[len(opening):], False
            elif not final and opening.startswith(begun):
                return reasoning, ""  # (it may yet open the tags)
            else:
                self.state = "content"
        content = ""
        if self.state == "wrapped":
            closing = self.tags.answer[1]
            # (the last closing tag closes them: what follows one may still hold another, so it waits for the end)
            end = self.held.rfind(closing)
            if end < 0:
                return reasoning, self._part(self._ready(closing, final), final)
            if not final:
                ready, self.held = self.held[:end], self.held[end:]
                return reasoning, self._part(ready, False)
            content = self._part(self.held[:end], True)
            # (what follows the closing tag is content as written)
            self.state, self.held, self.sent_any = "content", self.held[end + len(closing):], True
        rest, self.held = self.held, ""  # (content: as it comes, less its leading whitespace)
        if not self.sent_any:
            rest = rest.lstrip()
            self.sent_any = bool(rest)
        return reasoning, content + rest

    def _feed_anywhere(self, text: str, final: bool) -> tuple[str, str]:
        """:meth:`feed` for tags whose markers open and close blocks anywhere (:func:`_split_anywhere`): the text
        between markers as it comes, less a tail that may begin a marker (or, past an opening one, its label)."""
        opening, close = self.tags.kept[0], self.tags.close
        label = self.tags.open[len(opening):]
        self.held += text
        if self.state == "start":
            begun = self.held.lstrip()
            if self.opened:
                self.state = "reasoning"
            elif begun.startswith(opening):
                self.state, self.held, self.label, self.blocks = "reasoning", begun[len(opening):], True, True
            elif not final and opening.startswith(begun):
                return "", ""  # (it may yet open a block)
            else:
                self.state, self.content_sent = "content", True  # (an answer that begins so: content as written)
        reasoning, content = [], []
        while True:
            if self.state == "reasoning" and self.label:  # (past an opening marker)
                if self.held.startswith(opening):
                    self.held = self.held[len(opening):]
                    continue
                if label and self.held.startswith(label):
                    self.held, self.label = self.held[len(label):], False
                    continue
                if not final and (opening.startswith(self.held) or label.startswith(self.held)):
                    break  # (it may yet be either)
                self.label = False
            marks = [(at, spelling) for spelling in (opening, close) if (at := self.held.find(spelling)) >= 0]
            if not marks:
                keep = 0 if final else max(partial_tail(self.held, opening), partial_tail(self.held, close))
                ready, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                if self.state == "reasoning":
                    reasoning.append(self._thought(ready, final))
                else:
                    content.append(self._said(ready))
                break
            at, spelling = min(marks)
            before, self.held = self.held[:at], self.held[at + len(spelling):]
            if self.state == "reasoning":
                reasoning.append(self._thought(before, spelling == close))
                if spelling == close:
                    self.state = "content"
                else:  # (an opening marker inside the block: dropped, with its label)
                    self.label = True
            else:  # (content: an opening marker opens a block, a closing one is dropped)
                content.append(self._said(before))
                if spelling == opening:
                    self.state, self.label, self.blocks, self.block_sent = "reasoning", True, True, False
        return "".join(reasoning), "".join(content)

    def _thought(self, ready: str, closing: bool) -> str:
        """A block's reasoning ``ready`` to send (:meth:`_feed_anywhere`): less its leading whitespace until the block
        sent some, and its trailing whitespace held back unless the block ends here (``closing``); set apart from an
        earlier block's."""
        text = self.gap + ready
        if not self.block_sent:
            text = text.lstrip()
        trimmed = text.rstrip()
        self.gap = "" if closing else text[len(trimmed):]
        if not trimmed:
            return ""
        apart = BLOCKS_APART if self.thought and not self.block_sent else ""
        self.block_sent = self.thought = True
        return apart + trimmed

    def _said(self, ready: str) -> str:
        """Content ``ready`` to send (:meth:`_feed_anywhere`), less its leading whitespace until some was sent."""
        if not self.content_sent:
            ready = ready.lstrip()
            self.content_sent = bool(ready)
        return ready

    def _ready(self, closing: str, final: bool) -> str:
        """What is held, less a tail that may begin ``closing`` (all of it where the answer ends here)."""
        keep = 0 if final else partial_tail(self.held, closing)
        ready, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return ready

    def _part(self, ready: str, closing: bool) -> str:
        """Reasoning (or content inside tags) ``ready`` to send, less its leading whitespace (until something was sent)
        and, unless the part ends here (``closing``), its trailing whitespace, held back for more."""
        if not self.sent_any:
            ready = ready.lstrip()
        trimmed = ready.rstrip()
        if not closing:
            self.held = ready[len(trimmed):] + self.held
        self.sent_any = self.sent_any or bool(trimmed)
        return trimmed
