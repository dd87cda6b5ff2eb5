"""Medusa-style draft heads: K independent heads on the target's last feature, each guessing one token further.

The target's feature at position ``f`` (its last hidden state after the final norm) gives, through its LM head, the
token at ``f + 1``: the target's own next token, which the decode loop already has. Head ``k`` (1 <= k <= K) maps the
same feature through ``num_layers`` residual blocks ``x + SiLU(W x)`` to a guess of the feature whose LM-head output
is the token at ``f + 1 + k``. The target's LM head is shared and frozen (restricted to the draft vocabulary:
VocabTrim), so only the blocks are trained and saved: ``K x num_layers x hidden^2`` parameters (1.3 M for SmolLM2 and
K = 4). The blocks start at zero, so an untrained head repeats the target's next-token guess.

Heads do not read the drafted tokens (Medusa's weakness against EAGLE, whose head reads its own previous token): a
whole draft, chain or tree, is scored from the one latest true feature, and every node at depth ``d`` gets the same
distribution. :class:`MedusaDraftModel` still has the :class:`~jointspec.backends.hf.CausalLM` interface, so the
model-based drafters use it through ``--draft DIR``. It has no cache to keep: a token fed at position ``p`` is scored
from the latest true feature ``f <= p`` with head ``p - f`` (head 0 is the target's LM head itself; past the last
head, the last head is used again).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import tree_depths
from jointspec.core.target import ForwardOutput
from jointspec.drafts.artifact import (
    ARTIFACT_FORMAT,
    FeatureDraft,
    HeadConfig,
    check_head_target,
    float_lm_weight,
    full_vocab_logits,
    load_artifact,
    save_artifact,
    write_engine_checkpoint,
)


@dataclass(frozen=True)
class MedusaConfig(HeadConfig):
    """Shape of a set of Medusa heads and the target they belong to (saved as ``draft.json``, kind "medusa")."""

    kind: str = "medusa"
    format: int = ARTIFACT_FORMAT
    num_heads: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # start as the identity: head k first guesses the target's next token
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(config.hidden_size) for _ in range(config.num_layers)))
            for _ in range(config.num_heads))
        size = config.draft_vocab_size or config.target_vocab_size
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        # Heads trained here read the target's LM head. Heads made for another engine bring their own
        # (drafts/medusa_checkpoint.py): float32 [num_heads or 1 shared, draft vocab, hidden], any logit scale in them.
        # A buffer, so that moving the heads to their target's device moves it too (one copy, not one on each
        # device); not saved, since a checkpoint made elsewhere keeps them in its own files.
        self.register_buffer("lm_heads", None, persistent=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., hidden] features -> [num_heads, ..., hidden]: head k's guess of the feature k positions on."""
        return torch.stack([head(features) for head in self.heads])

    def save(self, folder: str | Path, training: dict | None = None) -> Path:
        return save_artifact(self, self.config, folder, training)


class MedusaDraftModel(FeatureDraft):
    """Medusa heads bound to their target, behind the CausalLM interface (see the module docstring)."""

    def __init__(self, heads: MedusaHeads, target: CausalLM, name: str = "medusa heads") -> None:
        super().__init__(target, name)
        self.heads = heads.to(target.device).eval()  # heads built or loaded on another device run beside the target
        lm_weight = float_lm_weight(target.model).detach()
        self.lm_full = lm_weight  # head 0: the target's own next-token logits
        own = getattr(heads, "lm_heads", None)
        if own is None:
            self.lm_draft = lm_weight.index_select(0, heads.draft_vocab.to(lm_weight.device)).float()
            self.lm_own = None
        else:  # the heads' own, shared (not copied) between every draft bound from them
            self.lm_own = own.to(device=lm_weight.device, dtype=torch.float32)
            self.lm_draft = self.lm_own[0]
        self.draft_vocab = heads.draft_vocab
        self.reset()

    @property
    def config(self):
        return self.target.config

    @property
    def device(self) -> torch.device:
        return self.lm_draft.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_draft.dtype

    def reset(self) -> None:
        self.num_cached = 0

    def _feature(self, source: int) -> torch.Tensor:
        """The target's feature at position ``source``; before it has scored any token (``source`` -1: only a cost
        measurement drafts then), zeros, as an EAGLE head's first entry reads."""
        if source < 0:
            return torch.zeros(self.lm_draft.shape[1], device=self.device)
        return self.mirror.features[source].float()

    def _logits(self, positions: list[int]) -> torch.Tensor:
        """[len(positions), full vocab] logits for the token after each position."""
        known = self.known_features()  # positions 0 .. known - 1 have true features
        computed: dict[tuple[int, int], torch.Tensor] = {}  # a tree's nodes at one depth share their row
        rows = []
        for p in positions:
            source = min(p, known - 1)
            k = min(p - source, self.heads.config.num_heads)
            if (source, k) not in computed:
                feature = self._feature(source)
                if k == 0:
                    computed[source, k] = feature @ self.lm_full.float().T
                else:
                    lm = self.lm_draft if self.lm_own is None else self.lm_own[min(k, len(self.lm_own)) - 1]
                    draft_logits = self.heads.heads[k - 1](feature) @ lm.T
                    computed[source, k] = full_vocab_logits(draft_logits, self.draft_vocab, self._full_vocab)
            rows.append(computed[source, k])
        return torch.stack(rows)

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False) -> ForwardOutput:
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if output_hidden:
            raise ValueError("Medusa heads have no hidden states of their own to return")
        start = self.num_cached
        depths = list(range(n)) if parents is None else tree_depths(parents)
        keep = n if num_logits is None else num_logits
        self.num_cached = start + n
        rows = [start + d for d in depths[n - keep:]] if keep > 0 else []
        logits = self._logits(rows) if rows else torch.zeros(0, self._full_vocab, device=self.device)
        return ForwardOutput(logits=logits, hidden=None)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot crop a cache of {self.num_cached} tokens to {length}")
        self.num_cached = length

    def keep(self, positions: list[int]) -> None:
        self.num_cached = len(positions)


def load_medusa(folder: str | Path, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[MedusaHeads, dict]:
    """Load saved Medusa heads (weights back to ``dtype``) and their training record."""
    return load_artifact(folder, MedusaConfig, MedusaHeads, device=device, dtype=dtype)


def bind_medusa(folder: str | Path, target: CausalLM) -> MedusaDraftModel:
    """Load the Medusa heads saved in ``folder`` for ``target``; refuses heads trained for another target (a checkpoint
    made for vLLM or by the Medusa project: :func:`jointspec.drafts.medusa_checkpoint.bind_medusa_checkpoint`)."""
    heads, _ = load_medusa(folder, device=target.device)
    check_head_target(heads, folder, target)
    return MedusaDraftModel(heads, target, name=f"medusa {Path(folder).name}")


def save_vllm_medusa(heads: MedusaHeads, folder: str | Path, lm_weight: torch.Tensor) -> Path:
    """Write ``heads`` in vLLM's Medusa layout (``vllm/model_executor/models/medusa.py``, docs/interop.md) in a new
    ``folder``: ``blocks.{k}.layers.{i}`` (``x + SiLU(W x + b)``, ``medusa_fc_bias``), one LM head shared by every head
    (``original_lm_head``) holding the target's rows ``lm_weight`` for the draft vocabulary, and ``token_map`` (the
    draft vocabulary's target ids) where that vocabulary is trimmed. vLLM's head ``k`` drafts the token ``k + 2``
    positions after the feature, as ours does; its config names ``MedusaModel``."""
    config = heads.config
    vocab = heads.draft_vocab.detach().cpu()
    trimmed = vocab.numel() != config.target_vocab_size
    state = {f"blocks.{k}.layers.{i}.{part}": getattr(block.linear, part).detach().float().cpu().contiguous()
             for k, head in enumerate(heads.heads) for i, block in enumerate(head) for part in ("weight", "bias")}
    state["lm_head.weight"] = lm_weight.detach().float().cpu().index_select(0, vocab).contiguous()
    if trimmed:
        state["token_map"] = vocab.clone()
    raw = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": config.hidden_size,
           "vocab_size": config.target_vocab_size, "num_heads": config.num_heads,
           "num_hidden_layers": config.num_layers, "truncated_vocab_size": int(vocab.numel()),
           "original_lm_head": True, "medusa_fc_bias": True}
    return write_engine_checkpoint(Path(folder).expanduser(), raw, state)
