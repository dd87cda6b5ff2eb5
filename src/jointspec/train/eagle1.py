"""Training EAGLE-1 heads (:mod:`jointspec.drafts.eagle1`): the layout vLLM and SGLang load, trained as jointspec's
EAGLE-style heads are (:class:`~jointspec.train.heads.HeadTrainer`: the same data, unrolled passes, feature
regression plus the target's distribution through its LM head, schedule and checkpoints).

Only the head differs: ``fc`` over [embedding ; feature] with no bias (vLLM's EAGLE-1 has none), layers whose first has
no input norm, no final norm. Its output is the predicted feature as it stands, which is what the loss reads. So
``export-draft --format vllm-eagle|sglang-eagle`` writes the head as trained, and it drafts there what it drafts
here.
"""

from __future__ import annotations

from jointspec.drafts.eagle1 import Eagle1Config, Eagle1Head
from jointspec.train.heads import HeadTrainer


class Eagle1Trainer(HeadTrainer):
    """Trains an EAGLE-1 head for one target with :class:`~jointspec.train.heads.HeadTrainer`'s data, passes, loss,
    schedule and checkpoints."""

    config_class = Eagle1Config
    module_class = Eagle1Head
