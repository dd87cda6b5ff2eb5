"""Gemma 4's thinking channel read apart from the answer (server/reasoning.py, ``CHANNEL``): its markers,
``<|channel>`` (with its label, ``thought``) and ``<channel|>``, are special tokens that a decode keeps so that the
reader can find the block, and which the model may write elsewhere too: another block after its answer, a closing
marker left over, an opening one doubled. Wherever they stand, they are read as markers and never left in the
``reasoning_content`` or the ``content`` as text, whole and streamed alike.

The cases first are llama.cpp's own for its Gemma 4 parser (tests/test-chat.cpp, "Google Gemma 4"), with the
reasoning and content it expects; the others follow Gemma 4's template's own reading of an earlier answer
(strip_thinking: every block and every stray marker dropped from the content).
"""

from __future__ import annotations

import random

import pytest

from jointspec.server.app import _Reply
from jointspec.server.engine import Chunk
from jointspec.server.reasoning import (
    BLOCKS_APART,
    CHANNEL,
    INNER,
    MISTRAL_THINK,
    THINK,
    ReasoningStream,
    split_reasoning,
)
from jointspec.server.tools import GEMMA4, read_tool_use
from jointspec.server.tools_gemma import CALL_CLOSE, CALL_OPEN, QUOTE

from helpers import assert_stream_adds_up

OPEN, CLOSE = "<|channel>", "<channel|>"
ANSWER = "Hello, world!\nWhat's up?"  # (llama.cpp's message_assist)


def split(text: str, opened: bool = False) -> tuple[str | None, str]:
    parts = split_reasoning(text, opened, CHANNEL)
    return parts.reasoning, parts.content


# llama.cpp's expected reasoning "" is an empty block here, its "" where no block was written None.
@pytest.mark.parametrize("text, opened, reasoning, content", [
    pytest.param("Hello, world!", False, None, "Hello, world!", id="content-alone"),
    pytest.param(f"{OPEN}thought\nI'm\nthinking{CLOSE}{ANSWER}", False, "I'm\nthinking", ANSWER, id="block-first"),
    pytest.param(f"{OPEN}thought{CLOSE}{ANSWER}", False, "", ANSWER, id="empty-block-no-newline"),
    # The four edge cases llama.cpp reads as its message_assist (each left a marker in the content before):
    pytest.param(f"{OPEN}thought\n{CLOSE}{ANSWER}{CLOSE}", False, "", ANSWER, id="stray-close-after-answer"),
    pytest.param(f"{OPEN}thought\n{CLOSE}{ANSWER}{OPEN}thought\n{CLOSE}", False, "", ANSWER,
                 id="empty-block-after-answer"),
    pytest.param(f"{OPEN}thought\n{CLOSE}{ANSWER}{OPEN}thought\n{CLOSE}{CLOSE}", False, "", ANSWER,
                 id="empty-block-and-stray-close-after-answer"),
    pytest.param(f"{OPEN}{OPEN}thought\n{CLOSE}{ANSWER}", False, "", ANSWER, id="doubled-opening"),
    # (llama.cpp's reasoning continuation: the prompt left the block open, here its answer's own part alone)
    pytest.param(f" thinking{CLOSE}{ANSWER}", True, "thinking", ANSWER, id="begun-inside-a-block"),
])
def test_llama_cpps_gemma4_answers_split_as_llama_cpp_reads_them_whole_and_streamed(text, opened, reasoning,
                                                                                    content):
    """Each of llama.cpp's Gemma 4 answers reads as the reasoning and content llama.cpp expects, no marker left in
    either; a stream cut anywhere (or a character at a time) sends the same."""
    assert split(text, opened) == (reasoning, content)
    assert_stream_adds_up(opened, text, CHANNEL)


@pytest.mark.parametrize("text, opened, reasoning, content", [
    # A block after the answer (or inside it) is reasoning; the content is what stands outside blocks, as written.
    (f"Sure.{OPEN}thought\nhm\n{CLOSE}\n\nHere.", False, "hm", "Sure.\n\nHere."),
    (f"{OPEN}thought\nfirst\n{CLOSE}A{OPEN}thought\n second {CLOSE}B", False, f"first{BLOCKS_APART}second", "AB"),
    (f"  A {OPEN}thought\nx{CLOSE}", False, "x", "  A "),  # (an answer that begins with content keeps its spaces)
    (f" \n{OPEN}thought\nx{CLOSE}\n A", False, "x", "A"),  # (one that begins with a block: none before its content)
    # A stray closing marker is dropped, the text about it kept.
    (f"Hello{CLOSE} there", False, None, "Hello there"),
    (f"{CLOSE}{CLOSE}Hi", False, None, "Hi"),
    (f"a{CLOSE}b{CLOSE}c", True, "a", "bc"),
    # An opening marker opens a block, its label optional, doubled or not; inside a block another is dropped.
    (f"{OPEN}plan{CLOSE}Go.", False, "plan", "Go."),
    (f"{OPEN}{OPEN}{OPEN}thought\nx{CLOSE}y", False, "x", "y"),
    (f"{OPEN}thought\nab{OPEN}thought\ncd{CLOSE}e", False, "ab\ncd", "e"),
    (f"{OPEN}thought\nagain{CLOSE}ok", True, "again", "ok"),  # (an answer that opens the prompt's block again)
    # A block never closed is reasoning to the end (an answer cut by its length), wherever it opened.
    (f"{OPEN}thought\nstill", False, "still", ""),
    (f"Done.{OPEN}thought\ncut", False, "cut", "Done."),
    (f"Done.{OPEN}", False, "", "Done."),
    # Text that only begins a marker, or spells its label without one, is text.
    ("a <|chan b", False, None, "a <|chan b"),
    ("thought <chan", False, None, "thought <chan"),
    (f"{OPEN}thoughtful{CLOSE}x", False, "ful", "x"),  # (the label, as the template's tag begins the block)
    ("", False, None, ""),
    ("", True, "", ""),
])
def test_gemmas_markers_are_read_wherever_they_stand_and_never_left_as_text(text, opened, reasoning, content):
    """Blocks anywhere, stray and doubled markers, as Gemma 4's template reads an earlier answer (every block and
    stray marker out of the content), whole and streamed alike."""
    assert split(text, opened) == (reasoning, content)
    assert_stream_adds_up(opened, text, CHANNEL)


def test_a_stream_holds_back_what_may_yet_be_a_marker_or_its_label():
    """A streamed Gemma answer holds back a tail that may begin a marker (and, past an opening marker, its label),
    and sends it as text where it turns out to be none."""
    stream = ReasoningStream(False, CHANNEL)
    assert stream.feed("<|chan") == ("", "")  # (the answer may open a block)
    assert stream.feed("nel>") == ("", "") and stream.feed("thou") == ("", "")  # (the label may follow)
    assert stream.feed("ght\nhm ") == ("hm", "") and stream.state == "reasoning"  # (its whitespace may end it)
    assert stream.feed("<chan") == ("", "") and stream.feed("nel|>\nHi") == ("", "Hi")
    assert stream.feed(" there<") == ("", " there")
    assert stream.feed("channel|>!") == ("", "!")  # (a stray closing marker: dropped)
    assert stream.feed("<|channel>") == ("", "") and stream.state == "reasoning"
    assert stream.feed("thought\nmore<chan", final=True) == (f"{BLOCKS_APART}more<chan", "")
    assert stream.blocks  # (a block was read: the reasoning is not None)
    text = ReasoningStream(False, CHANNEL)
    assert text.feed("<|x") == ("", "<|x") and text.feed("a <chan", final=True) == ("", "a <chan")
    assert not text.blocks


def test_streams_of_seeded_random_gemma_answers_add_up_to_the_whole_answers_parts():
    """Answers made of Gemma's markers, pieces of them and text, cut at random places (seeded: the same every run):
    the stream sends the whole answer's parts; and where no piece spells part of a marker, neither part holds one."""
    rng = random.Random(11)
    whole_markers = [OPEN, CLOSE, "thought", "thou", " ", "\n", "a", "b c", "<", CALL_OPEN]
    pieces = [*whole_markers, "<|chan", "nel>", "<chan", "nel|>", "|"]
    for number in range(4000):
        words = whole_markers if number % 2 else pieces
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.5
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ReasoningStream(opened, CHANNEL)
        sent = [stream.feed(chunk, final=at == len(chunks) - 1) for at, chunk in enumerate(chunks)]
        whole = split_reasoning(text, opened, CHANNEL)
        assert ("".join(r for r, _ in sent), "".join(c for _, c in sent)) == (whole.reasoning or "",
                                                                             whole.content), (text, opened, chunks)
        assert stream.blocks == (whole.reasoning is not None), (text, opened)
        if words is whole_markers:
            assert not any(marker in part for marker in (OPEN, CLOSE)
                           for part in (whole.reasoning or "", whole.content)), (text, opened)


def test_other_formats_still_read_a_later_block_as_text():
    """Only Gemma's markers are read anywhere: <think> (text in most tokenizers) and the other formats' control
    tokens keep their reading, a block after the answer's start and a stray closing tag left as written."""
    for tags in (THINK, MISTRAL_THINK, INNER):
        assert not tags.anywhere
        later = f"Hi {tags.open}x{tags.close} y{tags.close}"
        assert split_reasoning(later, False, tags).content == later
        assert split_reasoning(f"{tags.open}a{tags.close}b{tags.close}", False, tags).content == f"b{tags.close}"


def test_a_reply_carries_no_marker_whole_and_streamed_and_reads_calls_after_a_stray_block():
    """Through the chat reply (server/app.py): a Gemma answer that writes an empty block again after its text and
    then a call has the text as its content, no marker in it, and the call read, whole and streamed."""
    tools = read_tool_use([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}], "auto", False,
        call_format=GEMMA4)
    answer = (f"{OPEN}thought\nWeather: a call.\n{CLOSE}Let me check.{OPEN}thought\n{CLOSE}{CLOSE}"
              f"{CALL_OPEN}call:get_weather{{city:{QUOTE}Rome{QUOTE}}}{CALL_CLOSE}")
    for size in (1, 4, 9, len(answer)):
        chunks = [Chunk(answer[at:at + size], 1) for at in range(0, len(answer), size)] + [Chunk("", 0, "stop")]
        reply = _Reply("chat", "tiny", 5, None)
        reply.tools, reply.reasoning, reply.reasoning_tags = tools, {0: False}, {0: CHANNEL}
        message = reply.whole([chunks])["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("Weather: a call.", "Let me check.")
        assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]
        deltas = [event["choices"][0]["delta"] for chunk in chunks for event in reply.events(chunk)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather: a call."
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check.", size
        assert [call["function"]["name"] for d in deltas for call in d.get("tool_calls", [])] == ["get_weather"]
