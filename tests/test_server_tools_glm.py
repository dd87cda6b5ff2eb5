"""GLM-4.5-4.7's tool-call format in the server (server/tools_glm.py, server/call_formats.py): a template that names
``<arg_key>`` besides ``<tool_call>`` recognised (not taken for Hermes's), a call's name and its key and value pairs
read back whole and streamed in both layouts the templates write (GLM-4.6's on lines of their own, GLM-4.7's
without line breaks), each value typed by the tool's schema, the tags (special tokens in GLM's tokenizers) kept in
the answer's text and named by id in the grammar, or matched as text where they are not tokens.

The model is a tiny random Llama over a byte-level tokenizer with GLM's control tokens added as special tokens,
given a template of this file's own in GLM-4.7's conventions without its thinking (so that a required call is the
call alone; the real template is checked in tests/test_server_real_templates.py). Greedy throughout: nothing can
fail by chance.
"""

from __future__ import annotations

import json

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.server.engine import CompletionRequest, ServingEngine
from jointspec.server.tools import (
    GLM,
    HERMES,
    ToolError,
    call_markers,
    native_call_format,
    read_calls,
    read_tool_use,
)

from helpers import (
    CITY_TOOL,
    EARLIER_CALL,
    byte_tokenizer,
    check_required_call,
    check_streamed_calls,
    engine_of,
    grammar_takes,
    llama_ending_at_eos,
)

TAGS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
CONTROL = ["<|user|>", "<|assistant|>", "<|observation|>", *TAGS]
VOCAB = 259 + len(CONTROL)
GLM_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}For each function call, "
    "output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>"
    "{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>{% endif %}{% for m in messages %}"
    "{% if m.role == 'user' %}<|user|>{{ m.content }}{% elif m.role == 'assistant' %}<|assistant|>"
    "{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
    "{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|><tool_response>{{ m.content }}</tool_response>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
    "filters": {"type": "object", "properties": {"site": {"type": "string"}}}}, "required": ["query"]}}}


def glm_tokenizer(tokens: bool = True):
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": CONTROL if tokens else CONTROL[:3]})
    tokenizer.chat_template = GLM_TEMPLATE
    return tokenizer


def call(name: str, arguments: dict, newlines: bool = False) -> str:
    """A call as GLM-4.7's template writes it (``newlines``: GLM-4.6's)."""
    gap = "\n" if newlines else ""
    pairs = "".join(f"{gap}<arg_key>{k}</arg_key>{gap}<arg_value>{v if isinstance(v, str) else json.dumps(v)}"
                    f"</arg_value>" for k, v in arguments.items())
    return f"<tool_call>{name}{pairs}{gap}</tool_call>"


def use_of(*tools, choice=None, parallel=None, special=()):
    return read_tool_use(list(tools), choice, parallel, call_format=GLM, special=special)


def arguments_of(text: str, use) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read_calls(text, use).calls]


@pytest.fixture(scope="module")
def model():
    return llama_ending_at_eos(19, VOCAB, 2048)


@pytest.fixture(scope="module")
def engine(model):
    yield from engine_of(model, glm_tokenizer())


def test_a_glm_template_is_recognised_and_its_tags_found(engine):
    assert native_call_format(glm_tokenizer()) == GLM and engine.call_format == GLM
    ids = {tag: engine.tokenizer.convert_tokens_to_ids(tag) for tag in TAGS}
    assert dict(call_markers(engine.tokenizer, GLM)) == ids == dict(engine.call_markers)
    hermes_like = glm_tokenizer()
    hermes_like.chat_template = GLM_TEMPLATE.replace("<arg_key>", "<key>").replace("</arg_key>", "</key>")
    assert native_call_format(hermes_like) == HERMES  # (the <arg_key> pairs are what tell GLM's apart)


@pytest.mark.parametrize("newlines", [False, True])
def test_an_answer_is_read_in_both_layouts_with_its_values_typed(newlines):
    use = use_of(CITY_TOOL, SEARCH)
    arguments = {"query": '{"not": "json"} </tool_call>', "limit": 3, "exact": True, "filters": {"site": "a.org"}}
    text = "Looking.\n" + call("search", arguments, newlines) + "\n" + call("get_weather", {"city": "Rome"}, newlines)
    assert arguments_of(text, use) == [("search", arguments), ("get_weather", {"city": "Rome"})]
    assert read_calls(text, use).content == "Looking."
    assert arguments_of(call("search", {}, newlines), use) == [("search", {})]  # (a call without arguments)
    assert len(read_calls(text, use_of(CITY_TOOL, SEARCH, parallel=False)).calls) == 1
    for bad in (call("nope", {}), call("search", {"query": "x"})[:-len("</tool_call>")],
                "<tool_call>search<arg_key>query</arg_key>x</tool_call>", "<tool_call><arg_key>q</arg_key>"
                "<arg_value>x</arg_value></tool_call>", "no calls"):
        assert read_calls(bad, use).calls == () and read_calls(bad, use).content == bad, bad
    # Cut in the second call, the first stands.
    assert [name for name, _ in arguments_of(text, use)][:1] == ["search"]
    cut = text[:text.rindex("Rome")]
    assert [c["function"]["name"] for c in read_calls(cut, use, cut=True).calls] == ["search"]
    # Cut in a call whose text value spells the opening tag: the calls before it stand.
    # (A value that closes its own tags, "</arg_value></tool_call>", reads as a whole call: GLM's values are raw text.)
    for spelled in ("<tool_call>", "<tool_call> <tool_call>", "</tool_call>"):
        quoting = text[:text.rindex("Rome")] + f"a {spelled} b"
        assert [c["function"]["name"] for c in read_calls(quoting, use, cut=True).calls] == ["search"], spelled
    check_streamed_calls(use, text, "Looking.", 2)


@pytest.mark.parametrize("tokens", [True, False])
def test_the_grammar_holds_a_call_to_its_schema_with_the_tags_as_tokens_or_text(tokens, model):
    words = glm_tokenizer(tokens)
    served = ServingEngine(CausalLM(llama_ending_at_eos(19, len(words), 2048)), words, model_id="tiny",
                           max_batch_size=4)
    try:
        ids = served.call_markers
        assert bool(ids) == tokens
        required = use_of(CITY_TOOL, SEARCH, choice="required", special=ids)
        for text, takes in [
            (call("get_weather", {"city": "Rome"}), True),
            (call("get_weather", {"city": "Rome"}, newlines=True), True),
            (call("search", {"query": "a < b", "limit": 2, "filters": {"site": "x"}}), True),
            (call("search", {"query": "q"}) + call("get_weather", {"city": "Paris"}), True),
            (call("get_weather", {"city": "Oslo"}), False),  # (an enum holds)
            (call("search", {"limit": 2}), False),  # (a required argument missing)
            (call("search", {"query": "q", "limit": "two"}), False),  # (an integer's value is JSON)
            (call("search", {"query": "x</arg_value>y"}), False),  # (a text value ends at its closing tag)
            ("Sure.", False),
            ("\n" + call("get_weather", {"city": "Rome"}, newlines=True), True),  # (GLM-4.6's line break first)
            # (an open schema's other keys are none of its own, spaces around it or not: the reader strips a key)
            (call("search", {"query": "q", "other": "x"}), True),
            (call("search", {"query": "q", " limit": "two"}), False),
            (call("search", {"query": "q", "limit\t": "two"}), False),
            (call("search", {"query": "q", "query ": "again"}), False),
        ]:
            assert grammar_takes(served, required, text) == takes, text
        strict = use_of({**CITY_TOOL, "function": {**CITY_TOOL["function"], "strict": True}}, special=ids)
        assert grammar_takes(served, strict, "Sure.") and grammar_takes(
            served, strict, "Checking. " + call("get_weather", {"city": "Paris"}))
        assert not grammar_takes(served, strict, call("get_weather", {"city": "Oslo"}))
    finally:
        served.close()


def test_a_nullable_enum_takes_null_and_keys_the_format_cannot_write_are_refused(engine):
    nullable = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object", "properties": {
        "size": {"type": ["string", "null"], "enum": ["s", "m", None]}}, "required": ["size"],
        "additionalProperties": False}}}
    held = use_of(nullable, choice="required", special=engine.call_markers)
    assert grammar_takes(engine, held, call("pick", {"size": None})) and grammar_takes(engine, held, call(
        "pick", {"size": "m"}))
    assert arguments_of(call("pick", {"size": None}), held) == [("pick", {"size": None})]
    for key in ("", " size", "size ", "a<b", "two\nlines"):
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            key: {"type": "string"}}}}}
        with pytest.raises(ToolError) as refused:
            use_of(bad, choice="required")
        assert refused.value.param == "tools.0.function.parameters", key


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(engine, model, method):
    check_required_call(engine, model, GLM, method)


def test_the_template_renders_an_earlier_call_in_its_format(engine):
    assert engine.shows_calls
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(
        messages=tuple(EARLIER_CALL), tools=use_of(CITY_TOOL).shown())))
    assert "<|assistant|>Checking." + call("get_weather", {"city": "Paris"}) + "<|observation|>" in prompt
