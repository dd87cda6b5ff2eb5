"""Qwen3 dense models on jointspec's compiled CPU layers.

A Qwen3 decoder layer is a Llama layer (no q/k/v biases, unlike Qwen2) whose every query and key head is RMS-normed
over its head dimension before the rotary embedding (``q_norm`` / ``k_norm``, plain weights as Llama's norms). The
compiled layer already computes those per-head norms row by row for Gemma-3 (``CompiledLayers.set_extras`` in
kernels/csrc), so a Qwen3 model quantised to jointspec's grouped layers runs its whole decoder in one C++ call, as a
Llama model does, each row computed alone: plain and speculative decoding of the model agree exactly.

A forward the compiled layers do not take (more rows than their attention reads at once, a cache not made of
jointspec's buffered layers, a model changed since) runs transformers' own forward; so does a Qwen3 model not on the
grouped kernels (:func:`lean_qwen3_for` returns None), one with sliding-window layers, or a mixture-of-experts one
(another class).
"""

from __future__ import annotations

import torch
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from jointspec.backends.lean_forward import (
    LeanLlamaForward,
    accelerate_hooked,
    compiled_forward_for,
    replaced_part,
)


def qwen3_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take :class:`LeanQwen3Forward` (None: it can)."""
    if type(model) is not qwen3.Qwen3ForCausalLM:
        return f"{type(model).__name__} is not transformers' Qwen3ForCausalLM"
    base, config = model.model, model.config
    if type(base) is not qwen3.Qwen3Model or base.training:
        return "the body is not transformers' Qwen3Model in inference mode"
    if accelerate_hooked(model):
        return "the model carries accelerate hooks (device_map offloading)"
    if any(kind != "full_attention" for kind in config.layer_types):
        return "sliding-window attention layers"
    parts = [(base.norm, qwen3.Qwen3RMSNorm), (base.rotary_emb, qwen3.Qwen3RotaryEmbedding)]
    for layer in base.layers[:config.num_hidden_layers]:
        attn = layer.self_attn
        parts += [(layer, qwen3.Qwen3DecoderLayer), (attn, qwen3.Qwen3Attention), (layer.mlp, qwen3.Qwen3MLP)]
        parts += [(norm, qwen3.Qwen3RMSNorm) for norm in (layer.input_layernorm, layer.post_attention_layernorm,
                                                           attn.q_norm, attn.k_norm)]
    replaced = replaced_part(parts)
    if replaced is not None:
        return replaced
    # The compiled layer takes one epsilon for all of a layer's norms.
    if any(norm.variance_epsilon != config.rms_norm_eps for norm, kind in parts if kind is qwen3.Qwen3RMSNorm):
        return "norms with different epsilons"
    return None


def lean_qwen3_for(model: torch.nn.Module) -> LeanQwen3Forward | None:
    """A :class:`LeanQwen3Forward` over ``model`` where its layers fit the compiled ones, else None (transformers'
    forward)."""
    return compiled_forward_for(LeanQwen3Forward, model)


class LeanQwen3Forward(LeanLlamaForward):
    """``Qwen3ForCausalLM.forward`` for one sequence with a cache, on the compiled layers (module docstring)."""

    FAMILY_NAME = "Qwen3"
    unsupported_reason = staticmethod(qwen3_unsupported_reason)
    # attention_mass() rebuilds Llama's queries, without the per-head norms.
    reads_attention = False
    # The 4-bit screen's margin was set on SmolLM2's 49,152-token head and missed on Gemma-3's; no Qwen3 file was at
    # hand to measure it on a 151,936-token one (docs/kernels.md, "Architectures"). The exact head, always.
    screens_head = False
    HEAD_NORMS = ("q_norm", "k_norm")
    # Llama's Python operations lack the q/k norms: a forward the compiled layers do not take runs transformers'.
    llama_operations = False

    def _add_extras(self, index: int, layer: qwen3.Qwen3DecoderLayer) -> None:
        attn = layer.self_attn
        self._compiled_stack.set_extras(index, attn.q_norm.weight, attn.k_norm.weight, None, None, False, 0, 0)
