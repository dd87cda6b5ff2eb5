"""EAGLE-3 draft heads in the layouts vLLM and SGLang load, bound to a target like any other draft.

**The head** (EAGLE-3, arXiv 2503.01840), as vLLM's ``llama_eagle3.py`` and the ``speculators`` package define it:

- ``fc`` maps the target's hidden states at three layers ("auxiliary" ids ``a, b, c``: the *inputs* of those decoder
  layers, which are ``hidden_states[a]`` in transformers' numbering) from ``3 x hidden`` to ``hidden``;
- one decoder layer reads ``[input_layernorm(embed(token)) ; hidden_norm(h)]`` (q/k/v take ``2 x hidden``), with the
  residual taken from ``h`` (or from ``hidden_norm(h)`` under ``norm_before_residual``), then an ordinary MLP block;
- ``norm`` and the head's own ``lm_head`` give logits over a draft vocabulary, whose row ``i`` is target token
  ``i + d2t[i]``.

At a committed position ``h`` is ``fc`` of the target's auxiliary states; at a drafted position it is the head's own
output before ``norm`` at the position before. That is exactly what :class:`~jointspec.drafts.eagle.HeadDraftModel`
does with an EAGLE-1 head's features (true where the target has scored the position, predicted elsewhere), so
:class:`Eagle3DraftModel` is that adapter with this head in it: chains, trees, crops and the feature mirror are
shared. Rotary positions are the cache entries' (jointspec's rule); ``speculators`` trains with positions starting
at 1, which rotary attention does not see (only differences of positions enter it).

**The layouts.** Both are a ``config.json`` and a ``model.safetensors`` with ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t`` and ``t2d``:

- ``speculators`` (vLLM): ``speculators_model_type: "eagle3"``, the layer's ``transformer_layer_config``,
  ``draft_vocab_size``, ``norm_before_residual``, ``eagle_aux_hidden_state_layer_ids``; the layer as ``layers.0.*``;
  ``embed_tokens.weight`` optional (without it the head reads the target's embedding, as vLLM does);
- EAGLE-3's original layout (SGLang, and vLLM too): a Llama config naming ``LlamaForCausalLMEagle3`` with
  ``draft_vocab_size``; the layer as ``midlayer.*``.

jointspec also saves its own trained heads in its draft format (``draft.json``). Options this code does not
implement (``norm_before_fc``, ``fc_norm``, ``norm_output``, biases, more than one layer, a target of another hidden
size) are refused by name, never approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from jointspec.backends.hf import CausalLM
from jointspec.backends.kvcache import BufferedCache
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.drafts.artifact import (
    EAGLE3_ARCHITECTURES,
    ENGINE_WEIGHTS,
    SPECULATORS_CONFIG,
    FeatureDraft,
    HeadConfig,
    check_head_target,
    full_vocab_logits,
    is_eagle3_checkpoint,
    load_artifact,
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

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format export writes and the interop tests check
# Config switches of later EAGLE-3 variants; a checkpoint that turns one on is refused (module docstring).
UNSUPPORTED_SWITCHES = ("norm_before_fc", "fc_norm", "norm_output", "attention_bias", "mlp_bias")


@dataclass(frozen=True)
class Eagle3Config(HeadConfig):
    """An EAGLE-3 head's shape (the common draft fields), the target layers it reads and its decoder layer's rope.

    A head read from a speculators checkpoint has no ``target_fingerprint`` (""): it is checked against its target by
    shape (:func:`check_eagle3_target`); one trained by jointspec has both."""

    aux_layers: tuple[int, ...] = ()  # target hidden-state indices fc reads, in order (vLLM's aux hidden state ids)
    norm_before_residual: bool = False
    rope_parameters: dict | None = None  # transformers' rope settings of the layer (None: default rope, rope_theta)
    kind: str = "eagle3"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "aux_layers", tuple(int(layer) for layer in self.aux_layers))  # JSON gives a list
        if not self.aux_layers:
            raise ValueError("an EAGLE-3 head needs the target layers it reads (aux_layers)")
        if self.num_layers != 1:
            raise ValueError(f"jointspec's EAGLE-3 heads have one decoder layer, not {self.num_layers}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states the head reads: what its feature mirror records."""
        return self.aux_layers

    @property
    def llama(self) -> LlamaConfig:
        """The decoder layer's transformers config."""
        return layer_llama_config(self, 1, self.rope_parameters)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 decoder layer (module docstring): attention over [normed embedding ; normed hidden]."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        bias = bool(getattr(config, "attention_bias", False))
        head_dim = self.self_attn.head_dim
        self.self_attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings, attention_mask: torch.Tensor,
                cache: BufferedCache | None) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attended, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                     attention_mask=attention_mask, past_key_values=cache)
        x = residual + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """``fc``, one :class:`Eagle3Layer`, ``norm`` and ``lm_head``; ``draft_vocab`` maps draft rows to target ids."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        llama = config.llama
        self.llama_config = llama
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layers) * hidden, hidden, bias=False)
        self.layer = Eagle3Layer(llama, config.norm_before_residual)
        self.norm = LlamaRMSNorm(hidden, eps=llama.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        size = config.draft_vocab_size or config.target_vocab_size
        self.lm_head = nn.Linear(hidden, size, bias=False)
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own embedding, where it ships one
        self.source = ""  # the folder it was read from, for messages
        # Bound to a target (Eagle3DraftModel), cache entry 0 is hidden from later entries (see forward).
        self.hide_first_entry = False

    def fuse(self, wide: torch.Tensor) -> torch.Tensor:
        """[..., len(aux_layers) * hidden] target hidden states -> [..., hidden]: the head's input at that position."""
        return self.fc(wide)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, *, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: BufferedCache | None = None,
                lean: bool = False) -> torch.Tensor:
        """[batch, n, hidden] inputs and token embeddings -> [batch, n, hidden] outputs before ``norm`` (what the next
        drafted position reads). Without a mask the rows are a causal chain after the cached entries."""
        attention_mask = engine_head_mask(features, cache, attention_mask, self.hide_first_entry)
        position_embeddings = self.rotary_emb(features, position_ids)
        return self.layer(token_embeds, features, position_embeddings, attention_mask, cache)

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """[n, hidden] outputs -> [n, draft vocab] logits."""
        return self.lm_head(self.norm(outputs))

    def save(self, folder: str | Path, training: dict | None = None) -> Path:
        """Write jointspec's ``draft.json`` and fp16 weights into ``folder`` (``export-draft`` writes speculators')."""
        return save_artifact(self, self.config, folder, training)


def _checkpoint_config(raw: dict, folder: Path, target_layers: int | None) -> Eagle3Config:
    """Our config of the head a checkpoint's ``config.json`` describes, in either layout (:data:`EAGLE3_LAYOUTS`);
    refuses what this head does not implement. ``target_layers``: the target's decoder layers, for a checkpoint of the
    original layout that does not name the layers it reads (EAGLE-3's default then applies)."""
    speculators = raw.get("speculators_model_type") == "eagle3"
    layer = (raw.get("transformer_layer_config") or {}) if speculators else raw
    refuse_unsupported_layer(layer, folder, "EAGLE-3", UNSUPPORTED_SWITCHES, outer=raw)
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' has {layer['num_hidden_layers']} decoder layers; "
                             "jointspec reads one-layer EAGLE-3 heads only")
    hidden = int(layer["hidden_size"])
    if raw.get("target_hidden_size") not in (None, hidden):
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' reads a target {raw['target_hidden_size']} wide with a "
                             f"head {hidden} wide; jointspec reads heads as wide as their target")
    aux = raw.get("eagle_aux_hidden_state_layer_ids")  # vLLM's and speculators' numbering: transformers' own
    if not aux:
        # SGLang's (and SpecForge's) names a layer by its output, one below ours (:func:`save_eagle3_layout`).
        nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = [int(i) + 1 for i in nested] if nested else None
    if not aux and not speculators and target_layers is not None:
        aux = (2, target_layers // 2, target_layers - 3)  # what vLLM and SGLang capture when the config is silent
    if not aux:
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' does not name its target layers "
                             "(eagle_aux_hidden_state_layer_ids)")
    heads = int(layer["num_attention_heads"])
    rope = layer.get("rope_parameters") or layer.get("rope_scaling")
    theta = float((rope or {}).get("rope_theta", layer.get("rope_theta", 10000.0)))
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), rope_theta=theta,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
        target_vocab_size=int(layer["vocab_size"]), target_fingerprint="", target_name=str(verifier),
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer["vocab_size"]), aux_layers=tuple(aux),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        rope_parameters=dict(rope, rope_theta=theta) if rope else None)


# speculators' weight names -> ours (the decoder layer's are layers.0.* there, layer.* here).
def _weight_names(head: Eagle3Head) -> dict[str, str]:
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    names.update({f"layers.0.{name}": f"layer.{name}" for name in head.layer.state_dict()})
    return names


def load_eagle3(folder: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                target_layers: int | None = None) -> Eagle3Head:
    """Read an EAGLE-3 checkpoint in either layout (:data:`EAGLE3_LAYOUTS`); ``target_layers`` as in
    :func:`_checkpoint_config`."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not is_eagle3_checkpoint(folder):
        raise ModelLoadError(f"'{folder}' holds no EAGLE-3 checkpoint (a config.json with speculators_model_type "
                             f"'eagle3', or architectures {list(EAGLE3_ARCHITECTURES)})")
    try:
        config = _checkpoint_config(json.loads((folder / SPECULATORS_CONFIG).read_text()), folder, target_layers)
        state = load_file(str(folder / ENGINE_WEIGHTS))
    except (OSError, KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"'{folder}' is not a readable EAGLE-3 checkpoint ({error})") from error
    state = {name.replace("midlayer.", "layers.0."): value for name, value in state.items()}
    if not 2 <= config.draft_vocab_size <= config.target_vocab_size:
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' drafts {config.draft_vocab_size} tokens of a "
                             f"{config.target_vocab_size}-token vocabulary (draft_vocab_size)")
    head = Eagle3Head(config)
    names = _weight_names(head)
    missing = [name for name in names if name not in state]
    if missing:
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' lacks {', '.join(missing)}")
    # speculators keeps the target's own LM head and norm beside the draft (verifier_*) for training: not the draft's.
    unread = sorted(name for name in set(state) - set(names) - {"d2t", "t2d", "embed_tokens.weight"}
                    if not name.startswith("verifier_"))
    if unread:  # a bias, a second layer, a norm this head lacks: loading without it would draft otherwise
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' has weights jointspec's EAGLE-3 head does not "
                             f"implement: {', '.join(unread[:6])}{' ...' if len(unread) > 6 else ''}")
    try:
        head.load_state_dict({ours: state[theirs] for theirs, ours in names.items()}, strict=False)
    except RuntimeError as error:  # a weight of another shape than its config.json says
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' does not match its config.json: {error}") from error
    if "d2t" in state:
        d2t = state["d2t"].long().flatten()
        draft_vocab = torch.arange(d2t.numel()) + d2t
        if d2t.numel() != config.draft_vocab_size:
            raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' has a d2t map of {d2t.numel()} entries for "
                                 f"{config.draft_vocab_size} draft tokens")
        if not bool(((draft_vocab >= 0) & (draft_vocab < config.target_vocab_size)).all()):
            raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' has a d2t map that points outside the "
                                 f"{config.target_vocab_size}-token vocabulary")
        head.draft_vocab.copy_(draft_vocab)
    elif config.draft_vocab_size != config.target_vocab_size:
        raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' drafts {config.draft_vocab_size} of "
                             f"{config.target_vocab_size} tokens but has no d2t map")
    if "embed_tokens.weight" in state:
        shape = tuple(state["embed_tokens.weight"].shape)
        if shape != (config.target_vocab_size, config.hidden_size):
            raise ModelLoadError(f"EAGLE-3 checkpoint '{folder}' has a {shape[0]} x {shape[-1]} embedding for a "
                                 f"{config.target_vocab_size}-token vocabulary {config.hidden_size} wide")
        head.embed_tokens = nn.Embedding.from_pretrained(state["embed_tokens.weight"].float(), freeze=True)
    head.source = str(folder)
    return head.to(device=device, dtype=dtype).eval()


def save_speculators(head: Eagle3Head, folder: str | Path, verifier: str, embedding: torch.Tensor) -> Path:
    """Write ``head`` as a speculators EAGLE-3 checkpoint in ``folder`` (a new folder, complete or absent):
    ``config.json`` and float32 ``model.safetensors`` with speculators' names, ``d2t``, ``t2d`` and the target's
    input ``embedding`` (as speculators' own checkpoints carry it: without it, speculators 0.9.0 filled the
    embedding from the verifier in some loads and left it random in others). ``verifier``: the target's name or path
    as vLLM and speculators will look it up."""
    folder = Path(folder).expanduser()
    config = head.config
    raw = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
           "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": _layer_dict(config),
           "draft_vocab_size": config.draft_vocab_size or config.target_vocab_size,
           "norm_before_residual": config.norm_before_residual, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": list(config.aux_layers), "norm_before_fc": False, "fc_norm": False,
           "norm_output": False, "embed_requires_grad": False, "tie_word_embeddings": False, "dtype": "float32",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                        "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    state = _renamed_state(head, layer_prefix="layers.0.")
    state["embed_tokens.weight"] = embedding.detach().float().cpu().contiguous()
    return write_engine_checkpoint(folder, raw, state)


def save_eagle3_layout(head: Eagle3Head, folder: str | Path) -> Path:
    """Write ``head`` in EAGLE-3's original layout, what SGLang's ``LlamaForCausalLMEagle3`` loads (and vLLM's
    ``Eagle3LlamaForCausalLM`` too): a Llama ``config.json`` with ``draft_vocab_size`` and the target layers, and
    ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` weights; the engine shares the target's
    embedding. SGLang's layer takes its residual before ``hidden_norm``: a head trained with
    ``norm_before_residual`` is refused."""
    config = head.config
    if config.norm_before_residual:
        raise UnsupportedOptionError("this head sets norm_before_residual, which SGLang's EAGLE-3 layer does not "
                                     "read: export it as speculators (vLLM) instead")
    raw = _layer_dict(config)
    # transformers 5 keeps the RoPE base only inside rope_parameters; SGLang's Llama layer reads rope_theta, and
    # without it takes 10,000 (SmolLM2's is 100,000).
    raw.setdefault("rope_theta", config.rope_theta)
    # The layers twice, as each engine numbers them. vLLM reads the top-level key first: the input of layer i, as
    # here. SGLang reads eagle_config's and captures the input of layer v + 1 for each v: the output of layer v (-1
    # for the embeddings, layer 0's input).
    raw.update({"architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": config.draft_vocab_size or config.target_vocab_size,
                "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layers],
                                 "use_aux_hidden_state": True},
                "dtype": "float32"})
    state = _renamed_state(head, layer_prefix="midlayer.")
    return write_engine_checkpoint(Path(folder).expanduser(), raw, state)


def _layer_dict(config: Eagle3Config) -> dict:
    """The decoder layer's transformers config as a plain dict, without what only a saved model carries."""
    layer = config.llama.to_dict()
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "return_dict",
                "output_attentions", "output_hidden_states", "id2label", "label2id", "problem_type",
                "chunk_size_feed_forward"):
        layer.pop(key, None)
    return layer


def _renamed_state(head: Eagle3Head, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The head's weights under the checkpoint names (the layer's under ``layer_prefix``), float32, with ``d2t``
    (draft id -> target id - draft id) and ``t2d`` (the target ids drafted)."""
    ours = head.state_dict()
    state = {theirs.replace("layers.0.", layer_prefix): ours[mine].detach().float().cpu().contiguous()
             for theirs, mine in _weight_names(head).items()}
    draft_vocab = head.draft_vocab.detach().cpu()
    state["d2t"] = draft_vocab - torch.arange(draft_vocab.numel())
    t2d = torch.zeros(head.config.target_vocab_size, dtype=torch.bool)
    t2d[draft_vocab] = True
    state["t2d"] = t2d
    return state


def check_eagle3_target(head: Eagle3Head, target: CausalLM) -> None:
    """Raise :class:`ModelLoadError` unless ``target`` has the hidden size, vocabulary and layers ``head`` reads."""
    config, source = head.config, head.source
    target_config = target.config
    if config.hidden_size != target_config.hidden_size:
        raise ModelLoadError(f"EAGLE-3 head '{source}' is {config.hidden_size} wide; target '{target.name}' is "
                             f"{target_config.hidden_size} wide")
    if config.target_vocab_size != target.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head '{source}' drafts for {config.target_vocab_size} tokens; target "
                             f"'{target.name}' has {target.vocab_size}")
    layers = target_config.num_hidden_layers
    bad = [i for i in config.aux_layers if not 0 <= i < layers]
    if bad:
        raise ModelLoadError(f"EAGLE-3 head '{source}' reads target layers {list(config.aux_layers)}; target "
                             f"'{target.name}' has layers 0 to {layers - 1}")


class Eagle3DraftModel(HeadDraftModel):
    """An EAGLE-3 head bound to its target: :class:`~jointspec.drafts.eagle.HeadDraftModel`'s caching, chains and
    trees, with this head's own norm and LM head over its draft vocabulary."""

    def __init__(self, head: Eagle3Head, target: CausalLM, name: str = "EAGLE-3 head", weights: str = "auto") -> None:
        FeatureDraft.__init__(self, target, name, head.config.feature_layers)
        self.head = head.to(target.device).eval()  # a head built or loaded on another device runs beside its target
        self._device, self._dtype = float_activations(self.head)
        self.head.hide_first_entry = True
        self.embed = head.embed_tokens if head.embed_tokens is not None else target.model.get_input_embeddings()
        self.draft_vocab = head.draft_vocab
        self._lm_int8 = self._lm_onednn = None
        self._lean = False
        # int8 as for EAGLE-style heads (drafts/artifact.py, HEAD_WEIGHT_CHOICES): the layer's linears and the LM
        # head on the grouped int8 kernel. fc stays float: it reads the target's raw hidden states, whose outliers
        # would dominate a group's 8-bit inputs, and no EAGLE-3 head here has been measured with it on int8. It
        # changes which tokens are drafted, never what is generated.
        self.weights = chosen_head_weights(self.head, weights, self.head.layer)
        if self.weights == "int8":
            self._use_int8()
        self.reset()

    def _use_int8(self) -> None:
        from jointspec.kernels.grouped import GroupedInt8Linear

        linears_to_int8(self.head.layer)
        if type(self.head.lm_head) is nn.Linear:  # a head bound before has it converted already
            self.head.lm_head = GroupedInt8Linear(self.head.lm_head)

    @property
    def config(self):
        return self.head.llama_config

    def _new_cache(self) -> BufferedCache:
        return BufferedCache(self.head.llama_config)

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        return full_vocab_logits(self.head.logits(features).float(), self.draft_vocab, self._full_vocab)


def load_eagle3_artifact(folder: str | Path, *, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> tuple[Eagle3Head, dict]:
    """An EAGLE-3 head saved by ``jointspec train-draft`` (draft.json, kind eagle3) and its training record."""
    head, training = load_artifact(folder, Eagle3Config, Eagle3Head, device=device, dtype=dtype)
    head.source = str(folder)
    return head, training


def bind_eagle3(folder: str | Path, target: CausalLM, weights: str = "auto") -> Eagle3DraftModel:
    """The EAGLE-3 head in ``folder`` (a checkpoint of either layout, or one ``jointspec train-draft`` saved), checked
    against ``target`` and bound to it; ``weights``: see :data:`~jointspec.drafts.artifact.HEAD_WEIGHT_CHOICES`."""
    if is_eagle3_checkpoint(folder):
        head = load_eagle3(folder, device=target.device, dtype=torch.float32,
                           target_layers=target.config.num_hidden_layers)
    else:
        head, _ = load_eagle3_artifact(folder, device=target.device, dtype=torch.float32)
        check_head_target(head, folder, target)
    check_eagle3_target(head, target)
    return Eagle3DraftModel(head, target, name=f"EAGLE-3 head {Path(folder).name}", weights=weights)
