"""Training Medusa heads (:mod:`jointspec.drafts.medusa`) on self-distillation data.

Head ``k`` reads the target's feature at ``t`` and is trained towards the target's next-token distribution at
``t + k`` (``softmax(lm_head(feature_{t+k}))`` over the draft vocabulary), with a cross-entropy whose weight decays
with ``k`` (0.8 per head, as in Medusa): the first heads matter most, since a draft is accepted front to back.

Held-out evaluation reports, per head and on the answers only, how often its argmax equals the target's token ``k``
positions on (teacher-forced). Head 1 guesses the first drafted token, so its figure compares with a feature head's
depth 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from jointspec.drafts.medusa import MedusaConfig, MedusaHeads
from jointspec.train.heads import EvalResult, HeadTrainer, TrainConfig, _batches, _collate

HEAD_DECAY = 0.8


@dataclass(frozen=True)
class MedusaTrainConfig(TrainConfig):
    num_heads: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")


class MedusaTrainer(HeadTrainer):
    """Trains Medusa heads for one target, with :class:`~jointspec.train.heads.HeadTrainer`'s data, schedule and
    checkpoints."""

    config_class = MedusaConfig
    module_class = MedusaHeads

    def _new_config(self, draft_vocab_size: int | None) -> MedusaConfig:
        return replace(super()._new_config(draft_vocab_size), num_heads=self.config.num_heads)

    def _per_head(self, heads: MedusaHeads, tokens, features, labels, draft_weight):
        """Per head k: (its draft log-probabilities at the scored positions, the target's log-probabilities there,
        the positions' labels k steps on); scored are the positions t whose position t + k is real."""
        predicted = heads(features)  # [num_heads, batch, length, hidden]
        with torch.no_grad():
            target_logprobs = F.log_softmax(features @ draft_weight.T, dim=-1)  # [batch, length, draft vocab]
        out = []
        for k in range(1, heads.config.num_heads + 1):
            valid = labels[:, k:] >= 0  # [batch, length - k]
            draft_logprobs = F.log_softmax(predicted[k - 1][:, :-k][valid] @ draft_weight.T, dim=-1)
            out.append((draft_logprobs, target_logprobs[:, k:][valid], labels[:, k:][valid]))
        return out

    def _train_loss(self, heads, tokens, features, labels, draft_weight, draft_index, generator) -> torch.Tensor:
        total = 0.0
        for k, (draft_logprobs, target_logprobs, _) in enumerate(self._per_head(heads, tokens, features, labels,
                                                                              draft_weight)):
            if draft_logprobs.shape[0]:
                total = total - HEAD_DECAY ** k * (target_logprobs.exp() * draft_logprobs).sum(-1).mean()
        return total

    @torch.no_grad()
    def evaluate(self, heads: MedusaHeads, sequences, labels_of, draft_weight, draft_index,
                 step: int) -> EvalResult:
        heads.eval()
        num_heads = heads.config.num_heads
        hits, counts = [0.0] * num_heads, [0] * num_heads
        total_loss, covered = 0.0, 0
        for group in _batches(sequences, self.config.batch_tokens, random.Random(0)):
            tokens, features, labels = _collate(sequences, group, labels_of, "cpu", answers_only=True)
            for k, (draft_logprobs, target_logprobs, wanted_ids) in enumerate(
                    self._per_head(heads, tokens, features, labels, draft_weight)):
                wanted = draft_index[wanted_ids]  # -1 where the target's choice is outside the draft vocabulary
                hits[k] += float(((draft_logprobs.argmax(-1) == wanted) & (wanted >= 0)).sum())
                counts[k] += int(wanted.shape[0])
                if k == 0:
                    total_loss += float(-(target_logprobs.exp() * draft_logprobs).sum())
                    covered += int((wanted >= 0).sum())
        heads.train()
        return EvalResult(step=step, agreement=[round(h / max(1, c), 4) for h, c in zip(hits, counts)],
                          loss=round(total_loss / max(1, counts[0]), 4),
                          vocab_coverage=round(covered / max(1, counts[0]), 4))
