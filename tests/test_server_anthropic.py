"""Anthropic's Messages API on the server (server/anthropic.py): requests read into chat requests, answers written as
messages and as the stream events Anthropic's own client reads, checked against that client's models; its error
envelope and its x-api-key header.

conftest's tiny random Llama and byte tokenizer; greedy throughout (temperature 0 sent as an extra field: the
installed client no longer takes it), so nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from pydantic import TypeAdapter

from jointspec.backends.hf import CausalLM
from jointspec.server.anthropic import MessagesError, chat_request
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine

from helpers import byte_tokenizer, live_server

EVENTS = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}
GREEDY = {"temperature": 0}


def ask(client, headers=None, **fields):
    body = {"model": "tiny", "max_tokens": 12, "messages": [{"role": "user", "content": "Hello"}], **GREEDY, **fields}
    return client.post("/v1/messages", json=body, headers=headers)


def events_of(reply) -> list[dict]:
    assert reply.status_code == 200, reply.text
    events = []
    for block in filter(None, reply.text.split("\n\n")):
        kind, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event, strict=True)
        events.append(event)
    return events


def test_a_messages_request_is_read_into_the_chat_request_that_decodes_it():
    read = chat_request({
        "model": "m", "max_tokens": 40, "system": [{"type": "text", "text": "Be brief."}], "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"}, "thinking": {"type": "disabled"}, "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "x"}, {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C"},
                                         {"type": "tool_result", "tool_use_id": "t2",
                                          "content": [{"type": "text", "text": "21C"}]},
                                         {"type": "text", "text": "Which is warmer?"}]}]})
    chat = read.body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "t2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "18C"}, {"role": "tool", "tool_call_id": "t2",
                                                                  "content": "21C"},
        {"role": "user", "content": "Which is warmer?"}]
    assert read.origins == ("system", "messages.0", "messages.1", "messages.2.content.0", "messages.2.content.1",
                            "messages.2")
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER[
        "input_schema"], "description": "The weather in a city"}}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == ({"type": "function", "function": {
        "name": "get_weather"}}, False)
    assert (chat["max_completion_tokens"], chat["stop"], chat["user"]) == (40, ["END"], "u1")
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert chat_request({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                         "tool_choice": {"type": "any"}}).body["tool_choice"] == "required"
    # A user turn of results alone is those results: no empty user message after them.
    results_only = chat_request({"max_tokens": 1, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                          "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]}).body
    assert [m["role"] for m in results_only["messages"]] == ["user", "assistant", "tool"]
    assert read.wording("messages.4.tool_call_id: max_completion_tokens") == (
        "messages.2.content.1.tool_use_id: max_tokens")


@pytest.mark.parametrize("data, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9",
                                                                  "content": "1"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305",
                                                                                  "name": "web_search"}]},
     "tools.0"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "all"}}, "tool_choice"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "deep"}}, "thinking"),
])
def test_what_a_messages_request_cannot_have_here_is_refused_by_name_in_its_own_envelope(byte_client, data, param):
    with pytest.raises(MessagesError) as refused:
        chat_request(data)
    assert refused.value.param == param
    reply = byte_client.post("/v1/messages", json={"model": "tiny", **data})
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error" and param.split(".")[0] in reply.json()[
        "error"]["message"]
    # The chat route's own checks are worded as this request named its fields.
    too_long = ask(byte_client, max_tokens=5000).json()["error"]
    assert too_long["type"] == "invalid_request_error" and "context" in too_long["message"]
    bad_schema = ask(byte_client, tools=[{"name": "f", "input_schema": {"type": "string"}}]).json()["error"]["message"]
    assert "tools.0.input_schema" in bad_schema and "function" not in bad_schema


def test_a_message_holds_the_chat_routes_answer_whole_and_streamed(byte_client):
    chat = byte_client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, **GREEDY}).json()
    text = chat["choices"][0]["message"]["content"]
    message = Message.model_validate(ask(byte_client).json(), strict=True)
    assert [(block.type, block.text) for block in message.content] == [("text", text)]
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 12)
    events = events_of(ask(byte_client, stream=True))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == ["content_block_stop",
                                                                                    "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 12
    # A stop sequence that matched is named, here and (vLLM's extension) on chat.
    stop = text[2]
    stopped = ask(byte_client, stop_sequences=["zz", stop]).json()
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", stop)
    assert stopped["content"][0]["text"] == text[:2]
    chat_stopped = byte_client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12, "stop": [stop],
        **GREEDY}).json()["choices"][0]
    assert chat_stopped["stop_reason"] == stop and "stop_reason" not in chat["choices"][0]
    streamed = events_of(ask(byte_client, stop_sequences=[stop], stream=True))
    assert streamed[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_calls_are_tool_use_blocks_and_results_are_answered_through_anthropics_client(byte_engine):
    import anthropic

    with live_server(create_app(ServerSettings(api_key="k3y"), byte_engine)) as (url, _):
        client = anthropic.Anthropic(base_url=url, api_key="k3y", max_retries=0)
        asked = dict(model="tiny", max_tokens=120, messages=[{"role": "user", "content": "Weather in Rome?"}],
                     tools=[WEATHER], tool_choice={"type": "any"}, extra_body=GREEDY)
        whole = client.messages.create(**asked)
        calls = [block for block in whole.content if block.type == "tool_use"]
        assert whole.stop_reason == "tool_use" and len(calls) == 1 and calls[0].input["city"] in ("Paris", "Rome")
        with client.messages.stream(**asked) as stream:  # (the client's own accumulator)
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(calls[0].name,
                                                                                       calls[0].input)]
        assert final.stop_reason == "tool_use"
        follow = client.messages.create(model="tiny", max_tokens=4, tools=[WEATHER], extra_body=GREEDY, messages=[
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": [calls[0].model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "21C"}]}])
        assert follow.stop_reason == "max_tokens"
        # A wrong key is refused in this API's envelope.
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(**asked)
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["message"] == "incorrect API key"
    # x-api-key is this API's own header (its older clients and curl examples send it).
    keyed = TestClient(create_app(ServerSettings(api_key="k3y"), byte_engine))
    assert ask(keyed, max_tokens=2, headers=None).status_code == 401
    assert keyed.post("/v1/messages", headers={"x-api-key": "k3y"}, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
    assert keyed.post("/v1/messages", headers={"x-api-key": "nope"}, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 401


def test_a_reasoning_models_thinking_is_a_thinking_block(long_byte_model):
    words = byte_tokenizer()
    words.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content.split('</think>')[-1] }}\n"
                           "{% endfor %}<|assistant|><think>\n")
    served = ServingEngine(CausalLM(long_byte_model), words, model_id="tiny", max_batch_size=2)
    try:
        client = TestClient(create_app(ServerSettings(), served))
        thought = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12,
            **GREEDY}).json()["choices"][0]["message"]["reasoning_content"]
        message = Message.model_validate(ask(client).json(), strict=True)
        assert [(block.type, block.thinking) for block in message.content] == [("thinking", thought)]
        events = events_of(ask(client, stream=True))
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        assert "".join(d.get("thinking", "") for d in deltas) == thought and deltas[-1]["type"] == "signature_delta"
    finally:
        served.close()


def test_a_final_assistant_message_is_continued_as_a_prefill(byte_client, byte_engine):
    """The API's prefill: the answer goes on from the last assistant message's text, not from a new turn."""
    from jointspec.backends.tokens import chat_template_ids
    from jointspec.server.engine import CompletionRequest

    turns = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "The answer is ("}]
    read = chat_request({"max_tokens": 5, "messages": turns})
    assert read.body["continue_final_message"] is True
    prompt = byte_engine.encode(CompletionRequest(messages=tuple(turns), continue_final=True))
    words = byte_engine.tokenizer
    assert prompt == chat_template_ids(words, turns, continue_final=True)
    assert words.decode(prompt).endswith("The answer is (")  # (the turn left open)
    assert len(prompt) < len(chat_template_ids(words, turns))  # (closed and a new turn opened, without it)
    reply = ask(byte_client, messages=turns, max_tokens=3).json()
    assert reply["usage"]["input_tokens"] == len(prompt)
    # On chat, the same as vLLM's continue_final_message; a last message that is not an assistant's text is refused.
    refused = byte_client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": turns[:1], "continue_final_message": True, "max_tokens": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("extra, says", [
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": None}]}]}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ["t"], "content": "1"}]}]},
     "tool_use_id"),
    ({"thinking": {"type": "enabled"}, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
])
def test_malformed_blocks_are_400s_naming_them_not_500s(byte_client, extra, says):
    reply = ask(byte_client, **extra)
    assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text


def test_what_a_conversion_keeps_results_errors_paragraphs_turns_and_the_output_format(byte_client):
    body = chat_request({"max_tokens": 5, "system": [{"type": "text", "text": "You are X."},
                                                     {"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "Part A."}, {"role": "user", "content": [{"type": "text", "text": "Part B."}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "not found",
                                      "is_error": True}]}],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}).body
    assert body["messages"][0] == {"role": "system", "content": "You are X.\n\nBe brief."}
    assert body["messages"][1] == {"role": "user", "content": "Part A.\n\nPart B."}  # (consecutive turns: one)
    assert body["messages"][-1]["content"] == "Error: not found"  # (a failure told from a result)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": {
        "type": "object"}}}
    shaped = ask(byte_client, max_tokens=6, output_config={"format": {"type": "json_schema",
                                                                      "schema": {"type": "object"}}}).json()
    assert shaped["content"][0]["text"].startswith("{")


def test_usage_counts_calls_stops_errors_and_routes_as_the_api_does(byte_client, byte_engine):
    import anthropic

    from jointspec.server.anthropic import MessageShaper, error_body

    usage = MessageShaper.usage_of({"prompt_tokens": 416, "completion_tokens": 8,
                                  "prompt_tokens_details": {"cached_tokens": 400}})
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (16, 400)  # (the total is their sum)
    shaper = MessageShaper()
    shaper._stop({"finish_reason": "tool_calls", "stop_reason": "DONE"})  # (calls made: tool_use, not the stop)
    assert (shaper.stop_reason, shaper.stop_sequence) == ("tool_use", None)
    assert error_body(504, "x")["error"]["type"] == "timeout_error"
    assert shaper.whole({"model": "tiny", "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "choices": [{
        "finish_reason": "stop", "message": {"content": "ok", "reasoning_content": ""}}]})["content"] == [
        {"type": "text", "text": "ok"}]  # (an empty thinking block, thinking turned off, is none)
    # The models list reads as both APIs' clients read it.
    from anthropic.types import ModelInfo
    from openai.types import Model

    listed = byte_client.get("/v1/models").json()
    assert (listed["has_more"], listed["first_id"]) == (False, "tiny")
    ModelInfo.model_validate(listed["data"][0])  # (its created_at a time: strict mode would want a datetime object)
    Model.model_validate(listed["data"][0], strict=True)
    missing = byte_client.get("/v1/messages/batches")
    assert missing.status_code in (404, 405) and missing.json()["type"] == "error"
    with live_server(create_app(ServerSettings(api_key="k3y"), byte_engine)) as (url, _):
        client = anthropic.Anthropic(base_url=url, api_key="k3y", max_retries=0)
        messages = [{"role": "user", "content": "Weather in Rome?"}]
        counted = client.messages.count_tokens(model="tiny", messages=messages, tools=[WEATHER])
        answered = client.messages.create(model="tiny", max_tokens=1, messages=messages, tools=[WEATHER])
        assert counted.input_tokens == answered.usage.input_tokens + answered.usage.cache_read_input_tokens > 0
    keyed = TestClient(create_app(ServerSettings(api_key="k3y"), byte_engine))
    assert keyed.post("/v1/messages", headers={"x-api-key": "k3y", "Authorization": "Bearer placeholder"}, json={
        "model": "tiny", "max_tokens": 2, "messages": messages}).status_code == 200  # (either header may hold it)
    unkeyed = keyed.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": messages})
    assert unkeyed.status_code == 401 and unkeyed.json()["error"]["type"] == "authentication_error"
