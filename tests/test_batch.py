"""Batched decoding equals decoding each sequence alone.

The reference for every sequence is :class:`jointspec.core.loop.SpeculativeDecoder` run on it alone with the same
settings
and seed: with ``ar`` for greedy runs (greedy output does not depend on the drafter, and the single loop's own tests
show every lossless method matches ``ar``), with the same method for sampled runs. Settings, and why:
- 16 prompts of 1 to 29 tokens, some repetitive (so prompt lookup finds drafts) and some random;
- ``max_new_tokens=20`` gives ``ar`` 20 rounds and the draft methods several rounds of 4-token drafts, and 20 is not
  a multiple of 5 so the length limit falls inside a draft;
- end-of-sequence ids {2, 7}: the tiny target emits one of them in several of the 16 continuations, so rows leave
  early, some in the middle of an accepted draft;
- ``max_batch_size`` 1, 3, 8 and 16 with 16 requests: below 16, finished rows leave and waiting ones join
  mid-run (continuous batching), so rows of very different cache lengths share rounds;
- ``sps`` with the target as its own draft accepts everything (long drafts, fast-growing rows) and with an unrelated
  random draft accepts almost nothing (holes every round; the cache compacts).

Float caveat: a padded, masked batch forward multiplies different shapes than an unpadded one, so fp32 logits differ
by up to ~5e-7 here (measured on 16 rows). A greedy token flips only if the target's top two logits are closer than
that. conftest's lm_head x 8 makes the measured top-2 gaps (320 decode steps) at least 1.5e-3, with about 1.3 gaps per
unit of logit near zero, so a flip has odds of ~1e-6 per token. The tests are deterministic (fixed models, prompts and
seeds): they either pass or fail on a given CPU/BLAS build, and the odds that some build hits a near-tie in one of
the ~5,000 compared tokens are ~0.5%. Sampled runs compare multinomial draws, which move only if a cumulative
probability boundary falls within ~1e-7 of the uniform draw: negligible by comparison. (Sharpening further would
not help: the logit noise scales with lm_head just as the gaps do.)

The module runs torch on one thread: tiny matmuls gain nothing from intra-op threads, and on a shared CPU the
hand-offs cost milliseconds per attention call (6 s instead of 80 s for this file).
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch.cache import RaggedCache
from jointspec.batch.engine import BatchEngine, BatchRequest
from jointspec.core.draft import EMPTY_DRAFT
from jointspec.core.errors import ContextTooLongError, UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.methods import registry as method_registry
from jointspec.verifiers.greedy import GreedyVerifier

from helpers import BATCH_EOS as EOS
from helpers import BATCH_GREEDY as GREEDY
from helpers import BATCH_METHODS as METHODS
from helpers import BATCH_PROMPTS as PROMPTS
from helpers import BATCH_SAMPLED as SAMPLED


@pytest.fixture(scope="module")
def load_draft(other_model):
    return lambda source: (CausalLM(other_model, name="tiny-other"), None)


@pytest.fixture(scope="module")
def references(target_model, load_draft):
    """Each prompt decoded alone by the single-sequence loop, computed once per (method, config)."""
    memo: dict = {}

    def get(method: str, config: DecodeConfig, index: int) -> list[int]:
        if config.sampling.greedy:
            method = "ar"  # greedy output does not depend on the drafter: one reference serves every method
        key = (method, config, index)
        if key not in memo:
            target = CausalLM(target_model)
            drafter, verifier = build_method(MethodContext(METHODS[method], target, None, load_draft))
            generator = torch.Generator().manual_seed(index)
            memo[key] = SpeculativeDecoder(target, drafter, verifier).generate(PROMPTS[index], config, generator)
        return memo[key]

    return get


def engine(target_model, load_draft, max_batch_size: int) -> BatchEngine:
    return BatchEngine(CausalLM(target_model), max_batch_size=max_batch_size, load_draft=load_draft)


@pytest.mark.parametrize("method", ["ar", "pld", "sps-self", "sps-other"])
@pytest.mark.parametrize("batch_size", [1, 3, 8, 16])
def test_batched_greedy_equals_single(method, batch_size, target_model, load_draft, references):
    indices = range(4) if batch_size == 1 else range(16)  # batch size 1 is the single loop again: keep it short
    eng = engine(target_model, load_draft, batch_size)
    outs = eng.generate([BatchRequest(PROMPTS[i], GREEDY, METHODS[method], seed=i) for i in indices])
    for i, out in zip(indices, outs):
        assert out == references(method, GREEDY, i), f"prompt {i} ({len(PROMPTS[i])} tokens)"
    assert eng.cache.num_rows == 0 and not eng.has_work
    # Tokens per round = 1 + accepted / rounds, also where an EOS ended a round inside its accepted draft.
    assert eng.stats.num_new_tokens == eng.stats.num_rounds + eng.stats.num_accepted_tokens


def test_rows_leave_early_and_the_limit_falls_inside_drafts(target_model, load_draft, references):
    """Guards the equivalence test's premises: some rows stop on EOS, some stop mid-draft at the length limit."""
    outs = [references("sps-self", GREEDY, i) for i in range(16)]
    assert any(out[-1] in EOS for out in outs)
    assert any(len(out) == 20 for out in outs)


@pytest.mark.parametrize("method", ["pld", "sps-other"])
def test_batched_sampling_equals_single_with_the_same_seeds(method, target_model, load_draft, references):
    indices = range(8)
    outs = engine(target_model, load_draft, 8).generate(
        [BatchRequest(PROMPTS[i], SAMPLED, METHODS[method], seed=i) for i in indices])
    for i, out in zip(indices, outs):
        assert out == references(method, SAMPLED, i)


def test_mixed_methods_and_settings_share_one_batch(target_model, load_draft, references):
    plan = [(i, ["ar", "pld", "sps-self", "sps-other"][i % 4], GREEDY if i % 3 else SAMPLED) for i in range(12)]
    plan = [(i, m, c) for i, m, c in plan if c is GREEDY or m in ("pld", "sps-other")]
    outs = engine(target_model, load_draft, 16).generate(
        [BatchRequest(PROMPTS[i], c, METHODS[m], seed=i) for i, m, c in plan])
    for (i, m, c), out in zip(plan, outs):
        assert out == references(m, c, i), (i, m)


def test_join_and_cancel_mid_run(target_model, load_draft, references):
    eng = engine(target_model, load_draft, 4)
    first = {eng.submit(BatchRequest(PROMPTS[i], GREEDY, METHODS["pld"], seed=i)): i for i in range(3)}
    out: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    late: dict[int, int] = {}
    victim = None
    for round_index in range(200):
        if round_index == 3:  # newcomers join rows that already hold prompt + several rounds
            late = {eng.submit(BatchRequest(PROMPTS[i], GREEDY, METHODS["sps-other"], seed=i)): i
                    for i in range(8, 12)}
            victim = next(iter(late))
        if round_index == 6:
            eng.cancel(victim)
        for event in eng.step():
            out.setdefault(event.seq_id, []).extend(event.token_ids)
            if event.finish_reason:
                finish[event.seq_id] = event.finish_reason
        if not eng.has_work:
            break
    assert finish[victim] == "cancelled"
    for seq_id, i in first.items():
        assert out[seq_id] == references("pld", GREEDY, i)
    for seq_id, i in late.items():
        if seq_id != victim:
            assert out[seq_id] == references("sps-other", GREEDY, i)
    assert eng.cache.num_rows == 0


def test_compaction_keeps_logits(target_model):
    """A cache full of holes scores the next token like its compacted self."""
    cache = RaggedCache(CausalLM(target_model))
    cache.add(0, PROMPTS[5])
    cache.add(1, PROMPTS[3])
    cache.forward([[5, 6, 7, 8], [9]])
    cache.truncate([len(PROMPTS[5]) + 1, len(PROMPTS[3]) + 1])  # row 0 rejects 3 slots, row 1 has 3 dummies
    before = cache.num_slots
    holes = RaggedCache(CausalLM(target_model))
    holes.cache, holes.valid, holes.row_ids = cache.cache, cache.valid.clone(), list(cache.row_ids)
    cache.compact()
    assert cache.num_slots < before and bool(cache.valid.all(dim=1).any())
    torch.testing.assert_close(cache.forward([[11], [12]]), holes.forward([[11], [12]]), atol=1e-5, rtol=1e-5)


def test_prompt_too_long_and_unbatchable_methods_are_refused(target_model, load_draft, monkeypatch):
    eng = engine(target_model, load_draft, 4)
    with pytest.raises(ContextTooLongError):
        eng.submit(BatchRequest([5] * 256, GREEDY))
    with pytest.raises(UnsupportedOptionError, match="unknown method"):
        eng.submit(BatchRequest([5], GREEDY, MethodConfig("no-such-method")))

    class OneShotDrafter:  # a drafter type the batched engine has never heard of
        def start(self, prompt_ids): pass
        def propose(self, context_ids, max_num_draft_tokens, sampling, generator): return EMPTY_DRAFT
        def commit(self, context_ids, num_accepted): pass

    monkeypatch.setitem(method_registry._METHODS, "test-unbatchable", method_registry.MethodEntry(
        lambda context: (OneShotDrafter(), GreedyVerifier()), "test only", lossless=True, cost_aware=False))
    with pytest.raises(UnsupportedOptionError, match="cannot run batched"):
        eng.submit(BatchRequest([5], GREEDY, MethodConfig("test-unbatchable")))
    assert not eng.has_work


def test_a_dynamic_tree_with_sampling_is_refused_at_submit(target_model, load_draft):
    """`generate` refuses --tree-budget with sampling before decoding; the batched engines did only once the
    drafter ran, after a streamed answer's first tokens were out. Both engines share this check."""
    from jointspec.core.sampling import SamplingConfig

    eng = engine(target_model, load_draft, 4)
    sampled = DecodeConfig(8, SamplingConfig(0.8))
    with pytest.raises(UnsupportedOptionError, match="--tree-budget drafts for greedy decoding only"):
        eng.submit(BatchRequest([5, 6], sampled, MethodConfig("hybrid-tree", tree_budget=6)))
    assert not eng.has_work
    eng.check(BatchRequest([5, 6], GREEDY, MethodConfig("pld", tree_budget=6)))  # a method without a dynamic tree


def test_a_head_method_refused_leaves_no_feature_mirror_on_the_target(target_model, load_draft, tmp_path):
    """Binding a trained head attaches a feature mirror to the target; where the ragged engine then refuses the
    method, that mirror went with it no more, one more per request, each filled by every later forward."""
    from helpers import untrained_head

    eng = engine(target_model, load_draft, 4)
    untrained_head(eng.target).save(tmp_path / "head")
    before = len(eng.target.mirrors)
    for _ in range(3):
        with pytest.raises(UnsupportedOptionError):
            eng.submit(BatchRequest([5, 6], GREEDY, MethodConfig("sps", draft=str(tmp_path / "head"))))
    assert len(eng.target.mirrors) == before


def test_corpus_lookup_runs_batched_and_shares_its_table(target_model, load_draft, references, tmp_path):
    """`corpus` batches like `pld`: each row drafts from one shared n-gram table (not a copy per request), greedy
    output equals each prompt decoded alone, and drafts from the table are accepted (a table built from the target's
    own answers). Deterministic."""
    from jointspec.drafters.corpus import NgramTable

    answers = [references("ar", GREEDY, i) for i in range(16)]
    NgramTable.build([PROMPTS[i] + answers[i] for i in range(16)], vocab_size=target_model.config.vocab_size,
                     min_count=1).save(tmp_path, {"kind": "corpus"})
    method = MethodConfig("corpus", draft=str(tmp_path), num_draft_tokens=4)
    eng = engine(target_model, load_draft, 8)
    outs = eng.generate([BatchRequest(PROMPTS[i], GREEDY, method, seed=i) for i in range(16)])
    assert outs == answers
    assert eng.stats.num_accepted_tokens > 0
    eng.submit(BatchRequest(PROMPTS[0], GREEDY, method))
    eng.submit(BatchRequest(PROMPTS[1], GREEDY, method))
    eng.step()
    drafters = eng.method(method).drafter.drafters.values()
    assert len(drafters) == 2 and len({id(drafter.table) for drafter in drafters}) == 1


def test_the_engine_keeps_a_bounded_number_of_built_methods(target_model, load_draft):
    # A server's requests may each name their own options: the engine keeps the most recently used methods only.
    from jointspec.batch.engine import MAX_BUILT_METHODS

    eng = engine(target_model, load_draft, 4)
    configs = [MethodConfig("pld", num_draft_tokens=4, accept_threshold=1.0 + i) for i in range(MAX_BUILT_METHODS + 6)]
    for config in configs:
        eng.method(config)
    assert len(eng._methods) == MAX_BUILT_METHODS
    assert configs[0] not in eng._methods and configs[-1] in eng._methods
