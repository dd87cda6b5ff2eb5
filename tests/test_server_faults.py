"""Overload and faults: a full queue, request timeouts, clients that leave, stop strings, shutdown, and a small soak.

The server runs live (uvicorn in a thread, helpers.live_server) over the real batched engine on the tiny random Llama
with the byte tokenizer of helpers.py. Where a request must still be decoding when something happens to it, the
engine's rounds are slowed or held by patching ``BatchEngine.step`` (nothing else about a round changes): a
200-token request at 20-50 ms a round runs for 4-10 s, far past the 0.5-2 s at which the tests act, so a slower
machine only makes the outcome surer. The timing bounds that could fail on a healthy server: a refusal within 2 s, a
row freed within 2 s of its client leaving, and, in the drain test, 20 rounds finishing within the 2 s drain (about
0.5 s at the patched 20 ms a round). Each fails only if the test process stalls for a second or more; none has in
the runs so far.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from jointspec.backends.hf import CausalLM
from jointspec.batch.engine import BatchEngine
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine
from jointspec.server.lifecycle import DrainingServer

from helpers import SERVER_TIMEOUT as TIMEOUT
from helpers import live_server

LONG = {"prompt": "abc", "max_tokens": 200, "temperature": 0}  # no end-of-sequence token in 200 greedy tokens


@pytest.fixture()
def make_engine(byte_model, tokenizer):
    engines = []

    def make(**options) -> ServingEngine:
        engines.append(ServingEngine(CausalLM(byte_model), tokenizer, model_id="tiny", **options))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def slow_rounds(monkeypatch, seconds: float) -> None:
    """Every round sleeps ``seconds`` first."""
    real = BatchEngine.step

    def step(self):
        time.sleep(seconds)
        return real(self)

    monkeypatch.setattr(BatchEngine, "step", step)


def held_rounds(monkeypatch):
    """Rounds run only once the returned event is set; until then the engine thread keeps reading its inbox."""
    import threading

    gate = threading.Event()
    real = BatchEngine.step

    def step(self):
        if not gate.is_set():
            time.sleep(0.002)
            return []
        return real(self)

    monkeypatch.setattr(BatchEngine, "step", step)
    return gate


def eventually(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def rows_freed(engine: ServingEngine) -> bool:
    snapshot = engine.snapshot()
    return snapshot.running_sequences == 0 and snapshot.waiting_sequences == 0


def sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def outcome_count(url: str, endpoint: str, outcome: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    line = f'jointspec_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} '
    return int(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def assert_envelope(payload: dict, code: str) -> None:
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, payload
    assert payload["error"]["code"] == code and payload["error"]["message"], payload


# -- overload ---------------------------------------------------------------------------------------------------

def test_a_full_queue_is_refused_at_once_with_429_and_retry_after(make_engine, monkeypatch):
    gate = held_rounds(monkeypatch)
    engine = make_engine(max_batch_size=1, max_queue=1)  # room for two requests in flight
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}
    with live_server(create_app(ServerSettings(), engine)) as (url, _):
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                admitted = [asyncio.create_task(http.post("/v1/completions", json=b))
                            for b in (body, {**body, "stream": True})]
                while engine.snapshot().waiting_sequences < 2:  # no round runs: both wait
                    await asyncio.sleep(0.01)
                start = time.monotonic()
                refused = [await http.post("/v1/completions", json=b) for b in (body, {**body, "stream": True})]
                elapsed = time.monotonic() - start
                gate.set()
                answers = await asyncio.gather(*admitted)
                after = await http.post("/v1/completions", json=body)  # the admitted ones left: room again
                return refused, elapsed, answers, after

        refused, elapsed, answers, after = asyncio.run(scenario())
        assert elapsed < 2.0, f"refusing took {elapsed:.2f} s"
        for reply in refused:
            assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
            assert_envelope(reply.json(), "queue_full")
        assert [a.status_code for a in answers] == [200, 200] and after.status_code == 200
        assert sse_data(answers[1].text)[-1] == "[DONE]"
        assert outcome_count(url, "completions", "overloaded") == 2
        assert outcome_count(url, "completions", "completed") == 3


def test_choices_the_queue_cannot_hold_are_refused_together_and_leave_nothing_running(make_engine, monkeypatch):
    # n choices are n sequences, admitted together or refused together: more than the server ever holds is a 400;
    # more than it has room for now, a 429 with none of them queued; and the ones admitted join the same round.
    gate = held_rounds(monkeypatch)
    engine = make_engine(max_batch_size=1, max_queue=1)  # room for two sequences in flight
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}
    with live_server(create_app(ServerSettings(), engine)) as (url, _):
        never = httpx.post(f"{url}/v1/completions", json={**body, "n": 3}, timeout=TIMEOUT)
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
        assert "--max-batch-size 1 + --max-queue 1" in never.json()["error"]["message"]
        three = httpx.post(f"{url}/v1/completions", json={**body, "prompt": ["a", "b", "c"]}, timeout=TIMEOUT)
        assert three.status_code == 400 and three.json()["error"]["param"] == "prompt"
        # Prompts scored alone hold no sequence (each holds a place while it is scored, one after another).
        gate.set()
        scored = httpx.post(f"{url}/v1/completions", json={"prompt": ["a b", "c d", "e f"], "max_tokens": 0,
                                                           "echo": True, "logprobs": 0}, timeout=TIMEOUT)
        assert scored.status_code == 200 and len(scored.json()["choices"]) == 3
        gate.clear()

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                first = asyncio.create_task(http.post("/v1/completions", json=body))
                while engine.snapshot().waiting_sequences < 1:  # no round runs: it waits, holding a place
                    await asyncio.sleep(0.01)
                refused = await http.post("/v1/completions", json={**body, "n": 2})
                waiting = engine.snapshot().waiting_sequences
                gate.set()
                return await first, refused, waiting

        first, refused, waiting = asyncio.run(scenario())
        assert refused.status_code == 429 and waiting == 1  # none of the two was queued
        assert_envelope(refused.json(), "queue_full")
        assert first.status_code == 200
        eventually(engine.is_idle, "every place given back")
        both = httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=TIMEOUT)
        assert both.status_code == 200 and len(both.json()["choices"]) == 2


def test_a_prompt_being_scored_holds_its_place_and_a_full_server_refuses_more(make_engine, monkeypatch):
    # Echo's scoring runs on the engine thread before any decoding: it takes a place in flight as a request does, so
    # past --max-batch-size + --max-queue the next is refused at once, never queued behind it unseen.
    import threading

    gate, entered = threading.Event(), threading.Event()
    real = ServingEngine._score_now

    def held(self, prompt_ids, top):
        entered.set()
        gate.wait(TIMEOUT)
        return real(self, prompt_ids, top)

    monkeypatch.setattr(ServingEngine, "_score_now", held)
    engine = make_engine(max_batch_size=1, max_queue=0)
    body = {"prompt": "abc abc", "max_tokens": 0, "echo": True, "logprobs": 1}
    with live_server(create_app(ServerSettings(), engine)) as (url, _):
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                first = asyncio.create_task(http.post("/v1/completions", json=body))
                try:
                    await asyncio.to_thread(entered.wait, TIMEOUT)  # the first is being scored
                    # refused at once, not queued behind it
                    refused = [await asyncio.wait_for(http.post("/v1/completions", json=b), 5)
                               for b in (body, {**body, "max_tokens": 4})]
                finally:
                    gate.set()
                return await first, refused

        first, refused = asyncio.run(scenario())
        assert first.status_code == 200 and first.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None
        for reply in refused:
            assert reply.status_code == 429
            assert_envelope(reply.json(), "queue_full")
        eventually(engine.is_idle, "the scored request's place given back")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).status_code == 200


# -- timeouts, clients leaving, stop strings --------------------------------------------------------------------

def test_a_request_past_its_timeout_is_stopped_and_gets_504(make_engine, monkeypatch):
    slow_rounds(monkeypatch, 0.05)
    engine = make_engine(max_batch_size=2)
    with live_server(create_app(ServerSettings(request_timeout=0.5), engine)) as (url, _):
        start = time.monotonic()
        whole = httpx.post(f"{url}/v1/completions", json=LONG, timeout=TIMEOUT)
        assert 0.5 <= time.monotonic() - start < TIMEOUT
        assert whole.status_code == 504
        assert_envelope(whole.json(), "timeout")
        eventually(lambda: rows_freed(engine) and engine.snapshot().num_cancelled == 1, "the row was not freed")

        streamed = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=TIMEOUT)
        events = sse_data(streamed.text)
        assert streamed.status_code == 200 and "[DONE]" not in events  # it had started: the error ends it
        assert_envelope(json.loads(events[-1]), "timeout")
        assert all("choices" in json.loads(e) for e in events[:-1])
        eventually(lambda: rows_freed(engine) and engine.snapshot().num_cancelled == 2, "the row was not freed")
        assert outcome_count(url, "completions", "timeout") == 2


def test_a_client_that_leaves_mid_stream_frees_its_row_at_once(make_engine, monkeypatch):
    slow_rounds(monkeypatch, 0.02)
    engine = make_engine(max_batch_size=2)
    with live_server(create_app(ServerSettings(), engine)) as (url, _):
        with httpx.Client(timeout=TIMEOUT) as http:
            with http.stream("POST", f"{url}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "abc"}], **{k: LONG[k] for k in LONG if k != "prompt"},
                    "stream": True}) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break  # text arrived: the sequence is in a row, 190-odd rounds from its end
                assert engine.snapshot().running_sequences == 1
        # Leaving the block closed the connection; the row must go long before the sequence could end (4 s).
        left = time.monotonic()
        eventually(lambda: rows_freed(engine) and engine.snapshot().num_cancelled == 1, "the row was not freed")
        assert time.monotonic() - left < 2.0
        assert outcome_count(url, "chat", "cancelled") == 1


def test_a_stop_string_ends_the_sequence_in_the_engine_too(make_engine):
    engine = make_engine(max_batch_size=2)
    # A live server: TestClient closes each request's event loop after it, which would cancel the sequence anyway.
    with live_server(create_app(ServerSettings(), engine)) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        body = {**LONG, "max_tokens": 60}
        full = http.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
        # A two-character stop string whose first occurrence is early in the 60-token answer.
        i = next(i for i in range(1, 20) if full[i:i + 2].isascii() and full[i:i + 2].isprintable()
                 and full.find(full[i:i + 2]) == i)
        cut = http.post(f"{url}/v1/completions", json={**body, "stop": full[i:i + 2]}).json()
        assert cut["choices"][0]["text"] == full[:i] and cut["choices"][0]["finish_reason"] == "stop"
        # The text stopped; decoding must stop as well, not run on to max_tokens for nobody.
        eventually(lambda: engine.snapshot().num_cancelled == 1 and rows_freed(engine),
                   "it decoded on after the stop")



def test_a_request_its_own_method_refuses_mid_way_gets_a_400_and_the_server_goes_on(tmp_path):
    """A draft past the rows a CPU forward computes alone (SpecTr's 16 chains of up to 29 tokens: hundreds of nodes,
    within the options' own bounds) is refused by the decode loop at the request's first round, on the lockstep
    engine that serves a CPU int4 model. That request gets a 400 in OpenAI's envelope (an error event when
    streamed); it used to raise out of the engine's round and fail every request in flight with a 500. The next
    request is served as before."""
    from jointspec.cli.main import build_parser
    from jointspec.cli.serve import build_engine

    from helpers import grouped_llama, random_prompt, word_tokenizer

    folder = tmp_path / "model"
    grouped_llama(0).save_pretrained(folder)
    word_tokenizer(99).save_pretrained(folder)
    engine = build_engine(build_parser().parse_args(["serve", "--model", str(folder), "--quantize", "int4",
                                                      "--method", "pld", "--max-tokens", "16"]))
    body = {"prompt": random_prompt(2), "temperature": 0, "max_tokens": 30,
            "jointspec": {"method": "spectr", "draft": "self", "beam_width": 16, "num_draft_tokens": 64,
                          "cost_aware": False}}
    try:
        with live_server(create_app(ServerSettings(), engine)) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
            reply = http.post(f"{url}/v1/completions", json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "invalid_request" and "needs a verification forward of" in error["message"]
            streamed = http.post(f"{url}/v1/completions", json={**body, "stream": True}).text
            assert '"code": "invalid_request"' in streamed.replace('":"', '": "')
            good = http.post(f"{url}/v1/completions", json={**body, "jointspec": {"method": "pld"}})
            assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 30
            # Counted as the 400s they are, whole and streamed, not as engine errors.
            page = http.get(f"{url}/metrics").text
            assert 'jointspec_requests_total{endpoint="completions",outcome="rejected"} 2' in page, page
            assert 'jointspec_requests_total{endpoint="completions",outcome="error"} 0' in page
    finally:
        engine.close()

def test_a_round_that_raises_fails_its_requests_with_a_500_code_and_the_server_goes_on(make_engine, monkeypatch):
    """A bug in a round (here: a round that raises once) fails the requests in it with a 500 in OpenAI's envelope,
    code ``engine_error``, whole or streamed, counted as ``error``; the engine starts afresh and the next request is
    served."""
    real, raised = BatchEngine.step, []

    def step(self):
        if self.active and len(raised) < 2:  # the whole request's round, then the streamed one's
            raised.append(True)
            raise RuntimeError("a bug in a round")
        return real(self)

    monkeypatch.setattr(BatchEngine, "step", step)
    engine = make_engine()
    with live_server(create_app(ServerSettings(), engine)) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        reply = http.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 8})
        assert reply.status_code == 500, reply.text
        assert_envelope(reply.json(), "engine_error")
        assert reply.json()["error"]["type"] == "server_error"
        streamed = [json.loads(line) for line in sse_data(http.post(
            f"{url}/v1/completions", json={**LONG, "max_tokens": 8, "stream": True}).text) if line != "[DONE]"]
        assert_envelope(streamed[-1], "engine_error")
        good = http.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 8})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 8, good.text
        assert outcome_count(url, "completions", "error") == 2
        assert outcome_count(url, "completions", "completed") == 1


def test_an_unexpected_failure_outside_a_round_is_a_500_with_a_code(make_engine, monkeypatch):
    """Failures no rule names still answer in OpenAI's envelope with a code a client can branch on: ``engine_error``
    where the engine refused a request unexpectedly (here: its tokenizer step raising), ``internal_error`` for any
    other route (here: /metrics failing to read the engine)."""
    engine = make_engine()

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    with live_server(create_app(ServerSettings(), engine)) as (url, _), httpx.Client(timeout=TIMEOUT) as http:
        monkeypatch.setattr(engine, "encode", broken)
        reply = http.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 4})
        assert reply.status_code == 500, reply.text
        assert_envelope(reply.json(), "engine_error")
        monkeypatch.setattr(engine, "snapshot", broken)
        page = http.get(f"{url}/metrics")
        assert page.status_code == 500, page.text
        assert_envelope(page.json(), "internal_error")
        assert page.json()["error"]["type"] == "server_error"

# -- shutdown ---------------------------------------------------------------------------------------------------

def test_sigterm_drains_every_request_finishes_or_gets_an_error(make_engine, monkeypatch):
    """Six requests in flight at SIGTERM: three that need about 0.4 s more finish within the 2 s drain, three that
    need 4 s get a 503 envelope (a stream: its last event) when it ends; one sent while draining gets 503 at once."""
    slow_rounds(monkeypatch, 0.02)
    engine = make_engine(max_batch_size=8)
    app = create_app(ServerSettings(drain_timeout=2.0), engine)
    short = {**LONG, "max_tokens": 20}
    bodies = [short, {**short, "stream": True}, short, LONG, {**LONG, "stream": True}, {**LONG, "stream": True}]

    with live_server(app, lambda config: DrainingServer(config, app.state.drain)) as (url, server):
        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                async def send(body):
                    reply = await http.post("/v1/completions", json=body)
                    return reply, time.monotonic()

                running = [asyncio.create_task(send(b)) for b in bodies]
                while engine.snapshot().running_sequences < len(bodies):
                    await asyncio.sleep(0.005)
                signalled = time.monotonic()
                server.handle_exit(signal.SIGTERM, None)
                while (await http.get("/health")).status_code != 503:
                    await asyncio.sleep(0.005)
                late = await http.post("/v1/completions", json=short)
                return signalled, late, await asyncio.gather(*running)

        signalled, late, results = asyncio.run(scenario())
        eventually(lambda: server.should_exit, "the server did not stop after draining")

    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert_envelope(late.json(), "shutting_down")
    for body, (reply, ended) in zip(bodies, results):
        assert reply.status_code in (200, 503), reply.text
        if body.get("stream"):
            events = sse_data(reply.text)
            finished = events[-1] == "[DONE]"
            if not finished:
                assert_envelope(json.loads(events[-1]), "shutting_down")
        else:
            finished = reply.status_code == 200
            if not finished:
                assert_envelope(reply.json(), "shutting_down")
        assert finished == (body["max_tokens"] == 20), (body, reply.text[-300:])
        assert ended > signalled  # it was still in flight when the signal came
    assert rows_freed(engine)


# -- soak -------------------------------------------------------------------------------------------------------

def load_soak_script():
    """benchmarks/soak_test.py, the script run against real servers: the test runs its client, checks included."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "soak_test.py"
    spec = importlib.util.spec_from_file_location("soak_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_soak_loses_no_request_and_leaves_no_row(make_engine, monkeypatch, caplog):
    """48 requests in phases of concurrency 1-8, a third of the clients leaving early, on the tiny model with 5 ms
    rounds (so that early leavers leave mid-decode). No statistics: any lost request or leftover row is a bug."""
    soak = load_soak_script()
    slow_rounds(monkeypatch, 0.005)
    engine = make_engine(max_batch_size=4, max_queue=64)
    with live_server(create_app(ServerSettings(), engine)) as (url, _):
        report = asyncio.run(soak.soak(url, num_requests=48, max_concurrency=8, disconnect_rate=0.33, min_tokens=4,
                                       max_tokens=24, seed=1, timeout=TIMEOUT, memory_from=24, idle_timeout=TIMEOUT))
    assert report["outcomes"]["lost"] == 0, report["lost"]
    assert report["passed"]["none_lost"] and report["passed"]["server_idle"], report
    # The schedule (seed 1) has leavers of both kinds and several concurrencies; most requests complete.
    assert report["outcomes"]["cancelled"] >= 5 and report["outcomes"]["completed"] >= 24, report["outcomes"]
    assert len(report["concurrency_used"]) >= 4
    assert report["server_requests"].get("cancelled", 0) >= 3  # some left while their request was still running
    assert rows_freed(engine)
    # A client that leaves must not make the server fail on its side either (it would not show in the client's
    # counts: nobody reads that answer).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
