"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Counters and histograms are updated by the routes (requests, tokens, latency as the client sees it); the engine's
speculative counters (rounds, drafted and accepted tokens, acceptance by draft position) are read from its
:class:`~jointspec.core.loop.SpecStats` when scraped.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

from jointspec.core.loop import SpecStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
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

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        out += [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Everything ``/metrics`` reports. Thread-safe: routes update it, scrapes render it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[tuple[str, str], ...], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.time_per_output_token = Histogram(PER_TOKEN_BUCKETS)

    def count_request(self, endpoint: str, status: str) -> None:
        with self._lock:
            self.requests[(("endpoint", endpoint), ("status", status))] += 1

    def count_tokens(self, num_prompt_tokens: int = 0, num_generated_tokens: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens
            self.generated_tokens += num_generated_tokens

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def observe_chunk(self, seconds: float, num_tokens: int) -> None:
        """A chunk of ``num_tokens`` arrived ``seconds`` after the previous one: each token cost seconds / n."""
        if num_tokens > 0:
            with self._lock:
                self.time_per_output_token.observe(seconds / num_tokens, num_tokens)

    def render(self, stats: SpecStats, gauges: dict[str, float]) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[tuple, float]]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
            out.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

        with self._lock:
            metric("jointspec_requests_total", "counter", "HTTP requests by endpoint and outcome.",
                   sorted(self.requests.items()))
            metric("jointspec_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                   [((), self.prompt_tokens)])
            metric("jointspec_generated_tokens_total", "counter", "Tokens sent to clients.",
                   [((), self.generated_tokens)])
            histograms = [("jointspec_time_to_first_token_seconds", "Request arrival to first token.",
                           self.time_to_first_token),
                          ("jointspec_time_per_output_token_seconds", "Latency per output token after the first.",
                           self.time_per_output_token)]
            for name, help_text, histogram in histograms:
                out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} histogram"])
                out.extend(histogram.lines(name))
        metric("jointspec_rounds_total", "counter", "Target forward passes (rounds), summed over sequences.",
               [((), stats.num_rounds)])
        metric("jointspec_draft_tokens_total", "counter", "Draft tokens proposed.", [((), stats.num_draft_tokens)])
        metric("jointspec_accepted_tokens_total", "counter", "Draft tokens accepted.",
               [((), stats.num_accepted_tokens)])
        metric("jointspec_drafted_by_position_total", "counter", "Rounds that drafted a token at this depth.",
               [((("position", str(i)),), n) for i, n in enumerate(stats.drafted_per_position)])
        metric("jointspec_accepted_by_position_total", "counter", "Rounds that accepted the token at this depth.",
               [((("position", str(i)),), n) for i, n in enumerate(stats.accepted_per_position)])
        metric("jointspec_acceptance_by_position", "gauge", "Accepted / drafted at each draft depth.",
               [((("position", str(i)),), round(rate, 6)) for i, rate in enumerate(stats.acceptance_per_position)])
        for name, value in sorted(gauges.items()):
            metric(f"jointspec_{name}", "gauge", f"Engine gauge: {name.replace('_', ' ')}.", [((), value)])
        return "\n".join(out) + "\n"
