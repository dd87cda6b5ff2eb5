"""MTAD verification: keep the deepest draft node whose target/draft joint-likelihood ratio reaches ``tau``.

For a node at depth ``d`` with path ``y_1..y_d``: ``target_joint = Σ log p̃(y_i | c, y_<i)`` (from the target rows of
this round) and ``draft_joint = Σ log q̃(y_i | c, y_<i)`` (the drafter's ``draft_logprobs`` along the node's *own*
ancestor path). The node passes when ``target_joint - draft_joint >= log tau``. The verifier keeps the deepest
passing node (on a chain: the longest passing prefix; a failing short prefix does not block a longer passing one,
since the joint ratio can recover), breaking ties at equal depth by the larger target joint, then appends one token
sampled from the target's processed distribution after that node (row 0 when nothing passes). There is no residual
correction: MTAD approximates multi-token joint decoding and is *not* lossless (docs/mtad.md; arXiv 2407.09722).

Differences from the reference code, on purpose: the tree threshold uses each node's own ancestor path, not
column ``b*`` of every level (docs/mtad.md, the table of fixes); and the test is ``>=`` with a tolerance of
``JOINT_TOLERANCE`` nats rather than a strict ``>``, so that a draft identical to the target (ratio 1 up to
floating-point noise between two forward passes) is fully accepted at ``tau = 1``.

At temperature 0 the target rows are one-hot, so ``target_joint`` is 0 on the target's argmax path and ``-inf`` off
it, and draft joints are <= 0: for ``tau <= 1`` this is exactly greedy speculative decoding, and for any ``tau``
every emitted token is the target's argmax (the output equals plain greedy decoding).
"""

from __future__ import annotations

import math

import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict, path_to

# Two fp32 forward passes of the same model over the same tokens (chain vs tree mask, different batch shapes) agree
# to ~1e-6 per log-probability; 1e-4 nats over a few tokens covers that and is far below any meaningful tau.
JOINT_TOLERANCE = 1e-4


def node_joints(draft: Draft, target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node, the (target, draft) joint log-likelihoods of its whole path, float64 ([num_nodes] each).

    target_probs: [num_nodes + 1, vocab] processed target distributions (row 1 + i: after node i).
    """
    parents = draft.node_parents()
    device = target_probs.device
    tokens = torch.tensor(draft.token_ids, dtype=torch.long, device=device)
    rows = torch.tensor([p + 1 for p in parents], dtype=torch.long, device=device)  # the row predicting each token
    # The joints are summed on the CPU: a few numbers, walked node by node.
    target_logprobs = target_probs[rows, tokens].double().log().cpu()  # [num_nodes], -inf outside the nucleus
    if draft.draft_logprobs is not None:
        draft_logprobs = draft.draft_logprobs.double().cpu()
    elif draft.draft_probs is not None:
        probs = draft.draft_probs
        index = torch.arange(len(tokens), device=probs.device)
        draft_logprobs = probs[index, tokens.to(probs.device)].double().log().cpu()
    else:
        draft_logprobs = torch.zeros(len(tokens), dtype=torch.float64)  # a deterministic draft: Q = 1
    target_joint = target_logprobs.clone()
    draft_joint = draft_logprobs.clone()
    for node, parent in enumerate(parents):  # parents come first, so their joints are already complete
        if parent >= 0:
            target_joint[node] += target_joint[parent]
            draft_joint[node] += draft_joint[parent]
    return target_joint, draft_joint


class MTADVerifier:
    """Chain and tree MTAD: one rule, since a chain is a tree with one node per depth."""

    # At temperature 0 it reads each row's argmax only (processed_probs' one-hot, the greedy endpoint): it may read
    # the screened head's argmax logits, as plain greedy decoding does, and so commits the same tokens.
    reads_argmax_when_greedy = True
    reads_top_k_when_sampling = True  # only processed_probs of the target's rows

    def __init__(self, accept_threshold: float = 0.5) -> None:
        if not accept_threshold > 0:
            raise ValueError(f"accept_threshold must be > 0, got {accept_threshold}")
        self.accept_threshold = accept_threshold
        self._log_threshold = math.log(accept_threshold) - JOINT_TOLERANCE

    def verify(self, draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig,
               generator: torch.Generator | None) -> Verdict:
        node = -1
        target_probs = processed_probs(target_logits, sampling)  # [num_nodes + 1, vocab]
        if draft.num_nodes:
            target_joint, draft_joint = node_joints(draft, target_probs)
            # -inf - (-inf) is nan, and nan >= x is False: a node off both supports fails, as it should.
            passing = (target_joint - draft_joint) >= self._log_threshold  # [num_nodes]
            node = self._deepest(draft.node_parents(), passing, target_joint)
        path = path_to(draft.node_parents(), node)
        if sampling.greedy:
            endpoint = int(target_logits[node + 1].argmax())
        else:
            endpoint = int(sample(target_probs[node + 1], generator))
        return Verdict(path, [draft.token_ids[i] for i in path] + [endpoint])

    @staticmethod
    def _deepest(parents: list[int], passing: torch.Tensor, target_joint: torch.Tensor) -> int:
        """The deepest passing node, the larger target joint at equal depth; -1 if none passes."""
        depths: list[int] = []
        for parent in parents:
            depths.append(0 if parent == -1 else depths[parent] + 1)
        best, best_key = -1, None
        for node in torch.nonzero(passing).flatten().tolist():
            key = (depths[node], float(target_joint[node]))
            if best_key is None or key > best_key:
                best, best_key = node, key
        return best


