"""Not a benchmark: writes a random-weight Llama-family GGUF of a real model's shape, for speed and memory runs.

Shapes: Llama-3.2-1B, SmolLM2-1.7B and -360M (``llama`` files), Qwen3-0.6B (a ``qwen3`` file: 128-wide heads with
per-head q/k norms).

No larger Llama-family model is on this machine's disk and none may be downloaded, so the larger-model measurements
(docs/lab/benchmarks.md, "A 1B model") run on random weights of a real shape: speed and memory depend on the shape
and the block types, not on the values. Acceptance and perplexity mean nothing on such a model. The tokenizer (and
chat template) is the embedded SmolLM2's, so the vocabulary is 49,152 tokens whatever the shape.

The file is written in F16 with the ``gguf`` package; llama.cpp's own quantiser then writes the block types people
download (``requantize_gguf.py``)::

    python benchmarks/synthetic_gguf.py /tmp/llama1b-f16.gguf --shape llama-3.2-1b
    python benchmarks/requantize_gguf.py /tmp/llama1b-f16.gguf /tmp/llama1b-q4_0.gguf q4_0
    python benchmarks/requantize_gguf.py /tmp/llama1b-f16.gguf /tmp/llama1b-q4_k_m.gguf q4_k_m
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    arch: str = "llama"  # "qwen3": per-head q/k norms (blk.N.attn_q_norm / attn_k_norm)
    head_dim: int | None = None  # None: hidden / heads


# The transformer shapes of real checkpoints (their config.json); the vocabulary is always SmolLM2's.
SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, rope_theta=500000.0),
    "smollm2-1.7b": Shape(hidden=2048, layers=24, heads=32, kv_heads=32, ffn=8192, rope_theta=130000.0),
    "smollm2-360m": Shape(hidden=960, layers=32, heads=15, kv_heads=5, ffn=2560, rope_theta=100000.0),
    "qwen3-0.6b": Shape(hidden=1024, layers=28, heads=16, kv_heads=8, ffn=3072, rope_theta=1000000.0, arch="qwen3",
                        head_dim=128),
}

# Keys of the source file that describe its shape (rewritten) or are rewritten by the writer itself.
_SHAPE_KEYS = {"llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
               "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.freq_base",
               "llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length",
               "general.file_type", "general.architecture", "general.name", "general.size_label",
               "general.quantization_version"}


def write(path: str, shape: Shape, name: str, seed: int = 0) -> int:
    """Write the model; returns its parameter count."""
    import gguf

    from jointspec.backends.embedded import default_gguf_path

    source = gguf.GGUFReader(str(default_gguf_path()))
    writer = gguf.GGUFWriter(path, shape.arch, use_temp_file=True)
    writer.add_name(f"random {name}")
    for key, field in source.fields.items():
        if key in _SHAPE_KEYS or key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        if key.startswith("llama."):  # the source's architecture keys (context length, epsilon...) under ours
            key = f"{shape.arch}.{key[len('llama.'):]}"
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    writer.add_block_count(shape.layers)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    head_dim = shape.head_dim or shape.hidden // shape.heads
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    rng = np.random.default_rng(seed)
    vocab = int(source.fields["llama.vocab_size"].contents())
    count = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal count
        weights = (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)
        writer.add_tensor(name, weights)
        count += rows * cols

    def norm(name: str, size: int = shape.hidden) -> None:
        nonlocal count
        writer.add_tensor(name, np.ones(size, dtype=np.float32))
        count += size

    matrix("token_embd.weight", vocab, shape.hidden)  # tied: the output layer reads it too
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        norm(f"{block}.attn_norm.weight")
        matrix(f"{block}.attn_q.weight", shape.heads * head_dim, shape.hidden)
        matrix(f"{block}.attn_k.weight", shape.kv_heads * head_dim, shape.hidden)
        matrix(f"{block}.attn_v.weight", shape.kv_heads * head_dim, shape.hidden)
        matrix(f"{block}.attn_output.weight", shape.hidden, shape.heads * head_dim)
        if shape.arch == "qwen3":
            norm(f"{block}.attn_q_norm.weight", head_dim)
            norm(f"{block}.attn_k_norm.weight", head_dim)
        norm(f"{block}.ffn_norm.weight")
        matrix(f"{block}.ffn_gate.weight", shape.ffn, shape.hidden)
        matrix(f"{block}.ffn_up.weight", shape.ffn, shape.hidden)
        matrix(f"{block}.ffn_down.weight", shape.hidden, shape.ffn)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the .gguf file to write (F16)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    count = write(args.out, SHAPES[args.shape], args.shape, args.seed)
    print(f"wrote {args.out}: {args.shape} shape, {count / 1e9:.2f} B parameters, random weights (F16)")


if __name__ == "__main__":
    main()
