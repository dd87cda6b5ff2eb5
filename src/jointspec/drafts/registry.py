"""Every kind of trained draft by name: what ``--draft DIR`` binds to a target, whatever ``jointspec train-draft`` saved
there (its ``draft.json`` names the kind)."""

from __future__ import annotations

import weakref
from pathlib import Path

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafts.artifact import (
    FeatureDraft,
    artifact_kind,
    is_eagle1_checkpoint,
    is_eagle3_checkpoint,
    is_medusa_checkpoint,
)
from jointspec.drafts.distill import bind_distill
from jointspec.drafts.eagle import bind_head
from jointspec.drafts.eagle1 import bind_eagle1
from jointspec.drafts.eagle3 import bind_eagle3
from jointspec.drafts.hydra import bind_hydra
from jointspec.drafts.medusa import bind_medusa
from jointspec.drafts.medusa_checkpoint import bind_medusa_checkpoint
from jointspec.kernels.fp32 import kernels_in_use

# ``kind`` in draft.json -> its binder; EAGLE-style and EAGLE-3 heads also take ``head_weights``.
BINDERS = {"distill": bind_distill, "medusa": bind_medusa, "hydra": bind_hydra}


def bind_trained_draft(folder: str | Path, target: CausalLM, head_weights: str = "auto"):
    """Any draft ``jointspec train-draft`` saved in ``folder`` (its ``draft.json`` names the kind: an EAGLE head,
    Medusa or Hydra heads or a distilled draft), bound to ``target``; refuses one trained for another target.
    ``head_weights`` (EAGLE heads; the other kinds take only ``auto``, which keeps them float): see
    :data:`HEAD_WEIGHT_CHOICES`.

    A server binds the draft to a fork of its target for every request, so heads (drafts that read the target's
    features) are loaded, checked and prepared once per target model and folder contents; later binds share those
    weights (:meth:`~jointspec.drafts.artifact.FeatureDraft.bound_to`)."""
    model = getattr(target, "model", None)
    if model is None:  # not a torch target (the binders say what it lacks)
        return _bind(folder, target, head_weights)
    key = (folder_signature(folder), head_weights, str(target.device), kernels_in_use(model))
    try:
        templates = _TEMPLATES.setdefault(model, {})
    except TypeError:  # a model that cannot be weakly referenced: bind from the files every time
        templates = {}
    if key in templates:
        return templates[key].bound_to(target)
    draft = _bind(folder, target, head_weights)
    if isinstance(draft, FeatureDraft):
        templates[key] = draft.template()
    return draft


# bind_trained_draft's templates per target model (weakly: they go with the model).
_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def folder_signature(folder: str | Path) -> tuple:
    """What identifies a saved draft's files as read: the folder's resolved path and each file's name, inode, size
    and modification time (a draft saved again into the folder is read again: saves replace files, so even one within
    the clock's resolution has a new inode)."""
    path = Path(folder).resolve()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path] if path.is_file() else []
    stats = [(p.name, p.stat()) for p in files]
    return (str(path), *((name, st.st_ino, st.st_size, st.st_mtime_ns) for name, st in stats))


def _bind(folder: str | Path, target: CausalLM, head_weights: str):
    kind = "eagle3" if is_eagle3_checkpoint(folder) else "medusa" if is_medusa_checkpoint(folder) \
        else artifact_kind(folder)
    if kind == "eagle3":
        return bind_eagle3(folder, target, head_weights)
    if kind == "eagle1" or is_eagle1_checkpoint(folder):
        return bind_eagle1(folder, target, head_weights)
    if head_weights != "auto" and kind not in (None, "eagle"):
        raise UnsupportedOptionError(f"head_weights={head_weights} applies to EAGLE heads; '{folder}' holds a "
                                     f"'{kind}' draft, which runs in float: leave head_weights at auto")
    if kind == "medusa" and is_medusa_checkpoint(folder):
        return bind_medusa_checkpoint(folder, target)
    if kind in BINDERS:
        return BINDERS[kind](folder, target)
    return bind_head(folder, target, head_weights)  # an unreadable folder gets load_head's error
