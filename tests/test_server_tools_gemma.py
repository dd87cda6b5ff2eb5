"""Gemma 4's tool-call format in the server (server/tools_gemma.py): ``<|tool_call>call:NAME{key:value}<tool_call|>``,
strings between ``<|"|>`` markers, keys bare. A template that writes calls so is recognised, its markers (special
tokens) are kept in the answer's text, its answers are read with their values as the format types them, and
required calls decode through a grammar of the format that names the markers by id.

The model is a tiny random Llama over a byte-level tokenizer with Gemma's markers added as special tokens, given a
template of this file's own in the conventions of Gemma 4's. Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import chat_template_ids, decode_text
from jointspec.server.app import ServerSettings, _Reply, create_app
from jointspec.server.engine import Chunk, CompletionRequest, ServingEngine
from jointspec.server.reasoning import CHANNEL, template_reasons
from jointspec.server.tools import (
    GEMMA4,
    CallStream,
    ToolError,
    call_markers,
    native_call_format,
    prompt_messages,
    read_calls,
    read_tool_use,
)
from jointspec.server.tools_gemma import CALL_CLOSE, CALL_OPEN, QUOTE

from helpers import byte_tokenizer, check_required_call, grammar_takes, llama_ending_at_eos

CONTROL = [CALL_OPEN, CALL_CLOSE, QUOTE, "<|tool_response>", "<tool_response|>", "<|turn>", "<turn|>", "<|channel>",
           "<channel|>"]
VOCAB = 259 + len(CONTROL)

# Gemma 4's conventions: the tools in a system turn; a call turn's calls as call:NAME{...} with their arguments in
# sorted order, strings quoted by the <|"|> marker, booleans as JSON's, numbers and null as Python writes them; each
# result after the calls it answers.
GEMMA_TEMPLATE = (
    "{% macro arg(v) %}{% if v is string %}<|\"|>{{ v }}<|\"|>{% elif v is boolean %}"
    "{{ 'true' if v else 'false' }}{% elif v is mapping %}{{ '{' }}{% for k, x in v | dictsort %}"
    "{{ k }}:{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}{{ '}' }}{% elif v is sequence %}["
    "{% for x in v %}{{ arg(x) }}{% if not loop.last %},{% endif %}{% endfor %}]{% else %}{{ v }}{% endif %}"
    "{% endmacro %}"
    "{{ bos_token }}{% if tools %}<|turn>system\n{% for t in tools %}<|tool>{{ t | tojson }}<tool|>{% endfor %}"
    "<turn|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|turn>model\n{% if m.reasoning_content %}<|channel>thought\n"
    "{{ m.reasoning_content }}\n<channel|>{% endif %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
    "<|tool_call>call:{{ c.function.name }}{{ arg(c.function.arguments) }}<tool_call|>{% endfor %}<turn|>\n"
    "{% elif m.role == 'tool' %}<|tool_response>response:{value:<|\"|>{{ m.content }}<|\"|>}<tool_response|>"
    "{% else %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% if not enable_thinking | default(false) %}<|channel>thought\n"
    "<channel|>{% endif %}{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}, "tags": {"type": "array",
                                                                             "items": {"type": "string"}},
        "near": {"anyOf": [{"type": "number"}, {"type": "null"}]}, "metric": {"type": "boolean"}},
        "required": ["city"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}, "meta": {"type": "object"}}, "required": ["text"]}}}


def gemma_tokenizer(markers: str = "special"):
    """:func:`byte_tokenizer` with the template and Gemma's markers as special tokens (``markers`` "added": tokens
    without the special flag, which a decode keeps and llguidance still reads as special; "none": no tokens, the
    markers spelled byte by byte)."""
    tokenizer = byte_tokenizer()
    if markers == "special":
        tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    elif markers == "added":
        tokenizer.add_tokens(CONTROL)
    tokenizer.chat_template = GEMMA_TEMPLATE
    return tokenizer


def call(name: str, arguments: str) -> str:
    return f"{CALL_OPEN}call:{name}{{{arguments}}}{CALL_CLOSE}"


TWO_LINES = "two\nlines"


def q(text: str) -> str:
    return QUOTE + text + QUOTE


def use_of(*tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=GEMMA4, special=special)


@pytest.fixture(scope="module")
def model():
    """Its end of sequence the tokenizer's </s> (a special token), not the byte the test models' config names."""
    return llama_ending_at_eos(9, VOCAB, 2048)


@pytest.fixture(scope="module")
def engine(model):
    served = ServingEngine(CausalLM(model), gemma_tokenizer(), model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def test_a_gemma_template_is_recognised_renders_the_calls_and_reads_them_back(engine):
    tokenizer = engine.tokenizer
    assert native_call_format(tokenizer) == GEMMA4 and engine.call_format == GEMMA4
    ids = tokenizer.convert_tokens_to_ids([CALL_OPEN, CALL_CLOSE, QUOTE])
    assert call_markers(tokenizer, GEMMA4) == tuple(zip([CALL_OPEN, CALL_CLOSE, QUOTE], ids, strict=True))
    assert call_markers(gemma_tokenizer("added"), GEMMA4) == call_markers(tokenizer, GEMMA4)
    assert call_markers(gemma_tokenizer("none"), GEMMA4) == ()
    sent = {"city": "Rome", "days": 2, "tags": ["a b", "c"], "near": None, "metric": True}
    conversation = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(sent)}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    rendered = prompt_messages(conversation, (WEATHER,), True, GEMMA4)
    assert rendered[0][1]["tool_calls"][0]["id"] == "c1"  # (ids as sent: only Mistral's templates take others)
    text = decode_text(tokenizer, chat_template_ids(tokenizer, *rendered),
                       {id_: spelling for spelling, id_ in call_markers(tokenizer, GEMMA4)})
    written = call("get_weather", f"city:{q('Rome')},days:2,metric:true,near:None,tags:[{q('a b')},{q('c')}]")
    assert written in text
    # what the template wrote reads back as the call that was sent (an integer as an integer)
    arguments = read_calls(written, use_of(WEATHER)).calls[0]["function"]["arguments"]
    assert json.loads(arguments) == sent and '"days": 2,' in arguments


def test_an_answer_is_read_for_its_calls_after_the_marker_or_left_text():
    use = use_of(WEATHER, NOTE)
    read = read_calls("Checking.\n" + call("get_weather", f"city:{q('Paris')}") +
                      call("note", f"meta:{{a:[1,2.5,{q('x,y}')}],b:{{c:false}},{q('d e')}:null}},"
                                   f"text:{q(TWO_LINES)}"), use)
    assert read.content == "Checking." and [json.loads(c["function"]["arguments"]) for c in read.calls] == [
        {"city": "Paris"}, {"meta": {"a": [1, 2.5, "x,y}"], "b": {"c": False}, "d e": None}, "text": "two\nlines"}]
    one = read_calls(call("note", f"text:{q('a')}") + call("note", f"text:{q('b')}"), use_of(NOTE, parallel=False))
    assert [c["function"]["arguments"] for c in one.calls] == ['{"text": "a"}']
    for text in (call("nope", ""), "Hi " + CALL_OPEN, call("note", "text:" + q("a")).replace(CALL_CLOSE, ""),
                 call("note", "text:{"), call("note", "text:" + q("a")) + call("note", "text")):
        assert read_calls(text, use).calls == () and read_calls(text, use).content == text, text
    # As vLLM's reader: text between and after the calls passed over (the result's marker where it is no end of
    # sequence), keys up to their colon, null in any case, trailing commas, numbers as float() reads them.
    loose = read_calls("Ok. " + call("note", f"text:{q('a')}") + " and " + call(
        "note", f"text:{q('b')},meta:{{first name:NULL,n:[.5,1.,],}}") + "<|tool_response>response:note{}", use)
    assert loose.content == "Ok." and [json.loads(c["function"]["arguments"]) for c in loose.calls] == [
        {"text": "a"}, {"text": "b", "meta": {"first name": None, "n": [0.5, 1.0]}}]
    whole = call("get_weather", f"city:{q('Rome')}") + call("note", f"text:{q('cut here')}")
    cut = whole[:whole.rindex("cut")]
    assert [c["function"]["name"] for c in read_calls(cut, use, cut=True).calls] == ["get_weather"]
    for size in (1, 5):
        stream = CallStream(use)
        sent = "".join(stream.feed(("Ok. " + whole)[at:at + size]) for at in range(0, len(whole) + 4, size))
        assert sent == "Ok." and len(stream.finish()[1]) == 2


def test_the_grammar_takes_calls_the_schema_accepts_in_the_templates_order_and_nothing_else(engine):
    special = engine.call_markers
    both = use_of(WEATHER, NOTE, choice="required", special=special)
    for text in (call("get_weather", f"city:{q('Rome')}"),
                 call("get_weather", f"city:{q('Paris')},days:-3,metric:false,near:None,tags:[{q('a')},{q('b')}]"),
                 call("get_weather", f"city:{q('Paris')},near:2.5e3"),
                 call("note", f"meta:{{k:[1,{q('v')}]}},text:{q('multi' + chr(10) + 'line, with: marks')}") +
                 call("get_weather", f"city:{q('Rome')}")):
        assert grammar_takes(engine, both, text), text
    for text in (call("get_weather", f"city:{q('Oslo')}"), call("get_weather", "days:2"),  # enum; city missing
                 call("get_weather", f"days:2,city:{q('Rome')}"),  # (the sorted order)
                 call("get_weather", f"city:{q('Rome')},days:2.5"), call("get_weather", f"city:{q('Rome')},x:1"),
                 call("get_weather", f"city:{q('Rome')},metric:yes"), "Sure. " + call("note", f"text:{q('a')}")):
        assert not grammar_takes(engine, both, text), text
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    held = use_of(strict, NOTE, special=special)
    for text in ("Just text.", "Ok. " + call("get_weather", f"city:{q('Rome')}"), call("note", "anything:[1]")):
        assert grammar_takes(engine, held, text), text
    assert not grammar_takes(engine, held, call("get_weather", f"city:{q('Oslo')}"))
    # (the marker's text is no marker, and the text before the calls may not spell it)
    spelled = engine.tokenizer("Hi " + CALL_OPEN, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    state = engine.grammar(held.output_format()).start()
    for token in spelled[:-1]:
        state.advance([token])
    assert not state.allowed()[spelled[-1]]
    # Keys are written in the template's order, Jinja's dictsort (case ignored); a key the format cannot write, at
    # any depth, is refused with the request.
    mixed = {"type": "function", "function": {"name": "crawl", "parameters": {"type": "object", "properties": {
        "URL": {"type": "string"}, "depth": {"type": "integer"}, "person": {"type": "object", "properties": {
            "first name": {"type": "string"}}}}, "required": ["depth"]}}}
    crawl = use_of(mixed, choice="required", special=special)
    assert grammar_takes(engine, crawl, call("crawl", f"depth:2,person:{{first name:{q('Ann')}}},URL:{q('x')}"))
    assert not grammar_takes(engine, crawl, call("crawl", f"URL:{q('x')},depth:2"))
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"type": "object", "properties": {"a:b": {"type": "string"}}}}}}}
    with pytest.raises(ToolError) as refused:
        use_of(bad, choice="required")
    assert refused.value.param == "tools.0.function.parameters"


@pytest.mark.parametrize("markers", ["added", "none"])
def test_markers_that_are_plain_added_tokens_or_no_tokens_at_all_are_held_too(model, markers):
    engine = ServingEngine(CausalLM(model), gemma_tokenizer(markers), model_id="tiny", max_batch_size=2)
    try:
        strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
        held = use_of(strict, NOTE, special=engine.call_markers)
        assert grammar_takes(engine, held, "Ok. " + call("get_weather", f"city:{q('Rome')}"))
        assert not grammar_takes(engine, held, "Ok. " + call("get_weather", f"city:{q('Oslo')}"))
        assert grammar_takes(engine, use_of(NOTE, choice="required", special=engine.call_markers),
                             call("note", f"text:{q('a')}"))
    finally:
        engine.close()


@pytest.mark.parametrize("method", ["ar", "default"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, model, method):
    check_required_call(engine, model, GEMMA4, method, max_tokens=80)


def test_gemmas_thinking_channel_is_read_as_reasoning_with_its_markers_kept(engine):
    """Gemma 4's thinking (enable_thinking): "<|channel>thought" ... "<channel|>", special tokens the engine keeps in
    the text of a chat answer, then read apart as reasoning_content, whole and streamed."""
    assert template_reasons(engine.tokenizer) is CHANNEL
    ids = engine.tokenizer.convert_tokens_to_ids(["<|channel>", "<channel|>"])
    assert engine.reasoning_markers == {"<|channel>": ids[0], "<channel|>": ids[1]}
    generation = asyncio.run(submitted(engine, {"enable_thinking": True}))
    assert generation.reasoning_tags is CHANNEL and generation.opens_reasoning is False
    assert generation.text.detokenizer.kept == {ids[0]: "<|channel>", ids[1]: "<channel|>"}
    # (with thinking off the template closes an empty block in the prompt: the answer is not inside one; a template
    # that leaves the block open in the prompt, as DeepSeek-R1's does its own, has the answer begin inside it)
    assert asyncio.run(submitted(engine, None)).opens_reasoning is False
    opening = gemma_tokenizer()
    opening.chat_template = GEMMA_TEMPLATE.replace("<|channel>thought\n<channel|>", "<|channel>thought\n")
    opened = ServingEngine(engine.target, opening, model_id="tiny", max_batch_size=2)
    try:
        assert asyncio.run(submitted(opened, None)).opens_reasoning is True
    finally:
        opened.close()
    answer = "<|channel>thought\nThe user wants weather.\n<channel|>It is sunny."
    chunks = [Chunk(answer[at:at + 7], 1) for at in range(0, len(answer), 7)] + [Chunk("", 0, "stop")]
    reply = _Reply("chat", "tiny", 5, None)
    reply.reasoning, reply.reasoning_tags = {0: False}, {0: CHANNEL}
    message = reply.whole([chunks])["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user wants weather.", "It is sunny.")
    deltas = [event["choices"][0]["delta"] for chunk in chunks for event in reply.events(chunk)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    # Through the server: the route reads each answer with its generation's tags.
    client = TestClient(create_app(ServerSettings(), Answering(engine, answer)))
    served = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "Weather?"}]}).json()["choices"][0]["message"]
    assert (served["reasoning_content"], served["content"]) == ("The user wants weather.", "It is sunny.")


class Answering:
    """``engine``'s routes, each request answered with ``text`` by a generation whose template writes Gemma's
    reasoning tags."""

    def __init__(self, engine, text: str) -> None:
        self.engine, self.text = engine, text

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def submit(self, request):
        text = self.text

        class Generation:
            num_prompt_tokens, method, echo_text, prompt_logprobs = 5, "ar", "", None
            opens_reasoning, reasoning_tags = False, CHANNEL

            async def __aiter__(self):
                yield Chunk(text, 3, "stop")

            def cancel(self) -> None:
                pass

        return Generation()


async def submitted(engine, template_kwargs):
    """A chat request's generation, cancelled once submitted (what it read of its prompt is all these tests ask)."""
    generation = await engine.submit(CompletionRequest(messages=({"role": "user", "content": "Weather?"},),
                                                       max_tokens=4, temperature=0, template_kwargs=template_kwargs))
    generation.cancel()
    return generation


def test_the_terminal_chat_keeps_a_gemma_answers_thinking_apart_from_its_content():
    """`jointspec chat` keeps each answer for the next turn's prompt: a message's text is read as text, so Gemma's
    channel tags (special tokens) in it would not be seen by the template that drops earlier thinking; the thinking
    goes apart instead. <think> answers, whose templates drop it from the text themselves, stay as written."""
    from jointspec.cli.chat import _Answer
    from jointspec.server.reasoning import THINK

    answer = _Answer()
    answer.text, answer.reasoning = "<|channel>thought\nhmm\n<channel|>Hello.", (False, CHANNEL)
    assert answer.message() == {"role": "assistant", "content": "Hello.", "reasoning_content": "hmm"}
    answer.text, answer.reasoning = "<think>hmm</think>Hello.", (False, THINK)
    assert answer.message() == {"role": "assistant", "content": "<think>hmm</think>Hello."}


def test_the_terminal_chats_turn_reads_its_answer_with_the_generations_tags(engine, capsys):
    """The turn (`jointspec chat`'s _answer) records its generation's reasoning, and keeps the answer so."""
    from jointspec.cli.chat import _Answer, _answer
    from jointspec.cli.main import build_parser

    args = build_parser().parse_args(["chat"])
    answer = _Answer()
    text = "<|channel>thought\nhmm\n<channel|>Hello."
    asyncio.run(_answer(Answering(engine, text), [{"role": "user", "content": "hi"}], args, 0, answer))
    assert answer.text == text and answer.message() == {"role": "assistant", "content": "Hello.",
                                                        "reasoning_content": "hmm"}
