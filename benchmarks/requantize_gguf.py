"""Not a benchmark: writes a GGUF in another llama.cpp quantisation type, as input for llamacpp_cost_curve.py.

It goes through llama-cpp-python's ``llama_model_quantize``. Used to ask whether llama.cpp's verification cost depends
on the weight format (docs/lab/benchmarks.md, section 5):

    python benchmarks/requantize_gguf.py default /tmp/smollm2-q4_0.gguf q4_0
    python benchmarks/llamacpp_cost_curve.py --model /tmp/smollm2-q4_0.gguf --threads 2 --no-flash-attn-off

Requantising an already quantised file (the embedded default is Q4_1) changes the model: its outputs are not the
embedded model's. Q8_0 stays closest to it; Q4_0 rounds the weights a second time.
"""

from __future__ import annotations

import argparse
import sys

TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
         "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
         "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "f16": "LLAMA_FTYPE_MOSTLY_F16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="'default' (the embedded SmolLM2 GGUF) or a .gguf path")
    parser.add_argument("out", help="the .gguf file to write")
    parser.add_argument("type", choices=sorted(TYPES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import llama_cpp

    from jointspec.backends.embedded import default_gguf_path

    source = str(default_gguf_path()) if args.source == "default" else args.source
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, TYPES[args.type])
    params.allow_requantize = True  # the source is usually quantised already
    params.nthread = args.threads
    if llama_cpp.llama_model_quantize(source.encode(), args.out.encode(), params) != 0:
        sys.exit(f"llama.cpp could not requantise {source} to {args.type}")
    print(f"wrote {args.out} ({args.type}) from {source}")


if __name__ == "__main__":
    main()
