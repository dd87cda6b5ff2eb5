"""The one on-disk format of every trained draft (a folder with ``draft.json`` and fp16 ``model.safetensors``), what
every kind's config shares (the target it belongs to, checked by fingerprint), and the base of drafts that read the
target's features. The kinds themselves (eagle, medusa, hydra, distill) build on this; ``registry`` binds any of them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from jointspec.backends.hf import CausalLM
from jointspec.core.choices import HEAD_WEIGHT_CHOICES  # noqa: F401  (re-exported)
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.core.files import cannot_write, is_write_failure, replacing_together
from jointspec.core.target import TargetCapabilities

ARTIFACT_FORMAT = 1


CONFIG_FILE = "draft.json"


WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    """Shape of a head and the target it belongs to (saved as ``draft.json``)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    target_vocab_size: int
    target_fingerprint: str
    target_name: str = ""
    # The fingerprint of the target's weights rounded to bf16 (target_fingerprint(target, torch.bfloat16)): lets the
    # draft bind to the target's bf16 copy too. None in drafts saved before it was recorded.
    target_fingerprint_bf16: str | None = None
    num_layers: int = 1
    draft_vocab_size: int | None = None  # None: the full target vocabulary
    fuse_layers: tuple[int, ...] = ()  # hidden-state indices of the target fused into the feature (eagle only)
    kind: str = "eagle"
    format: int = ARTIFACT_FORMAT

    def __post_init__(self) -> None:
        wanted = self.__dataclass_fields__["kind"].default  # "eagle" here; the other kinds subclass
        if self.kind != wanted:
            raise ValueError(f"a {type(self).__name__} has kind '{wanted}', got '{self.kind}'")
        if self.num_layers < 1 or self.hidden_size < 1:
            raise ValueError(f"bad head shape: {self.num_layers} layers of width {self.hidden_size}")
        object.__setattr__(self, "fuse_layers", tuple(int(layer) for layer in self.fuse_layers))  # JSON gives a list
        if self.fuse_layers and self.kind != "eagle":
            raise ValueError(f"fuse_layers is for eagle heads, not for a '{self.kind}' draft")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target hidden states a head reads, the last (after the final norm) first: what its mirror records."""
        return (-1, *self.fuse_layers)

    @classmethod
    def for_target(cls, target: CausalLM, fingerprint: str, *, draft_vocab_size: int | None = None,
                   num_layers: int = 1, intermediate_size: int | None = None,
                   **extra) -> HeadConfig:
        config = target.config
        heads = config.num_attention_heads
        return cls(hidden_size=config.hidden_size, intermediate_size=intermediate_size or config.intermediate_size,
                   num_attention_heads=heads, num_key_value_heads=getattr(config, "num_key_value_heads", heads),
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   rope_theta=float(_rope_theta(config)), rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-5)),
                   max_position_embeddings=target.max_context, target_vocab_size=target.vocab_size,
                   target_fingerprint=fingerprint, target_fingerprint_bf16=target_fingerprint(target, torch.bfloat16),
                   target_name=target.name, num_layers=num_layers,
                   draft_vocab_size=draft_vocab_size, **extra)


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return theta


def save_artifact(module: nn.Module, config, folder: str | Path, training: dict | None = None) -> Path:
    """Write a trained draft's ``draft.json`` (``config`` and ``training``) and fp16 weights into ``folder``.

    The body's placeholder token embedding is left out: drafts read the target's embedding. Both files are written
    whole under temporary names before either replaces the folder's, so a failed write (a full disk: a
    :class:`~jointspec.core.files.WriteError`) keeps the folder as it was, and a folder never pairs a new config with
    old weights of another shape, or new weights with an old config (a save stopped between the renames leaves no
    config, and the folder is refused at load).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    state = {k: (v.half() if v.is_floating_point() else v).contiguous().cpu() for k, v in module.state_dict().items()
             if not k.startswith("body.embed_tokens")}
    meta = json.dumps({"config": asdict(config), "training": training or {}}, indent=1)
    with replacing_together([folder / WEIGHTS_FILE, folder / CONFIG_FILE], "draft", folder,
                            "what the folder held before is kept") as (weights, settings):
        save_file(state, str(weights))
        shareable(weights)
        settings.write_text(meta)
    return folder


def shareable(path: Path) -> None:
    """Give ``path`` (a file, or a folder and all it holds) the permissions the user's umask gives new files. A
    draft is written to be loaded by others (a server's user, another engine), but safetensors writes its files for
    their owner alone and ``mkdtemp`` its folders likewise."""
    mask = 0o022
    try:
        status = Path("/proc/self/status").read_text()
        mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        pass  # not Linux: the usual umask
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def target_fingerprint(target: CausalLM, rounded_to: torch.dtype | None = None) -> str:
    """A short hash that tells one target model from another: its shape plus a sample of its float weights.

    Taken from the config, the input embedding and the final norm, which weight-only quantisation leaves in float, so a
    draft trained on the fp32 target also fits its quantised versions (which are meant to be the same model).
    ``rounded_to=torch.bfloat16`` hashes the sampled weights rounded to bf16 first: the same for the fp32 model and
    its bf16 copy (what CUDA runs by default), which the exact fingerprint tells apart.
    """
    model = target.model
    config = model.config
    digest = hashlib.sha256()
    shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                                                    "num_attention_heads", "num_key_value_heads")}
    digest.update(json.dumps(shape, sort_keys=True).encode())

    def sample(weight: torch.Tensor) -> bytes:
        weight = weight.detach() if rounded_to is None else weight.detach().to(rounded_to)
        return weight.float().cpu().numpy().tobytes()

    embedding = model.get_input_embeddings()
    count = getattr(embedding, "num_embeddings", None) or embedding.weight.shape[0]
    digest.update(sample(embedding_rows(embedding, torch.arange(min(64, count)))))
    digest.update(sample(embedding_rows(embedding, torch.arange(max(0, count - 64), count))))
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None:
        digest.update(sample(norm.weight))
    return digest.hexdigest()[:16]


def fits_target(config, target: CausalLM) -> bool:
    """Whether a draft whose config is ``config`` was trained for ``target``: the exact fingerprint, or, for a target
    in another float type than the one the draft was trained on, the fingerprint of the weights rounded to bf16
    (recorded since drafts carry ``target_fingerprint_bf16``; the shipped ones do)."""
    if config.target_fingerprint == target_fingerprint(target):
        return True
    wanted = getattr(config, "target_fingerprint_bf16", None)
    return wanted is not None and wanted == target_fingerprint(target, torch.bfloat16)


def check_head_target(head: nn.Module, folder: str | Path, target: CausalLM) -> None:
    """Raise :class:`ModelLoadError` unless ``head`` (loaded from ``folder``) was trained for ``target``."""
    if not fits_target(head.config, target):
        fingerprint = target_fingerprint(target)
        raise ModelLoadError(
            f"draft head '{folder}' was trained for target '{head.config.target_name}' (fingerprint "
            f"{head.config.target_fingerprint}), not for '{target.name}' (fingerprint {fingerprint}); train a head "
            "for this target with `jointspec train-draft --target ...`")
    if head.config.target_vocab_size != target.vocab_size:
        raise ModelLoadError(f"draft head '{folder}' expects {head.config.target_vocab_size} tokens, the target has "
                             f"{target.vocab_size}")


SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "data" / "drafts"


def shipped_head_for(target: CausalLM) -> Path | None:
    """The draft head shipped inside the package for ``target`` (matched by fingerprint), if there is one."""
    if not SHIPPED_HEADS.is_dir():
        return None
    for folder in sorted(SHIPPED_HEADS.iterdir()):
        if not (folder / CONFIG_FILE).is_file():
            continue
        try:
            config = json.loads((folder / CONFIG_FILE).read_text())["config"]
            if config.get("kind", "eagle") != "eagle":
                continue
            fingerprints = SimpleNamespace(target_fingerprint=config["target_fingerprint"],
                                           target_fingerprint_bf16=config.get("target_fingerprint_bf16"))
        except (OSError, ValueError, KeyError):
            continue
        if fits_target(fingerprints, target):
            return folder
    return None


def measured_top_w_hit_rate(folder: str | Path) -> dict[int, float] | None:
    """How often the draft's top w tokens (w = 1, 2, ...) held the target's next token, as its ``draft.json`` records
    under ``measured`` (``jointspec`` writes it after measuring), or None where it records none."""
    try:
        meta = json.loads((Path(folder).expanduser() / CONFIG_FILE).read_text())
        rates = {int(w): float(rate) for w, rate in meta["measured"]["top_w_hit_rate"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    valid = rates and all(w >= 1 for w in rates) and all(0.0 <= rate <= 1.0 for rate in rates.values())
    return rates if valid else None


def is_head_artifact(path: str | Path) -> bool:
    """Whether ``path`` holds a draft head: one ``jointspec train-draft`` saved, or an EAGLE-1, EAGLE-3 or Medusa
    checkpoint made for another engine."""
    return (Path(path).expanduser() / CONFIG_FILE).is_file() or is_eagle3_checkpoint(path) \
        or is_eagle1_checkpoint(path) or is_medusa_checkpoint(path)


# The config file of EAGLE-3 checkpoints, in both layouts vLLM and SGLang load: the ``speculators`` format
# (``speculators_model_type: "eagle3"``) and EAGLE-3's original one (a Llama config naming an EAGLE-3 architecture).
SPECULATORS_CONFIG = "config.json"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


ENGINE_WEIGHTS = "model.safetensors"


def write_engine_checkpoint(folder: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """A checkpoint for another engine (``config.json`` and ``model.safetensors``) in a new ``folder``, complete or
    not at all (written into a temporary sibling, then renamed)."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    if folder.exists():
        raise FileExistsError(f"'{folder}' exists; export-draft writes a new folder")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as error:
        raise cannot_write("the checkpoint", folder, error) from error
    try:
        (tmp / SPECULATORS_CONFIG).write_text(json.dumps(config, indent=2))
        save_file(state, str(tmp / ENGINE_WEIGHTS), metadata={"format": "pt"})
        shareable(tmp)
        tmp.rename(folder)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(error):  # a full disk: safetensors' error names no file
            raise cannot_write("the checkpoint", folder, error, "nothing of it was left there") from error
        raise
    return folder


def engine_config(folder: str | Path) -> dict | None:
    """The ``config.json`` of a checkpoint made for another engine in ``folder``, or None if it has none readable."""
    try:
        config = json.loads((Path(folder).expanduser() / SPECULATORS_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def refuse_unsupported_layer(layer: dict, folder: Path, what: str, switches: tuple[str, ...],
                             outer: dict | None = None) -> None:
    """Refuse a checkpoint whose Llama-style layer config ``layer`` (or its own config ``outer``) turns on one of
    ``switches``, or whose layer is not a SiLU Llama layer; ``what`` names the head ("EAGLE-3") in the message."""
    switched = [name for name in switches if layer.get(name) or (outer or {}).get(name)]
    if switched:
        raise ModelLoadError(f"{what} checkpoint '{folder}' sets {', '.join(switched)}, which jointspec's {what} head "
                             "does not implement")
    if layer.get("model_type", "llama") != "llama" or layer.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{what} checkpoint '{folder}' has a '{layer.get('model_type')}' decoder layer "
                             f"({layer.get('hidden_act')}); jointspec reads Llama-style {what} layers only")


def _read_tensor_file(path: Path) -> dict:
    if path.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)  # tensors only: torch refuses anything else


def read_engine_weights(folder: Path, files: tuple[str, ...], what: str,
                        none_hint: str = "") -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of the first of ``files`` in ``folder`` that exists (``.safetensors``, a PyTorch pickle read as
    tensors only, or either's ``.index.json`` naming its shards, as transformers saves large checkpoints) and its
    name; ``what`` names the checkpoint in errors, ``none_hint`` ends the one for a folder holding none of them."""
    for name in files:
        path = folder / name
        index = folder / f"{name}.index.json"
        if not path.is_file() and not index.is_file():
            continue
        try:
            if path.is_file():
                state, shown = _read_tensor_file(path), name
            else:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                state, shown = {}, index.name
                for shard in shards:
                    state.update(_read_tensor_file(folder / shard))
        except Exception as error:  # safetensors, torch and json raise their own kinds for a damaged file
            raise ModelLoadError(f"{what} '{folder}': cannot read {name} or its shards ({error})") from error
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ModelLoadError(f"{what} '{folder}': {shown} is not a flat map of tensors")
        return state, shown
    raise ModelLoadError(f"{what} '{folder}' has none of {', '.join(files)} (nor their .index.json shards)"
                         f"{none_hint}")


def is_eagle3_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds an EAGLE-3 checkpoint in either layout (its config.json says so)."""
    config = engine_config(folder)
    return config is not None and (config.get("speculators_model_type") == "eagle3" or any(
        name in EAGLE3_ARCHITECTURES for name in config.get("architectures") or ()))


# EAGLE-1 heads as SGLang (``LlamaForCausalLMEagle``) and vLLM (``EagleLlamaForCausalLM``) load them:
# drafts/eagle1.py reads them.
EAGLE1_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")


def is_eagle1_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds an EAGLE-1 head in the layout vLLM and SGLang load: its config.json names their
    architecture, or (as the EAGLE repository publishes its heads, and vLLM renames) names ``LlamaForCausalLM`` over
    weights that are a head's (``fc.weight`` and ``layers.*``, no ``model.*``), read from the file's names alone."""
    config = engine_config(folder)
    if config is None:
        return False
    architectures = config.get("architectures") or ()
    if any(name in EAGLE1_ARCHITECTURES for name in architectures):
        return True
    return list(architectures) == ["LlamaForCausalLM"] and _head_weight_names(Path(folder).expanduser())


def _head_weight_names(folder: Path) -> bool:
    """Whether the weights in ``folder`` are named as an EAGLE-1 head's: ``fc.weight`` and ``layers.*``, no full
    model's ``model.layers.*`` (a safetensors header, or a PyTorch file mapped, not read)."""
    names: list[str] = []
    try:
        if (folder / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
                names = list(handle.keys())
        elif (folder / "pytorch_model.bin").is_file():
            names = list(torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True,
                                    mmap=True).keys())
    except Exception:  # not a readable weight file: not a head either
        return False
    return "fc.weight" in names and any(name.startswith("layers.") for name in names) \
        and not any(name.startswith("model.layers.") for name in names)


# Medusa heads as vLLM loads them (its config names ``MedusaModel``) and as the Medusa project saves them (a config
# with ``medusa_num_heads``): drafts/medusa_checkpoint.py reads both.
MEDUSA_ARCHITECTURES = ("MedusaModel",)


def is_medusa_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds Medusa heads in vLLM's or the Medusa project's layout (its config.json says so)."""
    config = engine_config(folder)
    return config is not None and (config.get("model_type") == "medusa" or "medusa_num_heads" in config or any(
        name in MEDUSA_ARCHITECTURES for name in config.get("architectures") or ()))


def artifact_kind(folder: str | Path) -> str | None:
    """The kind of trained draft saved in ``folder`` ("eagle", "medusa", "hydra" or "distill"), or None if it holds none
    readable."""
    try:
        return json.loads((Path(folder).expanduser() / CONFIG_FILE).read_text())["config"].get("kind", "eagle")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_artifact(folder: str | Path, config_class, module_class, *, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32):
    """Load a trained draft of one kind (``config_class``/``module_class``, e.g. ``HeadConfig``/``EagleHead``) from
    ``folder``, weights back to ``dtype``; returns it and its training record."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    wanted_kind = config_class.__dataclass_fields__["kind"].default
    try:
        meta = json.loads((folder / CONFIG_FILE).read_text())
        kind = meta["config"].get("kind", "eagle")
        if kind != wanted_kind:
            raise ModelLoadError(f"'{folder}' holds a '{kind}' draft, not a '{wanted_kind}' one; pass it where a "
                                 f"{kind} draft is expected (--draft DIR takes every kind)")
        config = config_class(**meta["config"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ModelLoadError(f"'{folder}' is not a readable jointspec draft head ({error}); "
                             "train one with `jointspec train-draft`") from error
    if config.format != ARTIFACT_FORMAT:
        raise ModelLoadError(f"draft '{folder}' has format {config.format}; this jointspec reads format "
                             f"{ARTIFACT_FORMAT}: retrain it with this version")
    module = module_class(config)
    state = load_file(str(folder / WEIGHTS_FILE))
    missing, unexpected = module.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                  for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if not k.startswith("body.embed_tokens")]:
        raise ModelLoadError(f"draft '{folder}' weights do not match its config "
                             f"(missing {missing}, unexpected {unexpected})")
    return module.to(device=device, dtype=dtype).eval(), meta.get("training", {})


def float_lm_weight(model) -> torch.Tensor:
    """The target's LM head as a float [vocab, hidden] matrix (its tied input embedding if the head is quantised)."""
    return float_lm_rows(model, None)


def float_lm_rows(model, ids: torch.Tensor | None) -> torch.Tensor:
    """Rows ``ids`` (1-D; None: all) of :func:`float_lm_weight`, reading only those rows of an embedding that keeps
    a file's blocks (a draft vocabulary is a third of the rows)."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dim() == 2:
        return weight if ids is None else weight.index_select(0, ids.to(weight.device))
    if getattr(model.config, "tie_word_embeddings", False):
        embedding = model.get_input_embeddings()
        return embedding.weight if ids is None else embedding_rows(embedding, ids)
    raise UnsupportedOptionError("the target's LM head is not a float matrix (quantised?) and not tied to its "
                                 "embedding; a draft head cannot read it")


def embedding_rows(embedding: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (1-D) of an input embedding's float matrix: dequantised alone where the embedding keeps a file's
    blocks (``weight_rows``: kernels/gguf_blocks.BlockEmbedding, whose ``weight`` dequantises every row, several times
    the blocks' bytes), else read from ``weight``."""
    rows = getattr(embedding, "weight_rows", None)
    if rows is not None:
        return rows(ids)
    return embedding.weight.index_select(0, ids.to(embedding.weight.device))


def full_vocab_logits(draft_logits: torch.Tensor, draft_vocab: torch.Tensor, full_vocab: int) -> torch.Tensor:
    """[..., draft vocab] logits -> [..., full vocab], ``-inf`` for the tokens outside the draft vocabulary."""
    if draft_logits.shape[-1] == full_vocab:
        return draft_logits
    full = draft_logits.new_full((*draft_logits.shape[:-1], full_vocab), float("-inf"))
    full[..., draft_vocab] = draft_logits
    return full


class FeatureDraft:
    """What a draft that reads its target's features shares: the target's vocabulary and context length, and a
    :class:`~jointspec.backends.hf.FeatureMirror` of the target's features."""

    def __init__(self, target: CausalLM, name: str, layers: tuple[int, ...] = (-1,)) -> None:
        self.target = target
        self.name = name
        self.mirror_layers = layers
        self.mirror = target.attach_feature_mirror(layers)
        self._full_vocab = target.vocab_size

    # What the draft's measured cost curve belongs to (drafters.costaware): drafts bound from one template share it.
    cost_owner: object | None = None

    def template(self) -> FeatureDraft:
        """This freshly bound draft without its target: every module, tensor and setting shared (a shallow copy), no
        feature mirror and no cache. :meth:`bound_to` makes drafts of it for forks of the same target model; this
        draft and those share one measured cost (the template's)."""
        template = copy.copy(self)
        template.target = template.mirror = None
        template.reset()  # its own (empty) state, not this draft's
        template.cost_owner = self.cost_owner = template
        return template

    def bound_to(self, target: CausalLM) -> FeatureDraft:
        """A draft of this :meth:`template` for ``target``, a fork of the model it was bound to: nothing loaded,
        copied or converted again; its own feature mirror and fresh state (every kind keeps what drafting changes in
        the attributes ``reset`` sets)."""
        draft = copy.copy(self)
        FeatureDraft.__init__(draft, target, self.name, self.mirror_layers)
        draft.reset()
        return draft

    # Drafts that read features score chains and trees; they have no features of their own and no fork.
    capabilities = TargetCapabilities(trees=True)

    # How many leading target features the draft may read (None: all the mirror holds). A drafter that drafts while
    # the target's forward runs (PEARL, drafters/pearl.py) caps it at what was committed when it began, so that the
    # draft does not read rows that forward is writing, nor depend on how far it had got.
    feature_horizon: int | None = None

    def known_features(self) -> int:
        """The number of leading positions whose true target features this draft reads now."""
        length = self.mirror.length
        return length if self.feature_horizon is None else min(length, self.feature_horizon)

    @property
    def vocab_size(self) -> int:
        return self._full_vocab

    @property
    def max_context(self) -> int:
        return self.target.max_context


# How a bound head's weights run (``--head-weights``, MethodConfig.head_weights; HEAD_WEIGHT_CHOICES).
# - ``int8``: the head's decoder-layer linears, its rows of the target's LM head and (EAGLE-style heads, whose ``fc``
#   reads normed features) its ``fc`` as signed 8-bit weights in groups of 32 on jointspec's CPU kernel
#   (kernels/grouped.py), activations rounded to 8 bits per group as the kernel's inputs are. A draft call reads
#   about a quarter of the bytes, and after a target step has evicted the head from the caches its time goes with
#   those bytes, which made the shipped SmolLM2 head's calls cheaper at the same acceptance (docs/kernels.md, "Draft
#   heads on int8 weights").
# - ``float32``: the weights as trained.
# - ``auto``: int8 where that kernel runs with vector instructions (an x86 CPU with AVX2 or AVX-512, layer widths
#   multiples of 64), else float32.
# Either way the head only proposes tokens and the target verifies them, so the choice changes which tokens are
# drafted (and so the speed), never what is generated.
