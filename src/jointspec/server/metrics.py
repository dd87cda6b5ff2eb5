"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

One page, two sources:

- the routes count what clients see (:class:`Metrics`): requests by endpoint and outcome, requests in flight, tokens,
  time to first token and time per output token, per method;
- the engine thread counts what decoding did (:class:`EngineSnapshot`, copied when ``/metrics`` is scraped): rounds,
  drafted and accepted tokens, acceptance by draft position, tokens per round and queue time per method, the rows of
  each target forward, the rows and the queue now.

Prometheus conventions: every family has one HELP and one TYPE line, counters end in ``_total``, times are in
seconds, and histograms write cumulative ``_bucket{le="..."}`` lines ending at ``+Inf``, then ``_sum`` and ``_count``.
"""

from __future__ import annotations

import copy
import math
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from jointspec.core.loop import SpecStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKENS_PER_ROUND_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)

ENDPOINTS = ("completions", "chat", "responses", "messages")
# How a request ended. "rejected": a 400 (bad request); "overloaded": a 429 or 503 (queue full, or draining);
# "timeout": past --request-timeout; "cancelled": its client left; "error": the engine failed it or shut down under it.
OUTCOMES = ("completed", "cancelled", "timeout", "error", "rejected", "overloaded")

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, value in labels)
    return "{" + ",".join(f'{name}="{value}"' for (name, _), value in zip(labels, escaped)) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += times
                break
        self.sum += value * times
        self.count += times

    def lines(self, name: str, labels: Labels = ()) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f"{name}_bucket{_labels(labels + (('le', _number(bound)),))} {cumulative}")
        out += [f"{name}_sum{_labels(labels)} {_number(self.sum)}", f"{name}_count{_labels(labels)} {self.count}"]
        return out


@dataclass
class MethodStats:
    """What the engine did for one method's sequences since the server started."""

    spec: SpecStats = field(default_factory=SpecStats)
    tokens_per_round: Histogram = field(default_factory=lambda: Histogram(TOKENS_PER_ROUND_BUCKETS))
    queue_seconds: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))


@dataclass
class EngineSnapshot:
    """The serving engine's counters and gauges at one moment (a copy: the engine thread goes on updating its own)."""

    methods: dict[str, MethodStats] = field(default_factory=dict)
    running_sequences: int = 0  # rows in the batch now
    waiting_sequences: int = 0  # admitted, waiting for a row: the queue depth
    max_batch_size: int = 0
    max_queue: int = 0
    num_cancelled: int = 0  # sequences stopped before their end (client gone, timeout, stop string)
    batch_size: Histogram = field(default_factory=lambda: Histogram(BATCH_SIZE_BUCKETS))  # rows per target forward
    prompt_cache_bytes: int = 0  # finished requests' caches kept for later prompts (batch/prompt_cache.py)
    prompt_cache_entries: int = 0
    prompt_cache_max_bytes: int = 0  # --prompt-cache-mb (0: the engine keeps none)

    def copy(self) -> EngineSnapshot:
        return copy.deepcopy(self)


def resident_memory_bytes() -> int | None:
    """This process's resident set size, from /proc (Linux); None where that is not readable."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Metrics:
    """What the routes count. Thread-safe: routes update it, scrapes render it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Every endpoint and outcome starts at 0, so that rates over a series that has not happened yet are 0.
        self.requests: dict[Labels, int] = {(("endpoint", e), ("outcome", o)): 0 for e in ENDPOINTS for o in OUTCOMES}
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.time_to_first_token: dict[str, Histogram] = defaultdict(lambda: Histogram(TTFT_BUCKETS))
        self.time_per_output_token: dict[str, Histogram] = defaultdict(lambda: Histogram(PER_TOKEN_BUCKETS))

    def count_request(self, endpoint: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown request outcome '{outcome}'")
        with self._lock:
            self.requests[(("endpoint", endpoint), ("outcome", outcome))] += 1

    def count_tokens(self, num_prompt_tokens: int = 0, num_generated_tokens: int = 0,
                     num_cached_prompt_tokens: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
            self.generated_tokens += num_generated_tokens
            self.cached_prompt_tokens += num_cached_prompt_tokens

    def observe_first_token(self, method: str, seconds: float) -> None:
        with self._lock:
            self.time_to_first_token[method].observe(seconds)

    def observe_chunk(self, method: str, seconds: float, num_tokens: int) -> None:
        """A chunk of ``num_tokens`` arrived ``seconds`` after the previous one: each token cost seconds / n."""
        if num_tokens > 0:
            with self._lock:
                self.time_per_output_token[method].observe(seconds / num_tokens, num_tokens)

    def render(self, engine: EngineSnapshot, in_flight: int) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[Labels, float]]) -> None:
            family(name, kind, help_text)
            out.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

        def histograms(name: str, help_text: str, by_method: dict[str, Histogram]) -> None:
            family(name, "histogram", help_text)
            for method, histogram in sorted(by_method.items()):
                out.extend(histogram.lines(name, (("method", method),)))

        with self._lock:
            metric("jointspec_requests_total", "counter", "HTTP requests by endpoint and how they ended.",
                   sorted(self.requests.items()))
            metric("jointspec_prompt_tokens_total", "counter", "Prompt tokens of requests the engine took.",
                   [((), self.prompt_tokens)])
            metric("jointspec_prompt_tokens_cached_total", "counter",
                   "Prompt tokens served from the prompt cache instead of being read again.",
                   [((), self.cached_prompt_tokens)])
            metric("jointspec_generated_tokens_total", "counter", "Tokens sent to clients.",
                   [((), self.generated_tokens)])
            histograms("jointspec_time_to_first_token_seconds", "Request arrival to its first token, by method.",
                       self.time_to_first_token)
            histograms("jointspec_time_per_output_token_seconds",
                       "Inter-token latency: time per output token after the first, by method.",
                       self.time_per_output_token)
        metric("jointspec_requests_in_flight", "gauge", "Requests admitted and not yet answered in full.",
               [((), in_flight)])

        methods = sorted(engine.methods.items())
        spec = [(method, stats.spec) for method, stats in methods]
        by_method = [(((("method", m),)), s) for m, s in spec]
        metric("jointspec_rounds_total", "counter", "Target forward passes (rounds), summed over sequences.",
               [(labels, s.num_rounds) for labels, s in by_method])
        metric("jointspec_draft_tokens_total", "counter", "Draft tokens proposed.",
               [(labels, s.num_draft_tokens) for labels, s in by_method])
        metric("jointspec_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [(labels, s.num_accepted_tokens) for labels, s in by_method])
        metric("jointspec_forced_tokens_total", "counter",
               "Accepted draft tokens that a response_format's grammar forced (counted in the accepted too).",
               [(labels, s.num_forced_tokens) for labels, s in by_method])
        metric("jointspec_acceptance_rate", "gauge", "Accepted / drafted tokens since the server started.",
               [(labels, round(s.acceptance_rate, 6)) for labels, s in by_method])
        histograms("jointspec_tokens_per_round", "Tokens a sequence committed in one round (accepted + 1).",
                   {m: stats.tokens_per_round for m, stats in methods})
        histograms("jointspec_queue_time_seconds", "Request admission to its first round in the batch.",
                   {m: stats.queue_seconds for m, stats in methods})
        positions = [((("method", m), ("position", str(i))), s, i) for m, s in spec
                     for i in range(len(s.drafted_per_position))]
        metric("jointspec_drafted_by_position_total", "counter", "Rounds that drafted a token at this depth.",
               [(labels, s.drafted_per_position[i]) for labels, s, i in positions])
        metric("jointspec_accepted_by_position_total", "counter", "Rounds that accepted the token at this depth.",
               [(labels, s.accepted_per_position[i]) for labels, s, i in positions])
        metric("jointspec_acceptance_by_position", "gauge", "Accepted / drafted at each draft depth.",
               [(labels, round(s.acceptance_per_position[i], 6)) for labels, s, i in positions])
        metric("jointspec_running_sequences", "gauge", "Sequences in the batch now (the current batch size).",
               [((), engine.running_sequences)])
        metric("jointspec_waiting_sequences", "gauge", "Requests waiting for a row now (the queue depth).",
               [((), engine.waiting_sequences)])
        metric("jointspec_max_batch_size", "gauge", "Rows the batch holds (--max-batch-size).",
               [((), engine.max_batch_size)])
        metric("jointspec_max_queue", "gauge", "Requests that may wait for a row (--max-queue).",
               [((), engine.max_queue)])
        metric("jointspec_prompt_cache_bytes", "gauge",
               "Bytes of finished requests' caches kept for prompts that begin with their tokens.",
               [((), engine.prompt_cache_bytes)])
        metric("jointspec_prompt_cache_entries", "gauge", "Finished requests' caches kept in the prompt cache.",
               [((), engine.prompt_cache_entries)])
        metric("jointspec_prompt_cache_max_bytes", "gauge", "The prompt cache's budget (--prompt-cache-mb; 0: off).",
               [((), engine.prompt_cache_max_bytes)])
        family("jointspec_batch_size", "histogram", "Sequences scored by each batched target forward.")
        out.extend(engine.batch_size.lines("jointspec_batch_size"))
        metric("jointspec_cancelled_sequences_total", "counter",
               "Sequences stopped before their end: client gone, timeout, stop string.", [((), engine.num_cancelled)])
        rss = resident_memory_bytes()
        if rss is not None:
            metric("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", [((), rss)])
        return "\n".join(out) + "\n"
