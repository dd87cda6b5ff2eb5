"""Training answers from an OpenAI-compatible server (``train-draft --answers-from URL``).

Writing the answers is most of a data build's cost on a CPU (a decode per token, where featurising is one forward per
sequence), and a server (vLLM, SGLang, llama.cpp's server, ``jointspec serve``) may run the same model faster or on
another machine. Only the answers come from it: the features and the labels still come from the local target.

- **Faithful prompts.** Each request is a ``POST URL/completions`` whose ``prompt`` is the prompt's token ids (chat
  template already applied), so the server reads exactly what the local target would read; no chat endpoint
  re-renders it. Greedy (``temperature`` 0), ``max_tokens`` the answer's budget, one choice.
- **Answer ids.** Where the server returns the generated ids (vLLM does, asked with ``return_token_ids``, which other
  servers ignore), they are used. Otherwise the server's text is tokenised again: that gives the model's own ids
  where it generated the canonical tokenisation of its text, which it nearly always does (docs/training.md has the
  share measured through ``jointspec serve``). Either way the ids are cut after their first end-of-sequence token, and
  an answer that ended with ``finish_reason`` "stop" without one (servers leave the special end token out of the
  text) gets the template's end-of-turn token back, as local generation keeps it.
- **Resumable.** Each answer is appended to ``server-answers.jsonl`` in the data folder as it arrives (one line,
  flushed and synced), keyed by a hash of the prompt ids and the budget; a rerun requests only what is missing. A
  line cut off by an interruption is dropped when the file is next opened.
- **Same model.** Before fetching, :func:`check_same_model` asks for short greedy answers to the build's first few
  prompts (the same ones when a build resumes) and has the local target read them: where the local target's own
  greedy choice differs from the server's token at more than :data:`CHECK_MAX_MISMATCH_SHARE` of the positions, the
  server runs another model (or tokenizer) and is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from jointspec.backends.hf import CausalLM
from jointspec.bench.prompts import chat_prompt_ids
from jointspec.core.errors import JointspecError
from jointspec.core.files import cannot_write
from jointspec.train.sources import given_answer_ids

log = logging.getLogger(__name__)

ANSWERS_FILE = "server-answers.jsonl"
# The same-model check: this many prompts, this many answer tokens each. A disagreement is a near-tie that another
# kernel or precision flips (an int4 server read by a float32 target), and teacher forcing confines one to its own
# position, so the same model's two builds disagree at a few positions in a hundred (docs/training.md has the rate
# measured), while another tokenizer disagrees almost everywhere (a sibling model on the same tokenizer that agrees
# at 85 % or more would pass: docs/training.md). A fixed count of one in 48 refused a correct int4 server on about
# half of all prompt sets; a share with room above quantisation's rate does not.
CHECK_PROMPTS = 4
CHECK_TOKENS = 32
CHECK_MAX_MISMATCH_SHARE = 0.15


def allowed_mismatches(num_tokens: int) -> int:
    """How many of ``num_tokens`` checked positions may differ: :data:`CHECK_MAX_MISMATCH_SHARE` of them, and one
    however few tokens the answers had (a short answer can end in a flipped near-tie too)."""
    return max(1, int(CHECK_MAX_MISMATCH_SHARE * num_tokens))
REQUEST_TIMEOUT = 600.0  # seconds a request may take: a long answer on a busy CPU server takes minutes
RETRIES = 6  # a 429 (queue full) or 503 (draining) is retried this often, after Retry-After or a doubling backoff
URL_EXAMPLE = "http://127.0.0.1:8000/v1"


class AnswerServerError(JointspecError):
    """The answer server could not be reached, refused a request, or is not the target's model."""


@dataclass(frozen=True)
class AnswerServer:
    """Where the answers come from: ``url`` is the API's base (``.../v1``), as OpenAI clients take it."""

    url: str
    concurrency: int = 8  # requests in flight at once
    model: str | None = None  # the request's ``model`` field; None: the first model ``URL/models`` lists
    check: bool = True  # the same-model check (check_same_model)
    timeout: float = REQUEST_TIMEOUT
    api_key: str | None = field(default=None, repr=False)  # sent as "Authorization: Bearer KEY" where set

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise AnswerServerError(f"'{self.url}' is not an http:// or https:// URL; give the server's API base, "
                                    f"e.g. {URL_EXAMPLE}")
        if self.concurrency < 1:
            raise AnswerServerError(f"the answers' concurrency must be >= 1, got {self.concurrency}")
        object.__setattr__(self, "url", self.url.rstrip("/"))


@dataclass(frozen=True)
class ServerAnswer:
    """What the server returned for one prompt, as it returned it."""

    text: str
    finish_reason: str  # "stop" (an end token) or "length" (the budget)
    token_ids: tuple[int, ...] | None = None  # the generated ids, where the server returns them (vLLM)


# -- HTTP ---------------------------------------------------------------------------------------------------------

def _request(server: AnswerServer, path: str, body: dict | None = None) -> dict:
    """``GET`` (no body) or ``POST`` ``server.url + path``; the JSON reply, or an AnswerServerError that names the
    URL and what to do. 429 and 503 are retried: the server is busy, not wrong."""
    url = server.url + path
    data = None if body is None else json.dumps(body).encode()
    for attempt in range(RETRIES + 1):
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if server.api_key is not None:
            headers["Authorization"] = f"Bearer {server.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers)
        try:
            with _OPENER.open(request, timeout=server.timeout) as response:
                raw = response.read()
            break
        except urllib.error.HTTPError as error:
            if error.code in (429, 503) and attempt < RETRIES:
                time.sleep(_retry_after(error, attempt))
                continue
            raise AnswerServerError(_http_error(error, url)) from None
        except urllib.error.URLError as error:
            raise AnswerServerError(_unreachable(url, error.reason)) from None
        except TimeoutError:
            raise AnswerServerError(f"{url} sent no answer within {server.timeout:g} s; is the server overloaded "
                                    "(lower --answers-concurrency) or stuck?") from None
        except OSError as error:  # the connection broke mid-answer (a server that died or restarted)
            raise AnswerServerError(_unreachable(url, error)) from None
    try:
        reply = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AnswerServerError(f"{url} did not answer with JSON ({raw[:80]!r}): it is not an OpenAI-compatible API; "
                                f"give --answers-from the API's base URL, e.g. {URL_EXAMPLE}") from None
    if not isinstance(reply, dict):
        raise AnswerServerError(f"{url} answered {str(reply)[:80]}, not a JSON object: it is not an "
                                "OpenAI-compatible API")
    return reply


class _KeyStaysHome(urllib.request.HTTPRedirectHandler):
    """Follows redirects as urllib does, but a redirect to another origin (scheme, host or port) loses the request's
    API key: urllib would send it wherever the server pointed."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.netloc.lower()


_OPENER = urllib.request.build_opener(_KeyStaysHome)


def _retry_after(error: urllib.error.HTTPError, attempt: int) -> float:
    try:
        return min(float(error.headers.get("Retry-After", "")), 30.0)
    except ValueError:
        return min(0.5 * 2 ** attempt, 30.0)


def _http_error(error: urllib.error.HTTPError, url: str) -> str:
    try:
        message = json.loads(error.read())["error"]["message"]  # OpenAI's error envelope
    except Exception:  # any other body: its status says enough
        message = error.reason
    hint = {404: f"is --answers-from the API's base URL, ending in /v1 (e.g. {URL_EXAMPLE})?",
            400: "the server refused the request: it must take token ids as a completions prompt (vLLM, SGLang, "
                 "llama.cpp's server and jointspec serve do), and the prompts must fit its context",
            401: "the server wants an API key (another one, where JOINTSPEC_API_KEY was set): set JOINTSPEC_API_KEY "
                 "to the key it was started with (a redirect to another origin, http to https included, does not "
                 "carry the key: give --answers-from the URL it points to)",
            429: "the server stayed full: lower --answers-concurrency or raise the server's queue",
            503: "the server is shutting down or not ready: start it again and rerun (fetched answers are kept)"}
    if 300 <= error.code < 400:  # a redirect urllib did not follow (a POST's 307 or 308)
        return (f"{url} answered HTTP {error.code}, a redirect to {error.headers.get('Location', 'nowhere said')}; "
                "give --answers-from the URL it points to")
    return f"{url} answered HTTP {error.code} ({message}); " + hint.get(error.code, "see the server's log")


def _unreachable(url: str, reason) -> str:
    return (f"cannot reach the answer server at {url} ({reason}); start it first (e.g. `jointspec serve --port 8000 "
            "&`) or correct --answers-from (answers fetched so far are kept)")


def served_model(server: AnswerServer) -> str:
    """The model name to send: ``server.model``, else the first of ``URL/models`` (vLLM refuses other names)."""
    reply = _request(server, "/models")
    models = reply.get("data")
    if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in models):
        raise AnswerServerError(f"{server.url}/models answered {str(reply)[:120]}, not OpenAI's model list: is "
                                f"--answers-from an OpenAI-compatible API's base URL (e.g. {URL_EXAMPLE})?")
    if server.model is not None:
        return server.model
    if not models:
        raise AnswerServerError(f"{server.url}/models lists no model; name one with --answers-model")
    return models[0]["id"]


def complete(server: AnswerServer, model: str, prompt_ids: list[int], max_tokens: int) -> ServerAnswer:
    """The server's greedy answer to ``prompt_ids`` (token ids, so the prompt is read exactly as given)."""
    # return_token_ids: vLLM then adds the generated ids to the choice; servers without it ignore the field.
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0, "n": 1,
            "stream": False, "return_token_ids": True}
    reply = _request(server, "/completions", body)
    try:
        choice = reply["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    except (KeyError, IndexError, TypeError):
        raise AnswerServerError(f"{server.url}/completions answered {str(reply)[:120]}, not an OpenAI completion "
                                "(choices[0].text): is it an OpenAI-compatible API?") from None
    if not isinstance(text, str) or finish not in ("stop", "length"):
        raise AnswerServerError(f"{server.url}/completions ended an answer with finish_reason {finish!r}; only "
                                "'stop' and 'length' are complete answers (see the server's log)")
    ids = choice.get("token_ids")
    ids = tuple(ids) if isinstance(ids, list) and all(type(t) is int for t in ids) else None
    return ServerAnswer(text, finish, ids)


# -- answer ids ---------------------------------------------------------------------------------------------------

def end_of_answer_id(tokenizer, eos: frozenset[int]) -> int | None:
    """The token that ends an answer: the end-of-turn token the chat template writes after an assistant message
    where it is an EOS token, else the tokenizer's EOS, else the smallest EOS id (None without any)."""
    if not eos:
        return None
    if getattr(tokenizer, "chat_template", None):
        prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])
        rendered = given_answer_ids(tokenizer, "Hi", prompt, "Hello", eos)
        if rendered and rendered[-1] in eos:
            return rendered[-1]
    return tokenizer.eos_token_id if tokenizer.eos_token_id in eos else min(eos)


def answer_token_ids(tokenizer, answer: ServerAnswer, eos: frozenset[int], end_id: int | None) -> list[int]:
    """The ids of ``answer`` (the server's own, else its text's), ending as local generation ends: after their
    first EOS token, which a "stop" answer gets back where the server left it out."""
    if answer.token_ids is not None:
        ids = list(answer.token_ids)
    else:
        ids = list(tokenizer(answer.text, add_special_tokens=False)["input_ids"])
    ends = [i for i, token in enumerate(ids) if token in eos]
    if ends:
        return ids[:ends[0] + 1]
    if answer.finish_reason == "stop" and end_id is not None:
        ids.append(end_id)
    return ids


def answer_key(prompt_ids: list[int], max_tokens: int) -> str:
    return hashlib.sha256(json.dumps([list(prompt_ids), max_tokens]).encode()).hexdigest()


def complete_lines(path: Path) -> list[str]:
    """The whole lines of an append-only file (one record a line, appended as each is made). A last line cut off
    mid-write by an interrupted run is dropped, from the file too: the next append would join it."""
    raw = path.read_bytes()
    complete = raw[:raw.rfind(b"\n") + 1]
    if len(complete) < len(raw):
        log.warning("%s: dropping an unfinished last line (an interrupted run)", path)
        with path.open("r+b") as sink:
            sink.truncate(len(complete))
    return complete.decode().splitlines()


class AnswerCache:
    """``server-answers.jsonl``: one answer a line, appended as it arrives, so an interrupted run keeps them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answers: dict[str, ServerAnswer] = {}
        if not path.is_file():
            return
        for number, line in enumerate(complete_lines(path), start=1):
            try:
                record = json.loads(line)
                ids = record.get("token_ids")
                self.answers[record["key"]] = ServerAnswer(record["text"], record["finish_reason"],
                                                           None if ids is None else tuple(ids))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise AnswerServerError(f"{path}:{number} is not an answer line; delete the file to fetch every "
                                        "answer again") from None

    def add(self, key: str, answer: ServerAnswer, model: str) -> None:
        line = json.dumps({"key": key, "text": answer.text, "finish_reason": answer.finish_reason, "model": model,
                           "token_ids": None if answer.token_ids is None else list(answer.token_ids)})
        try:
            with self.path.open("a", encoding="utf-8") as sink:
                sink.write(line + "\n")
                sink.flush()
                os.fsync(sink.fileno())  # an answer costs seconds of a server's time; a sync costs milliseconds
        except OSError as error:  # a full disk: a line cut short is dropped when the run goes on
            raise cannot_write("the server's answers", self.path, error, "the answers before this one are kept: "
                               "free some room and run the same command again to go on from them") from error
        self.answers[key] = answer


# -- fetching -----------------------------------------------------------------------------------------------------

def _fetch(server: AnswerServer, model: str, jobs: list[tuple[str, list[int], int]], on_answer) -> None:
    """Requests ``jobs`` (key, prompt ids, max tokens) ``server.concurrency`` at a time, calling ``on_answer(key,
    answer)`` on this thread as each arrives. On the first failure (or Ctrl-C) the requests not yet sent are dropped,
    those in flight are waited for and their answers kept, and the failure is raised."""
    pool = ThreadPoolExecutor(server.concurrency, thread_name_prefix="answers")
    futures: dict[Future, str] = {pool.submit(complete, server, model, ids, budget): key for key, ids, budget in jobs}
    handed: set[str] = set()
    try:
        for future in as_completed(futures):
            key = futures[future]
            on_answer(key, future.result())
            handed.add(key)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        for future, key in futures.items():
            if key not in handed and future.done() and not future.cancelled() and future.exception() is None:
                on_answer(key, future.result())
        raise
    pool.shutdown()


@dataclass(frozen=True)
class CheckResult:
    """What :func:`check_same_model` compared: answer tokens, and where the local target chose otherwise
    (prompt index, answer position, server's token, local target's token)."""

    num_tokens: int
    mismatches: tuple[tuple[int, int, int, int], ...]


@torch.inference_mode()
def teacher_forced_mismatches(target: CausalLM, prompt_ids: list[int], answer_ids: list[int],
                              eos: frozenset[int]) -> list[tuple[int, int, int]]:
    """Positions of ``answer_ids`` where the target's greedy choice after ``prompt_ids + answer_ids[:i]`` is not
    ``answer_ids[i]`` (any EOS token matches any other): (i, answer token, target's token)."""
    if not answer_ids:
        return []
    ids = torch.tensor([list(prompt_ids) + list(answer_ids)], device=target.device)
    logits = target.model(input_ids=ids, logits_to_keep=len(answer_ids) + 1, use_cache=False).logits
    choices = logits[0, :-1].argmax(-1).tolist()
    return [(i, token, choice) for i, (token, choice) in enumerate(zip(answer_ids, choices))
            if token != choice and not (token in eos and choice in eos)]


def check_same_model(server: AnswerServer, model: str, target: CausalLM, tokenizer, prompts: list[list[int]],
                     budgets: list[int], eos: frozenset[int]) -> CheckResult:
    """Refuses a server whose greedy answers are not the local target's: short answers to the first
    :data:`CHECK_PROMPTS` prompts, read by the local target (teacher forcing, one forward each); more positions
    where its greedy choice differs than :func:`allowed_mismatches` lets through raise AnswerServerError."""
    jobs = [(str(i), prompt, min(CHECK_TOKENS, budget))
            for i, (prompt, budget) in enumerate(zip(prompts[:CHECK_PROMPTS], budgets))]
    answers: dict[str, ServerAnswer] = {}
    _fetch(server, model, jobs, answers.__setitem__)
    end_id = end_of_answer_id(tokenizer, eos)
    num_tokens, mismatches = 0, []
    for key, prompt, budget in jobs:
        ids = answer_token_ids(tokenizer, answers[key], eos, end_id)[:budget]
        num_tokens += len(ids)
        mismatches += [(int(key), *found) for found in teacher_forced_mismatches(target, prompt, ids, eos)]
    result = CheckResult(num_tokens, tuple(mismatches))
    if len(mismatches) > (allowed := allowed_mismatches(num_tokens)):
        index, position, theirs, ours = mismatches[0]
        raise AnswerServerError(
            f"the answer server at {server.url} (model '{model}') does not answer like the local target: reading "
            f"its greedy answers to {len(jobs)} prompts ({num_tokens} tokens), the target chose another token at "
            f"{len(mismatches)} positions (at most {allowed} may differ; the first: prompt {index}, "
            f"token {position}, server {_shown(tokenizer, theirs)}, target {_shown(tokenizer, ours)}). Serve the "
            "model given as --target, or pass --no-answers-check to use this server's answers anyway")
    log.info("same-model check passed: %d of %d answer tokens as the local target chose", num_tokens - len(mismatches),
             num_tokens)
    return result


def _shown(tokenizer, token: int) -> str:
    return f"{tokenizer.convert_ids_to_tokens(token)!r} (id {token})"


class ServerAnswers:
    """The server's answers to ``prompts`` (each with its token budget) for a data folder: :meth:`prepare` reads what
    is cached and, if anything is left to fetch, checks the server; :meth:`fetch` fetches the rest and returns every
    prompt's answer ids. Two steps, so that a new data folder is only begun with a server that passed the check."""

    def __init__(self, server: AnswerServer, target: CausalLM, tokenizer, folder: Path, prompts: list[list[int]],
                 budgets: list[int], eos: frozenset[int], progress: bool = True) -> None:
        if tokenizer is None:
            raise AnswerServerError("answers from a server need the target's tokenizer (the server answers text)")
        self.server, self.target, self.tokenizer, self.eos = server, target, tokenizer, eos
        self.prompts, self.budgets, self.progress = prompts, budgets, progress
        self.keys = [answer_key(p, b) for p, b in zip(prompts, budgets)]
        self.cache = AnswerCache(folder / ANSWERS_FILE)
        self.model: str | None = None

    def _firsts(self, wanted) -> list[int]:
        """The index of each distinct key's first prompt, in order, for the keys ``wanted`` takes."""
        firsts: dict[str, int] = {}
        for index, key in enumerate(self.keys):
            if wanted(key):
                firsts.setdefault(key, index)
        return list(firsts.values())

    def todo(self) -> list[int]:
        """Indices of the prompts whose answers are still to fetch, one per distinct key."""
        return self._firsts(lambda key: key not in self.cache.answers)

    def prepare(self) -> None:
        todo = self.todo()
        if not todo:
            return  # everything is cached: no server needed
        self.model = served_model(self.server)
        if self.server.check:
            # The first prompts of the whole build, cached or not: a resumed build asks the same questions as the run
            # it resumes, so a server that passed the check once passes it again.
            firsts = self._firsts(lambda key: True)
            check_same_model(self.server, self.model, self.target, self.tokenizer,
                             [self.prompts[i] for i in firsts], [self.budgets[i] for i in firsts], self.eos)
        else:
            log.warning("--no-answers-check: using %s's answers without checking that it runs the target",
                        self.server.url)

    def fetch(self) -> list[list[int]]:
        todo = self.todo()
        if todo:
            if self.model is None:
                raise RuntimeError("ServerAnswers.fetch before prepare")
            started = time.perf_counter()
            total = len(set(self.keys))
            with tqdm(total=total, initial=total - len(todo), desc="answers from server", unit="answer",
                      disable=not self.progress) as bar:
                def keep(key: str, answer: ServerAnswer) -> None:
                    self.cache.add(key, answer, self.model)
                    bar.update()

                _fetch(self.server, self.model, [(self.keys[i], self.prompts[i], self.budgets[i]) for i in todo], keep)
            log.info("fetched %d answers from %s in %.1f s", len(todo), self.server.url,
                     time.perf_counter() - started)
        end_id = end_of_answer_id(self.tokenizer, self.eos)
        return [answer_token_ids(self.tokenizer, self.cache.answers[key], self.eos, end_id)[:budget]
                for key, budget in zip(self.keys, self.budgets)]
