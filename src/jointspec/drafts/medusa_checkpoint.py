"""Medusa heads made for other engines, read for ``--draft DIR``.

Two layouts are read, each as its own loader reads it:

- **vLLM's** (``vllm/model_executor/models/medusa.py``; what ``export-draft --format medusa`` writes): a
  ``config.json`` naming ``MedusaModel`` (``num_heads``, ``num_hidden_layers``, ``vocab_size``,
  ``truncated_vocab_size``, ``original_lm_head``, ``medusa_fc_bias``, ``logit_scale``) and weights
  ``blocks.{h}.layers.{i}.weight`` (``.bias`` with ``medusa_fc_bias``), one ``lm_head.weight`` shared by every head
  (``original_lm_head``) or ``lm_heads.{h}.weight``, and ``token_map`` where the vocabulary is truncated.
- **The Medusa project's** (FasterDecoding/Medusa, ``medusa/model/medusa_model.py``): a ``config.json`` with
  ``medusa_num_heads`` and ``medusa_num_layers``, and ``medusa_lm_head.safetensors`` (or ``.pt``) holding head ``h``
  as ``{h}.{i}.linear.weight`` / ``.bias`` for its residual blocks and ``{h}.{num_layers}.weight`` for its own LM
  head over the whole vocabulary.

Both are :class:`~jointspec.drafts.medusa.MedusaHeads` with their own LM heads: block ``h`` maps the target's last
feature to a guess of the feature ``h + 2`` positions on, as jointspec's head ``h + 1`` does. They carry no
fingerprint of the target they were trained for, so they are checked against it by shape (width and vocabulary);
a weight the layout does not read, or one missing, is refused by name, never dropped or left at random.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import ModelLoadError
from jointspec.drafts.artifact import engine_config, is_medusa_checkpoint, read_engine_weights, target_fingerprint
from jointspec.drafts.medusa import MedusaConfig, MedusaDraftModel, MedusaHeads

log = logging.getLogger(__name__)

# Where each layout keeps its weights, in the order they are looked for.
WEIGHT_FILES = ("model.safetensors", "medusa_lm_head.safetensors", "pytorch_model.bin", "medusa_lm_head.pt")

_PROJECT_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")


def _count(raw: dict, names: tuple[str, ...], folder: Path, default: int | None = None) -> int | None:
    """The first of ``names`` that config.json sets, a whole number >= 1 (``default`` where none is set)."""
    name = next((name for name in names if raw.get(name) is not None), None)
    if name is None:
        return default
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"Medusa checkpoint '{folder}': config.json's {name} must be a whole number >= 1, "
                             f"got {value!r}")
    return value


def _project_shape(state: dict) -> tuple[int, int]:
    """(heads, residual layers) of the Medusa project's weights, from their names: what its loader runs whatever its
    config says (medusa_model.py sets five heads over the config's count, which published configs got wrong)."""
    blocks = [tuple(map(int, match.groups()[:2])) for match in map(_PROJECT_BLOCK.match, state) if match]
    return max(h for h, _ in blocks) + 1, max(i for _, i in blocks) + 1


def _vllm_tensors(raw: dict, state: dict, folder: Path, num_heads: int, num_layers: int):
    """(per head: [(weight, bias or None)] per layer), LM heads, token_map or None, as vLLM's loader reads them."""
    bias = bool(raw.get("medusa_fc_bias", False))
    used, blocks = set(), []
    for h in range(num_heads):
        layers = []
        for i in range(num_layers):
            name = f"blocks.{h}.layers.{i}"
            used.add(f"{name}.weight")
            if bias:
                used.add(f"{name}.bias")
            layers.append((state.get(f"{name}.weight"), state.get(f"{name}.bias") if bias else None))
        blocks.append(layers)
    if raw.get("original_lm_head", False):
        shared = "lm_head.weight" if "lm_head.weight" in state else "lm_heads.0.weight"  # vLLM takes either
        used.add(shared)
        lm_names = [shared]
    else:
        lm_names = [f"lm_heads.{h}.weight" for h in range(num_heads)]
        used.update(lm_names)
    vocab = _count(raw, ("vocab_size",), folder)
    truncated = _count(raw, ("truncated_vocab_size",), folder, default=vocab)
    token_map = None
    if "token_map" in state:
        used.add("token_map")
        if vocab is None or truncated is None or truncated < vocab:  # vLLM reads it only for a truncated vocabulary
            token_map = state["token_map"].long().flatten()
            if truncated is not None and token_map.numel() != truncated:  # vLLM's LM head has truncated rows
                raise ModelLoadError(f"Medusa checkpoint '{folder}' has a token_map of {token_map.numel()} ids for "
                                     f"truncated_vocab_size {truncated}")
    elif vocab is not None and truncated is not None and truncated < vocab:
        raise ModelLoadError(f"Medusa checkpoint '{folder}' truncates the vocabulary to {truncated} of {vocab} tokens "
                             "but has no token_map")
    return blocks, [state.get(name) for name in lm_names], token_map, used, lm_names


def _project_tensors(state: dict, num_heads: int, num_layers: int, folder: Path):
    """The same, as the Medusa project's ``medusa_head`` modules name them (an LM head per head, no map). Its heads
    repeat one residual block object ``num_layers`` times, so loading a file copies each ``{h}.{i}`` into that one
    block in turn and the last copy is what every layer runs: so here too."""
    used, blocks = set(), []
    for h in range(num_heads):
        names = [(f"{h}.{i}.linear.weight", f"{h}.{i}.linear.bias") for i in range(num_layers)]
        for pair in names:
            used.update(pair)
        last = (state.get(names[-1][0]), state.get(names[-1][1]))
        copies = [(state.get(w), state.get(b)) for w, b in names[:-1]]
        if any(w is not None and last[0] is not None and not (torch.equal(w, last[0]) and torch.equal(b, last[1]))
               for w, b in copies if b is not None and last[1] is not None):
            log.warning("Medusa checkpoint '%s': head %d's layer copies differ; the Medusa project runs the last "
                        "(%s) for every layer, and so does jointspec", folder, h, names[-1][0])
        blocks.append([last] * num_layers)
    lm_names = [f"{h}.{num_layers}.weight" for h in range(num_heads)]
    used.update(lm_names)
    return blocks, [state.get(name) for name in lm_names], None, used, lm_names


def load_medusa_checkpoint(folder: str | Path, target: CausalLM) -> MedusaHeads:
    """The Medusa heads in ``folder`` (either layout, module docstring), checked against ``target`` by shape."""
    folder = Path(folder).expanduser()
    raw = engine_config(folder)
    if raw is None or not is_medusa_checkpoint(folder):
        raise ModelLoadError(f"'{folder}' holds no Medusa checkpoint (a config.json naming MedusaModel, or with "
                             "medusa_num_heads)")
    state, file = read_engine_weights(folder, WEIGHT_FILES, "Medusa checkpoint",
                                      "; a Medusa-2 folder that also holds the base model is not read: save its "
                                      "heads alone")
    state = {re.sub(r"^medusa_heads?\.", "", name): value for name, value in state.items()}
    num_heads = _count(raw, ("num_heads", "medusa_num_heads"), folder)
    num_layers = _count(raw, ("num_hidden_layers", "medusa_num_layers"), folder, default=1)
    if any(name.startswith("blocks.") for name in state):
        layout = "vLLM"
        if num_heads is None:
            raise ModelLoadError(f"Medusa checkpoint '{folder}': config.json names no num_heads")
        blocks, lm, token_map, used, lm_names = _vllm_tensors(raw, state, folder, num_heads, num_layers)
    elif any(_PROJECT_BLOCK.match(name) for name in state):
        layout = "Medusa project"
        found = _project_shape(state)
        if (num_heads, num_layers) != found:
            log.info("Medusa checkpoint '%s': config.json says %s heads of %s layers, the weights hold %d of %d; "
                     "read as the weights are (as the Medusa project's loader does)", folder, num_heads, num_layers,
                     *found)
        num_heads, num_layers = found
        blocks, lm, token_map, used, lm_names = _project_tensors(state, num_heads, num_layers, folder)
    else:
        raise ModelLoadError(f"Medusa checkpoint '{folder}': {file} names no Medusa block (blocks.H.layers.I.weight "
                             "as vLLM writes, or H.I.linear.weight as the Medusa project does)")
    missing = sorted(name for name in used if name not in state)
    if missing:
        raise ModelLoadError(f"Medusa checkpoint '{folder}' ({layout} layout, {num_heads} heads of {num_layers} "
                             f"layers) lacks {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
    unread = sorted(set(state) - used)
    if unread:  # another head, layer or bias than config.json says: loading without it would draft otherwise
        raise ModelLoadError(f"Medusa checkpoint '{folder}' ({layout} layout, {num_heads} heads of {num_layers} "
                             f"layers) has weights that layout does not read: {', '.join(unread[:6])}"
                             f"{' ...' if len(unread) > 6 else ''}")
    hidden, vocab = target.config.hidden_size, target.vocab_size
    for h, layers in enumerate(blocks):
        for i, (weight, bias) in enumerate(layers):
            if tuple(weight.shape) != (hidden, hidden) or bias is not None and tuple(bias.shape) != (hidden,):
                raise ModelLoadError(f"Medusa checkpoint '{folder}': head {h} layer {i} is "
                                     f"{'x'.join(map(str, weight.shape))}; target '{target.name}' is {hidden} wide")
    if token_map is not None:
        if token_map.numel() < 2 or not bool(((token_map >= 0) & (token_map < vocab)).all()) \
                or token_map.unique().numel() != token_map.numel():
            raise ModelLoadError(f"Medusa checkpoint '{folder}' has a token_map that is not {token_map.numel()} "
                                 f"distinct ids of target '{target.name}''s {vocab}-token vocabulary")
        # vLLM picks the map's rows from an LM head over the whole vocabulary.
        lm = [weight[token_map] if weight.dim() == 2 and weight.shape[0] == vocab else weight for weight in lm]
    rows = token_map.numel() if token_map is not None else vocab
    for name, weight in zip(lm_names, lm):
        if tuple(weight.shape) != (rows, hidden):
            raise ModelLoadError(f"Medusa checkpoint '{folder}': {name} is {'x'.join(map(str, weight.shape))}; "
                                 f"target '{target.name}' needs {rows}x{hidden} ({vocab}-token vocabulary"
                                 f"{', ' + str(rows) + ' drafted' if token_map is not None else ''})")
    for name in ("vocab_size", "hidden_size"):
        wanted = vocab if name == "vocab_size" else hidden
        if layout == "vLLM" and _count(raw, (name,), folder, default=wanted) != wanted:
            raise ModelLoadError(f"Medusa checkpoint '{folder}' has {name} {raw[name]}; target '{target.name}' has "
                                 f"{wanted}")
    scale = raw.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ModelLoadError(f"Medusa checkpoint '{folder}': config.json's logit_scale must be a number > 0, got "
                             f"{scale!r}")
    config = MedusaConfig.for_target(target, target_fingerprint(target), num_heads=num_heads, num_layers=num_layers,
                                     draft_vocab_size=rows if token_map is not None else None)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for head, layers in zip(heads.heads, blocks):
            for block, (weight, bias) in zip(head, layers):
                block.linear.weight.copy_(weight.float())
                block.linear.bias.copy_(bias.float() if bias is not None else torch.zeros(hidden))
        if token_map is not None:
            heads.draft_vocab.copy_(token_map)
    # One float32 copy, the scale folded in (vLLM multiplies the logits by it): the draft reads it as it is.
    heads.lm_heads = torch.stack([weight.float() for weight in lm])
    if scale != 1:
        heads.lm_heads.mul_(float(scale))
    base = raw.get("base_model_name_or_path")
    log.info("Medusa checkpoint '%s' (%s layout, %d heads, %d layers%s) read for target '%s', checked by shape",
             folder, layout, num_heads, num_layers, f", made for '{base}'" if base else "", target.name)
    return heads.to(target.device).eval()


def bind_medusa_checkpoint(folder: str | Path, target: CausalLM) -> MedusaDraftModel:
    """The Medusa heads of a checkpoint made for another engine in ``folder``, checked by shape, bound to ``target``."""
    return MedusaDraftModel(load_medusa_checkpoint(folder, target), target, name=f"medusa {Path(folder).name}")
