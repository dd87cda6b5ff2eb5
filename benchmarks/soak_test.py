"""Soak test of ``jointspec serve``: many requests at mixed concurrency, some clients leaving early; none may be lost.

Starts nothing itself: point it at a running server. The requests run in about 25 phases, each at one
concurrency: every level from 1 to ``--max-concurrency`` in turn, in a random order. Each request is streamed or not,
chat or completion, with a random ``max_tokens``, and with probability ``--disconnect-rate`` its client leaves early (a
stream after a few events, a plain request after a random delay). Every request must end in one of three ways:

* completed: a 200 with a whole answer (a stream: a finish reason, then ``[DONE]``);
* cancelled: its own client left before the end;
* an error envelope ``{"error": {...}}``: the status of a refusal, or a stream's last event.

Anything else is *lost* (no answer before the request's timeout, a connection error, a stream cut off without
``[DONE]`` or an error, a malformed body). Memory: the server's ``process_resident_memory_bytes`` (from ``/metrics``)
when request ``--memory-from`` has ended is the baseline; every 10th request after it and the end must stay within
``--memory-tolerance`` of it. At the end the server must go idle: no rows, no queue, no request in flight. Exit code
0 when all three checks pass; the last line is one JSON report.

    jointspec serve --method pld --port 8765 &
    python benchmarks/soak_test.py --base-url http://127.0.0.1:8765 --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

PROMPTS = ("Summarise in one sentence: the meeting moved to Tuesday because the room was booked.",
           "Write a haiku about rain.", "List three prime numbers.", "What is the capital of France?",
           "Rewrite more simply: the committee has reached a consensus regarding the proposal.",
           "Translate to French: good morning, how are you?")


@dataclass(frozen=True)
class Plan:
    """One request: what to send and whether (and when) its client leaves."""

    index: int
    endpoint: str  # "chat" or "completions"
    prompt: str
    max_tokens: int
    stream: bool
    leave_after_events: int | None  # a stream's client leaves after this many events
    leave_after_seconds: float | None  # a plain request's client leaves after this long


def make_plans(num_requests: int, prompts: tuple[str, ...], min_tokens: int, max_tokens: int,
               disconnect_rate: float, rng: random.Random) -> list[Plan]:
    plans = []
    for i in range(num_requests):
        stream = rng.random() < 0.5
        leaves = rng.random() < disconnect_rate
        plans.append(Plan(i, rng.choice(("chat", "completions")), rng.choice(prompts),
                          rng.randint(min_tokens, max_tokens), stream,
                          rng.randint(1, 4) if leaves and stream else None,
                          rng.uniform(0.02, 0.5) if leaves and not stream else None))
    return plans


def _is_envelope(payload) -> bool:
    return (isinstance(payload, dict) and isinstance(payload.get("error"), dict)
            and {"message", "type", "code"} <= set(payload["error"]))


async def run_one(http: httpx.AsyncClient, plan: Plan, model: str | None, timeout: float) -> tuple[str, str]:
    """(outcome, detail): outcome is "completed", "cancelled", "error" or "lost"."""
    path = "/v1/chat/completions" if plan.endpoint == "chat" else "/v1/completions"
    body = {"max_tokens": plan.max_tokens, "temperature": 0, "stream": plan.stream}
    body |= {"model": model} if model else {}
    body |= ({"messages": [{"role": "user", "content": plan.prompt}]} if plan.endpoint == "chat"
             else {"prompt": plan.prompt})
    try:
        if not plan.stream:
            call = http.post(path, json=body, timeout=timeout)
            if plan.leave_after_seconds is not None:
                try:
                    reply = await asyncio.wait_for(call, plan.leave_after_seconds)
                except TimeoutError:
                    return "cancelled", "left a plain request"
            else:
                reply = await call
            payload = reply.json()
            if reply.status_code == 200 and payload.get("choices") and payload["choices"][0].get("finish_reason"):
                return "completed", ""
            if reply.status_code >= 400 and _is_envelope(payload):
                return "error", f"{reply.status_code} {payload['error']['code']}"
            return "lost", f"{reply.status_code} {str(payload)[:120]}"
        async with http.stream("POST", path, json=body, timeout=timeout) as reply:
            if reply.status_code != 200:
                payload = json.loads(await reply.aread())
                if _is_envelope(payload):
                    return "error", f"{reply.status_code} {payload['error']['code']}"
                return "lost", f"{reply.status_code} {str(payload)[:120]}"
            events, finished = [], False
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if events[-1] == "[DONE]":
                    return ("completed", "") if finished else ("lost", "[DONE] without a finish reason")
                payload = json.loads(events[-1])
                if _is_envelope(payload):
                    return "error", f"stream {payload['error']['code']}"
                finished = finished or any(c.get("finish_reason") for c in payload.get("choices", []))
                if plan.leave_after_events is not None and len(events) >= plan.leave_after_events:
                    return "cancelled", "left a stream"
            return "lost", f"the stream ended without [DONE] or an error after {len(events)} events"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as error:
        return "lost", f"{type(error).__name__}: {error}"[:200]


def read_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples by name, and jointspec_requests_total summed by outcome ("requests:OUTCOME")."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("jointspec_requests_total{"):
            outcome = name.split('outcome="', 1)[1].split('"', 1)[0]
            values[f"requests:{outcome}"] = values.get(f"requests:{outcome}", 0.0) + float(value)
        elif "{" not in name:
            values[name] = float(value)
    return values


async def soak(base_url: str, *, num_requests: int = 500, max_concurrency: int = 16, disconnect_rate: float = 0.2,
               min_tokens: int = 4, max_tokens: int = 32, prompts: tuple[str, ...] = PROMPTS, seed: int = 0,
               timeout: float = 300.0, memory_from: int = 100, memory_tolerance: float = 0.10,
               idle_timeout: float = 60.0, model: str | None = None) -> dict:
    rng = random.Random(seed)
    plans = make_plans(num_requests, prompts, min_tokens, max_tokens, disconnect_rate, rng)
    outcomes: dict[str, int] = {"completed": 0, "cancelled": 0, "error": 0, "lost": 0}
    lost: list[str] = []
    errors: dict[str, int] = {}
    memory: list[tuple[int, float]] = []  # (requests ended, resident bytes)
    phases: list[tuple[int, int]] = []  # (concurrency, requests)
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as http:
        before = read_metrics((await http.get("/metrics")).text)
        ended = 0

        async def sample_memory() -> None:
            rss = read_metrics((await http.get("/metrics")).text).get("process_resident_memory_bytes")
            if rss is not None:
                memory.append((ended, rss))

        start = time.perf_counter()
        position = 0
        levels = list(range(1, max_concurrency + 1))
        rng.shuffle(levels)  # phases take every concurrency from 1 to the maximum in turn, in a random order
        while position < len(plans):
            concurrency = levels[len(phases) % len(levels)]
            # About 25 phases, whatever the number of requests (10 to 41 requests each for 500).
            phase = plans[position:position + rng.randint(max(1, num_requests // 50), max(2, num_requests // 12))]
            position += len(phase)
            phases.append((concurrency, len(phase)))
            queue = list(phase)

            async def worker(queue: list[Plan]) -> None:
                nonlocal ended
                while queue:
                    plan = queue.pop(0)
                    outcome, detail = await run_one(http, plan, model, timeout)
                    outcomes[outcome] += 1
                    if outcome == "lost":
                        lost.append(f"#{plan.index}: {detail}")
                    elif outcome == "error":
                        errors[detail] = errors.get(detail, 0) + 1
                    ended += 1
                    if ended == memory_from or (ended > memory_from and ended % 10 == 0):
                        await sample_memory()

            await asyncio.gather(*(worker(queue) for _ in range(concurrency)))
        wall = time.perf_counter() - start

        # The server must go idle: no rows, no queue, nothing in flight (cancels reach the engine between rounds).
        deadline = time.monotonic() + idle_timeout
        while True:
            after = read_metrics((await http.get("/metrics")).text)
            idle = {name: after.get(name) for name in ("jointspec_running_sequences", "jointspec_waiting_sequences",
                                                       "jointspec_requests_in_flight")}
            if all(v == 0 for v in idle.values()) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        await sample_memory()

    baseline = next((rss for n, rss in memory if n >= memory_from), None)
    window = [rss for n, rss in memory if n >= memory_from]
    drift = max(abs(rss - baseline) / baseline for rss in window) if baseline else None
    return {
        "base_url": base_url, "requests": num_requests, "max_concurrency": max_concurrency,
        "disconnect_rate": disconnect_rate, "max_tokens": [min_tokens, max_tokens], "seed": seed,
        "wall_s": round(wall, 1), "phases": len(phases),
        "concurrency_used": sorted({c for c, _ in phases}),
        "outcomes": outcomes, "errors": errors, "lost": lost[:10],
        "server_requests": {k.split(":", 1)[1]: after.get(k, 0) - before.get(k, 0) for k in after
                            if k.startswith("requests:") and after.get(k, 0) != before.get(k, 0)},
        "server_idle": idle,
        "memory": {"from_request": memory_from, "baseline_mib": round(baseline / 2**20, 1) if baseline else None,
                   "min_mib": round(min(window) / 2**20, 1) if window else None,
                   "max_mib": round(max(window) / 2**20, 1) if window else None,
                   "final_mib": round(memory[-1][1] / 2**20, 1) if memory else None,
                   "max_drift": round(drift, 4) if drift is not None else None, "samples": len(window)},
        "passed": {"none_lost": outcomes["lost"] == 0 and sum(outcomes.values()) == num_requests,
                   "server_idle": all(v == 0 for v in idle.values()),
                   "memory_within_tolerance": drift is not None and drift <= memory_tolerance},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", default=None, help="model name to send (default: none; jointspec ignores it)")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-concurrency", type=int, default=16, help="each phase runs at 1 to this many at once")
    parser.add_argument("--disconnect-rate", type=float, default=0.2, help="share of clients that leave early")
    parser.add_argument("--min-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as lost")
    parser.add_argument("--memory-from", type=int, default=100, help="the request whose end sets the memory baseline")
    parser.add_argument("--memory-tolerance", type=float, default=0.10)
    args = parser.parse_args()
    report = asyncio.run(soak(args.base_url, num_requests=args.requests, max_concurrency=args.max_concurrency,
                              disconnect_rate=args.disconnect_rate, min_tokens=args.min_tokens,
                              max_tokens=args.max_tokens, seed=args.seed, timeout=args.timeout,
                              memory_from=args.memory_from, memory_tolerance=args.memory_tolerance,
                              model=args.model))
    memory = report["memory"]
    print(f"{report['requests']} requests in {report['wall_s']} s over {report['phases']} phases "
          f"(concurrency {report['concurrency_used']}): {report['outcomes']}, errors {report['errors']}")
    print(f"server RSS from request {memory['from_request']}: baseline {memory['baseline_mib']} MiB, "
          f"min {memory['min_mib']}, max {memory['max_mib']}, final {memory['final_mib']} MiB "
          f"(max drift {memory['max_drift']}); idle at the end: {report['server_idle']}")
    for line in report["lost"]:
        print("lost:", line)
    print("PASS" if all(report["passed"].values()) else f"FAIL {report['passed']}")
    print(json.dumps(report))
    raise SystemExit(0 if all(report["passed"].values()) else 1)


if __name__ == "__main__":
    main()
