"""Training a distilled draft (:mod:`jointspec.drafts.distill`) on self-distillation data.

The data is the same as for heads (:mod:`jointspec.train.data`): the target's own answers and its features, from
which its next-token distribution at every position is ``softmax(lm_head(feature))``, recomputed on the fly. The draft
reads the tokens through the target's frozen embedding and is trained to match that distribution over the draft
vocabulary (VocabTrim), with one of two losses, as DistillSpec compares them:

- ``kl``: forward KL(target || draft), the usual distillation loss (mode-covering);
- ``tv``: total variation distance, ``1 - sum(min(target, draft))``, which is exactly one minus the chance that
  speculative sampling accepts a draft token: the quantity sampling-based verification pays for.

Held-out evaluation reports, on the answers only, how often the draft's argmax equals the target's: the chance a
greedy draft token is accepted. There is a single depth: the draft reads tokens, and an accepted draft token is the
target's own, so deeper drafts see the same inputs as in training.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jointspec.drafts.distill import DistillConfig, DistillDraft
from jointspec.train.heads import EvalResult, HeadTrainer, TrainConfig, _batches, _collate

log = logging.getLogger(__name__)

LOSSES = ("kl", "tv")


@dataclass(frozen=True)
class DistillTrainConfig(TrainConfig):
    num_layers: int = 2
    loss: str = "kl"
    init_from_target: bool = True  # start from the target's first layers (where shapes allow), not from random

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got '{self.loss}'")


class DistillTrainer(HeadTrainer):
    """Trains one distilled draft for one target; the data, schedule, checkpoints and early stopping are
    :class:`~jointspec.train.heads.HeadTrainer`'s."""

    config_class = DistillConfig
    module_class = DistillDraft

    def _initialise(self, draft: DistillDraft) -> None:
        if self.config.init_from_target and not draft.init_from_target(self.target):
            log.warning("the target's layers are not shaped like Llama decoder layers: the draft starts from "
                        "random weights")

    def _draft_logits(self, draft: DistillDraft, tokens: torch.Tensor, draft_weight: torch.Tensor) -> torch.Tensor:
        """[batch, length] token ids -> [batch, length, draft vocab] logits for the token after each one."""
        batch, length = tokens.shape
        with torch.no_grad():  # the embedding is the target's, frozen
            embeds = self.embed(tokens).float()
        positions = torch.arange(length, device=tokens.device)[None].expand(batch, -1)
        return draft(embeds, position_ids=positions) @ draft_weight.T

    def _distill_loss(self, draft_logits, features, valid, draft_weight) -> torch.Tensor:
        """Mean loss over the ``valid`` positions ([batch, length] bool) between the target's distribution
        (from its features) and the draft's, both over the draft vocabulary."""
        draft_logprobs = F.log_softmax(draft_logits[valid], dim=-1)  # [n, draft vocab]
        with torch.no_grad():
            target_logprobs = F.log_softmax(features[valid] @ draft_weight.T, dim=-1)
        if self.config.loss == "tv":
            return 1 - torch.minimum(target_logprobs.exp(), draft_logprobs.exp()).sum(-1).mean()
        return (target_logprobs.exp() * (target_logprobs - draft_logprobs)).sum(-1).mean()

    def _train_loss(self, draft, tokens, features, labels, draft_weight, draft_index, generator) -> torch.Tensor:
        # Position t reads tokens up to t and is trained on the target's distribution for token t + 1, which is
        # lm_head(feature_t): no shift, unlike a head (which predicts the next feature).
        return self._distill_loss(self._draft_logits(draft, tokens, draft_weight), features, labels >= 0,
                                  draft_weight)

    @torch.no_grad()
    def evaluate(self, draft: DistillDraft, sequences, labels_of, draft_weight, draft_index,
                 step: int) -> EvalResult:
        draft.eval()
        hits = total_loss = 0.0
        count = covered = 0
        for group in _batches(sequences, self.config.batch_tokens, random.Random(0)):
            tokens, features, labels = _collate(sequences, group, labels_of, "cpu", answers_only=True)
            valid = labels >= 0
            draft_logits = self._draft_logits(draft, tokens, draft_weight)
            num = int(valid.sum())
            total_loss += float(self._distill_loss(draft_logits, features, valid, draft_weight)) * num
            wanted = draft_index[labels[valid]]  # -1 where the target's choice is outside the draft vocabulary
            hits += float(((draft_logits[valid].argmax(-1) == wanted) & (wanted >= 0)).sum())
            covered += int((wanted >= 0).sum())
            count += num
        draft.train()
        return EvalResult(step=step, agreement=[round(hits / max(1, count), 4)],
                          loss=round(total_loss / max(1, count), 4), vocab_coverage=round(covered / max(1, count), 4))
