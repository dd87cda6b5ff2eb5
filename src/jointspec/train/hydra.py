"""Training Hydra heads (:mod:`jointspec.drafts.hydra`) on self-distillation data.

Head ``k`` reads the target's feature at ``t`` and the tokens at ``t + 1 .. t + k`` of the training sequence (the
target's own answers: the tokens a draft the target accepted would hold), and is trained towards the target's
next-token distribution at ``t + k`` (``softmax(lm_head(feature_{t+k}))`` over the draft vocabulary). The loss
weights, schedule and evaluation are Medusa's (:mod:`jointspec.train.medusa`); only what a head reads differs.

Head 1 reads what an EAGLE head reads at depth 1 (a feature and the next token), so their held-out agreements
compare directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jointspec.drafts.hydra import HydraConfig, HydraHeads
from jointspec.train.medusa import MedusaTrainConfig, MedusaTrainer

HydraTrainConfig = MedusaTrainConfig  # the same settings: the number of heads and the shared ones


class HydraTrainer(MedusaTrainer):
    """Trains Hydra heads for one target, with :class:`~jointspec.train.heads.HeadTrainer`'s data, schedule and
    checkpoints and :class:`~jointspec.train.medusa.MedusaTrainer`'s loss and evaluation."""

    config_class = HydraConfig
    module_class = HydraHeads

    def _per_head(self, heads: HydraHeads, tokens, features, labels, draft_weight):
        """Per head k: (its draft log-probabilities at the scored positions, the target's log-probabilities there,
        the labels there); scored are the positions t whose position t + k is real."""
        with torch.no_grad():
            embeds = self.embed(tokens).float()  # [batch, length, hidden]; the target's embedding, frozen
            target_logprobs = F.log_softmax(features @ draft_weight.T, dim=-1)  # [batch, length, draft vocab]
        length = tokens.shape[1]
        out = []
        for k in range(1, heads.config.num_heads + 1):
            valid = labels[:, k:] >= 0  # [batch, length - k]
            # Position t reads tokens t + 1 .. t + k: window j holds token t + 1 + j.
            windows = torch.stack([embeds[:, 1 + j:length - k + 1 + j] for j in range(k)], dim=-2)
            guess = heads.heads[k - 1](features[:, :-k][valid], windows[valid])
            out.append((F.log_softmax(guess @ draft_weight.T, dim=-1), target_logprobs[:, k:][valid],
                        labels[:, k:][valid]))
        return out
