"""Run by the interop tests with a Python that has ``speculators`` installed (its own virtual environment: it pins
an older transformers than jointspec's). Two jobs, both on a tiny SmolLM2-shaped target that the test builds:

- ``write FOLDER VERIFIER ...``: speculators' own ``Eagle3DraftModel`` for the target saved in VERIFIER, randomly
  initialised but for the target's embedding, saved with its own ``save_pretrained`` (what jointspec must read);
- ``score FOLDER INPUTS OUT``: that model, loaded with speculators' own ``from_pretrained``, runs its training-time
  forward (``ttt_steps`` steps, teacher-forced tokens) on the token ids and auxiliary hidden states in INPUTS; the
  logits of every step are caught at its ``lm_head`` and saved to OUT.

Only this file imports ``speculators``; it never imports jointspec.
"""

from __future__ import annotations

import sys

import torch


def tiny_layer_config(vocab: int, hidden: int):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    return config


def write(folder: str, verifier: str, draft_vocab: int, aux: list[int], norm_before_residual: bool) -> None:
    from safetensors.torch import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    embed = load_file(f"{verifier}/model.safetensors")["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tiny_layer_config(vocab, hidden), draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual, eagle_aux_hidden_state_layer_ids=aux,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.startswith("verifier_") or name == "embed_tokens.weight":
                continue
            # Random weights of a size that moves the logits (a fresh head's zeros and nan placeholders would not).
            scale, offset = (0.2, 0.0) if parameter.dim() > 1 else (0.1, 1.0)  # norms' weights stay near 1
            parameter.copy_(torch.randn_like(parameter) * scale + offset)
        # Every other target token in the draft vocabulary: d2t[i] = target id - i.
        target_ids = torch.arange(0, 2 * draft_vocab, 2)[:draft_vocab]
        d2t = target_ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[target_ids] = True
        model.load_vocab_mappings(t2d, d2t)
        model.embed_tokens.weight.copy_(embed)
    model.save_pretrained(folder)


def score(folder: str, inputs: str, out: str) -> None:
    from speculators.models.eagle3.core import Eagle3DraftModel

    data = torch.load(inputs)
    from speculators.models.attention import create_float_mask

    model = Eagle3DraftModel.from_pretrained(folder).float().eval()
    # Dense float masks and eager attention on the CPU, in place of the flex attention it trains with on GPUs: the
    # same masks (speculators' own dense path), computable here.
    model.config.transformer_layer_config._attn_implementation = "eager"
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    model._attn_impl = "eager"
    model._create_mask_fn = create_float_mask
    caught = []
    model.lm_head.register_forward_hook(lambda module, args, output: caught.append(output[0].clone()))
    ids = data["input_ids"][None]
    with torch.no_grad():
        model(hidden_states=data["hidden_states"][None], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=1 + torch.arange(ids.shape[1])[None], ttt_steps=data["ttt_steps"])
    torch.save({"logits": caught}, out)


if __name__ == "__main__":
    job = sys.argv[1]
    if job == "write":
        folder, verifier, draft_vocab, aux, nbr = sys.argv[2:7]
        write(folder, verifier, int(draft_vocab), [int(i) for i in aux.split(",")], nbr == "1")
    elif job == "score":
        score(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown job {job!r}")
