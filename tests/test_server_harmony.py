"""gpt-oss's Harmony format in the server (server/harmony.py): answers read as llama.cpp's gpt-oss parser reads them
(its parser tests' cases), streamed so that the pieces add up to the whole, the real template's prompt with an
earlier call and its reasoning, and the grammars of a required call and of a response format after the analysis. The
tokenizer is the byte tokenizer with gpt-oss's markers as special tokens, the model a tiny random gpt-oss; greedy
throughout, so nothing here can fail by chance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.core.grammar import OutputFormat
from jointspec.server import harmony
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import CompletionRequest, ServingEngine
from jointspec.server.reasoning import HARMONY, HARMONY_IN_CONTENT, reasoning_first, split_reasoning
from jointspec.server.tools import HARMONY_CALLS, native_call_format, read_calls, read_tool_use

from helpers import CITY_TOOL, assert_stream_adds_up, byte_tokenizer, grammar_takes, sse_events, tiny_gpt_oss

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "gpt-oss-120b.jinja"
# gpt-oss's markers, special tokens of its tokenizer (<|return|> and <|call|> its ends of sequence).
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
FUNCTION = {"type": "function", "function": {"name": "special_function", "parameters": {
    "type": "object", "properties": {"arg1": {"type": "integer"}}}}}
THOUGHT = "<|channel|>analysis<|message|>I'm\nthinking<|end|>"
CALL = "<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>"
# llama.cpp's parser tests for gpt-oss (tests/test-chat.cpp): an answer, whether its length cut it, and what it reads
# as: its reasoning, its content and its calls (name and arguments).
CASES = [
    ("<|channel|>analysis<|message|>I'm\nthink", True, "I'm\nthink", "", []),
    (THOUGHT, True, "I'm\nthinking", "", []),
    (THOUGHT + "<|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?", False, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    (THOUGHT + "<|start|>assistant" + CALL + '{"arg1', True, "I'm\nthinking", "", []),
    (THOUGHT + "<|start|>assistant" + CALL + '{"arg1": 1}', False, "I'm\nthinking", None, [{"arg1": 1}]),
    (THOUGHT + "<|start|>assistant<|channel|>commentary to=functions.special_function<|message|>{\"arg1\": 1}", False,
     "I'm\nthinking", None, [{"arg1": 1}]),
    (THOUGHT + "<|start|>assistant" + CALL.replace("commentary", "analysis") + '{"arg1": 1}', False, "I'm\nthinking",
     None, [{"arg1": 1}]),
    (THOUGHT + "<|start|>assistant<|channel|>commentary<|message|>Hello, world!\nWhat's up?", True, "I'm\nthinking",
     "Hello, world!\nWhat's up?", []),
    (THOUGHT + "<|start|>assistant<|channel|>commentary<|message|>Hello, world!\nWhat's up?<|end|><|start|>assistant"
     + CALL + '{"arg1": 1}', False, "I'm\nthinking", "Hello, world!\nWhat's up?", [{"arg1": 1}]),
    (" to=functions.special_function<|channel|>commentary <|constrain|>json<|message|>{\"arg1\": 1}", False, None,
     None, [{"arg1": 1}]),
    (" to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{\"arg1\": 1}", False, None, None,
     [{"arg1": 1}]),
    (THOUGHT + "<|start|>assistant to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>"
     '{"arg1": 1}', False, "I'm\nthinking", None, [{"arg1": 1}]),
    # (and ours: a message to a built-in tool is dropped, two analyses are one reasoning, text is content as written)
    (THOUGHT + "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|end|><|start|>assistant"
     "<|channel|>analysis<|message|>More.<|end|><|start|>assistant<|channel|>final<|message|>Done.", False,
     "I'm\nthinking\n\nMore.", "Done.", []),
    ("  Plain text, no header.", False, None, "  Plain text, no header.", []),
    (THOUGHT + "<|start|>assistant<|channel|>weird<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>A.",
     False, "I'm\nthinking", "A.", []),
    # (a call closed by <|end|> rather than <|call|>, and what followed it: content)
    (CALL + '{"arg1": 1}<|end|><|start|>assistant<|channel|>final<|message|>Done.', False, None, "Done.",
     [{"arg1": 1}]),
    # (the length cut a second call: the first stands; and a cut call after a preamble leaves the preamble)
    (CALL + '{"arg1": 1}<|end|><|start|>assistant' + CALL + '{"arg1": 2', True, None, None, [{"arg1": 1}]),
    ("<|channel|>commentary<|message|>Checking. <|end|><|start|>assistant" + CALL + '{"ar', True, None, "Checking.",
     []),
]


@pytest.mark.parametrize("text, cut, reasoning, content, calls", CASES)
def test_harmony_answers_read_as_llama_cpps_parser_reads_them(text, cut, reasoning, content, calls):
    use = read_tool_use([FUNCTION], None, None, call_format=HARMONY_CALLS)
    parts = split_reasoning(text, False, HARMONY)
    read = read_calls(parts.content, use, cut)
    assert parts.reasoning == reasoning and read.content == content
    assert [json.loads(call["function"]["arguments"]) for call in read.calls] == calls
    assert all(call["function"]["name"] == "special_function" for call in read.calls)
    assert_stream_adds_up(False, text, HARMONY)


@pytest.mark.parametrize("text, calls", [
    (THOUGHT + "<|start|>assistant<|channel|>final<|message|>Hello, world!\nWhat's up?", []),
    (THOUGHT + "<|start|>assistant" + CALL + '{"arg1": 1}', [{"arg1": 1}]),
])
def test_with_the_reasoning_left_in_the_content_the_analysis_is_written_there_and_calls_still_read(text, calls):
    """--reasoning-format none: as llama.cpp leaves it, the analysis message as written, then the final message's
    text; calls are read as ever."""
    use = read_tool_use([FUNCTION], None, None, call_format=HARMONY_CALLS)
    parts = split_reasoning(text, False, HARMONY_IN_CONTENT)
    assert parts.reasoning is None and parts.content.startswith(THOUGHT)
    read = read_calls(parts.content, use)
    assert [json.loads(call["function"]["arguments"]) for call in read.calls] == calls
    assert read.content == (THOUGHT if calls else THOUGHT + "Hello, world!\nWhat's up?")
    assert_stream_adds_up(False, text, HARMONY_IN_CONTENT)


def test_a_call_that_does_not_read_is_content_and_a_call_of_no_offered_tool_is_none():
    use = read_tool_use([FUNCTION], None, None, call_format=HARMONY_CALLS)
    for arguments in ('{"arg1": 1', "[1]"):
        content = split_reasoning(CALL + arguments, False, HARMONY).content
        assert read_calls(content, use).calls == () and read_calls(content, use).content == content
    other = split_reasoning(CALL.replace("special_function", "other") + "{}", False, HARMONY).content
    assert read_calls(other, use).calls == ()
    # (the content carries a call as the template writes an earlier one into the prompt)
    assert split_reasoning(CALL + "{}", False, HARMONY).content == (
        '<|start|>assistant to=functions.special_function<|channel|>commentary json<|message|>{}')


def gpt_oss_tokenizer():
    words = byte_tokenizer()
    words.add_special_tokens({"additional_special_tokens": MARKERS})
    words.chat_template = TEMPLATE.read_text()
    return words


def words_id(engine, spelling: str) -> int:
    return engine.tokenizer.convert_tokens_to_ids(spelling)


@pytest.fixture(scope="module")
def engine():
    """A tiny gpt-oss (sliding-window layers, sinks, experts: served by the lockstep engine) whose ends of sequence
    are <|return|> and <|call|>, as gpt-oss's generation config names them."""
    words = gpt_oss_tokenizer()
    model = tiny_gpt_oss(3, vocab=len(words), max_positions=2048)
    model.config.eos_token_id = model.generation_config.eos_token_id = [
        words.convert_tokens_to_ids("<|return|>"), words.convert_tokens_to_ids("<|call|>")]
    served = ServingEngine(CausalLM(model), words, model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def test_the_gpt_oss_template_is_read_as_harmony_and_renders_an_earlier_call_after_its_reasoning(engine):
    assert native_call_format(engine.tokenizer) == HARMONY_CALLS and engine.reasoning_tags is HARMONY
    assert set(engine.reasoning_markers) == set(harmony.MARKERS) == set(dict(engine.call_markers))
    shown = read_tool_use([CITY_TOOL], None, None, call_format=engine.call_format).shown()
    conversation = (
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"})
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(messages=conversation, tools=shown)))
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant "
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|><|start|>'
            'functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|><|start|>assistant'
            ) in prompt
    assert prompt.endswith("<|start|>assistant") and "type get_weather = " in prompt
    # Reasoning sent back is read as text: a marker's spelling in it is characters, not the marker.
    end = words_id(engine, "<|end|>")
    spelt = ({**conversation[1], "reasoning_content": "Need <|end|> the tool."},)
    assert engine.encode(CompletionRequest(messages=conversation[:1] + spelt + conversation[2:], tools=shown)).count(
        end) == engine.encode(CompletionRequest(messages=conversation, tools=shown)).count(end)
    # Two calls in one earlier turn: the template writes one a turn, so each goes in a turn of its own, its result
    # after it; the reasoning before the first.
    clock = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    two = (conversation[0], {**conversation[1], "tool_calls": [*conversation[1]["tool_calls"], clock]},
           conversation[2], {"role": "tool", "tool_call_id": "call_2", "content": "noon"})
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(messages=two, tools=shown)))
    assert ('"sunny"<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>') in prompt
    assert prompt.count("Need the tool.") == 1
    # An answer's reasoning sent back with its text (no call): the template shows the text, as it does any answer.
    answered = (*conversation, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
                {"role": "user", "content": "Thanks"})
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(messages=answered, tools=shown)))
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in prompt
    # A call turn's text with its reasoning: the template refuses both, so they go to it as one analysis.
    both = (conversation[0], {**conversation[1], "content": "Checking."}, conversation[2])
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(messages=both, tools=shown)))
    assert "<|channel|>analysis<|message|>Need the tool.\n\nChecking.<|end|>" in prompt


def test_a_required_calls_grammar_takes_gpt_oss_answers_and_nothing_else(engine):
    use = read_tool_use([CITY_TOOL], "required", False, call_format=HARMONY_CALLS, special=engine.call_markers)
    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + '{"city": "Rome"}'
    for answer in (call, THOUGHT + "<|start|>assistant" + call,
                   ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}',
                   '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}'):
        assert grammar_takes(engine, use, answer), answer
    preamble = "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
    for answer in (THOUGHT + "<|start|>assistant" + THOUGHT + "<|start|>assistant" + call, preamble + call,
                   THOUGHT + "<|start|>assistant" + preamble + call,
                   call.replace("<|channel|>commentary", "<|channel|>analysis"),
                   call.replace(" <|constrain|>json", "<|constrain|>json")):
        assert grammar_takes(engine, use, answer), answer
    for answer in (call.replace("Rome", "Oslo"), THOUGHT + call, "<|channel|>final<|message|>Hi",
                   call.replace("get_weather", "get_weathers"), THOUGHT + "<|start|>" + call,
                   call.replace("<|channel|>commentary", "<|channel|>final")):
        assert not grammar_takes(engine, use, answer), answer
    strict = read_tool_use([{**CITY_TOOL, "function": {**CITY_TOOL["function"], "strict": True}}], "auto", False,
                           call_format=HARMONY_CALLS, special=engine.call_markers)
    assert grammar_takes(engine, strict, THOUGHT + "<|start|>assistant<|channel|>final<|message|>Hi")
    assert not grammar_takes(engine, strict, call.replace("Rome", "Oslo"))


def test_a_response_format_is_held_in_the_final_message_after_the_analysis(engine):
    held = reasoning_first(OutputFormat.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"]}), HARMONY, engine.reasoning_tokens, False)
    final = '<|channel|>final<|message|>{"a": 1}'
    assert grammar_takes(engine, held, final) and grammar_takes(engine, held, THOUGHT + "<|start|>assistant" + final)
    assert grammar_takes(engine, held, final.replace("final", "final <|constrain|>json"))
    assert not grammar_takes(engine, held, '{"a": 1}') and not grammar_takes(engine, held, final.replace("1", '"x"'))


@pytest.mark.parametrize("reasoning_format", ["auto", "none"])
def test_a_required_call_through_the_server_whole_and_streamed(engine, reasoning_format):
    """The random model, kept from closing a header as a message of its own (the message marker pushed down, which
    the grammar then allows only after a call's header), calls the tool as the grammar holds it: read as a call, with
    no content, streamed alike; with the reasoning left in the content too (llama.cpp reads calls so as well)."""
    words = engine.tokenizer
    bias = {str(words.convert_tokens_to_ids("<|message|>")): -100}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [CITY_TOOL],
            "tool_choice": "required", "logit_bias": bias, "temperature": 0, "max_tokens": 120}
    client = TestClient(create_app(ServerSettings(reasoning_format=reasoning_format), engine))
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = choice["message"]
    assert "reasoning_content" not in message and message["content"] is None
    assert choice["finish_reason"] == "tool_calls" and len(message["tool_calls"]) == 1
    function = message["tool_calls"][0]["function"]
    assert function["name"] == "get_weather" and json.loads(function["arguments"])["city"] in ("Paris", "Rome")
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    deltas = [event["choices"][0]["delta"] for event in events]
    assert [call["function"] for delta in deltas for call in delta.get("tool_calls", [])] == [function]
    assert not "".join(delta.get("content") or "" for delta in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_the_length_cut_leaves_no_markup_whole_or_streamed(engine):
    """A required call cut inside its arguments: no call, and the content is what came before it, the same whole
    and streamed (not the reader's own spelling of the call)."""
    words = engine.tokenizer
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [CITY_TOOL],
            "tool_choice": "required", "temperature": 0, "max_tokens": 40,
            "logit_bias": {str(words.convert_tokens_to_ids("<|message|>")): -100}}
    client = TestClient(create_app(ServerSettings(), engine))
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert not choice["message"]["content"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert not "".join(event["choices"][0]["delta"].get("content") or "" for event in events)


def test_a_response_format_through_the_server_is_the_final_messages_content(engine):
    """The random model, any analysis closed at once, writes the schema's JSON in a final message: the content is
    the JSON alone, whatever the reasoning format (Harmony's headers are its answer's structure)."""
    words = engine.tokenizer
    bias = {str(words.convert_tokens_to_ids("<|end|>")): 100, str(words.convert_tokens_to_ids("<|channel|>")): 50}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "logit_bias": bias, "temperature": 0,
            "max_tokens": 60,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    for reasoning_format in ("auto", "none"):
        message = TestClient(create_app(ServerSettings(reasoning_format=reasoning_format), engine)).post(
            "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        # (the grammar lets analysis messages come first, or none: this model writes the final message at once)
        assert "reasoning_content" not in message and isinstance(json.loads(message["content"])["ok"], bool)


def test_a_reasoning_effort_reaches_the_template_from_chat_and_responses(engine):
    """gpt-oss's template writes the effort into its system message ("Reasoning: medium" by default): with the byte
    tokenizer each letter is a token, so the prompt's length tells which effort it got."""
    client = TestClient(create_app(ServerSettings(), engine))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}

    def prompt_tokens(**extra) -> int:
        reply = client.post("/v1/chat/completions", json={**chat, **extra})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    medium = prompt_tokens()
    assert prompt_tokens(reasoning_effort="low") == medium - 3 and prompt_tokens(reasoning_effort="high") == medium - 2
    assert prompt_tokens(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}) == medium - 2
    # (other variables beside it leave it be; OpenAI's other efforts reach the template as they are)
    assert prompt_tokens(reasoning_effort="low", chat_template_kwargs={"builtin_tools": []}) == medium - 3
    assert prompt_tokens(reasoning_effort="minimal") == medium + 1
    refused = client.post("/v1/chat/completions", json={**chat, "reasoning_effort": "extreme"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    response = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "max_output_tokens": 1,
                                                  "temperature": 0, "reasoning": {"effort": "low"}}).json()
    assert response["usage"]["input_tokens"] == medium - 3 and response["reasoning"]["effort"] == "low"
    refused = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "reasoning": {"effort": "extreme"}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning.effort"
    refused = client.post("/v1/responses", json={"model": "tiny", "input": "Hi", "reasoning": "low"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning"
