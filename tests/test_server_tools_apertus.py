"""Swiss AI Apertus's tool-call format in the server (server/call_formats.py): a template that names
``<|tools_prefix|>`` and ``<|tools_suffix|>`` recognised, one JSON list between them whose items name the function as
their one key read back whole and streamed, the markers (special tokens) kept in the answer's text and named by id in
the grammar, and an earlier call rendered by the template itself.

The model is a tiny random Llama over a byte-level tokenizer with Apertus's control tokens added as special tokens,
given a template of this file's own in the conventions of Apertus's (without its deliberation, so that a required
call is the call alone; the real template is checked in tests/test_server_real_templates.py). Greedy throughout:
nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.server.engine import CompletionRequest, ServingEngine
from jointspec.server.tools import (
    APERTUS,
    TOOLS_PREFIX,
    TOOLS_SUFFIX,
    CallStream,
    call_markers,
    native_call_format,
    read_calls,
    read_tool_use,
)

from helpers import byte_tokenizer, check_required_call, grammar_takes, llama_ending_at_eos

CONTROL = ["<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>", TOOLS_PREFIX, TOOLS_SUFFIX]
VOCAB = 259 + len(CONTROL)
APERTUS_TEMPLATE = (
    "{% if tools %}Tool Capabilities:\n{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}<|user_start|>{{ m.content }}<|user_end|>{% elif m.role == 'assistant' %}"
    "<|assistant_start|>{{ m.content or '' }}{% if m.tool_calls %}<|tools_prefix|>[{% for c in m.tool_calls %}"
    '{"{{ c.function.name }}": {{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]'
    "<|tools_suffix|>{% endif %}{% elif m.role == 'tool' %}[{{ m.content }}]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant_start|>{% endif %}")

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


def apertus_tokenizer():
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = APERTUS_TEMPLATE
    return tokenizer


def written(*calls: tuple[str, dict], text: str = "", after: str = "") -> str:
    return text + TOOLS_PREFIX + json.dumps([{n: a} for n, a in calls]) + TOOLS_SUFFIX + after


def use_of(*tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=APERTUS, special=special)


@pytest.fixture(scope="module")
def model():
    return llama_ending_at_eos(17, VOCAB, 2048)


@pytest.fixture(scope="module")
def engine(model):
    served = ServingEngine(CausalLM(model), apertus_tokenizer(), model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def test_an_apertus_template_is_recognised_and_its_markers_found(engine):
    assert native_call_format(apertus_tokenizer()) == APERTUS and engine.call_format == APERTUS
    ids = {spelling: engine.tokenizer.convert_tokens_to_ids(spelling) for spelling in (TOOLS_PREFIX, TOOLS_SUFFIX)}
    assert dict(call_markers(engine.tokenizer, APERTUS)) == ids == dict(engine.call_markers)


def test_an_answer_is_read_for_the_list_of_named_calls_whole_cut_and_streamed():
    use = use_of(WEATHER, ADD)
    read = read_calls(written(("get_weather", {"city": "Rome"}), ("add", {"a": 2}), text="Checking.\n"), use)
    assert read.content == "Checking." and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                            for c in read.calls] == [("get_weather", {"city": "Rome"}),
                                                                     ("add", {"a": 2})]
    assert read_calls(written(("add", {"a": 2})), use).content is None
    assert read_calls(written(("add", {"a": 2}), text="First. ", after=" Then more."), use).content == (
        "First.\nThen more.")
    assert len(read_calls(written(("add", {"a": 1}), ("add", {"a": 3})), use_of(ADD, parallel=False)).calls) == 1
    two_keys = TOOLS_PREFIX + '[{"add": {"a": 1}, "get_weather": {"city": "Rome"}}]' + TOOLS_SUFFIX
    openai_shaped = TOOLS_PREFIX + '[{"name": "add", "arguments": {"a": 1}}]' + TOOLS_SUFFIX
    for text in (written(("nope", {})), written(("add", 1)), two_keys, openai_shaped, "Hi " + TOOLS_PREFIX,
                 "no calls"):
        assert read_calls(text, use).calls == () and read_calls(text, use).content == text, text
    whole = written(("add", {"a": 1}), ("get_weather", {"city": "Paris"}))
    assert [c["function"]["name"] for c in read_calls(whole[:whole.rindex("Paris")], use, cut=True).calls] == ["add"]
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
    assert not grammar_takes(engine, required, written(("get_weather", {"city": "Rome"}))[:-len(TOOLS_SUFFIX)])
    assert not grammar_takes(engine, required, written(("get_weather", {"city": "Oslo"})))
    assert not grammar_takes(engine, required, written(("get_weather", {"a": 1})))
    assert not grammar_takes(engine, required, "Sure.")
    strict = use_of({**WEATHER, "function": {**WEATHER["function"], "strict": True}}, special=ids)
    assert grammar_takes(engine, strict, "Sure.") and grammar_takes(engine, strict, written(
        ("get_weather", {"city": "Paris"}), text="Checking. "))
    assert not grammar_takes(engine, strict, written(("get_weather", {"city": "Oslo"})))


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, model, method):
    check_required_call(engine, model, APERTUS, method)


def test_the_template_renders_an_earlier_call_in_its_format(engine):
    assert engine.shows_calls
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(
        messages=tuple(EARLIER), tools=use_of(WEATHER).shown())))
    assert ('<|assistant_start|>Checking.<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>[sunny]'
            in prompt)
