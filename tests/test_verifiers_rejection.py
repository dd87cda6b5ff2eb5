"""Statistical losslessness of ``RejectionSamplingVerifier``, on the verifier alone (the sampling conventions it
relies on are tested in test_core_sampling.py).

Setup. A vocabulary of 6 tokens and a two-step "target model" given directly as logits: row 0 is the target after
the committed context, row 1 the target after the first draft token, row 2 after both draft tokens. At verifier
level these rows do not depend on *which* token was drafted; that is a legitimate model (one whose next-token law
ignores the previous token), and it makes the exact law of a round easy to write down. The draft is the same kind
of model: draft token ``i`` is drawn from ``draft_probs[i]``, independently, before the verifier sees it.

Exact law of the first two emitted tokens. Write ``p_i`` for target row ``i`` after temperature/top-k/top-p and
``q_i`` for draft row ``i``. The first emitted token is the draft token ``x_1`` when it is accepted (probability
``q_0(a) min(1, p_0(a)/q_0(a)) = min(p_0(a), q_0(a))`` for ``x_1 = a``), otherwise a recovered token, drawn from the
normalised residual, and the round ends. Given an accepted ``x_1``, the second token is either the bonus token
(1-token draft: drawn from ``p_1``) or the outcome of the same accept/recover step at position 2 (2-token draft),
whose law is ``p_1`` again if the verifier is right. So, for both draft lengths::

    P(first = a, second = b)    = min(p_0(a), q_0(a)) * p_1(b)
    P(first = a, second = none) = max(p_0(a) - q_0(a), 0)

which sums over ``b`` and "none" to ``p_0(a)``: the first-token marginal is the target's. We test both the
first-token marginal (6 cells) and this joint (42 cells) with Pearson's chi-square. A cell of probability 0 that is
ever observed fails outright; cells expected fewer than 5 times are pooled so the chi-square approximation holds.

False alarms. Every draw comes from explicitly seeded ``torch.Generator``s, so each test is deterministic: it passes
or fails the same way on every run. Each chi-square test rejects at ``ALPHA = 1e-4``; a correct verifier therefore
had at most 1e-4 chance per test (under 2e-3 over the 18 p-values checked here, by a union bound) of meeting seeds
that fail it. Power: the mutant verifiers at the end are rejected with p-values that underflow to 0.0 (a bonus drawn
from the draft is only visible to the joint test, as expected).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jointspec.core.draft import Draft
from jointspec.core.sampling import SamplingConfig, processed_probs, sample
from jointspec.core.verdict import Verdict
from jointspec.verifiers import rejection
from jointspec.verifiers.rejection import RejectionSamplingVerifier, residual_distribution

from helpers import chi_square_pvalue

VOCAB = 6
NONE = VOCAB  # "no second token": the round ended after a recovered first token
ALPHA = 1e-4
# 10^5 rounds for the general case; 2 * 10^4 for edge cases and mutants, whose deviations (if any) are large.
# A verify call costs ~50 us, so the whole file stays well under a minute.
NUM_ROUNDS_MAIN = 100_000
NUM_ROUNDS_EDGE = 20_000


def logits_from_probs(rows) -> torch.Tensor:
    """Logits whose softmax is ``rows`` (zeros become -inf)."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


def normalise(rows) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    return rows / rows.sum(axis=-1, keepdims=True)


def exact_joint(target_probs: np.ndarray, draft_probs: np.ndarray) -> np.ndarray:
    """[VOCAB, VOCAB + 1] law of (first token, second token or NONE), from the module docstring."""
    p0, p1 = target_probs[0], target_probs[1]
    q0 = draft_probs[0]
    joint = np.zeros((VOCAB, VOCAB + 1))
    joint[:, :VOCAB] = np.minimum(p0, q0)[:, None] * p1[None, :]
    joint[:, NONE] = np.maximum(p0 - q0, 0.0)
    return joint


def run_rounds(verifier, target_logits: torch.Tensor, draft_probs: torch.Tensor | None, sampling: SamplingConfig,
               num_rounds: int, seed: int, fixed_draft: list[int] | None = None) -> np.ndarray:
    """Verify ``num_rounds`` fresh drafts; counts [VOCAB, VOCAB + 1] of (first, second or NONE) emitted tokens.

    target_logits: [num_draft_tokens + 1, VOCAB]. draft_probs: [num_draft_tokens, VOCAB], from which the draft
    tokens are drawn, or None with ``fixed_draft`` for a deterministic drafter.
    """
    draft_generator = torch.Generator().manual_seed(seed)
    verify_generator = torch.Generator().manual_seed(seed + 1)
    if draft_probs is not None:
        drafts = torch.multinomial(draft_probs, num_rounds, replacement=True,
                                   generator=draft_generator).T.tolist()  # [num_rounds, num_draft_tokens]
    else:
        drafts = [fixed_draft] * num_rounds
    counts = np.zeros((VOCAB, VOCAB + 1), dtype=np.int64)
    for token_ids in drafts:
        verdict = verifier.verify(Draft(token_ids=token_ids, draft_probs=draft_probs), target_logits, sampling,
                                  verify_generator)
        out = verdict.token_ids
        counts[out[0], out[1] if len(out) > 1 else NONE] += 1
    return counts


def lossless_pvalues(verifier, case: dict, num_rounds: int = NUM_ROUNDS_EDGE, seed: int = 0,
                     counts_out: list | None = None) -> tuple[float, float]:
    """(first-token p-value, joint p-value) of ``verifier`` on ``case``; the counts are appended to ``counts_out``."""
    counts = run_rounds(verifier, case["target_logits"], case["draft_probs"], case["sampling"], num_rounds, seed,
                        case.get("fixed_draft"))
    target_probs = case["target_probs"]
    if case["draft_probs"] is not None:
        draft_probs = case["draft_probs"].double().numpy()
    else:
        draft_probs = np.eye(VOCAB)[case["fixed_draft"]]  # a deterministic draft is a one-hot draft
    if counts_out is not None:
        counts_out.append(counts)
    return (chi_square_pvalue(counts.sum(axis=1), target_probs[0]),
            chi_square_pvalue(counts, exact_joint(target_probs, draft_probs)))


# Target and draft rows with full, unequal supports: probabilities from 0.05 to 0.4, so every joint cell has
# thousands of expected draws and both the accept and the recover branches are frequent at both positions.
TARGET = normalise([[0.05, 0.40, 0.10, 0.25, 0.15, 0.05],
                    [0.30, 0.05, 0.20, 0.10, 0.05, 0.30],
                    [0.10, 0.10, 0.40, 0.10, 0.20, 0.10]])
DRAFT = normalise([[0.30, 0.20, 0.20, 0.05, 0.15, 0.10],
                   [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]])
T1 = SamplingConfig(temperature=1.0)


def chain_case(target_probs, draft_probs, num_draft_tokens: int = 2, sampling: SamplingConfig = T1,
               target_logits: torch.Tensor | None = None) -> dict:
    target_probs = np.asarray(target_probs, dtype=np.float64)[: num_draft_tokens + 1]
    return {
        "target_probs": target_probs,
        "target_logits": logits_from_probs(target_probs) if target_logits is None
        else target_logits[: num_draft_tokens + 1],
        "draft_probs": None if draft_probs is None
        else torch.tensor(np.asarray(draft_probs)[:num_draft_tokens], dtype=torch.float32),
        "sampling": sampling,
    }


def test_general_two_token_draft_is_lossless():
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), chain_case(TARGET, DRAFT), NUM_ROUNDS_MAIN)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_one_token_draft_bonus_is_lossless():
    # With one draft token the second emitted token is the bonus token, drawn from target row 1.
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), chain_case(TARGET, DRAFT, num_draft_tokens=1))
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_draft_equal_to_target_is_always_accepted():
    # The draft rows are the verifier's own processed target rows, so p == q bit for bit and min(1, p/q) is 1.
    case = chain_case(TARGET, TARGET[:2])
    case["draft_probs"] = processed_probs(case["target_logits"], T1)[:2]  # [2, VOCAB]
    counts: list[np.ndarray] = []
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), case, seed=1, counts_out=counts)
    assert counts[0][:, NONE].sum() == 0
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_disjoint_supports_always_recover():
    # The draft only proposes tokens 0-2, the target only allows 3-5: nothing is accepted, and the recovered token
    # (the residual is the whole target) must follow the target exactly.
    target = normalise([[0, 0, 0, 0.5, 0.3, 0.2], TARGET[1], TARGET[2]])
    draft = normalise([[0.4, 0.4, 0.2, 0, 0, 0], DRAFT[1]])
    case = chain_case(target, draft)
    counts: list[np.ndarray] = []
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), case, seed=2, counts_out=counts)
    assert counts[0][:, :VOCAB].sum() == 0 and counts[0][:3].sum() == 0
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


@pytest.mark.parametrize("fixed_draft", [[1, 5], [4, 0]])
def test_one_hot_draft_without_probabilities(fixed_draft):
    # draft_probs None (an n-gram drafter): token x is kept with probability p(x), the residual is the target with x
    # removed. [1, 5] drafts the target's favourite first token, [4, 0] a less likely one.
    case = chain_case(TARGET, None)
    case["fixed_draft"] = fixed_draft
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), case, seed=3)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_one_hot_draft_uses_the_draws_of_plain_sampling():
    # A draft without probabilities is judged by the target's own draw at each position, one draw per emitted token:
    # with the same generator, a round emits what plain sampling would have drawn for those positions, whatever was
    # drafted (the rows here do not depend on the drafted tokens). Deterministic: no false failures.
    case = chain_case(TARGET, None)
    for seed in range(20):
        plain = torch.Generator().manual_seed(seed)
        draws = [int(sample(processed_probs(case["target_logits"][i], T1), plain)) for i in range(3)]
        for fixed_draft in ([1, 5], [4, 0], draws[:2], [draws[0], 5 if draws[1] != 5 else 4]):
            verdict = RejectionSamplingVerifier().verify(Draft(token_ids=fixed_draft), case["target_logits"], T1,
                                                         torch.Generator().manual_seed(seed))
            emitted = verdict.token_ids
            assert emitted == draws[:len(emitted)], (seed, fixed_draft)
            kept = next((i for i, token in enumerate(fixed_draft) if token != draws[i]), len(fixed_draft))
            assert verdict.accepted == list(range(kept))


def test_draft_zero_where_target_is_not():
    # Tokens 2-5 can never be drafted, so they can only come out as recovered tokens; the residual must supply them
    # with exactly the target's probability.
    draft = normalise([[0.5, 0.5, 0, 0, 0, 0], [0, 0.6, 0, 0.4, 0, 0]])
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), chain_case(TARGET, draft), seed=4)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_top_k_and_temperature_applied_to_the_target():
    # The law is that of the *processed* target: temperature 0.7, then the 3 largest logits. The kept sets are
    # written by hand ({0, 2, 3}, {1, 4, 5}, {0, 1, 2}); the draft proposes every token, so draft tokens outside
    # the target's top-k must always be rejected.
    logits = torch.tensor([[1.0, -1.0, 0.5, 2.0, 0.0, -2.0],
                           [-1.0, 1.5, 0.0, -0.5, 1.0, 0.8],
                           [0.3, 0.2, 0.1, -1.0, -2.0, -3.0]])
    kept = [[0, 2, 3], [1, 4, 5], [0, 1, 2]]
    target = np.zeros((3, VOCAB))
    for row, tokens in enumerate(kept):
        scaled = logits[row, tokens].double().numpy() / 0.7
        target[row, tokens] = np.exp(scaled) / np.exp(scaled).sum()
    sampling = SamplingConfig(temperature=0.7, top_k=3)
    case = chain_case(target, DRAFT, sampling=sampling, target_logits=logits)
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), case, seed=5)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_top_p_applied_to_the_target():
    # top_p = 0.7 keeps the smallest most-likely set reaching 0.7: row 0 sorted is 0.40, 0.25, 0.15 (sum 0.80) ->
    # {1, 3, 4} renormalised to 0.5, 0.3125, 0.1875; row 1 is 0.30, 0.30, 0.20 (sum 0.80) -> {0, 5, 2}.
    logits = logits_from_probs(TARGET)
    target = np.zeros((3, VOCAB))
    target[0, [1, 3, 4]] = [0.5, 0.3125, 0.1875]
    target[1, [0, 5, 2]] = [0.375, 0.375, 0.25]
    case = chain_case(target, DRAFT, sampling=SamplingConfig(temperature=1.0, top_p=0.7), target_logits=logits)
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), case, seed=6)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_min_p_applied_to_the_target():
    # min_p = 0.45 keeps the tokens at least 0.45 times as likely as the best: row 0 (best 0.40) keeps {1, 3}
    # (0.25 >= 0.18; 0.15 is not), renormalised to 0.40 / 0.65 and 0.25 / 0.65; row 1 (best 0.30) keeps {0, 2, 5}
    # (0.20 >= 0.135), renormalised over 0.80.
    logits = logits_from_probs(TARGET)
    target = np.zeros((3, VOCAB))
    target[0, [1, 3]] = [0.40 / 0.65, 0.25 / 0.65]
    target[1, [0, 2, 5]] = [0.375, 0.25, 0.375]
    target[2, [2, 4]] = [0.40 / 0.60, 0.20 / 0.60]
    case = chain_case(target, DRAFT, sampling=SamplingConfig(temperature=1.0, min_p=0.45), target_logits=logits)
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), case, seed=8)
    assert p_first > ALPHA and p_joint > ALPHA, (p_first, p_joint)


def test_residual_distribution_by_hand():
    target = torch.tensor([0.5, 0.3, 0.2, 0.0])
    draft = torch.tensor([0.2, 0.5, 0.1, 0.2])
    # max(target - draft, 0) = [0.3, 0, 0.1, 0], normalised.
    torch.testing.assert_close(residual_distribution(target, draft), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    # target == draft: the residual is empty (that rejection had probability 0); the target is returned.
    torch.testing.assert_close(residual_distribution(target, target), target)


# Mutants: broken verifiers the same tests must reject. Each shows that the tests above have the power to catch the
# corresponding bug, with p-values far below ALPHA.

class BonusFromDraftVerifier(RejectionSamplingVerifier):
    """Bug: after a full acceptance, the bonus token is drawn from the draft's last distribution, not the target's.
    (Done by swapping the target's last row for the draft's; at temperature 1 ``log q`` softmaxes back to ``q``.)"""

    def verify(self, draft, target_logits, sampling, generator):
        corrupted = torch.cat([target_logits[:-1], draft.draft_probs[-1:].log()])
        return super().verify(draft, corrupted, sampling, generator)


class AcceptWithoutRatioVerifier(RejectionSamplingVerifier):
    """Bug: draft token x is kept with probability target(x) instead of min(1, target(x) / draft(x)), while the
    recovered token still comes from the residual max(target - draft, 0)."""

    def verify(self, draft, target_logits, sampling, generator):
        target_probs = processed_probs(target_logits, sampling)  # [num_nodes + 1, vocab]
        for i, token in enumerate(draft.token_ids):
            if float(torch.rand(1, generator=generator)) < float(target_probs[i, token]):
                continue
            residual = residual_distribution(target_probs[i], draft.draft_probs[i])
            recovered = int(torch.multinomial(residual, 1, generator=generator))
            return Verdict(list(range(i)), list(draft.token_ids[:i]) + [recovered])
        bonus = int(torch.multinomial(target_probs[draft.num_nodes], 1, generator=generator))
        return Verdict(list(range(draft.num_nodes)), list(draft.token_ids) + [bonus])


class RedrawAfterMismatchVerifier(RejectionSamplingVerifier):
    """Bug: a one-hot draft token that differs from the target's draw is replaced by a second, fresh draw (which can
    be the draft token again) instead of by that draw."""

    def verify(self, draft, target_logits, sampling, generator):
        target_probs = processed_probs(target_logits, sampling)
        for i, token in enumerate(draft.token_ids):
            if int(sample(target_probs[i], generator)) != token:
                recovered = int(sample(target_probs[i], generator))
                return Verdict(list(range(i)), list(draft.token_ids[:i]) + [recovered])
        bonus = int(sample(target_probs[draft.num_nodes], generator))
        return Verdict(list(range(draft.num_nodes)), list(draft.token_ids) + [bonus])


def test_mutant_redraw_after_one_hot_mismatch_is_rejected():
    # The first token then comes out as the draft token with probability p + (1 - p) p instead of p.
    case = chain_case(TARGET, None)
    case["fixed_draft"] = [1, 5]
    p_first, p_joint = lossless_pvalues(RedrawAfterMismatchVerifier(), case, seed=10)
    assert p_first < ALPHA and p_joint < ALPHA, (p_first, p_joint)


def test_mutant_recovered_from_target_is_rejected(monkeypatch):
    # Bug: the recovered token is drawn from the target instead of the residual (what an unclamped residual
    # degenerates to: target - draft sums to 0, and the code falls back to the target). Tokens the draft
    # over-proposes come out too often; the first-token test alone catches it.
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_row, draft_row: target_row)
    p_first, p_joint = lossless_pvalues(RejectionSamplingVerifier(), chain_case(TARGET, DRAFT), seed=7)
    assert p_first < ALPHA and p_joint < ALPHA, (p_first, p_joint)


def test_mutant_bonus_from_draft_is_rejected():
    # Only the joint test can see this one: the first token is untouched, the second follows q_0 instead of p_1.
    p_first, p_joint = lossless_pvalues(BonusFromDraftVerifier(), chain_case(TARGET, DRAFT, num_draft_tokens=1),
                                        seed=8)
    assert p_first > ALPHA, p_first
    assert p_joint < ALPHA, p_joint


def test_mutant_accept_without_ratio_is_rejected():
    p_first, p_joint = lossless_pvalues(AcceptWithoutRatioVerifier(), chain_case(TARGET, DRAFT), seed=9)
    assert p_first < ALPHA and p_joint < ALPHA, (p_first, p_joint)
