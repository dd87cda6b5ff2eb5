"""Mistral's tool-call formats in the server (server/tools.py): templates that name ``[TOOL_CALLS]`` recognised, the
conversation rendered as they take it, the calls read back whole and streamed, the markers (special tokens) kept in
the answer's text, and calls forced by a grammar that names the markers by id.

The model is a tiny random Llama over a byte-level tokenizer with Mistral's control tokens added as special tokens,
given two templates of this file's own in the conventions of Mistral's: the v3 one (calls as one JSON list after
``[TOOL_CALLS]``, call ids of exactly 9 letters and digits, else the template raises) and the v11 one (each call
``[TOOL_CALLS]name[ARGS]{arguments}``). Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import IncrementalDetokenizer, chat_template_ids, decode_text
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine
from jointspec.server.tools import (
    MISTRAL_V3,
    MISTRAL_V11,
    CallStream,
    call_markers,
    native_call_format,
    prompt_messages,
    read_calls,
    read_tool_use,
)
from jointspec.server.tools_mistral import ARGS, CALL_ID, TOOL_CALLS

from helpers import byte_tokenizer, check_required_call, grammar_takes, llama_ending_at_eos

CONTROL = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", TOOL_CALLS, "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", ARGS, CALL_ID]
VOCAB = 259 + len(CONTROL)

# v3's conventions: the tools before the last user turn; a call turn one list of the calls, each with its id; a
# result names its call's id; ids of any other shape refused.
V3_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.role == 'system' %}[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls is defined %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    "{% if c.id is not defined or c.id | length != 9 %}{{ raise_exception('call ids must be 9 characters') }}"
    "{% endif %}{% set out = c.function | tojson %}{{ out[:-1] }}, \"id\": \"{{ c.id }}\"}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %} {{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('call ids must be 9 characters') }}{% endif %}"
    "[TOOL_RESULTS] {\"content\": {{ m.content }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")
# v11's: the tools first; a call turn's text, then each call as marker, name, [ARGS] and arguments; results bare.
V11_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role in ('user', 'system') %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.content is string %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}{% set a = c.function.arguments %}"
    "{% if a is not string %}{% set a = a | tojson %}{% endif %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ a }}"
    "{% endfor %}{% endif %}{{ eos_token }}"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")
# The v11 layout that shows call ids: [CALL_ID] and the id between a call's name and [ARGS], and beside a result; ids
# of any other shape refused, as mistral_common refuses them.
V11_IDS_TEMPLATE = V11_TEMPLATE.replace(
    "[TOOL_CALLS]{{ c.function.name }}[ARGS]",
    "{% if c.id | length != 9 %}{{ raise_exception('call ids must be 9 characters') }}{% endif %}"
    "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]").replace(
    "[TOOL_RESULTS]{{ m.content }}", "[TOOL_RESULTS]{{ m.tool_call_id }}[CALL_ID]{{ m.content }}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
                                  "additionalProperties": False}}}
# A conversation with two parallel calls (OpenAI's ids) and their results.
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "\"sunny\""},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "\"rain\""},
]


def mistral_tokenizer(template: str, special: bool = True, added: bool = False):
    """:func:`byte_tokenizer` with ``template`` and Mistral's control tokens as special tokens, as in Mistral's
    tokenizers (``added``: as tokens without the special flag, which a decode keeps; neither: no tokens, the markers
    spelled byte by byte)."""
    tokenizer = byte_tokenizer()
    if added:
        tokenizer.add_tokens(CONTROL)
    elif special:
        tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def model():
    """A tiny Llama whose end of sequence is the tokenizer's ``</s>`` (a special token, as in Mistral's models), not
    the byte that the test models' config names, which a decode would spell after the calls."""
    return llama_ending_at_eos(5, VOCAB)


@pytest.fixture(scope="module", params=[MISTRAL_V3, MISTRAL_V11])
def served(request, model):
    """(format, engine) for each of the two templates."""
    template = V3_TEMPLATE if request.param == MISTRAL_V3 else V11_TEMPLATE
    engine = ServingEngine(CausalLM(model), mistral_tokenizer(template), model_id="tiny", max_batch_size=4)
    yield request.param, engine
    engine.close()


def use_in(call_format: str, *tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=call_format, special=special)


def v3(*calls: tuple[str, dict], text: str = "") -> str:
    return text + TOOL_CALLS + " [" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


def v11(*calls: tuple[str, dict], text: str = "") -> str:
    return text + "".join(f"{TOOL_CALLS}{n}{ARGS}{json.dumps(a)}" for n, a in calls)


WRITE = {MISTRAL_V3: v3, MISTRAL_V11: v11}


def test_a_mistral_template_is_recognised_and_its_special_markers_found():
    assert native_call_format(mistral_tokenizer(V3_TEMPLATE)) == MISTRAL_V3
    assert native_call_format(mistral_tokenizer(V11_TEMPLATE)) == MISTRAL_V11
    v11_tokenizer = mistral_tokenizer(V11_TEMPLATE)
    ids = v11_tokenizer.convert_tokens_to_ids([TOOL_CALLS, ARGS, CALL_ID])
    assert call_markers(v11_tokenizer, MISTRAL_V11) == ((TOOL_CALLS, ids[0]), (ARGS, ids[1]), (CALL_ID, ids[2]))
    assert call_markers(mistral_tokenizer(V3_TEMPLATE), MISTRAL_V3) == ((TOOL_CALLS, ids[0]),)
    # (markers that are no token of the vocabulary are matched as text; other formats have none)
    assert call_markers(mistral_tokenizer(V11_TEMPLATE, special=False), MISTRAL_V11) == ()
    assert call_markers(v11_tokenizer, "hermes") == ()


def test_the_engine_keeps_the_markers_in_the_text_of_an_answer_read_for_calls(served):
    call_format, engine = served
    assert engine.call_format == call_format and engine.call_markers
    kept = {id_: text for text, id_ in engine.call_markers}
    ids = engine.tokenizer(v11(("add", {"a": 1}), text="Sum: "), add_special_tokens=False)["input_ids"]
    assert decode_text(engine.tokenizer, ids) == 'Sum: add{"a": 1}'  # (a decode skips special tokens)
    assert decode_text(engine.tokenizer, ids, kept) == 'Sum: [TOOL_CALLS]add' + (
        '[ARGS]{"a": 1}' if call_format == MISTRAL_V11 else '{"a": 1}')
    stream = IncrementalDetokenizer(engine.tokenizer, kept=kept)
    assert "".join(stream.push([token]) for token in ids) + stream.finish() == decode_text(engine.tokenizer, ids,
                                                                                          kept)


def test_the_v3_template_gets_call_ids_of_nine_characters_the_same_for_a_call_and_its_result():
    tokenizer = mistral_tokenizer(V3_TEMPLATE)
    messages, tools = prompt_messages(CONVERSATION, (WEATHER,), True, MISTRAL_V3)
    first, second = (call["id"] for call in messages[1]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and second == "abcDEF123"  # (an id of that shape is kept)
    assert [m["tool_call_id"] for m in messages[2:]] == [first, second]
    text = tokenizer.decode(chat_template_ids(tokenizer, messages, tools=tools))
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "' + first + '"}, '
            '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcDEF123"}]</s>') in text
    assert f'[TOOL_RESULTS] {{"content": "sunny", "call_id": "{first}"}}[/TOOL_RESULTS]' in text
    # (the template itself refuses an id of another shape: the reason for the derived ones)
    with pytest.raises(Exception, match="9 characters"):
        tokenizer.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False)


def test_the_v11_template_gets_each_call_after_its_markers_and_the_results():
    tokenizer = mistral_tokenizer(V11_TEMPLATE)
    messages, tools = prompt_messages(CONVERSATION, (WEATHER,), True, MISTRAL_V11)
    text = tokenizer.decode(chat_template_ids(tokenizer, messages, tools=tools))
    assert ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}</s>'
            '[TOOL_RESULTS]"sunny"[/TOOL_RESULTS][TOOL_RESULTS]"rain"[/TOOL_RESULTS]') in text
    assert text.startswith("<s>[AVAILABLE_TOOLS][{")
    # Where the layout shows ids, they are 9 characters too (the template refuses OpenAI's), a call's and its result's
    with_ids = mistral_tokenizer(V11_IDS_TEMPLATE)
    with pytest.raises(Exception, match="9 characters"):
        with_ids.apply_chat_template(CONVERSATION, tools=[WEATHER], tokenize=False)
    first = prompt_messages(CONVERSATION, (WEATHER,), True, MISTRAL_V11)[0][1]["tool_calls"][0]["id"]
    text = with_ids.decode(chat_template_ids(with_ids, messages, tools=tools))
    assert (f'[TOOL_CALLS]get_weather[CALL_ID]{first}[ARGS]{{"city": "Paris"}}' in text
            and f'[TOOL_RESULTS]{first}[CALL_ID]"sunny"' in text and len(first) == 9)
    # and an answer that writes its call's id reads as the call
    read = read_calls(f'{TOOL_CALLS}get_weather{CALL_ID}abcDEF123{ARGS}{{"city": "Rome"}}',
                      use_in(MISTRAL_V11, WEATHER))
    assert [c["function"]["arguments"] for c in read.calls] == ['{"city": "Rome"}']


@pytest.mark.parametrize("call_format", [MISTRAL_V3, MISTRAL_V11])
def test_an_answer_is_read_for_its_calls_after_the_marker_or_left_text(call_format):
    write, use = WRITE[call_format], use_in(call_format, WEATHER, ADD)
    read = read_calls(write(("get_weather", {"city": "Rome"}), ("add", {"a": 2}), text="Checking. \n"), use)
    assert read.content == "Checking." and [json.loads(c["function"]["arguments"]) for c in read.calls] == [
        {"city": "Rome"}, {"a": 2}]
    assert read_calls(write(("add", {"a": 2})), use).content is None
    one = read_calls(write(("add", {"a": 1}), ("add", {"a": 3})), use_in(call_format, ADD, parallel=False))
    assert [c["function"]["arguments"] for c in one.calls] == ['{"a": 1}']
    # Not calls: an unoffered tool, arguments that are no object, text after the calls, nothing after the marker.
    for text in (write(("nope", {})), write(("add", [1])), write(("add", {"a": 1})) + " done",
                 "Hi " + TOOL_CALLS, "no calls at all"):
        assert read_calls(text, use) == read_calls(text, use_in(call_format, WEATHER)) and not read_calls(
            text, use).calls and read_calls(text, use).content == text, text


@pytest.mark.parametrize("call_format", [MISTRAL_V3, MISTRAL_V11])
def test_an_answer_cut_by_its_length_keeps_the_calls_it_finished(call_format):
    whole = WRITE[call_format](("add", {"a": 1}), ("get_weather", {"city": "Paris"}))
    use = use_in(call_format, WEATHER, ADD)
    cut = whole[:whole.rindex("Paris")]
    assert [c["function"]["name"] for c in read_calls(cut, use, cut=True).calls] == ["add"]
    assert read_calls(cut, use).calls == ()  # (not cut by its length: not calls)
    assert read_calls(whole[:whole.index("add") + 3], use, cut=True).calls == ()  # (no call finished)


@pytest.mark.parametrize("call_format", [MISTRAL_V3, MISTRAL_V11])
def test_a_stream_sends_the_text_before_the_marker_as_it_comes_and_the_whole_answers_content(call_format):
    use = use_in(call_format, WEATHER, ADD)
    for text in (WRITE[call_format](("add", {"a": 1}), text="Let me add. "), "[TOOL_ no call [TOOL", "plain text"):
        for size in (1, 3, 7):
            stream = CallStream(use)
            sent = [stream.feed(text[at:at + size]) for at in range(0, len(text), size)]
            rest, calls = stream.finish()
            whole = read_calls(text, use)
            assert "".join(sent) + rest == (whole.content or "") and len(calls) == len(whole.calls)
            if whole.calls:  # (the text before the calls went out before the end)
                assert "".join(sent) == "Let me add."


def test_the_grammar_takes_the_formats_calls_of_the_offered_tools_with_the_markers_as_tokens(served):
    call_format, engine = served
    write, special = WRITE[call_format], engine.call_markers
    both = use_in(call_format, WEATHER, ADD, choice="required", special=special)
    two = write(("get_weather", {"city": "Rome"}), ("add", {"a": 3}))
    assert grammar_takes(engine, both, write(("add", {"a": 3}))) and grammar_takes(engine, both, two)
    assert not grammar_takes(engine, use_in(call_format, WEATHER, ADD, choice="required", parallel=False,
                                            special=special), two)
    for wrong in (write(("add", {"a": 4})), write(("nope", {})), "text", "Hi " + write(("add", {"a": 1}))):
        assert not grammar_takes(engine, both, wrong), wrong
    named = use_in(call_format, WEATHER, ADD, choice={"type": "function", "function": {"name": "add"}},
                   special=special)
    assert grammar_takes(engine, named, write(("add", {"a": 1}))) and not grammar_takes(
        engine, named, write(("get_weather", {"city": "Rome"})))
    # strict auto: any text, then calls whose strict arguments the schema accepts, or none
    strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
    held = use_in(call_format, WEATHER, strict, special=special)
    for text in ("Just text.", "", write(("add", {"a": 2}), text="Sum: "), write(("get_weather", {"city": "Oslo"}))):
        assert grammar_takes(engine, held, text), text
    assert not grammar_takes(engine, held, write(("add", {"a": 9}), text="Sum: "))
    # (the marker's text, not its token, is no call: a special token's spelling is no marker; and the text before
    # the calls may not spell it, since the reader takes its first spelling for where the calls begin)
    spelled = engine.tokenizer(write(("add", {"a": 1})), add_special_tokens=False,
                               split_special_tokens=True)["input_ids"]
    state = engine.grammar(both.output_format()).start()
    assert not state.allowed()[spelled[0]]
    state = engine.grammar(held.output_format()).start()
    for token in spelled[:len(TOOL_CALLS) - 1]:
        assert state.allowed()[token]
        state.advance([token])
    assert not state.allowed()[spelled[len(TOOL_CALLS) - 1]]
    # The forms of the two layouts the grammar takes besides the templates': tekken's v3 list without the space, a
    # v11 call with its id.
    if call_format == MISTRAL_V3:
        assert grammar_takes(engine, both, v3(("add", {"a": 3})).replace("] [", "]["))
    else:
        with_id = f'{TOOL_CALLS}add{CALL_ID}abcDEF123{ARGS}{{"a": 3}}'
        assert grammar_takes(engine, both, with_id) and not grammar_takes(engine, both, with_id.replace("123", "12"))


@pytest.mark.parametrize("added", [False, True])
def test_a_marker_that_is_no_token_or_a_plain_added_one_is_held_too(model, added):
    tokenizer = mistral_tokenizer(V11_TEMPLATE, special=False, added=added)
    engine = ServingEngine(CausalLM(model), tokenizer, model_id="tiny", max_batch_size=2)
    try:
        special = engine.call_markers
        assert bool(special) == added  # (an added token is named by id, as a special one is)
        strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
        held = use_in(MISTRAL_V11, WEATHER, strict, special=special)
        assert grammar_takes(engine, held, v11(("add", {"a": 2}), text="Sum: "))
        assert not grammar_takes(engine, held, v11(("add", {"a": 9}), text="Sum: "))
        assert grammar_takes(engine, use_in(MISTRAL_V11, ADD, choice="required", special=special),
                             v11(("add", {"a": 2})))
    finally:
        engine.close()


def body_with(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
            "max_tokens": 80, **extra}


@pytest.mark.parametrize("method", ["ar", "default"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(served, model, method):
    """The server decodes the call through the grammar, keeps the markers in the text, and reads the calls: the
    tokens plain constrained decoding gives the same prompt (every method decodes a grammar losslessly)."""
    call_format, engine = served
    check_required_call(engine, model, call_format, method, max_tokens=80)



def test_a_conversation_with_openai_call_ids_and_their_results_is_answered(served):
    """(v3's template raises on OpenAI's ids: the request would be a 400 without the derived ones)"""
    call_format, engine = served
    client = TestClient(create_app(ServerSettings(), engine))
    reply = client.post("/v1/chat/completions", json=body_with(messages=CONVERSATION, tools=[WEATHER],
                                                                max_tokens=8))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(chat_template_ids(
        engine.tokenizer, *prompt_messages(CONVERSATION, (WEATHER,), True, call_format)))
