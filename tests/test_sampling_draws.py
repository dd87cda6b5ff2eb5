"""Sampling with temperature alone, drawn through the screened head (core/sampling.py, "draws";
ScreenedInt8Head.draw_tokens; csrc/grouped_linear.cpp, screened_draws).

What is proved here:
- the law: draws at one row follow softmax(exact logits / T) (a chi-square test over 24,000 keyed draws at two
  temperatures), and the same test rejects draws held to the wrong temperature;
- the screen changes no draw: with the screen's margin each draw is the one a margin that makes every logit exact
  gives (the Gumbel-max winner over the exact logits with the same noise), on every build the CPU runs, which all give
  the same draws;
- the loop: plain sampling and lookup drafts draw the same tokens for a seed (each row's noise keyed by its position),
  a batch changes nobody's draws, and a seed repeats its text.

False-failure odds: each chi-square test fails a correct sampler with probability 1e-6.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from jointspec.backends.hf import CausalLM
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import LockstepEngine
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig, draws_for, position_key
from jointspec.kernels.grouped import ScreenedInt8Head, kernels, runnable_isas
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import grouped_llama, random_prompt

P_VALUE_FLOOR = 1e-6


@pytest.fixture(scope="module")
def int4_model():
    return quantize_model(grouped_llama(0), "int4")


def chi_square_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square p-value of drawn ``tokens`` against ``probs``, tokens expected fewer than 5 times pooled."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    keep = expected >= 5
    observed, wanted = counts[keep], expected[keep]
    if not keep.all():  # the rarely expected tokens as one bin
        observed = torch.cat([observed, counts[~keep].sum()[None]])
        wanted = torch.cat([wanted, expected[~keep].sum()[None]])
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    return float(stats.chi2.sf(statistic, len(observed) - 1))


def near_tied_head() -> ScreenedInt8Head:
    """A screened head whose rows are nearly parallel: for an input along them every logit is about 30, the top few
    a few hundredths apart (at temperature 0.02 their scaled logits pass 745, where exp(-z) underflows a double)."""
    generator = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(64, 99, bias=False)
    base = torch.randn(64, generator=generator)
    linear.weight.data = base + 0.002 * torch.randn(99, 64, generator=generator)
    return ScreenedInt8Head(linear)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.02])
def test_draws_follow_the_exact_logits_law_and_a_wrong_temperature_fails_the_test(int4_model, temperature):
    # (0.02 on near-tied logits of about 30: a noise formula in absolute terms overflowed there and drew the
    # runner-up most of the time)
    if temperature < 0.1:
        head = near_tied_head()
        x = (torch.linspace(-1, 1, 64) + head.dequantized().mean(0) * 30 / head.dequantized().mean(0).norm() ** 2)[None]
    else:
        head = int4_model.lm_head
        x = torch.randn(1, head.in_features, generator=torch.Generator().manual_seed(1)) * 3
    logits = head(x)[0].float()
    if temperature < 0.1:
        assert logits.max() / temperature > 745 and torch.softmax(logits / temperature, -1).max() < 0.9
    n = 24_000
    keys = torch.tensor([position_key(12345, i) for i in range(n)], dtype=torch.long)
    tokens = head.draw_tokens(x.expand(n, -1).contiguous(), torch.full((n,), temperature), keys)
    assert chi_square_p(tokens, torch.softmax(logits / temperature, -1)) > P_VALUE_FLOOR
    # A sampler held to another temperature than it draws at: the same test rejects it.
    assert chi_square_p(tokens, torch.softmax(logits / (1.15 * temperature), -1)) < P_VALUE_FLOOR
    # The lowest temperature but 0 draws the argmax (greedy in all but exact ties).
    least = head.draw_tokens(x.expand(50, -1).contiguous(), torch.full((50,), 1e-6), keys[:50])
    assert (least == logits.argmax()).all()


def test_the_screen_changes_no_draw_and_every_build_draws_alike(int4_model):
    head = int4_model.lm_head
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(300, head.in_features, generator=generator) * 3
    temperature = torch.rand(300, generator=generator) * 1.5 + 0.1
    keys = torch.randint(0, 2 ** 62, (300,), generator=generator)
    screened = head.draw_tokens(rows, temperature, keys)
    assert torch.equal(screened, head.draw_tokens(rows, temperature, keys, margin=1e6))  # every logit exact
    assert len(set(screened.tolist())) > 20  # draws, not one argmax
    buffers = [getattr(head, name) for name in head.BUFFERS]
    for isa in runnable_isas():
        drawn = kernels(isa).screened_draws(rows, head.screen4, head.screen_scale, head.column, buffers,
                                            head.margin, temperature, keys)
        assert torch.equal(drawn, screened), isa
    assert torch.equal(head.draw_tokens(rows[:1], temperature[:1], keys[:1]), screened[:1])  # a row alone
    broken = rows[:2].clone()
    broken[1] = float("nan")
    assert head.draw_tokens(broken, temperature[:2], keys[:2]).tolist() == [int(screened[0]), -1]


accepted: dict[str, int] = {}


def decode(target, method: str, prompt, sampling: SamplingConfig, seed: int) -> list[int]:
    fork = target.fork(method)
    drafter, verifier = build_method(MethodContext(MethodConfig(method, cost_aware=False), fork, None, None))
    decoder = SpeculativeDecoder(fork, drafter, verifier)
    tokens = decoder.generate(prompt, DecodeConfig(32, sampling), torch.Generator().manual_seed(seed))
    accepted[method] = accepted.get(method, 0) + decoder.stats.num_accepted_tokens
    return tokens


def test_plain_sampling_and_lookup_drafts_draw_the_same_tokens_through_the_screen(int4_model):
    target = CausalLM(int4_model, name="int4")
    assert target.capabilities.draw_screen
    sampling = SamplingConfig(temperature=0.3)  # low enough for the tiny model to repeat itself: drafts accepted
    assert draws_for(sampling) and not draws_for(SamplingConfig(temperature=0.9, top_p=0.95))
    assert not draws_for(SamplingConfig(temperature=0.9, min_p=0.1))  # min-p needs the whole row
    for seed in range(4):
        prompt = random_prompt(1, 24)  # seed 1's prompt repeats itself: lookup drafts plenty
        plain = decode(target, "ar", prompt, sampling, seed)
        assert decode(target, "pld", prompt, sampling, seed) == plain
        assert accepted["pld"] > 0  # drafts were kept: a round's rows drew past its first
        assert decode(target, "ar", prompt, sampling, seed) == plain  # a seed repeats its text
    assert decode(target, "ar", prompt, sampling, 99) != plain


def test_a_batch_changes_no_requests_draws(int4_model):
    target = CausalLM(int4_model, name="int4")
    sampling = SamplingConfig(temperature=1.1)
    prompts = [random_prompt(seed, 10 + seed) for seed in range(5)]
    engine = LockstepEngine(target, max_batch_size=3)
    config = DecodeConfig(20, sampling)
    batched = engine.generate([BatchRequest(tuple(p), config, MethodConfig("pld", cost_aware=False), seed=i)
                               for i, p in enumerate(prompts)])
    assert batched == [decode(target, "pld", p, sampling, i)[:20] for i, p in enumerate(prompts)]


def test_a_row_with_nothing_to_draw_from_gets_its_exact_logits(int4_model):
    # A NaN row (a broken model) has no winner; the forward hands back its exact logits, which sampling then refuses
    # as it refuses them without the screen.
    from jointspec.core.sampling import RowDraws

    target = CausalLM(int4_model, name="int4")
    rows = torch.randn(2, int4_model.config.hidden_size)
    rows[1] = float("nan")
    out = target.lean._drawn(rows, [RowDraws((position_key(5, 0), position_key(5, 1)), 1.0)])
    assert (out[0] == 0).sum() == 1 and torch.isinf(out[0]).sum() == out.shape[1] - 1
    assert torch.isnan(out[1]).all()


def test_draws_under_a_grammar_follow_the_masked_law_on_every_build(int4_model):
    """Structured output: each row draws from softmax over its allowed tokens (the rest forbidden before the draw),
    which a chi-square test over 24,000 keyed draws holds to the masked law and rejects against the unmasked one
    renormalised over the allowed tokens at another temperature; every draw is allowed, the screen changes none, every
    build draws alike, and a row with nothing allowed draws nothing (-1)."""
    head = int4_model.lm_head
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, head.in_features, generator=generator) * 3
    logits = head(x)[0].float()
    allowed = torch.rand(head.out_features, generator=generator) < 0.5
    allowed[logits.topk(3).indices] = False  # the model's favourites forbidden: the law is the rest's
    allowed[:64] = False  # a whole block of the draw's 64 forbidden
    n = 24_000
    keys = torch.tensor([position_key(777, i) for i in range(n)], dtype=torch.long)
    tokens = head.draw_tokens(x.expand(n, -1).contiguous(), torch.full((n,), 1.0), keys,
                              allowed=allowed.expand(n, -1))
    assert allowed[tokens].all()
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert chi_square_p(tokens, torch.softmax(masked, -1)) > P_VALUE_FLOOR
    assert chi_square_p(tokens, torch.softmax(masked / 1.15, -1)) < P_VALUE_FLOOR
    rows = torch.randn(200, head.in_features, generator=generator) * 3
    temperature = torch.rand(200, generator=generator) * 1.5 + 0.1
    row_keys = torch.randint(0, 2 ** 62, (200,), generator=generator)
    masks = torch.rand(200, head.out_features, generator=generator) < 0.3
    masks[0] = False
    screened = head.draw_tokens(rows, temperature, row_keys, allowed=masks)
    assert screened[0] == -1 and masks[torch.arange(1, 200), screened[1:]].all()
    assert torch.equal(screened, head.draw_tokens(rows, temperature, row_keys, margin=1e6, allowed=masks))
    buffers = [getattr(head, name) for name in head.BUFFERS]
    for isa in runnable_isas():
        drawn = kernels(isa).screened_draws(rows, head.screen4, head.screen_scale, head.column, buffers,
                                            head.margin, temperature, row_keys, masks)
        assert torch.equal(drawn, screened), isa
