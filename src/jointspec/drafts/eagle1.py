"""EAGLE-1 draft heads in the layout vLLM and SGLang load, read for ``--draft DIR``.

**The head** (EAGLE, arXiv 2401.15077; SafeAILab/EAGLE ``eagle/model/cnets.py``), as vLLM's ``llama_eagle.py`` and
SGLang's ``llama_eagle.py`` run it: ``fc`` maps ``[embed(token) ; feature]`` (the token's embedding *first*) from
``2 x hidden`` to ``hidden``; then Llama decoder layers, the first without its input norm; no final norm. The output
is the predicted feature: the target's own LM head turns it into logits (times ``logit_scale``), and the next
drafted position reads it as its feature. The true features are the target's last hidden states after its final
norm, as for jointspec's EAGLE-style heads, so :class:`~jointspec.drafts.eagle.HeadDraftModel` binds this head as it
binds those: chains, trees, crops and the feature mirror are shared. Entry 0 is hidden from later entries, as the
engines' caches start at the second token (:func:`~jointspec.drafts.eagle.engine_head_mask`).

**The layout**: a Llama ``config.json`` naming ``LlamaForCausalLMEagle`` (SGLang) or ``EagleLlamaForCausalLM``
(vLLM), and ``model.safetensors`` or ``pytorch_model.bin`` with ``fc.weight``, ``fc.bias`` (the EAGLE repository's
heads have one; SGLang reads it, vLLM drops it: jointspec reads it, as the head was trained with it) and
``layers.{i}.*`` (``layers.0`` without ``input_layernorm``). ``embed_tokens.weight`` and ``lm_head.weight``, where a
checkpoint carries them, are not read: both engines use the target's. The head has no fingerprint of its target, so
it is checked by shape. Variants this code does not implement (HASS's ``add_para_norm``, biases in the layers,
another activation) are refused by name, never approximated.

jointspec's own EAGLE-style heads (``train-draft --head eagle``) keep both norms, so they are not this layout and
``export-draft`` does not write them in it (docs/interop.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from jointspec.backends.hf import CausalLM
from jointspec.backends.kvcache import BufferedCache
from jointspec.core.errors import ModelLoadError
from jointspec.drafts.artifact import (
    FeatureDraft,
    HeadConfig,
    engine_config,
    float_lm_weight,
    is_eagle1_checkpoint,
    read_engine_weights,
    refuse_unsupported_layer,
)
from jointspec.drafts.eagle import (
    HeadDraftModel,
    chosen_head_weights,
    engine_head_mask,
    float_activations,
    linears_to_int8,
)

log = logging.getLogger(__name__)

# Where the layout keeps its weights, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Config switches of EAGLE-1 variants this head does not implement.
UNSUPPORTED_SWITCHES = ("add_para_norm", "attention_bias", "mlp_bias")
# Weights the engines replace by the target's own.
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")


class Eagle1Head(nn.Module):
    """``fc`` (over [embedding ; feature]) and decoder layers, the first without its input norm; no final norm."""

    def __init__(self, llama: LlamaConfig, fc_bias: bool, logit_scale: float = 1.0) -> None:
        super().__init__()
        self.llama_config = llama
        hidden = llama.hidden_size
        self.config = HeadConfig(
            hidden_size=hidden, intermediate_size=llama.intermediate_size,
            num_attention_heads=llama.num_attention_heads, num_key_value_heads=llama.num_key_value_heads,
            head_dim=llama.head_dim, rope_theta=float(llama.rope_parameters.get("rope_theta", 10000.0)),
            rms_norm_eps=llama.rms_norm_eps, max_position_embeddings=llama.max_position_embeddings,
            target_vocab_size=llama.vocab_size, target_fingerprint="", num_layers=llama.num_hidden_layers)
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, layer_idx=i) for i in range(llama.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        self.logit_scale = logit_scale
        self.source = ""  # the folder it was read from, for messages
        self.hide_first_entry = True

    def fuse(self, wide: torch.Tensor) -> torch.Tensor:
        """The target's last feature is the head's input as it is."""
        return wide[..., :self.config.hidden_size]

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, *, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: BufferedCache | None = None,
                lean: bool = False) -> torch.Tensor:
        """[batch, n, hidden] features and token embeddings -> [batch, n, hidden] predicted features."""
        mask = engine_head_mask(features, cache, attention_mask, self.hide_first_entry)
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        position_embeddings = self.rotary_emb(x, position_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                      use_cache=cache is not None, position_embeddings=position_embeddings)
        return x


def _llama_config(raw: dict, folder: Path) -> LlamaConfig:
    refuse_unsupported_layer(raw, folder, "EAGLE-1", UNSUPPORTED_SWITCHES)
    try:
        fields = {name: raw[name] for name in ("vocab_size", "hidden_size", "intermediate_size",
                                                 "num_attention_heads", "num_hidden_layers")}
    except KeyError as error:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}': config.json lacks {error}") from error
    extra = {name: raw[name] for name in ("num_key_value_heads", "head_dim", "rms_norm_eps",
                                          "max_position_embeddings", "rope_theta", "rope_scaling",
                                          "rope_parameters") if raw.get(name) is not None}
    config = LlamaConfig(**fields, **extra, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    if config.num_hidden_layers < 1:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' has {config.num_hidden_layers} decoder layers")
    return config


def load_eagle1(folder: str | Path, target: CausalLM) -> Eagle1Head:
    """The EAGLE-1 head in ``folder`` (module docstring), checked against ``target`` by shape."""
    folder = Path(folder).expanduser()
    raw = engine_config(folder)
    if raw is None or not is_eagle1_checkpoint(folder):
        raise ModelLoadError(f"'{folder}' holds no EAGLE-1 checkpoint (a config.json naming LlamaForCausalLMEagle or "
                             "EagleLlamaForCausalLM)")
    llama = _llama_config(raw, folder)
    hidden = target.config.hidden_size
    if llama.hidden_size != hidden:
        raise ModelLoadError(f"EAGLE-1 head '{folder}' is {llama.hidden_size} wide; target '{target.name}' is "
                             f"{hidden} wide")
    if llama.vocab_size != target.vocab_size:
        raise ModelLoadError(f"EAGLE-1 head '{folder}' drafts for {llama.vocab_size} tokens; target "
                             f"'{target.name}' has {target.vocab_size}")
    state, _ = read_engine_weights(folder, WEIGHT_FILES, "EAGLE-1 checkpoint")
    state = {name.removeprefix("model."): value for name, value in state.items()}
    head = Eagle1Head(llama, fc_bias="fc.bias" in state, logit_scale=float(raw.get("logit_scale", 1.0) or 1.0))
    wanted = head.state_dict()
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' ({llama.num_hidden_layers} layers) lacks "
                             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    unread = sorted(set(state) - set(wanted) - set(TARGET_OWNED))
    if unread:  # a norm layer 0 lacks, a bias, another layer: loading without it would draft otherwise
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' ({llama.num_hidden_layers} layers) has weights "
                             f"jointspec's EAGLE-1 head does not implement: {', '.join(unread[:6])}"
                             f"{' ...' if len(unread) > 6 else ''}")
    bad = [f"{name} {tuple(state[name].shape)}, not {tuple(value.shape)}" for name, value in wanted.items()
           if tuple(state[name].shape) != tuple(value.shape)]
    bad += [f"{name} {tuple(state[name].shape)}, not {(target.vocab_size, hidden)}" for name in TARGET_OWNED
            if name in state and tuple(state[name].shape) != (target.vocab_size, hidden)]
    if bad:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' does not match its config.json and target "
                             f"'{target.name}': {'; '.join(bad[:4])}")
    head.load_state_dict({name: state[name].float() for name in wanted})
    head.source = str(folder)
    log.info("EAGLE-1 head '%s' (%d layers%s) read for target '%s', checked by shape; drafting with the target's "
             "embedding and LM head", folder, llama.num_hidden_layers, ", fc with bias" if "fc.bias" in state else "",
             target.name)
    return head.to(target.device).eval()


class Eagle1DraftModel(HeadDraftModel):
    """An EAGLE-1 head bound to its target: :class:`~jointspec.drafts.eagle.HeadDraftModel`'s caching, chains and
    trees, with the target's embedding and LM head (times the head's ``logit_scale``)."""

    def __init__(self, head: Eagle1Head, target: CausalLM, name: str = "EAGLE-1 head", weights: str = "auto") -> None:
        FeatureDraft.__init__(self, target, name, head.config.feature_layers)
        self.head = head.to(target.device).eval()
        self._device, self._dtype = float_activations(self.head)
        self.embed = target.model.get_input_embeddings()
        self.lm_weight = (float_lm_weight(target.model).detach().float() * head.logit_scale).to(self._dtype)
        self.draft_vocab = torch.arange(target.vocab_size, device=self._device)
        self._lm_int8 = self._lm_onednn = None
        self._lean = False
        # int8 as for EAGLE-3 heads: the layers' linears and the LM head on the grouped int8 kernel, fc in float. It
        # changes which tokens are drafted, never what is generated.
        self.weights = chosen_head_weights(self.head, weights, self.head.layers)
        if self.weights == "int8":
            from jointspec.kernels.grouped import GroupedInt8Linear

            linears_to_int8(self.head.layers)
            self._lm_int8 = GroupedInt8Linear(self._lm_linear())
        self.reset()

    @property
    def config(self):
        return self.head.llama_config

    def _new_cache(self) -> BufferedCache:
        return BufferedCache(self.head.llama_config)


def bind_eagle1(folder: str | Path, target: CausalLM, weights: str = "auto") -> Eagle1DraftModel:
    """The EAGLE-1 head in ``folder``, checked against ``target`` and bound to it."""
    return Eagle1DraftModel(load_eagle1(folder, target), target, name=f"EAGLE-1 head {Path(folder).name}",
                            weights=weights)
