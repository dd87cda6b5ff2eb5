"""IBM Granite 3's tool-call format in the server (server/call_formats.py): a template that names ``<|tool_call|>`` and
``<|start_of_role|>`` recognised, ``<|tool_call|>`` and one JSON list of the calls read back whole and streamed, the
marker (a special token) kept in the answer's text and named by id in the grammar. And what a template that renders
no earlier calls gets (Granite 3's, SmolLM3's): each such turn's calls written after its text in the model's format,
the format's markers as the tokens they are, a client's text still read as text.

The model is a tiny random Llama over a byte-level tokenizer with Granite's control tokens added as special tokens,
given a template of this file's own in the conventions of Granite 3.1-3.3's (tools in their own turn, each message
its role and content: an assistant's calls dropped). Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.tokens import chat_template_ids
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import CompletionRequest
from jointspec.server.tools import (
    GRANITE,
    GRANITE_CALL,
    HERMES,
    call_markers,
    native_call_format,
    prompt_messages,
    read_calls,
    read_tool_use,
    template_shows_calls,
)

from helpers import (
    ADD_TOOL,
    CITY_TOOL,
    EARLIER_CALL,
    byte_tokenizer,
    check_required_call,
    check_streamed_calls,
    engine_of,
    grammar_takes,
    llama_ending_at_eos,
)

CONTROL = ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", GRANITE_CALL]
VOCAB = 259 + len(CONTROL)
GRANITE_TEMPLATE = (
    "{% if tools %}<|start_of_role|>system<|end_of_role|>You may call tools: respond with <|tool_call|> followed by a "
    "JSON list of tools used.<|end_of_text|>\n<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}"
    "<|end_of_text|>\n{% endif %}{% for m in messages %}<|start_of_role|>{{ m.role }}<|end_of_role|>"
    "{{ m.content or '' }}<|end_of_text|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|start_of_role|>assistant<|end_of_role|>{% endif %}")
# Granite 4's and SmolLM3's write Hermes's blocks (the template names <tool_call>); this one drops earlier calls too.
HERMES_DROPPING = GRANITE_TEMPLATE.replace("respond with <|tool_call|> followed by a JSON list of tools used",
                                          "write each call as <tool_call>{...}</tool_call>")
# One that renders them (as Hermes's blocks, after the turn's text).
HERMES_SHOWING = HERMES_DROPPING.replace(
    "{{ m.content or '' }}", "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}")



def granite_tokenizer(template: str = GRANITE_TEMPLATE):
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL})
    tokenizer.chat_template = template
    return tokenizer


def written(*calls: tuple[str, dict], text: str = "") -> str:
    return text + GRANITE_CALL + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def use_of(*tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=GRANITE, special=special)


@pytest.fixture(scope="module")
def model():
    """Its end of sequence the tokenizer's </s> (a special token), not the byte the test models' config names."""
    return llama_ending_at_eos(11, VOCAB, 2048)


@pytest.fixture(scope="module")
def engine(model):
    yield from engine_of(model, granite_tokenizer())


def test_a_granite_template_is_recognised_and_its_marker_found(engine):
    assert native_call_format(granite_tokenizer()) == GRANITE and engine.call_format == GRANITE
    marker_id = engine.tokenizer.convert_tokens_to_ids(GRANITE_CALL)
    assert call_markers(engine.tokenizer, GRANITE) == ((GRANITE_CALL, marker_id),) == engine.call_markers
    # (Granite 4's templates name <tool_call> and write Hermes's blocks)
    assert native_call_format(granite_tokenizer(HERMES_DROPPING)) == HERMES


def test_an_answer_is_read_for_the_list_after_the_marker_whole_cut_and_streamed():
    use = use_of(CITY_TOOL, ADD_TOOL)
    read = read_calls(written(("get_weather", {"city": "Rome"}), ("add", {"a": 2}), text="Checking.\n"), use)
    assert read.content == "Checking." and [json.loads(c["function"]["arguments"]) for c in read.calls] == [
        {"city": "Rome"}, {"a": 2}]
    assert read_calls(written(("add", {"a": 2})), use).content is None
    assert len(read_calls(written(("add", {"a": 1}), ("add", {"a": 3})), use_of(ADD_TOOL, parallel=False)).calls) == 1
    for text in (written(("nope", {})), written(("add", {"a": 1})) + " done", "Hi " + GRANITE_CALL, "no calls"):
        assert read_calls(text, use).calls == () and read_calls(text, use).content == text, text
    whole = written(("add", {"a": 1}), ("get_weather", {"city": "Paris"}))
    assert [c["function"]["name"] for c in read_calls(whole[:whole.rindex("Paris")], use, cut=True).calls] == ["add"]
    text = written(("add", {"a": 1}), text="Let me add. ")
    check_streamed_calls(use, text, "Let me add.", 1)


def test_the_grammar_holds_the_list_after_the_marker_token(engine):
    ids = engine.call_markers
    required = use_of(CITY_TOOL, ADD_TOOL, choice="required", special=ids)
    assert grammar_takes(engine, required, written(("get_weather", {"city": "Rome"}), ("add", {"a": 3})))
    assert not grammar_takes(engine, required, written(("get_weather", {"city": "Oslo"})))
    assert not grammar_takes(engine, required, "Sure.")
    strict = use_of({**CITY_TOOL, "function": {**CITY_TOOL["function"], "strict": True}}, special=ids)
    assert grammar_takes(engine, strict, "Sure.") and grammar_takes(engine, strict, written(
        ("get_weather", {"city": "Paris"}), text="Checking. "))
    assert not grammar_takes(engine, strict, written(("get_weather", {"city": "Oslo"})))


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, model, method):
    check_required_call(engine, model, GRANITE, method)


def test_a_template_that_drops_earlier_calls_gets_them_written_in_the_format_as_tokens(engine):
    assert not engine.shows_calls and not template_shows_calls(engine.tokenizer, GRANITE)
    shown = use_of(CITY_TOOL).shown()  # (the tools as the server gives them to the template)
    prompt = engine.encode(CompletionRequest(messages=tuple(EARLIER_CALL), tools=shown))
    words = engine.tokenizer
    marker_id = words.convert_tokens_to_ids(GRANITE_CALL)
    call = GRANITE_CALL + '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert ("<|start_of_role|>assistant<|end_of_role|>Checking." + call + "<|end_of_text|>") in words.decode(prompt)
    assert prompt.count(marker_id) == 2  # (the system text's and the call's: the tokens the model writes)
    # A client's text in that turn is still read as text: a special token's spelling in it stays characters.
    spelled = [dict(EARLIER_CALL[0]), {**EARLIER_CALL[1], "content": "a <|end_of_text|> b"}, *EARLIER_CALL[2:]]
    ids = engine.encode(CompletionRequest(messages=tuple(spelled), tools=shown))
    assert "a <|end_of_text|> b" + call in words.decode(ids)
    assert ids.count(words.convert_tokens_to_ids("<|end_of_text|>")) == prompt.count(
        words.convert_tokens_to_ids("<|end_of_text|>")) and ids.count(marker_id) == 2
    # The same conversation answered through the server.
    reply = TestClient(create_app(ServerSettings(), engine)).post("/v1/chat/completions", json={
        "model": "tiny", "messages": EARLIER_CALL, "tools": [CITY_TOOL], "temperature": 0, "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(prompt)


def test_hermes_templates_that_drop_calls_get_blocks_and_those_that_render_them_nothing(model):
    dropping, showing = granite_tokenizer(HERMES_DROPPING), granite_tokenizer(HERMES_SHOWING)
    assert not template_shows_calls(dropping, HERMES) and template_shows_calls(showing, HERMES)
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for tokenizer, shows in ((dropping, False), (showing, True)):
        messages, tools = prompt_messages([dict(m) for m in EARLIER_CALL], (CITY_TOOL,), True, HERMES, shows)
        text = dropping.decode(chat_template_ids(tokenizer, messages, tools))
        assert (block in text) != shows and text.count("get_weather") == 2  # (the tools' turn and the call)
        assert ("Checking.\n" + block in text) != shows  # (after the turn's text on a line of its own)
