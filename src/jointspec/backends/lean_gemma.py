"""Gemma-3 text models on jointspec's compiled CPU layers.

A Gemma-3 decoder layer is a Llama layer with five additions, each computed row by row: every query and key head
RMS-normed before the rotary embedding; each block's output RMS-normed before its residual add; gelu_tanh where
Llama has SiLU; norms that multiply by 1 + weight; and two kinds of layer, most of them sliding (each row sees the
last ``sliding_window`` positions, rotated with their own base), every few a full-attention one. The compiled layer
takes these per layer (``CompiledLayers.set_extras`` in kernels/csrc), so a Gemma-3 model quantised to jointspec's
grouped layers runs its whole decoder in one C++ call, as a Llama model does (:mod:`jointspec.backends.lean_forward`),
instead of through transformers' modules: each row still computed alone, so plain and speculative decoding of the
model agree exactly.

A forward the compiled layers do not take (more rows than their attention reads at once, a cache not made of
jointspec's buffered layers, a model changed since) runs transformers' own forward, as the adapter runs any model
without a lean forward; so does a Gemma-3 model not on the grouped kernels (:func:`lean_gemma_for` returns None).
The (1 + weight) norm factors are computed once, when the layers are registered: the weights are not expected to
change under a loaded model.
"""

from __future__ import annotations

import torch
from transformers.models.gemma3 import modeling_gemma3 as gemma3

from jointspec.backends.kvcache import BufferedLayer, BufferedSlidingLayer, sliding_window_mask
from jointspec.backends.lean_forward import (
    LeanLlamaForward,
    accelerate_hooked,
    compiled_forward_for,
    replaced_part,
    screen_rank,
    transformers_forward,
)

# The layer kinds, in the order of the compiled layers' rotary pairs and views (a layer's index into both).
LAYER_TYPES = ("full_attention", "sliding_attention")

# A layer's norms: the attention block's input norm, then the MLP's (as Llama's two), then the blocks' output norms.
NORMS = ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")


def gemma_unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take :class:`LeanGemmaForward` (None: it can)."""
    if type(model) is not gemma3.Gemma3ForCausalLM:
        return f"{type(model).__name__} is not transformers' Gemma3ForCausalLM"
    base, config = model.model, model.config
    if type(base) is not gemma3.Gemma3TextModel or base.training:
        return "the body is not transformers' Gemma3TextModel in inference mode"
    if accelerate_hooked(model):
        return "the model carries accelerate hooks (device_map offloading)"
    if config.attn_logit_softcapping is not None or config.final_logit_softcapping is not None:
        return "logit soft-capping"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if config.hidden_activation != "gelu_pytorch_tanh":
        return f"the activation {config.hidden_activation}"
    if not set(config.layer_types) <= set(LAYER_TYPES):
        return f"layer types {sorted(set(config.layer_types) - set(LAYER_TYPES))}"
    parts = [(base.norm, gemma3.Gemma3RMSNorm), (base.rotary_emb, gemma3.Gemma3RotaryEmbedding)]
    for layer in base.layers[:config.num_hidden_layers]:
        attn = layer.self_attn
        parts += [(layer, gemma3.Gemma3DecoderLayer), (attn, gemma3.Gemma3Attention), (layer.mlp, gemma3.Gemma3MLP)]
        parts += [(norm, gemma3.Gemma3RMSNorm) for norm in (*map(layer.__getattr__, NORMS), attn.q_norm, attn.k_norm)]
    replaced = replaced_part(parts)
    if replaced is not None:
        return replaced
    # The compiled layer takes one epsilon for all of a layer's norms.
    if any(norm.eps != config.rms_norm_eps for norm, kind in parts if kind is gemma3.Gemma3RMSNorm):
        return "norms with different epsilons"
    return None


def lean_gemma_for(model: torch.nn.Module) -> LeanGemmaForward | None:
    """A :class:`LeanGemmaForward` over ``model`` where its layers fit the compiled ones, else None (transformers'
    forward)."""
    return compiled_forward_for(LeanGemmaForward, model)


class LeanGemmaForward(LeanLlamaForward):
    """``Gemma3ForCausalLM.forward`` for one sequence with a cache, on the compiled layers (module docstring)."""

    FAMILY_NAME = "Gemma-3"
    unsupported_reason = staticmethod(gemma_unsupported_reason)
    reads_attention = False
    # The 4-bit screen's error on Gemma-3-270M's 262,144-token head is too wide for the margin tuned on SmolLM2: it
    # missed the exact argmax in 1 of 24 answers (docs/kernels.md, "The screened head"). The exact head, always.
    screens_head = False
    NORMS = NORMS
    HEAD_NORMS = ("q_norm", "k_norm")

    def _activation_fits(self) -> bool:
        return self.model.config.hidden_activation == "gelu_pytorch_tanh"

    @staticmethod
    def _norm_weight(norm: gemma3.Gemma3RMSNorm) -> torch.Tensor:
        # Gemma3RMSNorm multiplies the normed row by 1 + weight, computed in float32.
        return (1.0 + norm.weight.float()).contiguous()

    @staticmethod
    def _norm_eps(norm: gemma3.Gemma3RMSNorm) -> float:
        return norm.eps

    def _add_extras(self, index: int, layer: gemma3.Gemma3DecoderLayer) -> None:
        attn, weight = layer.self_attn, self._norm_weight
        kind = LAYER_TYPES.index(attn.layer_type)
        self._compiled_stack.set_extras(index, weight(attn.q_norm), weight(attn.k_norm),
                                        weight(layer.post_attention_layernorm),
                                        weight(layer.post_feedforward_layernorm), True, kind, kind)

    @staticmethod
    def _compiled_call_ready(n: int, cache) -> bool:
        from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

        return n <= ROWWISE_MAX_ROWS and all(type(layer) in (BufferedLayer, BufferedSlidingLayer)
                                             for layer in cache.layers)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache, num_logits: int,
                 hidden_layers: tuple[int, ...] = (), argmax_only: bool = False, top_k_only: int = 0,
                 allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As :meth:`LeanLlamaForward.__call__`; ``attention_mask`` may also be the adapter's dict of a 4-D mask
        per layer kind."""
        model = self.model
        base, config = model.model, model.config
        n = input_ids.shape[1]
        if input_ids.shape[0] != 1 or model.dtype != torch.float32 or not self._compiled_ready(n, cache):
            return transformers_forward(model, input_ids, position_ids, attention_mask, cache, num_logits,
                                        hidden_layers)
        hidden = base.embed_tokens(input_ids)
        ropes = self._ropes(hidden, position_ids)
        num_layers = config.num_hidden_layers
        wanted = {layer % (num_layers + 1) for layer in hidden_layers}
        kept: dict[int, torch.Tensor] = {0: hidden} if 0 in wanted else {}
        prefill = num_logits == 0 and n >= self.prefill_gemm_rows
        segment = self._segment(hidden, position_ids, attention_mask, cache)
        hidden = self._final_norm(self._compiled_body(hidden, ropes, segment, wanted, kept, prefill))
        if num_layers in wanted:
            kept[num_layers] = hidden
        logits = self._head(hidden, num_logits, screen_rank(argmax_only, top_k_only), allowed)
        return logits, {layer: kept[layer % (num_layers + 1)] for layer in hidden_layers}

    def _ropes(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # One pair per layer kind, in LAYER_TYPES' order (a layer's ``rope`` index).
        return [self.model.model.rotary_emb(hidden, position_ids, kind) for kind in LAYER_TYPES]

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.model.norm(hidden)

    def _segment(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache) -> tuple:
        """As :meth:`LeanLlamaForward._segment`, with one view per layer kind: the full layers' and the sliding
        layers', where each row sees only keys less than ``sliding_window`` positions back (positions as the adapter
        gives them: cached entry j at position j)."""
        from jointspec.kernels.quantize import compiled_visibility

        n = inputs_embeds.shape[1]
        keys = cache.get_seq_length() + n
        if attention_mask is None:  # a chain after the cache
            full = compiled_visibility(None, keys, n)
            window = self.model.config.sliding_window
            if keys <= window:  # every key is within every row's window
                views = [full, full]
            else:
                positions = position_ids[0]
                key_positions = torch.arange(keys, device=positions.device)
                seen = (key_positions[None, :] <= positions[:, None]) & sliding_window_mask(positions, key_positions,
                                                                                            window)
                views = [full, compiled_visibility(seen[None, None], keys, n)]
        else:
            masks = attention_mask if isinstance(attention_mask, dict) else dict.fromkeys(LAYER_TYPES, attention_mask)
            views = [compiled_visibility(masks[kind], keys, n) for kind in LAYER_TYPES]
        return views, self._slots(inputs_embeds, cache)
