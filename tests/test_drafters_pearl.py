"""PEARL (drafters/pearl.py): the draft drafts on, on a worker thread, while the target verifies.

What must hold: greedy output is plain decoding's token for token (also in tests/test_core_loop_equivalence.py, with
EOS, length and context limits), including where the tokens proposed were drafted by the worker during the previous
round's verification, and with a trained head as the draft; the worker's drafts are what they would be if drafted
in place (the self-draft, which always agrees with the target, proposes the worker's chain every round after the
first); on the compiled int4 layers a self-draft gets a forward of its own and the output is plain decoding's; the
worker drafts nothing the sequence cannot use; a CPU target's forward runs on half the threads while the worker
drafts, and the caller's thread gets them all back after the sequence, also after an early EOS or a stream closed early;
delays in the worker change neither greedy nor seeded sampled output; at temperature > 0 the first four
tokens follow the target's joint law (chi-square), and a drafter that reports a flattened distribution for the
tokens its worker drafted is rejected by the same test. Greedy checks are deterministic (see
tests/test_core_loop_equivalence.py). The chi-square tests reject at ALPHA = 1e-4: a correct drafter fails about
once in 10,000 runs; on the seeds below the correct drafter gave p = 0.57 and the mutant p = 2.4e-7.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.pearl import ParallelDrafter
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers.rejection import RejectionSamplingVerifier

from helpers import (
    TEST_DEVICE,
    chi_square_pvalue,
    first_occurrences,
    greedy,
    grouped_llama,
    hf_greedy,
    make_decoder,
    model_joint_law,
    random_prompt,
)

ALPHA = 1e-4
GAMMA = 4


def pearl(target_model, draft: CausalLM | None = None, num_draft_tokens: int = GAMMA, cls=ParallelDrafter):
    target = CausalLM(target_model, name="tiny-target")
    drafter = cls(draft if draft is not None else target.fork("self-draft"), num_draft_tokens)
    return SpeculativeDecoder(target, drafter, RejectionSamplingVerifier())


def test_a_self_draft_proposes_the_workers_chain_after_the_first_round(target_model):
    """The target as its own draft agrees with every token, so after round one (γ tokens drafted in place, the
    target's token after them) each round proposes the γ - 1 tokens the worker drafted past that token while the
    round before was verified: rounds of γ + 1 tokens, then of γ, every one of them plain decoding's."""
    prompt = random_prompt(0)
    decoder = pearl(target_model)
    out = decoder.generate(prompt, greedy(1 + GAMMA + 4 * GAMMA))
    assert out == hf_greedy(target_model, prompt, len(out))
    assert decoder.stats.num_rounds == 5
    assert decoder.stats.num_draft_tokens == GAMMA + 4 * (GAMMA - 1) == decoder.stats.num_accepted_tokens


def test_eos_inside_a_chain_the_worker_drafted(target_model):
    """EOS declared at positions inside the worker-drafted proposals of rounds after the first (round one covers
    new tokens 0..γ, each later round γ tokens, its last the target's own): the output stops right after it."""
    prompt = random_prompt(6)
    reference = hf_greedy(target_model, prompt, 40)
    inside = [(pos, tok) for tok, pos in first_occurrences(reference).items()
              if pos > GAMMA and (pos - GAMMA - 1) % GAMMA != GAMMA - 1]
    assert len(inside) >= 2
    for pos, eos in (inside[0], inside[-1]):
        decoder = pearl(target_model)
        assert decoder.generate(prompt, greedy(40, frozenset({eos}))) == reference[:pos + 1]


@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_greedy_with_a_trained_head_is_plain_decoding(target_model, trained_head_dir, num_draft_tokens):
    """A head reads the target's features; while the target's forward writes more of them the worker must read
    none past the committed text (FeatureDraft.feature_horizon), and the output is plain decoding's."""
    target = CausalLM(target_model, name="tiny-target")
    config = MethodConfig(name="pearl", draft=str(trained_head_dir), num_draft_tokens=num_draft_tokens)
    drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    for seed in (1, 4):
        prompt = random_prompt(seed)
        assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    assert decoder.stats.num_accepted_tokens > 0
    assert drafter.draft.feature_horizon is None  # set only while the worker drafts


@pytest.mark.parametrize("prompt_seed", [1, 6])
def test_a_self_draft_on_the_compiled_layers_drafts_beside_them(prompt_seed):
    """A fork of the target shares the target's lean forward, whose compiled layers keep the cache they were last
    given; the worker calling it during the target's forward once gave the target's rows another cache (zeros on the
    embedded model). The worker's draft gets a forward of its own, and the output is plain decoding's."""
    model = quantize_model(grouped_llama(2), "int4")
    prompt = random_prompt(prompt_seed, length=40)
    outputs = []
    for method in ("ar", "pearl"):
        target = CausalLM(model, name="int4 target")
        config = MethodConfig(name=method, draft="self" if method == "pearl" else None, num_draft_tokens=3)
        drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
        if method == "pearl":
            assert target.lean is not None and drafter.draft.lean is not target.lean
            assert drafter.draft.lean.compiled is not None  # the worker's draft runs the compiled layers too
        decoder = SpeculativeDecoder(target, drafter, verifier)
        outputs.append(decoder.generate(prompt, greedy(60)))
    assert outputs[1] == outputs[0]
    assert decoder.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("max_new_tokens", [6, 13, 21])
def test_the_worker_drafts_nothing_the_sequence_cannot_use(target_model, max_new_tokens):
    """The worker stops where the sequence's length (or the context) ends: a draft with a fixed context (llama.cpp's)
    must never be fed past it. The draft agrees with every token, so each round runs the worker as far as it may."""
    prompt = random_prompt(0)
    decoder = pearl(target_model)
    draft, furthest = decoder.drafter.draft, []
    forward = draft.forward

    def counted(token_ids, **kwargs):
        out = forward(token_ids, **kwargs)
        furthest.append(draft.num_cached)
        return out

    draft.forward = counted
    assert decoder.generate(prompt, greedy(max_new_tokens)) == hf_greedy(target_model, prompt, max_new_tokens)
    # The last token a sequence can use is its final one; the draft holds every token before the one it drafts.
    assert max(furthest) <= len(prompt) + max_new_tokens - 1


class SlowDrafter(ParallelDrafter):
    """Sleeps before some of the worker's tokens: the target's forward then often ends before the worker does."""

    def _extend(self, count, sampling):
        time.sleep(0.002 * (len(self._chain) % 3))
        super()._extend(count, sampling)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_timing_changes_nothing_the_seed_fixes(target_model, other_model, temperature):
    prompt = random_prompt(2)
    sampling = SamplingConfig(temperature=temperature)
    outputs = []
    for cls in (ParallelDrafter, SlowDrafter, ParallelDrafter):
        decoder = pearl(target_model, CausalLM(target_model, name="self").fork(), 3, cls)
        generator = torch.Generator().manual_seed(7)
        outputs.append(decoder.generate(prompt, DecodeConfig(max_new_tokens=30, sampling=sampling), generator))
    assert outputs[0] == outputs[1] == outputs[2]
    if temperature == 0:
        assert outputs[0] == hf_greedy(target_model, prompt, 30)


def test_a_worker_error_reaches_the_caller(target_model):
    class Broken(ParallelDrafter):
        def _extend(self, count, sampling):
            raise RuntimeError("draft failed")

    with pytest.raises(RuntimeError, match="draft failed"):
        pearl(target_model, cls=Broken).generate(random_prompt(0), greedy(8))


def test_the_target_verifies_on_half_the_threads_and_gets_them_back(target_model):
    """While the worker drafts, the target's forward runs on half the threads; after the sequence every thread is
    back on the caller's, also where it ends at an end-of-sequence token mid-round (no commit follows)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        decoder = pearl(target_model)
        seen = []
        forward = decoder.target.forward

        def counted(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return forward(*args, **kwargs)

        decoder.target.forward = counted
        prompt = random_prompt(6)
        reference = hf_greedy(target_model, prompt, 40)
        eos = reference[GAMMA + 2]  # inside round two's proposal, where the worker is drafting on
        assert reference.index(eos) == GAMMA + 2
        assert decoder.generate(prompt, greedy(40, frozenset({eos}))) == reference[:GAMMA + 3]
        # The prompt, then two rounds beside the worker; a GPU target's forward needs none of torch's CPU threads, so
        # on one nothing is split (drafters/pearl.py).
        beside_worker = 1 if TEST_DEVICE.type == "cpu" else 2
        assert seen[0] == 2 and seen[1:] == [beside_worker, beside_worker]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_stream_closed_early_stops_the_worker(target_model):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        decoder = pearl(target_model)
        stream = decoder.stream(random_prompt(0), greedy(40))
        next(stream)  # round one, committed: its threads are back, its worker drafts on
        assert torch.get_num_threads() == 2 and decoder.drafter._pending is not None
        stream.close()
        assert decoder.drafter._pending is None  # finish() waited for the worker: nothing runs on
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_batched_engine_refuses_it(target_model):
    from jointspec.batch.lockstep import LockstepEngine

    engine = LockstepEngine(CausalLM(target_model, name="tiny-target"), None)
    with pytest.raises(UnsupportedOptionError, match="pearl"):
        engine.method(MethodConfig(name="pearl", draft="self"))


# -- the sampled law ------------------------------------------------------------------------------------------------

SAMPLING = SamplingConfig(temperature=0.3, top_k=2)
# Round one proposes 2 tokens (γ = 2) and adds one; round two may propose one, from the worker's chain where its
# first token is the target's third; the fifth is the target's. The test reads the law of the first four.
NEW_TOKENS = 5
LAW_TOKENS = 4
DRAWS = 2000


class MisreportingDrafter(ParallelDrafter):
    """Draws the tokens its worker drafted correctly but reports a flattened distribution for them: the verifier then
    keeps them with the wrong ratio. Rounds drafted in place report the truth, so only the worker's path is wrong."""

    def propose(self, context_ids, max_num_draft_tokens, sampling, generator):
        chain_before = self.worker_rounds
        draft = super().propose(context_ids, max_num_draft_tokens, sampling, generator)
        if draft.draft_probs is not None and self.worker_rounds > chain_before:
            draft.draft_probs = torch.softmax(draft.draft_probs.clamp_min(1e-12).log() / 4, dim=-1)
        return draft


def joint_pvalue(cls, target_model, draft_model, prompt: list[int]) -> float:
    law = model_joint_law(target_model, prompt, SAMPLING, LAW_TOKENS)
    cells = sorted(law)
    counts = dict.fromkeys(cells, 0)
    decoder = pearl(target_model, CausalLM(draft_model, name="draft"), 2, cls)
    uses_chain = 0
    for seed in range(DRAWS):
        out = tuple(decoder.generate(prompt, DecodeConfig(max_new_tokens=NEW_TOKENS, sampling=SAMPLING),
                                     torch.Generator().manual_seed(seed)))[:LAW_TOKENS]
        if out not in counts:
            return 0.0  # a sequence the target cannot produce
        counts[out] += 1
        uses_chain += decoder.drafter.worker_rounds
    assert uses_chain > DRAWS // 10, "too few runs proposed the worker's chain for the test to see it"
    return chi_square_pvalue(np.array([counts[c] for c in cells]), np.array([law[c] for c in cells]))


def test_sampled_tokens_follow_the_target_and_a_misreporting_worker_is_caught(target_model):
    """The draft is the target itself: its tokens are always kept, so the worker's chain is proposed whenever its
    first token equals the target's own draw, and a wrong reported distribution changes the kept tokens' law."""
    prompt = random_prompt(5)
    p_correct = joint_pvalue(ParallelDrafter, target_model, target_model, prompt)
    p_mutant = joint_pvalue(MisreportingDrafter, target_model, target_model, prompt)
    assert p_correct > ALPHA, p_correct
    assert p_mutant < ALPHA, p_mutant


def test_make_decoder_builds_it(target_model, other_model):
    decoder = make_decoder("pearl-other", target_model, other_model)
    assert isinstance(decoder.drafter, ParallelDrafter)
