"""The bench's paired bootstrap intervals (``jointspec.bench.intervals``): exact where nothing varies, the right
width where something does, and wired into the bench's summary and table.

The coverage tests simulate whole benches whose truth is known and count how often the 95 % interval holds it. They
are seeded, so they pass or fail the same way every run; the bounds were set from the binomial spread of the count
before looking at it (see each test), so a correct interval would fail them with odds of about 1e-4 over seeds.
"""

from __future__ import annotations

import math

import pytest
import torch

from jointspec.bench.intervals import MIN_PROMPTS, RatioInterval, paired_ratio_interval
from jointspec.bench.prompts import BenchPrompt
from jointspec.bench.report import table
from jointspec.bench.runner import prompt_seed

from helpers import WORDS, run_tiny


def simulated_bench(num_prompts: int, nats_shift: float, generator: torch.Generator):
    """Per-prompt (log-prob sum, tokens) for a method and the baseline on prompts of very different difficulty.

    Each prompt has its own mean log-probability per token (-0.3 to -2.0 nats: a code answer against a poem); both
    methods sample 64 tokens whose log-probabilities scatter around it (sd 1.0 nat per token), and the method's
    mean is ``nats_shift`` above the baseline's, so its true perplexity ratio is exp(-nats_shift).
    """
    difficulty = -0.3 - 1.7 * torch.rand(num_prompts, generator=generator, dtype=torch.float64)
    tokens = torch.full((num_prompts,), 64.0, dtype=torch.float64)

    def side(shift: float) -> torch.Tensor:
        per_token = difficulty[:, None] + shift + torch.randn(num_prompts, 64, generator=generator,
                                                              dtype=torch.float64)
        return torch.stack([per_token.sum(1), tokens], dim=1)
    return side(nats_shift), side(0.0)


def test_identical_runs_give_ratio_one_and_a_point_interval():
    parts = torch.tensor([[-float(10 + i), 20.0] for i in range(MIN_PROMPTS)])
    interval = paired_ratio_interval(parts, parts.clone(), "perplexity")
    assert (interval.ratio, interval.low, interval.high) == (1.0, 1.0, 1.0)
    assert not interval.excludes_one


def test_too_few_prompts_or_nothing_scored_give_no_interval():
    few = torch.tensor([[10.0, 1.0]] * (MIN_PROMPTS - 1))
    assert paired_ratio_interval(few, few, "rate") is None
    unscored = torch.zeros(MIN_PROMPTS, 2)  # --no-perplexity: no log-probs, no scored tokens
    assert paired_ratio_interval(unscored, unscored, "perplexity") is None


def test_rate_ratio_is_the_bench_speedup():
    # Method: 10 tokens in 1 s on every prompt; baseline: 10 tokens in 2 s. Speedup 2 whatever prompts are drawn.
    method = torch.tensor([[10.0, 1.0]] * 10)
    baseline = torch.tensor([[10.0, 2.0]] * 10)
    interval = paired_ratio_interval(method, baseline, "rate")
    assert interval.ratio == pytest.approx(2.0) and interval.low == pytest.approx(2.0)
    assert interval.excludes_one


def test_bad_arguments_are_refused():
    parts = torch.ones(10, 2)
    with pytest.raises(ValueError, match="kind must be"):
        paired_ratio_interval(parts, parts, "speed")
    with pytest.raises(ValueError, match="same shape"):
        paired_ratio_interval(parts, torch.ones(9, 2), "rate")
    with pytest.raises(ValueError, match="does not contain"):
        RatioInterval(1.5, 0.9, 1.2)


def unpaired_interval(method: torch.Tensor, baseline: torch.Tensor, seed: int) -> RatioInterval:
    """A mutant: resamples the method's prompts and the baseline's independently, as if they were unrelated."""
    generator = torch.Generator().manual_seed(seed)
    num_prompts = method.shape[0]
    picks = [torch.randint(num_prompts, (2000, num_prompts), generator=generator) for _ in range(2)]
    method_sums, baseline_sums = method[picks[0]].sum(1), baseline[picks[1]].sum(1)
    ratios = torch.exp(-method_sums[:, 0] / method_sums[:, 1] + baseline_sums[:, 0] / baseline_sums[:, 1])
    ratio = math.exp(-method[:, 0].sum() / method[:, 1].sum() + baseline[:, 0].sum() / baseline[:, 1].sum())
    low, high = torch.quantile(ratios, torch.tensor([0.025, 0.975], dtype=ratios.dtype)).tolist()
    return RatioInterval(ratio, min(low, ratio), max(high, ratio))


def coverage(nats_shift: float, interval_of=None, num_benches: int = 200, num_prompts: int = 40) -> float:
    """Share of simulated benches whose 95 % interval holds the true ratio exp(-nats_shift)."""
    interval_of = interval_of or (lambda m, b, seed: paired_ratio_interval(m, b, "perplexity", seed=seed))
    generator = torch.Generator().manual_seed(1234)
    truth = math.exp(-nats_shift)
    hits = 0
    for bench in range(num_benches):
        method, baseline = simulated_bench(num_prompts, nats_shift, generator)
        interval = interval_of(method, baseline, bench)
        hits += interval.low <= truth <= interval.high
    return hits / num_benches


@pytest.mark.parametrize("nats_shift", [0.0, 0.1])
def test_intervals_hold_the_true_ratio_about_95_percent_of_the_time(nats_shift):
    # 200 simulated benches of 40 prompts. A percentile bootstrap covers a little under its level at n = 40 (92 %
    # for both seeded shifts): the count of hits is then ~Binomial(200, 0.92), sd 3.8, so [85 %, 99.5 %] lies 3.7 and
    # 3.9 sd away (a seed that fails a correct interval: odds about 1e-4). Too
    # narrow an interval (a bench claiming differences it has not shown) fails the lower bound; one that ignores
    # the pairing is far too wide and fails the upper bound (checked by the next test).
    share = coverage(nats_shift)
    assert 0.85 <= share <= 0.995, share


def test_a_shift_the_size_of_mtads_is_found_by_pairing():
    # A 10 % lower perplexity on 40 prompts of 64 tokens: the paired interval excludes 1 in almost every bench, the
    # unpaired one (the mutant above) in almost none. Measured over 10,000 benches of other seeds, the paired interval
    # finds the shift in 95.0 % of them: the count is ~Binomial(200, 0.95), and fewer than 176 of 200 has odds of
    # 2e-5 (this seed finds 188). The unpaired one found it in 0 of these 200.
    # (Until this was measured the test asked for 45 of 50 benches, which a correct interval misses 3.7 % of the time.)
    generator = torch.Generator().manual_seed(7)
    found = unpaired = 0
    for bench in range(200):
        method, baseline = simulated_bench(40, 0.1, generator)
        found += paired_ratio_interval(method, baseline, "perplexity", seed=bench).high < 1.0
        unpaired += unpaired_interval(method, baseline, bench).high < 1.0
    assert found >= 176, found
    assert unpaired < 176, unpaired


@pytest.mark.parametrize("mutant", ["unpaired", "half level"])
def test_broken_intervals_fail_the_coverage_test(mutant):
    """Ignoring the pairing gives intervals ~4x too wide here (prompt difficulty dominates), covering ~100 %; a 50 %
    interval reported as 95 % covers ~50 %. The coverage bounds above must reject both."""
    interval_of = {"unpaired": unpaired_interval,
                   "half level": lambda m, b, seed: paired_ratio_interval(m, b, "perplexity", level=0.5, seed=seed)}
    share = coverage(0.0, interval_of[mutant])
    assert not 0.85 <= share <= 0.995, share


def test_bench_summary_and_table_carry_the_intervals(target_model, bench_tokenizer):
    prompts = [BenchPrompt(str(i), "x", (" ".join(WORDS[i:i + 6]),)) for i in range(MIN_PROMPTS)]
    result, summary = run_tiny(target_model, bench_tokenizer, "ar,pld:n=4,oracle:corrupt=0.3", prompts)
    pld = summary["pld:n=4"]
    # Greedy and lossless: the same tokens on every prompt, so the same perplexity on every resample.
    assert pld["num_identical"] == MIN_PROMPTS
    assert pld["perplexity_ratio"] == 1.0 and pld["perplexity_ratio_interval"] == [1.0, 1.0]
    low, high = pld["speedup_interval"]
    assert low <= pld["speedup"] <= high
    assert summary["ar"]["speedup_interval"] == [1.0, 1.0]
    text = table(result, summary)
    assert f"95% paired bootstrap over {MIN_PROMPTS} prompts" in text
    assert "1.000 [1.000, 1.000]" in text and "no clear difference" in text


def test_table_says_when_there_are_too_few_prompts(target_model, bench_tokenizer):
    prompts = [BenchPrompt("0", "x", ("the hive is warm",))]
    result, summary = run_tiny(target_model, bench_tokenizer, "ar,pld:n=4", prompts)
    assert summary["pld:n=4"]["speedup_interval"] is None and summary["pld:n=4"]["perplexity_ratio"] is None
    assert "fewer than" in table(result, summary)


def test_a_baseline_alone_gets_no_interval_section(target_model, bench_tokenizer):
    """With the baseline alone and enough prompts, the table printed an interval header with no rows under it."""
    from jointspec.bench.report import interval_lines

    prompts = [BenchPrompt(str(i), "x", (" ".join(WORDS[i:i + 6]),)) for i in range(8)]
    result, summary = run_tiny(target_model, bench_tokenizer, "ar", prompts, max_new_tokens=2, perplexity=False)
    assert interval_lines(result, summary) == [] and "paired bootstrap" not in table(result, summary)


def test_each_prompt_and_turn_samples_with_its_own_seed(target_model, bench_tokenizer):
    assert prompt_seed(0, "81", 0) == prompt_seed(0, "81", 0)
    seeds = {prompt_seed(0, "81", 0), prompt_seed(0, "81", 1), prompt_seed(0, "82", 0), prompt_seed(1, "81", 0)}
    assert len(seeds) == 4
    # With one seed for all, the tiny target sampled the same first tokens for all 10 prompts (its next-token
    # distributions barely depend on the prompt); with a seed per prompt, 10 draws from ~70 likely tokens agree on
    # all 10 with odds far below 1e-9.
    prompts = [BenchPrompt(str(i), "x", (" ".join(WORDS[i:i + 6]),)) for i in range(10)]
    result, _ = run_tiny(target_model, bench_tokenizer, "ar", prompts, temperature=1.0, max_new_tokens=4,
                         perplexity=False)
    assert len({run.output_ids[0][0] for run in result.runs}) > 1
    again, _ = run_tiny(target_model, bench_tokenizer, "ar", prompts[3:4], temperature=1.0, max_new_tokens=4,
                        perplexity=False)
    assert again.runs[0].output_ids == result.runs[3].output_ids  # a prompt's draws do not depend on the others


def test_a_ratio_without_an_interval_over_enough_prompts_says_why():
    """From 8 prompts on, a ratio whose interval is missing (undefined in most resamples: a method that scored tokens
    on one prompt only) was printed bare, as if the interval had been left off. Deterministic."""
    from jointspec.bench.compare import describe

    comparison = {"method": "pld", "reference": "ar", "num_prompts": 10,
                  "speedup": {"ratio": 1.1, "interval": [1.0, 1.2], "excludes_1": False},
                  "perplexity_ratio": {"ratio": 0.9, "interval": None, "excludes_1": None}}
    lines = describe(comparison)
    assert lines[1] == "speedup: 1.100 [1.000, 1.200]" and lines[2] == "perplexity_ratio: 0.900"
    assert lines[3].startswith("(perplexity_ratio: no interval") and "undefined" in lines[3]
    assert describe(dict(comparison, num_prompts=4))[-1] == f"(no intervals under {MIN_PROMPTS} prompts)"
    complete = dict(comparison, perplexity_ratio=comparison["speedup"])
    assert len(describe(complete)) == 3  # nothing to explain
    # The speedup after the prompt, where the run timed it, is one more line and explained the same way.
    after = describe(dict(complete, decode_speedup={"ratio": 1.2, "interval": None, "excludes_1": None}))
    assert after[3] == "decode_speedup: 1.200" and after[4].startswith("(decode_speedup: no interval")
    assert describe(dict(complete, decode_speedup=None)) == describe(complete)


def test_chat_template_variables_reach_every_prompt_of_a_bench(byte_model):
    """--chat-template-kwargs: each turn is read with the variables (a template of this test's own reads one)."""
    from jointspec.backends.tokens import chat_template_ids

    from helpers import byte_tokenizer

    words = byte_tokenizer()
    words.chat_template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
                           "{% if note is defined %}{{ note }}{% endif %}")
    prompts = [BenchPrompt("1", "x", ("abc",))]
    result, _ = run_tiny(byte_model, words, "ar", prompts, max_new_tokens=2, perplexity=False,
                         chat_template_kwargs={"note": "[n]"})
    assert result.runs[0].prompt_ids[0] == chat_template_ids(words, [{"role": "user", "content": "abc"}],
                                                             template_kwargs={"note": "[n]"})
    assert words.decode(result.runs[0].prompt_ids[0]).endswith("<assistant>[n]")
