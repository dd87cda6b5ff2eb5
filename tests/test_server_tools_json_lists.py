"""The tool-call formats that write one JSON list of calls between two markers (server/call_formats.py's
``_JsonList``): NVIDIA Nemotron Nano 2's ``<TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL>``, ServiceNow
Apriel 1.5's ``<tool_calls>[...]</tool_calls>`` (markers that are text, not tokens) and Swiss AI Apertus's
``<|tools_prefix|>[{"get_weather": {...}}]<|tools_suffix|>`` (each item naming the function as its one key). For
each: its template recognised, answers read back whole, cut and streamed (the list read as JSON first, text after
the closing marker joining the content), the markers kept in the text and named by id in the grammar where they are
tokens, a required call the loop's constrained greedy decoding, an earlier call rendered by the template itself.

The model is a tiny random Llama over a byte-level tokenizer with each format's control tokens added as special
tokens, given a template of this file's own in the conventions of the model's (Nemotron's licence keeps its real
one out of the repository; Apriel's and Apertus's real templates are checked in tests/test_server_real_templates.py,
Apertus's own here without its deliberation, so that a required call is the call alone). Greedy throughout: nothing
can fail by chance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from jointspec.server.engine import CompletionRequest
from jointspec.server.tools import (
    APERTUS,
    APRIEL,
    NEMOTRON,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
    TOOLCALL_CLOSE,
    TOOLCALL_OPEN,
    TOOLS_PREFIX,
    TOOLS_SUFFIX,
    call_markers,
    native_call_format,
    read_calls,
    read_tool_use,
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

# An earlier call's arguments as each template writes them: a string as it is, an object as JSON.
ARGUMENTS = ("{% if c.function.arguments is string %}{{ c.function.arguments }}"
             "{% else %}{{ c.function.arguments | tojson }}{% endif %}")


@dataclass(frozen=True)
class Format:
    """One of the formats, as this file's tests see it."""

    name: str
    opening: str
    closing: str
    control: tuple[str, ...]  # the tokenizer's special tokens (the markers among them where they are tokens)
    template: str
    earlier: str  # what the template writes of EARLIER_CALL's call
    named: bool = False  # each item names the function as its one key (Apertus's)

    def tokenizer(self):
        tokenizer = byte_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": list(self.control)})
        tokenizer.chat_template = self.template
        return tokenizer

    def written(self, *calls: tuple[str, object], text: str = "", after: str = "") -> str:
        items = [{n: a} if self.named else {"name": n, "arguments": a} for n, a in calls]
        return text + self.opening + json.dumps(items) + self.closing + after

    def use(self, *tools, choice=None, parallel=None, special=()):
        return read_tool_use(list(tools), choice, parallel, call_format=self.name, special=special)


def _template(system: str, user: str, assistant: str, tool: str, end: str, item: str, opening: str,
              closing: str) -> str:
    """A template in the conventions these models share: the tools in a system turn, each message in its role's
    tags, an assistant's calls after its text as the list between the markers."""
    return (
        f"{{% if tools %}}{system}Tools:\n{{{{ tools | tojson }}}}\nCall them as {opening}[...]{closing}{end}"
        f"{{% endif %}}{{% for m in messages %}}{{% if m.role == 'user' %}}{user}{{{{ m.content }}}}{end}"
        f"{{% elif m.role == 'assistant' %}}{assistant}{{{{ m.content or '' }}}}{{% if m.tool_calls %}}{opening}["
        f"{{% for c in m.tool_calls %}}{item}{{% if not loop.last %}}, {{% endif %}}{{% endfor %}}]{closing}"
        f"{{% endif %}}{end}{{% elif m.role == 'tool' %}}{tool}{{{{ m.content }}}}{end}{{% endif %}}{{% endfor %}}"
        f"{{% if add_generation_prompt %}}{assistant}{{% endif %}}")


LISTED = '{"name": "{{ c.function.name }}", "arguments": ' + ARGUMENTS + "}"
FORMATS = {
    NEMOTRON: Format(NEMOTRON, TOOLCALL_OPEN, TOOLCALL_CLOSE,
                     ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", TOOLCALL_OPEN, TOOLCALL_CLOSE),
                     _template("<SPECIAL_10>System\n", "<SPECIAL_11>User\n", "<SPECIAL_11>Assistant\n",
                               "<SPECIAL_11>User\n<TOOL_RESPONSE>", "\n<SPECIAL_12>\n", LISTED, TOOLCALL_OPEN,
                               TOOLCALL_CLOSE),
                     '<SPECIAL_11>Assistant\nChecking.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": '
                     '"Paris"}}]</TOOLCALL>'),
    APRIEL: Format(APRIEL, TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                   _template("<|system|>\n", "<|user|>\n", "<|assistant|>\n", "<|tool_result|>\n", "\n<|end|>\n",
                             LISTED, TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE),
                   '<|assistant|>\nChecking.<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
                   "</tool_calls>"),
    APERTUS: Format(APERTUS, TOOLS_PREFIX, TOOLS_SUFFIX,
                    ("<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>", TOOLS_PREFIX,
                     TOOLS_SUFFIX),
                    _template("", "<|user_start|>", "<|assistant_start|>", "[", "<|user_end|>",
                              '{"{{ c.function.name }}": ' + ARGUMENTS + "}", TOOLS_PREFIX, TOOLS_SUFFIX),
                    '<|assistant_start|>Checking.<|tools_prefix|>[{"get_weather": {"city": "Paris"}}]'
                    "<|tools_suffix|>", named=True),
}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served(request):
    """(the format, its model, an engine over it)"""
    form = FORMATS[request.param]
    words = form.tokenizer()
    model = llama_ending_at_eos(17, len(words), 2048)
    for engine in engine_of(model, words):
        yield form, model, engine


def test_each_template_is_recognised_and_its_markers_found(served):
    form, _, engine = served
    assert native_call_format(form.tokenizer()) == form.name == engine.call_format
    ids = {spelling: engine.tokenizer.convert_tokens_to_ids(spelling) for spelling in (form.opening, form.closing)
           if spelling in form.control}
    assert dict(call_markers(engine.tokenizer, form.name)) == ids == dict(engine.call_markers)
    assert bool(ids) == (form.name != APRIEL)  # (Apriel's markers are text)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_an_answer_is_read_for_the_list_between_the_markers_whole_cut_and_streamed(name):
    form = FORMATS[name]
    use = form.use(CITY_TOOL, ADD_TOOL)
    written = form.written
    read = read_calls(written(("get_weather", {"city": "Rome"}), ("add", {"a": 2}), text="Checking.\n"), use)
    assert read.content == "Checking." and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                            for c in read.calls] == [("get_weather", {"city": "Rome"}),
                                                                     ("add", {"a": 2})]
    assert read_calls(written(("add", {"a": 2})), use).content is None
    # Text after the closing marker joins the content, on a line of its own.
    assert read_calls(written(("add", {"a": 2}), text="First. ", after=" Then more."), use).content == (
        "First.\nThen more.")
    assert len(read_calls(written(("add", {"a": 1}), ("add", {"a": 3})), form.use(ADD_TOOL, parallel=False)).calls) == 1
    other_shape = (form.opening + ('[{"name": "add", "arguments": {"a": 1}}]' if form.named else '[{"add": {"a": 1}}]')
                   + form.closing)
    for text in (written(("nope", {})), written(("add", 1)), written(("add", {"a": 1}))[:-len(form.closing)] + " x",
                 form.opening + json.dumps([{"name": "add", "arguments": {"a": 1}}])[:-1] + "] x" + form.closing,
                 other_shape, "Hi " + form.opening, "no calls"):
        assert read_calls(text, use).calls == () and read_calls(text, use).content == text, text
    if form.named:  # (an item of two keys names no one function)
        two = form.opening + '[{"add": {"a": 1}, "get_weather": {"city": "Rome"}}]' + form.closing
        assert read_calls(two, use).calls == ()
    # An answer that ends its list without the closing marker still reads; one cut mid-call keeps the calls before,
    # and one cut inside the closing marker (spelled as text) the whole list.
    assert len(read_calls(written(("add", {"a": 1}))[:-len(form.closing)], use).calls) == 1
    whole = written(("add", {"a": 1}), ("get_weather", {"city": "Paris"}))
    assert [c["function"]["name"] for c in read_calls(whole[:whole.rindex("Paris")], use, cut=True).calls] == ["add"]
    assert read_calls(whole[:whole.rindex("Paris")], use).calls == ()  # (not cut: no call was finished)
    assert len(read_calls(whole[:-4], use, cut=True).calls) == 2 and read_calls(whole[:-4], use).calls == ()
    # The list is read as JSON first: a marker's spelling inside an argument is text.
    spelled = written(("note", {"text": "a" + form.closing + "b"}), after=" ok")
    assert [json.loads(c["function"]["arguments"]) for c in read_calls(spelled, form.use(NOTE)).calls] == [
        {"text": "a" + form.closing + "b"}] and read_calls(spelled, form.use(NOTE)).content == "ok"
    check_streamed_calls(use, written(("add", {"a": 1}), text="Let me add. "), "Let me add.", 1)


def test_the_grammar_holds_the_list_between_the_markers(served):
    form, _, engine = served
    ids = engine.call_markers
    required = form.use(CITY_TOOL, ADD_TOOL, choice="required", special=ids)
    assert grammar_takes(engine, required, form.written(("get_weather", {"city": "Rome"}), ("add", {"a": 3})))
    for text in (form.written(("get_weather", {"city": "Rome"}))[:-len(form.closing)],
                 form.written(("get_weather", {"city": "Oslo"})), form.written(("get_weather", {"a": 1})), "Sure."):
        assert not grammar_takes(engine, required, text), text
    strict = form.use({**CITY_TOOL, "function": {**CITY_TOOL["function"], "strict": True}}, special=ids)
    assert grammar_takes(engine, strict, "Sure.") and grammar_takes(engine, strict, form.written(
        ("get_weather", {"city": "Paris"}), text="Checking. "))
    assert not grammar_takes(engine, strict, form.written(("get_weather", {"city": "Oslo"})))


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_a_required_call_is_the_loops_constrained_greedy_decoding_whole_and_streamed(served, method):
    form, model, engine = served
    check_required_call(engine, model, form.name, method)


def test_the_template_renders_an_earlier_call_in_its_format(served):
    form, _, engine = served
    assert engine.shows_calls
    prompt = engine.tokenizer.decode(engine.encode(CompletionRequest(
        messages=tuple(EARLIER_CALL), tools=form.use(CITY_TOOL).shown())))
    assert form.earlier in prompt and "sunny" in prompt
