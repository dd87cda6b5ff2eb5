"""Forward cost and argmax agreement of the two int4 CPU paths, PyTorch's kernel and jointspec's, beside float32.

PyTorch's int4 kernel runs bfloat16 activations (kernels/quantize.py), jointspec's grouped kernel float32 ones
(kernels/grouped.py).

Loads the model once (float32, ``--kernels auto``), quantises two copies,
prefills the same random ``--context`` tokens into each, then times forwards of k tokens (all k rows of logits,
cropped back after), the (model, k) pairs interleaved over ``--repeats`` passes after one warm-up; prints 20th
percentiles in ms. Then it scores both int4 copies against the float model, teacher-forced on the float model's
greedy answers to the first ``--prompts`` MT-Bench questions: the share of positions with the same argmax.

    python benchmarks/int4_kernel_ab.py --threads 2 --ks 1,2,3,4,6
"""

from __future__ import annotations

import argparse
import random

from interleaved import time_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--ks", default="1,2,3,4,6")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    import torch

    from jointspec.api import GenerationConfig, Pipeline
    from jointspec.backends.loading import load_model, quantized_copy
    from jointspec.bench.prompts import load_prompts
    from jointspec.kernels import grouped
    from jointspec.methods import MethodConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_model(args.model)
    if grouped.kernels() is None:
        raise SystemExit(f"jointspec's grouped kernel cannot run here: {grouped.unavailable_reason()}")
    models = {"float32": target, "grouped int4": quantized_copy(target, "int4")}
    load = grouped._load
    grouped._load = lambda isa: (None, "switched off to compare")  # the next copy takes PyTorch's kernel
    try:
        models["pytorch int4"] = quantized_copy(target, "int4")
    finally:
        grouped._load = load

    rng = random.Random(0)
    prompt = [rng.randrange(target.vocab_size) for _ in range(args.context)]
    for model in models.values():
        model.reset()
        model.forward(prompt, num_logits=0)
    ks = [int(k) for k in args.ks.split(",")]
    cells = time_forwards(models, ks, args.context, args.repeats, rng)
    print("| model | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|" + "---:|" * len(ks))
    for name in models:
        print(f"| {name} | " + " | ".join(f"{cells[name, k]:.1f}" for k in ks) + " |")

    pipeline = Pipeline(target, tokenizer, MethodConfig(name="ar"))
    agree = {name: 0 for name in models if name != "float32"}
    total = 0
    for item in load_prompts("builtin:mt_bench")[:args.prompts]:
        ids = pipeline.encode(item.turns[0])
        answer = pipeline.generate_ids(ids, GenerationConfig(max_new_tokens=args.max_new_tokens)).token_ids
        sequence = ids + answer
        logits = {}
        for name, model in models.items():
            model.reset()
            logits[name] = model.forward(sequence).logits[len(ids) - 1:-1].argmax(-1)
        total += len(answer)
        for name in agree:
            agree[name] += int((logits[name] == logits["float32"]).sum())
    for name, count in agree.items():
        print(f"{name}: argmax equal to float32's at {count}/{total} answer positions")


if __name__ == "__main__":
    main()
