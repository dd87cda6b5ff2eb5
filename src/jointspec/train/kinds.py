"""Every kind of draft ``train-draft`` makes, by name: its training settings, its trainer, its loader, and which of
the command's kind-specific options it takes (with their defaults)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafts.distill import load_distill
from jointspec.drafts.eagle import load_head
from jointspec.drafts.eagle1 import load_eagle1_artifact
from jointspec.drafts.eagle3 import load_eagle3_artifact
from jointspec.drafts.hydra import load_hydra
from jointspec.drafts.medusa import load_medusa
from jointspec.train.distill import DistillTrainConfig, DistillTrainer
from jointspec.train.eagle1 import Eagle1Trainer
from jointspec.train.eagle3 import Eagle3TrainConfig, Eagle3Trainer
from jointspec.train.heads import HeadTrainConfig, HeadTrainer
from jointspec.train.hydra import HydraTrainConfig, HydraTrainer
from jointspec.train.medusa import MedusaTrainConfig, MedusaTrainer


@dataclass(frozen=True)
class TrainKind:
    name: str
    config_class: type
    trainer_class: type
    load: Callable  # (folder, device=...) -> (draft module, training record)
    options: dict[str, object] = field(default_factory=dict)  # kind-only settings -> default
    num_layers: int = 1


KINDS = {kind.name: kind for kind in (
    TrainKind("eagle", HeadTrainConfig, HeadTrainer, load_head,
              {"unroll": 2, "fuse_layers": (), "cls_weight": HeadTrainConfig.cls_weight,
               "cls_fraction": HeadTrainConfig.cls_fraction}),
    TrainKind("eagle1", HeadTrainConfig, Eagle1Trainer, load_eagle1_artifact,
              {"unroll": 2, "cls_weight": HeadTrainConfig.cls_weight, "cls_fraction": HeadTrainConfig.cls_fraction}),
    TrainKind("eagle3", Eagle3TrainConfig, Eagle3Trainer, load_eagle3_artifact, {"unroll": 3, "fuse_layers": ()}),
    TrainKind("medusa", MedusaTrainConfig, MedusaTrainer, load_medusa, {"num_heads": 4}),
    TrainKind("hydra", HydraTrainConfig, HydraTrainer, load_hydra, {"num_heads": 4}),
    TrainKind("distill", DistillTrainConfig, DistillTrainer, load_distill, {"loss": "kl"}, num_layers=2),
)}


# Every kind-only option of any kind: train-draft checks each against the kind asked for.
KIND_OPTIONS = frozenset(option for kind in KINDS.values() for option in kind.options)


def kind_named(name: str) -> TrainKind:
    if name not in KINDS:
        raise UnsupportedOptionError(f"unknown kind of draft '{name}'; choose one of: {', '.join(KINDS)}")
    return KINDS[name]


def trainer_for_kind(name: str):
    """(training config class, trainer class, loader of a saved draft) for a kind of draft."""
    kind = kind_named(name)
    return kind.config_class, kind.trainer_class, kind.load


def kinds_taking(option: str) -> list[str]:
    return [kind.name for kind in KINDS.values() if option in kind.options]
