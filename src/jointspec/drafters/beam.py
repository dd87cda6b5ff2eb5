"""Beam sampling with a draft model: MTAD's drafter (chain: the best beam; tree: every beam of every level).

A *beam* is a path of up to ``num_draft_tokens`` tokens after the context. Step ``s`` scores every child
``(beam b, token v)`` by the draft joint ``log Q(path_b) + log q̃(v | path_b)`` and keeps ``beam_width`` children:
sampled from ``softmax`` of those scores (so a child is drawn with probability ∝ its draft joint ``Q``), or, at
temperature 0, the top ``beam_width`` (plain beam search on the raw draft log-softmax). Beam weights are the kept
joints renormalised, ``w_b = Q(path_b) / Σ_j Q(path_j)``, computed in log space. (The reference code instead took a
softmax *of probabilities*, which makes weights nearly uniform; we do not copy that, see docs/mtad.md.)

End of sequence: a beam whose last token is an end-of-sequence token is *finished*. It is never expanded (nothing
after an EOS is worth the target's time); it stays a candidate at later steps with its joint unchanged (its
continuation has probability 1) and competes with the growing beams, as in ordinary beam search.

Example, ``beam_width=2``, depth 2: step 0 keeps tokens ``[7, 3]`` (nodes 0, 1); step 1 keeps ``(beam 0, 5)`` and
``(beam 0, 9)`` (nodes 2, 3, both children of node 0). The tree draft is tokens ``[7, 3, 5, 9]`` with parents
``[-1, -1, 0, 0]``; the chain draft is the best final beam, e.g. ``[7, 9]``.

Draft KV cache: see :mod:`jointspec.drafters.treecache` (the tree grown so far is re-fed each level, the accepted
path is kept after the round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import EMPTY_DRAFT, Draft
from jointspec.core.sampling import SamplingConfig, multinomial, processed_probs
from jointspec.drafters.treecache import DraftTreeCache


@dataclass
class BeamTree:
    """Every node kept by a beam search, and the final beams.

    ``parents``/``token_ids`` list the nodes level by level (-1: follows the context). ``draft_logprobs[i]`` is
    ``log q̃(token_i | path to its parent)``. ``beams[b]`` is the last node of final beam ``b`` and
    ``beam_log_joint[b]`` its draft joint ``log Q(path_b)``.
    """

    parents: list[int]
    token_ids: list[int]
    draft_logprobs: torch.Tensor  # [num_nodes]
    beams: list[int]
    beam_log_joint: torch.Tensor  # [num_beams]

    def __post_init__(self) -> None:
        if not len(self.parents) == len(self.token_ids) == self.draft_logprobs.shape[0]:
            raise ValueError(f"BeamTree has {len(self.token_ids)} tokens, {len(self.parents)} parents and "
                             f"{self.draft_logprobs.shape[0]} log-probabilities")
        if len(self.beams) != self.beam_log_joint.shape[0]:
            raise ValueError(f"BeamTree has {len(self.beams)} beams but {self.beam_log_joint.shape[0]} joints")

    @property
    def log_weights(self) -> torch.Tensor:
        """Normalised beam weights, ``log(Q(path_b) / Σ_j Q(path_j))`` ([num_beams])."""
        return self.beam_log_joint - torch.logsumexp(self.beam_log_joint, dim=0)

    @property
    def best_beam(self) -> int:
        return int(self.beam_log_joint.argmax())

    def path(self, node: int) -> list[int]:
        """Nodes from the root down to ``node`` (empty for -1)."""
        nodes: list[int] = []
        while node != -1:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]


def beam_search(cache: DraftTreeCache, context_ids: list[int], num_draft_tokens: int, beam_width: int,
                sampling: SamplingConfig, generator: torch.Generator | None,
                eos_token_ids: frozenset[int] = frozenset(), replacement: bool = False) -> BeamTree:
    """Beam sampling (or beam search when ``sampling.greedy``) of ``num_draft_tokens`` levels after the context."""
    parents: list[int] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    beams = [-1]  # one empty beam at the root
    # Small bookkeeping (joints, picked log-probabilities) stays on the CPU; the [beams, vocab] scores live with the
    # draft's logits, on whatever device the draft runs.
    beam_log_joint = torch.zeros(1, dtype=torch.float64)
    logits = cache.context_logits(context_ids)[None]  # [1, vocab]: the root is the only expandable beam
    level_start = 0
    for level in range(num_draft_tokens):
        alive = [b for b, node in enumerate(beams) if node == -1 or token_ids[node] not in eos_token_ids]
        finished = [b for b in range(len(beams)) if b not in alive]
        if not alive:
            break
        if level > 0:
            # Alive beams all end on the last level, whose nodes are the last rows.
            logits = cache.tree_logits(parents, token_ids, num_logits=len(token_ids) - level_start)
        rows = torch.tensor([0 if beams[b] == -1 else beams[b] - level_start for b in alive], device=logits.device)
        joints = beam_log_joint.to(logits.device)
        vocab = logits.shape[-1]
        if sampling.greedy:
            # Beam search ranks children by the untruncated draft joint.
            child_logq = logits[rows].double().log_softmax(dim=-1).flatten()  # [num_alive * vocab]
            children = torch.arange(child_logq.numel(), device=logits.device)  # flat (beam, token) indices
            child_scores = joints[alive].repeat_interleave(vocab) + child_logq
        else:
            # Only the children inside top-k / top-p can be drawn: a few dozen of beams x vocabulary, listed in the
            # same flat order, so the draws are those over the full vector.
            probs = processed_probs(logits[rows], sampling)  # [num_alive, vocab]
            beam_rows, tokens = probs.nonzero(as_tuple=True)
            child_logq = probs[beam_rows, tokens].double().log()
            children = beam_rows * vocab + tokens
            child_scores = joints[alive][beam_rows] + child_logq
        scores = torch.cat([child_scores, joints[finished]])
        picks = _choose(scores, beam_width, sampling.greedy, replacement, generator)

        level_start = len(token_ids)
        new_beams: list[int] = []
        num_children = children.numel()
        chosen = picks.tolist()
        picked_children = picks[picks < num_children]
        # One read of the chosen children's indices and log-probabilities, not one device round trip each.
        child_index = iter(children[picked_children].tolist())
        child_logprobs = iter(child_logq[picked_children].tolist())
        for pick in chosen:
            if pick < num_children:
                index = next(child_index)
                beam, token = alive[index // vocab], index % vocab
                parents.append(beams[beam])
                token_ids.append(token)
                logprobs.append(next(child_logprobs))
                new_beams.append(len(token_ids) - 1)
            else:
                new_beams.append(beams[finished[pick - num_children]])
        beams, beam_log_joint = new_beams, scores[picks].cpu()
    return BeamTree(parents, token_ids, torch.tensor(logprobs, dtype=torch.float64), beams, beam_log_joint)


def _choose(scores: torch.Tensor, beam_width: int, greedy: bool, replacement: bool,
            generator: torch.Generator | None) -> torch.Tensor:
    """Indices of the kept children: the top ``beam_width`` scores, or draws ∝ ``exp(scores)``."""
    finite = torch.isfinite(scores)
    if greedy:
        return torch.topk(scores, min(beam_width, int(finite.sum()))).indices
    # Draw among the possible children only: with top-k/top-p (or a head's draft vocabulary) they are a few dozen of
    # beams x vocabulary candidates, and a draw over the full vector cost milliseconds. Same distribution.
    possible = finite.nonzero().squeeze(-1)  # [num_possible]
    probs = torch.softmax(scores[possible], dim=0)  # the logsumexp normalisation of w_b ∝ Q(path_b)
    # Without replacement there may be fewer possible children than beams (top-k/top-p): keep them all.
    num_draws = beam_width if replacement else min(beam_width, possible.numel())
    return possible[multinomial(probs, num_draws, replacement=replacement, generator=generator)]


class BeamDrafter:
    """MTAD's drafter. ``tree=False``: the best beam as a chain; ``tree=True``: every beam of every level."""

    def __init__(self, draft: CausalLM, num_draft_tokens: int, beam_width: int, *, tree: bool = False,
                 eos_token_ids: frozenset[int] = frozenset(), replacement: bool = False) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        self.cache = DraftTreeCache(draft)
        self.num_draft_tokens = num_draft_tokens
        self.beam_width = beam_width
        self.tree = tree
        self.eos_token_ids = frozenset(eos_token_ids)
        self.replacement = replacement

    def start(self, prompt_ids: list[int]) -> None:
        self.cache.start()

    def propose(self, context_ids: list[int], max_num_draft_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Draft:
        num_tokens = min(self.num_draft_tokens, max_num_draft_tokens, self.cache.room(context_ids))
        if num_tokens <= 0:
            return EMPTY_DRAFT
        beams = beam_search(self.cache, context_ids, num_tokens, self.beam_width, sampling, generator,
                            self.eos_token_ids, self.replacement)
        if self.tree:
            return Draft(token_ids=beams.token_ids, parents=beams.parents,
                         draft_logprobs=beams.draft_logprobs.float())
        path = beams.path(beams.beams[beams.best_beam])
        return Draft(token_ids=[beams.token_ids[i] for i in path], draft_logprobs=beams.draft_logprobs[path].float())

    def commit(self, context_ids: list[int], num_accepted: int) -> None:
        self.cache.commit(context_ids, num_accepted)
