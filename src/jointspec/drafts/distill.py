"""A distilled draft: a few decoder layers that read and write through the target's own embedding and LM head.

DistillSpec's small causal draft, made cheap to store: only the decoder layers and the final norm are trained and
saved; the token embedding and the LM head are the target's, frozen, and bound at load time. So the artifact stays a
few MB and only fits the target it was trained for. The layers start as copies of the target's first layers (when
their shapes match, as they do for Llama-family targets), which is already a weak early-exit draft; distillation then
teaches them to finish the prediction the remaining layers would have made.

Unlike a feature head (:mod:`jointspec.drafts.eagle`), the draft reads only tokens, never the target's hidden states:
it drafts as an ordinary small causal LM, so every model-based drafter uses it through the standard
:class:`~jointspec.backends.hf.CausalLM` adapter, trees and crops included. VocabTrim applies as for heads: the
output matmul covers the draft vocabulary only, and other tokens get ``-inf``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from jointspec.backends.hf import CausalLM
from jointspec.drafts.artifact import (
    ARTIFACT_FORMAT,
    HeadConfig,
    check_head_target,
    float_lm_rows,
    full_vocab_logits,
    load_artifact,
    save_artifact,
)
from jointspec.kernels.fp32 import kernels_in_use, onednn_supported, use_onednn_linears


@dataclass(frozen=True)
class DistillConfig(HeadConfig):
    """Shape of a distilled draft and the target it belongs to (saved as ``draft.json``, kind "distill")."""

    kind: str = "distill"
    format: int = ARTIFACT_FORMAT

    def llama_config(self, vocab_size: int = 1) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, attn_implementation="sdpa", tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


class DistillDraft(nn.Module):
    """``num_layers`` Llama decoder layers and a norm over the target's token embeddings (the trainable part)."""

    def __init__(self, config: DistillConfig) -> None:
        super().__init__()
        self.config = config
        self.body = LlamaModel(config.llama_config())  # its 1-row embedding is never used: inputs come as embeddings
        size = config.draft_vocab_size or config.target_vocab_size
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))

    def forward(self, token_embeds: torch.Tensor, *, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``token_embeds``: [batch, n, hidden] -> last hidden states after the norm [batch, n, hidden]."""
        out = self.body(inputs_embeds=token_embeds, position_ids=position_ids, attention_mask=attention_mask,
                        use_cache=False)
        return out.last_hidden_state

    def init_from_target(self, target: CausalLM) -> bool:
        """Copy the target's first ``num_layers`` decoder layers and its final norm; False (and nothing copied) where
        the target's layers are not shaped like this draft's (a non-Llama architecture)."""
        body = getattr(target.model, "model", None)
        layers, norm = getattr(body, "layers", None), getattr(body, "norm", None)
        if layers is None or norm is None or len(layers) < self.config.num_layers:
            return False
        state = {f"layers.{i}.{k}": v for i in range(self.config.num_layers)
                 for k, v in layers[i].state_dict().items()}
        state.update({f"norm.{k}": v for k, v in norm.state_dict().items()})
        mine = {k: v for k, v in self.body.state_dict().items() if not k.startswith("embed_tokens")}
        if set(state) != set(mine) or any(state[k].shape != mine[k].shape or not state[k].is_floating_point()
                                          for k in mine):
            return False
        self.body.load_state_dict({k: v.detach().float() for k, v in state.items()}, strict=False)
        return True

    def save(self, folder: str | Path, training: dict | None = None) -> Path:
        return save_artifact(self, self.config, folder, training)


class TrimmedLMHead(nn.Module):
    """The target's LM head rows for the draft vocabulary; logits of tokens outside it are ``-inf``."""

    def __init__(self, weight: torch.Tensor, draft_vocab: torch.Tensor, full_vocab: int) -> None:
        super().__init__()
        # [draft vocab, hidden], a copy of the rows: one small matmul per draft step. A Linear, so that the CPU
        # kernel swap (kernels.fp32) covers it like the layers.
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.proj.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("draft_vocab", draft_vocab)
        self.full_vocab = full_vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [batch, n, hidden] -> [batch, n, full vocab]
        return full_vocab_logits(self.proj(hidden), self.draft_vocab, self.full_vocab)


class DistilledDraftModel(CausalLM):
    """A distilled draft bound to its target: an ordinary causal LM whose vocabulary is the target's."""

    def __init__(self, draft: DistillDraft, target: CausalLM, name: str = "distilled draft") -> None:
        config = draft.config
        model = LlamaForCausalLM(config.llama_config())
        model.model.layers = draft.body.layers
        model.model.norm = draft.body.norm
        model.model.rotary_emb = draft.body.rotary_emb
        model.model.embed_tokens = target.model.get_input_embeddings()  # shared, not copied
        lm_weight = float_lm_rows(target.model, draft.draft_vocab).detach()
        model.lm_head = TrimmedLMHead(lm_weight.to(target.dtype).clone(), draft.draft_vocab, target.vocab_size)
        model.config.vocab_size = target.vocab_size
        model = model.to(device=target.device, dtype=target.dtype)
        if kernels_in_use(target.model) == "onednn" and onednn_supported(model) is None:
            use_onednn_linears(model)  # drafting is the same small-batch matmuls as the target's decoding
        super().__init__(model, name=name)
        self._vocab_size = target.vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size


def load_distill(folder: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[DistillDraft, dict]:
    """Load a saved distilled draft (weights back to ``dtype``) and its training record."""
    return load_artifact(folder, DistillConfig, DistillDraft, device=device, dtype=dtype)


def bind_distill(folder: str | Path, target: CausalLM) -> DistilledDraftModel:
    """Load the distilled draft saved in ``folder`` for ``target``; refuses one trained for another target."""
    draft, _ = load_distill(folder, device=target.device, dtype=target.dtype)
    check_head_target(draft, folder, target)
    return DistilledDraftModel(draft, target, name=f"distilled draft {Path(folder).name}")
