"""The harness of the tree verifiers' chi-square tests (test_verifiers_tree_spectr.py, whose docstring describes
it; test_verifiers_traversal.py uses it too): a two-level "language" on a 5-token vocabulary from hand-made tables,
trees drawn from the draft tables as the drafters draw them, the verifier run once per draw, and the p-values of the
first one, two and three emitted tokens against the target tables."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig

ALPHA = 1e-4
# 5·10^4 draws resolve a first-token error of ~0.5 % at ALPHA; edge cases and mutants (errors of several %) need
# fewer. (10^5 draws for every case would take minutes on two shared cores.)
NUM_DRAWS = 50_000
NUM_SMALL = 15_000
SAMPLING = SamplingConfig(temperature=1.0)  # no top-k/top-p: softmax(log p) gives back the tables exactly


def tables(vocab: int, seed: int, zeros: float = 0.3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random next-token tables after the context [V], after one token [V, V], after two [V, V, V]; some zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in ((vocab,), (vocab, vocab), (vocab, vocab, vocab)):
        weights = torch.rand(shape, generator=g) ** 2
        weights[torch.rand(shape, generator=g) < zeros] = 0.0
        weights[..., seed % vocab] += 0.05  # every row keeps some mass
        out.append(weights / weights.sum(-1, keepdim=True))
    return tuple(out)


def draw_trees(draft_tables, branching: tuple[int, int], num: int, replacement: bool, g: torch.Generator):
    """``num`` two-level trees drawn from the draft tables: first-level tokens [num, k0], second [num, k0, k1]."""
    q0, q1, _ = draft_tables
    k0, k1 = branching
    first = torch.multinomial(q0.expand(num, -1), k0, replacement=replacement, generator=g)  # [num, k0]
    second = torch.multinomial(q1[first.flatten()], k1, replacement=replacement, generator=g)  # [num*k0, k1]
    return first, second.reshape(num, k0, k1)


def run_verifier(verifier, target_tables, draft_tables, branching, num, replacement, seed, one_hot=False,
                 kept: list[int] | None = None, third: list[int] | None = None):
    """First and second emitted tokens over ``num`` seeded rounds ([num] each); ``kept``, if given, gets each round's
    number of kept draft tokens, ``third`` each round's third token (drawn from the target where the round emitted
    fewer, with a generator of its own). The trees depend on the seed alone, whatever the verifier."""
    g = torch.Generator().manual_seed(seed)
    completing = torch.Generator().manual_seed(seed + 1000)
    p0, p1, p2 = target_tables
    q0, q1, _ = draft_tables
    k0, k1 = branching
    first, second = draw_trees(draft_tables, branching, num, replacement, g)
    parents = [-1] * k0 + [j for j in range(k0) for _ in range(k1)]
    # Target rows: after the context, after each first-level node, after each second-level node.
    logits = torch.cat([p0.log().expand(num, 1, -1), p1[first].log(),
                        p2[first[:, :, None].expand(-1, -1, k1), second].log().flatten(1, 2)], dim=1)
    draft_rows = torch.cat([q0.expand(num, k0, -1), q1[first][:, :, None].expand(-1, -1, k1, -1).flatten(1, 2)], 1)
    tokens = torch.cat([first, second.flatten(1)], dim=1).tolist()
    fallback = torch.multinomial(p1, num, replacement=True, generator=g).T.tolist()  # [num, V]: a draw after each a
    out_first, out_second = [], []
    for i in range(num):
        draft = Draft(tokens[i], None if one_hot else draft_rows[i], parents)
        verdict = verifier.verify(draft, logits[i], SAMPLING, g)
        emitted = verdict.token_ids
        if kept is not None:
            kept.append(len(verdict.accepted))
        out_first.append(emitted[0])
        out_second.append(emitted[1] if len(emitted) > 1 else fallback[i][emitted[0]])
        if third is not None:
            third.append(emitted[2] if len(emitted) > 2 else
                         int(torch.multinomial(p2[out_first[-1], out_second[-1]], 1, generator=completing)))
    return torch.tensor(out_first), torch.tensor(out_second)


def p_values(target_tables, first: torch.Tensor, second: torch.Tensor,
             third: list[int] | None = None) -> tuple[float, ...]:
    """Chi-square p-values of the first token, of the first pair and (``third`` given) of the first three tokens;
    impossible outcomes give 0. Cells expecting fewer than 5 draws are pooled into one: the three-token law has cells
    expecting 1e-4 draws, where a single draw adds thousands to Pearson's statistic and a correct verifier would fail
    about one run in twenty instead of one in ALPHA's 10^4."""
    p0, p1, p2 = target_tables
    vocab = p0.shape[0]
    results = []
    cases = [(torch.bincount(first, minlength=vocab), p0),
             (torch.bincount(first * vocab + second, minlength=vocab * vocab), (p0[:, None] * p1).flatten())]
    if third is not None:
        cases.append((torch.bincount((first * vocab + second) * vocab + torch.tensor(third), minlength=vocab ** 3),
                      (p0[:, None, None] * p1[:, :, None] * p2).flatten()))
    for observed, expected in cases:
        expected = expected.double() * len(first)
        if observed[expected == 0].sum() > 0:
            results.append(0.0)
            continue
        keep, rare = expected >= 5, (expected > 0) & (expected < 5)
        while rare.any() and float(expected[rare].sum()) < 5 and keep.sum() > 1:  # the pool itself expects 5 or more
            smallest = torch.where(keep, expected, torch.inf).argmin()
            keep[smallest], rare[smallest] = False, True
        counts, wanted = observed[keep].double(), expected[keep]
        if rare.any():
            counts = torch.cat([counts, observed[rare].sum().double()[None]])
            wanted = torch.cat([wanted, expected[rare].sum()[None]])
        results.append(float(chisquare(counts, wanted * counts.sum() / wanted.sum()).pvalue))
    return tuple(results)


VOCAB = 5
TARGET = tables(VOCAB, seed=1)
DRAFT = tables(VOCAB, seed=2, zeros=0.15)  # zeros where the target has mass, yet >= 3 tokens per row (k0 = 3)


def disjoint_case() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(target, draft) tables whose first-token supports are disjoint: the draft only proposes tokens 3 and 4."""
    p0 = TARGET[0].clone()
    p0[3:] = 0.0
    q0 = torch.zeros(VOCAB)
    q0[3:] = 1.0
    uniform = torch.full((VOCAB, VOCAB), 1.0 / VOCAB)
    return (p0 / p0.sum(), TARGET[1], TARGET[2]), (q0 / q0.sum(), uniform, uniform[None].expand(VOCAB, -1, -1))
