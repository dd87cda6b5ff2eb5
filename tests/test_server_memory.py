"""The server's online memory (``serve --online-memory``): answers stay the engine's exact tokens, and a later request
drafts from earlier answers of its own scope only, on both batched engines. And MTAD served, with its request options,
on the lockstep engine.

Models: a tiny random Llama on the compiled int4 layers, served by the lockstep engine (what serves a CPU int4
model), and the tiny float32 byte-level model, served by the ragged-cache engine. Greedy, so every comparison is
exact (no false-failure odds)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.methods import MethodConfig
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine

from helpers import random_prompt


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from jointspec.batch.lockstep import LockstepEngine
    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import build_engine

    from helpers import grouped_llama, word_tokenizer

    folder = tmp_path_factory.mktemp("model")
    grouped_llama(0).save_pretrained(folder)
    word_tokenizer(99).save_pretrained(folder)
    args = build_parser().parse_args(["serve", "--model", str(folder), "--quantize", "int4", "--max-tokens", "24",
                                      "--method", "lookahead", "--online-memory", "user"])
    engine = build_engine(args)
    assert isinstance(engine._engine, LockstepEngine)
    yield engine
    engine.close()


def ask(client, prompt: list[int], **extra) -> dict:
    reply = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                 "return_token_ids": True, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_user_drafts_from_their_own_earlier_answers_and_gets_the_same_tokens(served):
    client = TestClient(create_app(ServerSettings(), served))
    prompt = random_prompt(5)
    first = ask(client, prompt, user="alice")
    again = ask(client, prompt, user="alice")
    other = ask(client, prompt, user="bob")
    anonymous = ask(client, prompt)
    tokens = first["choices"][0]["token_ids"]
    assert len(tokens) == 24
    for reply in (again, other, anonymous):
        assert reply["choices"][0]["token_ids"] == tokens  # lossless: the memory changes drafts, never tokens
    # Alice's second request copied her first answer: far fewer target calls. Bob and a request without a user
    # have no memory of it, so they decode as her first request did.
    rounds = [reply["usage"]["jointspec"]["rounds"] for reply in (first, again, other, anonymous)]
    assert rounds[1] < rounds[0] / 2 and rounds[2] == rounds[3] == rounds[0], rounds
    memory = served.memory_for("alice", served.method)
    assert memory is not None and memory.num_answers == 2
    assert served.memory_for(None, served.method) is None
    assert served.memory_for("alice", MethodConfig(name="sps", draft="self")) is None  # sps does not learn online


def test_the_ragged_engine_shares_one_memory_when_told_to(byte_model, tokenizer):
    # A float32 model is served by the ragged-cache engine: its batched prompt lookup copies from the shared memory
    # too, so a second request (another user's, or none) drafts the first one's answer, with the same tokens.
    engine = ServingEngine(CausalLM(byte_model), tokenizer, MethodConfig(name="pld"), model_id="tiny",
                           online_memory="shared")
    try:
        client = TestClient(create_app(ServerSettings(), engine))
        prompt = random_prompt(5)
        first, again = ask(client, prompt, user="alice"), ask(client, prompt)
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
        rounds = [reply["usage"]["jointspec"]["rounds"] for reply in (first, again)]
        assert rounds[1] < rounds[0], rounds  # deterministic: 6 against 9 when written
        assert engine.memory_for(None, engine.method) is engine.memory_for("bob", engine.method)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="online_memory must be one of"):
        ServingEngine(CausalLM(byte_model), tokenizer, online_memory="everyone")


def test_mtad_is_served_with_its_own_options_on_the_lockstep_engine(served):
    """MTAD at temperature 0 is plain greedy decoding whatever its depth, beams and threshold, so its tokens are the
    server's method's; sampled, it answers in full with its speculation figures."""
    client = TestClient(create_app(ServerSettings(), served))
    prompt = random_prompt(7)
    options = {"method": "mtad", "draft": "self", "num_draft_tokens": 3, "beam_width": 2, "accept_threshold": 0.3}
    plain = ask(client, prompt)
    for cost_aware in (True, False):
        mtad = ask(client, prompt, jointspec={**options, "cost_aware": cost_aware})
        assert mtad["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
        assert mtad["usage"]["jointspec"]["accepted_tokens"] > 0
    sampled = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 1.0,
                                                   "top_k": 10, "seed": 3, "jointspec": options})
    assert sampled.status_code == 200, sampled.text
    assert sampled.json()["usage"]["completion_tokens"] >= 1
    bad = client.post("/v1/completions", json={"prompt": prompt, "jointspec": {**options, "verify": "blocks"}})
    assert bad.status_code == 400 and "verify" in bad.text


def test_only_answers_no_stop_string_cut_are_remembered(served):
    # docs/methods.md: only whole answers join a memory. A stop string is found by the request's text layer, after
    # the engine may already have finished the answer (this one copies its earlier answer, so it ends in a round
    # or two): an answer it cut must not be remembered, whatever the threads' timing.
    client = TestClient(create_app(ServerSettings(), served))
    prompt = random_prompt(9)
    whole = ask(client, prompt, user="carol", stop=["no such words"])  # may meet a stop string, meets none
    memory = served.memory_for("carol", served.method)
    assert whole["choices"][0]["finish_reason"] == "length"
    stop = whole["choices"][0]["text"].split()[3]
    # The engine thread remembers an answer that could have met a stop string when its stream says it is whole,
    # through the inbox the next request comes by: so by the time that request is answered.
    cut = ask(client, prompt, user="carol", stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["usage"]["completion_tokens"] < 24
    assert memory.num_answers == 1  # the whole answer
    ask(client, random_prompt(10), user="carol")  # the same inbox: anything the cut answer queued is done by now
    assert memory.num_answers == 2  # the first answer and the last, not the cut one


def test_a_refused_request_makes_no_memory(served):
    # A user's memory is one of 64 per model (least recently used out): requests the server refuses must not make
    # scopes that push real ones out.
    from jointspec.drafters import memory as memories

    client = TestClient(create_app(ServerSettings(), served))
    too_long = client.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 4, "user": "mallory"})
    assert too_long.status_code == 400, too_long.text
    assert "user:mallory" not in memories._memories.get(served.target.model, {})
