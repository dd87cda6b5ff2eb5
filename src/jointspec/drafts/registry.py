"""Every kind of trained draft by name: what ``--draft DIR`` binds to a target, whatever ``jointspec train-draft`` saved
there (its ``draft.json`` names the kind)."""

from __future__ import annotations

from pathlib import Path

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafts.artifact import artifact_kind, is_eagle3_checkpoint
from jointspec.drafts.distill import bind_distill
from jointspec.drafts.eagle import bind_head
from jointspec.drafts.eagle3 import bind_eagle3
from jointspec.drafts.hydra import bind_hydra
from jointspec.drafts.medusa import bind_medusa

# ``kind`` in draft.json -> its binder; EAGLE-style and EAGLE-3 heads also take ``head_weights``.
BINDERS = {"distill": bind_distill, "medusa": bind_medusa, "hydra": bind_hydra}


def bind_trained_draft(folder: str | Path, target: CausalLM, head_weights: str = "auto"):
    """Any draft ``jointspec train-draft`` saved in ``folder`` (its ``draft.json`` names the kind: an EAGLE head,
    Medusa or Hydra heads or a distilled draft), bound to ``target``; refuses one trained for another target.
    ``head_weights`` (EAGLE heads; the other kinds take only ``auto``, which keeps them float): see
    :data:`HEAD_WEIGHT_CHOICES`."""
    kind = "eagle3" if is_eagle3_checkpoint(folder) else artifact_kind(folder)
    if kind == "eagle3":
        return bind_eagle3(folder, target, head_weights)
    if head_weights != "auto" and kind not in (None, "eagle"):
        raise UnsupportedOptionError(f"head_weights={head_weights} applies to EAGLE heads; '{folder}' holds a "
                                     f"'{kind}' draft, which runs in float: leave head_weights at auto")
    if kind in BINDERS:
        return BINDERS[kind](folder, target)
    return bind_head(folder, target, head_weights)  # an unreadable folder gets load_head's error
