"""Multi-token joint decoding (MTJD) references: the exact block law for tiny vocabularies, MTAD's idealised law
and its error bound, and a target-only beam-sampling approximation of MTJD (the quality ceiling MTAD aims at).

Exact MTJD chooses the next ``num_tokens`` tokens as one unit from the target's joint
``P(y_1..y_n | c) = Π p̃(y_i | c, y_<i)``; enumerating it costs ``V^n`` blocks, so it is only for tests with tiny
vocabularies. Sampling the untempered joint is distributionally the same as ancestral sampling; joint decoding
differs when a decoding rule (greedy, beam search, truncation) acts on the joint instead of each token.

Idealised MTAD (docs/mtad.md; Qin et al., arXiv 2407.09722): draw a block ``y ~ Q`` (the draft joint), keep it iff
``P(y) >= tau·Q(y)``, otherwise draw again. Its law is ``Q`` restricted to the kept set ``K`` and renormalised,
``pi(y) = Q(y)/Z`` with ``Z = Q(K)``, and ``TV(pi, P) <= (1 - Z) + TV(Q, P) <= TV(Q, P)·(2 - tau)/(1 - tau)`` for
``tau < 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.sampling import SamplingConfig, processed_probs
from jointspec.drafters.beam import beam_search
from jointspec.drafters.treecache import DraftTreeCache


def all_prefixes_tree(vocab_size: int, max_len: int) -> tuple[list[int], list[int]]:
    """(parents, tokens) of every token sequence of length 1..max_len, level by level, lexicographic in a level.

    A sequence of length ``d + 1`` with base-``vocab_size`` index ``f`` is node ``offset_d + f``.
    """
    parents: list[int] = []
    tokens: list[int] = []
    previous_offset = -1
    for depth in range(max_len):
        offset = len(tokens)
        for flat in range(vocab_size ** (depth + 1)):
            parents.append(-1 if depth == 0 else previous_offset + flat // vocab_size)
            tokens.append(flat % vocab_size)
        previous_offset = offset
    return parents, tokens


@torch.inference_mode()
def exact_block_distribution(model: CausalLM, context_ids: list[int], num_tokens: int,
                             sampling: SamplingConfig) -> torch.Tensor:
    """The model's processed joint over the next ``num_tokens`` tokens, ``[vocab] * num_tokens`` (float64).

    Scores every prefix in one tree forward on a private cache (``model``'s own cache is untouched).
    """
    vocab = model.vocab_size
    probe = model.fork(f"{model.name} (mtjd probe)")
    rows = [processed_probs(probe.forward(context_ids, num_logits=1).logits, sampling).double()]  # [1, vocab]
    if num_tokens > 1:
        parents, tokens = all_prefixes_tree(vocab, num_tokens - 1)
        rows.append(processed_probs(probe.forward(tokens, parents=parents).logits, sampling).double())
    probs = torch.cat(rows)  # [1 + Σ_{d<n-1} vocab^(d+1), vocab]: row 0 after the context, row 1 + node after it
    joint = probs[0]  # [vocab]
    offset = 1
    for depth in range(1, num_tokens):
        level = probs[offset: offset + vocab ** depth]  # [vocab^depth, vocab]
        joint = (joint.reshape(-1, 1) * level).reshape(-1)
        offset += vocab ** depth
    return joint.reshape([vocab] * num_tokens)


def total_variation(law_a: torch.Tensor, law_b: torch.Tensor) -> float:
    return 0.5 * float((law_a.double() - law_b.double()).abs().sum())


def mtjd_greedy_block(joint: torch.Tensor) -> tuple[int, ...]:
    """Joint greedy decoding: the block with the largest joint probability."""
    return tuple(int(i) for i in torch.unravel_index(joint.argmax(), joint.shape))


@dataclass
class IdealisedMTAD:
    law: torch.Tensor  # [vocab] * num_tokens: pi
    kept_mass: float  # Z = Q(K)
    bound: float  # TV(Q, P)·(2 - tau)/(1 - tau); inf for tau >= 1


def idealised_mtad(target_joint: torch.Tensor, draft_joint: torch.Tensor, tau: float) -> IdealisedMTAD:
    """MTAD's idealised block law and the TV bound it must satisfy (see the module docstring)."""
    target, draft = target_joint.double(), draft_joint.double()
    kept = (draft > 0) & (target >= tau * draft)
    kept_mass = float(draft[kept].sum())
    law = torch.where(kept, draft, torch.zeros_like(draft)) / kept_mass
    ratio = (2.0 - tau) / (1.0 - tau) if tau < 1 else float("inf")
    return IdealisedMTAD(law, kept_mass, total_variation(draft, target) * ratio)


def beam_mtjd_generate(target: CausalLM, prompt_ids: list[int], max_new_tokens: int, num_tokens: int,
                       beam_width: int, sampling: SamplingConfig, generator: torch.Generator | None,
                       eos_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """Target-only beam-sampling MTJD: per block, beam-sample ``num_tokens`` levels with the *target* and commit the
    best beam whole. Costs ``num_tokens`` target forwards per block (no speed-up; a quality reference only)."""
    cache = DraftTreeCache(target.fork(f"{target.name} (mtjd)"))
    cache.start()
    tokens = list(prompt_ids)
    new: list[int] = []
    while len(new) < max_new_tokens:
        depth = min(num_tokens, max_new_tokens - len(new))
        beams = beam_search(cache, tokens, depth, beam_width, sampling, generator, eos_token_ids)
        block = [beams.token_ids[i] for i in beams.path(beams.beams[beams.best_beam])]
        cut = next((i + 1 for i, t in enumerate(block) if t in eos_token_ids), None)
        block = block[:cut]
        new.extend(block)
        tokens.extend(block)
        if cut is not None:
            break
        cache.commit(tokens, len(block))
    return new

