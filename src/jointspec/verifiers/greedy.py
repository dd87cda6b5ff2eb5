"""Greedy verification: keep draft tokens while they equal the target's argmax, then add the target's own choice.

On a tree, follow at each step the child whose token is the target's argmax (the first such sibling). The output is
exactly plain greedy decoding's, whatever the drafter proposed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig
from jointspec.core.verdict import Verdict, children_of


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first maximal entry, as torch.argmax; NaN counts as maximal in both). On the CPU through
    NumPy, whose argmax of a vocabulary-wide row costs a small fraction of torch's call (docs/kernels.md), which
    matters on a step as cheap as an int4 one."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def follow_target(draft: Draft, choice: Callable[[int], int]) -> Verdict:
    """Keep draft nodes while their token is the target's own choice, then add that choice where they part.

    ``choice(row)`` is the target's token for its logits row ``row`` (0: after the committed text; ``1 + i``: after
    draft node ``i``). It is called once per emitted token, row by row in the order the tokens come out, and never for
    a row past the first difference: a sampled choice then draws exactly what plain sampling would have drawn for
    those tokens. On a tree, the first child whose token is the choice is followed.
    """
    accepted: list[int] = []
    if draft.is_chain:
        while True:
            wanted = choice(len(accepted))
            if len(accepted) == draft.num_nodes or draft.token_ids[len(accepted)] != wanted:
                return Verdict(accepted, [draft.token_ids[i] for i in accepted] + [wanted])
            accepted.append(len(accepted))
    children = children_of(draft)
    node = -1
    while True:
        wanted = choice(node + 1)
        match = next((c for c in children[node] if draft.token_ids[c] == wanted), None)
        if match is None:
            return Verdict(accepted, [draft.token_ids[i] for i in accepted] + [wanted])
        accepted.append(match)
        node = match


class GreedyVerifier:
    # At temperature 0 only each row's argmax is read (the loop may then ask the target for screened logits).
    reads_argmax_when_greedy = True

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        return follow_target(draft, argmax_rows(target_logits).__getitem__)
