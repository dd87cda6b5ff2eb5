"""OpenAI's Responses API on the server (server/responses.py): requests read into chat requests, answers written as
responses and as the typed stream events OpenAI's own client reads, checked against that client's models.

conftest's tiny random Llama and byte tokenizer; greedy throughout, so nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from jointspec.backends.hf import CausalLM
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine
from jointspec.server.responses import (
    ResponsesError,
    ResponseShaper,
    ResponseStore,
    StoredResponse,
    chat_body,
    chat_request,
)

from helpers import byte_tokenizer, live_server

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}


def events_of(reply) -> list[dict]:
    """A streamed response's events, each checked against OpenAI's client's own event models; their numbering."""
    assert reply.status_code == 200, reply.text
    lines = reply.text.split("\n\n")
    events = []
    for block in filter(None, lines):
        kind, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event, strict=True)
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_a_responses_request_is_read_into_the_chat_request_that_decodes_it():
    data = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0, "stream": True,
            "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "metadata": {"a": "b"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                          "text": "in Paris?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text",
                                                                                 "text": "Look it up."}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "18C"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "21C"}]},
            ]}
    chat = chat_body(data)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"}, {"role": "tool", "tool_call_id": "c2",
                                                                  "content": "21C"}]
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": {
        "type": "object"}, "strict": True}}
    assert (chat["max_completion_tokens"], chat["temperature"], chat["stream"]) == (40, 0, True)
    assert chat_body({"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("data, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input.0.type"),
    ({"input": [{"type": "function_call_output", "output": "18C"}]}, "input.0.call_id"),
    # (a result answers a call sent beside it or stored, as OpenAI refuses one whose call it cannot find)
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "c9", "output": "1"}]},
     "input.1.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input.0.arguments"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"model": "tiny"}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "x", "text": "plain"}, "text"),
    ({"input": "x", "instructions": ["a"]}, "instructions"),
])
def test_what_a_responses_request_cannot_have_here_is_refused_by_name(byte_client, data, param):
    with pytest.raises(ResponsesError) as refused:
        chat_body(data)
    assert refused.value.param == param
    reply = byte_client.post("/v1/responses", json={"model": "tiny", **data})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_chat_message_named_in_an_error_is_the_input_item_it_came_from():
    read = chat_request({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "summary": []}, {"type": "function_call_output", "call_id": "c", "output": "1"}]})
    assert read.origins == ("instructions", "input.0", "input.1", "input.3")
    assert read.wording("messages.2.tool_calls.0 must be a call") == "input.1 must be a call"
    assert read.wording("messages.3.tool_call_id") == "input.3.call_id"
    assert read.wording("response_format.json_schema.schema and max_completion_tokens") == (
        "text.format.schema and max_output_tokens")
    assert read.wording("tools.2.function.parameters") == "tools.2.parameters" and read.wording(None) is None


def test_instructions_and_the_system_messages_before_the_conversation_are_one_system_message():
    chat = chat_body({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Later."}]})
    assert chat["messages"] == [{"role": "system", "content": "Be brief.\n\nAnswer in French."},
                                {"role": "user", "content": "Hi"}, {"role": "system", "content": "Later."}]


@pytest.mark.parametrize("data, param, says", [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format", ""),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools.0.strict", "tools.0.strict"),
    ({"max_output_tokens": 5000}, "input", ""),  # (past the context: the chat route names its messages)
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools.0.parameters", ""),
])
def test_what_the_chat_route_refuses_is_named_as_the_responses_request_named_it(byte_client, data, param, says):
    reply = byte_client.post("/v1/responses", json={"model": "tiny", "input": "x", **data})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == param and says in error["message"], reply.text
    for chat_name in ("messages", "max_completion_tokens", "response_format", "function", "tool_call"):
        assert chat_name not in error["message"], error["message"]


def test_a_response_holds_the_chat_routes_answer_and_validates_as_openais(byte_client):
    body = {"model": "tiny", "input": "Hello", "instructions": "Answer.", "max_output_tokens": 12, "temperature": 0,
            "metadata": {"run": "1"}, "parallel_tool_calls": None, "tool_choice": None}  # (nulls: left out)
    whole = byte_client.post("/v1/responses", json=body).json()
    response = Response.model_validate(whole, strict=True)
    chat = byte_client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Hello"}],
        "max_completion_tokens": 12, "temperature": 0}).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"  # (cut)
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 12)
    assert response.metadata == {"run": "1"} and response.instructions == "Answer." and response.id.startswith("resp_")
    # Streamed: the deltas add up to the same text, inside one message item, and the last event carries it all.
    # (a request may name any model: the served one answers, and every event names it)
    events = events_of(byte_client.post("/v1/responses", json={**body, "stream": True, "model": "gpt-4o"}))
    kinds = [event["type"] for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.incomplete"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == response.output_text
    final = Response.model_validate(events[-1]["response"], strict=True)
    assert events[0]["response"]["model"] == final.model == "tiny"  # (the served model's name throughout)
    assert final.output_text == response.output_text and final.usage.output_tokens == 12
    # An answer that ends by itself (here at a stop string: its own third character) is completed.
    ended = byte_client.post("/v1/responses", json={**body, "stop": [response.output_text[2]]}).json()
    assert ended["status"] == "completed" and ended["incomplete_details"] is None
    assert ended["output"][0]["content"][0]["text"] == response.output_text[:2]


def test_calls_come_back_as_function_call_items_whole_and_streamed_through_openais_client(byte_engine):
    import openai

    with live_server(create_app(ServerSettings(), byte_engine)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        asked = dict(model="tiny", input="Weather in Rome?", tools=[WEATHER], tool_choice="required", temperature=0,
                     max_output_tokens=120, parallel_tool_calls=False)
        whole = client.responses.create(**asked)
        calls = [item for item in whole.output if item.type == "function_call"]
        assert whole.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome") and calls[0].call_id.startswith("call_")
        # The client's own stream helper accumulates the events into the same response.
        with client.responses.stream(**asked) as stream:
            final = stream.get_final_response()
        streamed = [item for item in final.output if item.type == "function_call"]
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
        # The call and its result sent back as input items: answered.
        follow = client.responses.create(model="tiny", temperature=0, max_output_tokens=4, tools=[WEATHER], input=[
            {"role": "user", "content": "Weather in Rome?"}, calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "21C"}])
        assert follow.status == "incomplete" and follow.output_text


def test_a_reasoning_models_thinking_is_a_reasoning_item(long_byte_model):
    """A template that opens a reasoning block (DeepSeek-R1's conventions): this random model never closes it, so its
    whole answer is one reasoning item, with the text the chat route returns as reasoning_content."""
    words = byte_tokenizer()
    words.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content.split('</think>')[-1] }}\n"
                           "{% endfor %}<|assistant|><think>\n")
    served = ServingEngine(CausalLM(long_byte_model), words, model_id="tiny", max_batch_size=2)
    try:
        client = TestClient(create_app(ServerSettings(), served))
        body = {"model": "tiny", "input": "Why?", "max_output_tokens": 10, "temperature": 0}
        chat = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user",
                                                                                        "content": "Why?"}],
                                                         "max_tokens": 10, "temperature": 0}).json()
        thought = chat["choices"][0]["message"]["reasoning_content"]
        response = Response.model_validate(client.post("/v1/responses", json=body).json(), strict=True)
        assert [item.type for item in response.output] == ["reasoning"]
        assert response.output[0].content[0].text == thought and response.output_text == ""
        events = events_of(client.post("/v1/responses", json={**body, "stream": True}))
        assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thought
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"] == ["reasoning"]
        parts = [e for e in events if e["type"].startswith("response.content_part.")]
        assert [(e["type"], e["part"]["type"]) for e in parts] == [("response.content_part.added", "reasoning_text"),
                                                                 ("response.content_part.done", "reasoning_text")]
        assert parts[1]["part"]["text"] == thought
        # Continued, a response that only thought reads as sending its reasoning item back does: no turn of its own.
        again = client.post("/v1/responses", json={**body, "input": "And?", "previous_response_id": response.id})
        whole = client.post("/v1/responses", json={**body, "input": [
            {"role": "user", "content": "Why?"}, response.output[0].model_dump(exclude_none=True),
            {"role": "user", "content": "And?"}]})
        assert again.json()["usage"]["input_tokens"] == whole.json()["usage"]["input_tokens"]
    finally:
        served.close()


def test_an_error_in_a_stream_ends_it_with_a_failed_response():
    kept = []
    shaper = ResponseShaper({"model": "tiny", "input": "x"}, {"messages": []}, kept.append)
    events = [*shaper.start("tiny"), *shaper.events({"choices": [{"index": 0, "delta": {"content": "Hi"},
                                                            "finish_reason": None}]}),
              *shaper.events({"error": {"message": "the engine failed", "code": "engine_error"}})]
    parsed = [EVENTS.validate_python(json.loads(event.split("\n")[1][len("data: "):])) for event in events]
    assert parsed[-1].type == "response.failed" and parsed[-1].response.error.message == "the engine failed"
    assert (parsed[-1].response.error.code, parsed[-1].response.error.type) == ("server_error", "engine_error")
    assert [item.content[0].text for item in parsed[-1].response.output] == ["Hi"]  # (what it had written)
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    assert kept == []  # (a failed response is not kept: its answer is partial)


def test_thinking_an_answer_followed_is_complete_however_the_answer_ended():
    shaper = ResponseShaper({"model": "tiny", "input": "x"}, {"messages": []})
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    cut = {"model": "tiny", "usage": usage, "choices": [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "Blue", "reasoning_content": "Scattering."}}]}
    response = Response.model_validate(shaper.whole(cut), strict=True)
    assert [(item.type, item.status) for item in response.output] == [("reasoning", "completed"),
                                                                      ("message", "incomplete")]
    cut["choices"][0]["message"]["content"] = None  # (cut while thinking: the thinking is what was cut)
    assert [item["status"] for item in shaper.whole(cut)["output"]] == ["incomplete"]


# -- stored responses ----------------------------------------------------------------------------------------------

def respond(client, **fields) -> dict:
    reply = client.post("/v1/responses", json={"model": "tiny", "temperature": 0, "max_output_tokens": 6, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_stored_response_is_continued_as_the_whole_conversation_sent_again_without_its_instructions(byte_client):
    """previous_response_id gives the model the conversation the response ended, then the new input: the same prompt
    (its token count) and the same greedy answer as sending that conversation whole; the earlier instructions are
    not carried, as in OpenAI's API, and later requests leave the stored conversation as it was."""
    first = respond(byte_client, input="Hello", instructions="Answer briefly.")
    assert first["store"] is True and first["previous_response_id"] is None
    said = first["output"][0]["content"][0]["text"]
    again = respond(byte_client, input="And then?", previous_response_id=first["id"])
    whole = respond(byte_client, input=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": said},
                                        {"role": "user", "content": "And then?"}])
    assert again["previous_response_id"] == first["id"]
    assert again["usage"]["input_tokens"] == whole["usage"]["input_tokens"] and again["output"] == [
        {**whole["output"][0], "id": again["output"][0]["id"]}]
    # New instructions go first; a chain of two continues both turns; the first response's conversation is unchanged.
    instructed = respond(byte_client, input="And then?", previous_response_id=first["id"], instructions="Be kind.")
    whole_instructed = respond(byte_client, instructions="Be kind.", input=[
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": said},
        {"role": "user", "content": "And then?"}])
    assert instructed["usage"]["input_tokens"] == whole_instructed["usage"]["input_tokens"]
    third = respond(byte_client, input="Why?", previous_response_id=again["id"])
    chained = respond(byte_client, input=[
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": said},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": again["output"][0]["content"][0]["text"]},
        {"role": "user", "content": "Why?"}])
    assert third["usage"]["input_tokens"] == chained["usage"]["input_tokens"]
    assert respond(byte_client, input="And then?", previous_response_id=first["id"])["usage"]["input_tokens"] == \
        again["usage"]["input_tokens"]
    # A call item that follows the stored answer joins its turn, in a copy: asked twice, the same prompt.
    joined = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
              {"type": "function_call_output", "call_id": "c1", "output": "18C"}]
    once, twice = (respond(byte_client, input=joined, previous_response_id=first["id"], tools=[WEATHER])
                   for _ in range(2))
    assert once["usage"]["input_tokens"] == twice["usage"]["input_tokens"]


def test_a_call_of_a_stored_response_is_answered_by_its_result_alone(byte_engine):
    """The loop an agent runs with previous_response_id (OpenAI's client): a response that called a function, then
    only the function's output as input; and GET and DELETE on the stored response."""
    import openai

    with live_server(create_app(ServerSettings(), byte_engine)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        called = client.responses.create(model="tiny", input="Weather in Rome?", tools=[WEATHER],
                                         tool_choice="required", temperature=0, max_output_tokens=120,
                                         parallel_tool_calls=False)
        call = next(item for item in called.output if item.type == "function_call")
        follow = client.responses.create(model="tiny", previous_response_id=called.id, temperature=0,
                                         max_output_tokens=4, tools=[WEATHER], input=[
                                             {"type": "function_call_output", "call_id": call.call_id,
                                              "output": "21C"}])
        # (the same conversation whole: the request, every output item of the response, the result)
        whole = client.responses.create(model="tiny", temperature=0, max_output_tokens=4, tools=[WEATHER], input=[
            {"role": "user", "content": "Weather in Rome?"}, *(item.model_dump(exclude_none=True)
                                                               for item in called.output),
            {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}])
        assert follow.usage.input_tokens == whole.usage.input_tokens and follow.output_text == whole.output_text
        # Its input items: the conversation it continued and its own input, which sent back whole give the same
        # prompt; listed a page at a time (newest first by default), the same items.
        items = [item.model_dump(exclude_none=True) for item in
                 client.responses.input_items.list(follow.id, order="asc")]
        # (the answer's items as the response gave them, less their ids and status: its text, if any, and its call)
        answered = [{key: value for key, value in item.model_dump(exclude_none=True).items()
                     if key not in ("id", "status")} for item in called.output]
        assert [{key: value for key, value in item.items() if key not in ("id", "status")} for item in items] == [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
            *answered, {"type": "function_call_output", "call_id": call.call_id, "output": "21C"}]
        sent_back = client.responses.create(model="tiny", temperature=0, max_output_tokens=4, tools=[WEATHER],
                                            input=[{key: value for key, value in item.items() if key != "id"}
                                                   for item in items])
        assert sent_back.usage.input_tokens == follow.usage.input_tokens
        paged = [item.model_dump(exclude_none=True) for item in client.responses.input_items.list(follow.id, limit=1)]
        assert paged == items[::-1]
        # Streamed responses are stored as their last event carries them.
        last = list(client.responses.create(model="tiny", input="Hi", temperature=0, max_output_tokens=5,
                                            stream=True))[-1]
        assert last.type == "response.incomplete" and last.response.store
        assert client.responses.retrieve(last.response.id).model_dump() == last.response.model_dump()
        assert client.responses.retrieve(follow.id).output_text == follow.output_text
        client.responses.delete(follow.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(follow.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(follow.id)


def test_input_items_keep_reasoning_calls_and_results_apart_as_openais_item_types():
    """An earlier assistant turn's reasoning, text and calls are the items a response's output gave them as; a tool
    result is its call's output; the response's own answer is not an input."""
    conversation = ({"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Looking.", "reasoning_content": "Call it.", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "Rome"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "18C"})
    response = {"id": "resp_1", "output": [{"type": "message", "content": [{"type": "output_text", "text": "18C."}]}]}
    items = StoredResponse.of(response, conversation).input_items()
    assert [{key: value for key, value in item.items() if key not in ("id", "status")} for item in items] == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18C"}]
    assert [item["id"].split("_")[0] for item in items] == ["msg", "rs", "msg", "fc", "fco"]


def test_input_items_are_listed_in_pages_by_cursor_and_a_bad_query_is_a_400(byte_client):
    first = respond(byte_client, input=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    second = respond(byte_client, input="Again?", previous_response_id=first["id"])

    def listed(response_id, **query):
        reply = byte_client.get(f"/v1/responses/{response_id}/input_items", params=query)
        assert reply.status_code == 200, reply.text
        return reply.json()

    whole = listed(second["id"], order="asc")
    said = first["output"][0]["content"][0]["text"]
    assert [(item["role"], item["content"][0]["text"]) for item in whole["data"]] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"), ("assistant", said),
        ("user", "Again?")]
    assert [item["content"][0]["type"] for item in whole["data"]][:3] == ["input_text", "input_text", "output_text"]
    ids = [item["id"] for item in whole["data"]]
    assert len(set(ids)) == 6 and whole["first_id"] == ids[0] and whole["last_id"] == ids[-1] and not whole["has_more"]
    assert listed(second["id"], order="asc") == whole  # (the same ids from one listing to the next)
    assert [item["id"] for item in listed(second["id"])["data"]] == ids[::-1]  # (newest first by default)
    page = listed(second["id"], order="asc", limit=2, after=ids[1])
    assert [item["id"] for item in page["data"]] == ids[2:4] and page["has_more"] and page["last_id"] == ids[3]
    assert [item["id"] for item in listed(second["id"], order="asc", after=ids[0], before=ids[3])["data"]] == ids[1:3]
    back = listed(second["id"], order="asc", limit=2, before=ids[4])  # (before alone: the page just before it)
    assert [item["id"] for item in back["data"]] == ids[2:4] and back["has_more"]
    first_page = listed(second["id"], order="asc", limit=5, before=ids[2])
    assert [item["id"] for item in first_page["data"]] == ids[:2] and not first_page["has_more"]
    assert not listed(second["id"], order="asc", limit=3, after=ids[2])["has_more"]
    empty = listed(second["id"], order="asc", after=ids[-1])
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]
    for query, param in [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"),
                         ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"), ({"before": "x"}, "before")]:
        reply = byte_client.get(f"/v1/responses/{second['id']}/input_items", params=query)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, query
    assert byte_client.get("/v1/responses/resp_nope/input_items").status_code == 404


def test_what_is_not_stored_cannot_be_fetched_or_continued(byte_engine):
    kept = TestClient(create_app(ServerSettings(stored_responses=2), byte_engine))
    unstored = respond(kept, input="Hi", store=False)
    assert unstored["store"] is False and kept.get(f"/v1/responses/{unstored['id']}").status_code == 404
    refused = kept.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": unstored["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    assert refused.json()["error"]["code"] == "previous_response_not_found"  # (OpenAI's, which clients read)
    # store: null is store left out (true); a stored response is returned whole, not as a stream
    nulled = respond(kept, input="Hi", store=None)
    assert nulled["store"] is True and kept.get(f"/v1/responses/{nulled['id']}").json() == nulled
    assert kept.get(f"/v1/responses/{nulled['id']}?stream=true").json()["error"]["param"] == "stream"
    # At most 2 kept: the least recently used goes first (fetching one counts as a use).
    a, b = respond(kept, input="a"), respond(kept, input="b")
    assert kept.get(f"/v1/responses/{a['id']}").status_code == 200
    c = respond(kept, input="c")
    assert [kept.get(f"/v1/responses/{r['id']}").status_code for r in (a, b, c)] == [200, 404, 200]
    # A server that stores none says so, and a request that asks to store is answered unstored.
    none = TestClient(create_app(ServerSettings(stored_responses=0), byte_engine))
    answered = respond(none, input="Hi")
    assert answered["store"] is False and none.get(f"/v1/responses/{answered['id']}").status_code == 404
    refused = none.post("/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": a["id"]})
    assert refused.status_code == 400 and "--stored-responses 0" in refused.json()["error"]["message"]
    assert kept.post("/v1/responses", json={"model": "tiny", "input": "x", "store": "yes"}).json()["error"][
        "param"] == "store"


def test_the_store_keeps_responses_within_its_count_and_its_budget_charging_each_only_its_own_text():
    def response(number: int, text: str) -> dict:
        return {"id": f"resp_{number}", "output": [{"type": "message", "content": [{"type": "output_text",
                                                                                      "text": text}]}]}

    first = StoredResponse.of(response(1, "a" * 1000), ({"role": "user", "content": "b" * 1000},))
    follow = StoredResponse.of(response(2, "c"), first.messages + ({"role": "user", "content": "d"},),
                               continued=len(first.messages))
    assert first.size > 3000 and follow.size < 300 and follow.messages[:2] == first.messages
    store = ResponseStore(capacity=10, budget=first.size + follow.size)
    store.put(first)
    store.put(follow)
    assert len(store) == 2 and store.held == first.size + follow.size
    store.put(StoredResponse.of(response(3, "e"), ()))  # (over the budget: the least recently used goes)
    assert store.get("resp_1") is None and store.get("resp_2") is follow and store.held <= store.budget
    assert store.delete("resp_2") and not store.delete("resp_2") and store.held == store.get("resp_3").size
