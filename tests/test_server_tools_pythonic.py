"""LiquidAI LFM2's tool-call format in the server (server/tools_pythonic.py): a template that lists the tools as LFM2's
do recognised, ``<|tool_call_start|>[name(key=value, ...)]<|tool_call_end|>`` read back with Python's parser (never
evaluated), earlier calls written for the template (which drops them), and required and strict calls held to their
schemas as Python literals by a grammar that names the markers by id.

The model is a tiny random Llama over a byte-level tokenizer with LFM2's control tokens added as special tokens, given
a template of this file's own in the conventions of LFM2's. Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import CompletionRequest, ServingEngine
from jointspec.server.tools import LFM2, native_call_format, read_calls, read_tool_use
from jointspec.server.tools_pythonic import CALL_END, CALL_START, python_literal, write

from helpers import byte_tokenizer, check_required_call, grammar_takes, llama_ending_at_eos

CONTROL = ["<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", CALL_START, CALL_END,
           "<|tool_response_start|>", "<|tool_response_end|>"]
# LFM2's conventions: the tools listed in the system turn between their markers; each message its role and text (an
# assistant's calls dropped); a result between the response markers.
TEMPLATE = (
    "{% set ns = namespace(system='') %}{% if messages[0].role == 'system' %}{% set ns.system = messages[0].content %}"
    "{% endif %}{% if tools %}{% set ns.system = ns.system + 'List of tools: <|tool_list_start|>' + (tools | tojson) "
    "+ '<|tool_list_end|>' %}{% endif %}{% if ns.system %}<|im_start|>system\n{{ ns.system }}<|im_end|>\n{% endif %}"
    "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{% if m.role == 'tool' %}"
    "<|tool_response_start|>{{ m.content }}<|tool_response_end|>{% else %}{{ m.content or '' }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "near": {"anyOf": [{"type": "string"},
                                                                                       {"type": "null"}]},
                                     "tags": {"type": "array", "items": {"type": "string"}},
                                     "box": {"type": "object", "properties": {"x": {"type": "number"}},
                                             "required": ["x"]}},
    "required": ["city"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}}, "required": ["text"]}}}


def lfm2_tokenizer(template: str = TEMPLATE):
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = template
    return tokenizer


def use_of(*tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=LFM2, special=special)


def calls(*written: str, text: str = "") -> str:
    return f"{text}{CALL_START}[{', '.join(written)}]{CALL_END}"


@pytest.fixture(scope="module")
def engine():
    served = ServingEngine(CausalLM(llama_ending_at_eos(13, 259 + len(CONTROL), 2048)), lfm2_tokenizer(),
                           model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def test_an_lfm2_template_is_recognised_and_its_markers_found(engine):
    assert engine.call_format == LFM2 and [spelling for spelling, _ in engine.call_markers] == [CALL_START, CALL_END]
    # (LFM2.5's templates list the tools as text)
    assert native_call_format(lfm2_tokenizer(TEMPLATE.replace("<|tool_list_start|>", "["))) == LFM2


def test_an_answer_is_read_with_pythons_parser_and_nothing_else_is_a_call():
    use = use_of(WEATHER, NOTE)
    read = read_calls(calls('get_weather(city="Rome", days=3, metric=True, near=None, tags=["a", \'b\'])',
                            "note(text='it\\'s \"fine\"')", text="Checking.\n"), use)
    assert read.content == "Checking." and [json.loads(call["function"]["arguments"]) for call in read.calls] == [
        {"city": "Rome", "days": 3, "metric": True, "near": None, "tags": ["a", "b"]}, {"text": "it's \"fine\""}]
    assert len(read_calls(calls('note(text="a")', 'note(text="b")'), use_of(NOTE, parallel=False)).calls) == 1
    # (a model that ends the answer without the end marker)
    assert read_calls(f'{CALL_START}[note(text="a")]', use).calls
    # (LFM2 may say what it does after its calls: that text joins the content)
    after = read_calls(calls('note(text="a")', text="Let me note.") + " Noting it now.", use)
    assert after.content == "Let me note.\nNoting it now." and len(after.calls) == 1
    for text in (calls('note("positional")'), calls('os.system(cmd="x")'), calls("note(text=open('f'))"),
                 calls('nope(a=1)'), calls("note(**kw)"), calls(""), calls('note(text="a"'), "no calls",
                 calls('note(text="a", text="b")'),
                 # (literals that are no JSON values)
                 calls("note(text=1j)"), calls("note(text={1, 2})"), calls('note(text=b"x")'),
                 calls("note(text=1e999)"), calls("note(text={1: 2})"), calls("note(text=...)")):
        assert read_calls(text, use).calls == () and read_calls(text, use).content == text, text
    assert json.loads(read_calls(calls('note(text=("a", 1))'), use).calls[0]["function"]["arguments"]) == {
        "text": ["a", 1]}
    # JSON's constants read as Python's (a model trained on both writes them at times); other names stay refused.
    spelled = read_calls(calls('get_weather(city="Rome", metric=true, near=null, tags={"on": false, "n": [null]})'),
                         use)
    assert json.loads(spelled.calls[0]["function"]["arguments"]) == {"city": "Rome", "metric": True, "near": None,
                                                                     "tags": {"on": False, "n": [None]}}
    assert read_calls(calls("note(text=nope)"), use).calls == ()
    assert read_calls(calls("note(text=True_)"), use).calls == ()
    cut = calls('note(text="a)b")', 'get_weather(city="Ro(")')[:-len(CALL_END) - 3]
    assert [call["function"]["name"] for call in read_calls(cut, use, cut=True).calls] == ["note"]


def test_written_calls_read_back_as_they_were():
    records = [{"name": "note", "arguments": {"text": "line\nand \"quotes\" \u00e9"}},
               {"name": "get_weather", "arguments": {"city": "Rome", "near": None, "metric": False,
                                                     "box": {"x": 1.5, "y": [True, None]}}}]
    read = read_calls(write(records), use_of(WEATHER, NOTE))
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in read.calls] == [
        (record["name"], record["arguments"]) for record in records]
    assert python_literal({"a": [True, None, 2]}) == '{"a": [True, None, 2]}'


def test_the_grammar_holds_each_value_to_its_schema_as_a_python_literal(engine):
    ids = engine.call_markers
    required = use_of(WEATHER, NOTE, choice="required", special=ids)
    for text, takes in [
        (calls('get_weather(city="Rome")'), True),
        (calls('get_weather(city="Paris", days=-2, metric=True, near="Nice", tags=["a", \'b\'], box={"x": 1.5})'),
         True),
        (calls('get_weather(city="Rome", near=None)', 'note(text="hi")'), True),
        (calls('get_weather(city="Oslo")'), False),  # (not in the enum)
        (calls('get_weather(days=2)'), False),  # (city is required)
        (calls('get_weather(city="Rome", metric=true)'), False),  # (JSON's spelling, not Python's)
        (calls('get_weather(city="Rome", days=2.5)'), False),
        (calls('get_weather(city="Rome", box={"y": 1})'), False),
        (calls('get_weather(city="Rome", other=1)'), False),  # (additionalProperties false)
        (calls('note(text="a\nb")'), False),  # (a line break inside a literal, or a CR, which Python refuses)
        (calls('note(text="a\rb")'), False),
        ("Sure.", False),
    ]:
        assert grammar_takes(engine, required, text) == takes, text
        if takes:  # (what the grammar takes reads as calls)
            assert read_calls(text, required).calls
    strict = use_of({**NOTE, "function": {**NOTE["function"], "strict": True}}, special=ids)
    assert grammar_takes(engine, strict, "Sure.") and grammar_takes(engine, strict, calls('note(text="x")', text="Ok "))
    assert not grammar_takes(engine, strict, calls("note(text=1)"))
    # (a tool that is not strict takes any arguments: any names Python's parser takes)
    loose = use_of({**NOTE, "function": {**NOTE["function"], "strict": True}}, WEATHER, special=ids)
    assert grammar_takes(engine, loose, calls("get_weather(anything=[1, {'a': None}], classy=2)"))
    assert not grammar_takes(engine, loose, calls("get_weather(class=1)"))


def test_a_function_or_parameter_that_python_cannot_write_is_refused_where_calls_are_held():
    hyphenated = {"type": "function", "function": {"name": "get-weather", "parameters": {"type": "object"}}}
    with pytest.raises(ValueError, match="cannot write a function named"):
        use_of(hyphenated, choice="required")
    assert use_of(hyphenated).choice == "auto"
    for name in ("class", "my-key", "2x"):
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {name: {"type": "string"}}}}}
        with pytest.raises(ValueError, match="cannot write a parameter named"):
            use_of(tool, choice="required")
        assert use_of(tool).choice == "auto"  # (free calls are read as the model writes them)


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, method):
    check_required_call(engine, engine.target.model, LFM2, method)


def test_an_earlier_call_is_written_for_the_template_that_drops_it(engine):
    assert not engine.shows_calls
    conversation = ({"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Rome", "metric": true}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    prompt = engine.encode(CompletionRequest(messages=conversation, tools=use_of(WEATHER).shown()))
    written = f'{CALL_START}[get_weather(city="Rome", metric=True)]{CALL_END}'
    assert f"<|im_start|>assistant\n{written}<|im_end|>" in engine.tokenizer.decode(prompt)
    assert prompt.count(engine.tokenizer.convert_tokens_to_ids(CALL_START)) == 1  # (the token, as the model writes it)
    reply = TestClient(create_app(ServerSettings(), engine)).post("/v1/chat/completions", json={
        "model": "tiny", "messages": list(conversation), "tools": [WEATHER], "temperature": 0, "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(prompt)
