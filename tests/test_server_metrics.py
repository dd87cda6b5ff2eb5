"""What the server tells about itself: the ``usage.jointspec`` figures of each answer and the Prometheus page.

Models: the tiny random Llama with a 259-token vocabulary and the byte-level tokenizer of helpers.py. Requests are
greedy and run one at a time (TestClient), so every count below is exact: there is no timing in any assertion and
no false-failure odds beyond a bug. The figures are checked against a second source each time: the engine's own
per-sequence statistics (``SpecStats``, the top-level ``jointspec`` field) and the token counts of the answers.
"""

from __future__ import annotations

import re
import sys
import time

import pytest
from fastapi.testclient import TestClient

from jointspec.backends.hf import CausalLM
from jointspec.server.app import ServerSettings, create_app
from jointspec.server.engine import ServingEngine
from jointspec.server.metrics import ENDPOINTS, OUTCOMES

from helpers import SERVER_TIMEOUT

METHODS = {"ar": {"method": "ar"}, "pld": {"method": "pld", "num_draft_tokens": 3},
           "sps": {"method": "sps", "draft": "self", "num_draft_tokens": 4}}


@pytest.fixture()
def served(byte_model, tokenizer):
    """A fresh engine per test, so the metrics page starts from zero."""
    engine = ServingEngine(CausalLM(byte_model), tokenizer, model_id="tiny", max_batch_size=4, max_queue=5)
    yield engine, TestClient(create_app(ServerSettings(), engine))
    engine.close()


def sse_payloads(text: str) -> list[dict]:
    import json

    lines = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def eventually(condition, what: str) -> None:
    """The engine thread updates its gauges just after it hands a round's tokens over: wait for it."""
    deadline = time.monotonic() + SERVER_TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# -- the usage extension ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", sorted(METHODS))
def test_usage_reports_each_requests_speculation_figures(method, served):
    _, client = served
    # "abcabc..." repeats, so prompt lookup finds drafts; 20 tokens with no end-of-sequence token among them.
    body = {"prompt": "abcabcabcabc", "max_tokens": 20, "temperature": 0, "jointspec": METHODS[method]}
    whole = client.post("/v1/completions", json=body).json()
    figures, engine_stats = whole["usage"]["jointspec"], whole["jointspec"]
    assert figures["rounds"] == engine_stats["num_rounds"] >= 1
    assert figures["drafted_tokens"] == engine_stats["num_draft_tokens"]
    assert figures["accepted_tokens"] == engine_stats["num_accepted_tokens"]
    assert figures["mean_accepted_tokens"] == round(1 + figures["accepted_tokens"] / figures["rounds"], 4)
    assert whole["choices"][0]["finish_reason"] == "length"
    # Each round commits its accepted tokens plus the target's own one, and the budget keeps drafts within
    # max_tokens: the figures account for every token of the answer.
    assert whole["usage"]["completion_tokens"] == figures["rounds"] + figures["accepted_tokens"] == 20
    if method == "ar":
        assert figures["drafted_tokens"] == 0 and figures["mean_accepted_tokens"] == 1.0
    if method == "sps":  # the target drafting for itself: everything drafted is accepted
        assert figures["accepted_tokens"] == figures["drafted_tokens"] > 0 and figures["acceptance_rate"] == 1.0

    streamed = sse_payloads(client.post("/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == whole["usage"]  # the same greedy decode


# -- the Prometheus page ----------------------------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, dict]:
    """family -> {"type", "help", "samples": {(sample name, labels): value}}, checking the text format on the way:
    one HELP then one TYPE line per family before its samples, counters named ``_total``, histogram buckets
    cumulative up to ``+Inf`` and equal to ``_count`` there."""
    families: dict[str, dict] = {}
    current = None
    for line in text.rstrip("\n").split("\n"):
        if line.startswith("# HELP "):
            current, help_text = line[len("# HELP "):].split(" ", 1)
            assert current not in families, f"{current} declared twice"
            families[current] = {"help": help_text, "samples": {}}
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split(" ")
            assert name == current and "type" not in families[name], line
            assert kind in ("counter", "gauge", "histogram"), line
            assert kind != "counter" or name.endswith("_total"), f"counter {name} must end in _total"
            families[name]["type"] = kind
        else:
            match = SAMPLE.match(line)
            assert match and current is not None, f"not a sample line: {line!r}"
            name, raw_labels, value = match[1], match[2] or "", float(match[3])
            family = families[current]
            suffixes = ("_bucket", "_sum", "_count") if family["type"] == "histogram" else ("",)
            assert any(name == current + suffix for suffix in suffixes), f"{name} outside its family {current}"
            pairs = LABEL.findall(raw_labels)
            assert ",".join(f'{k}="{v}"' for k, v in pairs) == raw_labels, f"bad labels: {line!r}"
            family["samples"][(name, tuple(pairs))] = value
    for name, family in families.items():
        if family["type"] != "histogram":
            continue
        series: dict[tuple, list[tuple[float, float]]] = {}
        for (sample, labels), value in family["samples"].items():
            if sample.endswith("_bucket"):
                rest = tuple(pair for pair in labels if pair[0] != "le")
                series.setdefault(rest, []).append((float(dict(labels)["le"]), value))
        for rest, buckets in series.items():
            counts = [count for _, count in buckets]
            assert counts == sorted(counts) and buckets[-1][0] == float("inf"), (name, rest)
            assert buckets[-1][1] == family["samples"][(f"{name}_count", rest)], (name, rest)
    return families


def value(families: dict, sample: str, **labels: str) -> float:
    family = next(f for name, f in families.items() if sample.startswith(name))
    matches = [v for (s, pairs), v in family["samples"].items() if s == sample and dict(pairs) == labels]
    assert len(matches) == 1, (sample, labels, matches)
    return matches[0]


def test_metrics_page_is_prometheus_text_with_per_method_series(served):
    engine, client = served
    answers = {}
    for method in ("ar", "sps"):
        answers[method] = client.post("/v1/completions", json={
            "prompt": "abcabcabcabc", "max_tokens": 12, "temperature": 0, "jointspec": METHODS[method]}).json()
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    eventually(lambda: engine.snapshot().running_sequences == 0, "the engine kept a row")
    families = parse_metrics(client.get("/metrics").text)

    for endpoint in ENDPOINTS:  # every endpoint and outcome is there, zeros included
        for outcome in OUTCOMES:
            expected = {("completions", "completed"): 2, ("chat", "rejected"): 1}.get((endpoint, outcome), 0)
            assert value(families, "jointspec_requests_total", endpoint=endpoint, outcome=outcome) == expected
    total_rounds = 0
    for method, answer in answers.items():
        usage, figures = answer["usage"], answer["usage"]["jointspec"]
        assert value(families, "jointspec_rounds_total", method=method) == figures["rounds"]
        assert value(families, "jointspec_draft_tokens_total", method=method) == figures["drafted_tokens"]
        assert value(families, "jointspec_accepted_tokens_total", method=method) == figures["accepted_tokens"]
        assert value(families, "jointspec_forced_tokens_total", method=method) == figures["forced_tokens"] == 0
        assert value(families, "jointspec_acceptance_rate", method=method) == round(figures["acceptance_rate"], 6)
        assert value(families, "jointspec_tokens_per_round_count", method=method) == figures["rounds"]
        assert value(families, "jointspec_tokens_per_round_sum", method=method) == usage["completion_tokens"]
        assert value(families, "jointspec_queue_time_seconds_count", method=method) == 1
        assert value(families, "jointspec_time_to_first_token_seconds_count", method=method) == 1
        total_rounds += figures["rounds"]
    # ar sends one token a round: every token after the first has an inter-token latency.
    ar_tokens = answers["ar"]["usage"]["completion_tokens"]
    assert value(families, "jointspec_time_per_output_token_seconds_count", method="ar") == ar_tokens - 1
    # One request at a time: every target forward scored one row.
    assert value(families, "jointspec_batch_size_count") == value(families, "jointspec_batch_size_sum") == total_rounds
    assert value(families, "jointspec_generated_tokens_total") == sum(
        a["usage"]["completion_tokens"] for a in answers.values())
    assert value(families, "jointspec_prompt_tokens_total") == sum(
        a["usage"]["prompt_tokens"] for a in answers.values())
    for gauge, expected in [("jointspec_running_sequences", 0), ("jointspec_waiting_sequences", 0),
                            ("jointspec_max_batch_size", 4), ("jointspec_max_queue", 5),
                            ("jointspec_requests_in_flight", 0), ("jointspec_cancelled_sequences_total", 0)]:
        assert value(families, gauge) == expected, gauge
    assert families["jointspec_time_to_first_token_seconds"]["type"] == "histogram"
    if sys.platform == "linux":
        assert value(families, "process_resident_memory_bytes") > 10 * 2**20  # torch alone is more than 10 MiB
