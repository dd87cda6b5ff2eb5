"""OpenAI tool calling in the server (server/tools.py): the tools read and refused, the prompt that shows them, the
calls read back from whole and streamed answers, and calls forced by a grammar decoded as the loop decodes them.

The model is conftest's tiny random Llama (with a longer context) and its byte-level tokenizer: it never writes a
call of its own, so answers that choose to call (``auto``) are given to the text layer as chunks; ``required`` makes
it write calls through the grammar, whatever its weights. No test samples: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import chat_template_ids
from jointspec.core.draft import NoDrafter
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.server.app import (
    ChatBody,
    Message,
    ServerSettings,
    _engine_requests,
    _message,
    _parse,
    _Reply,
    create_app,
)
from jointspec.server.engine import Chunk, CompletionRequest, ServingEngine
from jointspec.server.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    HERMES,
    LLAMA3_JSON,
    PYTHON_TAG,
    CallStream,
    ToolError,
    ToolUse,
    native_call_format,
    prompt_messages,
    read_calls,
    read_tool_use,
)
from jointspec.verifiers.greedy import GreedyVerifier

from helpers import byte_tokenizer, grammar_takes, sse_events, streamed_calls, tiny_llama, tokenizer_with

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                   "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/small"}},
                                  "required": ["a"], "additionalProperties": False,
                                  "$defs": {"small": {"enum": [1, 2, 3]}}}}}


def block(name: str, arguments) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def use_of(*tools, choice=None, parallel=None) -> ToolUse:
    return read_tool_use(list(tools), choice, parallel)


@pytest.fixture(scope="module")
def long_model():
    """conftest's byte model with room for the tools' text (byte tokens: the tools' preamble is ~900)."""
    return tiny_llama(3, vocab=259, max_positions=2048)


@pytest.fixture(scope="module")
def engine(long_model, tokenizer):
    served = ServingEngine(CausalLM(long_model), tokenizer, model_id="tiny", max_batch_size=8)
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(ServerSettings(), engine))


# -- what a request offers -------------------------------------------------------------------------------------

def test_tools_and_tool_choice_are_read_in_both_of_openais_forms():
    use = use_of(WEATHER, ADD)
    assert (use.choice, use.function, use.parallel) == ("auto", None, True)
    assert [tool.name for tool in use.tools] == ["get_weather", "add"] and use.shown()[0] == WEATHER
    named = use_of(WEATHER, ADD, choice={"type": "function", "function": {"name": "add"}}, parallel=False)
    assert (named.choice, named.function, named.parallel) == ("required", "add", False)
    assert use_of(WEATHER, choice="none").shown() == ()  # "none": the model is not shown them
    # The deprecated functions / function_call are the same request.
    old = read_tool_use(None, None, None, functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    assert (old.choice, old.function, old.shown()) == ("required", "get_weather", (WEATHER,))
    assert read_tool_use(None, "auto", None) is None and read_tool_use([], "none", None) is None


@pytest.mark.parametrize("tools, choice, parallel, param", [
    ([{"type": "retrieval"}], None, None, "tools.0"),
    ([{"type": "function", "function": {"name": "get weather"}}], None, None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, None, "tools.0.function.description"),
    ([WEATHER, WEATHER], None, None, "tools"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, None, "tool_choice"),
    ([WEATHER], "always", None, "tool_choice"),
    ([], "required", None, "tool_choice"),
    ([WEATHER], None, "yes", "parallel_tool_calls"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None, "tools.0.function.strict"),
])
def test_a_tool_request_that_cannot_be_served_names_its_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as refused:
        read_tool_use(tools, choice, parallel)
    assert refused.value.param == param
    with pytest.raises(ToolError, match="not both"):
        read_tool_use([WEATHER], None, None, functions=[WEATHER["function"]])


def required_calls_grammar(engine, use_of, call, joined) -> tuple[ToolUse, ToolUse]:
    """Check a format's required grammar (``use_of`` reads tools in it, ``call`` writes one call, ``joined`` two):
    one call or two, two refused without parallel calls, a named function alone; returns (both tools, named)."""
    both = use_of(WEATHER, ADD, choice="required")
    two = joined(call("get_weather", {"city": "Rome"}), call("add", {"a": 3}))
    assert grammar_takes(engine, both, call("add", {"a": 3})) and grammar_takes(engine, both, two)
    assert not grammar_takes(engine, use_of(WEATHER, ADD, choice="required", parallel=False), two)
    named = use_of(WEATHER, ADD, choice={"type": "function", "function": {"name": "add"}})
    assert grammar_takes(engine, named, call("add", {"a": 1})) and not grammar_takes(
        engine, named, call("get_weather", {"city": "Rome"}))
    return both, named


def test_the_grammar_of_required_calls_takes_what_the_schemas_accept_and_nothing_else(engine):
    both, named = required_calls_grammar(engine, use_of, block, lambda one, two: one + "\n" + two)
    assert grammar_takes(engine, both, block("add", {"a": 3}) + "\n")  # (a newline after the calls, at most)
    for wrong in (block("add", {"a": 3}) + "\n\n", block("add", {"a": 3}) + "\nmore",
                  block("add", {"a": 4}), block("get_weather", {"city": "Oslo"}), block("sub", {"a": 1}),
                  block("add", {"a": 1, "b": 2}), "Sure: " + block("add", {"a": 1})):
        assert not grammar_takes(engine, both, wrong), wrong  # (add's "a" is an enum through a $ref: followed)
    assert use_of(WEATHER, ADD).output_format() is None and use_of(WEATHER, choice="none").output_format() is None
    # A named function is called once, whatever parallel_tool_calls says (as OpenAI answers it).
    assert not grammar_takes(engine, named, block("add", {"a": 1}) + "\n" + block("add", {"a": 2}))
    # The arguments' references resolve against the arguments' own schema: to a sibling, and recursively to the root.
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"size": {"enum": [1, 2]}, "same": {"$ref": "#/properties/size"},
                                         "child": {"$ref": "#"}}, "required": ["size"], "additionalProperties": False}}}
    nested = use_of(tree, choice="required")
    assert grammar_takes(engine, nested, block("tree", {"size": 1, "same": 2, "child": {"size": 2, "child": {
        "size": 1}}}))
    assert not grammar_takes(engine, nested, block("tree", {"size": 1, "child": {"name": "tree", "arguments": {}}}))
    assert not grammar_takes(engine, nested, block("tree", {"size": 1, "same": 3}))
    # auto with a strict function: any text without the tag, or such text and then valid calls, and nothing else.
    strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
    held = use_of(WEATHER, strict)
    assert held.tools[1].strict and not held.tools[0].strict and held.output_format() is not None
    for text in ("Plain text <b>with</b> tags.", "", "Let me add.\n" + block("add", {"a": 2}),
                 "x" + block("add", {"a": 1}) + "\n" + block("get_weather", {"city": "Paris"})):
        assert grammar_takes(engine, held, text), text
    for text in ("Hi <tool_call> nope", "Hi " + block("add", {"a": 5}), block("add", {"a": 1}) + " and more text",
                 f"{CALL_OPEN}\n{{\"name\": \"sub\", \"arguments\": {{}}}}\n{CALL_CLOSE}"):
        assert not grammar_takes(engine, held, text), text
    assert not grammar_takes(engine, use_of(WEATHER, strict, parallel=False),
                             block("add", {"a": 1}) + "\n" + block("add", {"a": 2}))
    # strict is a function's own: the others' arguments are any object, and their schemas are not compiled at all
    assert grammar_takes(engine, held, "x" + block("get_weather", {"town": 3}))
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "properties": {
        "n": {"type": "string", "format": "int32"}}}}}
    assert use_of(odd, strict).output_format() is not None
    with pytest.raises(ToolError, match="Unknown format"):
        use_of(odd, strict, choice="required")
    # A function without parameters takes no arguments (OpenAI's reading), not any object.
    now = {"type": "function", "function": {"name": "now"}}
    assert grammar_takes(engine, use_of(now, choice="required"), block("now", {}))
    assert not grammar_takes(engine, use_of(now, choice="required"), block("now", {"type": "object"}))


# -- the prompt ------------------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "tool", "tool_call_id": "c2", "content": "21C"},
]


def test_a_template_without_tools_gets_them_and_the_calls_as_text(tokenizer):
    messages, tools = prompt_messages(CONVERSATION, (WEATHER,), native=False)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert json.dumps(WEATHER) in messages[0]["content"] and CALL_OPEN in messages[0]["content"]
    assert messages[2]["content"] == (block("get_weather", {"city": "Paris"}) + "\n"
                                      + block("get_weather", {"city": "Rome"}))
    # one turn's results, one user turn
    assert messages[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response>"
    # A system message of the request's own keeps its text first; without tools shown there is no preamble.
    own, _ = prompt_messages([{"role": "system", "content": "Be brief."}, *CONVERSATION[:1]], (WEATHER,), False)
    assert own[0]["content"].startswith("Be brief.\n\n") and len(own) == 2
    assert prompt_messages(CONVERSATION[:1], (), False)[0] == CONVERSATION[:1]
    assert native_call_format(tokenizer) is None


def test_a_template_that_renders_tools_gets_them_with_the_calls_arguments_as_objects():
    template = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}<{{ m.role }}>"
                "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>"
                "{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}<assistant>")
    native = byte_tokenizer()
    native.chat_template = template
    assert native_call_format(native) == HERMES
    messages, tools = prompt_messages(CONVERSATION, (WEATHER,), native=True)
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                               "arguments": {"city": "Paris"}}
    text = native.decode(chat_template_ids(native, messages, tools=tools))
    shown, _, after = text.partition("</tools>")
    assert shown.startswith("<tools>") and json.loads(shown[len("<tools>"):]) == [WEATHER]
    # (the template's newlines after its tags are trimmed, as transformers renders templates)
    assert after == ('<user>Weather in Paris and Rome?<assistant><tool_call>{"name": "get_weather", "arguments": '
                     '{"city": "Paris"}}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
                     '</tool_call><tool>18C<tool>21C<assistant>')
    # A special token's spelling inside a call would be read as the token: refused.
    bad = [dict(CONVERSATION[1], tool_calls=[{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "</s>"}'}}])]
    with pytest.raises(ValueError, match="special token"):
        chat_template_ids(native, prompt_messages(bad, (WEATHER,), True)[0], tools=[WEATHER])


def test_an_empty_assistant_turn_renders_as_its_template_writes_it_when_text_is_read_apart():
    """Where a message holds a special token's spelling, every message's text is read apart from the template's
    (backends/tokens.py); an empty one (an assistant turn of tool calls alone) is rendered as it is, not as a marker
    that a template's ``{% if message.content %}`` would take for text."""
    native = byte_tokenizer()
    native.chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.content %}:{{ m.content }}{% endif %}"
                            "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}"
                            "{% endfor %}{% if tools %}{% endif %}<assistant>")
    messages = [{"role": "user", "content": "a </s> b"}, *prompt_messages(CONVERSATION[1:2], (), True)[0],
                {"role": "tool", "content": "18C"}]
    ids = chat_template_ids(native, messages)
    assert native.decode(ids) == "<user>:a </s> b<assistant><tool_call>get_weather</tool_call><tool_call>get_weather" \
                                 "</tool_call><tool>:18C<assistant>"
    assert native.convert_tokens_to_ids("</s>") not in ids  # (the user's spelling stays characters)
    # A tokenizer with named templates renders tools with its tool_use one.
    named = byte_tokenizer()
    named.chat_template = {"default": "{% for m in messages %}{{ m.content }}{% endfor %}",
                           "tool_use": "{{ tools }}<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}"}
    assert native_call_format(named) == HERMES


def test_the_engine_reads_a_tool_conversation_as_the_rendered_prompt(engine, tokenizer):
    request = CompletionRequest(messages=tuple(CONVERSATION), tools=(WEATHER,))
    rendered, _ = prompt_messages(CONVERSATION, (WEATHER,), native=False)
    assert engine.encode(request) == chat_template_ids(tokenizer, rendered)
    assert engine.encode(CompletionRequest(messages=tuple(CONVERSATION[:1]))) == chat_template_ids(
        tokenizer, CONVERSATION[:1])


# -- calls read back -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", []),
    (block("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("Let me look.\n" + block("get_weather", {"city": "Paris"}) + "\n" + block("add", {"a": 2}),
     "Let me look.", [("get_weather", {"city": "Paris"}), ("add", {"a": 2})]),
    # arguments written as JSON text, as OpenAI's API sends them
    (f'{CALL_OPEN}{{"name": "add", "arguments": "{{\\"a\\": 1}}"}}{CALL_CLOSE}', None, [("add", {"a": 1})]),
    # what does not read as a call of an offered tool leaves the whole answer text
    (block("weather", {"city": "Paris"}), block("weather", {"city": "Paris"}), []),
    (f"{CALL_OPEN}\n{{not json\n{CALL_CLOSE}", f"{CALL_OPEN}\n{{not json\n{CALL_CLOSE}", []),
    (block("add", [1]), block("add", [1]), []),
    (block("add", {"a": 1}) + f"\n{CALL_OPEN}\n{{", block("add", {"a": 1}) + f"\n{CALL_OPEN}\n{{", []),
    # a closing tag inside an argument's string does not end the block: the JSON is read as JSON
    (block("get_weather", {"city": "</tool_call> <tool_call>"}), None,
     [("get_weather", {"city": "</tool_call> <tool_call>"})]),
    # text after and between blocks: the content outside them, less the whitespace beside a block
    ("  Hi.\n" + block("add", {"a": 1}) + "\n middle \n" + block("add", {"a": 2}) + "\nDone.\n", "  Hi.\nmiddle\nDone.",
     [("add", {"a": 1}), ("add", {"a": 2})]),
])
def test_an_answer_is_read_for_calls_of_the_offered_tools_or_left_text(text, content, calls):
    read = read_calls(text, use_of(WEATHER, ADD))
    assert read.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read.calls] == calls
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in read.calls)
    assert len({c["id"] for c in read.calls}) == len(read.calls)


def test_a_cut_answer_keeps_its_whole_calls_and_one_call_is_read_where_parallel_calls_are_off():
    two = block("add", {"a": 1}) + "\n" + block("add", {"a": 2})
    cut = two + f"\n{CALL_OPEN}\n{{\"name\": \"ad"
    assert [c["function"]["arguments"] for c in read_calls(cut, use_of(ADD), cut=True).calls] == ['{"a": 1}',
                                                                                                 '{"a": 2}']
    assert read_calls(cut, use_of(ADD)).calls == ()  # ended by itself with a block open: no call
    # The unfinished call's own text spells the opening tag (a value quoting it): the finished calls still stand.
    for spelled in (CALL_OPEN, f"{CALL_OPEN} and {CALL_OPEN}", CALL_CLOSE, f"{CALL_CLOSE}\n{CALL_OPEN}"):
        quoting = two + f'\n{CALL_OPEN}\n{{"name": "add", "arguments": {{"note": "write {spelled} then'
        assert len(read_calls(quoting, use_of(ADD), cut=True).calls) == 2, spelled
    # cut inside the next block's opening tag: the tag's start is no content
    started = read_calls(two + "\n<tool_", use_of(ADD), cut=True)
    assert started.content is None and len(started.calls) == 2
    assert read_calls("No call <tool_", use_of(ADD), cut=True).content == "No call <tool_"  # no call: as written
    assert len(read_calls(two, use_of(ADD, parallel=False)).calls) == 1
    assert read_calls(two, use_of(ADD, choice="none")).content == two


@pytest.mark.parametrize("pieces", [
    ["Let me ", "look.\n<tool", "_call>\n", '{"name": "add", "arguments": {"a": 3}}\n</tool_call>'],
    ["Let me look.\n<", "t", "ool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 3}}\n</tool_call>", ""],
    ["Let me look.\n", block("add", {"a": 3})],
])
def test_a_stream_sends_the_text_before_the_calls_as_it_comes_and_the_calls_at_the_end(pieces):
    stream = CallStream(use_of(ADD))
    sent = [stream.feed(piece) for piece in pieces]
    # (the whitespace before a block is held back, and dropped with the block, as the whole answer drops it)
    assert "".join(sent) == "Let me look." and not any("<" in piece for piece in sent)
    assert sent[0] == pieces[0].split("<")[0].rstrip()  # (text that cannot begin a block is not held back)
    rest, calls = stream.finish()
    assert rest == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 3}]
    # A "<" that turns out not to open a block is sent after all, and an answer without calls is all text, as
    # written (its trailing whitespace too).
    plain = CallStream(use_of(ADD))
    assert plain.feed("a <") == "a" and plain.feed("b ") == " <b" and plain.finish() == (" ", ())


@pytest.mark.parametrize("text", [
    "  Hi.\n" + block("add", {"a": 1}) + "\n middle \n" + block("add", {"a": 2}) + "\nDone.\n",
    block("add", {"a": 1}) + "\n\n", "Plain text,\n  with <b>tags</b> and spaces  \n",
    "Before " + block("add", {"a": 1}) + " <tool_call> broken", "x" + block("get_weather", {"city": "<tool_call>"}),
])
def test_the_content_streamed_is_the_whole_answers_however_the_text_is_split(text):
    """Split into chunks at every place (and into single characters), a stream sends the content the whole answer
    has, and the same calls."""
    use = use_of(WEATHER, ADD)
    whole = read_calls(text, use)
    splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = CallStream(use)
        sent = "".join(stream.feed(piece) for piece in pieces)
        rest, calls = stream.finish()
        assert sent + rest == (whole.content or "") and [c["function"] for c in calls] == [
            c["function"] for c in whole.calls], pieces


def reply_with(use: ToolUse) -> _Reply:
    reply = _Reply("chat", "tiny", 5, None)
    reply.tools = use
    return reply


def test_whole_and_streamed_replies_carry_the_calls_in_openais_shapes():
    use = use_of(WEATHER, ADD)
    pieces = ["Sure.\n<tool_", 'call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>\n',
              block("get_weather", {"city": "Rome"})]
    chunks = [Chunk(text=p, num_tokens=len(p), num_rounds=1) for p in pieces]
    chunks[-1].finish_reason = "stop"
    whole = reply_with(use).whole([chunks])["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Sure."
    called = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert called == [("add", '{"a": 2}'), ("get_weather", '{"city": "Rome"}')]
    reply = reply_with(use)
    events = [event for chunk in chunks for event in reply.events(chunk)]
    deltas = [event["choices"][0]["delta"] for event in events]
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    assert deltas[0] == {"content": "Sure."}  # (the reply's role chunk, which with tools sends no empty content, aside)
    streamed = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(streamed) == 1 and [c["index"] for c in streamed[0]] == [0, 1]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed[0]] == called
    assert [event["choices"][0]["finish_reason"] for event in events][-1] == "tool_calls"
    # An answer that reads as no call is the text, whole and streamed, with the engine's finish reason.
    text = [Chunk(text="No call here.", num_tokens=4, num_rounds=1, finish_reason="length")]
    assert reply_with(use).whole([text])["choices"][0]["message"] == {"role": "assistant",
                                                                      "content": "No call here."}
    assert [e["choices"][0] for e in reply_with(use).events(text[0])] == [
        {"index": 0, "delta": {"content": "No call here."}, "finish_reason": "length"}]


def test_each_streamed_choice_is_read_for_its_own_calls():
    """With n choices a stream's chunks interleave: each choice's text is held and read apart (by index)."""
    use = use_of(WEATHER, ADD)
    reply = reply_with(use)
    first = ["Hi ", "<tool_call>\n", '{"name": "add", "arguments": {"a": 1}}\n</tool_call>']
    second = ["<tool_", 'call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', " Bye"]
    events = []
    for number, (one, two) in enumerate(zip(first, second)):
        done = "stop" if number == len(first) - 1 else None
        events += reply.events(Chunk(text=one, num_tokens=1, finish_reason=done), 0)
        events += reply.events(Chunk(text=two, num_tokens=1, finish_reason=done), 1)
    by_choice = {0: [], 1: []}
    for event in events:
        by_choice[event["choices"][0]["index"]].append(event["choices"][0])
    for index, name, content in ((0, "add", "Hi"), (1, "get_weather", "Bye")):
        deltas = [choice["delta"] for choice in by_choice[index]]
        assert "".join(d.get("content", "") for d in deltas) == content
        assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == [name]
        assert by_choice[index][-1]["finish_reason"] == "tool_calls"


# -- through the server ----------------------------------------------------------------------------------------

def body_with(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
            "max_tokens": 120, **extra}


@pytest.mark.parametrize("method", ["ar", "default"])
def test_auto_with_a_strict_function_decodes_as_the_loop_under_its_grammar(client, engine, long_model, tokenizer,
                                                                           method):
    """OpenAI's strict functions: the answer follows the auto grammar, and every method gives the loop's
    constrained greedy answer (which this random model writes as text: the grammar forbids only a bad call)."""
    strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
    body = body_with(tools=[WEATHER, strict], max_tokens=40, jointspec={"method": method})
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    use = use_of(WEATHER, strict)
    prompt = chat_template_ids(tokenizer, prompt_messages(body["messages"], use.shown(), False)[0])
    loop = SpeculativeDecoder(CausalLM(long_model), NoDrafter(), GreedyVerifier())
    ids = loop.generate(prompt, DecodeConfig(40, eos_token_ids=engine.eos_token_ids,
                                             grammar=engine.grammar(use.output_format())))
    assert reply.json()["choices"][0]["message"]["content"] == read_calls(
        tokenizer.decode(ids, skip_special_tokens=True), use).content
    # (the server decodes it under that grammar; without a strict function, under none)
    parsed = _parse(json.dumps(body).encode(), ChatBody)
    assert _engine_requests(parsed)[0].output_format == use.output_format()
    loose = _parse(json.dumps(body_with(tools=[WEATHER, ADD])).encode(), ChatBody)
    assert _engine_requests(loose)[0].output_format is None


@pytest.mark.parametrize("method", ["ar", "pld", "default"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(client, engine, long_model,
                                                                                     tokenizer, method):
    """The grammar makes even a random model call a tool, with arguments its schema accepts; every method answers
    with the tokens plain constrained decoding gives the same prompt (the grammar's losslessness, core/grammar.py)."""
    body = body_with(tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
                     jointspec={"method": method})
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    use = use_of(WEATHER, ADD, choice="required", parallel=False)
    prompt = chat_template_ids(tokenizer, prompt_messages(body["messages"], use.shown(), False)[0])
    loop = SpeculativeDecoder(CausalLM(long_model), NoDrafter(), GreedyVerifier())
    ids = loop.generate(prompt, DecodeConfig(120, eos_token_ids=engine.eos_token_ids,
                                             grammar=engine.grammar(use.output_format())))
    expected = read_calls(tokenizer.decode(ids, skip_special_tokens=True), use)
    # (content: none but the end-of-sequence byte this byte model's config names, which its tokenizer spells)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == expected.content
    calls = choice["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [c["function"] for c in expected.calls] and len(calls) == 1
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert arguments in ({"city": "Paris"}, {"city": "Rome"}, {"a": 1}, {"a": 2}, {"a": 3})  # (the schemas')
    functions, content, finish = streamed_calls(client, body)
    assert functions == [c["function"] for c in calls] and finish == "tool_calls"
    assert content.strip() == (expected.content or "")


def test_a_named_function_is_the_one_called_and_a_conversation_with_results_is_answered(client):
    named = client.post("/v1/chat/completions", json=body_with(
        tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}))
    assert named.status_code == 200, named.text
    calls = named.json()["choices"][0]["message"]["tool_calls"]
    assert calls and {c["function"]["name"] for c in calls} == {"add"}
    assert all(json.loads(c["function"]["arguments"])["a"] in (1, 2, 3) for c in calls)
    # the calls and their results sent back: a plain answer (this model's is gibberish, but an answer)
    follow = client.post("/v1/chat/completions", json=body_with(tools=[WEATHER, ADD], messages=CONVERSATION,
                                                                 max_tokens=8))
    assert follow.status_code == 200 and follow.json()["choices"][0]["message"]["role"] == "assistant"
    assert len(calls) == 1  # a named function is called once
    # The older functions form decodes the same call and answers in its own shape: one function_call.
    legacy = client.post("/v1/chat/completions", json=body_with(
        functions=[WEATHER["function"], ADD["function"]], function_call={"name": "add"}))
    choice = legacy.json()["choices"][0]
    assert choice["message"]["function_call"] == {"name": "add", "arguments": calls[0]["function"]["arguments"]}
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "function_call"
    streamed = client.post("/v1/chat/completions", json=body_with(
        functions=[WEATHER["function"], ADD["function"]], function_call={"name": "add"}, stream=True))
    events = sse_events(streamed.text)
    assert [e["choices"][0]["delta"]["function_call"] for e in events
            if "function_call" in e["choices"][0]["delta"]] == [choice["message"]["function_call"]]
    assert events[-1]["choices"][0]["finish_reason"] == "function_call"
    # Its history: an assistant's function_call and the function's result read as a call and a tool result.
    history = [CONVERSATION[0], {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}, {"role": "function", "name": "get_weather",
                                                                     "content": "18C"}]
    answered = client.post("/v1/chat/completions", json=body_with(max_tokens=1, messages=history))
    assert answered.status_code == 200, answered.text
    read = [_message(Message.model_validate(message)) for message in history]
    assert read[1]["tool_calls"][0]["function"] == history[1]["function_call"]
    assert read[2] == {"role": "tool", "content": "18C", "tool_call_id": ""}
    rendered = prompt_messages(read, (), native=False)[0]
    assert rendered[1]["content"] == block("get_weather", {"city": "Paris"})
    assert rendered[2]["content"] == "<tool_response>\n18C\n</tool_response>"


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"prompt": "hi", "tools": [WEATHER]}, "tools"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "18C"}]}, "messages.0.tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls"),
    ("/v1/chat/completions", {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(a"}}}}}], "tool_choice": "required"},
     "tools.1.function.parameters"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "function_call": {"name": "f"}}]},
     "messages.0.function_call"),
])
def test_a_tool_request_the_server_cannot_serve_is_a_400_naming_the_field(client, path, extra, param):
    body = {**body_with(), **extra} if path.endswith("chat/completions") else {"model": "tiny", **extra}
    reply = client.post(path, json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


# -- Llama 3's format ------------------------------------------------------------------------------------------

# Llama 3.1-3.3's conventions, in a template of this test's own: a system message taken out of the turns, the tools
# shown in the first turn after it (which must exist), or in the system turn where tools_in_user_message is false; an
# earlier call written as the bare JSON object with its arguments under "parameters" and its turn's text dropped;
# results in ipython turns; one call a turn (more refused, as Meta's templates refuse them).
LLAMA_TEMPLATE = (
    "{% if tools_in_user_message is not defined %}{% set tools_in_user_message = true %}{% endif %}"
    "{% if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n"
    "{% if not tools_in_user_message %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}{% endif %}"
    "{{ system }}<|eot_id|>"
    "{% if tools and tools_in_user_message %}{% if messages | length == 0 %}"
    "{{ raise_exception('no first user message for the tools') }}{% endif %}"
    "<|start_header_id|>user<|end_header_id|>\n\nRespond with a JSON call "
    "{{ '{\"name\": function name, \"parameters\": arguments}' }}.\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}{{ messages[0].content }}<|eot_id|>{% set messages = messages[1:] %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}{% if m.tool_calls | length != 1 %}{{ raise_exception('one call a turn') }}{% endif %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{ '{\"name\": \"' + m.tool_calls[0].function.name + '\", \"parameters\": ' }}"
    "{{ m.tool_calls[0].function.arguments | tojson }}}<|eot_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}"
    "{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")


def llama_use(*tools, choice=None, parallel=None) -> ToolUse:
    return read_tool_use(list(tools), choice, parallel, call_format=LLAMA3_JSON)


def llama_call(name: str, arguments) -> str:
    return json.dumps({"name": name, "parameters": arguments})


@pytest.fixture(scope="module")
def llama_tokenizer():
    return tokenizer_with(LLAMA_TEMPLATE)


@pytest.fixture(scope="module")
def llama_engine(long_model, llama_tokenizer):
    served = ServingEngine(CausalLM(long_model), llama_tokenizer, model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def test_a_llama_template_is_recognised_and_gets_the_tools_each_call_in_a_turn_and_the_results(
        llama_tokenizer, llama_engine, engine):
    assert native_call_format(llama_tokenizer) == LLAMA3_JSON and llama_engine.call_format == LLAMA3_JSON
    assert engine.call_format == HERMES and native_call_format(byte_tokenizer()) is None  # (SmolLM2-like: as text)
    hermes = byte_tokenizer()
    hermes.chat_template = "{% if tools %}{% endif %}<tool_call>{\"name\": ..., \"parameters\": ...} ipython"
    assert native_call_format(hermes) == HERMES  # (the tag decides first)
    assert native_call_format(tokenizer_with("{{ tools }} \"parameters\": ipython <|python_start|>")) is None  # Llama 4
    # Each call in a turn of its own, followed by its result (matched by id: the ipython turns name no call).
    messages, tools = prompt_messages(CONVERSATION, (WEATHER,), True, LLAMA3_JSON)
    assert tools == [WEATHER] and [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "tool"]
    assert [(m["tool_calls"][0]["function"], r["content"]) for m, r in (messages[1:3], messages[3:5])] == [
        ({"name": "get_weather", "arguments": {"city": city}}, result) for city, result in (("Paris", "18C"),
                                                                                            ("Rome", "21C"))]
    swapped = [*CONVERSATION[:2], CONVERSATION[3], CONVERSATION[2]]  # (results in another order: by id all the same)
    assert prompt_messages(swapped, (WEATHER,), True, LLAMA3_JSON)[0] == messages
    text = llama_tokenizer.decode(llama_engine.encode(CompletionRequest(messages=tuple(CONVERSATION),
                                                                        tools=(WEATHER,))))
    assert json.dumps(WEATHER) in text and "Environment: ipython" in text
    turn = "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>"
    assert (turn.format("assistant", llama_call("get_weather", {"city": "Paris"})) + turn.format("ipython", "18C")
            + turn.format("assistant", llama_call("get_weather", {"city": "Rome"})) + turn.format("ipython", "21C")
            in text)
    # (without the split, the template refuses the turn of two calls)
    with pytest.raises(Exception, match="one call a turn"):
        chat_template_ids(llama_tokenizer, prompt_messages(CONVERSATION, (WEATHER,), True)[0], tools=[WEATHER])
    # A conversation without a user turn gets the tools in the system turn (the template would refuse it), and a
    # call turn's text, which the template drops, is not looked for in its output (where a special token's spelling
    # elsewhere has the messages' text read apart).
    system_only = CompletionRequest(messages=({"role": "system", "content": "Be brief."},), tools=(WEATHER,))
    assert json.dumps(WEATHER) + "\nBe brief.<|eot_id|>" in llama_tokenizer.decode(llama_engine.encode(system_only))
    spelled = ({"role": "user", "content": "a </s> b"}, {**CONVERSATION[1], "content": "Let me check."},
               *CONVERSATION[2:])
    assert llama_engine.encode(CompletionRequest(messages=spelled, tools=(WEATHER,)))


def test_the_llama_grammar_takes_calls_of_the_offered_tools_as_their_schemas_say_and_nothing_else(llama_engine):
    both, named = required_calls_grammar(llama_engine, llama_use, llama_call, lambda one, two: one + "; " + two)
    for wrong in (llama_call("add", {"a": 4}), llama_call("get_weather", {"city": "Oslo"}), llama_call("sub", {}),
                  block("add", {"a": 1}), json.dumps({"name": "add", "arguments": {"a": 1}}),
                  "Sure: " + llama_call("add", {"a": 1}), llama_call("add", {"a": 1}) + " more"):
        assert not grammar_takes(llama_engine, both, wrong), wrong
    assert not grammar_takes(llama_engine, named, llama_call("add", {"a": 1}) + "; " + llama_call("add", {"a": 2}))
    # auto with a strict function: text that does not begin with a call's "{", or calls alone
    strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
    held = llama_use(WEATHER, strict)
    for text in ("Plain text {with} braces.", "", llama_call("add", {"a": 2}), llama_call("get_weather", {"x": 1})):
        assert grammar_takes(llama_engine, held, text), text
    for text in (llama_call("add", {"a": 5}), "  {", "  " + llama_call("add", {"a": 1}),
                 llama_call("add", {"a": 1}) + " and text", PYTHON_TAG + " " + llama_call("add", {"a": 5}),
                 "\x1c" + llama_call("add", {"a": 5})):  # (what the reader strips as whitespace, the grammar too)
        assert not grammar_takes(llama_engine, held, text), text
    # (a call after text is no call: the answer reads as text, which the grammar takes)
    after = "Let me add. " + llama_call("add", {"a": 1})
    assert grammar_takes(llama_engine, held, after) and not read_calls(after, held).calls


@pytest.mark.parametrize("text, content, calls", [
    (llama_call("get_weather", {"city": "Paris"}), None, [("get_weather", {"city": "Paris"})]),
    ("  " + PYTHON_TAG + llama_call("add", {"a": 1}) + "\n", None, [("add", {"a": 1})]),
    (llama_call("add", {"a": 1}) + " ;" + llama_call("add", {"a": 2}), None, [("add", {"a": 1}), ("add", {"a": 2})]),
    (json.dumps({"name": "add", "arguments": {"a": 1}}), None, [("add", {"a": 1})]),  # (the Hermes key read too)
    ("It is sunny.", "It is sunny.", []),
    ("Sure: " + llama_call("add", {"a": 1}), "Sure: " + llama_call("add", {"a": 1}), []),
    (llama_call("add", {"a": 1}) + " Done.", llama_call("add", {"a": 1}) + " Done.", []),
    (llama_call("add", {"a": 1}) + "; " + llama_call("sub", {}), llama_call("add", {"a": 1}) + "; "
     + llama_call("sub", {}), []),
    (llama_call("add", {"a": 1}) + ";", llama_call("add", {"a": 1}) + ";", []),
    ('{"name": "add", "parameters": {"a": ', '{"name": "add", "parameters": {"a": ', []),  # (cut: no call)
    ("{not json}", "{not json}", []),
])
def test_a_llama_answer_is_its_calls_or_text(text, content, calls):
    read = read_calls(text, llama_use(WEATHER, ADD))
    assert read.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read.calls] == calls
    cut = read_calls(text, llama_use(WEATHER, ADD), cut=True)  # (cut by its length: read alike, but after a ";")
    if not text.endswith(";"):
        assert cut.content == read.content and [c["function"] for c in cut.calls] == [
            c["function"] for c in read.calls]
    if len(calls) > 1:
        assert len(read_calls(text, llama_use(WEATHER, ADD, parallel=False)).calls) == 1


def test_a_llama_answer_cut_by_its_length_keeps_the_calls_it_finished():
    use = llama_use(WEATHER, ADD)
    finished = llama_call("add", {"a": 1}) + "; " + llama_call("add", {"a": 2})
    for tail in ("; {\"name\": \"get_weath", ";", "; "):
        calls = read_calls(finished + tail, use, cut=True).calls
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 2}], tail
        assert read_calls(finished + tail, use).calls == ()  # (ended by itself so: text)
    assert read_calls('{"name": "add", "param', use, cut=True) == read_calls('{"name": "add", "param', use)


@pytest.mark.parametrize("text", [
    llama_call("add", {"a": 1}), "  " + llama_call("add", {"a": 1}) + "\n", PYTHON_TAG + llama_call("add", {"a": 1}),
    "Plain text,\n  with <b>tags</b> and {braces}  \n", "  <|python", "\n\nHi", "{not a call} but text", "",
])
def test_a_llama_stream_sends_text_as_it_comes_and_the_same_content_as_the_whole_answer(text):
    use = llama_use(WEATHER, ADD)
    whole = read_calls(text, use)
    splits = [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = CallStream(use)
        sent = [stream.feed(piece) for piece in pieces]
        rest, calls = stream.finish()
        assert "".join(sent) + rest == (whole.content or "") and [c["function"] for c in calls] == [
            c["function"] for c in whole.calls], pieces
    # Text that cannot begin a call streams at once; what may be a call waits for the end.
    stream = CallStream(use)
    assert stream.feed(" Hel") == " Hel" and stream.feed("lo") == "lo"
    waiting = CallStream(use)
    assert waiting.feed(" {") == "" and waiting.feed('"name"') == "" and waiting.feed("<") == ""


@pytest.mark.parametrize("method", ["ar", "default"])
def test_a_required_llama_call_is_the_loops_constrained_greedy_decoding(llama_engine, long_model, llama_tokenizer,
                                                                        method):
    client = TestClient(create_app(ServerSettings(), llama_engine))
    body = body_with(tools=[WEATHER, ADD], tool_choice="required", jointspec={"method": method})
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    use = llama_use(WEATHER, ADD, choice="required")
    prompt = chat_template_ids(llama_tokenizer, *prompt_messages(body["messages"], use.shown(), True, LLAMA3_JSON))
    loop = SpeculativeDecoder(CausalLM(long_model), NoDrafter(), GreedyVerifier())
    ids = loop.generate(prompt, DecodeConfig(120, eos_token_ids=llama_engine.eos_token_ids,
                                             grammar=llama_engine.grammar(use.output_format())))
    expected = read_calls(llama_tokenizer.decode(ids, skip_special_tokens=True), use)
    assert expected.calls and choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [c["function"] for c in expected.calls]
    assert streamed_calls(client, body) == ([c["function"] for c in expected.calls], "", "tool_calls")
