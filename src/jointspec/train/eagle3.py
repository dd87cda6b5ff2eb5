"""Training EAGLE-3 heads (:mod:`jointspec.drafts.eagle3`) on self-distillation data, with training-time test.

Pass 0 reads, at each position ``t``, ``fc`` of the target's hidden states at the head's layers and the embedding of
token ``t + 1``; its output drafts token ``t + 2``. Pass ``k`` reads the head's own pass ``k - 1`` output at ``t`` and
token ``t + 1 + k`` (teacher-forced), and drafts token ``t + 2 + k``: the head learns from the inputs it will see
when drafting ``k`` tokens ahead. Row ``t`` of pass ``k`` attends to pass 0's rows up to ``t`` and to its own rows of
passes 1 to ``k`` (EAGLE-3's training-time test; speculators' mask). Each pass's loss is the cross-entropy against
the target's distribution over the draft vocabulary (``softmax(feature @ lm_head_rows)``), all passes weighted
alike (speculators' default). The head's LM head starts as the target's rows for the draft vocabulary.

Held-out agreement at depth ``k + 1`` is how often pass ``k``'s argmax is the target's greedy token there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafts.artifact import target_fingerprint
from jointspec.drafts.eagle3 import Eagle3Config, Eagle3Head
from jointspec.train.heads import HeadTrainConfig, HeadTrainer


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers (vLLM's and speculators' choice): early, middle and late."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3TrainConfig(HeadTrainConfig):
    """``unroll``: training-time-test passes (drafting depths trained); ``fuse_layers``: the target layers ``fc``
    reads (empty: :func:`default_aux_layers`)."""

    unroll: int = 3
    noise: float = 0.0


def ttt_mask(length: int, passes: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, length, length * passes] additive mask of the last pass: causal over pass 0, diagonal over the rest."""
    visible = torch.zeros(length, length * passes, dtype=torch.bool)
    visible[:, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    rows = torch.arange(length)
    for k in range(1, passes):
        visible[rows, k * length + rows] = True
    mask = torch.zeros(1, 1, length, length * passes, dtype=dtype)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)


class Eagle3Trainer(HeadTrainer):
    """Trains an EAGLE-3 head for one target with :class:`~jointspec.train.heads.HeadTrainer`'s data, schedule and
    checkpoints."""

    config_class = Eagle3Config
    module_class = Eagle3Head

    def __init__(self, target, config: Eagle3TrainConfig, eos_token_ids: frozenset[int] = frozenset()):
        num_layers = target.config.num_hidden_layers
        aux = tuple(config.fuse_layers) or default_aux_layers(num_layers)
        bad = [layer for layer in aux if not 0 <= layer < num_layers]
        if bad or len(set(aux)) != len(aux):
            raise UnsupportedOptionError(f"EAGLE-3 target layers {list(aux)} must be distinct and within 0 to "
                                         f"{num_layers - 1} (this target's decoder layers)")
        super().__init__(target, config, eos_token_ids)
        self.fuse_layers = aux  # the data columns the head reads, after the last feature

    def _new_config(self, draft_vocab_size: int | None) -> Eagle3Config:
        return Eagle3Config.for_target(self.target, target_fingerprint(self.target), num_layers=1,
                                       draft_vocab_size=draft_vocab_size, aux_layers=self.fuse_layers)

    def _starting_head(self, init: Eagle3Head | None, vocab: torch.Tensor) -> Eagle3Head:
        if init is not None:
            if init.config.aux_layers != self.fuse_layers:
                raise UnsupportedOptionError(f"the head to start from reads target layers "
                                             f"{list(init.config.aux_layers)}; pass --fuse-layers "
                                             f"{','.join(map(str, init.config.aux_layers))}")
            # Recorded as this target's: a checkpoint made for vLLM or SGLang carries no fingerprint of its own (it
            # was checked against the target by shape), and one saved here carries this target's already.
            target = self.target
            head = Eagle3Head(replace(init.config, target_fingerprint=target_fingerprint(target),
                                      target_fingerprint_bf16=target_fingerprint(target, torch.bfloat16),
                                      target_name=target.name))
            head.load_state_dict({k: v.detach().float().cpu() for k, v in init.state_dict().items()
                                  if not k.startswith("embed_tokens.")})  # the target's embedding is read, not kept
        else:
            head = Eagle3Head(self._new_config(None if vocab.shape[0] == self.target.vocab_size
                                               else int(vocab.shape[0])))
            with torch.no_grad():
                head.lm_head.weight.copy_(self.lm_weight_full.index_select(0, vocab))
        head.draft_vocab.copy_(vocab)
        head.train()
        return head

    def _passes(self, head: Eagle3Head, tokens, features, generator: torch.Generator | None, noise: float):
        """Draft logits of every pass: [unroll] x [batch, length - 1, draft vocab] (module docstring)."""
        batch, length, _ = features.shape
        hidden = self.target.config.hidden_size
        rows = length - 1
        inputs = head.fuse(features[:, :-1, hidden:])  # [batch, rows, hidden]: fc of the target's layers at t
        cache = DynamicCache()
        outputs = []
        for k in range(self.config.unroll):
            shifted = torch.zeros(batch, rows, dtype=torch.long)
            shifted[:, :rows - k] = tokens[:, 1 + k:]  # token t + 1 + k at row t (zeros past the end)
            embeds = self.embed(shifted).float()
            positions = (torch.arange(rows) + 1 + k)[None].expand(batch, -1)
            out = head(inputs, embeds, position_ids=positions, attention_mask=ttt_mask(rows, k + 1, inputs.dtype),
                       cache=cache)
            outputs.append(head.logits(out))
            inputs = out
        return outputs

    def _loss(self, outputs, features, labels, draft_weight, draft_index, generator=None, cls_fraction=1.0):
        """Summed cross-entropy over passes, argmax hits per pass, number of scored positions of pass 0."""
        hidden = self.target.config.hidden_size
        last = features[..., :hidden]
        total, per_depth, scored = 0.0, [], 0
        for k, logits in enumerate(outputs):
            n = logits.shape[1] - k
            valid = labels[:, 1 + k:] >= 0  # row t drafts token t + 2 + k, the target's choice at t + 1 + k
            with torch.no_grad():
                teacher = F.softmax(last[:, 1 + k:][valid] @ draft_weight.T, dim=-1)
                wanted = draft_index[labels[:, 1 + k:][valid]]
            logprobs = F.log_softmax(logits[:, :n][valid], dim=-1)
            total = total - (teacher * logprobs).sum(-1).mean()
            with torch.no_grad():
                per_depth.append(((logprobs.argmax(-1) == wanted) & (wanted >= 0)).float().sum().item())
            if k == 0:
                scored = int(valid.sum())
        return total, per_depth, scored
