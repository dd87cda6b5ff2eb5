"""Repetition, presence and frequency penalties and the logit bias (core/penalties.py) through every method.

What is proved: the penalties and the bias are vLLM's, by hand on a small row (the bias first); every lossless
method, penalised or biased, gives the tokens
of plain penalised decoding done by hand (one full forward a token, the penalties from the text so far, the argmax),
chains, a tree and MTAD, with an end-of-sequence token inside drafts; a seeded lookup draft samples plain sampling's
penalised text token for token; both batched engines give each request the loop's tokens. Fixed models, prompts
and seeds: no false-failure odds.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.batch.engine import BatchEngine, BatchRequest
from jointspec.batch.lockstep import LockstepEngine
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.penalties import Penalties, penalized_rows
from jointspec.core.sampling import SamplingConfig
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import ROUND_KINDS, grouped_llama, random_prompt

PENALTIES = Penalties(repetition=1.3, presence=0.4, frequency=0.6)
# A bias that bans tokens the tiny models write often unbiased and favours one, with a presence penalty beside it.
BIASED = Penalties(presence=0.3, bias={5: -100.0, 17: -100.0, 40: 4.0, 41: -2.5})
METHODS = {**ROUND_KINDS, "lookahead": MethodConfig("lookahead")}


@pytest.fixture(scope="module")
def int4_target():
    from jointspec.backends.hf import CausalLM

    return CausalLM(quantize_model(grouped_llama(0), "int4"), name="int4")


def decode(target, method: MethodConfig, prompt: list[int], config: DecodeConfig, seed: int = 0) -> list[int]:
    fork = target.fork("decode")
    drafter, verifier = build_method(MethodContext(method, fork, None, None))
    return SpeculativeDecoder(fork, drafter, verifier).generate(prompt, config, torch.Generator().manual_seed(seed))


def by_hand(target, prompt: list[int], max_new_tokens: int, penalties: Penalties, eos: frozenset[int]) -> list[int]:
    """Plain penalised greedy decoding: a whole forward over the text for each token, the penalties, the argmax."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_new_tokens:
        fork = target.fork("by hand")
        row = fork.forward(tokens).logits[-1:]
        token = int(penalized_rows(row, tokens, len(prompt), [[]], penalties).argmax())
        tokens.append(token)
        if token in eos:
            break
    return tokens[len(prompt):]


def test_the_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    # Prompt [0], answer [3, 3] and a draft path [2]: repetition over 0, 2, 3; frequency and presence over 3 (twice)
    # and 2 (once).
    out = penalized_rows(logits, [0, 3, 3], 1, [[2]], Penalties(repetition=2.0, presence=0.5, frequency=0.25))
    assert out.tolist() == [[1.0, -1.0, 0.25 - 0.75, 1.5 - 1.0, 0.0]]
    assert penalized_rows(logits, [0, 3, 3], 1, [[2]], Penalties()).tolist() == logits.tolist()
    negative = penalized_rows(logits, [1], 0, [[]], Penalties(repetition=2.0))
    assert negative[0, 1] == -2.0  # a negative logit is multiplied
    with pytest.raises(ValueError, match="2 histories for 1 rows"):
        penalized_rows(logits, [0], 0, [[], []], PENALTIES)
    for bad, match in ((dict(repetition=0.0), "repetition_penalty must be a positive"),
                       (dict(presence=2.5), r"presence_penalty must be in \[-2, 2\]"),
                       (dict(frequency=-3), r"frequency_penalty must be in \[-2, 2\]")):
        with pytest.raises(ValueError, match=match):
            Penalties(**bad)
    assert not Penalties().active and PENALTIES.active
    import numpy as np

    assert Penalties(np.float32(1.5), np.int64(1)).repetition == 1.5  # numpy's numbers, as the sampling settings take


def test_the_logit_bias_by_hand():
    logits = torch.tensor([[1.0, -1.0, 0.5, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    biased = Penalties(bias={0: 1.0, 3: -100})
    assert biased.active and biased.bias == ((0, 1.0), (3, -100.0))
    assert penalized_rows(logits, [], 0, [[], []], biased).tolist() == [[2.0, -1.0, 0.5, -97.0, 0.0],
                                                                         [1.0, 0.0, 0.0, -100.0, 0.0]]
    # The bias first, then the repetition penalty (vLLM's order): token 0's 1.0 + 1.0, then halved; the other order
    # would give 1.5.
    both = Penalties(repetition=2.0, bias={0: 1.0})
    assert penalized_rows(logits[:1], [0], 0, [[]], both)[0, 0] == 1.0
    assert Penalties(bias=[(4, 2), (1, -3)]).bias == ((1, -3.0), (4, 2.0))  # pairs too, kept sorted
    for bad, error, match in (({0: 100.5}, ValueError, r"logit_bias\[0\] must be in \[-100, 100\]"),
                              ({-1: 1.0}, ValueError, "keys must be token ids"),
                              ({"7": 1.0}, ValueError, "keys must be token ids"),
                              ({0: float("nan")}, ValueError, r"logit_bias\[0\] must be a finite number"),
                              ({0: True}, TypeError, "must be a number"),
                              ([(1, 1.0), (1, 2.0)], ValueError, "lists token 1 twice"),
                              ([1, 2], TypeError, "must map token ids to amounts"),
                              (5, TypeError, "must map token ids to amounts"),
                              ("5=1", TypeError, "must map token ids to amounts")):
        with pytest.raises(error, match=match):
            Penalties(bias=bad)
    with pytest.raises(UnsupportedOptionError, match="token id 9, beyond this model's vocabulary of 5"):
        penalized_rows(logits, [], 0, [[], []], Penalties(bias={9: 1.0}))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model", ["float32", "int4"])
@pytest.mark.parametrize("penalties", [PENALTIES, BIASED], ids=["penalised", "biased"])
def test_every_lossless_method_decodes_plain_penalised_greedy(method, model, penalties, target, int4_target):
    target = int4_target if model == "int4" else target
    for seed in (3, 5):
        prompt = random_prompt(seed)
        expected = by_hand(target, prompt, 20, penalties, frozenset())
        # An end-of-sequence token set at an answer token a draft may run past.
        eos = frozenset({expected[9]})
        config = DecodeConfig(20, SamplingConfig(0.0), eos, penalties=penalties)
        assert decode(target, METHODS[method], prompt, config) == by_hand(target, prompt, 20, penalties, eos)
        assert decode(target, METHODS[method], prompt, DecodeConfig(20, penalties=penalties)) == expected
    # (And the penalties change the answer: the test would pass vacuously otherwise.)
    assert decode(target, METHODS[method], prompt, DecodeConfig(20)) != expected


@pytest.mark.parametrize("model", ["float32", "int4"])
def test_a_seeded_lookup_draft_samples_plain_penalised_sampling_token_for_token(model, target, int4_target):
    # The rejection verifier keeps the target's own draw for a draft without probabilities: with each row penalised
    # by its own path, pld samples ar's text, whatever it drafted.
    target = int4_target if model == "int4" else target
    config = DecodeConfig(24, SamplingConfig(0.9, top_k=20), penalties=PENALTIES)
    for seed in range(4):
        prompt = random_prompt(1)  # a prompt that repeats itself: lookup drafts often
        assert decode(target, METHODS["pld"], prompt, config, seed) == decode(target, METHODS["ar"], prompt, config,
                                                                              seed)


def test_the_batched_engines_give_each_request_the_loops_tokens(target, int4_target):
    prompts = [random_prompt(seed) for seed in (0, 3, 5, 6)]
    penalties = [PENALTIES, Penalties(), BIASED, Penalties(bias={40: 4.0, 5: -100.0, 17: -100.0})]  # the last alone
    for engine, method in ((LockstepEngine(int4_target, max_batch_size=4), METHODS["specinfer-self"]),
                           (BatchEngine(target, max_batch_size=4), METHODS["pld"])):
        requests = [BatchRequest(tuple(p), DecodeConfig(16, penalties=pen), method)
                    for p, pen in zip(prompts, penalties)]
        out = engine.generate(requests)
        reference = int4_target if isinstance(engine, LockstepEngine) else target
        assert out == [by_hand(reference, p, 16, pen, frozenset()) for p, pen in zip(prompts, penalties)]
        assert out[3] != by_hand(reference, prompts[3], 16, Penalties(), frozenset())  # (the bias alone tells)
