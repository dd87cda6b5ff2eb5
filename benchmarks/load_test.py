"""Latency, time to first token and throughput of ``jointspec serve`` (or any OpenAI-compatible server) under load.

N chat requests, C at a time. Starts nothing itself: point it at a running server. Every request has a timeout and the
whole run a deadline, so it always stops. Half the requests stream (time-to-first-token is measured on those), half do
not; all greedy. Reports completed / failed / lost (no answer before the run's deadline) counts, latency and TTFT
percentiles, aggregate completion tokens/s over the run's wall time, and a final JSON line.

    jointspec serve --method pld --host 127.0.0.1 --port 8765 &
    python benchmarks/load_test.py --base-url http://127.0.0.1:8765/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from openai import AsyncOpenAI

from jointspec.bench.prompts import load_prompts


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return round(values[lo] + (values[hi] - values[lo]) * (k - lo), 3)


async def one(client: AsyncOpenAI, model: str, prompt: str, max_tokens: int, stream: bool, timeout: float) -> dict:
    messages = [{"role": "user", "content": prompt}]
    start = time.perf_counter()
    if not stream:
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                     temperature=0, timeout=timeout)
        return {"latency": time.perf_counter() - start, "ttft": None, "tokens": reply.usage.completion_tokens,
                "finish": reply.choices[0].finish_reason, "stream": False}
    ttft, tokens, finish = None, None, None
    chunks = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True, timeout=timeout,
                                                  stream_options={"include_usage": True})
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"latency": time.perf_counter() - start, "ttft": ttft, "tokens": tokens, "finish": finish, "stream": True}


async def run(args) -> dict:
    client = AsyncOpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=args.timeout)
    model = args.model or (await client.models.list()).data[0].id
    texts = [p.turns[0] for source in ("builtin:grounded", "builtin:mt_bench") for p in load_prompts(source)]
    semaphore = asyncio.Semaphore(args.concurrency)
    results: list[dict] = []
    failures: list[str] = []

    async def worker(i: int) -> None:
        async with semaphore:
            max_tokens = args.min_tokens + (i * 37) % (args.max_tokens - args.min_tokens + 1)  # spread, reproducible
            try:
                results.append(await asyncio.wait_for(
                    one(client, model, texts[i % len(texts)], max_tokens, i % 2 == 0, args.timeout),
                    args.timeout))
            except Exception as error:  # noqa: BLE001 - every failure is counted and reported
                failures.append(f"{type(error).__name__}: {error}"[:200])

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker(i)) for i in range(args.requests)]
    done, pending = await asyncio.wait(tasks, timeout=args.deadline)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    await client.close()
    tokens = sum(r["tokens"] or 0 for r in results)
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"base_url": args.base_url, "model": model, "requests": args.requests, "concurrency": args.concurrency,
            "max_tokens": [args.min_tokens, args.max_tokens], "completed": len(results), "failed": len(failures),
            "lost": len(pending), "wall_s": round(wall, 3), "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "finish_reasons": {k: sum(r["finish"] == k for r in results) for k in {r["finish"] for r in results}},
            "latency_s": {"p50": percentile(latencies, .5), "p90": percentile(latencies, .9),
                          "p99": percentile(latencies, .99), "max": percentile(latencies, 1.0)},
            "ttft_s": {"n": len(ttfts), "p50": percentile(ttfts, .5), "p90": percentile(ttfts, .9),
                       "p99": percentile(ttfts, .99)},
            "failures": failures[:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds for the whole run")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(f"completed {report['completed']}/{report['requests']}, failed {report['failed']}, lost {report['lost']}, "
          f"{report['completion_tokens']} tokens in {report['wall_s']} s = {report['tokens_per_s']} tok/s")
    print(f"latency s p50/p90/p99: {report['latency_s']['p50']}/{report['latency_s']['p90']}/"
          f"{report['latency_s']['p99']}; TTFT s (streamed, n={report['ttft_s']['n']}) p50/p90/p99: "
          f"{report['ttft_s']['p50']}/{report['ttft_s']['p90']}/{report['ttft_s']['p99']}")
    for failure in report["failures"]:
        print("failure:", failure)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
