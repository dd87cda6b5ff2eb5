"""``jointspec serve`` next to llama-cpp-python's own OpenAI server, end to end, on the same GGUF file.

Starts each server itself, one at a time, as a subprocess on a free localhost port: ``python -m jointspec serve
--model FILE.gguf`` and llama-cpp-python's ``python -m llama_cpp.server --model FILE.gguf``, the latter through
``llamacpp_server.py`` beside this file, which loads the model as the bench's ``llamacpp`` rows do (on CPUs with AMX
without llama.cpp's extra buffer types, whose AMX kernels segfault in 0.3.36 at the first decode of several tokens;
elsewhere unchanged). It waits until ``GET /v1/models`` answers
(with a deadline), warms it up (one request, non-streamed then streamed), runs every concurrency level, then stops
the server (SIGTERM, then SIGKILL after ``--stop-timeout``; in a ``finally``, so Ctrl-C, SIGTERM or an error leave
no server running; each server runs in its own session, so a Ctrl-C reaches the script only and the script stops the
server).

The load: the first turns of ``builtin:grounded`` and ``builtin:mt_bench`` (as ``load_test.py``), request i asks
prompt i mod 96 (their count), one user message each, identical for both servers; greedy (temperature 0),
``--max-tokens`` (128) each, streamed through the official ``openai`` AsyncOpenAI client, so time to first token
(first chunk with text) is measured on every request. At each ``--concurrency`` level (1 4 16) ``--requests``
requests (default max(8, 2 x concurrency)) are sent, that many at a time. Per server and level it reports completed
/ failed counts, aggregate completion tokens/s over the level's wall time, p50/p99 latency and TTFT, and then per
level the ratios jointspec / llama.cpp of throughput and of p50 latency: a markdown table on stdout and a JSON file
(``--out``; default ``reports/serve_vs_llamacpp/TIMESTAMP/results.json``, git-ignored, with both servers' logs
beside it). Every request has a timeout (``--timeout``) and the whole run a deadline (``--deadline``): levels that
do not fit are reported as skipped.

    python benchmarks/serve_vs_llamacpp.py                      # the embedded default's GGUF, 1 4 16
    python benchmarks/serve_vs_llamacpp.py --concurrency 1 4 --requests 8 --max-tokens 64
    python benchmarks/serve_vs_llamacpp.py --gguf model.gguf --jointspec-args "--quantize auto --method pld"
    python benchmarks/serve_vs_llamacpp.py --structured --max-tokens 96 --concurrency 1 4 8   # JSON under a schema

With ``--structured`` the load is ``structured_output.py``'s ten extraction requests, each asking for JSON under its
schema as ``response_format: {"type": "json_object", "schema": ...}`` (the form llama-cpp-python's server takes;
``jointspec serve`` takes it too), and each level also counts the answers that parse as a JSON object.

The servers' settings. jointspec: ``--model FILE.gguf --threads N`` and ``--jointspec-args`` (default ``--quantize
auto``, also ``serve``'s own default: the GGUF's own Q4_0/Q4_1/... blocks on jointspec's int4 kernels, as llama.cpp
runs them; the method is serve's default, ``default``, unless the args name one). llama.cpp: ``--n_ctx 2048
--n_threads N --n_threads_batch N --interrupt_requests False --verbose False`` and ``--llamacpp-args``; N is
``--threads`` (default os.cpu_count()). Both apply the chat template stored in the GGUF (jointspec through its
transformers tokenizer, llama-cpp-python through its Jinja2 formatter); the warm-up's non-streamed
``usage.prompt_tokens`` from each server is printed and kept in the JSON, so a template mismatch shows.

Caveats, which matter for reading the numbers:

- llama-cpp-python's server (0.3.x) serves ONE request at a time: one ``Llama`` object with one context behind a
  global lock (``llama_cpp/server/app.py``, ``get_llama_proxy``); a request waits for the lock, and there is no
  batching of concurrent requests. Its throughput is flat in concurrency and its latency grows with the queue.
  Worse, its default ``--interrupt_requests True`` ends a streaming answer early (``[DONE]`` without a
  finish_reason) as soon as another request is waiting for the lock, so under concurrency most streams would be
  cut short; this script passes ``--interrupt_requests False`` (and counts a stream that ends without a
  finish_reason as failed, should it happen anyway). It also reuses the previous request's KV cache for a common
  prompt prefix (the chat template's system text), which saves it a little prefill.
- llama-cpp-python's server ignores ``stream_options={"include_usage": true}`` (its request model has no such field:
  no usage chunk comes). For a stream without a usage chunk, completion tokens are counted from the stream: a
  finish_reason ``length`` means exactly ``max_tokens`` tokens (llama-cpp-python stops at that count); otherwise
  the number of chunks with text, which is one per token except where it holds tokens back to complete a
  multi-byte character or a possible stop string (then one chunk carries several tokens: a slight undercount). The
  warm-up checks this on one prompt: non-streamed ``usage.completion_tokens`` against the count from a stream of
  the same request, both kept in the JSON. That check means something only where both answers are the same text
  (``same_text_streamed``): llama-cpp-python's greedy answer to a prompt it has just seen can differ, as it reuses
  the cached prompt and evaluates less of it. On 13 answers that ended with ``stop`` and came out the same both
  ways, the chunk count equalled the usage every time. jointspec's streams carry the usage chunk, used as is.
- On SIGTERM llama-cpp-python's server (uvicorn) waits for the generation in flight to end, even when its client
  has gone; ``--stop-timeout`` bounds that wait before SIGKILL.
- The client runs on the same machine as the server and takes CPU from it; on a small machine (2 cores) keep
  everything else quiet, and read differences of a few percent as noise.
- The two servers' kernels differ, so their greedy answers can differ after some tokens (different lengths where
  one stops early); tokens/s counts what each produced.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from load_test import percentile
from openai import AsyncOpenAI

from jointspec.bench.prompts import load_prompts

SERVERS = ("jointspec", "llamacpp")
LABELS = {"jointspec": "jointspec serve", "llamacpp": "llama_cpp.server"}
# `python -m llama_cpp.server` with the model loaded as the bench's llama.cpp rows load it (its docstring says why).
LLAMACPP_SERVER = Path(__file__).with_name("llamacpp_server.py")


def default_gguf() -> Path:
    """The embedded default model's GGUF, as jointspec's llama.cpp backend uses it (copied into the cache once)."""
    from jointspec.backends.embedded import default_gguf_path

    return default_gguf_path()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, args, port: int) -> list[str]:
    if name == "jointspec":
        return ([sys.executable, "-m", "jointspec", "serve", "--model", str(args.gguf), "--threads", str(args.threads),
                 "--host", "127.0.0.1", "--port", str(port)] + shlex.split(args.jointspec_args))
    return ([sys.executable, str(LLAMACPP_SERVER), "--model", str(args.gguf), "--n_ctx", str(args.n_ctx),
             "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
             "--interrupt_requests", "False", "--verbose", "False", "--host", "127.0.0.1", "--port", str(port)]
            + shlex.split(args.llamacpp_args))


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def exit_description(code: int) -> str:
    """A server's exit status in words: ``code 1``, or the signal that killed it (``signal 11 (SIGSEGV)``)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {-code} ({signal.Signals(-code).name})"
        return f"signal {-code}"
    return f"code {code}"


def wait_ready(process: subprocess.Popen, base_url: str, deadline: float, log_path: Path) -> None:
    """Poll GET /v1/models until it answers 200; fail when the server exits or the deadline passes."""
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {exit_description(process.returncode)} before it was ready:\n"
                               f"{log_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not ready in time:\n{log_tail(log_path)}")
        time.sleep(0.5)


def stop_server(process: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds (the whole session: the server and anything it started)."""
    if process.poll() is not None:
        return
    try:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:  # past the timeout, or a second Ctrl-C while waiting
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def request_fields(prompt) -> tuple[str, dict]:
    """A load entry's text, and the fields its request adds (``--structured``: its response_format)."""
    if isinstance(prompt, tuple):
        return prompt[0], {"response_format": prompt[1]}
    return prompt, {}


async def one(client: AsyncOpenAI, model: str, prompt, max_tokens: int, timeout: float) -> dict:
    """One streamed chat request: latency, TTFT, completion tokens (and how they were counted), finish reason."""
    start = time.perf_counter()
    ttft, usage_tokens, finish, chunks_with_text, text = None, None, None, 0, []
    prompt, extra = request_fields(prompt)
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  timeout=timeout, stream_options={"include_usage": True}, **extra)
    async for chunk in stream:
        if chunk.choices:
            content = chunk.choices[0].delta.content
            if content:
                if ttft is None:
                    ttft = time.perf_counter() - start
                chunks_with_text += 1
                text.append(content)
            if chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            usage_tokens = chunk.usage.completion_tokens
    latency = time.perf_counter() - start
    if finish is None:
        raise RuntimeError("the stream ended without a finish_reason (interrupted by the server?)")
    if usage_tokens is not None:
        tokens, counted_by = usage_tokens, "usage"
    elif finish == "length":
        tokens, counted_by = max_tokens, "length"
    else:
        tokens, counted_by = chunks_with_text, "chunks"
    return {"latency": latency, "ttft": ttft, "tokens": tokens, "counted_by": counted_by, "finish": finish,
            "text": "".join(text)}


async def warm_up(client: AsyncOpenAI, model: str, prompt, max_tokens: int, timeout: float) -> dict:
    """A non-streamed request (exact usage from the server) and the same one streamed (tokens as the load counts
    them): warms the server up and checks the token count and the prompt's length under the chat template."""
    start = time.perf_counter()
    text, extra = request_fields(prompt)
    reply = await asyncio.wait_for(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        timeout=timeout, **extra), timeout)
    seconds = time.perf_counter() - start
    streamed = await asyncio.wait_for(one(client, model, prompt, max_tokens, timeout), timeout)
    return {"seconds": round(seconds, 3), "prompt_tokens": reply.usage.prompt_tokens,
            "completion_tokens": reply.usage.completion_tokens, "finish": reply.choices[0].finish_reason,
            "streamed_tokens": streamed["tokens"], "streamed_counted_by": streamed["counted_by"],
            "same_text_streamed": streamed["text"] == (reply.choices[0].message.content or ""),
            "text": reply.choices[0].message.content}


async def run_level(client: AsyncOpenAI, model: str, texts: list[str], concurrency: int, requests: int, args,
                    deadline: float) -> dict:
    semaphore = asyncio.Semaphore(concurrency)
    results: list[dict] = []
    failures: list[str] = []

    async def worker(i: int) -> None:
        async with semaphore:
            try:
                results.append(await asyncio.wait_for(
                    one(client, model, texts[i % len(texts)], args.max_tokens, args.timeout), args.timeout))
            except Exception as error:  # noqa: BLE001 - every failure is counted and reported
                failures.append(f"{type(error).__name__}: {error}"[:200])

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker(i)) for i in range(requests)]
    _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.0))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    latencies = [r["latency"] for r in results]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    return {"concurrency": concurrency, "requests": requests, "completed": len(results),
            "failed": len(failures) + len(pending), "lost_at_deadline": len(pending), "wall_s": round(wall, 3),
            "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
            "tokens_counted_by": {k: sum(r["counted_by"] == k for r in results)
                                  for k in sorted({r["counted_by"] for r in results})},
            "finish_reasons": {k: sum(r["finish"] == k for r in results)
                               for k in sorted({r["finish"] for r in results})},
            "latency_s": {"p50": percentile(latencies, .5), "p99": percentile(latencies, .99)},
            "ttft_s": {"p50": percentile(ttfts, .5), "p99": percentile(ttfts, .99)},
            "json_objects": sum(parses_as_object(r["text"]) for r in results),
            "failures": failures[:5]}


async def drive(base_url: str, texts: list[str], args, deadline: float) -> dict:
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=args.timeout)
    try:
        model = (await client.models.list()).data[0].id
        warm = await warm_up(client, model, texts[0], args.max_tokens, args.timeout)
        print(f"  warm-up: {warm['seconds']} s, prompt {warm['prompt_tokens']} tokens, completion "
              f"{warm['completion_tokens']} tokens ({warm['finish']}); streamed, counted by "
              f"{warm['streamed_counted_by']}: {warm['streamed_tokens']}", flush=True)
        levels = []
        for concurrency in args.concurrency:
            requests = args.requests or max(8, 2 * concurrency)
            if time.monotonic() >= deadline:
                levels.append({"concurrency": concurrency, "requests": requests, "skipped": "run deadline"})
                continue
            level = await run_level(client, model, texts, concurrency, requests, args, deadline)
            print(f"  concurrency {concurrency}: {level['completed']}/{requests} completed, "
                  f"{level['tokens_per_s']} tok/s, p50 latency {level['latency_s']['p50']} s, "
                  f"{level['json_objects']} answers a JSON object", flush=True)
            for failure in level["failures"]:
                print("    failure:", failure, flush=True)
            levels.append(level)
        return {"model_id": model, "warmup": warm, "levels": levels}
    finally:
        await client.close()


def run_server(name: str, args, texts: list[str], deadline: float, out_dir: Path) -> dict:
    port = free_port()
    command = server_command(name, args, port)
    log_path = out_dir / f"{name}.log"
    print(f"{LABELS[name]}: {shlex.join(command)}", flush=True)
    record: dict = {"command": command, "log": str(log_path)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        start = time.monotonic()
        wait_ready(process, f"http://127.0.0.1:{port}/v1", min(deadline, start + args.startup_timeout), log_path)
        record["startup_s"] = round(time.monotonic() - start, 2)
        print(f"  ready in {record['startup_s']} s", flush=True)
        record.update(asyncio.run(drive(f"http://127.0.0.1:{port}/v1", texts, args, deadline)))
    except Exception as error:  # noqa: BLE001 - reported, and the other server still runs
        record["error"] = f"{type(error).__name__}: {error}"
        with contextlib.suppress(subprocess.TimeoutExpired):  # a crashed server may not be reaped yet
            process.wait(1.0)
        if process.poll() is not None:  # it died under the load: say so, not only what the client saw
            record["error"] = (f"the server exited with {exit_description(process.returncode)} ({record['error']}); "
                               f"the end of its log ({log_path}):\n{log_tail(log_path)}")
        print(f"  error: {record['error']}", flush=True)
    finally:
        stop_server(process, args.stop_timeout)
        record["exit_code"] = process.returncode
    return record


def parses_as_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def fmt(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def fmt_load(load) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def tables(report: dict) -> str:
    lines = ["| server | concurrency | completed | failed | tok/s | p50 latency s | p99 latency s | p50 TTFT s "
             "| p99 TTFT s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, record in report["servers"].items():
        for level in record.get("levels", []):
            if "skipped" in level:
                lines.append(f"| {LABELS[name]} | {level['concurrency']} | skipped ({level['skipped']}) "
                             "| | | | | | |")
                continue
            lines.append(f"| {LABELS[name]} | {level['concurrency']} | {level['completed']}/{level['requests']} "
                         f"| {level['failed']} | {fmt(level['tokens_per_s'])} | {fmt(level['latency_s']['p50'])} "
                         f"| {fmt(level['latency_s']['p99'])} | {fmt(level['ttft_s']['p50'])} "
                         f"| {fmt(level['ttft_s']['p99'])} |")
        if "error" in record:
            lines.append(f"| {LABELS[name]} | error: {record['error'].splitlines()[0][:100]} | | | | | | | |")
    if report["ratios"]:
        lines += ["", "| concurrency | throughput jointspec / llama.cpp | p50 latency jointspec / llama.cpp |",
                  "|---|---|---|"]
        lines += [f"| {r['concurrency']} | {fmt(r['throughput'])} | {fmt(r['p50_latency'])} |"
                  for r in report["ratios"]]
    return "\n".join(lines)


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF file both servers load (default: the embedded default model's)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per concurrency level (default: max(8, 2 x concurrency))")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="CPU threads for both servers (default: os.cpu_count())")
    parser.add_argument("--n-ctx", type=int, default=2048, help="llama.cpp's context size")
    parser.add_argument("--jointspec-args", default="--quantize auto", help="more `jointspec serve` arguments")
    parser.add_argument("--llamacpp-args", default="", help="more `python -m llama_cpp.server` arguments")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS),
                        help="which servers, in this order")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to get ready")
    parser.add_argument("--stop-timeout", type=float, default=10.0, help="seconds after SIGTERM before SIGKILL")
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole run")
    parser.add_argument("--structured", action="store_true",
                        help="structured output: structured_output.py's extraction requests, each with its JSON schema "
                             "as response_format {type: json_object, schema} (the form both servers take)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON file (default: reports/serve_vs_llamacpp/TIMESTAMP/results.json)")
    args = parser.parse_args()
    if any(c < 1 for c in args.concurrency) or (args.requests is not None and args.requests < 1):
        parser.error("--concurrency and --requests must be >= 1")
    deadline = time.monotonic() + args.deadline
    signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: the finally blocks run and stop the server
    args.gguf = (args.gguf or default_gguf()).resolve()
    if not args.gguf.is_file():
        parser.error(f"no such GGUF file: {args.gguf}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or Path(__file__).resolve().parent.parent / "reports" / "serve_vs_llamacpp" / stamp / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.structured:  # each request asks for its facts as JSON under its schema, in llama.cpp's form
        from structured_output import PROMPTS, prompt_text

        texts = [(prompt_text(text, schema), {"type": "json_object", "schema": schema}) for text, schema in PROMPTS]
    else:
        texts = [p.turns[0] for source in ("builtin:grounded", "builtin:mt_bench") for p in load_prompts(source)]

    report = {"gguf": str(args.gguf), "max_tokens": args.max_tokens, "temperature": 0, "prompts": len(texts),
              "structured": args.structured,
              "concurrency": args.concurrency, "threads": args.threads,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
              "started": stamp, "load_average_before": os.getloadavg(), "servers": {}, "ratios": []}
    for name in args.servers:
        report["servers"][name] = run_server(name, args, texts, deadline, out.parent)
    if set(SERVERS) <= set(report["servers"]):
        by_level = {name: {level["concurrency"]: level for level in report["servers"][name].get("levels", [])
                           if "skipped" not in level} for name in SERVERS}
        for concurrency in args.concurrency:
            js, lc = by_level["jointspec"].get(concurrency), by_level["llamacpp"].get(concurrency)
            if js and lc:
                report["ratios"].append({"concurrency": concurrency,
                                         "throughput": ratio(js["tokens_per_s"], lc["tokens_per_s"]),
                                         "p50_latency": ratio(js["latency_s"]["p50"], lc["latency_s"]["p50"])})
    report["load_average_after"] = os.getloadavg()  # other work on the machine makes the numbers loose
    texts_out = [r["warmup"]["text"] or "" for r in report["servers"].values() if r.get("warmup")]
    if len(texts_out) == 2:  # how far the two greedy answers to the warm-up prompt agree
        report["warmup_common_prefix_chars"] = len(os.path.commonprefix(texts_out))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(tables(report))
    print()
    for name, record in report["servers"].items():
        warm = record.get("warmup")
        if warm:
            print(f"{LABELS[name]} warm-up: prompt {warm['prompt_tokens']} tokens, completion "
                  f"{warm['completion_tokens']} tokens (streamed, counted by {warm['streamed_counted_by']}: "
                  f"{warm['streamed_tokens']})")
    if "warmup_common_prefix_chars" in report:
        print(f"the two warm-up answers agree on their first {report['warmup_common_prefix_chars']} characters")
    print(f"load average (1, 5, 15 min) before {fmt_load(report['load_average_before'])}, after "
          f"{fmt_load(report['load_average_after'])} on {os.cpu_count()} CPUs")
    print(f"written: {out}")
    return 1 if any("error" in r for r in report["servers"].values()) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted (the server was stopped)", file=sys.stderr)
        sys.exit(130)
