"""Plain decoding on one GGUF file: jointspec's int4 path against llama.cpp's, after contexts of given lengths.

For models the bench's prompt sets cannot speak for (a random-weight model of a larger shape: synthetic_gguf.py),
where only speed and memory mean anything. Each engine runs in its own process, so each has its own peak memory
(``ru_maxrss``), and the two alternate ``--repeats`` times. An engine loads the file, then for each context length
reads that many random tokens and decodes ``--new-tokens`` greedily (end-of-sequence ignored), timing the decoding
alone (after one short untimed warm-up). jointspec runs ``--method`` (default ``ar``: plain decoding) on what
``--quantize auto`` picks, its key/value cache as ``--kv-cache`` says (``auto``: halves on the compiled layers, as
llama.cpp keeps its cache; ``float32`` to compare); llama.cpp runs its own generate loop, as the bench's
``llamacpp`` method does. Prints a table and, last, one JSON line::

    python benchmarks/gguf_decode_vs_llamacpp.py /tmp/llama1b-q4_0.gguf --contexts 128 2048 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time


def child(engine: str, path: str, contexts: list[int], new_tokens: int, threads: int, method: str,
          kv_cache: str = "auto") -> dict:
    import resource

    start = time.perf_counter()
    if engine == "llamacpp":
        import llama_cpp

        from jointspec.backends.llamacpp import llama_class_params

        with llama_class_params():  # as the bench's llamacpp rows: no AMX buffers where they crash
            llama = llama_cpp.Llama(model_path=path, n_ctx=max(contexts) + new_tokens + 8, n_batch=512,
                                    n_threads=threads, n_threads_batch=threads, verbose=False)
        vocab = llama.n_vocab()
    else:
        import torch

        from jointspec.backends.loading import load_model
        from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
        from jointspec.core.sampling import SamplingConfig
        from jointspec.methods import MethodConfig, MethodContext, build_method

        torch.set_num_threads(threads)
        target, tokenizer = load_model(path, quantize="auto", kv_cache=kv_cache)
        vocab = target.vocab_size
        drafter, verifier = build_method(MethodContext(MethodConfig(name=method), target, tokenizer, load_draft=None))
        decoder = SpeculativeDecoder(target, drafter, verifier)
    load_seconds = time.perf_counter() - start
    rates = {}
    for context in [16, *contexts]:  # the first, short, untimed: one-off costs of a first call stay out of the rates
        prompt = [random.Random(context).randrange(100, vocab - 100) for _ in range(context)]
        if engine == "llamacpp":
            llama.reset()
            tokens, first = 0, None
            for _ in llama.generate(prompt, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                tokens += 1
                if first is None:
                    first = time.perf_counter()
                if tokens == new_tokens:
                    break
            rates[str(context)] = (tokens - 1) / (time.perf_counter() - first)
        else:
            config = DecodeConfig(max_new_tokens=new_tokens, sampling=SamplingConfig(temperature=0.0),
                                  eos_token_ids=frozenset())
            begin = time.perf_counter()
            out = decoder.generate(prompt, config)
            seconds = time.perf_counter() - begin - decoder.stats.prefill_seconds
            rates[str(context)] = len(out) / seconds
    rates.pop("16")
    return {"engine": engine, "load_seconds": load_seconds, "tokens_per_second": rates,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--method", default="ar")
    # Checked by load_model in the jointspec child (an import here would weigh on llama.cpp's peak memory too).
    parser.add_argument("--kv-cache", default="auto",
                        help="jointspec's key/value cache: auto (halves on the compiled layers, as llama.cpp keeps "
                             "its own), float32 or float16")
    parser.add_argument("--child", choices=["jointspec", "llamacpp"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.contexts, args.new_tokens, args.threads, args.method,
                               args.kv_cache)))
        return
    runs: dict[str, list[dict]] = {"jointspec": [], "llamacpp": []}
    for repeat in range(args.repeats):
        for engine in ("jointspec", "llamacpp") if repeat % 2 == 0 else ("llamacpp", "jointspec"):
            command = [sys.executable, __file__, args.model, "--child", engine, "--contexts",
                       *map(str, args.contexts), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
                       "--method", args.method, "--kv-cache", args.kv_cache]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{engine} failed:\n{done.stderr[-2000:]}")
            runs[engine].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"run {repeat + 1} {engine}: {runs[engine][-1]}", file=sys.stderr)
    summary = {}
    print(f"{'context':>8} {'jointspec tok/s':>16} {'llama.cpp tok/s':>16} {'ratio':>7}")
    for context in args.contexts:
        ours, theirs = (statistics.median(run["tokens_per_second"][str(context)] for run in runs[engine])
                        for engine in ("jointspec", "llamacpp"))
        summary[context] = {"jointspec": ours, "llamacpp": theirs, "ratio": ours / theirs}
        print(f"{context:>8} {ours:>16.1f} {theirs:>16.1f} {ours / theirs:>6.2f}x")
    peaks = {engine: max(run["peak_rss_gb"] for run in engine_runs) for engine, engine_runs in runs.items()}
    loads = {engine: statistics.median(run["load_seconds"] for run in engine_runs)
             for engine, engine_runs in runs.items()}
    print(f"peak RSS: jointspec {peaks['jointspec']:.2f} GB, llama.cpp {peaks['llamacpp']:.2f} GB "
          f"({peaks['jointspec'] / peaks['llamacpp']:.2f}x); load: jointspec {loads['jointspec']:.1f} s, "
          f"llama.cpp {loads['llamacpp']:.1f} s")
    print(json.dumps({"model": args.model, "by_context": summary, "peak_rss_gb": peaks, "load_seconds": loads}))


if __name__ == "__main__":
    main()
