"""Forward cost of the compiled int4 decoder layer next to the same layers run op by op, and GEMM vs row-wise prefill.

The compiled layer is ``decoder_layer`` in kernels/csrc, called from backends/lean_forward.py.

Two adapters over one int4 model (``--quantize int4`` on jointspec's grouped kernel): ``compiled`` runs each layer as
one compiled call, ``ops`` the lean forward's PyTorch operations around the same grouped kernels. For each
``--contexts`` length both prefill the same random tokens; each of ``--repeats`` passes then times every (forward, k)
pair once in a shuffled order (benchmarks/interleaved.py), the first pass a discarded warm-up; 20th percentiles in ms.
Before timing it checks that the two agree to float rounding (on float inputs: 8-bit ones would flip levels) and that
the compiled layer gives a chain of k tokens bit for bit the logits of feeding them one by one. Last, the time of a
prefill of each context (a forward that asks no logits: the GEMM path) against the same forward row by row (``ops``),
the best of ``--repeats``. Run on a quiet machine:

    python benchmarks/compiled_layer_cost.py --threads 2 --contexts 200,1000 --ks 1,2,4,6
"""

from __future__ import annotations

import argparse
import random
import time

from interleaved import time_forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--contexts", default="200,1000")
    parser.add_argument("--ks", default="1,2,4,6")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from jointspec.backends.hf import CausalLM
    from jointspec.backends.loading import load_model
    from jointspec.kernels.grouped import float_inputs

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded, _ = load_model(args.model, quantize="int4")
    adapters = {"compiled": CausalLM(loaded.model, name="compiled"), "ops": CausalLM(loaded.model, name="ops")}
    if adapters["compiled"].lean is None or adapters["compiled"].lean.compiled is None:
        raise SystemExit(f"{args.model} does not take the compiled int4 layers here (no AVX-512 kernel, or not a "
                         "transformers Llama model)")
    adapters["ops"].lean.compiled = None
    rng = random.Random(args.seed)
    ks = [int(k) for k in args.ks.split(",")]
    print("| context | " + " | ".join(f"{name} k={k}" for name in adapters for k in ks) + " | compiled / ops |")
    print("|---:|" + "---:|" * (len(adapters) * len(ks) + 1))
    prefills = []
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = [rng.randrange(loaded.vocab_size) for _ in range(context)]
        check = [rng.randrange(loaded.vocab_size) for _ in range(max(ks))]
        # The two paths agree to float rounding on float inputs only: 8-bit inputs turn a last-bit difference into a
        # flipped level (kernels.grouped.float_inputs). The timings below run on the 8-bit inputs decoding runs on.
        with float_inputs():
            for adapter in adapters.values():
                adapter.reset()
                adapter.forward(prompt, num_logits=1)  # row by row in both: the checks compare steps, not prefills
            if not torch.allclose(adapters["compiled"].forward(check).logits, adapters["ops"].forward(check).logits,
                                  rtol=1e-3, atol=1e-3):
                raise SystemExit("the compiled layer and the operation-by-operation forward disagree beyond rounding")
        adapters["compiled"].crop(context)
        chain = adapters["compiled"].forward(check).logits
        adapters["compiled"].crop(context)
        steps = torch.cat([adapters["compiled"].forward([token]).logits for token in check])
        if not torch.equal(chain, steps):
            raise SystemExit("the compiled layer's rows depend on the batch (a bug: speculation would not be exact)")
        for adapter in adapters.values():
            adapter.crop(context)
        cells = time_forwards(adapters, ks, context, args.repeats, rng)
        ratios = " / ".join(f"{cells['compiled', k] / cells['ops', k]:.2f}" for k in ks)
        print(f"| {context} | " + " | ".join(f"{c:.1f}" for c in cells.values()) + f" | {ratios} |", flush=True)
        best = {}
        for name, adapter in adapters.items():
            runs = []
            for _ in range(max(3, args.repeats // 5)):
                adapter.reset()
                start = time.perf_counter()
                adapter.forward(prompt, num_logits=0)
                runs.append(time.perf_counter() - start)
            best[name] = min(runs) * 1e3
        prefills.append(f"| {context} | {best['compiled']:.0f} | {best['ops']:.0f} |")
    print("\n| prefill of | compiled (GEMM) ms | ops (row by row) ms |\n|---:|---:|---:|")
    print("\n".join(prefills))


if __name__ == "__main__":
    main()
