"""The draft supervisor (batch/supervisor.py) and the lockstep engine's use of it.

What is proved here:
- the rule: the two kinds of round alternate at a batch size until each is measured, then the one committing more
  tokens a second runs but for one round in ``explore_every`` (drafts kept unless rounds without them win by more
  than the margin), each size on its own, and a change of which is faster is followed within a few explored rounds;
- the engine: rounds it holds off draft nothing and decode plainly, so every greedy request still gets exactly the
  tokens it gets alone; only batches of two or more greedy rows of lossless methods drafting by load-aware lookup
  are supervised (never a request alone, MTAD's, a model's or head's, a sampled row's, or a fixed draft's), and each
  supervised round is recorded with what it committed.

The supervisor's tests feed it chosen seconds, and the engine's decide with a fixed pattern: no timing, so no
false-failure odds.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import BATCH_CURVE_SIZES, LockstepEngine, RoundRecord
from jointspec.batch.supervisor import DraftSupervisor
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.drafters.costaware import CostCurve
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import BATCH_GREEDY as GREEDY
from helpers import BATCH_PROMPTS as PROMPTS
from helpers import BATCH_SAMPLED as SAMPLED
from helpers import grouped_llama


def run(supervisor: DraftSupervisor, key, rounds: int, drafted_rate: float, held_rate: float) -> list[bool]:
    """``rounds`` decisions at ``key``, each round fed back at its kind's tokens a second."""
    out = []
    for _ in range(rounds):
        drafts = supervisor.drafts(key)
        out.append(drafts)
        supervisor.record(key, drafts, 10, 10 / (drafted_rate if drafts else held_rate))
    return out


@pytest.mark.parametrize("drafted_rate, held_rate, preferred", [(300, 200, True), (200, 300, False)])
def test_the_kinds_alternate_until_measured_then_the_faster_runs_but_for_its_explored_rounds(
        drafted_rate, held_rate, preferred):
    supervisor = DraftSupervisor(min_rounds=4, explore_every=8)
    decisions = run(supervisor, 1, 8, drafted_rate, held_rate)
    assert decisions == [True, False] * 4  # the warm-up: both kinds measured
    assert supervisor.prefers_drafts(1) is preferred
    decisions = run(supervisor, 1, 64, drafted_rate, held_rate)
    assert decisions.count(not preferred) == 64 // 8  # one explored round in eight
    assert all(d is preferred for i, d in enumerate(decisions) if (8 + i) % 8 != 7)


def test_drafts_stay_on_unless_rounds_without_them_win_by_more_than_the_margin():
    supervisor = DraftSupervisor(min_rounds=4, explore_every=8, margin=0.05)
    run(supervisor, 1, 40, drafted_rate=200, held_rate=208)  # 4 % faster without drafts: within the margin
    assert supervisor.prefers_drafts(1)
    run(supervisor, 1, 40, drafted_rate=200, held_rate=220)
    assert not supervisor.prefers_drafts(1)


def test_each_batch_size_is_measured_on_its_own():
    supervisor = DraftSupervisor(min_rounds=4, explore_every=8)
    run(supervisor, 1, 40, drafted_rate=300, held_rate=200)
    run(supervisor, 8, 40, drafted_rate=200, held_rate=300)
    assert supervisor.prefers_drafts(1) and not supervisor.prefers_drafts(8)
    assert supervisor.prefers_drafts(4)  # nothing measured there: drafts as their drafters choose
    assert supervisor.rates()[1][0] == pytest.approx(300) and supervisor.rates()[8][1] == pytest.approx(300)


def test_a_change_of_which_kind_is_faster_is_followed_within_a_few_explored_rounds():
    supervisor = DraftSupervisor(min_rounds=8, explore_every=16, memory=128)
    run(supervisor, 2, 400, drafted_rate=200, held_rate=300)
    assert not supervisor.prefers_drafts(2)
    # A run of requests that drafts pay for: the explored rounds measure it, and within eight of them (128 rounds,
    # a few seconds of a server's rounds) drafts run again, but for their own explored rounds.
    decisions = run(supervisor, 2, 8 * 16 + 32, drafted_rate=600, held_rate=300)
    assert supervisor.prefers_drafts(2)
    assert decisions[-32:].count(False) == 2


@pytest.mark.parametrize("option, value", [("min_rounds", 0), ("explore_every", 1), ("margin", -0.1),
                                           ("memory", 1.0)])
def test_bad_settings_are_refused_by_name(option, value):
    with pytest.raises(ValueError, match=option):
        DraftSupervisor(**{option: value})


# -- the engine -------------------------------------------------------------------------------------------------------

class Alternating(DraftSupervisor):
    """Drafts in every other round asked, whatever is measured; remembers what was asked and recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[object] = []
        self.recorded: list[tuple[object, bool, int]] = []

    def drafts(self, key) -> bool:
        self.asked.append(key)
        return len(self.asked) % 2 == 1

    def record(self, key, drafted, tokens, seconds) -> None:
        assert seconds > 0
        self.recorded.append((key, drafted, tokens))
        super().record(key, drafted, tokens, seconds)


@pytest.fixture(scope="module")
def int4_target():
    target = CausalLM(quantize_model(grouped_llama(0), "int4"), name="int4")
    assert target.lean is not None and target.lean.compiled is not None, "the compiled layers must run here"
    return target


def alone(target: CausalLM, config: MethodConfig, prompt: list[int], decode: DecodeConfig):
    fork = target.fork("alone")
    drafter, verifier = build_method(MethodContext(config, fork, None, None))
    return SpeculativeDecoder(fork, drafter, verifier).generate(prompt, decode, torch.Generator().manual_seed(0))


def supervised_engine(target: CausalLM) -> tuple[LockstepEngine, Alternating, list[RoundRecord]]:
    engine = LockstepEngine(target, max_batch_size=3)
    engine.supervisor = Alternating()
    # Rows priced nearly free: the drafters draft whenever they may.
    engine._curves = dict.fromkeys((False, True), CostCurve({n: 1.0 + 0.002 * (n - 1) for n in BATCH_CURVE_SIZES}))
    records: list[RoundRecord] = []
    engine.on_round = records.append
    return engine, engine.supervisor, records


@pytest.mark.parametrize("config", [MethodConfig("pld", num_draft_tokens=4, cost_aware=True),
                                    MethodConfig("lookahead"), MethodConfig("lade"),
                                    MethodConfig("aded", draft="none")],
                         ids=["pld-cost-aware", "lookahead", "lade", "aded"])
def test_rounds_held_off_decode_plainly_and_every_greedy_request_keeps_its_tokens(int4_target, config):
    engine, supervisor, records = supervised_engine(int4_target)
    out = engine.generate([BatchRequest(tuple(p), GREEDY, config) for p in PROMPTS])
    assert out == [alone(int4_target, config, p, GREEDY) for p in PROMPTS]
    batched = [r for r in records if r.sequences > 1]  # a request alone drafts as generate does: not supervised
    assert batched and supervisor.asked == [r.sequences for r in batched]  # each supervised, keyed by its size
    assert [r.drafted for r in batched] == [i % 2 == 0 for i in range(len(batched))]
    assert all(r.drafted for r in records if r.sequences == 1)
    assert all(r.rows == r.sequences for r in batched if not r.drafted)  # held off: no draft row
    assert any(r.rows > r.sequences for r in batched if r.drafted)
    assert [(key, drafted) for key, drafted, _ in supervisor.recorded] == [(r.sequences, r.drafted) for r in batched]


@pytest.mark.parametrize("mixed", [MethodConfig("mtad", draft="self", num_draft_tokens=3, beam_width=2),
                                   MethodConfig("pld", num_draft_tokens=4),
                                   MethodConfig("sps", draft="self"),  # cost-aware, but a model catches up
                                   MethodConfig("specinfer", draft="self", tree=(2, 2))],
                         ids=["mtad", "fixed-pld", "cost-aware-sps", "specinfer-tree"])
def test_a_batch_with_an_mtad_a_model_or_a_fixed_draft_row_is_not_supervised(int4_target, mixed):
    engine, supervisor, records = supervised_engine(int4_target)
    lookup = MethodConfig("pld", num_draft_tokens=4, cost_aware=True)
    requests = [BatchRequest(tuple(PROMPTS[0]), GREEDY, mixed), BatchRequest(tuple(PROMPTS[1]), GREEDY, lookup)]
    out = engine.generate(requests)
    assert out == [alone(int4_target, r.method, list(r.prompt_ids), GREEDY) for r in requests]
    assert any(r.sequences == 2 for r in records) and supervisor.asked == []


def test_a_batch_with_a_sampled_row_is_not_supervised(int4_target):
    engine, supervisor, records = supervised_engine(int4_target)
    lookup = MethodConfig("pld", num_draft_tokens=4, cost_aware=True)
    engine.generate([BatchRequest(tuple(PROMPTS[0]), SAMPLED, lookup, seed=1),
                     BatchRequest(tuple(PROMPTS[1]), GREEDY, lookup)])
    assert any(r.sequences == 2 for r in records) and supervisor.asked == []
