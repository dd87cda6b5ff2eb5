"""`train-draft --answers-from URL`: the answers come from an OpenAI-compatible server, here a live `jointspec serve`
app on 127.0.0.1 (uvicorn in a thread, as tests/test_server.py runs it) over the tiny target.

The tokenizer is a word-level one over the tiny models' 99 ids (``w0 w1 ...``, id 16 the special ``</s>``) in which
any answer round-trips through text: the server answers text, so only such a tokenizer lets the server's answers and
local generation be compared token for token. The tiny target's greedy answers to these prompts end at ``</s>``
after 2 to 20 tokens or run to the 40-token budget, so both endings are covered.

Deterministic on one thread (which requests arrive first at the server varies, and no assertion depends on it): no
false-failure odds. Every network call goes to 127.0.0.1; each test takes one to three seconds.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from jointspec.backends.hf import CausalLM
from jointspec.backends.tokens import eos_token_ids
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine
from jointspec.train import server_answers
from jointspec.train.data import build_data, load_shards, read_spec
from jointspec.train.server_answers import (
    ANSWERS_FILE,
    CHECK_MAX_MISMATCH_SHARE,
    CHECK_PROMPTS,
    CHECK_TOKENS,
    AnswerCache,
    AnswerServer,
    AnswerServerError,
    ServerAnswer,
    allowed_mismatches,
    answer_token_ids,
    check_same_model,
    complete,
    served_model,
    teacher_forced_mismatches,
)

from helpers import assert_clean_error, live_server, random_prompt, run_cli, train_cli_argv

EOS_WORD_ID = 16  # frequent in the tiny target's continuations, so many answers end early
MAX_NEW_TOKENS = 40
PROMPTS = [random_prompt(100 + i, length=8) for i in range(12)]


def round_trip_tokenizer() -> PreTrainedTokenizerFast:
    """``w0 .. w98`` as words split on whitespace, id 16 the special ``</s>``: decoding an answer and encoding the
    text gives its ids back (``</s>`` ends an answer and is left out of the text, as servers leave it out)."""
    vocab = {f"w{i}": i for i in range(99) if i != EOS_WORD_ID} | {"</s>": EOS_WORD_ID}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


@pytest.fixture(scope="module")
def words():
    return round_trip_tokenizer()


@pytest.fixture()
def eos(target, words):
    return eos_token_ids(target, words)  # {16} from the tokenizer, {2} from the model's generation config


class CountingEngine:
    """A served engine that records the prompts of the answers it is asked for (``checked``: the same-model check's
    short ones) and, past ``fail_after`` of them, fails every further request (the route answers 500): a server that
    breaks mid-run."""

    def __init__(self, engine: ServingEngine, fail_after: int | None = None) -> None:
        self.engine, self.fail_after = engine, fail_after
        self.model_id, self.call_format, self.call_markers = engine.model_id, engine.call_format, engine.call_markers
        self.answered: list[tuple[int, ...]] = []
        self.checked: list[tuple[int, ...]] = []
        self.refused = 0

    async def submit(self, request):
        if request.max_tokens == CHECK_TOKENS:
            self.checked.append(tuple(request.prompt))
        else:
            if self.fail_after is not None and len(self.answered) >= self.fail_after:
                self.refused += 1
                raise RuntimeError("simulated failure")
            self.answered.append(tuple(request.prompt))
        return await self.engine.submit(request)

    def snapshot(self):
        return self.engine.snapshot()

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def serving(model, tokenizer, fail_after: int | None = None, api_key: str | None = None):
    """``jointspec serve``'s app over ``model`` on a free local port; yields (API base URL, CountingEngine)."""
    engine = CountingEngine(ServingEngine(CausalLM(model), tokenizer, model_id="tiny", max_batch_size=4), fail_after)
    try:
        with live_server(create_app(ServerSettings(api_key=api_key), engine)) as (url, _):
            yield f"{url}/v1", engine
    finally:
        engine.close()


def build(target, words, eos, folder, **options):
    return build_data(target, words, PROMPTS, folder, max_new_tokens=MAX_NEW_TOKENS, max_length=128, shard_size=5,
                      batch_size=4, eos_token_ids=eos, progress=False, **options)


def assert_same_shards(folder_a, folder_b) -> None:
    shards_a, shards_b = list(load_shards(folder_a)), list(load_shards(folder_b))
    assert len(shards_a) == len(shards_b) == 3
    for shard_a, shard_b in zip(shards_a, shards_b):
        assert shard_a.keys() == shard_b.keys()
        for name in shard_a:
            assert torch.equal(shard_a[name], shard_b[name]), name


def answers_in(folder) -> list[list[int]]:
    answers = []
    for shard in load_shards(folder):
        starts, offsets, tokens = shard["starts"].tolist(), shard["answer_starts"].tolist(), shard["token_ids"]
        answers += [tokens[starts[s] + offset:starts[s + 1]].tolist() for s, offset in enumerate(offsets)]
    return answers


# -- the data folder ----------------------------------------------------------------------------------------------

def test_server_answers_build_the_same_folder_as_local_generation(target_model, target, words, eos, tmp_path):
    """Same token ids, same features, shard for shard; only data.json says who wrote the answers."""
    build(target, words, eos, tmp_path / "local")
    with serving(target_model, words) as (url, engine):
        build(target, words, eos, tmp_path / "served", answers_from=AnswerServer(url, concurrency=4))
    assert_same_shards(tmp_path / "local", tmp_path / "served")
    answers = answers_in(tmp_path / "local")
    assert any(a[-1] == EOS_WORD_ID for a in answers) and any(len(a) == MAX_NEW_TOKENS for a in answers)
    assert sorted(engine.answered) == sorted(tuple(p) for p in PROMPTS)  # each fetched once
    local, served = read_spec(tmp_path / "local"), read_spec(tmp_path / "served")
    assert served.pop("answers_by") == "server" and served == local
    lines = (tmp_path / "served" / ANSWERS_FILE).read_text().splitlines()
    assert len(lines) == len(PROMPTS) and all(json.loads(line)["model"] == "tiny" for line in lines)


def test_an_interrupted_fetch_resumes_without_refetching(target_model, target, words, eos, tmp_path):
    """The server fails after 5 answers: those 5 are kept (and no shard is written), and the rerun asks the server
    for exactly the 7 others, after the same same-model check as the first run (the build's first prompts)."""
    folder = tmp_path / "served"
    with serving(target_model, words, fail_after=5) as (url, first):
        with pytest.raises(AnswerServerError, match=rf"{url}/completions answered HTTP 500"):
            build(target, words, eos, folder, answers_from=AnswerServer(url, concurrency=4))
    assert len(first.answered) == 5 and first.refused >= 1
    assert len((folder / ANSWERS_FILE).read_text().splitlines()) == 5
    assert not list(folder.glob("shard-*")) and (folder / "data.json").is_file()
    with serving(target_model, words) as (url, second):
        build(target, words, eos, folder, answers_from=AnswerServer(url, concurrency=4))
    assert sorted(first.answered + second.answered) == sorted(tuple(p) for p in PROMPTS)
    assert sorted(first.checked) == sorted(second.checked) == sorted(tuple(p) for p in PROMPTS[:CHECK_PROMPTS])
    build(target, words, eos, tmp_path / "local")
    assert_same_shards(tmp_path / "local", folder)


def test_a_server_running_another_model_is_refused(other_model, target, words, eos, tmp_path):
    """The same-model check refuses before any answer is fetched or the folder begun; --no-answers-check (check=False)
    takes the other model's answers."""
    folder = tmp_path / "served"
    with serving(other_model, words) as (url, engine):
        with pytest.raises(AnswerServerError) as refused:
            build(target, words, eos, folder, answers_from=AnswerServer(url))
        assert not engine.answered
        assert not (folder / "data.json").exists() and not (folder / ANSWERS_FILE).exists()
        build(target, words, eos, folder, answers_from=AnswerServer(url, check=False))
    message = str(refused.value)
    assert f"the answer server at {url} (model 'tiny') does not answer like the local target" in message
    assert re.search(r"at \d+ positions \(at most \d+ may differ", message) and "--no-answers-check" in message
    build(target, words, eos, tmp_path / "local")
    assert answers_in(folder) != answers_in(tmp_path / "local")


def flipped_answer(target, prompt: list[int], length: int, flips: set[int]) -> list[int]:
    """The target's greedy answer to ``prompt``, except that at the positions in ``flips`` it takes its second
    choice: a server running another build of the same model, whose near-ties fell the other way there."""
    ids = list(prompt)
    with torch.inference_mode():
        for position in range(length):
            logits = target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(logits.topk(2).indices[1 if position in flips else 0].item())
    return ids[len(prompt):]


def test_the_same_model_check_allows_a_share_of_flipped_near_ties(target, words, monkeypatch):
    """A server whose answers differ from the target's own at CHECK_MAX_MISMATCH_SHARE of the checked positions
    passes (an int4 build read by a float32 target differs at a few in a hundred); one more refuses, naming the
    count. No EOS set, so every answer runs its whole budget. Deterministic: no false-failure odds."""
    prompts = PROMPTS[:CHECK_PROMPTS]
    num_tokens = CHECK_PROMPTS * CHECK_TOKENS
    allowed = allowed_mismatches(num_tokens)
    assert allowed == int(CHECK_MAX_MISMATCH_SHARE * num_tokens) > 1
    for flipped, passes in ((allowed, True), (allowed + 1, False)):
        # The flips spread over the prompts, none at an answer's first position (any position would do).
        spots = [(i % CHECK_PROMPTS, 1 + i // CHECK_PROMPTS) for i in range(flipped)]
        answers = {str(p): flipped_answer(target, prompt, CHECK_TOKENS, {t for q, t in spots if q == p})
                   for p, prompt in enumerate(prompts)}
        found = sum(len(teacher_forced_mismatches(target, prompt, answers[str(p)], frozenset()))
                    for p, prompt in enumerate(prompts))
        assert found == flipped  # the construction's own premise: exactly the flips differ

        def fetch(server, model, jobs, on_answer, answers=answers):
            for key, _, budget in jobs:
                on_answer(key, ServerAnswer("", "length", tuple(answers[key][:budget])))

        monkeypatch.setattr(server_answers, "_fetch", fetch)
        server = AnswerServer("http://127.0.0.1:9/v1")
        if passes:
            result = check_same_model(server, "tiny", target, words, prompts, [MAX_NEW_TOKENS] * len(prompts),
                                      frozenset())
            assert (result.num_tokens, len(result.mismatches)) == (num_tokens, flipped)
        else:
            with pytest.raises(AnswerServerError, match=f"at {flipped} positions \\(at most {allowed} may differ"):
                check_same_model(server, "tiny", target, words, prompts, [MAX_NEW_TOKENS] * len(prompts),
                                 frozenset())


def test_a_few_checked_tokens_still_allow_one_difference():
    assert [allowed_mismatches(n) for n in (0, 3, 6, 7, 13, 14, 128)] == [1, 1, 1, 1, 1, 2, 19]


def test_answer_ids_end_as_local_generation_ends(words, eos):
    """A "stop" answer gets its end token back; an EOS id the text spells out ends the answer there; a "length"
    answer is kept as it is."""
    assert answer_token_ids(words, ServerAnswer("w5 w7", "stop"), eos, EOS_WORD_ID) == [5, 7, EOS_WORD_ID]
    assert answer_token_ids(words, ServerAnswer("w5 w2 w7", "length"), eos, EOS_WORD_ID) == [5, 2]
    assert answer_token_ids(words, ServerAnswer("w5 w7", "length"), eos, EOS_WORD_ID) == [5, 7]
    assert answer_token_ids(words, ServerAnswer("", "stop"), eos, EOS_WORD_ID) == [EOS_WORD_ID]


def test_the_answers_file_drops_a_line_cut_off_mid_write(tmp_path):
    path = tmp_path / ANSWERS_FILE
    whole = json.dumps({"key": "a", "text": "w5", "finish_reason": "stop", "model": "m"})
    path.write_text(whole + '\n{"key": "b", "te')
    cache = AnswerCache(path)
    assert cache.answers == {"a": ServerAnswer("w5", "stop")}
    cache.add("b", ServerAnswer("w6 w7", "length"), "m")
    assert AnswerCache(path).answers == {"a": ServerAnswer("w5", "stop"), "b": ServerAnswer("w6 w7", "length")}


# -- other servers' replies, from a scripted stand-in ----------------------------------------------------------

@contextlib.contextmanager
def scripted_server(*replies: tuple[int, dict]):
    """An app on a free local port that lists one model, "fake", and answers its completions requests with
    ``replies`` (status, JSON body) in turn; yields (API base URL, the request bodies it received)."""
    app, bodies, queue = FastAPI(), [], list(replies)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        bodies.append(await request.json())
        status, body = queue.pop(0)
        return JSONResponse(body, status_code=status, headers={"Retry-After": "0"} if status == 429 else None)

    with live_server(app) as (url, _):
        yield f"{url}/v1", bodies


def completion(text: str, finish: str = "stop", **extra) -> tuple[int, dict]:
    return 200, {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                                           **extra}]}


def test_ids_the_server_returns_are_used_and_a_busy_server_is_retried(words, eos):
    """vLLM's reply shape (return_token_ids): its ids win over a tokenisation of its text; a 429 is retried after
    its Retry-After. The request carries the prompt as token ids, greedy, with the budget and the listed model."""
    busy = 429, {"error": {"message": "queue full", "type": "server_overloaded"}}
    with scripted_server(busy, completion("w5 w7", token_ids=[5, 9, 16])) as (url, bodies):
        server = AnswerServer(url)
        answer = complete(server, served_model(server), [4, 8, 15], 12)
    assert answer == ServerAnswer("w5 w7", "stop", (5, 9, 16))
    assert answer_token_ids(words, answer, eos, EOS_WORD_ID) == [5, 9, 16]
    assert len(bodies) == 2 and bodies[1] == bodies[0]
    assert {key: bodies[0][key] for key in ("model", "prompt", "max_tokens", "temperature")} == {
        "model": "fake", "prompt": [4, 8, 15], "max_tokens": 12, "temperature": 0.0}


@pytest.mark.parametrize("reply, message", [
    ((400, {"error": {"message": "prompt is too long", "type": "invalid_request_error"}}),
     "answered HTTP 400 (prompt is too long); the server refused the request: it must take token ids"),
    ((500, {"detail": "boom"}), "answered HTTP 500 (Internal Server Error); see the server's log"),
    ((200, {"result": "w5"}), "not an OpenAI completion (choices[0].text)"),
    (completion("w5", finish="content_filter"), "finish_reason 'content_filter'"),
])
def test_replies_that_are_not_an_answer_are_named(reply, message):
    with scripted_server(reply) as (url, _):
        with pytest.raises(AnswerServerError) as refused:
            complete(AnswerServer(url), "fake", [4, 8], 4)
    assert f"{url}/completions" in str(refused.value) and message in str(refused.value)


# -- the command line ---------------------------------------------------------------------------------------------

def cli_argv(monkeypatch, target_model, words, tmp_path) -> list[str]:
    """``train-draft --data-only`` on the tiny target with the round-trip tokenizer and :data:`PROMPTS` as text."""
    from jointspec.cli import train as train_cli

    argv = train_cli_argv(monkeypatch, target_model, tmp_path, "unused")
    monkeypatch.setattr(train_cli, "load_target", lambda *args, **kwargs: (CausalLM(target_model), words))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(words.decode(prompt) for prompt in PROMPTS))
    argv[argv.index("--prompts") + 1] = str(prompts)
    return argv + ["--data-only", "--max-new-tokens", str(MAX_NEW_TOKENS)]


def test_cli_builds_from_a_server_what_it_builds_locally(target_model, words, tmp_path, monkeypatch, capsys):
    argv = cli_argv(monkeypatch, target_model, words, tmp_path)
    code, out, err = run_cli(capsys, *argv, "--data", str(tmp_path / "local"))
    assert code == 0, err
    with serving(target_model, words) as (url, engine):
        code, out, err = run_cli(capsys, *argv, "--data", str(tmp_path / "served"), "--answers-from", url,
                                 "--answers-concurrency", "3")
        assert code == 0, err
        assert json.loads(out.strip().splitlines()[-1])["data_spec"]["answers_by"] == "server"
        code, _, err = run_cli(capsys, *argv, "--data", str(tmp_path / "served"), "--answers-from", url)
        assert code == 0, err
    assert len(engine.answered) == len(PROMPTS)  # the rerun found the folder finished and asked for nothing
    for local, served in zip(load_shards(tmp_path / "local"), load_shards(tmp_path / "served")):
        assert torch.equal(local["token_ids"], served["token_ids"])
        assert torch.equal(local["features"], served["features"])


def test_cli_sends_the_api_key_a_server_asks_for(target_model, words, tmp_path, monkeypatch, capsys):
    """A server started with a key (jointspec serve --api-key, vLLM's --api-key): without JOINTSPEC_API_KEY the
    build stops at once, naming the variable, and writes nothing; with it, the answers come."""
    argv = cli_argv(monkeypatch, target_model, words, tmp_path)
    monkeypatch.delenv("JOINTSPEC_API_KEY", raising=False)
    with serving(target_model, words, api_key="k3y") as (url, engine):
        code, _, err = run_cli(capsys, *argv, "--data", str(tmp_path / "data"), "--answers-from", url)
        assert_clean_error(code, err, "answered HTTP 401", "set JOINTSPEC_API_KEY")
        assert not (tmp_path / "data" / "data.json").exists()
        monkeypatch.setenv("JOINTSPEC_API_KEY", "k3y")
        code, _, err = run_cli(capsys, *argv, "--data", str(tmp_path / "data"), "--answers-from", url)
        assert code == 0, err
    assert len(engine.answered) == len(PROMPTS)


def test_cli_names_an_unreachable_server_and_writes_nothing(target_model, words, tmp_path, monkeypatch, capsys):
    with socket.socket() as sock:  # a port nothing listens on once the socket is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    argv = cli_argv(monkeypatch, target_model, words, tmp_path)
    code, _, err = run_cli(capsys, *argv, "--data", str(tmp_path / "data"), "--answers-from", url)
    assert_clean_error(code, err, f"cannot reach the answer server at {url}/models", "jointspec serve")
    assert not (tmp_path / "data" / "data.json").exists()


def test_cli_names_a_url_that_is_not_the_api_base(target_model, words, tmp_path, monkeypatch, capsys):
    argv = cli_argv(monkeypatch, target_model, words, tmp_path)
    with serving(target_model, words) as (url, _):
        base = url.removesuffix("/v1")
        code, _, err = run_cli(capsys, *argv, "--data", str(tmp_path / "data"), "--answers-from", base)
    assert_clean_error(code, err, f"{base}/models answered HTTP 404", "ending in /v1")


@pytest.mark.parametrize("extra, message", [
    (["--answers-concurrency", "4"], "--answers-concurrency set how --answers-from fetches answers"),
    (["--no-answers-check"], "--no-answers-check set how --answers-from fetches answers"),
    (["--answers-from", "http://127.0.0.1:1/v1", "--answer-quantize", "int4"], "give one of the two"),
])
def test_cli_refuses_answer_options_that_do_not_go_together(extra, message, target_model, words, tmp_path,
                                                            monkeypatch, capsys):
    code, _, err = run_cli(capsys, *cli_argv(monkeypatch, target_model, words, tmp_path), *extra)
    assert_clean_error(code, err, message)


def test_cli_refuses_a_url_without_a_scheme(target_model, words, tmp_path, monkeypatch, capsys):
    code, _, err = run_cli(capsys, *cli_argv(monkeypatch, target_model, words, tmp_path),
                           "--answers-from", "localhost:8000/v1")
    assert code == 2 and "'localhost:8000/v1' is not an http:// or https:// URL" in err


def test_the_api_key_is_not_sent_where_a_redirect_points_elsewhere(monkeypatch):
    """urllib keeps a request's Authorization header on every redirect, to any host: a server that redirected
    --answers-from elsewhere would have been handed the key. A redirect within the same origin keeps it."""
    import http.server
    import threading

    from jointspec.train.server_answers import _request

    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.setdefault(self.server.name, []).append((self.path, self.headers.get("Authorization")))
            if self.path.startswith("/v1/elsewhere"):
                self.send_response(307)
                self.send_header("Location", f"http://127.0.0.1:{other.server_port}/v1/models")
            elif self.path.startswith("/v1/here"):
                self.send_response(307)
                self.send_header("Location", "/v1/models")
            else:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
            self.end_headers()
            if self.path == "/v1/models":
                self.wfile.write(b'{"data": []}')

        def log_message(self, *args):
            pass

    servers = []
    for name in ("home", "other"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.name = name
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    home, other = servers
    try:
        answers = AnswerServer(f"http://127.0.0.1:{home.server_port}/v1", api_key="k3y")
        assert _request(answers, "/elsewhere") == {"data": []}
        assert seen["other"] == [("/v1/models", None)]  # followed, without the key
        assert _request(answers, "/here") == {"data": []}
        assert seen["home"][-1] == ("/v1/models", "Bearer k3y")  # the same origin keeps it
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
