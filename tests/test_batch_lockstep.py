"""The lockstep engine: many requests, each decoded by its own single-sequence loop, the target forwards run as one.

What is proved here, on the grouped int4 model whose decoder layers run compiled (helpers.grouped_llama):

- :func:`forward_many` gives every sequence the bits its own ``forward`` gives (logits, screened argmax logits and
  hidden states; chains and trees; caches of different lengths), so nothing a sequence computes depends on the
  others in the call;
- the engine therefore decodes each request to exactly the tokens the single-sequence loop gives it alone with the
  same method and seed: greedy and sampled, chain and tree methods, one to sixteen rows a round, requests joining as
  others finish, end-of-sequence and the length limit falling inside drafts (the settings of tests/test_batch.py);
- load-aware drafting: the batch's cost curve is the sequence's own alone and drafts nothing where extra rows cost
  what a row's share does.

These tests compare exact integers and bits on fixed models, prompts and seeds: they have no false-failure odds on a
given build (the kernels' results depend on neither the thread count nor the instruction set:
tests/test_kernels_grouped.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from jointspec.backends import hf
from jointspec.backends.hf import CausalLM, forward_many
from jointspec.backends.lean_forward import CompiledBody as LeanCompiledBody
from jointspec.backends.lean_forward import LeanLlamaForward
from jointspec.batch.engine import BatchEngine, BatchRequest
from jointspec.batch.lockstep import (
    BATCH_CURVE_SIZES,
    BATCH_PROBE_BUDGET,
    BATCH_SHADOW_BUDGET,
    LockstepEngine,
    RoundRecord,
    batch_cost_curve,
    engine_description,
    engine_for,
    prompt_rows_alone,
    sampled_rows_curve,
)
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.core.target import ForwardCall
from jointspec.drafters.costaware import CostAwareDrafter, CostCurve, choose_num_draft_tokens
from jointspec.kernels.grouped import ROWWISE_MAX_ROWS
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import BATCH_EOS as EOS
from helpers import BATCH_GREEDY as GREEDY
from helpers import BATCH_PROMPTS as PROMPTS
from helpers import BATCH_SAMPLED as SAMPLED
from helpers import (
    assert_forward_many_is_each_alone,
    greedy,
    grouped_llama,
    random_prompt,
    run_engine,
    tiny_gemma3,
    tiny_gemma3n,
    tiny_gpt_oss,
    tiny_llama,
    untrained_head,
)

METHODS = {
    "ar": MethodConfig("ar"),
    "pld": MethodConfig("pld", num_draft_tokens=4),
    "pld-cost-aware": MethodConfig("pld", num_draft_tokens=4, cost_aware=True),
    # sps and mtad at fixed lengths for the same-draws tests: cost-aware (their default), a batch's load changes their
    # draft lengths and so their sampled draws. Greedy tokens stay the same: mtad-cost-aware runs the greedy test.
    "sps-self": MethodConfig("sps", draft="self", num_draft_tokens=4, cost_aware=False),
    "specinfer-self": MethodConfig("specinfer", draft="self", tree=(2, 2)),
    "lookahead": MethodConfig("lookahead"),
    "mtad-self": MethodConfig("mtad", draft="self", num_draft_tokens=3, beam_width=2, cost_aware=False),
    "mtad-cost-aware": MethodConfig("mtad", draft="self", num_draft_tokens=3, beam_width=2),
    "mtad-tree-self": MethodConfig("mtad-tree", draft="self", num_draft_tokens=3, beam_width=2),
}


@pytest.fixture(scope="module")
def int4_model():
    return quantize_model(grouped_llama(0), "int4")


@pytest.fixture(scope="module")
def int4_target(int4_model):
    target = CausalLM(int4_model, name="int4")
    assert target.lean is not None and target.lean.compiled is not None, "the compiled layers must run here"
    return target


def alone(target: CausalLM, config: MethodConfig, prompt: list[int], decode: DecodeConfig, seed: int = 0):
    """``prompt`` decoded by the single-sequence loop on its own fork of the target: the reference."""
    fork = target.fork("alone")
    drafter, verifier = build_method(MethodContext(config, fork, None, None))
    return SpeculativeDecoder(fork, drafter, verifier).generate(prompt, decode, torch.Generator().manual_seed(seed))


# -- forward_many -----------------------------------------------------------------------------------------------------

@pytest.fixture
def passes(monkeypatch):
    """Counts the forward_many calls that ran as one pass of the compiled layers (not one call at a time)."""
    count = {"one pass": 0}
    original = LeanLlamaForward.forward_many

    def counted(self, calls):
        result = original(self, calls)
        count["one pass"] += result is not None
        return result
    monkeypatch.setattr(LeanLlamaForward, "forward_many", counted)
    return count


@pytest.mark.parametrize("argmax_only", [False, True])
def test_forward_many_gives_each_sequence_its_own_forwards_bits(int4_target, argmax_only, passes):
    contexts = [random_prompt(seed, length=3 + 5 * seed) for seed in range(4)]
    calls = [ForwardCall([5]), ForwardCall([6, 7, 8], argmax_only=argmax_only),
             ForwardCall([9, 10, 11, 12], parents=[-1, 0, 0, 1], argmax_only=argmax_only),
             ForwardCall([13, 14], output_hidden=True)]
    assert_forward_many_is_each_alone(int4_target, contexts, calls)
    assert passes["one pass"] == 2


@pytest.mark.parametrize("argmax_only", [False, True])
def test_forward_many_past_the_row_wise_limit_together_keeps_each_calls_bits(int4_target, argmax_only, passes):
    """Three chains of 100 rows: each alone is row-wise, but their 300 logits rows together pass ROWWISE_MAX_ROWS,
    where a quantised head on the rows of all calls at once took a prompt's GEMM (other bits for the exact logits)."""
    assert 3 * 100 > ROWWISE_MAX_ROWS >= 100
    contexts = [random_prompt(seed, length=5 + seed) for seed in range(3)]
    calls = [ForwardCall([5 + (i * 7 + seed) % 50 for i in range(100)], argmax_only=argmax_only) for seed in range(3)]
    assert_forward_many_is_each_alone(int4_target, contexts, calls, rounds=1)
    assert passes["one pass"] == 1


def test_forward_many_feeds_each_targets_feature_mirror_its_own_hidden_states(int4_target, passes):
    """Heads that read several layers' hidden states (a fused EAGLE head's mirror: the embeddings, a middle layer, the
    last) get, from the shared pass, exactly what their own forwards record."""
    contexts = [random_prompt(seed, length=4 + 3 * seed) for seed in range(3)]
    together, apart = [int4_target.fork(f"t{i}") for i in range(3)], [int4_target.fork(f"a{i}") for i in range(3)]
    mirrors = [[t.attach_feature_mirror((0, 1, -1)) for t in group] for group in (together, apart)]
    for context, a, b in zip(contexts, together, apart):
        a.reset()
        b.reset()
        a.forward(context, num_logits=0)
        b.forward(context, num_logits=0)
    calls = [ForwardCall([5, 6]), ForwardCall([7], argmax_only=True), ForwardCall([8, 9, 10], parents=[-1, 0, 0])]
    forward_many(together, calls)
    for target, call in zip(apart, calls):
        call.run(target)
    for mine, theirs in zip(*mirrors):
        assert mine.length == theirs.length and torch.equal(mine.features, theirs.features)
    assert passes["one pass"] == 1


def test_forward_many_runs_each_call_alone_off_the_compiled_layers():
    model = tiny_llama(0)
    targets = [CausalLM(model, name=f"fp32 {i}") for i in range(2)]
    reference = [CausalLM(model, name=f"ref {i}") for i in range(2)]
    calls = [ForwardCall([3, 4]), ForwardCall([5])]
    for output, target, call in zip(forward_many(targets, calls), reference, calls):
        assert torch.equal(output.logits, call.run(target).logits)


def test_the_engine_is_lockstep_on_the_compiled_layers_and_ragged_elsewhere(int4_target):
    assert isinstance(engine_for(int4_target), LockstepEngine)
    assert isinstance(engine_for(CausalLM(tiny_llama(0))), BatchEngine)


def test_a_method_the_ragged_engine_cannot_batch_runs_lockstep_on_a_float_model():
    target = CausalLM(tiny_llama(0), name="fp32")
    config = METHODS["specinfer-self"]
    engine = engine_for(target, method=config, max_batch_size=4)
    assert isinstance(engine, LockstepEngine)
    assert "one after another" in engine_description(engine)
    assert isinstance(engine_for(target, method=METHODS["pld"]), BatchEngine)
    out = engine.generate([BatchRequest(tuple(p), GREEDY, config) for p in PROMPTS[:6]])
    assert out == [alone(target, config, p, GREEDY) for p in PROMPTS[:6]]


@pytest.mark.parametrize("make", [tiny_gpt_oss, tiny_gemma3])
def test_a_model_with_sliding_window_layers_is_served_by_lockstep_with_each_requests_own_tokens(make, caplog):
    """gpt-oss's and Gemma-3's sliding-window layers have no place in the ragged cache: the engine (and so `serve`)
    falls back to lockstep, saying so, rather than refusing the model."""
    target = CausalLM(make(0), name="windowed")
    for config in (METHODS["ar"], METHODS["pld"], METHODS["specinfer-self"]):
        engine = engine_for(target, method=config, max_batch_size=4)
        assert isinstance(engine, LockstepEngine)
        out = engine.generate([BatchRequest(tuple(p), GREEDY, config) for p in PROMPTS[:6]])
        assert out == [alone(target, config, p, GREEDY) for p in PROMPTS[:6]]
    assert "windowed: its sliding-window or shared cache layers are not batched" in caplog.text


def test_a_kept_cache_copied_for_a_longer_prompt_skips_layers_that_hold_no_entries(monkeypatch):
    """Gemma 3n's last layers read earlier layers' keys and values: their cache layers hold none, and copying a kept
    cache's first entries into a new request's cache (a prompt that goes on past a kept one) skips them. The new
    request's next logits are those of reading the prompt afresh."""
    model = tiny_gemma3n(0)
    engine = engine_for(CausalLM(model, name="gemma3n"), method=METHODS["ar"], max_batch_size=2,
                        prompt_cache_bytes=1 << 24)
    kept, prompt = CausalLM(model, name="kept"), list(range(3, 23))
    kept.forward(prompt)
    monkeypatch.setattr(engine.prompt_cache, "take", lambda *_, **__: (kept.cache, 12, False))  # (not owned: copied)
    fresh, alone = CausalLM(model, name="fresh"), CausalLM(model, name="alone")
    assert engine._reuse(fresh, prompt[:12] + [50, 51], 14) == 12
    alone.forward(prompt[:12])
    assert torch.allclose(fresh.forward([50, 51]).logits[-1], alone.forward([50, 51]).logits[-1], atol=1e-5)


def test_pearl_is_refused_by_every_engine_with_why_and_never_offered_by_the_server(int4_target):
    # PEARL drafts on a thread of its own beside its target's forward; a batch's forward already takes every core.
    from jointspec.methods.registry import batched_methods, method_names, unknown_method_error

    pearl = MethodConfig(name="pearl", draft="self")
    for target in (int4_target, CausalLM(tiny_llama(0))):  # lockstep, and the ragged engine's lockstep fallback
        with pytest.raises(UnsupportedOptionError, match="'pearl' is not batched: it drafts on a thread"):
            engine_for(target, method=pearl).method(pearl)
    with pytest.raises(UnsupportedOptionError, match="unknown method 'no-such-method'; choose one of"):
        engine_for(int4_target).method(MethodConfig(name="no-such-method"))  # not pearl's reason
    served = batched_methods()
    assert "pearl" in method_names() and "pearl" not in served and {"ar", "default", "sps", "mtad"} <= set(served)
    assert "pearl" not in unknown_method_error("nope", served) and "pearl" in unknown_method_error("nope")


def test_a_method_neither_engine_runs_is_refused_with_its_reason_and_no_fallback_warning(caplog):
    # `serve --method mtad` on a float model without a draft logged "decoding every request with its own loop"
    # and then failed with the real reason.
    target = CausalLM(tiny_llama(0), name="fp32")
    with caplog.at_level("WARNING"), pytest.raises(UnsupportedOptionError, match="needs a draft model"):
        engine_for(target, method=MethodConfig("mtad"))
    assert "its own loop" not in caplog.text


# -- the engine -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("max_batch_size", [1, 3, 16])
def test_each_request_gets_the_tokens_it_gets_alone_greedy(int4_target, method, max_batch_size, passes):
    config = METHODS[method]
    engine = LockstepEngine(int4_target, max_batch_size=max_batch_size)
    # The batch's cost curve is measured by timing; on a loaded machine it can say that no draft pays at 16 rows,
    # and then nothing is verified. Rows priced nearly free keep the cost-aware drafters drafting: the check below
    # that drafts were accepted then holds whatever the machine's load (the tokens hold either way).
    engine._curves = dict.fromkeys((False, True), CostCurve({n: 1.0 + 0.002 * (n - 1) for n in BATCH_CURVE_SIZES}))
    engine.supervisor = None  # drafts as the pinned curve prices them (the supervisor's choice is timed)
    out = engine.generate([BatchRequest(tuple(p), GREEDY, config) for p in PROMPTS])
    expected = [alone(int4_target, config, p, GREEDY) for p in PROMPTS]
    assert out == expected
    assert any(len(tokens) < GREEDY.max_new_tokens for tokens in out), "some rows must end on an EOS"
    assert any(tokens[-1] in EOS for tokens in out if tokens)
    if method != "ar":
        assert engine.stats.num_accepted_tokens > 0
    # Tokens per round = 1 + accepted / rounds, also where an EOS ended a round inside its accepted draft.
    assert engine.stats.num_new_tokens == engine.stats.num_rounds + engine.stats.num_accepted_tokens
    assert (passes["one pass"] > 0) == (max_batch_size > 1)  # rounds of several rows ran as one pass


def test_each_round_reports_its_sequences_rows_and_accepted_tokens(int4_target):
    # on_round is what benchmarks/lockstep_methods.py --rounds-log prices rounds by: its counts must add up to the
    # engine's own per-sequence statistics, round by round.
    engine = LockstepEngine(int4_target, max_batch_size=3)
    # Rows nearly free: drafts.
    engine._curves = dict.fromkeys((False, True), CostCurve({n: 1.0 + 0.002 * (n - 1) for n in BATCH_CURVE_SIZES}))
    engine.supervisor = None  # drafts as the pinned curve prices them (the supervisor's choice is timed)
    records: list[RoundRecord] = []
    engine.on_round = records.append
    before = []

    def step():
        before.append((engine.stats.num_rounds, engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens))
        return original()

    original, engine.step = engine.step, step
    out = engine.generate([BatchRequest(tuple(p), GREEDY, METHODS["pld-cost-aware"]) for p in PROMPTS])
    assert out == [alone(int4_target, METHODS["pld-cost-aware"], p, GREEDY) for p in PROMPTS]
    after = before[1:] + [(engine.stats.num_rounds, engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens)]
    ran = [(b, a) for b, a in zip(before, after) if a[0] > b[0]]  # steps that ran a round (not only admitted)
    assert len(records) == len(ran) > 0
    for record, (b, a) in zip(records, ran):
        assert 1 <= record.sequences <= 3 and record.seconds >= record.forward_seconds > 0
        assert record.sequences == a[0] - b[0]
        assert record.rows - record.sequences == a[1] - b[1]
        assert record.accepted == a[2] - b[2]
    assert sum(r.accepted for r in records) > 0 and max(r.sequences for r in records) == 3


@pytest.mark.parametrize("method", ["ar", "sps-self", "specinfer-self", "mtad-self", "mtad-tree-self"])
def test_each_request_gets_the_tokens_it_gets_alone_sampled(int4_target, method):
    config = METHODS[method]
    engine = LockstepEngine(int4_target, max_batch_size=5)
    requests = [BatchRequest(tuple(p), SAMPLED, config, seed=100 + i) for i, p in enumerate(PROMPTS)]
    out = engine.generate(requests)
    assert out == [alone(int4_target, config, list(r.prompt_ids), SAMPLED, seed=r.seed) for r in requests]


@pytest.mark.parametrize("decode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mtad_requests_over_a_head_share_its_first_call_a_round_and_keep_their_tokens(decode, tmp_path, monkeypatch):
    """MTAD's requests drafting with one head (int8, its layer compiled) get each round's first head call made for
    all of them in one pass (drafts/eagle.py, context_logits_many), and each request still gets the tokens it gets
    alone: sampled ones too, whose draws read the draft's probabilities (logits moved by 1e-3, or another request's,
    change them; a last-bit difference might not: test_kernels_grouped.py holds the bits). Each request's round is
    charged its share of the shared call's time. Deterministic: no false-failure odds."""
    from jointspec.batch import lockstep
    from jointspec.drafts.eagle import HeadDraftModel

    model = grouped_llama(3)  # a head reads the target's LM head: a quantised one through the tied embedding
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    target = CausalLM(quantize_model(model, "int4"), name="int4 tied")
    head = untrained_head(target, seed=3)
    head.save(tmp_path / "head")
    assert isinstance(HeadDraftModel(head, target.fork("check"), weights="int8")._lean, LeanCompiledBody)
    config = MethodConfig("mtad", draft=str(tmp_path / "head"), num_draft_tokens=2, beam_width=2, cost_aware=False)
    batched = []
    original = lockstep.context_logits_many

    def counted(drafts, token_lists):
        result = original(drafts, token_lists)
        batched.append(0 if result is None else len(drafts))
        return result
    monkeypatch.setattr(lockstep, "context_logits_many", counted)
    engine = LockstepEngine(target, max_batch_size=5)
    requests = [BatchRequest(tuple(p), decode, config, seed=100 + i) for i, p in enumerate(PROMPTS)]
    out = engine.generate(requests)
    assert max(batched) >= 3 and sum(batched) > 3 * len(PROMPTS)  # most rounds' head calls made together
    assert out == [alone(target, config, list(r.prompt_ids), decode, seed=r.seed) for r in requests]
    assert engine.stats.num_draft_tokens > 0

    # The shared call's time reaches the requests' drafting: passes made to take 50 ms each show in its total.
    passes = []

    def slow(drafts, token_lists):
        start = time.perf_counter()
        result = original(drafts, token_lists)
        while time.perf_counter() - start < 0.05:
            pass
        passes.append(result is not None)
        return result
    monkeypatch.setattr(lockstep, "context_logits_many", slow)
    engine = LockstepEngine(target, max_batch_size=5)
    engine.generate([BatchRequest(tuple(p), decode, config, seed=i) for i, p in enumerate(PROMPTS[:3])])
    assert sum(passes) >= 5 and engine.stats.draft_seconds >= 0.05 * sum(passes)


def test_requests_reading_different_heads_in_one_batch_each_get_their_own_tokens(int4_target):
    # Greedy rows read the screen's argmax, top-k rows the screen's top k (of their own k), the others every exact
    # logit: one batch holds all four kinds, its head called once per kind over their rows, and each request still
    # gets the tokens it gets alone. The screen is narrowed until it misses, so that a row read through another kind
    # of head than its own gives other tokens.
    engine = LockstepEngine(int4_target, max_batch_size=8)
    screen = int4_target.model.lm_head
    narrowed = {"margin": 0.0, "max_exact": 1, "exact_per_rank": 1}
    kept = {name: getattr(screen, name) for name in narrowed}
    samplings = [GREEDY, SAMPLED, replace(SAMPLED, sampling=SamplingConfig(temperature=0.8, top_k=3)),
                 replace(SAMPLED, sampling=SamplingConfig(temperature=0.8))]
    requests = [BatchRequest(tuple(p), samplings[i % 4], METHODS["pld"], seed=100 + i) for i, p in enumerate(PROMPTS)]
    heads = []
    lean = int4_target.lean
    head = lean._head
    lean._head = lambda hidden, num_logits, rank, *rest: heads.append(rank) or head(hidden, num_logits, rank, *rest)
    try:
        for name, value in narrowed.items():
            setattr(screen, name, value)
        out = engine.generate(requests)
        expected = [alone(int4_target, METHODS["pld"], list(r.prompt_ids), r.config, seed=r.seed) for r in requests]
    finally:
        del lean._head
        for name, value in kept.items():
            setattr(screen, name, value)
    assert set(heads) >= {0, 1, 3, SAMPLED.sampling.top_k}  # every kind of head was read
    assert out == expected


def test_lookup_drafts_sample_what_ar_samples_under_load(int4_target):
    # Cost-aware lookup drafts shorter as the batch fills, but its drafts use no draws and its verifier one draw per
    # emitted token (verifiers/rejection.py): each request's sampled tokens are plain sampling's for its seed.
    engine = LockstepEngine(int4_target, max_batch_size=5)
    # Rows priced nearly free, as above: a measured curve on a loaded machine can leave drafting (and learning) too
    # rare for the acceptance check below; the tokens hold either way.
    engine._curves = dict.fromkeys((False, True), CostCurve({n: 1.0 + 0.002 * (n - 1) for n in BATCH_CURVE_SIZES}))
    engine.supervisor = None  # drafts as the pinned curve prices them (the supervisor's choice is timed)
    requests = [BatchRequest(tuple(p), SAMPLED, METHODS["pld-cost-aware"], seed=100 + i) for i, p in enumerate(PROMPTS)]
    out = engine.generate(requests)
    assert out == [alone(int4_target, METHODS["ar"], list(r.prompt_ids), SAMPLED, seed=r.seed) for r in requests]
    assert engine.stats.num_accepted_tokens > 0


def test_a_cancelled_request_leaves_and_the_others_are_untouched(int4_target):
    config = METHODS["pld"]
    engine = LockstepEngine(int4_target, max_batch_size=4)
    ids = [engine.submit(BatchRequest(tuple(p), GREEDY, config)) for p in PROMPTS[:6]]
    out = {seq_id: [] for seq_id in ids}
    finished = {}
    rounds = 0
    while engine.has_work:
        for event in engine.step():
            out[event.seq_id].extend(event.token_ids)
            if event.finish_reason:
                finished[event.seq_id] = event.finish_reason
        rounds += 1
        if rounds == 1:
            engine.cancel(ids[1])
            engine.cancel(ids[5])  # still waiting
    assert finished[ids[1]] == finished[ids[5]] == "cancelled"
    for i in (0, 2, 3, 4):
        assert finished[ids[i]] in ("stop", "length")
        assert out[ids[i]] == alone(int4_target, config, PROMPTS[i], GREEDY)



def test_a_request_its_own_method_refuses_ends_alone_and_the_others_are_untouched(int4_target):
    # A 16 x 16 tree is 272 draft nodes, past the rows a CPU forward computes alone: the loop refuses that round.
    # In a batch the refusal ends that request with its error; it used to raise out of the round and fail them all.
    too_big = MethodConfig("specinfer", draft="self", tree=(16, 16), cost_aware=False)
    with pytest.raises(UnsupportedOptionError, match="272 tokens"):
        alone(int4_target, too_big, PROMPTS[0], GREEDY)
    config = METHODS["pld"]
    engine = LockstepEngine(int4_target, max_batch_size=4)
    ids = [engine.submit(BatchRequest(tuple(p), GREEDY, too_big if i == 1 else config))
           for i, p in enumerate(PROMPTS[:4])]
    out = {seq_id: [] for seq_id in ids}
    finished = {}
    while engine.has_work:
        for event in engine.step():
            out[event.seq_id].extend(event.token_ids)
            if event.finish_reason:
                finished[event.seq_id] = (event.finish_reason, event.error)
    reason, error = finished[ids[1]]
    assert reason == "error" and isinstance(error, UnsupportedOptionError) and out[ids[1]] == []
    for i in (0, 2, 3):
        assert finished[ids[i]][0] in ("stop", "length")
        assert out[ids[i]] == alone(int4_target, config, PROMPTS[i], GREEDY)
    with pytest.raises(UnsupportedOptionError, match="272 tokens"):  # generate() raises the request's own error
        LockstepEngine(int4_target).generate([BatchRequest(tuple(PROMPTS[0]), GREEDY, too_big)])

def test_a_request_that_joins_mid_flight_gets_its_own_tokens(int4_target):
    config = METHODS["sps-self"]
    engine = LockstepEngine(int4_target, max_batch_size=16)
    first = engine.submit(BatchRequest(tuple(PROMPTS[3]), GREEDY, config))
    out = {first: []}
    for _ in range(3):
        for event in engine.step():
            out[event.seq_id].extend(event.token_ids)
    late = engine.submit(BatchRequest(tuple(PROMPTS[8]), GREEDY, config))
    out[late] = []
    while engine.has_work:
        for event in engine.step():
            out[event.seq_id].extend(event.token_ids)
    assert out[first] == alone(int4_target, config, PROMPTS[3], GREEDY)
    assert out[late] == alone(int4_target, config, PROMPTS[8], GREEDY)


@pytest.mark.parametrize("method", ["ar", "pld", "sps-self"])
def test_a_long_prompt_is_read_over_rounds_while_the_others_decode(int4_target, monkeypatch, method):
    """A prompt longer than the target's prefill chunk joins after several rounds, one chunk a round, while the
    request already decoding gets tokens every round; both get exactly ``generate``'s tokens (the chunks are
    ``generate``'s)."""
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(int4_target.lean, "prefill_chunk", 16)
    monkeypatch.setattr(int4_target.lean, "alone_prompt_tokens", 0)  # (the AVX2 builds' 128-row chunks up to 1,024)
    config = METHODS[method]
    engine = LockstepEngine(int4_target, max_batch_size=16)
    engine.prefill_tokens_per_round = 16
    first = engine.submit(BatchRequest(tuple(PROMPTS[3]), GREEDY, config))
    engine.step()
    long_prompt = random_prompt(9, length=100)  # 99 tokens to read: 7 chunks of up to 16
    late = engine.submit(BatchRequest(tuple(long_prompt), GREEDY, config))
    out, rounds_before = {first: [], late: []}, 0
    while engine.has_work:
        decoding = first in engine.active
        events = engine.step()
        if late not in engine.active and not any(e.seq_id == late for e in events):
            rounds_before += 1
            assert not decoding or any(e.seq_id == first and e.token_ids for e in events), "the decoding one waited"
        for event in events:
            out[event.seq_id].extend(event.token_ids)
    assert rounds_before == 6  # chunks 1-6 in rounds of their own; the 7th in the round the request joins
    assert out[first] == alone(int4_target, config, PROMPTS[3], GREEDY)
    assert out[late] == alone(int4_target, config, long_prompt, GREEDY)


# -- load-aware drafting --------------------------------------------------------------------------------------------

def test_probes_are_spaced_in_a_batch_and_left_alone_otherwise(int4_target):
    """A cost-aware drafter gets the engine's probe budget while its round has other sequences, and its own (none:
    the plain probe schedule, as `generate` runs it) while it is alone."""
    engine = LockstepEngine(int4_target, max_batch_size=4)
    config = METHODS["pld-cost-aware"]
    first = engine.submit(BatchRequest(tuple(PROMPTS[0]), GREEDY, config))
    engine.step()
    drafter = engine.active[first].decoder.drafter
    assert isinstance(drafter, CostAwareDrafter) and drafter.probe_budget is None and not drafter.shadow_tests
    second = engine.submit(BatchRequest(tuple(PROMPTS[1]), GREEDY, config))
    engine.step()
    assert len(engine.active) == 2
    assert all(seq.decoder.drafter.probe_budget == BATCH_PROBE_BUDGET and seq.decoder.drafter.shadow_tests
               and seq.decoder.drafter.shadow_budget == BATCH_SHADOW_BUDGET for seq in engine.active.values())
    engine.cancel(second)
    engine.step()
    assert list(engine.active) == [first] and drafter.probe_budget is None and not drafter.shadow_tests
    assert drafter.shadow_budget is None


def test_defaults_lookup_or_tree_drafter_takes_the_batch_curve_in_both_halves(int4_target):
    """`default` drafts lookup-or-tree where the head's tree is expected to pay: in a batch its tree must be judged on
    the batch's cost (a tree's extra rows cost a full batch more than they cost one sequence alone) and its lookup
    half must take the batch's curve and shadow tests; alone, both get their own curve back."""
    from types import SimpleNamespace

    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter

    class FakeTree:
        branching = (3,)

    own = CostCurve({1: 1.0, 2: 1.05, 4: 1.1, 5: 1.6})
    engine = LockstepEngine(int4_target, max_batch_size=4)
    engine._curves = {False: CostCurve({1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 3.0, 9: 5.0, 17: 9.0})}  # a row: half a step
    rows = [SimpleNamespace(seq_id=i, decoder=SimpleNamespace(drafter=LookupOrTreeDrafter(
        CostAwareDrafter(object(), own), FakeTree(), own, draft_cost_per_call=0.0)), own_settings={},
        request=BatchRequest((1,), GREEDY)) for i in range(4)]
    drafter = rows[0].decoder.drafter
    alone_tree_cost = drafter.tree_cost
    assert drafter.tree_speedup() > 1.3  # alone, the tree's expected 1.5 tokens cost 1.1 steps
    engine._set_draft_costs(rows)
    batch = batch_cost_curve(engine._curves[False], 3)
    assert drafter.curve.target_cost == batch.target_cost and drafter.lookup.curve is drafter.curve
    assert drafter.tree_cost == pytest.approx(batch.cost(4))
    assert drafter.tree_speedup() < 0.5  # in the full batch its three rows cost 3.4 rows' shares
    assert drafter.lookup.shadow_tests and drafter.lookup.probe_budget == BATCH_PROBE_BUDGET
    engine._set_draft_costs(rows[:1])
    assert drafter.curve is own and drafter.lookup.curve is own and drafter.tree_cost == alone_tree_cost
    assert not drafter.lookup.shadow_tests and drafter.lookup.probe_budget is None
    # Settings are made again only when the batch's members change (not every round): two other requests now.
    engine._set_draft_costs(rows[1:3])
    engine._set_draft_costs(rows[1:3])
    other = rows[1].decoder.drafter
    assert other.curve.target_cost == batch_cost_curve(engine._curves[False], 1).target_cost
    assert other.lookup.shadow_tests


def test_a_sequence_alone_sees_its_own_curve():
    curve = CostCurve({1: 1.0, 2: 1.1, 5: 1.4, 17: 3.0}, draft_cost_per_token=0.01)
    assert batch_cost_curve(curve, 0) is curve


def test_drafts_shrink_and_stop_as_the_batch_fills():
    """An overhead-bound forward (a CPU decoding a small model: 16 rows cost about 3 single-row forwards) pays for
    drafts alone; once 63 other rows fill the forward, an extra row costs what a row's share does, and a draft accepted
    70% of the time no longer pays."""
    curve = CostCurve({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4, 9: 1.8, 17: 2.6, 33: 4.2, 65: 7.4})
    chosen = [choose_num_draft_tokens(0.7, batch_cost_curve(curve, rows), 8) for rows in (0, 3, 15, 63)]
    assert chosen[0] >= 4
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[-1] == 0


def test_the_engine_shows_the_batch_curves_it_prices_drafts_by(int4_target, monkeypatch):
    import jointspec.batch.lockstep as lockstep

    greedy, sampled = CostCurve({1: 5.0, 2: 6.0, 16: 40.0, 17: 43.0}), CostCurve({1: 7.0, 2: 9.0, 16: 70.0, 17: 74.0})
    calls = []

    def measure(*args, argmax_only, **kwargs):
        calls.append(argmax_only)
        return greedy if argmax_only else sampled

    monkeypatch.setattr(lockstep, "measure_cost_curve", measure)
    engine = LockstepEngine(int4_target, max_batch_size=16)
    assert int4_target.capabilities.argmax_screen  # greedy rows read the screened head, sampled rows the exact one
    assert engine.batch_curves == {}  # not measured until a load-aware method needs one
    assert engine._batch_curve() is greedy and engine.batch_curves == {"greedy": greedy} and calls == [True]
    # Sampled rows are timed apart, with every row's exact logits, and each kind once; their curve is the greedy
    # one plus the exact head's fitted share.
    fitted = engine._batch_curve(sampled=True)
    assert fitted == sampled_rows_curve(greedy, sampled) and engine._batch_curve() is greedy
    assert engine._batch_curve(sampled=True) is fitted
    assert engine.batch_curves == {"greedy": greedy, "sampled": fitted} and calls == [True, False]


def test_the_sampled_rows_curve_is_the_greedy_one_plus_a_fitted_line():
    greedy = CostCurve({n: 5.0 + 1.0 * n + (3.0 if n > 8 else 0.0) for n in BATCH_CURVE_SIZES})  # a tile's step
    exact = {n: greedy.target_cost[n] + 1.0 + 0.5 * n for n in BATCH_CURVE_SIZES}
    fitted = sampled_rows_curve(greedy, CostCurve(exact))
    assert fitted.target_cost == pytest.approx(exact)  # a difference that is a line is kept as measured
    # One size measured high (16) would make the next (17) flat under the curve's running maximum: a free row.
    noisy = {**exact, 16: exact[16] + 6.0}
    assert CostCurve(noisy).cost(17) - CostCurve(noisy).cost(16) == 0.0
    fitted = sampled_rows_curve(greedy, CostCurve(noisy))
    assert fitted.cost(17) - fitted.cost(16) == pytest.approx(1.5, abs=0.05)  # greedy's 1.0 and about 0.5 more
    # Never below the greedy rows, whatever the measured difference.
    cheaper = sampled_rows_curve(greedy, CostCurve({n: greedy.target_cost[n] * 0.9 for n in BATCH_CURVE_SIZES}))
    assert all(cheaper.target_cost[n] >= greedy.target_cost[n] for n in BATCH_CURVE_SIZES)


def test_a_sampled_request_has_the_sampled_curve_measured_when_it_is_checked(int4_target, monkeypatch):
    import jointspec.batch.lockstep as lockstep

    calls = []
    monkeypatch.setattr(lockstep, "measure_cost_curve",
                        lambda *args, argmax_only, **kwargs: calls.append(argmax_only) or CostCurve({1: 1.0, 2: 1.2}))
    engine = LockstepEngine(int4_target, max_batch_size=4)
    engine.check(BatchRequest(tuple(PROMPTS[0]), SAMPLED, METHODS["ar"]))  # no drafts: no curve
    engine.check(BatchRequest(tuple(PROMPTS[0]), GREEDY, METHODS["pld-cost-aware"]))
    assert calls == [True]
    engine.check(BatchRequest(tuple(PROMPTS[0]), SAMPLED, METHODS["pld-cost-aware"]))
    assert calls == [True]  # its top-k reads the screen: greedy rows' curve
    exact = replace(SAMPLED, sampling=SamplingConfig(temperature=0.8))  # (its drawn rows priced as exact ones)
    engine.check(BatchRequest(tuple(PROMPTS[0]), exact, METHODS["pld-cost-aware"]))
    assert calls == [True, False]  # before any round, not in one


@pytest.mark.parametrize("method", ["pld-cost-aware", "lookahead", "mtad-cost-aware"])
def test_the_engine_gives_cost_aware_drafters_the_batch_curve(int4_target, method):
    engine = LockstepEngine(int4_target, max_batch_size=16)
    config = METHODS[method]
    for p in PROMPTS[:4]:
        engine.submit(BatchRequest(tuple(p), DecodeConfig(max_new_tokens=4, eos_token_ids=EOS), config))
    engine.step()
    drafters = [seq.decoder.drafter for seq in engine.active.values()]
    wide = engine._batch_curve()
    assert len(drafters) == 4 and all(d.curve == batch_cost_curve(
        wide.with_draft_cost(d.curve.draft_cost_per_token), 3) for d in drafters)
    # Alone, a request drafts on its own curve, as generate does.
    alone_engine = LockstepEngine(int4_target, max_batch_size=16)
    alone_engine.submit(BatchRequest(tuple(PROMPTS[5]), DecodeConfig(max_new_tokens=4, eos_token_ids=EOS), config))
    seq = next(iter(alone_engine.waiting))
    own = seq.decoder.drafter.curve
    alone_engine.step()
    assert seq.decoder.drafter.curve is own


def test_sampled_and_greedy_requests_in_one_batch_are_priced_by_their_own_rows_curves(int4_target):
    # A sampled row without a top-k reads the exact head, where a greedy one reads the screen's argmax and a sampled
    # one with a top-k the screen's top k: in one batch, each request's drafts take the batch curve of its own kind
    # of row (the exact head's, or the screened one's).
    engine = LockstepEngine(int4_target, max_batch_size=4)
    engine._curves = {False: CostCurve({n: 1.0 + 0.1 * (n - 1) for n in BATCH_CURVE_SIZES}),
                      True: CostCurve({n: 1.5 + 0.4 * (n - 1) for n in BATCH_CURVE_SIZES})}
    config = METHODS["pld-cost-aware"]
    exact = SamplingConfig(temperature=0.8, top_p=0.9)  # top-p alone: every logit's normaliser
    drawn = SamplingConfig(temperature=0.8)  # temperature alone: drawn rows, priced as exact ones (the dearer)
    assert 0 < SAMPLED.sampling.top_k <= int4_target.capabilities.top_k_screen
    kinds = [(GREEDY.sampling, False), (SAMPLED.sampling, False), (exact, True), (drawn, True)]
    for i, (p, (sampling, _)) in enumerate(zip(PROMPTS, kinds)):
        engine.submit(BatchRequest(tuple(p), DecodeConfig(4, sampling, EOS), config, seed=i))
    engine.step()
    assert len(engine.active) == 4
    for seq, (_, exact_rows) in zip(sorted(engine.active.values(), key=lambda seq: seq.seq_id), kinds):
        drafter = seq.decoder.drafter
        assert drafter.curve == batch_cost_curve(engine._curves[exact_rows].with_draft_cost(
            drafter.curve.draft_cost_per_token), 3)



def test_the_engine_keeps_a_bounded_number_of_checked_methods(int4_target):
    # A server's requests may each name their own options: the checked configs are the most recently used only.
    from jointspec.batch.engine import MAX_BUILT_METHODS

    engine = LockstepEngine(int4_target, max_batch_size=2)
    configs = [MethodConfig("pld", num_draft_tokens=4, accept_threshold=1.0 + i) for i in range(MAX_BUILT_METHODS + 6)]
    for config in configs:
        engine.method(config)
    assert len(engine._checked) == MAX_BUILT_METHODS
    assert configs[0] not in engine._checked and configs[-1] in engine._checked


# -- the prompt cache -------------------------------------------------------------------------------------------------

def decode_one(engine, request: BatchRequest):
    """Run ``request`` alone through ``engine``; its new tokens and final statistics."""
    seq_id, tokens, stats = engine.submit(request), [], None
    while engine.has_work:
        for event in engine.step():
            assert event.error is None, event.error
            if event.seq_id == seq_id:
                tokens.extend(event.token_ids)
                stats = event.stats if event.finish_reason is not None else stats
    return tokens, stats


def fresh_bits(target: CausalLM, cache, prompt: list[int]) -> bool:
    """Whether ``cache`` holds, for every token of ``prompt`` but the last, the bits a fresh prefill writes."""
    fresh = target.fork("fresh")
    fresh.forward(prompt[:-1], num_logits=0)
    end = len(prompt) - 1
    return all(torch.equal(layer.keys[..., :end, :], reference.keys[..., :end, :])
               and torch.equal(layer.values[..., :end, :], reference.values[..., :end, :])
               for layer, reference in zip(cache.layers, fresh.cache.layers))


PREFILL_MODES = {  # (chunk, rows from which a forward is read as one GEMM, leading positions read row by row)
    "rows alone": (16, math.inf, 0),  # the compiled AVX-512 layers' way: any shared prefix is reusable
    "GEMM chunks": (16, 8, 0),  # the portable and NEON builds' way (at their own sizes): whole chunks only
    # The AVX2 builds' way (at their own sizes): a prompt's first 80 positions row by row in chunks of 8 (any shared
    # prefix within them reusable), GEMM chunks of 16 from there.
    "first positions alone": (16, 9, 80),
}


def prefill_mode(monkeypatch, target, mode: str) -> int:
    """Have ``target``'s compiled layers read prompts in ``mode``'s way (PREFILL_MODES); returns its chunk."""
    chunk, gemm_rows, alone_tokens = PREFILL_MODES[mode]
    monkeypatch.setattr(target.lean, "prefill_chunk", chunk)
    monkeypatch.setattr(target.lean, "prefill_gemm_rows", gemm_rows)
    monkeypatch.setattr(target.lean, "alone_prompt_tokens", alone_tokens)
    return chunk


@pytest.mark.parametrize("mode", list(PREFILL_MODES))
@pytest.mark.parametrize("method", ["ar", "pld", "sps-self", "specinfer-self", "lookahead"])
def test_a_chats_next_turn_reuses_the_last_turns_cache_bit_for_bit(int4_target, monkeypatch, mode, method):
    """A prompt that begins with a finished request's tokens takes its cache and reads only the rest: the answer is
    the one ``generate`` gives, and the prompt's cache entries are the bits a fresh prefill writes (where rows of a
    prompt chunk are not computed alone, only whole chunks of the earlier prompt are reused: reusing its decoded
    entries too gives other bits, and this test fails)."""
    chunk = prefill_mode(monkeypatch, int4_target, mode)
    config = METHODS[method] if method in METHODS else MethodConfig(method)
    decode = replace(GREEDY, max_new_tokens=14, eos_token_ids=frozenset())
    engine = LockstepEngine(int4_target, max_batch_size=4, prompt_cache_bytes=2 ** 26)
    first = random_prompt(3, 45)
    answer, stats = decode_one(engine, BatchRequest(first, decode, config))
    assert (engine.stats.num_draft_tokens > 0) == (method != "ar")  # (the drafts' entries are reused too)
    assert stats.prompt_tokens_reused == 0 and len(engine.prompt_cache) == 1
    second = first + answer + random_prompt(5, 9)  # the conversation so far, then the next turn
    tokens, stats = decode_one(engine, BatchRequest(second, decode, config))
    assert tokens == alone(int4_target, config, second, decode)
    held = len(first) + len(answer) - 1  # every committed token but the last has its entry
    expected = (len(first) - 1) // chunk * chunk if mode == "GEMM chunks" else held
    assert stats.prompt_tokens_reused == expected > 0
    (kept,) = engine.prompt_cache._kept.values()  # the second turn's own cache, kept in turn
    assert fresh_bits(int4_target, kept.cache, second)


def test_an_answer_ended_by_an_eos_inside_a_draft_leaves_the_entries_of_its_tokens(int4_target):
    """A draft accepted past an end-of-sequence token leaves cache entries for tokens never committed: the kept
    cache holds those of the committed tokens only, and the next turn still gets a fresh reading's bits."""
    config = METHODS["sps-self"]  # the target drafting for itself: every drafted token accepted
    free = alone(int4_target, config, random_prompt(3, 45), replace(GREEDY, max_new_tokens=14,
                                                                   eos_token_ids=frozenset()))
    decode = replace(GREEDY, max_new_tokens=14, eos_token_ids=frozenset({free[6]}))  # an EOS mid-answer
    engine = LockstepEngine(int4_target, max_batch_size=2, prompt_cache_bytes=2 ** 26)
    first = random_prompt(3, 45)
    answer, _ = decode_one(engine, BatchRequest(first, decode, config))
    assert answer[-1] == free[6] and len(answer) < 14
    (kept,) = engine.prompt_cache._kept.values()
    assert kept.tokens == first + answer and kept.cache.get_seq_length() == len(kept.tokens)
    second = first + answer + random_prompt(5, 9)
    tokens, stats = decode_one(engine, BatchRequest(second, decode, config))
    assert tokens == alone(int4_target, config, second, decode)
    assert stats.prompt_tokens_reused == len(first) + len(answer) or not (prompt_rows_alone(int4_target)
                                                                          or int4_target.alone_positions)


def test_the_prompt_cache_keeps_within_its_budget_and_gives_the_longest_prefix(int4_target):
    from jointspec.batch.prompt_cache import PromptCache, cache_bytes

    def cache_of(tokens):
        fork = int4_target.fork("kept")
        fork.forward(tokens, num_logits=0)
        return fork.cache

    a, b, c = random_prompt(0, 20), random_prompt(3, 20), random_prompt(5, 20)
    fitted = cache_of(a)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in fitted.layers]
    roomy = cache_bytes(fitted)
    fitted.fit()  # what keep does first: the spare room goes, the entries stay
    size = cache_bytes(fitted)
    assert size < roomy and all(layer._key_buffer.shape[-2] == 20 for layer in fitted.layers)
    assert all(torch.equal(layer.keys, k) and torch.equal(layer.values, v)
               for layer, (k, v) in zip(fitted.layers, before))
    store = PromptCache(2 * size)
    store.keep(a, cache_of(a), None)
    store.keep(b, cache_of(b), None)
    store.keep(c, cache_of(c), None)  # past the budget: the oldest (a) leaves
    assert len(store) == 2 and store.nbytes == 2 * size
    assert store.take(a + [4, 5], 21, None) is None  # a's cache is gone
    cache, length, owned = store.take(b[:12] + [9, 9, 9], 15, None)
    assert length == 12 and not owned and len(store) == 2  # a part of b's tokens: copied, b's cache stays
    cache, length, owned = store.take(c + [4], 20, None)
    assert length == 20 and owned and cache.get_seq_length() == 20  # all of c's: the caller's now (it crops)
    assert len(store) == 1
    whole_chunks = PromptCache(2 * size)
    whole_chunks.keep(a, cache_of(a), 16)  # only its first 16 entries are any prompt's own
    assert whole_chunks.take(a + [4], 21, 8)[1:] == (16, True)
    again = PromptCache(4 * size)
    again.keep(b[:12], cache_of(b[:12]), None)
    again.keep(a, cache_of(a), None)
    again.keep(b, cache_of(b), None)  # serves every prompt b[:12]'s cache served: that one leaves
    assert len(again) == 2 and again.take(b[:12] + [9], 13, None)[1:] == (12, False)
    tiny = PromptCache(size - 1)
    tiny.keep(a, cache_of(a), None)  # larger than the whole budget: not kept
    assert len(tiny) == 0
    with pytest.raises(ValueError, match="budget"):
        PromptCache(-1)


@pytest.mark.parametrize("kv", ["float32", "float16"])
@pytest.mark.parametrize("mode", list(PREFILL_MODES))
def test_requests_sharing_a_system_prompt_each_copy_it_bit_for_bit(int4_target, monkeypatch, mode, kv):
    """A kept cache that a prompt shares only in part (a system prompt) is copied into each such request's own cache
    and stays kept: every one of them reads only its own part, and its entries are a fresh prefill's bits."""
    prefill_mode(monkeypatch, int4_target, mode)
    target = int4_target.fork(kv, kv_dtype=torch.float16 if kv == "float16" else None)  # copies widen, then narrow
    engine = LockstepEngine(target, max_batch_size=4, prompt_cache_bytes=2 ** 26)
    decode = replace(GREEDY, max_new_tokens=8, eos_token_ids=frozenset())
    system = random_prompt(0, 33)
    decode_one(engine, BatchRequest(system + random_prompt(3, 7), decode))
    for seed in (5, 6):
        prompt = system + random_prompt(seed, 11)
        seq_id = engine.submit(BatchRequest(prompt, decode))
        tokens = [t for event in engine.step() if event.seq_id == seq_id for t in event.token_ids]  # it joins
        own = engine.active[seq_id].decoder.target
        # GEMM chunks: the first request's prompt (40 tokens) left 2 whole chunks of 16, 32 of the 33 shared
        assert engine.active[seq_id].reused == (32 if mode == "GEMM chunks" else len(system))
        assert fresh_bits(target, own.cache, prompt)
        while engine.has_work:
            tokens += [t for event in engine.step() if event.seq_id == seq_id for t in event.token_ids]
        assert tokens == alone(target, MethodConfig(), prompt, decode)


@pytest.mark.parametrize("positions", [80, 76])
def test_past_the_positions_read_alone_only_whole_chunks_serve(int4_target, monkeypatch, positions):
    """The AVX2 builds' way at its own sizes (PREFILL_MODES: the first 80 positions row by row in chunks of 8, GEMM
    chunks of 16 from there; and 76, which no chunk divides): a prefix within those positions is reused whatever the
    prompts' lengths, past them only up to a whole chunk of both prompts' reading, counted from there, never an
    answer's entries there (computed alone, where a prompt's own reading takes the GEMM); each answer is the one
    ``generate`` gives, each cache a fresh prefill's bits. (Reusing past those bounds fails: a GEMM row's bits differ
    from a row's alone, and a chunk's from another's.)"""
    prefill_mode(monkeypatch, int4_target, "first positions alone")
    monkeypatch.setattr(int4_target.lean, "alone_prompt_tokens", positions)
    decode = replace(GREEDY, max_new_tokens=14, eos_token_ids=frozenset())

    def joins(engine, prompt: list[int]) -> int:
        """``prompt``'s request run to its end: how many entries it took, checked for a fresh prefill's bits."""
        seq_id = engine.submit(BatchRequest(prompt, decode))
        tokens = [t for event in engine.step() if event.seq_id == seq_id for t in event.token_ids]  # it joins
        reused = engine.active[seq_id].reused
        assert fresh_bits(int4_target, engine.active[seq_id].decoder.target.cache, prompt)
        while engine.has_work:
            tokens += [t for event in engine.step() if event.seq_id == seq_id for t in event.token_ids]
        assert tokens == alone(int4_target, MethodConfig(), prompt, decode)
        return reused

    engine = LockstepEngine(int4_target, max_batch_size=2, prompt_cache_bytes=2 ** 26)
    first = random_prompt(3, 45)
    answer, _ = decode_one(engine, BatchRequest(first, decode))
    # The next turn passes 96 tokens: the kept entries all lie within the positions read alone, and the rest is read
    # from the 58th in chunks that stop where its own reading's first GEMM chunk begins.
    assert joins(engine, first + answer + random_prompt(5, 45)) == len(first) + len(answer) - 1

    engine = LockstepEngine(int4_target, max_batch_size=2, prompt_cache_bytes=2 ** 26)
    first = random_prompt(4, 70)
    answer, _ = decode_one(engine, BatchRequest(first, decode))  # its answer's entries pass those positions
    assert joins(engine, first + answer + random_prompt(6, 10)) == positions

    engine = LockstepEngine(int4_target, max_batch_size=2, prompt_cache_bytes=2 ** 26)
    long = random_prompt(6, 120)  # 119 entries read: those positions alone, then chunks of 16, then a few rows
    decode_one(engine, BatchRequest(long, decode))
    # It shares 100 of them: up to the last chunk that starts before the 100th, counted from the positions read alone.
    assert joins(engine, long[:100] + random_prompt(7, 20)) == positions + (100 - positions) // 16 * 16
    assert joins(engine, long[:40] + random_prompt(8, 10)) == 40


def test_the_avx2_builds_serve_a_chats_next_turn_past_one_chunk_of_rows(int4_target):
    """At the compiled layers' own sizes: a first prompt of more than ROWWISE_PREFILL_CHUNK tokens, which the AVX2
    builds read by GEMM before they read a prompt's first ROWWISE_PROMPT_TOKENS positions row by row, leaves a cache
    whose every entry serves the next turn (on the AVX-512 builds too; the portable and NEON builds read it by GEMM)."""
    from jointspec.backends.lean_forward import ROWWISE_PREFILL_CHUNK, ROWWISE_PROMPT_TOKENS

    lean = int4_target.lean
    if lean._isa in ("avx2", "avx2vnni"):
        assert lean.alone_prompt_tokens == ROWWISE_PROMPT_TOKENS and lean.prefill_gemm_rows == ROWWISE_PREFILL_CHUNK + 1
        assert int4_target.alone_positions == ROWWISE_PROMPT_TOKENS
    decode = replace(GREEDY, max_new_tokens=14, eos_token_ids=frozenset())
    engine = LockstepEngine(int4_target, max_batch_size=2, prompt_cache_bytes=2 ** 26)
    first = random_prompt(8, ROWWISE_PREFILL_CHUNK + 20)
    answer, _ = decode_one(engine, BatchRequest(first, decode))
    second = first + answer + random_prompt(9, 12)
    tokens, stats = decode_one(engine, BatchRequest(second, decode))
    assert tokens == alone(int4_target, MethodConfig(), second, decode)
    if lean.alone_prompt_tokens or prompt_rows_alone(int4_target):  # (the portable and NEON builds: GEMM chunks)
        assert stats.prompt_tokens_reused == len(first) + len(answer) - 1
    (kept,) = engine.prompt_cache._kept.values()
    assert fresh_bits(int4_target, kept.cache, second)


def test_a_target_feeding_a_heads_mirror_takes_no_kept_cache(int4_target):
    # A head reads the target's features by position, which a kept cache does not carry.
    engine = LockstepEngine(int4_target, max_batch_size=2, prompt_cache_bytes=2 ** 26)
    prompt = random_prompt(6, 30)
    kept = int4_target.fork("kept")
    kept.forward(prompt[:20], num_logits=0)
    engine.prompt_cache.keep(prompt[:20], kept.cache, None)
    target = int4_target.fork("a head's target")
    target.mirrors.append(object())  # any mirror
    try:
        assert engine._reuse(target, prompt, len(prompt) - 1) == 0 and len(engine.prompt_cache) == 1
    finally:
        target.mirrors.clear()
    assert engine._reuse(target, prompt, len(prompt) - 1) == 20 and target.num_cached == 20


@pytest.mark.parametrize("half", ["begin_round", "finish_round"])
def test_a_fault_in_one_requests_round_ends_that_request_alone(monkeypatch, int4_target, half):
    """A drafting or verification that raises (faults: reviews found three, one in fitting a draft to a grammar) used to
    fail every request of the round, which a server then failed too. Now that request ends with its error and the
    others decode on."""
    prompts = [random_prompt(seed, 12) for seed in (0, 3)]
    real = getattr(SpeculativeDecoder, half)

    def faulty(self, state, *args, **kwargs):
        if state.tokens[:12] == prompts[0] and len(state.tokens) > 16:
            raise RuntimeError(f"a fault in this request's {half}")
        return real(self, state, *args, **kwargs)

    monkeypatch.setattr(SpeculativeDecoder, half, faulty)
    engine = LockstepEngine(int4_target, max_batch_size=4)
    ids = [engine.submit(BatchRequest(tuple(p), greedy(24), MethodConfig("pld", cost_aware=False))) for p in prompts]
    tokens, errors = run_engine(engine, ids)
    assert list(errors) == [ids[0]] and isinstance(errors[ids[0]], RuntimeError)
    monkeypatch.setattr(SpeculativeDecoder, half, real)
    assert tokens[ids[1]] == alone(int4_target, MethodConfig("pld", cost_aware=False), prompts[1], greedy(24))
