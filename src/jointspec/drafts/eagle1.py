"""EAGLE-1 draft heads in the layout vLLM and SGLang load, read for ``--draft DIR``.

**The head** (EAGLE, arXiv 2401.15077; SafeAILab/EAGLE ``eagle/model/cnets.py``), as vLLM's ``llama_eagle.py`` and
SGLang's ``llama_eagle.py`` run it: ``fc`` maps ``[embed(token) ; feature]`` (the token's embedding *first*) from
``2 x hidden`` to ``hidden``; then Llama decoder layers, the first without its input norm; no final norm. The output
is the predicted feature: the target's own LM head turns it into logits (times a config's ``logit_scale``, as vLLM
applies it; SGLang does not read one), and the next
drafted position reads it as its feature. The true features are the target's last hidden states after its final
norm, as for jointspec's EAGLE-style heads, so :class:`~jointspec.drafts.eagle.HeadDraftModel` binds this head as it
binds those: chains, trees, crops and the feature mirror are shared. Entry 0 is hidden from later entries, as the
engines' caches start at the second token (:func:`~jointspec.drafts.eagle.engine_head_mask`).

**The layout**: a Llama ``config.json`` naming ``LlamaForCausalLMEagle`` (SGLang) or ``EagleLlamaForCausalLM``
(vLLM), or ``LlamaForCausalLM`` over a head's weight names as the EAGLE repository publishes them
(:func:`~jointspec.drafts.artifact.is_eagle1_checkpoint`), and ``model.safetensors`` or ``pytorch_model.bin`` (or
their shards) with ``fc.weight``, ``fc.bias`` (the EAGLE repository's
heads have one; SGLang reads it, vLLM drops it: jointspec reads it, as the head was trained with it) and
``layers.{i}.*`` (``layers.0`` without ``input_layernorm``). ``embed_tokens.weight`` and ``lm_head.weight``, where a
checkpoint carries them, are not read: both engines use the target's. The head has no fingerprint of its target, so
it is checked by shape. Variants this code does not implement (HASS's ``add_para_norm``, biases in the layers,
another activation) are refused by name, never approximated.

jointspec's own EAGLE-style heads (``train-draft --head eagle``) keep both norms, so they are not this layout and
``export-draft`` does not write them in it; ``train-draft --head eagle1`` trains this head
(:mod:`jointspec.train.eagle1`), saved as jointspec's other drafts are and written for the engines by
:func:`save_eagle1_layout` (docs/interop.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from jointspec.backends.hf import CausalLM
from jointspec.backends.kvcache import BufferedCache
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.drafts.artifact import (
    CONFIG_FILE,
    FeatureDraft,
    HeadConfig,
    check_head_target,
    engine_config,
    float_lm_rows,
    is_eagle1_checkpoint,
    load_artifact,
    read_engine_weights,
    refuse_unsupported_layer,
    save_artifact,
    write_engine_checkpoint,
)
from jointspec.drafts.eagle import (
    HeadDraftModel,
    chosen_head_weights,
    engine_head_mask,
    float_activations,
    layer_llama_config,
    linears_to_int8,
)

log = logging.getLogger(__name__)

# Where the layout keeps its weights, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Config switches of EAGLE-1 variants this head does not implement.
UNSUPPORTED_SWITCHES = ("add_para_norm", "attention_bias", "mlp_bias")
# Weights the engines replace by the target's own.
TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Eagle1Config(HeadConfig):
    """An EAGLE-1 head's shape (the common draft fields) and what its layout adds: whether ``fc`` has a bias, the
    logits' scale and the layers' rope settings.

    A head read from a checkpoint made for vLLM or SGLang has no ``target_fingerprint`` (""): it is checked against
    its target by shape; one trained by jointspec (``train-draft --head eagle1``) has both."""

    fc_bias: bool = False
    logit_scale: float = 1.0
    rope_parameters: dict | None = None  # transformers' rope settings of the layers (None: default rope, rope_theta)
    kind: str = "eagle1"

    @property
    def llama(self) -> LlamaConfig:
        """The decoder layers' transformers config."""
        return layer_llama_config(self, self.num_layers, self.rope_parameters)


class Eagle1Head(nn.Module):
    """``fc`` (over [embedding ; feature]) and decoder layers, the first without its input norm; no final norm.
    ``draft_vocab`` maps draft rows to target ids (the target's LM head rows it drafts over)."""

    def __init__(self, config: Eagle1Config) -> None:
        super().__init__()
        self.config = config
        llama = config.llama
        self.llama_config = llama
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(llama, layer_idx=i) for i in range(config.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        size = config.draft_vocab_size or config.target_vocab_size
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        self.source = ""  # the folder it was read from, for messages
        # Bound to a target (Eagle1DraftModel), cache entry 0 is hidden from later entries; training has no entry 0.
        self.hide_first_entry = False

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

    def save(self, folder: str | Path, training: dict | None = None) -> Path:
        """Write jointspec's ``draft.json`` and fp16 weights into ``folder`` (``export-draft`` writes the engines')."""
        return save_artifact(self, self.config, folder, training)


def _checkpoint_config(raw: dict, folder: Path, fc_bias: bool) -> Eagle1Config:
    """Our config of the head a checkpoint's Llama ``config.json`` describes; refuses what this head does not
    implement."""
    refuse_unsupported_layer(raw, folder, "EAGLE-1", UNSUPPORTED_SWITCHES)
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") or raw.get("rope_scaling")
        theta = float((rope or {}).get("rope_theta", raw.get("rope_theta", 10000.0)))
        return Eagle1Config(
            hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]), num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), rope_theta=theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
            target_vocab_size=int(raw["vocab_size"]), target_fingerprint="", num_layers=int(raw["num_hidden_layers"]),
            fc_bias=fc_bias, logit_scale=float(raw.get("logit_scale", 1.0) or 1.0),
            rope_parameters=dict(rope, rope_theta=theta) if rope else None)
    except KeyError as error:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}': config.json lacks {error}") from error
    except (TypeError, ValueError) as error:  # a field of the wrong type, or a shape HeadConfig refuses
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}': config.json is not a readable Llama config "
                             f"({error})") from error


def load_eagle1(folder: str | Path, target: CausalLM) -> Eagle1Head:
    """The EAGLE-1 head in ``folder`` (module docstring), checked against ``target`` by shape."""
    folder = Path(folder).expanduser()
    raw = engine_config(folder)
    if raw is None or not is_eagle1_checkpoint(folder):
        raise ModelLoadError(f"'{folder}' holds no EAGLE-1 checkpoint (a config.json naming LlamaForCausalLMEagle or "
                             "EagleLlamaForCausalLM)")
    state, _ = read_engine_weights(folder, WEIGHT_FILES, "EAGLE-1 checkpoint")
    state = {name.removeprefix("model."): value for name, value in state.items()}
    config = _checkpoint_config(raw, folder, fc_bias="fc.bias" in state)
    hidden = target.config.hidden_size
    if config.hidden_size != hidden:
        raise ModelLoadError(f"EAGLE-1 head '{folder}' is {config.hidden_size} wide; target '{target.name}' is "
                             f"{hidden} wide")
    if config.target_vocab_size != target.vocab_size:
        raise ModelLoadError(f"EAGLE-1 head '{folder}' drafts for {config.target_vocab_size} tokens; target "
                             f"'{target.name}' has {target.vocab_size}")
    try:
        head = Eagle1Head(config)
    except Exception as error:  # rope settings or head counts transformers refuses, in its own error kinds
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}': config.json describes no Llama layer transformers can "
                             f"build ({type(error).__name__}: {error})") from error
    wanted = {name: value for name, value in head.state_dict().items() if name != "draft_vocab"}
    missing = sorted(set(wanted) - set(state))
    if missing:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' ({config.num_layers} layers) lacks "
                             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    unread = sorted(set(state) - set(wanted) - set(TARGET_OWNED))
    if unread:  # a norm layer 0 lacks, a bias, another layer: loading without it would draft otherwise
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' ({config.num_layers} layers) has weights "
                             f"jointspec's EAGLE-1 head does not implement: {', '.join(unread[:6])}"
                             f"{' ...' if len(unread) > 6 else ''}")
    bad = [f"{name} {tuple(state[name].shape)}, not {tuple(value.shape)}" for name, value in wanted.items()
           if tuple(state[name].shape) != tuple(value.shape)]
    bad += [f"{name} {tuple(state[name].shape)}, not {(target.vocab_size, hidden)}" for name in TARGET_OWNED
            if name in state and tuple(state[name].shape) != (target.vocab_size, hidden)]
    if bad:
        raise ModelLoadError(f"EAGLE-1 checkpoint '{folder}' does not match its config.json and target "
                             f"'{target.name}': {'; '.join(bad[:4])}")
    head.load_state_dict({name: state[name].float() for name in wanted}, strict=False)
    head.source = str(folder)
    log.info("EAGLE-1 head '%s' (%d layers%s) read for target '%s', checked by shape; drafting with the target's "
             "embedding and LM head", folder, config.num_layers, ", fc with bias" if "fc.bias" in state else "",
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
        self.head.hide_first_entry = True
        self.lm_weight = (float_lm_rows(target.model, head.draft_vocab).detach().float()
                          * head.config.logit_scale).to(self._dtype)
        self.draft_vocab = head.draft_vocab
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


def load_eagle1_artifact(folder: str | Path, *, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> tuple[Eagle1Head, dict]:
    """An EAGLE-1 head saved by ``jointspec train-draft --head eagle1`` (draft.json, kind eagle1) and its training
    record."""
    head, training = load_artifact(folder, Eagle1Config, Eagle1Head, device=device, dtype=dtype)
    head.source = str(folder)
    return head, training


def bind_eagle1(folder: str | Path, target: CausalLM, weights: str = "auto") -> Eagle1DraftModel:
    """The EAGLE-1 head in ``folder`` (a checkpoint made for vLLM or SGLang, checked by shape, or one ``jointspec
    train-draft`` saved, checked by fingerprint), bound to ``target``."""
    if (Path(folder).expanduser() / CONFIG_FILE).is_file():  # jointspec's own draft.json
        head, _ = load_eagle1_artifact(folder, device=target.device)
        check_head_target(head, folder, target)
    else:  # an engine's checkpoint: load_eagle1 checks that it is one (reading its weights' names once more)
        head = load_eagle1(folder, target)
    return Eagle1DraftModel(head, target, name=f"EAGLE-1 head {Path(folder).name}", weights=weights)


# The architecture each engine's EAGLE-1 loader is registered under (module docstring), by export-draft format.
ENGINE_ARCHITECTURES = {"vllm-eagle": "EagleLlamaForCausalLM", "sglang-eagle": "LlamaForCausalLMEagle"}


def save_eagle1_layout(head: Eagle1Head, folder: str | Path, layout: str) -> Path:
    """Write ``head`` in vLLM's (``layout`` "vllm-eagle") or SGLang's ("sglang-eagle") EAGLE-1 layout in a new
    ``folder``: a Llama config naming the engine's architecture, ``fc.weight`` and ``fc.bias`` (zeros where the head
    has none: SGLang's fc has a bias, which a checkpoint without one would leave at its initial values; vLLM's has none
    and skips it), and ``layers.{i}.*``. Refused where the engine would draft otherwise: a draft vocabulary smaller
    than the target's (both engines draft over the whole LM head), a non-zero fc bias for vLLM (which drops it)."""
    config = head.config
    if layout not in ENGINE_ARCHITECTURES:
        raise UnsupportedOptionError(f"unknown EAGLE-1 layout '{layout}'; choose one of: "
                                     f"{', '.join(ENGINE_ARCHITECTURES)}")
    if head.draft_vocab.numel() != config.target_vocab_size:
        raise UnsupportedOptionError(f"the head drafts over {head.draft_vocab.numel()} of {config.target_vocab_size} "
                                     "tokens (--draft-vocab); vLLM's and SGLang's EAGLE-1 heads draft over the whole "
                                     "vocabulary, so the checkpoint would draft otherwise: train with --draft-vocab 0")
    if layout == "vllm-eagle" and head.fc.bias is not None and bool(head.fc.bias.detach().abs().max() > 0):
        raise UnsupportedOptionError("the head's fc has a bias, which vLLM's EAGLE-1 drops; export it as "
                                     "--format sglang-eagle")
    state = {name: value.detach().float().cpu().contiguous() for name, value in head.state_dict().items()
             if name != "draft_vocab"}
    state.setdefault("fc.bias", torch.zeros(config.hidden_size))
    raw = {"architectures": [ENGINE_ARCHITECTURES[layout]], "model_type": "llama", "hidden_act": "silu",
           "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
           "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
           "head_dim": config.head_dim, "num_hidden_layers": config.num_layers, "rms_norm_eps": config.rms_norm_eps,
           "max_position_embeddings": config.max_position_embeddings, "vocab_size": config.target_vocab_size,
           "rope_theta": config.rope_theta, "tie_word_embeddings": False, "torch_dtype": "float32"}
    rope = config.rope_parameters
    if rope and rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = dict(rope)
    if config.logit_scale != 1.0:
        raw["logit_scale"] = config.logit_scale
    return write_engine_checkpoint(Path(folder).expanduser(), raw, state)
