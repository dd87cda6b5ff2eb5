"""``sparse-self``: the target drafting for itself over part of its own cache (drafters/sparse_self.py).

What must hold: ``forward(attend_to=...)`` is attention restricted to exactly those cached tokens (checked against
transformers' forward with the same mask written out by hand); drafting leaves the target's cache as it found it; the
output is plain decoding's, token for token at temperature 0, on float32 and on the int4 compiled layers; and at
temperature > 0 the first token follows the target's law (a chi-square test that rejects a drafter misreporting its
distribution). Greedy checks are deterministic (fp32 tiny models with sharpened logits, see
tests/test_core_loop_equivalence.py). The chi-square tests reject at ALPHA = 1e-4: a correct drafter fails about once
in 10,000 runs, and the misreporting one was rejected with p = 2e-27 on the seeds below (the correct one: p = 0.92).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.sparse_self import SparseSelfDrafter, SparseView, SparseViewTarget
from jointspec.kernels.grouped import float_inputs
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers.rejection import RejectionSamplingVerifier

from helpers import VOCAB, chi_square_pvalue, greedy, grouped_llama, random_prompt, tiny_llama

# A view small enough for tiny models: it leaves out most of a 100-token context.
TINY_VIEW = SparseView(sinks=2, window=6, chunk=5, chunks=2, lead=1, min_ngram=1, min_context=8)
ALPHA = 1e-4


def repetitive_prompt(seed: int, length: int) -> list[int]:
    """A prompt whose later part repeats earlier spans, so that the view retrieves something."""
    base = random_prompt(seed, length=length // 3)
    return (base + random_prompt(seed + 1, length=length // 3) + base)[:length]


def test_attend_to_is_attention_over_exactly_those_cached_tokens():
    model = tiny_llama(2)
    target = CausalLM(model)
    context = random_prompt(3, length=30)
    target.forward(context, num_logits=0)
    seen = torch.tensor([0, 1, 7, 8, 9, 25, 26, 27, 28, 29])
    logits = target.forward([5, 6], attend_to=seen).logits  # two new tokens: each also sees the new ones before it
    assert target.num_cached == 32
    # transformers' forward over the whole sequence, with the same visibility written out as an additive mask.
    ids = torch.tensor([context + [5, 6]], device=model.device)
    visible = torch.ones(32, 32, dtype=torch.bool).tril()
    for row in (30, 31):
        visible[row, :30] = False
        visible[row, seen] = True
    mask = torch.zeros(1, 1, 32, 32).masked_fill(~visible, torch.finfo(torch.float32).min).to(model.device)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits[0, 30:]
    assert torch.allclose(logits, expected, atol=1e-5, rtol=1e-5)
    full = CausalLM(model)
    full.forward(context, num_logits=0)
    assert not torch.allclose(full.forward([5, 6]).logits, expected, atol=1e-3)  # the view changed the answer
    with pytest.raises(ValueError, match="cached positions"):
        target.forward([5], attend_to=torch.tensor([40]))


def test_the_compiled_layers_restrict_attention_the_same_way():
    """int4's compiled layers take the view as per-row key lists; transformers' forward of the same quantised model
    (row-wise attention over the mask) must agree to float rounding."""
    model = quantize_model(grouped_llama(3), "int4")
    compiled, stock = CausalLM(model), CausalLM(model, lean=False)
    context = random_prompt(4, length=40)
    seen = torch.tensor([0, 1, 2, 20, 21, 22, 23, 35, 36, 37, 38, 39])
    outputs = []
    with float_inputs():  # (8-bit inputs would turn float rounding differences into flipped levels)
        for target in (compiled, stock):
            target.forward(context, num_logits=0)
            outputs.append(target.forward([9, 10, 11], attend_to=seen).logits)
    assert torch.allclose(outputs[0], outputs[1], atol=1e-4, rtol=1e-4)


def test_drafting_leaves_the_cache_as_it_was():
    target = CausalLM(tiny_llama(2))
    context = repetitive_prompt(5, 60)
    target.forward(context[:-1], num_logits=0)
    drafter = SparseSelfDrafter(target, 5, TINY_VIEW)
    drafter.start(context)
    before = [layer.keys.clone() for layer in target.cache.layers]
    draft = drafter.propose(context, 5, SamplingConfig(temperature=0.0), None)
    assert len(draft.token_ids) == 5 and target.num_cached == len(context) - 1
    assert all(torch.equal(layer.keys, kept) for layer, kept in zip(target.cache.layers, before))


def test_lookup_guesses_change_the_cost_not_the_draft(monkeypatch):
    """Greedy drafts score prompt lookup's guesses in the same sparse forward and keep those that are the view's
    argmax: on the compiled layers (rows computed alone) the draft is exactly token-by-token drafting's, in fewer
    forwards where the text repeats."""
    model = quantize_model(grouped_llama(2), "int4")
    sequence = repetitive_prompt(4, 150)
    drafts, calls = {}, {}
    for guessing in (True, False):
        target = CausalLM(model)
        drafter = SparseSelfDrafter(target, 8, TINY_VIEW)
        if not guessing:
            monkeypatch.setattr(drafter, "_guess", lambda drafted, count: [])
        forward, count = target.forward, [0]

        def counted(*args, _forward=forward, _count=count, **kwargs):
            _count[0] += 1
            return _forward(*args, **kwargs)

        target.forward = counted
        drafts[guessing] = []
        for end in range(110, 150, 4):  # contexts whose last tokens occurred earlier
            target.reset()
            target.forward(sequence[:end - 1], num_logits=0)
            drafter.start(sequence[:end])
            count[0] = 0
            drafts[guessing].append(drafter.propose(sequence[:end], 8, SamplingConfig(temperature=0.0),
                                                    None).token_ids)
            calls[guessing] = calls.get(guessing, 0) + count[0]
    assert drafts[True] == drafts[False]
    assert calls[False] == 8 * len(drafts[False]) and calls[True] < calls[False]


def test_below_min_context_it_drafts_nothing():
    target = CausalLM(tiny_llama(2))
    decoder = SpeculativeDecoder(target, SparseSelfDrafter(target, 4, SparseView(min_context=1000)),
                                 RejectionSamplingVerifier())
    decoder.generate(random_prompt(1, length=20), greedy(10))
    assert decoder.stats.num_draft_tokens == 0


@pytest.mark.parametrize("kind", ["float32", "int4 compiled"])
@pytest.mark.parametrize("prompt_seed", [1, 6])
def test_greedy_output_is_plain_decoding_token_for_token(kind, prompt_seed):
    model = tiny_llama(0) if kind == "float32" else quantize_model(grouped_llama(2), "int4")
    prompt = repetitive_prompt(prompt_seed, 120)
    outputs, stats = [], []
    for drafter_of in (None, lambda target: SparseSelfDrafter(target, 4, TINY_VIEW)):
        target = CausalLM(model)
        if drafter_of is None:
            drafter, verifier = build_method(MethodContext(MethodConfig(name="ar"), target, None, None))
        else:
            drafter, verifier = drafter_of(target), RejectionSamplingVerifier()
        decoder = SpeculativeDecoder(target, drafter, verifier)
        outputs.append(decoder.generate(prompt, greedy(50)))
        stats.append(decoder.stats)
    assert outputs[1] == outputs[0]
    assert stats[1].num_draft_tokens > 0


def test_eos_and_max_length_inside_a_draft():
    model = tiny_llama(0)
    prompt = repetitive_prompt(2, 90)
    reference = SpeculativeDecoder(CausalLM(model), *build_method(
        MethodContext(MethodConfig(name="ar"), CausalLM(model), None, None))).generate(prompt, greedy(30))

    def sparse(max_new_tokens: int, eos: frozenset[int] = frozenset()) -> list[int]:
        target = CausalLM(model)
        decoder = SpeculativeDecoder(target, SparseSelfDrafter(target, 5, TINY_VIEW), RejectionSamplingVerifier())
        return decoder.generate(prompt, greedy(max_new_tokens, eos))

    for budget in (1, 3, 7, 11):
        assert sparse(budget) == reference[:budget]
    eos = reference[9]
    stop = reference.index(eos) + 1
    assert sparse(30, frozenset({eos})) == reference[:stop]


class MisreportingDrafter(SparseSelfDrafter):
    """Samples its drafts correctly but reports a flattened distribution for them: the verifier then accepts with
    the wrong ratio, so the output no longer follows the target."""

    def propose(self, context_ids, max_num_draft_tokens, sampling, generator):
        draft = super().propose(context_ids, max_num_draft_tokens, sampling, generator)
        if draft.draft_probs is not None:
            draft.draft_probs = torch.softmax(draft.draft_probs.clamp_min(1e-12).log() / 4, dim=-1)
        return draft


def first_token_counts(drafter_class, model, prompt: list[int], sampling: SamplingConfig, draws: int) -> np.ndarray:
    counts = np.zeros(VOCAB)
    target = CausalLM(model)
    decoder = SpeculativeDecoder(target, drafter_class(target, 3, TINY_VIEW), RejectionSamplingVerifier())
    for seed in range(draws):
        generator = torch.Generator().manual_seed(seed)
        counts[decoder.generate(prompt, DecodeConfig(max_new_tokens=1 + 3, sampling=sampling), generator)[0]] += 1
    return counts


def test_sampled_first_token_follows_the_target_and_a_misreporting_drafter_is_caught():
    """The first token comes out of the round's verification (draft token kept, or the residual drawn): its law
    must be the target's own next-token distribution at this temperature."""
    model = tiny_llama(5)
    prompt = repetitive_prompt(3, 40)
    sampling = SamplingConfig(temperature=1.0)  # this tiny model's next token: 99 cells, the largest about 0.11
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt], device=model.device)).logits[0, -1]
    probs = torch.softmax(logits, dim=-1).double().cpu().numpy()
    probs /= probs.sum()
    assert chi_square_pvalue(first_token_counts(SparseSelfDrafter, model, prompt, sampling, 3000), probs) > ALPHA
    assert chi_square_pvalue(first_token_counts(MisreportingDrafter, model, prompt, sampling, 3000), probs) < ALPHA


# -- the approximate target (lossy, opt-in) ---------------------------------------------------------------------------

def decode(target, prompt: list[int], method: str = "ar", max_new_tokens: int = 40) -> list[int]:
    drafter, verifier = build_method(MethodContext(MethodConfig(name=method), target, None, None))
    return SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(max_new_tokens))


def test_the_sparse_target_is_the_target_where_the_view_holds_everything():
    model = tiny_llama(0)
    prompt = repetitive_prompt(3, 90)
    assert decode(SparseViewTarget(CausalLM(model), SparseView(min_context=10 ** 6)), prompt) == decode(
        CausalLM(model), prompt)


def test_the_sparse_target_decodes_over_its_view_and_keeps_its_record_through_trees():
    """Each decoding forward attends to exactly the view found from the cached tokens and the forward's first one;
    after tree verifications (lookahead) its record of the cached tokens is still the committed sequence. The output
    is approximate: it drifts from exact decoding on this prompt (that is what the bench measures)."""
    model = tiny_llama(0)
    prompt = repetitive_prompt(3, 120)
    sparse = SparseViewTarget(CausalLM(model), TINY_VIEW)
    sparse.forward(prompt[:-1], num_logits=0)
    reference = CausalLM(model)
    reference.forward(prompt[:-1], num_logits=0)
    view = TINY_VIEW.positions(np.asarray(prompt), len(prompt) - 1)
    assert len(view) < len(prompt) - 1
    assert torch.equal(sparse.forward([prompt[-1]]).logits, reference.forward([prompt[-1]], attend_to=view).logits)
    target = SparseViewTarget(CausalLM(model), TINY_VIEW)
    out = decode(target, prompt, "lookahead")
    assert target._tokens == (prompt + out)[:-1] and target.num_cached == len(prompt + out) - 1
    assert out != decode(CausalLM(model), prompt)


def test_sparse_attention_is_a_bench_option_for_the_torch_target():
    from jointspec.bench.specs import MethodSpecError, parse_spec

    assert parse_spec("ar:attention=sparse").attention == "sparse"
    assert parse_spec("ar").attention == "full"
    with pytest.raises(MethodSpecError, match="attention 'dense'"):
        parse_spec("ar:attention=dense")
    with pytest.raises(MethodSpecError, match="torch backend"):
        parse_spec("ar:attention=sparse,backend=llamacpp")
