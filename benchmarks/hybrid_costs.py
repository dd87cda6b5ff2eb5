"""What a verification costs on a hybrid model: a forward of 1 to 16 tokens after a prompt, with transformers' own
chunked recurrent forms and with jointspec's short-chain forms (backends/recurrent.py), in one process.

Random weights in the shapes of IBM's Granite-4.0-H-350M (Mamba-2 layers with 4 attention ones) and Qwen's
Qwen3.5-0.8B (Gated DeltaNet layers, every fourth full attention), on jointspec's int4 CPU kernels (``--quantize``) or
float32: the cost of a forward does not depend on the weights' values, and no such model's weights are on this
machine. The two forms alternate within each repeat, so a machine whose speed drifts slows both alike. Prints the
median milliseconds per forward and each against one token's, then one JSON line::

    python benchmarks/hybrid_costs.py --threads 2
    python benchmarks/hybrid_costs.py --shapes qwen3.5-0.8b --quantize none --rows 1,2,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import transformers

from jointspec.backends.hf import CausalLM
from jointspec.backends.loading import quantized_copy


def granite4_350m() -> transformers.PreTrainedModel:
    types = ["mamba"] * 32
    for index in (10, 13, 17, 27):
        types[index] = "attention"
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=100352, hidden_size=768, intermediate_size=2048, shared_intermediate_size=2048,
        num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=32768,
        layer_types=types, mamba_n_heads=48, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=128, mamba_expand=2,
        mamba_chunk_size=256, num_local_experts=0, tie_word_embeddings=True)
    return transformers.GraniteMoeHybridForCausalLM(config).eval()


def qwen3_5_0_8b() -> transformers.PreTrainedModel:
    config = transformers.Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=32768,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True)
    return transformers.Qwen3_5ForCausalLM(config).eval()


SHAPES = {"granite-4.0-h-350m": granite4_350m, "qwen3.5-0.8b": qwen3_5_0_8b}
FORMS = ("mamba2_chunk_scan", "torch_chunk_gated_delta_rule")


def use_forms(module, short: bool) -> None:
    """Put the short-chain forms (``short``) or the chunked forms they wrap into the model's module."""
    for name in FORMS:
        form = getattr(module, name, None)
        if form is None:
            continue
        wrapper = form if getattr(form, "short_chains", False) else getattr(module, f"_short_{name}")
        setattr(module, f"_short_{name}", wrapper)
        setattr(module, name, wrapper if short else wrapper.chunked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--rows", default="1,2,3,4,6,8,16", help="tokens per forward, comma-separated")
    parser.add_argument("--prompt", type=int, default=512, help="tokens cached before each forward")
    parser.add_argument("--quantize", choices=("int4", "none"), default="int4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = {}
    for shape in args.shapes.split(","):
        torch.manual_seed(0)
        model = SHAPES[shape]()
        target = CausalLM(model, name=shape)  # (installs the short-chain forms)
        if args.quantize == "int4":
            target = quantized_copy(target, "int4")
        module = sys.modules[type(model).__module__]
        target.forward(torch.randint(10, 1000, (args.prompt,)).tolist(), num_logits=0)
        times = {(short, n): [] for short in (False, True) for n in rows}
        for _ in range(args.repeats):
            for n in rows:
                for short in (False, True):
                    use_forms(module, short)
                    start = time.perf_counter()
                    target.forward(list(range(100, 100 + n)))
                    times[short, n].append(time.perf_counter() - start)
                    target.crop(args.prompt)
        use_forms(module, True)
        medians = {key: 1000 * statistics.median(value) for key, value in times.items()}
        for short in (False, True):
            label = "short-chain forms" if short else "transformers' chunked forms"
            one = medians[short, rows[0]]
            print(f"{shape}, {args.quantize}, {label}: " + ", ".join(
                f"{n}: {medians[short, n]:.0f} ms ({medians[short, n] / one:.2f}x)" for n in rows))
        results[shape] = {"short": {n: medians[True, n] for n in rows}, "chunked": {n: medians[False, n] for n in rows}}
    print(json.dumps({"quantize": args.quantize, "prompt": args.prompt, "threads": args.threads,
                      "milliseconds": results}))


if __name__ == "__main__":
    main()
