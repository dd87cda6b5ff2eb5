"""What a verifier returns, and the tree walking every verifier shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from jointspec.core.choices import VERIFY_CHOICES  # noqa: F401  (re-exported: the method registry, the server)
from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig


@dataclass
class Verdict:
    """``accepted``: the kept draft nodes, root to leaf (a chain prefix, or one path of a tree).
    ``token_ids``: what to append: the accepted draft tokens, then one token from the target (the *recovered*
    token after a rejection, or the *bonus* token after a full acceptance)."""

    accepted: list[int]
    token_ids: list[int]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.accepted) + 1:
            raise ValueError(f"a verdict appends the accepted tokens plus one: {len(self.accepted)} accepted, "
                             f"{len(self.token_ids)} tokens")

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


class Verifier(Protocol):
    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        """``target_logits``: [num_nodes + 1, vocab]; row 0 is the target after the last committed token, row
        ``1 + i`` the target after draft node ``i`` (and its ancestors)."""


def children_of(draft: Draft) -> dict[int, list[int]]:
    """Children of every node, -1 being the last committed token; siblings in draft order."""
    children: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(draft.node_parents()):
        children.setdefault(parent, []).append(node)
        children.setdefault(node, [])
    return children


def path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root down to ``node`` (inclusive); empty for -1."""
    nodes: list[int] = []
    while node != -1:
        nodes.append(node)
        node = parents[node]
    return nodes[::-1]
