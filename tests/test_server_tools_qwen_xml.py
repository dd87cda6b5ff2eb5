"""Qwen3-Coder's and Qwen3.5's tool-call format in the server (server/tools.py): ``<tool_call>`` blocks that hold a
``<function=NAME>`` with its ``<parameter=KEY>`` values as text, not JSON. A template that writes calls so is
recognised (it names ``<tool_call>`` too, and was taken for Hermes's before), its answers are read with their values
typed by the tool's schema, and required calls decode through a grammar of that format.

The model is conftest's tiny random Llama with its byte-level tokenizer, given a template of this file's own in the
conventions of Qwen3.5's. Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import chat_template_ids
from jointspec.server.engine import ServingEngine
from jointspec.server.tools import (
    HERMES,
    QWEN3_CODER,
    CallStream,
    ToolError,
    native_call_format,
    prompt_messages,
    read_calls,
    read_tool_use,
)

from helpers import check_required_call, grammar_takes, tokenizer_with

# Qwen3.5's conventions: the tools and the format in the system turn; each earlier call a block of its own after the
# turn's text, a value as text where it is a string or number (Python's spelling: True), as JSON where it is an object
# or a list; results as a user turn.
QWEN_XML_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function so:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{% set c = c.function %}{{ '\\n' }}<tool_call>\n<function={{ c.name }}>\n"
    "{% for k, v in c.arguments | items %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"], "additionalProperties": False}}}
WRITE = {"type": "function", "function": {
    "name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "text": {"type": "string"}, "options": {"type": "object"},
        "lines": {"$ref": "#/$defs/count"}, "tag": {"$ref": "#/$defs/tag"}}, "required": ["path", "text"],
        "$defs": {"count": {"type": "integer"}, "tag": {"type": "string"}}}}}


def call(function: str, **values) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function={function}>\n{parameters}</function>\n</tool_call>"


def use_of(*tools, choice=None, parallel=None):
    return read_tool_use(list(tools), choice, parallel, call_format=QWEN3_CODER)


@pytest.fixture(scope="module")
def engine(long_byte_model):
    served = ServingEngine(CausalLM(long_byte_model), tokenizer_with(QWEN_XML_TEMPLATE), model_id="tiny",
                           max_batch_size=4)
    yield served
    served.close()


def test_a_template_that_writes_function_blocks_is_recognised_and_renders_the_calls_it_reads():
    tokenizer = tokenizer_with(QWEN_XML_TEMPLATE)
    assert native_call_format(tokenizer) == QWEN3_CODER
    assert native_call_format(tokenizer_with("{{ tools }}<tool_call>{{ messages }}")) == HERMES  # (JSON blocks)
    conversation = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Rome", "days": 2, "metric": True})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    messages, tools = prompt_messages(conversation, (WEATHER,), True, QWEN3_CODER)
    text = tokenizer.decode(chat_template_ids(tokenizer, messages, tools=tools))
    written = ("<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
               "<parameter=metric>\nTrue\n</parameter>\n")
    assert f"Checking.\n{call('get_weather', city='Rome', days=2, metric=True)}" in text and written in text
    # What the template wrote reads back as the call that was sent (its values typed by the schema).
    start = text.index("Checking.\n")
    turn = text[start:text.index("</tool_call>", start) + len("</tool_call>")]
    read = read_calls(turn, use_of(WEATHER))
    assert read.content == "Checking." and json.loads(read.calls[0]["function"]["arguments"]) == {
        "city": "Rome", "days": 2, "metric": True}


def test_values_are_typed_by_the_schema_and_text_keeps_its_lines():
    code = "def f(x):\n    return {'a': [x]}\n"
    read = read_calls(call("write_file", path="a.py", text=code, options='{"mode": "w"}', lines="3", tag="7") +
                      "\n" + call("get_weather", city="Paris", metric="false"), use_of(WEATHER, WRITE))
    assert read.content is None and [json.loads(c["function"]["arguments"]) for c in read.calls] == [
        {"path": "a.py", "text": code, "options": {"mode": "w"}, "lines": 3, "tag": "7"},
        {"city": "Paris", "metric": False}]
    # A value that is not the JSON its schema asks for stays text (auto reads what the model wrote, unvalidated).
    loose = read_calls(call("get_weather", city="Oslo", days="two"), use_of(WEATHER))
    assert json.loads(loose.calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": "two"}


@pytest.mark.parametrize("text", [
    call("nope", a="1"),  # an unoffered tool
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>",  # Hermes's JSON
    call("get_weather", city="Rome").replace("</function>\n", ""),
    "<tool_call>\n<function=get_weather>\n<function=add>\n</function>\n</tool_call>",  # two functions in one block
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome",  # an unended value
])
def test_a_block_that_does_not_read_as_a_call_leaves_the_answer_text(text):
    assert read_calls("Sure. " + text, use_of(WEATHER)).calls == () and read_calls(
        "Sure. " + text, use_of(WEATHER)).content == "Sure. " + text


def test_the_reader_takes_what_vllms_reads_of_a_call_written_loosely():
    use = use_of(WEATHER)
    # a value missing its closing tag ends at the next parameter; a parameter written twice keeps its last value; a
    # value may hold the closing tag's text where no parameter or function end follows it; the last block's closing
    # tag may be missing at the answer's end
    loose = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>")
    assert [json.loads(c["function"]["arguments"]) for c in read_calls(loose, use).calls] == [
        {"city": "Rome", "days": 3}]
    held = call("write_file", path="a", text="see </parameter> here")
    assert json.loads(read_calls(held, use_of(WRITE)).calls[0]["function"]["arguments"])["text"] == \
        "see </parameter> here"


OPTIONAL = {"type": "function", "function": {"name": "find", "parameters": {
    "type": "object", "properties": {
        "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "tags": {"anyOf": [
            {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "name": {"type": ["string", "null"]}, "flag": {"$ref": "#/definitions/Flag"}, "x": {"type": "number"}},
    "required": ["n"], "additionalProperties": False,
    "definitions": {"Flag": {"type": "boolean"}}}}}


def test_unions_and_older_definitions_are_typed_as_their_branches_and_round_trip_through_the_template():
    """Optional[int] and Optional[list] (pydantic's anyOf with null), a type list with null, a reference into the
    older draft's definitions (pydantic v1's, zod's): each read as the JSON its branches take, null spelled either
    way; and what the template writes of a call reads back as that call."""
    use = use_of(OPTIONAL)
    read = read_calls(call("find", n="5", tags='["a", "b"]', name="None", flag="True", x="NaN"), use)
    assert json.loads(read.calls[0]["function"]["arguments"]) == {"n": 5, "tags": ["a", "b"], "name": None,
                                                                  "flag": True, "x": "NaN"}  # (NaN is no JSON)
    sent = {"n": 5, "tags": ["a", "b"], "name": None, "flag": False}
    tokenizer = tokenizer_with(QWEN_XML_TEMPLATE)
    conversation = [{"role": "user", "content": "Find."}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "find", "arguments": json.dumps(sent)}}]}]
    text = tokenizer.decode(chat_template_ids(tokenizer, *prompt_messages(conversation, (OPTIONAL,), True,
                                                                          QWEN3_CODER)))
    block = text[text.rindex("<tool_call>"):text.rindex("</tool_call>") + len("</tool_call>")]
    assert json.loads(read_calls(block, use).calls[0]["function"]["arguments"]) == sent


def test_the_grammar_holds_unions_definitions_python_spellings_and_open_schemas(engine):
    held = use_of(OPTIONAL, choice="required")
    for values in ({"n": "5"}, {"n": "None"}, {"n": "null", "tags": '["a"]', "name": "any text", "flag": "True"},
                   {"n": "1", "flag": "false", "x": "2.5"}):
        assert grammar_takes(engine, held, call("find", **values)), values
    for values in ({"n": "abc"}, {"n": "5", "flag": "yes"}, {"n": "5", "other": "1"}, {"n": "5", "x": "NaN"},
                   {"n": "5", "name": "a</parameter>b"}, {"n": "5", "name": "a\n<parameter=b"}):
        # (a text value may not hold the closing tag, nor what the reader takes for a missing one's place)
        assert not grammar_takes(engine, held, call("find", **values)), values
    # An open schema (no additionalProperties: false) takes other parameters after its own, as text.
    open_tool = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}}}}}
    assert grammar_takes(engine, use_of(open_tool, choice="required"), call("run", cmd="ls", cwd="/tmp", env="x"))
    assert not grammar_takes(engine, use_of(open_tool, choice="required"), call("run", **{"a<b": "1"}))
    # ... but none of its own again, where its schema would refuse the value (an integer's "abc", as another key).
    counted = {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}, "n": {"type": "integer"}}}}}
    assert grammar_takes(engine, use_of(counted, choice="required"), call("run", cmd="ls", n="2", cwd="/tmp"))
    assert not grammar_takes(engine, use_of(counted, choice="required"), call("run", cmd="ls", n="abc"))
    assert not grammar_takes(engine, use_of(counted, choice="required"), call("run", cwd="/", cmd="ls"))
    assert not grammar_takes(engine, use_of(counted, choice="required"), call("run", cmd="ls", **{" n": "abc"}))
    # A property name the format cannot write is refused with the request, naming the tool.
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a>b": {"type": "string"}}}}}
    with pytest.raises(ToolError) as refused:
        use_of(bad, choice="required")
    assert refused.value.param == "tools.0.function.parameters"


def test_a_cut_answer_keeps_its_finished_calls_and_a_stream_sends_the_text_before_them():
    use = use_of(WEATHER)
    whole = "Let me check.\n" + call("get_weather", city="Rome") + "\n" + call("get_weather", city="Paris")
    cut = whole[:whole.rindex("Paris")]
    assert [json.loads(c["function"]["arguments"]) for c in read_calls(cut, use, cut=True).calls] == [
        {"city": "Rome"}]
    # (a last call whose function ended, cut before its closing tag, reads as it does where the answer ended there)
    ended = whole[:whole.rindex("</tool_call>")]
    functions = [[c["function"] for c in read_calls(ended, use, cut=cut).calls] for cut in (True, False)]
    assert functions[0] == functions[1] and len(functions[0]) == 2
    for size in (1, 4, 9):
        stream = CallStream(use)
        sent = "".join(stream.feed(whole[at:at + size]) for at in range(0, len(whole), size))
        rest, calls = stream.finish()
        assert sent == "Let me check." and rest == "" and len(calls) == 2


def test_the_grammar_takes_calls_in_the_format_with_values_the_schema_accepts_and_nothing_else(engine):
    both = use_of(WEATHER, WRITE, choice="required")
    for text in (call("get_weather", city="Rome"), call("get_weather", city="Paris", days="3", metric="true"),
                 call("write_file", path="a b.py", text="line 1\n  line 2 </param\n", lines="2"),
                 call("get_weather", city="Rome") + "\n" + call("write_file", path="x", text="")):
        assert grammar_takes(engine, both, text), text
    for text in (call("get_weather", city="Oslo"), call("get_weather", days="3"),  # not in the enum; city missing
                 call("get_weather", city="Rome", days="three"), call("write_file", path="x", text="a", lines="2.5"),
                 call("get_weather", days="3", city="Rome"),  # (the properties' order)
                 "Sure. " + call("get_weather", city="Rome"), call("nope")):
        assert not grammar_takes(engine, both, text), text
    named = use_of(WEATHER, WRITE, choice={"type": "function", "function": {"name": "write_file"}})
    assert not grammar_takes(engine, named, call("get_weather", city="Rome"))
    assert not grammar_takes(engine, use_of(WEATHER, choice="required", parallel=False),
                             call("get_weather", city="Rome") + "\n" + call("get_weather", city="Paris"))
    # strict auto: text, then calls; the strict tool's values held to its schema, the other's any text
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    held = use_of(strict, WRITE)
    for text in ("Just text.", "Ok.\n" + call("get_weather", city="Rome"), call("write_file", anything="at all")):
        assert grammar_takes(engine, held, text), text
    assert not grammar_takes(engine, held, "Ok.\n" + call("get_weather", city="Oslo"))


@pytest.mark.parametrize("method", ["ar", "default"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, long_byte_model,
                                                                                     method):
    check_required_call(engine, long_byte_model, QWEN3_CODER, method)
