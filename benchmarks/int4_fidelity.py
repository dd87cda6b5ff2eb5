"""How far the int4 model moves from the float32 model of the same weights, and from llama.cpp on the same file.

The embedded model (or ``--model``) is loaded twice: on jointspec's int4 kernels (``--quantize auto``) and in float32
(``--quantize none``: the GGUF's own weights, dequantised). The float32 model answers the first ``--prompts``
MT-Bench questions greedily (``--tokens`` each, chat template); then every model reads prompt and answer
teacher-forced, in chunks of at most 128 rows (so the int4 layers read them row-wise, as decoding does), and at
each answer position this compares:

- the mean absolute difference of the logits of llama.cpp's top 5 tokens (or the float32 model's top 5 where
  llama-cpp-python is not installed or the model is not a GGUF file): int4 with 8-bit inputs, int4 with float
  inputs (``float_inputs()``) and llama.cpp, each against the float32 model, and int4 against llama.cpp;
- how often each one's argmax is the float32 model's.

Then the perplexity of each model on the first ``--text-prompts`` questions' own text (no template). Deterministic
(greedy, no timing); prints a table and one JSON line::

    python benchmarks/int4_fidelity.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import math


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or model folder (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=16, help="MT-Bench questions answered (default 16)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of each float32 answer (default 64)")
    parser.add_argument("--text-prompts", type=int, default=40, help="questions for the perplexity (default 40)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if min(args.prompts, args.tokens, args.text_prompts) < 1:
        parser.error("--prompts, --tokens and --text-prompts must be at least 1")

    import torch

    from jointspec.backends.loading import gguf_path, load_model
    from jointspec.bench.prompts import load_prompts
    from jointspec.kernels.grouped import float_inputs
    from jointspec.kernels.quantize import quantization_mode

    if args.threads:
        torch.set_num_threads(args.threads)
    int4, tokenizer = load_model(args.model, quantize="auto")
    if quantization_mode(int4.model) != "int4":
        raise SystemExit(f"--quantize auto keeps {args.model or 'the embedded model'} in float here: no int4 layers "
                         "to measure (a GGUF file of 4- or 5-bit blocks, on a CPU the kernels run on, has them)")
    fp32, _ = load_model(args.model, quantize="none")
    llama, gguf = None, gguf_path(args.model)
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    if llama_cpp is not None and gguf is not None:  # a model folder has no llama.cpp file to compare with
        from jointspec.backends.llamacpp import llama_class_params

        with llama_class_params():  # as the bench's llamacpp rows: no AMX buffers where they crash
            llama = llama_cpp.Llama(str(gguf), n_ctx=1024, logits_all=True, verbose=False,
                                    n_threads=args.threads or torch.get_num_threads())
    questions = load_prompts("builtin:mt_bench")

    def rows(model, ids: list[int]) -> torch.Tensor:  # logits of every position, read 128 rows at a time
        model.reset()
        return torch.cat([model.forward(ids[i:i + 128]).logits for i in range(0, len(ids), 128)]).double()

    def llama_rows(ids: list[int]) -> torch.Tensor:
        llama.reset()
        llama.eval(ids)
        return torch.tensor(llama.scores[:len(ids)], dtype=torch.float64)

    names = ["int4, 8-bit inputs", "int4, float inputs"] + (["llama.cpp"] if llama else [])
    difference = {name: 0.0 for name in names + (["int4 vs llama.cpp"] if llama else [])}
    agree = {name: 0 for name in names}
    positions = 0
    for question in questions[:args.prompts]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        fp32.reset()
        sequence, logits = list(ids), fp32.forward(ids).logits
        for _ in range(args.tokens):
            sequence.append(int(logits[-1].argmax()))
            logits = fp32.forward(sequence[-1:]).logits
        answer = slice(len(ids) - 1, len(sequence) - 1)  # the positions that predict the answer's tokens
        reference = rows(fp32, sequence[:-1])[answer]
        found = {"int4, 8-bit inputs": rows(int4, sequence[:-1])[answer]}
        with float_inputs():
            found["int4, float inputs"] = rows(int4, sequence[:-1])[answer]
        if llama:
            found["llama.cpp"] = llama_rows(sequence[:-1])[answer]
        top = (found["llama.cpp"] if llama else reference).topk(5, dim=-1).indices
        picked = {name: table.gather(-1, top) for name, table in found.items()}
        for name in names:
            difference[name] += float((picked[name] - reference.gather(-1, top)).abs().mean(-1).sum())
            agree[name] += int((found[name].argmax(-1) == reference.argmax(-1)).sum())
        if llama:
            difference["int4 vs llama.cpp"] += float(
                (picked["int4, 8-bit inputs"] - picked["llama.cpp"]).abs().mean(-1).sum())
        positions += reference.shape[0]

    losses = {"float32": 0.0, "int4, 8-bit inputs": 0.0}
    count = 0
    for question in questions[:args.text_prompts]:
        ids = tokenizer(question.turns[0], add_special_tokens=False).input_ids
        targets = torch.tensor(ids[1:])
        losses["float32"] += float(torch.nn.functional.cross_entropy(rows(fp32, ids)[:-1], targets, reduction="sum"))
        losses["int4, 8-bit inputs"] += float(torch.nn.functional.cross_entropy(rows(int4, ids)[:-1], targets,
                                                                                 reduction="sum"))
        count += len(targets)

    print(f"{positions} answer positions ({args.prompts} MT-Bench answers of {args.tokens} tokens, float32's), top 5 "
          f"tokens of {'llama.cpp' if llama else 'the float32 model'}")
    print("| against the float32 model | mean top-5 logit difference | argmax the same |")
    print("|---|---:|---:|")
    for name in names:
        print(f"| {name} | {difference[name] / positions:.3f} | {agree[name]} / {positions} |")
    if llama:
        print(f"int4 (8-bit inputs) against llama.cpp: {difference['int4 vs llama.cpp'] / positions:.3f}")
    perplexity = {name: math.exp(loss / count) for name, loss in losses.items()}
    print(f"perplexity over {count} tokens of question text: " +
          ", ".join(f"{name} {value:.2f}" for name, value in perplexity.items()))
    print(json.dumps({"positions": positions, "difference": {k: v / positions for k, v in difference.items()},
                      "argmax_agree": agree, "perplexity": perplexity, "perplexity_tokens": count}))


if __name__ == "__main__":
    main()
