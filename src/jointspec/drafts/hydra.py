"""Hydra-style draft heads: K sequentially dependent heads on the target's last feature.

Medusa's heads (:mod:`jointspec.drafts.medusa`) all read the same feature and nothing else, so head 2 cannot know
which token head 1 drafted before it. Hydra (Ankner et al., 2024) makes head ``k`` read the tokens drafted before it:
from the latest true feature ``f`` and the tokens at ``f + 1 .. f + k`` (the first of them is the target's own next
token, the others the draft so far), it guesses the token at ``f + k + 1``. Its input is the concatenation
``[feature_f, embed(token_{f+1}), ..., embed(token_{f+k})]`` (the embedding is the target's, frozen), projected to the
hidden size and passed through ``num_layers`` residual blocks ``x + SiLU(W x)``; the target's LM head, frozen and
restricted to the draft vocabulary (VocabTrim), turns the result into logits. Only the projections and blocks are
trained and saved: ``sum_k (k + 1) x hidden^2 + K x num_layers x hidden^2`` parameters (6.0 M for SmolLM2, K = 4).
Each projection starts as ``[identity, 0, ..., 0]`` and each block at zero, so an untrained head repeats the target's
next-token guess, as an untrained Medusa head does.

A Hydra draft has no cache of its own beyond the tokens it was fed (and where each hangs in a tree): the node at
position ``p`` is scored from the latest true feature ``f <= p`` with head ``p - f`` and the tokens on its path from
``f + 1`` to ``p``. Past the last head (a draft deeper than K), head K reads the K latest tokens of the path with the
same feature: an input it was not trained on, so such tokens are rarely accepted; draft no deeper than K.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import tree_depths
from jointspec.core.target import ForwardOutput
from jointspec.drafts.artifact import check_head_target, full_vocab_logits, load_artifact, save_artifact
from jointspec.drafts.medusa import MedusaConfig, MedusaDraftModel, ResidualBlock


@dataclass(frozen=True)
class HydraConfig(MedusaConfig):
    """Shape of a set of Hydra heads and the target they belong to (saved as ``draft.json``, kind "hydra")."""

    kind: str = "hydra"


class HydraHead(nn.Module):
    """Head ``k``: ``[feature, k token embeddings]`` -> a guess of the feature ``k`` positions on."""

    def __init__(self, hidden: int, num_tokens: int, num_layers: int) -> None:
        super().__init__()
        self.proj = nn.Linear((num_tokens + 1) * hidden, hidden)
        with torch.no_grad():  # start by passing the feature through: the target's next-token guess
            self.proj.weight.zero_()
            self.proj.weight[:, :hidden] = torch.eye(hidden)
            self.proj.bias.zero_()
        self.blocks = nn.Sequential(*(ResidualBlock(hidden) for _ in range(num_layers)))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """[..., hidden] features and [..., num_tokens, hidden] embeddings -> [..., hidden]."""
        inputs = torch.cat([features, token_embeds.flatten(-2)], dim=-1)
        return self.blocks(self.proj(inputs))


class HydraHeads(nn.Module):
    def __init__(self, config: HydraConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(HydraHead(config.hidden_size, k, config.num_layers)
                                   for k in range(1, config.num_heads + 1))
        size = config.draft_vocab_size or config.target_vocab_size
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))

    def save(self, folder: str | Path, training: dict | None = None) -> Path:
        return save_artifact(self, self.config, folder, training)


class HydraDraftModel(MedusaDraftModel):
    """Hydra heads bound to their target, behind the CausalLM interface (see the module docstring): Medusa's draft
    model, with the tokens it was fed kept to be read."""

    def __init__(self, heads: HydraHeads, target: CausalLM, name: str = "hydra heads") -> None:
        self.embed = target.model.get_input_embeddings()
        super().__init__(heads, target, name)

    @property
    def num_cached(self) -> int:
        return len(self.tokens)

    def reset(self) -> None:
        # One entry per fed token: its id, the entry it follows (-1: none) and its position in the sequence.
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.positions: list[int] = []

    def _append(self, token: int, parent: int) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.positions.append(0 if parent < 0 else self.positions[parent] + 1)

    def _path_tokens(self, entry: int, count: int) -> list[int]:
        """The ``count`` tokens ending at ``entry`` along its ancestors, oldest first."""
        path = []
        while len(path) < count:
            path.append(self.tokens[entry])
            entry = self.parents[entry]
        return path[::-1]

    def _logits(self, entries: list[int]) -> torch.Tensor:
        """[len(entries), full vocab] logits for the token after each entry."""
        known = self.known_features()  # positions 0 .. known - 1 have true features
        num_heads = self.heads.config.num_heads
        computed: dict[tuple, torch.Tensor] = {}  # tree nodes with the same path share a row
        rows = []
        for entry in entries:
            position = self.positions[entry]
            source = min(position, known - 1)
            k = min(position - source, num_heads)
            path = tuple(self._path_tokens(entry, k))
            if (source, path) not in computed:
                feature = self._feature(source)
                if k == 0:
                    computed[source, path] = feature @ self.lm_full.float().T
                else:
                    ids = torch.tensor(path, dtype=torch.long, device=self.device)
                    guess = self.heads.heads[k - 1](feature, self.embed(ids).float())
                    computed[source, path] = full_vocab_logits(guess @ self.lm_draft.T, self.draft_vocab,
                                                               self._full_vocab)
            rows.append(computed[source, path])
        return torch.stack(rows)

    @torch.inference_mode()
    def forward(self, token_ids: list[int] | torch.Tensor, *, parents: list[int] | None = None,
                num_logits: int | None = None, output_hidden: bool = False) -> ForwardOutput:
        token_ids = [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if output_hidden:
            raise ValueError("Hydra heads have no hidden states of their own to return")
        start = self.num_cached
        if parents is not None:
            tree_depths(parents)  # validates the tree
        for i, token in enumerate(token_ids):
            relative = i - 1 if parents is None else parents[i]
            self._append(token, start + relative if relative >= 0 else start - 1)
        keep = n if num_logits is None else num_logits
        entries = list(range(start + n - keep, start + n)) if keep > 0 else []
        logits = self._logits(entries) if entries else torch.zeros(0, self._full_vocab, device=self.device)
        return ForwardOutput(logits=logits, hidden=None)

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot crop a cache of {self.num_cached} tokens to {length}")
        del self.tokens[length:], self.parents[length:], self.positions[length:]

    def keep(self, positions: list[int]) -> None:
        """Keep the entries at ``positions`` (an accepted tree path), which become a chain."""
        prefix = 0  # usually most of the cache: kept as it is
        while prefix < len(positions) and positions[prefix] == prefix:
            prefix += 1
        rest = [self.tokens[i] for i in positions[prefix:]]
        self.crop(prefix)
        for token in rest:
            self._append(token, self.num_cached - 1)


def load_hydra(folder: str | Path, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[HydraHeads, dict]:
    """Load saved Hydra heads (weights back to ``dtype``) and their training record."""
    return load_artifact(folder, HydraConfig, HydraHeads, device=device, dtype=dtype)


def bind_hydra(folder: str | Path, target: CausalLM) -> HydraDraftModel:
    """Load the Hydra heads saved in ``folder`` for ``target``; refuses heads trained for another target."""
    heads, _ = load_hydra(folder, device=target.device)
    check_head_target(heads, folder, target)
    return HydraDraftModel(heads, target, name=f"hydra {Path(folder).name}")
