"""``default``, what `jointspec generate` runs (methods/default.py and methods/tree_width.py): the head shipped for
the target and its tree where the measured cost curve says the tree pays, else cost-aware lookup from the table shipped
for the tokenizer or from the prompt; the tree's width from the cost curve and the head's own measured hit rates.

Greedy equivalence is exact by construction; the rest is arithmetic on given curves and rates. Deterministic: no
false-failure odds.
"""

from __future__ import annotations

import pytest

from jointspec.backends.hf import CausalLM
from jointspec.core.loop import SpeculativeDecoder
from jointspec.drafters.corpus import CorpusLookupDrafter, NgramTable, tokenizer_fingerprint
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import VOCAB, FakeTokenizer, decoder_for, greedy, hf_greedy, random_prompt, tiny_llama


def test_default_method_uses_the_shipped_head_for_its_target(target_model, trained_head_dir, monkeypatch):
    from jointspec.drafters.costaware import CostAwareDrafter
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.drafts import artifact
    from jointspec.methods import default as default_policy
    from jointspec.methods import tree_width

    shipped = trained_head_dir.parent / "shipped"
    shipped.mkdir(exist_ok=True)
    monkeypatch.setattr(artifact, "SHIPPED_HEADS", shipped)
    without = build_method(MethodContext(MethodConfig(name="default"), CausalLM(target_model), None, None))[0]
    assert isinstance(without, CostAwareDrafter) and isinstance(without.inner, PromptLookupDrafter)
    import shutil
    shutil.copytree(trained_head_dir, shipped / "tiny-head", ignore=shutil.ignore_patterns("checkpoint.pt"))
    # See test_default_tree_width.
    monkeypatch.setattr(tree_width, "default_tree_width", lambda curve, draft_cost, hit_rate: 2)
    # Where the head's tree is expected to pay (the tiny model's own timings would decide otherwise at random):
    monkeypatch.setattr(default_policy, "expected_tree_gain",
                        lambda curve, draft_cost, hit_rate: default_policy.MIN_TREE_GAIN)
    decoder = decoder_for(target_model, "default", None)
    assert isinstance(decoder.drafter, LookupOrTreeDrafter) and decoder.drafter.tree.branching == (2,)
    prompt = random_prompt(3)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    # --cost-aware with default: already cost-aware, not wrapped again (a wrapper would refuse its trees).
    aware = decoder_for(target_model, "default", None, cost_aware=True)
    assert isinstance(aware.drafter, LookupOrTreeDrafter)
    assert aware.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    # Another target has no shipped head: prompt lookup.
    other = build_method(MethodContext(MethodConfig(name="default"), CausalLM(tiny_llama(7)), None, None))[0]
    assert isinstance(other.inner, PromptLookupDrafter)


def test_default_heads_tree_drafts_its_lookup_half_from_a_shipped_table(target_model, trained_head_dir, monkeypatch,
                                                                          tmp_path):
    """Where a table is shipped for the tokenizer, the float32 `default` (lookup, else the head's tree) looks up as
    `corpus` does; still equal to plain greedy decoding, drafts from the table accepted."""
    import shutil

    from jointspec.drafters import corpus
    from jointspec.drafters.corpus import CorpusLookupDrafter, NgramTable, tokenizer_fingerprint
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafts import artifact
    from jointspec.methods import default as default_policy

    shipped = tmp_path / "heads"
    shutil.copytree(trained_head_dir, shipped / "tiny-head", ignore=shutil.ignore_patterns("checkpoint.pt"))
    monkeypatch.setattr(artifact, "SHIPPED_HEADS", shipped)
    monkeypatch.setattr(default_policy, "expected_tree_gain",
                        lambda curve, draft_cost, hit_rate: default_policy.MIN_TREE_GAIN)
    prompts = [random_prompt(seed) for seed in (3, 4)]
    answers = [hf_greedy(target_model, prompt, 40) for prompt in prompts]
    tokenizer = FakeTokenizer({f"t{i}": i for i in range(VOCAB)})
    tokenizer.eos_token_id = None
    NgramTable.build(answers, vocab_size=VOCAB, min_count=1).save(  # the target's own answers: drafts that pass
        tmp_path / "tables" / "tiny", {"kind": "corpus", "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)})
    monkeypatch.setattr(corpus, "SHIPPED_TABLES", tmp_path / "tables")
    target = CausalLM(target_model, name="tiny-target")
    drafter, verifier = build_method(MethodContext(MethodConfig(name="default"), target, tokenizer, None))
    assert isinstance(drafter, LookupOrTreeDrafter) and isinstance(drafter.lookup.inner, CorpusLookupDrafter)
    decoder = SpeculativeDecoder(target, drafter, verifier)
    for prompt, answer in zip(prompts, answers):
        assert decoder.generate(prompt, greedy(40)) == answer
        assert drafter.num_lookup_rounds > 0 and decoder.stats.num_accepted_tokens > 0


def test_default_drafts_by_lookup_alone_where_the_heads_tree_would_not_pay(target_model, trained_head_dir,
                                                                           monkeypatch):
    from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.drafts import artifact
    from jointspec.methods import default as default_policy
    from jointspec.methods import tree_width

    shipped = trained_head_dir.parent / "shipped-dear"
    shipped.mkdir(exist_ok=True)
    import shutil
    shutil.copytree(trained_head_dir, shipped / "tiny-head", ignore=shutil.ignore_patterns("checkpoint.pt"),
                    dirs_exist_ok=True)
    monkeypatch.setattr(artifact, "SHIPPED_HEADS", shipped)
    estimate = tree_width.expected_tree_gain
    monkeypatch.setattr(default_policy, "expected_tree_gain",
                        lambda curve, draft_cost, hit_rate: default_policy.MIN_TREE_GAIN - 0.01)
    target = CausalLM(target_model, name="tiny-target")
    drafter, _ = build_method(MethodContext(MethodConfig(name="default"), target, None, None))
    assert isinstance(drafter, CostAwareDrafter) and isinstance(drafter.inner, PromptLookupDrafter)
    assert target.mirrors == []  # the unused head's feature mirror is gone: forwards stop recording for it
    # A tree, or a draft, asked for is kept whatever the estimate.
    asked, _ = build_method(MethodContext(MethodConfig(name="default", tree=(2,)), target, None, None))
    assert hasattr(asked, "tree") and asked.tree.branching == (2,)
    named, _ = build_method(MethodContext(MethodConfig(name="default", draft=str(shipped / "tiny-head")), target,
                                          None, None))
    assert hasattr(named, "tree")
    # The estimate itself: the int4 SmolLM2's measured curve (ms) and head call, against float32's.
    int4 = CostCurve({1: 11.2, 2: 12.6, 4: 15.3, 6: 18.1})
    fp32 = CostCurve({1: 30.8, 2: 31.5, 3: 33.9, 4: 46.1})
    assert estimate(int4, 1.74) < default_policy.MIN_TREE_GAIN < estimate(fp32, 1.74)


def test_default_tree_width_follows_the_cost_curve():
    from jointspec.drafters.costaware import CostCurve
    from jointspec.methods.tree_width import default_tree_width

    # The AMD machine's oneDNN kernels: a 4-token forward costs about a step, so the widest tree pays.
    assert default_tree_width(CostCurve({1: 1.0, 2: 1.04, 3: 1.18, 4: 1.03, 5: 1.72}), 0.1) == 3
    # The Intel Xeon's stock kernels: 4 tokens cost 1.57 steps, 3 tokens 1.21 (measured: width 2 ran fastest).
    assert default_tree_width(CostCurve({1: 1.0, 2: 1.13, 3: 1.21, 4: 1.57, 5: 1.60}), 0.1) == 2
    # Every extra token dear: one candidate.
    assert default_tree_width(CostCurve({1: 1.0, 2: 1.1, 3: 1.9, 4: 2.8}), 0.1) == 1


def test_a_heads_own_measured_hit_rates_choose_its_tree_width(trained_head_dir, tmp_path):
    """`hybrid-tree` / `default` read P(target's token in the draft's top w) from the head's draft.json; a head that
    records none, or records nonsense, gets the prior. On this curve the prior picks w = 2 and these rates w = 3."""
    import json
    import shutil

    from jointspec.drafters.costaware import CostCurve
    from jointspec.methods.tree_width import PRIOR_TOP_W_HIT_RATE, default_tree_width, top_w_hit_rate

    curve = CostCurve({1: 1.0, 2: 1.13, 3: 1.21, 4: 1.57, 5: 1.60})
    assert top_w_hit_rate(str(trained_head_dir)) == PRIOR_TOP_W_HIT_RATE  # trained here: nothing measured yet
    assert default_tree_width(curve, 0.1, PRIOR_TOP_W_HIT_RATE) == 2
    measured = tmp_path / "measured"
    shutil.copytree(trained_head_dir, measured, ignore=shutil.ignore_patterns("checkpoint.pt"))
    meta = json.loads((measured / "draft.json").read_text())
    meta["measured"] = {"top_w_hit_rate": {"1": 0.1, "2": 0.2, "3": 0.95}}
    (measured / "draft.json").write_text(json.dumps(meta))
    rates = top_w_hit_rate(str(measured))
    assert rates == {1: 0.1, 2: 0.2, 3: 0.95} and default_tree_width(curve, 0.1, rates) == 3
    meta["measured"] = {"top_w_hit_rate": {"1": 1.5}}  # not a probability: ignored
    (measured / "draft.json").write_text(json.dumps(meta))
    assert top_w_hit_rate(str(measured)) == PRIOR_TOP_W_HIT_RATE


def test_the_shipped_head_records_its_hit_rates():
    from jointspec.drafts.artifact import SHIPPED_HEADS, measured_top_w_hit_rate

    rates = measured_top_w_hit_rate(SHIPPED_HEADS / "smollm2-135m-instruct-eagle")
    assert rates is not None and set(rates) == {1, 2, 3} and rates[1] < rates[2] < rates[3]


def test_default_drafts_with_the_table_shipped_for_the_tokenizer(tmp_path, monkeypatch, target_model):
    import jointspec.drafters.corpus as corpus
    from jointspec.backends.hf import CausalLM
    from jointspec.drafters.costaware import CostAwareDrafter
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.methods import MethodConfig, MethodContext, build_method

    mine = FakeTokenizer({f"t{i}": i for i in range(VOCAB)})
    NgramTable.build([[1, 2, 3]], vocab_size=VOCAB, min_count=1).save(
        tmp_path / "table", {"kind": "corpus", "tokenizer_fingerprint": tokenizer_fingerprint(mine)})
    monkeypatch.setattr(corpus, "SHIPPED_TABLES", tmp_path)
    target = CausalLM(target_model)  # no head is shipped for this tiny target
    drafter, _ = build_method(MethodContext(MethodConfig(name="default"), target, mine, None))
    assert isinstance(drafter, CostAwareDrafter) and isinstance(drafter.inner, CorpusLookupDrafter)
    other = FakeTokenizer({f"u{i}": i for i in range(VOCAB)})  # no table for this one: prompt lookup
    drafter, _ = build_method(MethodContext(MethodConfig(name="default"), target, other, None))
    assert isinstance(drafter.inner, PromptLookupDrafter)


def test_default_verifies_token_wise_on_a_chain_only_target_whatever_its_config_says(target_model):
    """On a target that scores no trees and exposes no features (llama.cpp's adapter) `default` with a draft runs
    `hybrid`; it copied its whole config there, so a `verify` that reached it (the Python API, a spec) turned on
    block verification on those targets alone, while `default` declares no `verify` and refuses it everywhere else.
    Deterministic: no false failures."""
    import dataclasses

    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.verifiers.block import BlockVerifier

    class ChainOnly(CausalLM):
        @property
        def capabilities(self):
            return dataclasses.replace(super().capabilities, trees=False, features=False)

    def build(verify: str):
        config = dataclasses.replace(MethodConfig(name="default", draft="self"), verify=verify)
        return build_method(MethodContext(config, ChainOnly(target_model, name="chain-only"), None, None))

    assert not isinstance(build("token")[1], BlockVerifier)
    with pytest.raises(UnsupportedOptionError, match="no block verification"):
        build("block")  # refused, as on every other target


@pytest.mark.parametrize("shape", [dict(tree=(2, 2)), dict(tree_budget=6)])
def test_a_tree_shape_default_cannot_draft_is_refused_not_ignored(target_model, shape):
    """--tree and --tree-budget shape `default`'s head tree. On a chain-only target (llama.cpp's) and where no head
    ships for the target, `default` drafts by lookup, and the option was dropped without a word. Deterministic."""
    import dataclasses

    from jointspec.core.errors import UnsupportedOptionError

    class ChainOnly(CausalLM):
        @property
        def capabilities(self):
            return dataclasses.replace(super().capabilities, trees=False, features=False)

    config = MethodConfig(name="default", **shape)
    with pytest.raises(UnsupportedOptionError, match="chains only"):
        build_method(MethodContext(config, ChainOnly(target_model, name="chain-only"), None, None))
    with pytest.raises(UnsupportedOptionError, match="no draft head ships"):  # the tiny model has none
        build_method(MethodContext(config, CausalLM(target_model, name="tiny"), None, None))
