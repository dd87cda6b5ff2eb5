"""What the server's chat requests do through a model's chat template: reasoning kept apart from the answer
(server/reasoning.py), ``chat_template_kwargs``, and conversations a template refuses.

The model is conftest's tiny random Llama with its byte-level tokenizer, given templates of this file's own in the
conventions of Qwen3's (the model opens its ``<think>`` block; ``enable_thinking: false`` writes an empty one into the
prompt) and DeepSeek-R1's (the prompt opens the block). Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import chat_template_ids
from jointspec.server.app import ServerSettings, _Reply, create_app
from jointspec.server.engine import Chunk, CompletionRequest, ServingEngine
from jointspec.server.reasoning import (
    MISTRAL_THINK,
    THINK,
    THINK_RESPONSE,
    ReasoningStream,
    prompt_opens_reasoning,
    split_reasoning,
    template_reasons,
)
from jointspec.server.tools import read_tool_use

from helpers import assert_stream_adds_up, byte_tokenizer, tiny_llama, tokenizer_with

# Qwen3's conventions: the answer may open a block itself; enable_thinking false writes an empty one after the turn's
# opening; earlier reasoning sent back is shown in its turn.
QWEN_LIKE = (
    "{% set ns = namespace(turns=0) %}{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}\n{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}")
# DeepSeek-R1's: the prompt opens the block, and the answer closes it; earlier answers lose their reasoning.
R1_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content.split('</think>')[-1] }}\n{% endfor %}"
           "<|assistant|><think>\n")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, vocab=259, max_positions=1024)


@pytest.fixture(scope="module")
def r1_engine(model):
    served = ServingEngine(CausalLM(model), tokenizer_with(R1_LIKE), model_id="tiny", max_batch_size=4)
    yield served
    served.close()


@pytest.fixture(scope="module")
def qwen_engine(model):
    served = ServingEngine(CausalLM(model), tokenizer_with(QWEN_LIKE), model_id="tiny", max_batch_size=4)
    yield served
    served.close()


def chat(client: TestClient, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "temperature": 0,
            "max_tokens": 24, **extra}
    return client.post("/v1/chat/completions", json=body)


def streamed(client: TestClient, **extra) -> list[dict]:
    reply = chat(client, stream=True, **extra)
    assert reply.status_code == 200, reply.text
    return [json.loads(line[6:])["choices"][0] for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# -- reading reasoning -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nSky: scattering.\n</think>\n\nRayleigh scattering.", False, "Sky: scattering.",
     "Rayleigh scattering."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Rayleigh scattering.", False, None, "Rayleigh scattering."),
    ("Text, then <think>x</think> y", False, None, "Text, then <think>x</think> y"),  # (a block later is text)
    ("<think>\nstill thinking when cut", False, "still thinking when cut", ""),
    ("<think>\n\n</think>\n\nNo thoughts.", False, "", "No thoughts."),
    ("scattering...\n</think>\n\nBlue light.", True, "scattering...", "Blue light."),  # (the prompt opened it)
    ("never closed", True, "never closed", ""),
    ("x</think>a </think> b", True, "x", "a </think> b"),
    ("<think>\nagain</think>ok", True, "again", "ok"),  # (an answer that opens the prompt's block again)
    ("", False, None, ""),
    ("", True, "", ""),
])
def test_an_answer_is_split_into_its_reasoning_and_its_content(text, opened, reasoning, content):
    parts = split_reasoning(text, opened)
    assert (parts.reasoning, parts.content) == (reasoning, content)


@pytest.mark.parametrize("opened, text", [
    (False, "<think>\nSky: scattering.\n</think>\n\nRayleigh scattering."),
    (False, "  <think> a <b> </thin </think>  c"),
    (False, "<thing> is not a tag"),
    (False, "Plain answer\n"),
    (False, "<think>cut </thi"),
    (True, "a\n\n</think>\n\nb < c"),
    (True, "no end <"),
    (False, "<think>\nPlan.\n</think>\n<response>\nBlue light.\n</response>"),
    (False, " <response> x </resp </response>y"),
    (True, "a</think><response> cut "),
    (False, '<think>hm</think><response> {"s": "</response>"} </response>\n'),
    (False, "<response>a </response> b </response></response> c"),
])
def test_a_stream_sends_what_the_whole_answer_has_however_the_text_is_split(opened, text):
    for tags in (THINK, THINK_RESPONSE):
        assert_stream_adds_up(opened, text, tags)
    # What it cannot yet tell apart waits: the start of a tag, whitespace that may end the reasoning.
    waiting = ReasoningStream(False)
    assert waiting.feed(" <thi") == ("", "") and waiting.feed("nk>Hi ") == ("Hi", "")
    assert waiting.feed("</th") == ("", "") and waiting.feed("ere") == (" </there", "")
    assert ReasoningStream(False).feed("Hello") == ("", "Hello")
    wrapped = ReasoningStream(False, THINK_RESPONSE)
    assert wrapped.feed("<think>a</think>\n<resp") == ("a", "") and wrapped.feed("onse>\nB ") == ("", "B")
    assert wrapped.feed("</resp") == ("", "") and wrapped.feed("onse>") == ("", "")


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nPlan.\n</think>\n<response>\nBlue light.\n</response>", False, "Plan.", "Blue light."),
    ("<think>a</think><response>b", False, "a", "b"),  # (cut before the closing tag)
    ("<think>a</think> <response> b </response> c", False, "a", "b c"),  # (what follows it, as written)
    ("<think>a</think>b <response>c</response>", False, "a", "b <response>c</response>"),  # (tags later are text)
    ("<response>only</response>", False, None, "only"),
    ("  <response>x</response>", False, None, "x"),
    ("  plain", False, None, "  plain"),
    ("<resp", False, None, "<resp"),
    ("a</think><response>b</response>", True, "a", "b"),
    # (the last closing tag closes them: the answer inside may spell one, as a JSON string a grammar lets through)
    ('<think>hm</think><response>{"s": "</response>"}</response>', False, "hm", '{"s": "</response>"}'),
    ("<response>a</response> b </response> c", False, None, "a</response> b c"),
])
def test_granites_content_has_its_response_tags_taken_off(text, opened, reasoning, content):
    parts = split_reasoning(text, opened, THINK_RESPONSE)
    assert (parts.reasoning, parts.content) == (reasoning, content)
    assert "<response>" in split_reasoning(text, opened).content or "<response>" not in text  # (other templates)


@pytest.mark.parametrize("tags", [None, THINK_RESPONSE])
def test_streams_of_seeded_random_answers_add_up_to_the_whole_answers_parts(tags):
    """Answers made of the pieces a reading can trip on, split at random places (seeded: the same every run)."""
    import random

    rng = random.Random(7)
    pieces = ["<think>", "</think>", "<", "</th", "<thi", "nk>", " ", "\n", "a", "b c", "think>"]
    if tags is not None:
        pieces += ["<response>", "</response>", "<resp", "</res", "ponse>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        opened = rng.random() < 0.5
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = ReasoningStream(opened) if tags is None else ReasoningStream(opened, tags)
        sent = [stream.feed(chunk, final=number == len(chunks) - 1) for number, chunk in enumerate(chunks)]
        whole = split_reasoning(text, opened) if tags is None else split_reasoning(text, opened, tags)
        assert ("".join(r for r, _ in sent), "".join(c for _, c in sent)) == (whole.reasoning or "",
                                                                             whole.content), (text, opened, chunks)


def test_templates_that_write_reasoning_and_prompts_that_open_it_are_recognised(r1_engine, qwen_engine):
    assert template_reasons(tokenizer_with(QWEN_LIKE)) and template_reasons(tokenizer_with(R1_LIKE))
    assert not template_reasons(byte_tokenizer()) and template_reasons(tokenizer_with({"default": R1_LIKE}))
    assert prompt_opens_reasoning("<|assistant|><think>\n") and not prompt_opens_reasoning("<think>\n\n</think>\n\n")
    # Granite 3.3's instruction names both of its answer's tags; a template that wraps tool results in them does not.
    granite_like = QWEN_LIKE + "{# write your response between <response></response> #}"
    minimax_like = QWEN_LIKE + "{% if false %}<response>{{ m.content }}</response>{% endif %}"
    assert (template_reasons(tokenizer_with(granite_like)), template_reasons(tokenizer_with(minimax_like))) == (
        THINK_RESPONSE, THINK)
    assert template_reasons(tokenizer_with("{{ '[THINK]' + m.thinking + '[/THINK]' }}")) == MISTRAL_THINK


# -- through the server ----------------------------------------------------------------------------------------

def test_an_answer_begun_inside_a_block_is_reasoning_until_it_closes_it(r1_engine):
    """The R1-like prompt opens the block and this random model never closes it: its whole answer is reasoning,
    and the same answer with reasoning_format none is the content, as written."""
    split = TestClient(create_app(ServerSettings(), r1_engine))
    plain = TestClient(create_app(ServerSettings(reasoning_format="none"), r1_engine))
    written = chat(plain).json()["choices"][0]["message"]
    assert "reasoning_content" not in written and written["content"]
    message = chat(split).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": None, "reasoning_content": written["content"].strip()}
    deltas = [choice["delta"] for choice in streamed(split)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not any(d.get("content") for d in deltas)
    # A format (required calls, JSON) is the content's, after the reasoning: this model never closes the block, so
    # its answer gets no further than reasoning (tests/test_server_reasoning_formats.py closes it).
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
        "additionalProperties": False}}}
    for extra in ({"tools": [weather], "tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
        held = chat(split, **extra).json()["choices"][0]
        assert held["finish_reason"] == "length" and held["message"]["content"] is None, extra
        assert held["message"]["reasoning_content"] and "tool_calls" not in held["message"]
    # (OpenAI's default format said out loud holds nothing: the answer is read for reasoning as before)
    assert chat(split, response_format={"type": "text"}).json()["choices"][0]["message"] == message


def test_a_reply_carries_reasoning_and_content_apart_whole_and_streamed_with_tools_read_from_the_content():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    pieces = ["<think>\nThe user wants", " weather.\n", "</think>", "\n\n", "<tool_call>\n", '{"name": "get_weather", '
              '"arguments": {"city": "Paris"}}\n</tool_call>']
    chunks = [Chunk(text=piece, num_tokens=1, num_rounds=1) for piece in pieces]
    chunks[-1].finish_reason = "stop"
    for tools in (None, read_tool_use([weather], None, None)):
        reply = _Reply("chat", "tiny", 5, None)
        reply.tools, reply.reasoning = tools, {0: False}
        message = reply.whole([chunks])["choices"][0]["message"]
        assert message["reasoning_content"] == "The user wants weather."
        events = [event["choices"][0] for chunk in chunks for event in reply.events(chunk)]
        deltas = [event["delta"] for event in events]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather."
        assert deltas[0] == {"reasoning_content": "The user wants"}  # (sent as it comes)
        assert all(deltas[:-1])  # (pieces held back whole send no empty chunk)
        if tools is None:
            assert message["content"] == "".join(pieces[3:]).lstrip() == "".join(d.get("content", "") for d in deltas)
        else:
            assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
            assert [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])] == [
                '{"city": "Paris"}'] and not any(d.get("content") for d in deltas)
            assert events[-1]["finish_reason"] == "tool_calls"


def test_granites_reply_carries_its_content_without_the_response_tags_whole_and_streamed():
    pieces = ["<think>", "Sky: scattering.", "</think>", "\n<resp", "onse>\n", "Blue ", "light.\n</response>"]
    chunks = [Chunk(text=piece, num_tokens=1, num_rounds=1) for piece in pieces]
    chunks[-1].finish_reason = "stop"
    reply = _Reply("chat", "tiny", 5, None)
    reply.reasoning, reply.reasoning_tags = {0: False}, {0: THINK_RESPONSE}
    message = reply.whole([chunks])["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Sky: scattering.", "Blue light.")
    deltas = [event["choices"][0]["delta"] for chunk in chunks for event in reply.events(chunk)]
    assert "".join(d.get("content", "") for d in deltas) == "Blue light."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Sky: scattering."


def test_chat_template_kwargs_reach_the_template_and_earlier_reasoning_is_shown_to_it(qwen_engine):
    client = TestClient(create_app(ServerSettings(), qwen_engine))
    messages = [{"role": "user", "content": "Hi"}]
    off = CompletionRequest(messages=tuple(messages), template_kwargs={"enable_thinking": False})
    words = qwen_engine.tokenizer
    assert words.decode(qwen_engine.encode(off)).endswith("<|assistant|><think>\n\n</think>\n\n")
    assert qwen_engine.encode(off) == chat_template_ids(words, messages, template_kwargs={"enable_thinking": False})
    assert words.decode(qwen_engine.encode(CompletionRequest(messages=tuple(messages)))).endswith("<|assistant|>")
    # (the empty block is the prompt's: the answer begins after it, as content)
    thinking_off = chat(client, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert "reasoning_content" not in thinking_off
    history = [*messages, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."},
               {"role": "user", "content": "Bye"}]
    prompt = words.decode(qwen_engine.encode(CompletionRequest(messages=tuple(chat_body_messages(history)))))
    assert "<|assistant|><think>Greet back.</think>Hello.\n" in prompt
    assert chat(client, messages=history).status_code == 200
    # Earlier reasoning is read as text, as content is: a special token's spelling in it stays characters (where
    # the template shows it), and a template that drops it does not look for it.
    spelled = [*messages, {"role": "assistant", "content": "Hello.", "reasoning_content": "a </s> b"}]
    ids = qwen_engine.encode(CompletionRequest(messages=tuple(chat_body_messages(spelled))))
    assert "<think>a </s> b</think>" in words.decode(ids) and words.convert_tokens_to_ids("</s>") not in ids
    dropping = tokenizer_with(R1_LIKE)
    assert chat_template_ids(dropping, chat_body_messages(spelled)) == chat_template_ids(dropping, [
        *messages, {"role": "assistant", "content": "Hello."}])


def chat_body_messages(history: list[dict]) -> list[dict]:
    """The messages as the route gives them to the engine."""
    from jointspec.server.app import Message, _message

    return [_message(Message.model_validate(message)) for message in history]


@pytest.mark.parametrize("extra, param, says", [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "add_generation_prompt"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"chat_template_kwargs": {"note": "</s>"}}, None, "special token"),
    # (names the template call or the template itself uses otherwise: refused as the template fails on them)
    ({"chat_template_kwargs": {"conversations": []}}, "chat_template_kwargs", "may not set conversations"),
    ({"chat_template_kwargs": {"namespace": 1}}, "chat_template_kwargs", "cannot be given"),
    ({"chat_template_kwargs": {"deep": json.loads("[" * 600 + "]" * 600)}}, None, "nested too deeply"),
])
def test_what_the_template_may_not_be_given_is_a_400(qwen_engine, extra, param, says):
    reply = chat(TestClient(create_app(ServerSettings(), qwen_engine)), **extra)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param and says in reply.text, reply.text


def test_a_conversation_the_template_refuses_is_a_400_naming_the_messages(model):
    strict = tokenizer_with("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
                            "supported') }}{% endif %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>")
    served = ServingEngine(CausalLM(model), strict, model_id="tiny", max_batch_size=2)
    try:
        client = TestClient(create_app(ServerSettings(), served))
        reply = chat(client, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
        assert "refused the conversation: System role not supported" in reply.json()["error"]["message"]
        assert chat(client).status_code == 200  # (a conversation it takes)
    finally:
        served.close()
    with pytest.raises(ValueError, match="reasoning_format"):
        ServerSettings(reasoning_format="deepseek")
