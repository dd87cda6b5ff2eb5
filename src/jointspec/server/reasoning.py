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

The reasoning drops the whitespace around it, the content the whitespace before it (Qwen3 writes ``\\n\\n`` after the
block). A stream (:class:`ReasoningStream`) sends each part as it comes, holding back only what it cannot yet tell
apart (whitespace that may end the reasoning, a tail that may begin a tag), so that what it sends adds up to the whole
answer's two parts. Tool calls are read from the content alone (server/tools.py).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def template_reasons(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes reasoning blocks (names ``</think>``; of a tokenizer with named
    templates, any of them)."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(text, str) and THINK_CLOSE in text for text in templates)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves its answer inside a reasoning block: it ends with ``<think>`` (and
    whitespace), as DeepSeek-R1's template ends it."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


@dataclass(frozen=True)
class Parts:
    """An answer's reasoning (None where it wrote no block) and its content."""

    reasoning: str | None
    content: str


def _tail_of(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` without being all of it (0: none)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def _parts(text: str, opened: bool, final: bool) -> Parts | None:
    """``text`` split as the module docstring says; not ``final``: as much of each part as more text cannot change
    (a prefix of each final part), or None where it cannot yet tell whether the answer reasons."""
    body = text
    if not opened:
        begun = text.lstrip()
        if not begun.startswith(THINK_OPEN):
            if not final and THINK_OPEN.startswith(begun):
                return None
            return Parts(None, text)
        body = begun[len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end >= 0:
        return Parts(body[:end].strip(), body[end + len(THINK_CLOSE):].lstrip())
    if final:
        return Parts(body.strip(), "")
    return Parts(body[:len(body) - _tail_of(body, THINK_CLOSE)].strip(), "")


def split_reasoning(text: str, opened: bool) -> Parts:
    """A whole answer's reasoning and content; ``opened``: its prompt left it inside a block
    (:func:`prompt_opens_reasoning`)."""
    return _parts(text, opened, final=True)


class ReasoningStream:
    """One streamed answer's text split into reasoning and content as it comes (module docstring)."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.text = ""
        self.sent = Parts(None, "")

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the content that ``text`` (the next piece; ``final``: the last) lets through now."""
        self.text += text
        now = _parts(self.text, self.opened, final)
        if now is None:
            return "", ""
        sent_reasoning, reasoning = self.sent.reasoning or "", now.reasoning or ""
        assert reasoning.startswith(sent_reasoning) and now.content.startswith(self.sent.content), \
            "streamed reasoning or content that the whole answer does not begin with"
        new = reasoning[len(sent_reasoning):], now.content[len(self.sent.content):]
        self.sent = now
        return new
