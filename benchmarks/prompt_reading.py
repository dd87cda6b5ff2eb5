"""Reading a prompt on the compiled int4 layers: row by row, one GEMM a chunk, and the build's own way, alternating.

The AVX-512 builds read every prompt row by row, in chunks of ``ROWWISE_PREFILL_CHUNK`` rows; the AVX2 builds read a
prompt's first ``ROWWISE_PROMPT_TOKENS`` positions that way and the rest in GEMM chunks (backends/lean_forward.py,
docs/kernels.md). For each ``--lengths`` prompt of random tokens this times the three ways on the same model, their
order rotating from one repeat to the next (so a machine whose speed drifts slows each alike), as the decode loop
reads a prompt: every token but the last without logits, then the last with them. Prints the medians and each
against the GEMM's, then one JSON line::

    python benchmarks/prompt_reading.py --threads 2
    python benchmarks/prompt_reading.py --lengths 150,400,1024 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from jointspec.backends.lean_forward import ROWWISE_PREFILL_CHUNK, gemm_prefill_chunk
from jointspec.backends.loading import load_model
from jointspec.kernels.grouped import selected_isa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", default="130,200,300,512,700,1024,2048", help="prompt tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    lengths = [int(n) for n in args.lengths.split(",")]
    if min(lengths) < 2:
        parser.error("every length must be at least 2 tokens")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, _ = load_model(args.model, quantize="int4")
    lean = target.lean
    if lean is None or lean.compiled is None:
        raise SystemExit(f"{args.model}: not on the compiled int4 layers here; nothing to compare")
    if max(lengths) >= target.max_context:
        parser.error(f"the model holds {target.max_context} tokens; the longest length must be below that")
    own = (lean.prefill_chunk, lean.prefill_gemm_rows, lean.alone_prompt_tokens)
    ways = {  # (prefill chunk, rows from which a forward takes the GEMM, leading positions read row by row)
        "row by row": (ROWWISE_PREFILL_CHUNK, math.inf, 0),
        "GEMM chunks": (gemm_prefill_chunk(target.model.config.intermediate_size), ROWWISE_PREFILL_CHUNK + 1, 0),
        "own": own,
    }
    generator = torch.Generator().manual_seed(args.seed)
    vocab = target.vocab_size
    print(f"{selected_isa()} build, {torch.get_num_threads()} threads, {args.model}; medians of {args.repeats}, ms "
          f"(own: prefill chunk {own[0]}, GEMM from {own[1]} rows, first {own[2]} positions row by row)")
    print(f"{'tokens':>7} {'row by row':>11} {'GEMM chunks':>12} {'own':>9} {'row/GEMM':>9} {'own/GEMM':>9}")
    rows = []
    try:
        for length in lengths:
            ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
            seconds: dict[str, list[float]] = {way: [] for way in ways}
            for repeat in range(args.repeats + 1):  # the first pass warms up, untimed
                names = list(ways)
                for way in names[repeat % len(names):] + names[:repeat % len(names)]:
                    lean.prefill_chunk, lean.prefill_gemm_rows, lean.alone_prompt_tokens = ways[way]
                    target.reset(length=length)
                    start = time.perf_counter()
                    target.forward(ids[:-1], num_logits=0)
                    target.forward(ids[-1:], num_logits=1)
                    if repeat:
                        seconds[way].append(time.perf_counter() - start)
            rowwise, gemm, mine = (statistics.median(seconds[way]) * 1000 for way in ways)
            rows.append({"tokens": length, "row_by_row_ms": rowwise, "gemm_ms": gemm, "own_ms": mine,
                         "row_by_row_ratio": rowwise / gemm, "own_ratio": mine / gemm})
            print(f"{length:>7} {rowwise:>11.1f} {gemm:>12.1f} {mine:>9.1f} {rowwise / gemm:>8.3f}x "
                  f"{mine / gemm:>8.3f}x", flush=True)
    finally:
        lean.prefill_chunk, lean.prefill_gemm_rows, lean.alone_prompt_tokens = own
    print(json.dumps({"isa": selected_isa(), "threads": torch.get_num_threads(), "model": args.model,
                      "repeats": args.repeats, "lengths": rows}))


if __name__ == "__main__":
    main()
