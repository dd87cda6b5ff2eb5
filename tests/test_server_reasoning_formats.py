"""A format after the reasoning (server/reasoning.py's reasoning_first): a reasoning model's answer held to a format
(``response_format``, tool calls a grammar holds) may begin with its reasoning block, and the format is its content's,
as vLLM and SGLang apply structured output after the reasoning. A prompt that opens the block leaves the answer inside
it; one that closes an empty block (thinking turned off) starts the format at once.

The tags are text where the tokenizer has no token for them (this file's byte tokenizer), and tokens where it has
(Qwen3's ``<think>``, an added token; Gemma 4's channel markers, special tokens): a grammar names a token by id. The
server tests push a tiny random Llama to a tag with ``logit_bias`` (a tag the grammar allows then wins; one it
forbids never appears). Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jointspec.core.grammar import OutputFormat
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.reasoning import (
    CHANNEL,
    THINK,
    THINK_RESPONSE,
    prompt_closes_reasoning,
    reasoning_first,
    split_reasoning,
)
from jointspec.server.tools import read_tool_use

from helpers import CITY_TOOL, byte_tokenizer, engine_of, grammar_takes, llama_ending_at_eos, sse_events

QWEN_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
# Gemma 4's channel: thinking off (the template's default) writes an empty block, on leaves the answer to open one.
GEMMA_LIKE = ("{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}<|turn>model\n"
              "{% if not enable_thinking | default(false) %}<|channel>thought\n<channel|>{% endif %}")
POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
# (a random model fills an integer or a string until its length runs out: a boolean ends)
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def tokenizer(tags: str):
    """The byte tokenizer with a template and its tags: "text" (no tokens for them), "think" (``<think>`` and
    ``</think>`` added tokens, as Qwen3's) or "channel" (Gemma 4's markers, special tokens)."""
    words = byte_tokenizer()
    if tags == "think":
        words.add_tokens(["<think>", "</think>"])
    elif tags == "channel":
        words.add_special_tokens({"additional_special_tokens": ["<|turn>", "<turn|>", "<|channel>", "<channel|>"]})
    words.chat_template = GEMMA_LIKE if tags == "channel" else QWEN_LIKE
    return words


@pytest.fixture(scope="module", params=["text", "think", "channel"])
def engine(request):
    words = tokenizer(request.param)
    yield from engine_of(llama_ending_at_eos(5, len(words)), words)


def tags_of(engine):
    return CHANNEL if engine.reasoning_tags is CHANNEL else THINK


def block(engine, thought: str) -> str:
    tags = tags_of(engine)
    return f"{tags.open}{thought}{tags.close}"


# -- the grammar -------------------------------------------------------------------------------------------------

def test_a_format_may_follow_a_reasoning_block_or_stand_alone(engine):
    tags = tags_of(engine)
    assert engine.reasoning_tags == tags
    assert set(engine.reasoning_tokens) == ({"<think>", "</think>"} if "<think>" in engine.tokenizer.get_added_vocab()
                                            else set(tags.kept))
    answer = OutputFormat.json_schema(POINT)
    after = reasoning_first(answer, tags, engine.reasoning_tokens, opened=False)
    for text, takes in [
        ('{"x": 1}', True),  # (no block: the format at once)
        (block(engine, "\nhm, one.\n") + '\n\n{"x": 1}', True),
        (block(engine, "") + '{"x": 1}', True),
        (block(engine, "a < b") + ' \t\n{"x": 2}', True),
        (block(engine, "hm") + "\n" * 9 + '{"x": 1}', False),  # (a few blank lines at most: never endless)
        (block(engine, "hm") + 'So: {"x": 1}', False),  # (text between: the content is the format)
        (block(engine, "hm") + '{"x": "one"}', False),  # (the format's schema still holds)
        (block(engine, "hm") + tags.close + '{"x": 1}', False),  # (the reasoning never spells its closing tag)
        (block(engine, "a") + block(engine, "b") + '{"x": 1}', False),
        (tags.open + 'hm {"x": 1}', False),  # (never closed)
        ('Hi ' + block(engine, "hm") + '{"x": 1}', False),
    ]:
        assert grammar_takes(engine, after, text) == takes, text
    # A schema's own x-guidance options go with the house style, as they do without reasoning: JSON written one way.
    lenient = OutputFormat.json_schema({**POINT, "x-guidance": {"lenient": True}})
    for text in ('{"x": 1}', '{ "x" :1 }'):
        assert grammar_takes(engine, reasoning_first(lenient, tags, engine.reasoning_tokens, False),
                             block(engine, "hm") + text) == grammar_takes(engine, lenient, text) == (text == '{"x": 1}')
    # A prompt that opened the block: the rest of it and its tag come first.
    inside = reasoning_first(answer, tags, engine.reasoning_tokens, opened=True)
    assert grammar_takes(engine, inside, "hm, one." + tags.close + '\n{"x": 1}')
    assert not grammar_takes(engine, inside, '{"x": 1}')


@pytest.fixture(scope="module", params=["text", "think"])
def think_engine(request):
    words = tokenizer(request.param)
    yield from engine_of(llama_ending_at_eos(5, len(words)), words)


def test_granites_response_tags_may_hold_the_format(think_engine):
    """Granite 3.3 writes its answer in <response> tags after the block: the grammar lets them hold the format (the
    reader takes them off), closed, or the format stand without them."""
    engine = think_engine
    after = reasoning_first(OutputFormat.json_schema(POINT), THINK_RESPONSE, engine.reasoning_tokens, opened=False)
    for text, takes in [
        (block(engine, "hm") + '\n<response>\n{"x": 1}\n</response>', True),
        (block(engine, "hm") + '<response>{"x": 1}</response>', True),
        (block(engine, "hm") + '{"x": 1}', True),
        ('<response>{"x": 1}</response>', True),
        ('{"x": 1}', True),
        (block(engine, "hm") + '<response>{"x": 1}', False),  # (opened, so closed)
        (block(engine, "hm") + '<response>{"x": 1}</response>{"x": 1}', False),
        (block(engine, "hm") + '<response>{"x": "one"}</response>', False),
        (block(engine, "hm") + '{"x": 1}</response>', False),
    ]:
        assert grammar_takes(engine, after, text) == takes, text
    # What the grammar lets through reads back as the format, a closing tag spelled inside the answer included.
    said = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": False}
    text = block(engine, "hm") + '<response>{"s": "</response>"}</response>'
    assert grammar_takes(engine, reasoning_first(OutputFormat.json_schema(said), THINK_RESPONSE,
                                                 engine.reasoning_tokens, opened=False), text)
    assert json.loads(split_reasoning(text, False, THINK_RESPONSE).content) == {"s": "</response>"}
    inside = reasoning_first(OutputFormat.json_schema(POINT), THINK_RESPONSE, engine.reasoning_tokens, opened=True)
    assert grammar_takes(engine, inside, 'hm</think><response>{"x": 1}</response>')
    # Other tags than Granite's hold no <response>.
    plain = reasoning_first(OutputFormat.json_schema(POINT), THINK, engine.reasoning_tokens, opened=False)
    assert not grammar_takes(engine, plain, block(engine, "hm") + '<response>{"x": 1}</response>')


def test_tool_calls_and_a_lark_format_follow_the_reasoning_and_a_lark_format_needs_one_start(engine):
    tags = tags_of(engine)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    required = read_tool_use([CITY_TOOL], "required", False).output_format()
    strict = read_tool_use([{**CITY_TOOL, "function": {**CITY_TOOL["function"], "strict": True}}], "auto",
                           False).output_format()
    for answer, text, takes in [(required, call, True), (required, "Sunny.", False), (strict, call, True),
                                (strict, "Sunny.", True), (strict, call.replace("Paris", "Oslo"), False)]:
        after = reasoning_first(answer, tags, engine.reasoning_tokens, opened=False)
        assert grammar_takes(engine, after, block(engine, "Weather: a call.") + "\n\n" + text) == takes, text
    regex = reasoning_first(OutputFormat("regex", "[0-9]+/[0-9]+\n?"), tags, engine.reasoning_tokens, False)
    assert grammar_takes(engine, regex, block(engine, "hm") + "3/4\n")
    # A lark format is nested whole: its own start rule, which it may name again, and names that the tool's text
    # holds ("start" in a description) stay its own.
    nested = reasoning_first(OutputFormat("lark", 'start: "a" | "(" start ")"\n'), tags, engine.reasoning_tokens, False)
    assert grammar_takes(engine, nested, block(engine, "hm") + "((a))")
    assert not grammar_takes(engine, nested, "(" + block(engine, "hm") + "a)")
    timed = {"type": "function", "function": {"name": "start", "parameters": {"type": "object", "properties": {
        "start": {"enum": ["start", "stop"], "description": "start: when"}}, "required": ["start"]}}}
    after = reasoning_first(read_tool_use([timed], "required", False).output_format(), tags, engine.reasoning_tokens,
                            False)
    assert grammar_takes(engine, after, block(engine, "hm") + '\n<tool_call>\n{"name": "start", "arguments": '
                                                               '{"start": "stop"}}\n</tool_call>')


def test_a_prompt_that_closes_an_empty_block_is_recognised():
    assert prompt_closes_reasoning("<|assistant|><think>\n\n</think>\n\n")
    assert prompt_closes_reasoning("<|turn>model\n<|channel>thought\n<channel|>", CHANNEL)
    assert not prompt_closes_reasoning("<|assistant|>") and not prompt_closes_reasoning("<|assistant|><think>\n")


# -- through the server ------------------------------------------------------------------------------------------

def tag_bias(engine, *pieces: str) -> dict[str, float]:
    """``logit_bias`` that pushes the model to each piece's first token wherever the grammar lets it write one;
    none where the tags are text (their first byte would be pushed everywhere)."""
    if not engine.reasoning_tokens:
        return {}
    ids = [engine.tokenizer(piece, add_special_tokens=False)["input_ids"][0] for piece in pieces]
    return {str(id_): 100 for id_ in ids}


def ask(client, engine, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "A point?"}], "temperature": 0,
            "max_tokens": 120, **extra}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def thinking_on(engine) -> dict:
    return {"chat_template_kwargs": {"enable_thinking": True}} if engine.reasoning_tags is CHANNEL else {}


def test_json_and_calls_come_after_a_reasoning_block_whole_and_streamed(engine):
    """Pushed to open and close a block at once, the answer's reasoning is that empty block and its content the
    format (the text tags, spelled byte by byte, cannot be pushed so: this model then writes the format alone)."""
    client = TestClient(create_app(ServerSettings(), engine))
    tags = tags_of(engine)
    bias = tag_bias(engine, tags.open, tags.close)
    tokens = bool(engine.reasoning_tokens)
    shaped = ask(client, engine, logit_bias=bias, **thinking_on(engine),
                 response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}})
    assert set(json.loads(shaped["message"]["content"])) == {"ok"}
    assert ("reasoning_content" in shaped["message"]) == tokens and shaped["message"].get("reasoning_content") in (
        None, "")
    events = sse_events(client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "A point?"}], "temperature": 0, "max_tokens": 120,
        "logit_bias": bias, "stream": True, **thinking_on(engine),
        "response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}}).text)
    deltas = [event["choices"][0]["delta"] for event in events if event["choices"]]
    assert "".join(delta.get("content") or "" for delta in deltas) == shaped["message"]["content"]
    called = ask(client, engine, logit_bias=bias, tools=[CITY_TOOL], tool_choice="required",
                 parallel_tool_calls=False, **thinking_on(engine))
    assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
    assert json.loads(called["message"]["tool_calls"][0]["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert ("reasoning_content" in called["message"]) == tokens


def test_a_block_left_open_is_all_reasoning_and_thinking_off_starts_the_format_at_once(engine):
    client = TestClient(create_app(ServerSettings(), engine))
    tags = tags_of(engine)
    if engine.reasoning_tokens:
        # Pushed to open a block and not to close it: this random model reasons until its length runs out.
        opened = ask(client, engine, logit_bias=tag_bias(engine, tags.open), response_format={"type": "json_object"},
                     **thinking_on(engine))
        assert opened["finish_reason"] == "length" and opened["message"]["content"] is None
        assert opened["message"]["reasoning_content"]
    # Thinking off: the template closed an empty block, so a pushed opening tag is never allowed.
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    shaped = ask(client, engine, logit_bias=tag_bias(engine, tags.open, tags.close),
                 response_format={"type": "json_object"}, **off)
    assert "reasoning_content" not in shaped["message"] and shaped["message"]["content"].startswith("{")
    # --reasoning-format none: every answer is content as written, and a format holds it from its first token.
    plain = TestClient(create_app(ServerSettings(reasoning_format="none"), engine))
    written = ask(plain, engine, logit_bias=tag_bias(engine, tags.open), response_format={"type": "json_object"},
                  **thinking_on(engine))
    assert "reasoning_content" not in written["message"] and written["message"]["content"].startswith("{")
