"""NVIDIA Nemotron Nano 2's tool-call format in the server (server/call_formats.py): a template that names
``<TOOLCALL>`` and ``</TOOLCALL>`` recognised, one JSON list of the calls between them read back whole and streamed
(text after the closing marker joining the content), the markers (special tokens here) kept in the answer's text and
named by id in the grammar, and an earlier call rendered by the template itself.

The model is a tiny random Llama over a byte-level tokenizer with Nemotron's control tokens added as special tokens,
given a template of this file's own in the conventions of Nemotron Nano 2's (whose licence keeps it out of the
repository; the real one was checked by hand, docs/lab/benchmarks.md section 69). Greedy throughout: nothing can
fail by chance.
"""

from __future__ import annotations

import json

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.server.engine import CompletionRequest, ServingEngine
from jointspec.server.tools import (
    NEMOTRON,
    TOOLCALL_CLOSE,
    TOOLCALL_OPEN,
    CallStream,
    call_markers,
    native_call_format,
    read_calls,
    read_tool_use,
)

from helpers import byte_tokenizer, check_required_call, grammar_takes, llama_ending_at_eos

CONTROL = ["<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", TOOLCALL_OPEN, TOOLCALL_CLOSE]
VOCAB = 259 + len(CONTROL)
NEMOTRON_TEMPLATE = (
    "<SPECIAL_10>System\n{% if tools %}You can use the following tools to assist the user if required:\n"
    "<AVAILABLE_TOOLS>{{ tools | tojson }}</AVAILABLE_TOOLS>\n\nIf you decide to call any tool(s), use the following "
    'format:\n<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}]</TOOLCALL>{% endif %}\n\n'
    "{% for m in messages %}{% if m.role == 'tool' %}<SPECIAL_11>User\n<TOOL_RESPONSE>[{{ m.content }}]"
    "</TOOL_RESPONSE>\n{% else %}<SPECIAL_11>{{ m.role | capitalize }}\n{{ m.content or '' }}{% if m.tool_calls %}"
    '<TOOLCALL>[{% for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": '
    "{% if c.function.arguments is string %}{{ c.function.arguments }}{% else %}{{ c.function.arguments | tojson }}"
    "{% endif %}}{% if not loop.last %}, {% endif %}{% endfor %}]</TOOLCALL>{% endif %}\n"
    "<SPECIAL_12>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<SPECIAL_11>Assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                          "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
                                  "additionalProperties": False}}}
EARLIER = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "Checking.", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
           {"role": "user", "content": "And Rome?"}]


def nemotron_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = NEMOTRON_TEMPLATE
    return tokenizer


def written(*calls: tuple[str, dict], text: str = "", after: str = "") -> str:
    return text + TOOLCALL_OPEN + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + TOOLCALL_CLOSE + after


def use_of(*tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=NEMOTRON, special=special)


@pytest.fixture(scope="module")
def model():
    return llama_ending_at_eos(13, VOCAB, 2048)


@pytest.fixture(scope="module")
def engine(model):
    served = ServingEngine(CausalLM(model), nemotron_tokenizer(), model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def test_a_nemotron_template_is_recognised_and_its_markers_found(engine):
    assert native_call_format(nemotron_tokenizer()) == NEMOTRON and engine.call_format == NEMOTRON
    ids = {spelling: engine.tokenizer.convert_tokens_to_ids(spelling) for spelling in (TOOLCALL_OPEN, TOOLCALL_CLOSE)}
    assert dict(call_markers(engine.tokenizer, NEMOTRON)) == ids == dict(engine.call_markers)


def test_an_answer_is_read_for_the_list_between_the_markers_whole_cut_and_streamed():
    use = use_of(WEATHER, ADD)
    read = read_calls(written(("get_weather", {"city": "Rome"}), ("add", {"a": 2}), text="Checking.\n"), use)
    assert read.content == "Checking." and [json.loads(c["function"]["arguments"]) for c in read.calls] == [
        {"city": "Rome"}, {"a": 2}]
    assert read_calls(written(("add", {"a": 2})), use).content is None
    # Text after the closing marker joins the content, on a line of its own.
    assert read_calls(written(("add", {"a": 2}), text="First. ", after=" Then more."), use).content == (
        "First.\nThen more.")
    assert len(read_calls(written(("add", {"a": 1}), ("add", {"a": 3})), use_of(ADD, parallel=False)).calls) == 1
    for text in (written(("nope", {})), written(("add", {"a": 1}))[:-len(TOOLCALL_CLOSE)] + " done",
                 "Hi " + TOOLCALL_OPEN, TOOLCALL_OPEN + '[{"name": "add", "arguments": {"a": 1}}] x' + TOOLCALL_CLOSE,
                 "no calls"):
        assert read_calls(text, use).calls == () and read_calls(text, use).content == text, text
    # An answer that ends its list without the closing marker still reads; one cut mid-call keeps the calls before.
    assert len(read_calls(written(("add", {"a": 1}))[:-len(TOOLCALL_CLOSE)], use).calls) == 1
    whole = written(("add", {"a": 1}), ("get_weather", {"city": "Paris"}))
    assert [c["function"]["name"] for c in read_calls(whole[:whole.rindex("Paris")], use, cut=True).calls] == ["add"]
    assert read_calls(whole[:whole.rindex("Paris")], use).calls == ()  # (not cut: no call was finished)
    # Cut inside the closing marker (spelled as text), the list before it stands.
    assert len(read_calls(whole[:-4], use, cut=True).calls) == 2 and read_calls(whole[:-4], use).calls == ()
    # The list is read as JSON first: the marker's spelling inside an argument is text.
    note = use_of({"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}}}})
    spelled = written(("note", {"text": "a" + TOOLCALL_CLOSE + "b"}), after=" ok")
    assert [json.loads(c["function"]["arguments"]) for c in read_calls(spelled, note).calls] == [
        {"text": "a" + TOOLCALL_CLOSE + "b"}] and read_calls(spelled, note).content == "ok"
    text = written(("add", {"a": 1}), text="Let me add. ")
    for size in (1, 4):
        stream = CallStream(use)
        sent = "".join(stream.feed(text[at:at + size]) for at in range(0, len(text), size))
        rest, calls = stream.finish()
        assert sent == "Let me add." and rest == "" and len(calls) == 1


def test_the_grammar_holds_the_list_between_the_marker_tokens(engine):
    ids = engine.call_markers
    required = use_of(WEATHER, ADD, choice="required", special=ids)
    assert grammar_takes(engine, required, written(("get_weather", {"city": "Rome"}), ("add", {"a": 3})))
    assert not grammar_takes(engine, required, written(("get_weather", {"city": "Rome"}))[:-len(TOOLCALL_CLOSE)])
    assert not grammar_takes(engine, required, written(("get_weather", {"city": "Oslo"})))
    assert not grammar_takes(engine, required, "Sure.")
    strict = use_of({**WEATHER, "function": {**WEATHER["function"], "strict": True}}, special=ids)
    assert grammar_takes(engine, strict, "Sure.") and grammar_takes(engine, strict, written(
        ("get_weather", {"city": "Paris"}), text="Checking. "))
    assert not grammar_takes(engine, strict, written(("get_weather", {"city": "Oslo"})))


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, model, method):
    check_required_call(engine, model, NEMOTRON, method)


def test_the_template_renders_an_earlier_call_in_its_format(engine):
    assert engine.shows_calls
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(
        messages=tuple(EARLIER), tools=use_of(WEATHER).shown())))
    assert ('<SPECIAL_11>Assistant\nChecking.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
            "</TOOLCALL>") in prompt and "<TOOL_RESPONSE>[sunny]</TOOL_RESPONSE>" in prompt
