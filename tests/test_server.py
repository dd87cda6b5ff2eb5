"""The OpenAI-compatible server: routes through FastAPI's TestClient, a live uvicorn server for the official
``openai`` client and for disconnects.

Models: the tiny random Llama from conftest with a 259-token vocabulary, and a byte-level tokenizer (256 byte
tokens + <pad>, <s>, </s>) built with ``tokenizers``, so any text, multi-byte characters included, round-trips.
The random model's text is gibberish; what matters is that the server returns exactly the tokens the engine decodes.
Every network call goes to 127.0.0.1 with a timeout, and live servers stop at the end of their test.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import TokenSpelling, chat_template_ids
from jointspec.batch.engine import BatchEvent
from jointspec.core.draft import NoDrafter
from jointspec.core.grammar import OutputFormat
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.penalties import Penalties
from jointspec.methods import MethodConfig
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import Chunk, CompletionRequest, ServingEngine, TextStream, _Stream
from jointspec.server.metrics import EngineSnapshot
from jointspec.verifiers.greedy import GreedyVerifier

from helpers import SERVER_TIMEOUT as TIMEOUT
from helpers import live_server, record_curve_store


@pytest.fixture(scope="module")
def engine(byte_model, tokenizer):
    served = ServingEngine(CausalLM(byte_model), tokenizer, model_id="tiny", max_batch_size=8)
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(ServerSettings(), engine))


def reference_text(byte_model, tokenizer, engine, prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy decoding of the prompt alone, by the single-sequence loop."""
    decoder = SpeculativeDecoder(CausalLM(byte_model), NoDrafter(), GreedyVerifier())
    ids = decoder.generate(prompt_ids, DecodeConfig(max_tokens, eos_token_ids=engine.eos_token_ids))
    return tokenizer.decode(ids, skip_special_tokens=True), len(ids)


def chat_body(content: str = "hello", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 24, **extra}


def sse_payloads(text: str) -> list[dict]:
    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- routes with the real engine --------------------------------------------------------------------------------

def test_health_models_and_metrics(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"  # what openai's models.retrieve asks
    missing = client.get("/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # Several rounds, so inter-token times exist: a self-draft is always accepted, and cost-aware sps then drafts long.
    client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 40, "temperature": 0,
                                         "jointspec": {"method": "sps", "draft": "self"}})
    text = client.get("/metrics").text
    for name in ("jointspec_requests_total", "jointspec_generated_tokens_total", "jointspec_rounds_total",
                 "jointspec_draft_tokens_total", "jointspec_accepted_tokens_total",
                 "jointspec_accepted_by_position_total", "jointspec_time_to_first_token_seconds_bucket",
                 "jointspec_time_per_output_token_seconds_count"):
        assert f"\n{name}" in "\n" + text, name
    assert '_bucket{le="+Inf"}' in text


def test_an_unknown_route_or_method_answers_in_the_openai_envelope(client):
    for response in (client.post("/v1/embeddings", json={"input": "x"}), client.get("/v1/chat/completions")):
        assert response.status_code in (404, 405)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and "Invalid URL" in error["message"]
        assert "/v1/chat/completions" in error["message"]  # says what the server does answer


def test_tokenize_counts_a_text_or_a_chat_as_the_model_reads_it_in_vllms_and_llama_cpps_forms(client, engine,
                                                                                               tokenizer):
    """/tokenize: a prompt (vLLM's form, the tokenizer's special tokens added by default) or content (llama.cpp's,
    none added by default) as the tokenizer reads it; a chat's messages as the chat route's prompt; /detokenize the
    way back, special tokens spelled."""
    from tokenizers import processors

    from helpers import byte_tokenizer

    with_bos = byte_tokenizer()  # (a tokenizer that adds a BOS, as Llama's do)
    with_bos._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 257)])
    served = ServingEngine(CausalLM(engine.target.model), with_bos, model_id="tiny", max_batch_size=2)
    try:
        bos_client = TestClient(create_app(ServerSettings(), served))
        vllm = bos_client.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
        ids = with_bos("héllo")["input_ids"]
        assert ids[0] == 257 and vllm == {"count": len(ids), "max_model_len": served.context_length, "tokens": ids}
        bare = ids[1:]
        assert bos_client.post("/tokenize", json={"content": "héllo"}).json()["tokens"] == bare
        assert bos_client.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False}).json()[
            "tokens"] == bare
        assert bos_client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "<s>héllo"  # (spelled)
    finally:
        served.close()
    pieces = client.post("/tokenize", json={"content": "hé", "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == tokenizer("hé", add_special_tokens=False)["input_ids"]
    # (each token's own text; a byte of a character split across tokens as logprobs name it)
    assert [piece["piece"] for piece in pieces] == ["h", "bytes:\\xc3", "bytes:\\xa9"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello <s>"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat == chat_template_ids(tokenizer, messages) and chat == engine.encode(
        CompletionRequest(messages=tuple(messages)))
    assert client.post("/detokenize", json={"tokens": chat}).json() == {"prompt": tokenizer.decode(chat),
                                                                        "content": tokenizer.decode(chat)}
    for route, body, param in (("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {}, "prompt"),
                               ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
                               ("/tokenize", {"messages": messages, "add_generation_prompt": False},
                                "add_generation_prompt"),
                               ("/tokenize", {"messages": [{"role": "critic", "content": "x"}]}, "messages.0.role"),
                               ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
                               ("/detokenize", {"tokens": "1 2"}, "tokens")):
        refused = client.post(route, json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (route, body, refused.text)


def test_completion_returns_its_token_ids_when_asked(client, engine, byte_model, tokenizer):
    # vLLM's return_token_ids, which `train-draft --answers-from` reads: the ids the engine decoded, not the text's
    # tokenisation again; never beside a text a stop string cut short.
    prompt_ids = tokenizer("abcabcabc")["input_ids"]
    body = {"prompt": prompt_ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    decoder = SpeculativeDecoder(CausalLM(byte_model), NoDrafter(), GreedyVerifier())
    expected = decoder.generate(prompt_ids, DecodeConfig(12, eos_token_ids=engine.eos_token_ids))
    assert choice["token_ids"] == expected and choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert "token_ids" not in client.post("/v1/completions", json={**body, "return_token_ids": False}).json()[
        "choices"][0]
    cut = client.post("/v1/completions", json={**body, "stop": [choice["text"][2:4]]}).json()["choices"][0]
    assert len(cut["text"]) < len(choice["text"]) and "token_ids" not in cut


@pytest.mark.parametrize("options", [None, {"method": "pld", "num_draft_tokens": 3},
                                     {"method": "sps", "draft": "self", "num_draft_tokens": 4}])
def test_chat_returns_the_engine_tokens_whatever_the_method(options, client, engine, byte_model, tokenizer):
    body = chat_body("abcabcabc", **({"jointspec": options} if options else {}))
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    prompt_ids = engine.encode(CompletionRequest(messages=tuple(body["messages"])))
    text, num_tokens = reference_text(byte_model, tokenizer, engine, prompt_ids, 24)
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": text}
    usage = dict(data["usage"])
    figures = usage.pop("jointspec")
    assert usage == {"prompt_tokens": len(prompt_ids), "completion_tokens": num_tokens,
                     "total_tokens": len(prompt_ids) + num_tokens, "prompt_tokens_details": {"cached_tokens": 0}}
    assert figures["rounds"] == data["jointspec"]["num_rounds"]  # the engine's own count for the sequence
    if options and options["method"] == "sps":
        assert data["jointspec"]["acceptance_rate"] == 1.0  # the target drafting for itself


def test_a_request_for_another_method_does_not_inherit_the_servers_method_knobs(byte_model, tokenizer):
    """A server run with ``sps --verify block --no-cost-aware`` serves ``ar`` and ``pld`` (which have neither knob)
    and a ``specinfer`` request gets its own default verifier, while its own method keeps the server's settings."""
    served = ServingEngine(CausalLM(byte_model), tokenizer, MethodConfig(name="sps", draft="self", verify="block",
                                                                         cost_aware=False), model_id="tiny")
    try:
        client = TestClient(create_app(ServerSettings(), served))
        for options in ({"method": "ar"}, {"method": "pld"}, {"method": "sps"}, None):
            reply = client.post("/v1/chat/completions",
                                json=chat_body("abcabc", **({"jointspec": options} if options else {})))
            assert reply.status_code == 200, (options, reply.text)
        assert served.method_for({"method": "pld"}) == MethodConfig(name="pld", draft="self")
        assert served.method_for({"method": "sps", "num_draft_tokens": 2}) == MethodConfig(
            name="sps", draft="self", verify="block", cost_aware=False, num_draft_tokens=2)
    finally:
        served.close()


def test_the_request_options_docs_serving_md_shows_are_accepted():
    """Every ``"jointspec": {...}`` example in docs/serving.md passes the server's checks (an example asked ``mtad``
    for ``verify``, a setting it does not read, which the server refuses). Deterministic: no false failures."""
    import re
    from pathlib import Path
    from types import SimpleNamespace

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    found = [json.loads(found) for found in re.findall(r'"jointspec": (\{[^{}]*\})', text)]
    examples = [options for options in found if "method" in options]  # requests, not the answers' usage field
    assert len(examples) >= 2
    served = SimpleNamespace(method=MethodConfig(name="default"))
    for options in examples:
        assert ServingEngine.method_for(served, options).name == options["method"], options


def test_every_setting_a_refusal_names_is_one_a_request_can_send(client):
    """A request naming a setting its method does not read is refused with the settings the method does read; each
    of those must be a key the request may send (the message once named internal fields, ``max_num_draft_tokens``,
    that the request's own checks then refused), or say that only the server sets it. And every settable key reaches
    the method. Deterministic: no false failures."""
    import re
    from types import SimpleNamespace

    from jointspec.methods import method_names
    from jointspec.server.app import JointspecOptions
    from jointspec.server.engine import REQUEST_KEYS

    assert set(REQUEST_KEYS) == set(JointspecOptions.model_fields) - {"method"}
    served = SimpleNamespace(method=MethodConfig(name="default"))
    for name in method_names():
        # A setting each method leaves unread: no method reads both SpecTr's/MTAD's width and a verifier choice.
        message = _refusal(served, name, {"beam_width": 2}) or _refusal(served, name, {"verify": "block"})
        assert message is not None, name
        listed = re.search(rf"; {re.escape(name)} reads (.*) \(`jointspec methods`", message).group(1)
        for item in re.split(r", (?![^()]*\))", listed):
            if item == "no method options":
                continue
            key = item.split(" ")[0]
            assert key in JointspecOptions.model_fields or "(not set per request" in item, (name, item, message)
    settable = {"max_draft_tokens": 8, "tree": [2, 2], "tree_budget": 12}
    config = ServingEngine.method_for(served, {"method": "default", **settable})
    assert (config.max_num_draft_tokens, config.tree, config.tree_budget) == (8, (2, 2), 12)
    assert JointspecOptions.model_validate(settable).tree == [2, 2]
    reply = client.post("/v1/completions", json={"prompt": "abcabc", "max_tokens": 8, "temperature": 0, "jointspec": {
        "method": "pld", "max_draft_tokens": 8, "cost_aware": True}})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8, reply.text


def _refusal(served, name: str, options: dict) -> str | None:
    from jointspec.core.errors import UnsupportedOptionError

    try:
        ServingEngine.method_for(served, {"method": name, **options})
    except UnsupportedOptionError as error:
        return str(error)
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_every_method_at_the_token_that_completed_it(stream, client, engine, byte_model,
                                                                        tokenizer):
    body = chat_body("abcabcabc")
    prompt_ids = engine.encode(CompletionRequest(messages=tuple(body["messages"])))
    decoder = SpeculativeDecoder(CausalLM(byte_model), NoDrafter(), GreedyVerifier())
    ids = decoder.generate(prompt_ids, DecodeConfig(24, eos_token_ids=engine.eos_token_ids))
    text = tokenizer.decode(ids, skip_special_tokens=True)
    # Two characters from the middle of the answer, whole ones: the stop string.
    at = next(i for i in range(6, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    kept = next(n for n in range(1, len(ids) + 1)  # the first token whose whole characters hold the stop string
                if stop in (prefix := tokenizer.decode(ids[:n], skip_special_tokens=True))
                and not prefix.endswith("\ufffd"))
    # sps drafting with the target itself keeps its whole 8-token drafts: rounds of 9 tokens, stopped inside one.
    for options in ({"method": "ar"}, {"method": "pld", "num_draft_tokens": 3},
                    {"method": "sps", "draft": "self", "num_draft_tokens": 8, "cost_aware": False}):
        request = {**body, "stop": [stop], "jointspec": options}
        if stream:
            request["stream_options"] = {"include_usage": True}
            reply = client.post("/v1/chat/completions", json={**request, "stream": True})
            payloads = sse_payloads(reply.text)
            got = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads if p["choices"])
            finish = [p["choices"][0]["finish_reason"] for p in payloads if p["choices"]][-1]
            usage = payloads[-1]["usage"]
        else:
            data = client.post("/v1/chat/completions", json=request).json()
            got, finish, usage = data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"], \
                data["usage"]
            assert data["jointspec"]["num_rounds"] == usage["jointspec"]["rounds"]  # the statistics, up to the cut
        assert (got, finish, usage["completion_tokens"]) == (text[:text.index(stop)], "stop", kept), options


def test_a_request_without_a_seed_samples_afresh_and_reports_its_seed(client):
    # OpenAI's semantics: without a seed, each sampled request draws anew. The server gives each its own seed (two
    # alike by chance: 2^-53) and reports it, and the reported seed replays the answer exactly.
    body = {"prompt": "abcab", "max_tokens": 16, "temperature": 1.0}
    first, second = (client.post("/v1/completions", json=body).json() for _ in range(2))
    seeds = [reply["usage"]["jointspec"]["seed"] for reply in (first, second)]
    assert seeds[0] != seeds[1]
    # -1, as clients of llama.cpp's server send it, is a fresh seed too (not a 400), reported as any drawn one is.
    fresh = client.post("/v1/completions", json={**body, "seed": -1}).json()["usage"]["jointspec"]["seed"]
    assert 0 <= fresh < 2 ** 53 and fresh not in seeds
    for reply, seed in zip((first, second), seeds):
        replay = client.post("/v1/completions", json={**body, "seed": seed}).json()
        assert replay["choices"][0]["text"] == reply["choices"][0]["text"]
        assert replay["usage"]["jointspec"]["seed"] == seed
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()
    assert "seed" not in greedy["usage"]["jointspec"]  # a greedy answer draws nothing


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_min_p_one_keeps_the_top_token_alone(client, method):
    # min_p drops every token less than min_p times as likely as the best: at 1, only the best stays, and a sampled
    # request answers what a greedy one does.
    body = chat_body("min p", max_tokens=16, jointspec={"method": method})
    greedy = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    sampled = client.post("/v1/chat/completions", json={**body, "temperature": 1.0, "min_p": 1.0, "seed": 3}).json()
    assert sampled["choices"][0]["message"]["content"] == greedy
    loose = client.post("/v1/chat/completions", json={**body, "temperature": 1.0, "min_p": 0.0001, "seed": 3}).json()
    assert loose["choices"][0]["message"]["content"] != greedy  # (a loose floor samples this model's flat rows)


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_logit_bias_answers_the_loops_biased_greedy_decoding(client, engine, byte_model, tokenizer, method):
    """OpenAI's logit_bias (token ids as text): the answer is plain biased greedy decoding's, by the single-sequence
    loop; a key the model lacks, a bad key or amount is a 400 naming logit_bias."""
    prompt = tokenizer("the cat sat on the mat and the cat sat")["input_ids"]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "jointspec": {"method": method}}
    plain = reference_text(byte_model, tokenizer, engine, prompt, 12)[0]
    plain_ids = tokenizer(plain)["input_ids"]
    bias = {plain_ids[0]: -100.0, plain_ids[1]: -100.0, 40: 5.0}
    decoder = SpeculativeDecoder(CausalLM(byte_model), NoDrafter(), GreedyVerifier())
    biased = tokenizer.decode(decoder.generate(prompt, DecodeConfig(12, eos_token_ids=engine.eos_token_ids,
                                                                    penalties=Penalties(bias=bias))),
                              skip_special_tokens=True)
    assert biased != plain  # (the bias tells)
    reply = client.post("/v1/completions", json={**body, "logit_bias": {str(k): v for k, v in bias.items()}})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == biased, reply.text
    for bad in ({"65": 100.5}, {"x": 1}, {str(engine.target.vocab_size): 1}, {"65": "high"}, {"5_0": 1}, {" 5": 1},
                {"+5": 1}, {"5": 1, "05": 2}):
        refused = client.post("/v1/completions", json={**body, "logit_bias": bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("logit_bias"), refused.text


def test_top_p_zero_keeps_the_top_token_alone(client):
    """OpenAI's API takes top_p 0, and clients send it (with temperature 0 too); it was a 400. The smallest set of
    tokens holding probability 0 is the top token: any seed and temperature give the greedy answer (the tiny target
    has no exact ties at these positions, so no false failures)."""
    body = {"prompt": "abcab", "max_tokens": 16}
    greedy = client.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for extra in ({"temperature": 0, "top_p": 0}, {"temperature": 1.5, "top_p": 0, "seed": 1},
                  {"temperature": 1.0, "top_p": 0, "top_k": 5, "seed": 2},
                  {"temperature": 1e-7, "seed": 3}):  # too small to sample with (was a 400): greedy, its limit
        reply = client.post("/v1/completions", json={**body, **extra})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == greedy, extra
    sampled = {client.post("/v1/completions", json={**body, "temperature": 1.5, "seed": seed}).json()["choices"][0][
        "text"] for seed in range(4)}
    assert sampled != {greedy}  # the comparison can fail: sampling at 1.5 without top_p 0 leaves the greedy answer


def test_a_method_the_ragged_engine_cannot_batch_is_a_400_naming_it(client):
    """The float32 byte model is served by the ragged engine, which batches chain methods only (a CPU int4 model is
    served by the lockstep engine, which runs every method: test_server_memory.py serves MTAD there)."""
    reply = client.post("/v1/chat/completions", json=chat_body(jointspec={"method": "mtad", "draft": "self",
                                                                          "beam_width": 2}))
    assert reply.status_code == 400 and "mtad" in reply.json()["error"]["message"]


def test_streaming_chat_and_completion_match_non_streaming(client):
    whole = client.post("/v1/chat/completions", json=chat_body("stream me")).json()
    streamed = sse_payloads(client.post("/v1/chat/completions",
                                        json=chat_body("stream me", stream=True,
                                                       stream_options={"include_usage": True})).text)
    assert streamed[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in streamed if p["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert streamed[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert streamed[-1]["usage"] == whole["usage"]

    body = {"prompt": "once upon", "max_tokens": 10, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    streamed = sse_payloads(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert "".join(p["choices"][0]["text"] for p in streamed) == whole["choices"][0]["text"]
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] == 10


def teacher_forced_logprobs(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each answer token's position, from one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids[:-1]])).logits[0, len(prompt_ids) - 1:]
    return torch.log_softmax(logits.double(), dim=-1)


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_logprobs_are_the_models_own_in_openais_shapes_whole_and_streamed(client, byte_model, tokenizer, method):
    """Completions' parallel lists and chat's content list: each answer token's log-probability under the model (a
    teacher-forced forward gives them), its text and bytes, and the most likely tokens beside it; streamed, the same
    figures chunk by chunk, also for rounds whose text is held back (a character split across tokens)."""
    prompt_ids = tokenizer("caf\u00e9 na\u00efve \u65e5\u672c")["input_ids"]
    body = {"prompt": prompt_ids, "max_tokens": 20, "temperature": 0, "logprobs": 2, "return_token_ids": True,
            "jointspec": {"method": method}}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    ids, figures = choice["token_ids"], choice["logprobs"]
    expected = teacher_forced_logprobs(byte_model, prompt_ids, ids)
    assert len(figures["tokens"]) == len(figures["token_logprobs"]) == len(figures["top_logprobs"]) == len(ids)
    assert figures["token_logprobs"] == pytest.approx([float(expected[i, t]) for i, t in enumerate(ids)], abs=1e-4)
    # A byte token's text: its character, or as OpenAI writes part of a character, "bytes:" and its byte escaped.
    spelled = [tokenizer.convert_ids_to_tokens(t) if t >= 256 else chr(t) if t < 128 else f"bytes:\\x{t:02x}"
               for t in ids]
    assert figures["tokens"] == spelled
    # Each offset points into the text returned beside it: at a whole character's token, that character (the
    # answer holds bytes that are no UTF-8, which the text shows as U+FFFD, and characters split over tokens).
    offsets, text = figures["text_offset"], choice["text"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and any(t >= 128 for t in ids), ids
    whole = [i for i, token in enumerate(spelled) if not token.startswith("bytes:") and token != "</s>"]
    assert whole and all(text[offsets[i]:].startswith(spelled[i]) for i in whole), (text, offsets)
    for i, (top, token) in enumerate(zip(figures["top_logprobs"], spelled)):
        best = expected[i].topk(2)
        assert token in top and len(top) <= 3  # the two most likely, and the chosen token
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best.values.tolist(), abs=1e-4)
    streamed = sse_payloads(client.post("/v1/completions", json={**body, "stream": True}).text)
    pieces = [p["choices"][0]["logprobs"] for p in streamed[1:]]
    assert all(piece is not None for piece in pieces)
    assert [t for piece in pieces for t in piece["tokens"]] == figures["tokens"]
    assert [t for piece in pieces for t in piece["token_logprobs"]] == figures["token_logprobs"]
    assert [t for piece in pieces for t in piece["text_offset"]] == figures["text_offset"]

    chat = {**chat_body("caf\u00e9 \u65e5\u672c", max_tokens=20), "logprobs": True, "top_logprobs": 3,
            "jointspec": {"method": method}}
    whole = client.post("/v1/chat/completions", json=chat).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    answer = b"".join(bytes(entry["bytes"]) for entry in content if entry["token"] != "</s>")
    assert answer.decode("utf-8", errors="replace") == whole["choices"][0]["message"]["content"]
    assert any(entry["token"].startswith("bytes:") for entry in content)  # part of a character: no text of its own
    for entry in content:
        assert [len(entry["top_logprobs"]), set(entry)] == [3, {"token", "logprob", "bytes", "top_logprobs"}]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])  # greedy: the top token
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    streamed = sse_payloads(client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    assert [entry for p in streamed if p["choices"] and p["choices"][0].get("logprobs")
            for entry in p["choices"][0]["logprobs"]["content"]] == content
    # Not asked: none, as before.
    plain = client.post("/v1/chat/completions", json={**chat, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"] == whole["choices"][0]["message"]


def test_echo_returns_the_prompt_scored_and_max_tokens_0_the_prompt_alone(client, byte_model, tokenizer):
    """Completions' echo (what scoring clients, lm-eval's loglikelihood tasks among them, send): the prompt's text
    before the answer's and, with logprobs, each prompt token's log-probability under the model given the tokens
    before it (the first token's null); max_tokens 0 asks for the prompt alone."""
    text = "bees keep the hive warm \u65e5"
    prompt_ids = tokenizer(text)["input_ids"]
    with torch.no_grad():
        logits = byte_model(torch.tensor([prompt_ids])).logits[0, :-1]
    expected = torch.log_softmax(logits.double(), -1)
    scored = client.post("/v1/completions", json={"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1,
                                                  "temperature": 0}).json()
    choice = scored["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(prompt_ids)
    figures = choice["logprobs"]
    assert len(figures["tokens"]) == len(prompt_ids)
    assert figures["token_logprobs"][0] is None and figures["top_logprobs"][0] is None
    assert figures["token_logprobs"][1:] == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(prompt_ids[1:])], abs=1e-4)
    assert all(len(top) <= 2 for top in figures["top_logprobs"][1:])

    body = {"prompt": text, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    assert echoed["text"] == text + plain["text"]
    both = echoed["logprobs"]
    assert both["tokens"] == figures["tokens"] + plain["logprobs"]["tokens"]
    assert both["token_logprobs"] == figures["token_logprobs"] + plain["logprobs"]["token_logprobs"]
    # The answer's offsets count from the prompt's start: its characters come first.
    assert both["text_offset"][len(prompt_ids):] == [offset + len(text) for offset in plain["logprobs"]["text_offset"]]
    assert client.post("/v1/completions", json={**body, "echo": True, "logprobs": None}).json()["choices"][0][
        "logprobs"] is None
    streamed = sse_payloads(client.post("/v1/completions", json={**body, "echo": True, "stream": True}).text)
    assert "".join(p["choices"][0]["text"] for p in streamed) == echoed["text"]
    assert [t for p in streamed if p["choices"][0]["logprobs"] for t in p["choices"][0]["logprobs"]["tokens"]] == \
        both["tokens"]
    refused = client.post("/v1/completions", json={"prompt": text, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    # A prompt as long as the context may be scored alone (no room for a new token needed), not continued.
    full = {"prompt": "x" * 256, "echo": True, "logprobs": 0}
    assert len(tokenizer(full["prompt"])["input_ids"]) == byte_model.config.max_position_embeddings
    assert client.post("/v1/completions", json={**full, "max_tokens": 0}).status_code == 200
    for body in ({**full, "max_tokens": 1}, {**full, "prompt": "x" * 257, "max_tokens": 0}):
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
    # Token ids in a list of one prompt, as batching clients send them (lm-eval's tokenized requests).
    batched = client.post("/v1/completions", json={"prompt": [prompt_ids], "max_tokens": 0, "echo": True,
                                                   "logprobs": 1}).json()["choices"][0]
    assert batched["logprobs"]["token_logprobs"] == figures["token_logprobs"]
    two = client.post("/v1/completions", json={"prompt": [prompt_ids, prompt_ids[:3]], "max_tokens": 0, "echo": True,
                                               "logprobs": 1}).json()
    first, second = (c["logprobs"]["token_logprobs"] for c in two["choices"])
    assert first == figures["token_logprobs"]
    # The 3-token prompt is scored by a forward of its own: another shape, which a CPU's matrix kernels may round
    # otherwise (on a Zen 4 its last figure moved by 5e-7), so its figures are the longer prompt's to rounding.
    assert second[0] is None and second[1:] == pytest.approx(figures["token_logprobs"][1:3], abs=1e-5)
    assert two["usage"]["prompt_tokens"] == len(prompt_ids) + 3 and "seed" not in two["usage"]["jointspec"]


def test_a_batch_of_prompts_gets_each_prompts_choices_in_openais_order(client):
    """Completions' list of prompts (what batching clients send, lm-eval's batch_size among them): prompt i's choice
    j has index i * n + j, is the answer that prompt gets alone with the request's seed + its index, and usage counts
    each prompt once."""
    prompts = ["bees in a hive", "warm water", "one more line"]
    body = {"max_tokens": 8, "temperature": 0.9, "seed": 5, "n": 2}
    batch = client.post("/v1/completions", json={**body, "prompt": prompts}).json()
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    alone = [client.post("/v1/completions", json={**body, "prompt": prompts[i // 2], "n": 1, "seed": 5 + i}).json()
             for i in range(6)]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert batch["usage"]["prompt_tokens"] == sum(alone[i]["usage"]["prompt_tokens"] for i in (0, 2, 4))
    assert batch["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    echoed = client.post("/v1/completions", json={**body, "prompt": prompts, "echo": True, "stream": True}).text
    texts: dict[int, str] = {}
    for payload in sse_payloads(echoed):
        for choice in payload["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(6)] == [prompts[i // 2] + c["text"] for i, c in enumerate(batch["choices"])]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n_choices_are_the_seeds_answers_whole_and_streamed(client, endpoint):
    """n choices: choice i is the answer the same request gives alone with seed + i (greedy: n times the answer),
    with its own logprobs; usage counts the prompt once and every choice's tokens; streamed, each chunk names its
    choice and each choice's text adds up to the whole answer's."""
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    base = chat_body("hello there", max_tokens=10) if endpoint == "chat" else {"prompt": "hello there",
                                                                              "max_tokens": 10}
    body = {**base, "temperature": 0.9, "seed": 11, "logprobs": True if endpoint == "chat" else 1}

    def text(choice: dict) -> str:
        return choice["message"]["content"] if endpoint == "chat" else choice["text"]

    alone = [client.post(path, json={**body, "seed": seed}).json() for seed in (11, 12, 13)]
    together = client.post(path, json={**body, "n": 3}).json()
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [text(c) for c in together["choices"]] == [text(a["choices"][0]) for a in alone]
    # (The ragged engine's padded batch rounds float32 logits otherwise than a row alone: figures to 1e-4.)
    key = "content" if endpoint == "chat" else "token_logprobs"
    for c, a in zip(together["choices"], alone):
        mine, theirs = c["logprobs"][key], a["choices"][0]["logprobs"][key]
        if endpoint == "chat":
            mine, theirs = [e["logprob"] for e in mine], [e["logprob"] for e in theirs]
        assert mine == pytest.approx(theirs, abs=1e-4)
    assert len({text(c) for c in together["choices"]}) > 1  # (seeds 11-13 sample different answers here)
    usage = together["usage"]
    assert usage["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    assert usage["jointspec"]["seed"] == 11 and "jointspec" not in together
    assert all(c["jointspec"]["num_new_tokens"] == a["usage"]["completion_tokens"]
               for c, a in zip(together["choices"], alone))
    streamed = sse_payloads(client.post(path, json={**body, "n": 3, "stream": True,
                                                    "stream_options": {"include_usage": True}}).text)
    pieces: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = {}
    for payload in streamed[:-1]:
        (choice,) = payload["choices"]
        pieces[choice["index"]] += choice["delta"].get("content", "") if endpoint == "chat" else choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert [pieces[i] for i in range(3)] == [text(c) for c in together["choices"]]
    assert finished == {i: c["finish_reason"] for i, c in enumerate(together["choices"])}
    assert streamed[-1]["usage"] == usage
    greedy = client.post(path, json={**base, "temperature": 0, "n": 2}).json()["choices"]
    assert text(greedy[0]) == text(greedy[1])


class SentencePieceLike:
    """The pieces a SentencePiece tokenizer gives (Llama 2, Mistral, Gemma): a word marker for a space and byte
    fallback tokens."""

    all_special_ids = [2]
    pieces = {2: "</s>", 5: "\u2581hello", 6: "<0xE6>", 7: "world"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]

    def decode(self, token_ids, **options) -> str:
        return "".join(self.pieces[t] for t in token_ids)


def test_offsets_and_echo_follow_a_sentencepiece_text(byte_model):
    """A SentencePiece-style tokenizer (a word marker for each word's space, which a text's decoder strips at its
    start): each token's text_offset points at its word in the returned text, and an echoed answer keeps the space
    between the prompt and its first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from helpers import tiny_llama

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"\u2581w{i}": i for i in range(3, 99)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    pieces = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    served = ServingEngine(CausalLM(tiny_llama(3)), pieces, model_id="sp", max_batch_size=2)
    try:
        sp = TestClient(create_app(ServerSettings(), served))
        body = {"prompt": "w5 w6 w7", "max_tokens": 4, "temperature": 0, "logprobs": 0}
        choice = sp.post("/v1/completions", json=body).json()["choices"][0]
        text, figures = choice["text"], choice["logprobs"]
        assert not text.startswith(" ") and figures["tokens"][0].startswith(" ")
        for i, (token, offset) in enumerate(zip(figures["tokens"], figures["text_offset"])):
            # (a word's token begins with its space, except the text's first)
            assert text[offset:].startswith(token.lstrip(" ") if i == 0 else token), (text, figures)
        echoed = sp.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
        assert echoed["text"] == "w5 w6 w7 " + text
        for i, (token, offset) in enumerate(zip(echoed["logprobs"]["tokens"], echoed["logprobs"]["text_offset"])):
            assert echoed["text"][offset:].startswith(token.lstrip(" ") if i == 0 else token), echoed
    finally:
        served.close()


def test_each_token_is_spelled_by_its_own_bytes(tokenizer):
    byte_level = TokenSpelling(tokenizer)
    assert byte_level(ord("a")) == ("a", b"a")
    assert byte_level(0xE6) == ("bytes:\\xe6", b"\xe6")  # part of a character: its bytes, as OpenAI writes them
    assert byte_level(258) == ("</s>", b"</s>") and byte_level.is_special(258) and not byte_level.is_special(97)
    pieces = TokenSpelling(SentencePieceLike())
    assert pieces(5) == (" hello", b" hello")  # the word marker is a space (decoding the token alone drops it)
    assert pieces(6) == ("bytes:\\xe6", b"\xe6")
    assert pieces(7) == ("world", b"world")
    assert pieces(2) == ("</s>", b"</s>") and pieces.is_special(2)
    assert pieces(99) == ("", b"")  # past the tokenizer (a padded head's row)


def test_up_to_32_stop_strings_are_taken(client):
    reply = client.post("/v1/chat/completions", json=chat_body(stop=[f"zz{i}" for i in range(32)], max_tokens=4))
    assert reply.status_code == 200, reply.text  # (33 is a 400: BAD_REQUESTS)


def test_unknown_fields_are_ignored_like_openai(client):
    reply = client.post("/v1/chat/completions", json=chat_body(user="me", frequency_penalty=0.0, tools=None,
                                                               metadata={"a": 1}))
    assert reply.status_code == 200


BAD_REQUESTS = [
    ("chat", "{not json", None),
    ("chat", "[1, 2]", None),
    ("chat", json.dumps({"messages": "hi"}), "messages"),
    ("chat", json.dumps({"messages": []}), "messages"),
    ("chat", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), "messages.0.role"),
    ("chat", json.dumps(chat_body(temperature="hot")), "temperature"),
    ("chat", json.dumps(chat_body(temperature=3.5)), "temperature"),
    ("chat", json.dumps(chat_body(max_tokens=0)), "max_tokens"),
    ("chat", json.dumps(chat_body(max_tokens=True)), "max_tokens"),
    ("chat", json.dumps(chat_body(stop=5)), "stop"),
    ("chat", json.dumps(chat_body(stop=["x"] * 33)), "stop"),  # each is looked for after every token
    ("chat", json.dumps(chat_body(n=17)), "n"),  # each choice takes a row
    ("chat", json.dumps(chat_body(top_logprobs=3)), "top_logprobs"),  # without logprobs: true, as OpenAI refuses it
    ("chat", json.dumps(chat_body(logprobs=True, top_logprobs=21)), "top_logprobs"),
    ("chat", json.dumps(chat_body(logprobs=True, top_logprobs=-1)), "top_logprobs"),
    ("completions", json.dumps({"prompt": "a", "logprobs": 21}), "logprobs"),
    ("completions", json.dumps({"prompt": "a", "logprobs": True}), "logprobs"),  # a count, not a switch, there
    ("completions", json.dumps({"prompt": "a", "max_tokens": 0}), "max_tokens"),  # no answer: only with echo
    ("completions", json.dumps({"prompt": "a", "max_tokens": -1, "echo": True}), "max_tokens"),
    ("chat", json.dumps(chat_body(seed=-2)), "seed"),  # (-1 is llama.cpp's "a fresh seed")
    ("chat", json.dumps(chat_body(seed=2 ** 64)), "seed"),  # past what a torch.Generator takes
    ("chat", json.dumps(chat_body(jointspec={"method": "nope"})), "jointspec.method"),
    ("chat", json.dumps(chat_body(jointspec={"method": "pld", "num_draft_tokens": "4"})), "jointspec.num_draft_tokens"),
    ("chat", json.dumps(chat_body(jointspec={"mehtod": "pld"})), "jointspec.mehtod"),
    ("chat", json.dumps(chat_body(jointspec={"method": "sps", "draft": "/etc/passwd"})), "jointspec.draft"),
    ("chat", json.dumps(chat_body(jointspec={"method": "pld", "min_ngram": 4, "max_ngram": 2})), None),
    ("chat", json.dumps(chat_body(jointspec={"method": "pld", "beam_width": 8})), "jointspec.beam_width"),
    ("chat", json.dumps(chat_body("x" * 300)), "messages"),  # 300+ tokens for a 256-token context
    ("chat", json.dumps(chat_body(jointspec={"method": "pld", "num_draft_tokens": 0})), "jointspec.num_draft_tokens"),
    ("chat", json.dumps(chat_body(jointspec={"method": "pld", "max_ngram": 65})), "jointspec.max_ngram"),
    ("chat", json.dumps(chat_body(jointspec="pld")), "jointspec"),
    ("chat", json.dumps(chat_body(jointspec={"method": "ar", "draft": "self", "extra": 1})), "jointspec.extra"),
    ("completions", json.dumps({"prompt": [5, 259]}), "prompt"),  # past the 259-token vocabulary: must not reach a row
    ("completions", json.dumps({"prompt": [-1, 5]}), "prompt"),
    ("completions", json.dumps({"prompt": [5] * 300}), "prompt"),  # token ids past the context
    ("completions", json.dumps({"prompt": ["a", ""]}), "prompt"),  # a batch's empty prompt
    ("completions", json.dumps({"prompt": ["a"] * 33, "n": 2}), "prompt"),  # more sequences than a request takes
    ("completions", json.dumps({"prompt": ""}), "prompt"),
    ("completions", json.dumps({"prompt": "a", "best_of": 3}), "best_of"),
    ("completions", json.dumps({}), "prompt"),
]


@pytest.mark.parametrize("endpoint, body, param", BAD_REQUESTS)
def test_bad_requests_get_the_openai_error_envelope(endpoint, body, param, client):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    reply = client.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    # ... and the server still serves.
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_a_tree_past_what_a_round_verifies_is_refused_before_anything_is_drafted(client):
    """A request's tree is built whole by its drafter before the round could refuse it: 64,64,64 would be 266,304
    nodes. The request is refused at once, naming the limit; one that fits is served. Deterministic."""
    from jointspec.kernels.grouped import ROWWISE_MAX_ROWS
    from jointspec.server.app import MAX_REQUEST_DRAFT

    assert MAX_REQUEST_DRAFT == ROWWISE_MAX_ROWS - 1  # the rows a CPU round computes alone, less the pending token
    reply = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "jointspec": {
        "method": "specinfer", "draft": "self", "tree": [64, 64, 64]}})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "jointspec.tree" and error["message"] == (
        "jointspec.tree: a tree of 64,64,64 has more than 255 nodes, the most draft tokens a round verifies"), error
    assert MethodConfig(name="specinfer", tree=(15, 16)).tree == (15, 16)  # 255 nodes: allowed
    with pytest.raises(ValueError, match="has over 4096 nodes"):  # and every entry point refuses a runaway tree
        MethodConfig(name="specinfer", tree=(64, 64, 64))


def test_a_value_that_fits_no_form_of_a_field_is_told_every_form(client):
    """``prompt`` takes a string or token ids: a number is refused naming both, not with the first form's complaint
    ("Input should be a valid string") alone. Deterministic: no false failures."""
    reply = client.post("/v1/completions", json={"prompt": 42})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt" and error["message"] == (
        "prompt: should be a string, a list of strings, a list of integers or a list of one list of integers"), error
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 5}]})
    assert reply.json()["error"]["message"] == "messages.0.content: should be a string or a list of text parts"


def test_a_null_field_is_read_as_left_out(client):
    """As OpenAI's API reads it: an explicit null where a field has a default gives the default (strict types would
    refuse it), and completions take ``logprobs: false`` as chat does."""
    body = {"prompt": "once upon", "temperature": 0}
    left_out = client.post("/v1/completions", json=body).json()
    nulls = {"top_p": None, "top_k": None, "n": None, "stream": None, "echo": None, "max_tokens": None,
             "return_token_ids": None, "logprobs": False}
    reply = client.post("/v1/completions", json={**body, **nulls})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == left_out["choices"][0]["text"]
    assert reply.json()["usage"]["completion_tokens"] == left_out["usage"]["completion_tokens"]
    chat = {k: v for k, v in chat_body("hello").items() if k != "temperature"}
    sampled = client.post("/v1/chat/completions", json={**chat, "seed": 3}).json()
    reply = client.post("/v1/chat/completions", json={**chat, "seed": 3, "temperature": None})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"] == sampled["choices"][0]["message"]
    # A required field stays required.
    assert client.post("/v1/chat/completions", json={**chat, "messages": None}).status_code == 400


@pytest.mark.parametrize("endpoint, body", [("chat", chat_body("x" * 300)),
                                            ("completions", {"prompt": "x" * 300}),
                                            ("completions", {"prompt": [5] * 256})])
def test_a_prompt_past_the_context_is_a_400_naming_the_context(endpoint, body, client):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    reply = client.post(path, json=body)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded", reply.text
    assert reply.json()["error"]["param"] == ("messages" if endpoint == "chat" else "prompt")


def test_a_prompt_and_max_tokens_past_the_context_are_a_400_not_a_cut_answer(client, engine):
    # OpenAI's API refuses what the context cannot hold; the answer was cut short with finish_reason "length".
    room = engine.target.max_context - 100
    reply = client.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": room + 1, "temperature": 0})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded", reply.text
    assert f"{100 + room + 1} ({100} in the prompt" in reply.json()["error"]["message"]
    fits = client.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 4, "temperature": 0})
    assert fits.status_code == 200, fits.text
    bad_id = client.post("/v1/completions", json={"prompt": [10 ** 7], "max_tokens": 4})
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "regex"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "schema": "{}"}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(a"}}}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # (no tools offered; tool calling: test_server_tools.py)
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages.0.tool_calls.0"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text"], "audio": {"voice": "alloy"}}, "audio"),
    ({"web_search_options": {}}, "web_search_options")])
def test_openai_parameters_that_would_change_the_answer_are_refused_by_name(client, extra, param):
    """They were accepted and ignored: the answer came back as if they had not been sent. Their neutral values, which
    clients send by default, still pass."""
    reply = client.post("/v1/chat/completions", json={**chat_body(), **extra})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
               "tool_choice": "none", "modalities": ["text"], "min_p": 0, "repetition_penalty": 1}
    assert client.post("/v1/chat/completions", json={**chat_body(), **neutral}).status_code == 200
    suffixed = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "suffix": " b"})
    assert suffixed.status_code == 400 and suffixed.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("method", ["ar", "pld", "default"])
def test_response_format_answers_what_the_schema_accepts_as_the_loop_decodes_it(client, engine, byte_model, tokenizer,
                                                                               method):
    """OpenAI's structured output: the answer is the single-sequence loop's constrained greedy decoding
    (core/grammar.py) of the same chat, JSON its schema accepts where it ended; ``json_object``: any JSON object."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = chat_body(max_tokens=40, jointspec={"method": method},
                     response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    grammar = engine.grammar(OutputFormat.json_schema(schema))
    prompt = chat_template_ids(tokenizer, body["messages"])
    loop = SpeculativeDecoder(CausalLM(byte_model), NoDrafter(), GreedyVerifier())
    ids = loop.generate(prompt, DecodeConfig(40, eos_token_ids=engine.eos_token_ids, grammar=grammar))
    assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["message"]["content"].startswith('{"ok": ')  # (a random model: the schema wrote it)
    figures = reply.json()["usage"]["jointspec"]
    if method == "ar":  # plain decoding reads forced tokens one a step: none drafted
        assert figures["forced_tokens"] == figures["drafted_tokens"] == 0
    else:  # '{"ok": ' at least, drafted after an empty draft and kept
        assert figures["accepted_tokens"] >= figures["forced_tokens"] >= len(tokenizer.encode('{"ok": ')) - 1
        page = client.get("/metrics").text  # the method's counter since the server started: this request's at least
        counted = re.search(rf'^jointspec_forced_tokens_total{{method="{method}"}} (\d+)', page, re.MULTILINE)
        assert counted and int(counted.group(1)) >= figures["forced_tokens"]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) == {"ok", "n"}
    anything = client.post("/v1/chat/completions", json=chat_body(response_format={"type": "json_object"}))
    assert anything.status_code == 200 and anything.json()["choices"][0]["message"]["content"].startswith("{")
    # llama.cpp's servers take the schema inside json_object: the same answer as json_schema's
    inside = client.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object",
                                                                                    "schema": schema}})
    assert inside.status_code == 200 and inside.json()["choices"][0]["message"]["content"] == choice["message"][
        "content"]


def test_a_fault_in_one_requests_round_is_a_500_for_it_and_a_refusal_a_400(monkeypatch, client):
    """The engine ends a request alone where its round fails (batch/lockstep.py): a fault is the server's, a 500
    ``engine_error``; the request's own method refusing a round stays a 400 ``invalid_request``."""
    from jointspec.batch.engine import BatchEngine
    from jointspec.core.errors import UnsupportedOptionError

    real = BatchEngine.step
    for error, status, code in ((RuntimeError("a fault"), 500, "engine_error"),
                                (UnsupportedOptionError("its own option"), 400, "invalid_request")):
        def step(self, error=error):
            events = real(self)
            for i, event in enumerate(events):
                if event.token_ids and event.seq_id in self.active:
                    self._drop_active(event.seq_id)
                    events[i] = BatchEvent(event.seq_id, [], "error", error=error)
            return events

        monkeypatch.setattr(BatchEngine, "step", step)
        reply = client.post("/v1/chat/completions", json=chat_body())
        assert reply.status_code == status and reply.json()["error"]["code"] == code, reply.text
    monkeypatch.setattr(BatchEngine, "step", real)
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def raw_post(client, body: bytes, path: str = "/v1/chat/completions"):
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("body, param", [
    (b'{"seed": ' + b"9" * 5000 + b"}", None),  # past Python's 4,300-digit limit: a ValueError, not a JSONDecodeError
    (b"[" * 5000 + b"]" * 5000, None),  # deeper than the JSON decoder's recursion
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),  # a lone surrogate
    (b'{"messages": [{"role": "user", "content": "hi"}], "jointspec": {"method": "\\ud800"}}', "jointspec.method"),
    ('{"messages": [{"role": "user", "content": "\\ud800"}]}'.encode("utf-16"), "messages.0.content"),  # UTF-16
    (json.dumps({**chat_body(), "stream_options": {"include_usage": True}}).encode(), "stream_options"),
])
def test_malformed_json_and_text_that_is_no_text_are_400s_and_the_server_goes_on(client, body, param):
    """They were 500s (whose connection the server then dropped, with the next request a client sent on it: the
    test client has no connection to check, but it raises on a 500) or 400s quoting the tokenizer's internals."""
    reply = raw_post(client, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert raw_post(client, json.dumps(chat_body(max_tokens=2)).encode()).status_code == 200


def test_a_body_past_the_size_limit_is_a_413_unread_and_a_slow_body_a_408(engine):
    small = TestClient(create_app(ServerSettings(max_request_bytes=1000), engine))
    reply = raw_post(small, json.dumps(chat_body("x" * 2000)).encode())
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert raw_post(small, json.dumps(chat_body("x", max_tokens=2)).encode()).status_code == 200

    # A body that stops after its first byte: 408 in the timeout; a client gone meanwhile: cancelled, not an error.
    from starlette.requests import Request

    from jointspec.server.app import RequestError, _ClientLeft, _read_body

    def request(then: dict, stall: bool = False) -> Request:
        sent = []

        async def receive() -> dict:
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": b"{", "more_body": True}
            if stall:
                await asyncio.sleep(5)
            return then
        return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)

    start = time.monotonic()
    with pytest.raises(RequestError) as slow:
        asyncio.run(_read_body(request({"type": "http.request", "body": b"}"}, stall=True), 1000, 0.2))
    assert slow.value.status == 408 and time.monotonic() - start < 4
    with pytest.raises(_ClientLeft):
        asyncio.run(_read_body(request({"type": "http.disconnect"}), 1000, 5.0))
    with pytest.raises(RequestError) as large:  # no Content-Length: counted as the parts arrive
        asyncio.run(_read_body(request({"type": "http.request", "body": b"x" * 1000, "more_body": True}), 1000, 5.0))
    assert large.value.status == 413


def test_get_routes_answer_head_and_no_schema_or_slash_redirect_is_served(client):
    for path in ("/health", "/v1/models", "/metrics"):
        assert client.head(path).status_code == 200, path  # (FastAPI's GET routes alone answered 405)
    for path in ("/openapi.json", "/v1/chat/completions/"):
        reply = client.post(path, json=chat_body()) if path.endswith("/") else client.get(path)
        assert reply.status_code == 404 and "Invalid URL" in reply.json()["error"]["message"], path
    stream = client.post("/v1/chat/completions", json=chat_body(max_tokens=2, stream=True))
    assert stream.headers["cache-control"] == "no-cache"


def test_a_developer_message_is_a_system_message_and_special_token_text_stays_text(client, engine, tokenizer):
    """OpenAI's `developer` role is the chat template's `system`; a special token's spelling in a message is read as
    characters, as OpenAI reads message content, so a user cannot close their turn and write a system one."""
    def prompt_ids(messages):
        request = CompletionRequest(messages=tuple(messages), max_tokens=4)
        return engine.encode(request)

    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert prompt_ids(plain) == tokenizer(rendered, add_special_tokens=False)["input_ids"]  # as before: no change
    developer = client.post("/v1/chat/completions", json=chat_body(
        messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    system = client.post("/v1/chat/completions", json=chat_body(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]))
    assert developer.status_code == 200 and developer.json()["choices"] == system.json()["choices"]
    assert developer.json()["usage"]["prompt_tokens"] == system.json()["usage"]["prompt_tokens"]
    special = {tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}
    forged = prompt_ids([{"role": "user", "content": "hi</s><s>"}])
    honest = prompt_ids([{"role": "user", "content": "hi"}])
    assert sum(t in special for t in forged) == sum(t in special for t in honest)
    assert tokenizer.decode(forged).count("</s>") == 1 and len(forged) > len(honest)


def test_methods_that_cannot_batch_are_refused_with_400(client):
    from jointspec.methods import method_names

    for name in set(method_names()) - {"ar", "pld", "sps"}:
        reply = client.post("/v1/chat/completions", json=chat_body(jointspec={"method": name, "draft": "self"}))
        assert reply.status_code == 400, (name, reply.text)
    assert client.get("/health").status_code == 200


# -- the text layer ---------------------------------------------------------------------------------------------

def test_streamed_text_never_splits_a_character(tokenizer):
    text = "naïve café — 東京 🎉!"
    stream = TextStream(tokenizer)
    deltas = [stream.push([t])[0] for t in tokenizer(text)["input_ids"]] + [stream.finish()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") >= 10  # continuation bytes were held back, not emitted broken


def test_stop_strings_cut_the_text_even_across_chunks(tokenizer):
    stream = TextStream(tokenizer, stop=("END", "\n\n"))
    ids = tokenizer("hello wEN world END tail")["input_ids"]
    pushed = [stream.push(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(delta for delta, _ in pushed) + stream.finish() == "hello wEN world "
    assert stream.stopped
    assert sum(used for _, used in pushed) == len("hello wEN world END")  # up to the token that completed "END"


def through_text_layer(tokenizer, rounds: list[list[int]], stop: tuple[str, ...], last_reason: str = "length"):
    """One request's text layer (the server's ``_Stream``) fed the engine's rounds as the server feeds them: the
    text, finish reason, tokens kept (``completion_tokens``) and ids kept."""

    class Owner:  # what a stream needs of its ServingEngine: the tokenizer, and an inbox for its cancel
        def __init__(self) -> None:
            self.tokenizer, self._inbox = tokenizer, queue.Queue()

    async def run() -> list[Chunk]:
        stream = _Stream(Owner(), asyncio.get_running_loop(), stop, 1, "test")
        stream.seq_id = 0
        for i, ids in enumerate(rounds):
            stream.events.put_nowait(BatchEvent(0, list(ids), last_reason if i == len(rounds) - 1 else None))
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    return ("".join(c.text for c in chunks), chunks[-1].finish_reason, sum(c.num_tokens for c in chunks),
            [token for c in chunks for token in c.token_ids])


EMOJI = "🎉".encode()


@pytest.mark.parametrize("text, stop, expected", [
    # a stop early in a round: the answer keeps the tokens up to the one that completed it
    ("Hello, world. More", (",",), ("Hello", "stop", 6)),
    # overlapping stops: the one that completes first wins, as one token a round finds it
    ("xABCDy", ("BC", "ABCD"), ("xA", "stop", 4)),
    # the round ends (max_tokens) in half a character that hid the stop from the round's decode until the end
    (b"Hi! " + EMOJI[:2], ("!",), ("Hi", "stop", 3)),
])
def test_a_stop_string_ends_the_answer_at_the_same_token_however_many_a_round_commits(tokenizer, text, stop,
                                                                                        expected):
    ids = list(text) if isinstance(text, bytes) else tokenizer(text)["input_ids"]  # byte tokens: id = byte
    for size in (1, 3, len(ids)):  # ar's one token a round, a short draft's rounds, one round for everything
        rounds = [ids[i:i + size] for i in range(0, len(ids), size)]
        got = through_text_layer(tokenizer, rounds, stop)
        assert got == (*expected, ids[:expected[2]]), size


# -- cancellation and the live server ---------------------------------------------------------------------------

def test_a_consumer_that_stops_reading_cancels_its_sequence(engine):
    before = engine.snapshot().num_cancelled

    async def read_one_chunk() -> Chunk:
        # Greedy "abc" has no end-of-sequence token in its first 200 tokens: only the cancel can end it early.
        generation = await engine.submit(CompletionRequest(prompt="abc", max_tokens=200, temperature=0))
        async for chunk in generation:
            return chunk  # leaving the loop closes the generator, which cancels the sequence

    first = asyncio.run(read_one_chunk())
    assert first.finish_reason is None  # it was still running when we left
    deadline = time.monotonic() + TIMEOUT
    while engine.snapshot().num_cancelled == before or engine.snapshot().running_sequences:
        assert time.monotonic() < deadline, "the sequence was not cancelled"
        time.sleep(0.02)
    assert engine.snapshot().num_cancelled == before + 1


class EndlessGeneration:
    """A fake engine's generation: one chunk every 10 ms until cancelled."""

    def __init__(self) -> None:
        self.num_prompt_tokens = 3
        self.method = "ar"
        self.opens_reasoning = None
        self.cancelled = threading.Event()

    async def __aiter__(self):
        while not self.cancelled.is_set():
            await asyncio.sleep(0.01)
            yield Chunk("x", 1)

    def cancel(self) -> None:
        self.cancelled.set()


class FakeEngine:
    model_id = "fake"
    call_format = "hermes"
    call_markers = ()

    def __init__(self) -> None:
        self.generations: list[EndlessGeneration] = []

    async def submit(self, request: CompletionRequest) -> EndlessGeneration:
        self.generations.append(EndlessGeneration())
        return self.generations[-1]

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot()

    def close(self) -> None:
        for generation in self.generations:
            generation.cancel()


def test_disconnecting_clients_cancel_their_generation():
    fake = FakeEngine()
    with live_server(create_app(ServerSettings(), fake)) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=chat_body(stream=True)) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
        assert fake.generations[0].cancelled.wait(TIMEOUT), "streaming disconnect did not cancel"
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=0.5)
        assert fake.generations[1].cancelled.wait(TIMEOUT), "non-streaming disconnect did not cancel"
        assert http.get(f"{url}/health").status_code == 200


def hold_rounds_and_count_rows(monkeypatch) -> tuple[dict, list[int]]:
    """Patch the batched engine (the class every ServingEngine runs) so that, once ``hold["until"]`` is set, its rounds
    wait until that many sequences are queued or running (for at most ``hold["deadline"]``), and so that the number
    of sequences each target forward scores is appended to ``rows``. Nothing else about a round changes."""
    from jointspec.batch.cache import RaggedCache
    from jointspec.batch.engine import BatchEngine

    hold = {"until": 0, "deadline": 0.0}
    rows: list[int] = []
    real_step, real_forward = BatchEngine.step, RaggedCache.forward

    def step(self):
        waiting = len(self.waiting) + len(self.active)
        if hold["until"] and waiting < hold["until"] and time.monotonic() < hold["deadline"]:
            time.sleep(0.002)  # the engine thread goes back to its inbox for the requests still on their way
            return []
        hold["until"] = 0
        return real_step(self)

    def forward(self, inputs, *args, **kwargs):
        rows.append(len(inputs))
        return real_forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(BatchEngine, "step", step)
    monkeypatch.setattr(RaggedCache, "forward", forward)
    return hold, rows


def test_a_batch_of_prompts_joins_the_batch_in_one_round(byte_model, tokenizer, monkeypatch):
    # Admitted together: the first forward that scores any of them scores all of them, not one more a round.
    _, rows = hold_rounds_and_count_rows(monkeypatch)
    served = ServingEngine(CausalLM(byte_model), tokenizer, model_id="tiny", max_batch_size=8)
    try:
        client = TestClient(create_app(ServerSettings(), served))
        reply = client.post("/v1/completions", json={"prompt": ["a b", "c d e", "f", "g h"], "max_tokens": 6,
                                                     "temperature": 0, "n": 2})
        assert reply.status_code == 200 and len(reply.json()["choices"]) == 8
        assert rows[0] == 8, rows
    finally:
        served.close()


def test_the_openai_client_talks_to_jointspec_serve(tmp_path, byte_model, tokenizer, monkeypatch):
    """The `serve` code path (model folder -> build_engine -> create_app -> uvicorn) with the official client."""
    import openai

    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import build_engine

    byte_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    # Parsed by the real CLI parser, so every option `jointspec serve` has gets its real default.
    args = build_parser().parse_args(["serve", "--model", str(tmp_path / "model"), "--method", "pld",
                                      "--dtype", "float32", "--max-batch-size", "4", "--max-tokens", "16",
                                      "--model-id", "tiny-served"])
    served = build_engine(args)
    try:
        with live_server(create_app(ServerSettings(), served)) as (url, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)
            assert [m.id for m in client.models.list()] == ["tiny-served"]
            messages = [{"role": "user", "content": "abcabc"}]
            whole = client.chat.completions.create(model="tiny-served", messages=messages, temperature=0,
                                                   max_tokens=12)
            assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens >= 1
            # The usage extension parses: the client keeps the unknown field as an extra of its usage model.
            figures = whole.usage.model_extra["jointspec"]
            assert figures["rounds"] >= 1 and figures["drafted_tokens"] >= figures["accepted_tokens"] >= 0
            stream = client.chat.completions.create(model="tiny-served", messages=messages, temperature=0,
                                                    max_tokens=12, stream=True, stream_options={"include_usage": True},
                                                    extra_body={"jointspec": {"method": "ar"}})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == whole.choices[0].message.content
            assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
            assert chunks[-1].usage.model_extra["jointspec"] == {  # ar drafts nothing: one token per round
                "drafted_tokens": 0, "accepted_tokens": 0, "rounds": whole.usage.completion_tokens,
                "mean_accepted_tokens": 1.0, "acceptance_rate": 0.0, "forced_tokens": 0}
            # Log-probabilities parse into the client's own models, in both endpoints' shapes.
            scored = client.chat.completions.create(model="tiny-served", messages=messages, temperature=0,
                                                    max_tokens=12, logprobs=True, top_logprobs=2)
            assert scored.choices[0].message.content == whole.choices[0].message.content
            content = scored.choices[0].logprobs.content
            assert len(content) == scored.usage.completion_tokens
            assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 and entry.bytes is not None
                       for entry in content)
            legacy = client.completions.create(model="tiny-served", prompt="abcabc", temperature=0, max_tokens=8,
                                               logprobs=1)
            assert len(legacy.choices[0].logprobs.token_logprobs) == legacy.usage.completion_tokens
            assert all(len(top) <= 2 for top in legacy.choices[0].logprobs.top_logprobs)
            several = client.chat.completions.create(model="tiny-served", messages=messages, temperature=1.0,
                                                     seed=7, max_tokens=8, n=3)
            assert [c.index for c in several.choices] == [0, 1, 2]
            assert [c.message.content for c in several.choices] == [
                client.chat.completions.create(model="tiny-served", messages=messages, temperature=1.0, seed=seed,
                                               max_tokens=8).choices[0].message.content for seed in (7, 8, 9)]
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model="tiny-served", messages=messages, n=17)
            assert error.value.body["param"] == "n"

            async def concurrently() -> list[str]:
                async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT,
                                              max_retries=0) as aclient:
                    replies = await asyncio.gather(*[
                        aclient.completions.create(model="tiny-served", prompt=f"prompt {i}" * (i + 1),
                                                   temperature=0, max_tokens=10) for i in range(6)])
                return [r.choices[0].text for r in replies]

            # Six requests at once share the engine's rounds: the first round, once all six are in (rounds wait for
            # them, so how fast the client sends them does not matter), scores four of them (--max-batch-size) in
            # one target forward, and the other two join as those finish. Sent one by one, each runs alone.
            hold, rows = hold_rounds_and_count_rows(monkeypatch)
            hold.update(until=6, deadline=time.monotonic() + TIMEOUT)
            together = asyncio.run(concurrently())
            together_rows = list(rows)
            rows.clear()
            alone = [client.completions.create(model="tiny-served", prompt=f"prompt {i}" * (i + 1), temperature=0,
                                               max_tokens=10).choices[0].text for i in range(6)]
            assert together == alone  # sharing the batch changes nobody's tokens
            assert together_rows[0] == max(together_rows) == 4, together_rows
            assert set(rows) == {1}, rows
    finally:
        served.close()


def test_a_restarted_server_reads_back_the_cost_curves_it_kept(tmp_path, byte_model, tokenizer, monkeypatch,
                                                               capsys):
    """`jointspec serve` keeps the cost curves it measures in the store `generate` uses (drafters/curve_store.py), so
    a restart answers the same without measuring again (nothing new written) and makes the same speed choices."""
    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import run_serve
    from jointspec.drafters import curve_store
    from jointspec.server import lifecycle

    byte_model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.delenv(curve_store.ENV)
    monkeypatch.setattr(curve_store, "default_directory", lambda: tmp_path / "curves")
    answers, stores = [], []

    def one_request(app, settings):  # stands in for uvicorn: one request, then the drain
        stores.append((settings.stored_responses, settings.stored_responses_mb))
        with live_server(app) as (url, _):
            reply = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json={
                "prompt": "abcabcabc", "max_tokens": 12, "temperature": 0})
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["text"])

    monkeypatch.setattr(lifecycle, "serve", one_request)
    args = build_parser().parse_args(["serve", "--model", str(tmp_path / "model"), "--method", "pld", "--cost-aware",
                                      "--dtype", "float32", "--max-tokens", "12", "--stored-responses", "7",
                                      "--stored-responses-mb", "2"])
    assert run_serve(args) == 0 and stores == [(7, 2)]  # (the flags reach the server's settings)
    # It says what its weights are, as generate does (--quantize auto leaves a float folder float), then where it is.
    err = capsys.readouterr().err
    assert "jointspec: quantize=auto -> none:" in err and err.index("quantize=auto") < err.index("serving ")
    # (and what it reads of the chat template: this one writes no tool format and no reasoning block)
    assert "chat: tool calls in hermes format, shown to the model as text" in err and "no reasoning block" in err
    kept = sorted((tmp_path / "curves").glob("*.json"))
    assert kept, "the server measured a cost curve and kept none"
    read, written = record_curve_store(monkeypatch)
    assert run_serve(args) == 0
    assert answers[1] == answers[0] and written == [] and read and all(curve is not None for curve in read)


@pytest.mark.parametrize("quantize", ["int4", "auto"])
def test_serve_defaults_to_generates_method_and_answers_with_its_tokens(tmp_path, quantize):
    """`serve` with no method runs `default`, as `generate` does: on the compiled int4 layers through the lockstep
    engine; on a float32 model (auto keeps a local float folder float) through the ragged engine, as `default` is
    prompt lookup here (no head or n-gram table is shipped for this model). Either way a served greedy answer is the
    tokens the Python API's Pipeline (what `generate` runs) gives the same prompt ids, with two other requests in
    flight."""
    from jointspec.api import GenerationConfig, Pipeline
    from jointspec.batch.lockstep import LockstepEngine, compiled_target
    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import build_engine

    from helpers import grouped_llama, random_prompt, word_tokenizer

    folder = tmp_path / "model"
    grouped_llama(0).save_pretrained(folder)
    word_tokenizer(99).save_pretrained(folder)
    args = build_parser().parse_args(["serve", "--model", str(folder), "--quantize", quantize, "--max-tokens", "16"])
    assert args.method == "default"
    served = build_engine(args)
    try:
        assert isinstance(served._engine, LockstepEngine) == compiled_target(served.target) == (quantize == "int4")
        assert served.description.startswith("lockstep engine: each request" if quantize == "int4" else "ragged engine")
        pipeline = Pipeline.load(str(folder), quantize=quantize)
        prompts = [random_prompt(seed, length=6 + seed) for seed in range(3)]
        expected = [pipeline.generate_ids(p, GenerationConfig(max_new_tokens=16)).token_ids for p in prompts]
        with live_server(create_app(ServerSettings(), served)) as (url, _):
            def ask(prompt: list[int]) -> list[int]:
                reply = httpx.post(f"{url}/v1/completions", timeout=TIMEOUT, json={
                    "prompt": prompt, "max_tokens": 16, "temperature": 0})
                assert reply.status_code == 200, reply.text
                return pipeline.tokenizer(reply.json()["choices"][0]["text"], add_special_tokens=False)["input_ids"]
            answers: list = [None] * 3
            threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(prompts[i]))) for i in range(3)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
        assert answers == [pipeline.tokenizer(pipeline.tokenizer.decode(e, skip_special_tokens=True),
                                              add_special_tokens=False)["input_ids"] for e in expected]
        assert any(len(e) > 0 for e in expected)
    finally:
        served.close()


def test_the_engine_thread_loads_the_model_and_reports_a_failed_load(byte_model, tokenizer):
    """With ``load`` the model loads on the engine thread (all torch work on one thread: ServingEngine says why); a
    load that fails raises from the constructor, and no engine thread is left behind."""
    threads = []

    def load():
        threads.append(threading.current_thread().name)
        return CausalLM(byte_model), tokenizer
    served = ServingEngine(None, None, load=load)
    try:
        assert threads == ["jointspec-engine"] and served.target is not None
    finally:
        served.close()

    def broken():
        raise RuntimeError("no such model")
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="no such model"):
        ServingEngine(None, None, load=broken)
    assert {t.ident for t in threading.enumerate() if t.name == "jointspec-engine"} <= before
    with pytest.raises(ValueError, match="not both"):
        ServingEngine(CausalLM(byte_model), tokenizer, load=load)


def test_a_conversations_next_turn_reports_the_prompt_tokens_it_did_not_read_again(tmp_path, monkeypatch):
    """`serve` keeps finished requests' caches (--prompt-cache-mb): a prompt that begins with an earlier request's
    tokens reads only the rest, says how many it reused in OpenAI's ``usage.prompt_tokens_details.cached_tokens``,
    and answers what `generate` answers. With --prompt-cache-mb 0 nothing is reused."""
    from jointspec.api import GenerationConfig, Pipeline
    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import build_engine

    from helpers import grouped_llama, random_prompt, read_prompts_row_by_row, word_tokenizer

    read_prompts_row_by_row(monkeypatch)

    folder = tmp_path / "model"
    grouped_llama(0).save_pretrained(folder)
    word_tokenizer(99).save_pretrained(folder)
    pipeline = Pipeline.load(str(folder), quantize="int4")
    first = random_prompt(3, 40)
    for budget in ("256", "0"):
        args = build_parser().parse_args(["serve", "--model", str(folder), "--quantize", "int4", "--method", "ar",
                                          "--prompt-cache-mb", budget])
        served = build_engine(args)
        try:
            client = TestClient(create_app(ServerSettings(), served))

            def ask(prompt: list[int], client=client) -> dict:
                reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                             "return_token_ids": True})
                assert reply.status_code == 200, reply.text
                return reply.json()
            budget_bytes = int(budget) * 2 ** 20
            assert f"jointspec_prompt_cache_max_bytes {budget_bytes}\n" in client.get("/metrics").text
            answer = ask(first)["choices"][0]["token_ids"]
            second = first + answer + random_prompt(5, 6)
            reply = ask(second)
            expected = pipeline.generate_ids(second, GenerationConfig(max_new_tokens=12)).token_ids
            assert reply["choices"][0]["token_ids"] == expected
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (len(first) + len(answer) - 1 if budget != "0" else 0), cached
            metrics = client.get("/metrics").text
            assert f"jointspec_prompt_tokens_cached_total {cached}\n" in metrics
            # The second request took the first's cache whole and left its own: one entry, under the budget.
            entries = re.search(r"^jointspec_prompt_cache_entries (\d+)$", metrics, re.M)
            kept = re.search(r"^jointspec_prompt_cache_bytes (\d+)$", metrics, re.M)
            assert int(entries.group(1)) == (1 if budget_bytes else 0)
            assert (0 < int(kept.group(1)) <= budget_bytes) if budget_bytes else int(kept.group(1)) == 0
            # A batch of two prompts: usage's cached tokens are each prompt's, summed (the metric counts them too).
            counted = r"^jointspec_prompt_tokens_cached_total (\d+)$"
            before = int(re.search(counted, metrics, re.M).group(1))
            batch = client.post("/v1/completions", json={"prompt": [second + [5, 6], second + [7, 8]],
                                                         "max_tokens": 4, "temperature": 0}).json()
            after = int(re.search(counted, client.get("/metrics").text, re.M).group(1))
            assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == after - before
            assert (after - before > len(second)) == bool(budget_bytes), (before, after)  # (both reused)
        finally:
            served.close()


def test_a_model_without_a_chat_template_reads_a_chat_with_its_bos_token(byte_model):
    """Without a template the messages become a plain transcript, read as any prompt is: with the tokenizer's BOS.
    It was read without special tokens, and a base model (Gemma-3's GGUF) then continued the text as noise."""
    from tokenizers import processors

    from helpers import byte_tokenizer

    plain = byte_tokenizer()
    plain.chat_template = None
    plain.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                           special_tokens=[("<s>", 257)])
    served = ServingEngine(CausalLM(byte_model), plain, model_id="tiny")
    try:
        messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"})
        ids = served.encode(CompletionRequest(messages=messages))
        assert ids == plain("system: Be brief.\nuser: hi\nassistant:")["input_ids"] and ids[0] == 257
    finally:
        served.close()


def test_an_api_key_guards_the_api_and_leaves_health_and_metrics_open(engine):
    """serve --api-key: the official client with the key is answered, without it or with another it gets 401 in
    OpenAI's envelope (the key never echoed), before the body is read; /health and /metrics stay open; a streamed
    answer still streams (the gate is pure ASGI). Deterministic."""
    import openai

    key = "s3cret-key"
    app = create_app(ServerSettings(api_key=key), engine)
    with live_server(app) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=TIMEOUT, max_retries=0)
        reply = client.completions.create(model="tiny", prompt="abcab", max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens >= 1
        chunks = list(client.completions.create(model="tiny", prompt="abcab", max_tokens=6, temperature=0,
                                                stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
        for wrong in ("not-the-key", key + "x"):
            with pytest.raises(openai.AuthenticationError) as refused:
                openai.OpenAI(base_url=f"{url}/v1", api_key=wrong, timeout=TIMEOUT, max_retries=0).models.list()
            assert refused.value.body["code"] == "invalid_api_key" and wrong not in str(refused.value.body)
        bare = httpx.post(f"{url}/v1/chat/completions", json=chat_body(), timeout=TIMEOUT)
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == "Bearer"
        assert bare.json()["error"]["message"].startswith("no API key given")
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"bearer {key}"}, timeout=TIMEOUT
                         ).status_code == 200  # the scheme's case does not matter (RFC 7235)
        for header in (key, f"Basic {key}", f"Bearer{key}"):  # the key, but not as a bearer token
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": header}, timeout=TIMEOUT
                             ).status_code == 401, header
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{url}/metrics", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{url}/health/", timeout=TIMEOUT).status_code == 404  # a probe's slash: no key asked
    assert key not in repr(ServerSettings(api_key=key))
    for unusable in ("", " ", " padded", "non-ascii-\u00e9", "two words"):  # (a header could not carry it whole)
        with pytest.raises(ValueError, match="printable ASCII without spaces"):
            ServerSettings(api_key=unusable)


def test_the_api_key_guards_every_route_under_a_root_path_or_a_mount(engine):
    """Behind a proxy's prefix or mounted in another app, the routes' paths begin with the prefix: a gate that looked
    for /v1 at the start let /prefix/v1/completions through. Only /health and /metrics are open, wherever mounted."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    key = "k3y"
    outer = Starlette(routes=[Mount("/api", app=create_app(ServerSettings(api_key=key), engine))])
    with live_server(outer) as (url, _):
        body = {"prompt": "abcab", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/api/v1/completions", json=body, timeout=TIMEOUT).status_code == 401
        assert httpx.get(f"{url}/api/v1/models", timeout=TIMEOUT).status_code == 401
        assert httpx.post(f"{url}/api/v1/completions", json=body, timeout=TIMEOUT,
                          headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(f"{url}/api/health", timeout=TIMEOUT).status_code == 200
        assert httpx.get(f"{url}/api/metrics", timeout=TIMEOUT).status_code == 200


def test_serve_takes_its_api_key_from_the_environment_and_refuses_an_empty_one(monkeypatch, capsys):
    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import api_key
    from jointspec.server.keys import API_KEY_VARIABLE

    from helpers import assert_clean_error, run_cli

    parse = build_parser("serve").parse_args
    monkeypatch.delenv(API_KEY_VARIABLE, raising=False)
    assert api_key(parse(["serve"])) is None
    monkeypatch.setenv(API_KEY_VARIABLE, "from-env")
    assert api_key(parse(["serve"])) == "from-env"
    assert api_key(parse(["serve", "--api-key", "from-flag"])) == "from-flag"
    monkeypatch.setenv(API_KEY_VARIABLE, "")
    code, _, err = run_cli(capsys, "serve", "--port", "1")  # refused before the port or the model is looked at
    assert_clean_error(code, err, f"{API_KEY_VARIABLE} is empty")
    code, _, err = run_cli(capsys, "serve", "--port", "1", "--api-key", "secret with spaces")
    assert_clean_error(code, err, "--api-key: an API key is printable ASCII without spaces")
    assert "secret with spaces" not in err  # a secret is not repeated
