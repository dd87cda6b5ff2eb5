"""The server with real models' chat templates (tests/data/chat_templates, verbatim, with their sources and licences):
which tool-call format it reads from each, where each leaves an answer's reasoning, and the prompt each renders for a
conversation with an earlier call, its result and an answer. The tokenizers are the byte tokenizer with each model's
control tokens added as its own tokenizer has them (special, or added without the flag), the model a tiny random
Llama. Greedy throughout: nothing can fail by chance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import CompletionRequest, ServingEngine
from jointspec.server.reasoning import (
    APRIEL_THINK,
    HARMONY,
    INNER,
    MISTRAL_THINK,
    THINK,
    THINK_RESPONSE,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
    reasoning_first,
    split_reasoning,
)
from jointspec.server.tools import (
    APERTUS,
    APRIEL,
    GLM,
    GRANITE,
    HARMONY_CALLS,
    HERMES,
    MISTRAL_V3,
    MISTRAL_V11,
    QWEN3_CODER,
    native_call_format,
    read_calls,
    read_tool_use,
)

from helpers import CITY_TOOL, byte_tokenizer, check_required_call, grammar_takes, llama_ending_at_eos

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
QWEN = (["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                         "</tool_response>"])
MISTRAL = ["[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]"]
APERTUS_CONTROL = [f"<|{part}_{end}|>" for part in ("system", "developer", "user", "assistant")
                   for end in ("start", "end")] + ["<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>",
                                                   "<|tools_suffix|>"]
# Each template: its model's control tokens (special ones, added ones), the call format read from it, its reasoning
# tags, and how a prompt leaves the answer (opened: inside a block; closed: after an empty one) by default and with
# thinking off.
MODELS = {
    "Qwen3-0.6B": (*QWEN, HERMES, THINK, (False, False), (False, True)),
    "Qwen3.5-4B": (*QWEN, QWEN3_CODER, THINK, (True, False), (False, True)),
    "granite-3.3-2b-instruct": (["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"], [],
                                GRANITE, THINK_RESPONSE, (False, False), (False, False)),
    "granite-4.0": (["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"], QWEN[1][2:], HERMES, None, None,
                    None),
    "Mistral-Nemo-Instruct-2407": (MISTRAL, [], MISTRAL_V3, None, None, None),
    "Mistral-Small-3.2-24B-Instruct-2506": (MISTRAL + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]",
                                                       "[TOOL_CONTENT]"], [], MISTRAL_V11, None, None, None),
    "Ministral-3-14B-Reasoning-2512": (MISTRAL + ["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[THINK]",
                                                  "[/THINK]"], [], MISTRAL_V11, MISTRAL_THINK, (False, False),
                                       (False, False)),
    "Apertus-8B-Instruct-2509": (APERTUS_CONTROL, [], APERTUS, INNER, (False, False), (False, False)),
    "Apriel-1.5-15b-Thinker": (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool_result|>"], [], APRIEL,
                               None, None, None),
    "Apriel-1.6-15b-Thinker": (["<|begin_system|>", "<|begin_user|>", "<|begin_assistant|>", "<|end|>",
                                "<|begin_content|>"], [], APRIEL, APRIEL_THINK, (True, False), (True, False)),
    "GLM-4.7-Flash": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
                      ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                       "<tool_response>", "</tool_response>", "<think>", "</think>"], GLM, THINK, (True, False),
                      (False, True)),
    "SmolLM3-3B": (["<|im_start|>", "<|im_end|>"], ["<think>", "</think>", "<tool_call>", "</tool_call>"], HERMES,
                   THINK, (False, False), (False, True)),
    "gpt-oss-120b": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"],
                     [], HARMONY_CALLS, HARMONY, (False, False), (False, False)),
    "DeepSeek-R1-Distill-Qwen-32B": (["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>",
                                      "<｜begin▁of▁sentence｜>"], ["<think>", "</think>"], None, THINK,
                                     (True, False), (True, False)),
}
# An earlier call as each format writes it into the prompt (Mistral's with its call id as 9 characters).
CALLS = {
    "Qwen3-0.6B": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "Qwen3.5-4B": "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "</function>",
    # (Granite 3's template drops an assistant's calls: the server writes them after its text)
    "granite-3.3-2b-instruct": 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "granite-4.0": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "Mistral-Nemo-Instruct-2407": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "',
    "Mistral-Small-3.2-24B-Instruct-2506": "[TOOL_CALLS]get_weather[CALL_ID]",
    "Ministral-3-14B-Reasoning-2512": 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    "Apertus-8B-Instruct-2509": 'Checking.<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>',
    "GLM-4.7-Flash": "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>",
    "Apriel-1.6-15b-Thinker": 'Checking.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": '
                              '"call_abc123"}]</tool_calls>',
    "Apriel-1.5-15b-Thinker": 'Checking.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": '
                              '"call_abc123"}]</tool_calls>',
    # (SmolLM3's template drops an assistant's calls: the server writes them after its text)
    "SmolLM3-3B": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    # (the call as a message to the function; its turn's text dropped, as a final answer follows it)
    "gpt-oss-120b": '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                    "<|call|>",
    # (no format of its own: the tools and calls shown as text in Hermes's)
    "DeepSeek-R1-Distill-Qwen-32B": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = (
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call_abc123", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And Rome?"})


def tokenizer_of(name: str):
    special, added, *_ = MODELS[name]
    words = byte_tokenizer()
    words.add_special_tokens({"additional_special_tokens": special})
    if added:
        words.add_tokens(added)
    words.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return words


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request):
    words = tokenizer_of(request.param)
    engine = ServingEngine(CausalLM(llama_ending_at_eos(3, len(words))), words, model_id="tiny", max_batch_size=4)
    yield request.param, engine
    engine.close()


def test_each_templates_format_and_reasoning_are_read(served):
    name, engine = served
    *_, call_format, tags, by_default, thinking_off = MODELS[name]
    assert native_call_format(engine.tokenizer) == call_format and engine.reasoning_tags == tags
    if tags is not None:
        for kwargs, (opened, closed) in (({}, by_default), ({"enable_thinking": False}, thinking_off)):
            prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(
                messages=({"role": "user", "content": "Hi"},), template_kwargs=kwargs)))
            assert (prompt_opens_reasoning(prompt, tags), prompt_closes_reasoning(prompt, tags)) == (opened, closed)


def test_serve_says_what_it_reads_of_each_template(served):
    from jointspec.cli.serve import chat_line

    name, engine = served
    *_, call_format, tags, _, _ = MODELS[name]
    line = chat_line(engine)
    assert (f"tool calls in {call_format} format (the chat template's own)" in line if call_format
            else "tool calls in hermes format, shown to the model as text" in line)
    assert (tags is not None and (f"reasoning between {tags.open} and {tags.close}" in line or (
        tags.harmony and "reasoning in Harmony's analysis channel" in line))) == (tags is not None)
    assert ("the content's <response> and </response> taken off" in line) == (tags is THINK_RESPONSE)
    assert "reasoning left in the content" in chat_line(engine, "none") or tags is None


def test_each_template_renders_an_earlier_call_in_its_models_format(served):
    name, engine = served
    shown = read_tool_use([WEATHER], None, None, call_format=engine.call_format).shown()
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(messages=CONVERSATION, tools=shown)))
    assert CALLS[name] in prompt and "sunny" in prompt and "And Rome?" in prompt
    assert prompt.count("get_weather") >= 2  # the offered tool is shown too (SmolLM3's template reads xml_tools)
    assert engine.shows_calls == (name not in ("granite-3.3-2b-instruct", "SmolLM3-3B"))


def test_the_tools_variable_a_template_reads():
    """SmolLM3's first template reads ``xml_tools``; its later one, and every other, ``tools`` (transformers'
    ``{% generation %}`` tag, which plain jinja2 cannot read, taken off first)."""
    from jointspec.server.tools import template_tools_variable, xml_tools

    smollm3 = (TEMPLATES / "SmolLM3-3B.jinja").read_text()
    assert template_tools_variable(smollm3) == "xml_tools"
    tagged = smollm3.replace('{%- elif message.role == "assistant" -%}',
                             '{%- elif message.role == "assistant" -%}{% generation %}').replace(
        '{%- elif message.role == "tool" -%}', '{% endgeneration %}{%- elif message.role == "tool" -%}')
    assert tagged != smollm3 and template_tools_variable(tagged) == "xml_tools"
    later = "{%- if tools -%}{%- set xml_tools = tools -%}{%- endif -%}" + smollm3
    assert template_tools_variable(later) == "tools"
    for other in ("Qwen3-0.6B", "granite-4.0", "Mistral-Nemo-Instruct-2407"):
        assert template_tools_variable((TEMPLATES / f"{other}.jinja").read_text()) == "tools"
    assert template_tools_variable("{% if xml_tools %}") == "tools"  # unreadable: transformers will say why
    assert xml_tools([WEATHER]) == [json.dumps(WEATHER["function"])]


@pytest.mark.parametrize("name", ["Mistral-Small-3.2-24B-Instruct-2506", "Mistral-Nemo-Instruct-2407", "granite-4.0",
                                  "Apriel-1.5-15b-Thinker"])
def test_a_required_call_with_a_real_template_is_the_loops_constrained_greedy_decoding(name):
    words = tokenizer_of(name)
    model = llama_ending_at_eos(3, len(words), 4096)  # (Mistral Small's own system prompt is 2,500 tokens)
    engine = ServingEngine(CausalLM(model), words, model_id="tiny", max_batch_size=4)
    try:
        check_required_call(engine, model, MODELS[name][2], "pld")
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3.5-4B", "Ministral-3-14B-Reasoning-2512",
                                  "Apertus-8B-Instruct-2509", "GLM-4.7-Flash", "SmolLM3-3B"])
def test_a_required_call_may_come_after_thinking_with_the_real_template(name):
    """Qwen3 thinks in <think> ... </think> (added tokens of its tokenizer; Qwen3.5's template and GLM-4.7's open the
    block in the prompt), Ministral 3 Reasoning in [THINK] ... [/THINK] and Apertus in <|inner_prefix|> ...
    <|inner_suffix|>, control tokens of their tokenizers (special, so a decode keeps them only because the engine
    names them): pushed to open (where the prompt did not) and close the block, the answer is an empty reasoning and
    then the call the grammar holds, in the model's format."""
    words = tokenizer_of(name)
    engine = ServingEngine(CausalLM(llama_ending_at_eos(3, len(words), 2048)), words, model_id="tiny",
                           max_batch_size=4)
    try:
        tags = MODELS[name][3]
        assert set(engine.reasoning_markers) == set(tags.kept)
        bias = {str(words.convert_tokens_to_ids(tag)): 100 for tag in (tags.open, tags.close)}
        reply = TestClient(create_app(ServerSettings(), engine)).post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": [CITY_TOOL],
            "tool_choice": "required", "parallel_tool_calls": False, "logit_bias": bias, "temperature": 0,
            "max_tokens": 120})
        message = reply.json()["choices"][0]["message"]
        assert message["reasoning_content"] == "" and message["content"] is None
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] in ("Paris", "Rome")
    finally:
        engine.close()


def test_apriel_reasons_in_the_open_prompt_until_its_marker_and_calls_after_it_with_the_real_template():
    """Apriel 1.6 Thinker's template ends the prompt with "Here are my reasoning steps:"; the model reasons until
    "[BEGIN FINAL RESPONSE]" and answers after it (llama.cpp's parser tests' cases): read so, and a required call's
    grammar lets the reasoning come first, then holds the call."""
    words = tokenizer_of("Apriel-1.6-15b-Thinker")
    engine = ServingEngine(CausalLM(llama_ending_at_eos(3, len(words), 4096)), words, model_id="tiny",
                           max_batch_size=4)
    try:
        tags = engine.reasoning_tags
        parts = split_reasoning("I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHello, world!\nWhat's up?", True, tags)
        assert (parts.reasoning, parts.content) == ("I'm\nthinking", "Hello, world!\nWhat's up?")
        answer = 'I\'m thinking\n[BEGIN FINAL RESPONSE]\n<tool_calls>[{"name": "get_weather", "arguments": {"city": ' \
                 '"Rome"}}]</tool_calls>'
        use = read_tool_use([CITY_TOOL], "required", False, call_format=APRIEL)
        assert grammar_takes(engine, reasoning_first(use.output_format(), tags, engine.reasoning_tokens, True), answer)
        assert not grammar_takes(engine, reasoning_first(use.output_format(), tags, engine.reasoning_tokens, True),
                                 answer.replace("[BEGIN FINAL RESPONSE]\n", ""))
        content = split_reasoning(answer, True, tags).content
        assert [json.loads(c["function"]["arguments"]) for c in read_calls(content, use).calls] == [{"city": "Rome"}]
        # Through the server the prompt is found to open the block, its text spelled a character a token: an answer
        # that never writes the marker (a random model's, cut by its length) is all reasoning.
        reply = TestClient(create_app(ServerSettings(), engine)).post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0})
        message = reply.json()["choices"][0]["message"]
        assert message["reasoning_content"] and not message["content"]
    finally:
        engine.close()
