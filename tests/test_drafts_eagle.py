"""Feature-level draft heads: the adapter's cache bookkeeping, losslessness with every drafter that uses it,
training that measurably helps, and artifacts that reload exactly and refuse the wrong target.

Greedy equivalence here is exact by construction (a draft token is kept only when it is the target's argmax), so
those tests have no false-failure odds. The training test is seeded and deterministic on one thread; its margin
(trained acceptance above 0.3 and at least 0.25 above the untrained head's) was set from a run giving 0.44 vs 0.00.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (VOCAB, FakeTokenizer, assert_greedy_equivalent, assert_loads_to_the_same_decoding, decoder_for,
                     greedy, hf_greedy, random_prompt, sps_acceptance, tiny_llama, tiny_training_data,
                     train_cli_argv, untrained_head)
from jointspec.backends.hf import CausalLM
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.core.loop import SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.beam import beam_search
from jointspec.drafters.treecache import DraftTreeCache
from jointspec.drafts.eagle import EagleHead, HeadDraftModel, bind_head, load_head
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.train.heads import HeadTrainConfig, HeadTrainer


@pytest.fixture(scope="module")
def trained_head_dir(tmp_path_factory, target_model):
    """A head trained for the tiny target on its own greedy continuations of 48 random prompts."""
    target = CausalLM(target_model, name="tiny-target")
    data = tiny_training_data(tmp_path_factory, target_model)
    out = tmp_path_factory.mktemp("head")
    config = HeadTrainConfig(draft_vocab_size=None, epochs=40, batch_tokens=512, learning_rate=3e-3,
                             warmup_steps=10, eval_every=40, patience=100, eval_fraction=0.1)
    HeadTrainer(target, config).train(data, out, progress=False)
    return out


def primed(target_model, head: EagleHead, context: list[int]) -> HeadDraftModel:
    """A head bound to a target whose cache (and feature mirror) holds ``context`` but its last token."""
    target = CausalLM(target_model, name="tiny-target")
    draft = HeadDraftModel(head, target)
    target.reset()
    target.forward(context[:-1], num_logits=0)
    return draft


def test_chain_forward_in_one_call_equals_token_by_token(target_model):
    head = untrained_head(CausalLM(target_model))
    context = random_prompt(0)
    one_call = primed(target_model, head, context)
    all_rows = one_call.forward(context + [5, 6, 7]).logits  # the last three are draft tokens: predicted inputs
    stepwise = primed(target_model, head, context)
    rows = [stepwise.forward([token]).logits[0] for token in context + [5, 6, 7]]
    torch.testing.assert_close(all_rows, torch.stack(rows), rtol=1e-4, atol=1e-4)
    assert one_call.num_exact == len(context)  # the draft tokens were fed with predicted features


def test_drafting_runs_the_body_through_the_lean_forward_bit_for_bit(target_model):
    """A bound head runs its Llama body through models/fastpath's lean forward: the same operations as transformers'
    LlamaModel, so chain and tree logits are bit for bit the same either way (deterministic: no false failures)."""
    head = untrained_head(CausalLM(target_model))
    context = random_prompt(5)
    lean, stock = primed(target_model, head, context), primed(target_model, head, context)
    assert lean._lean
    stock._lean = False
    for draft in (lean, stock):
        draft.forward(context)
    assert torch.equal(lean.forward([7, 8]).logits, stock.forward([7, 8]).logits)
    for draft in (lean, stock):
        draft.crop(len(context))
    tree = [draft.forward([7, 8, 9, 10], parents=[-1, -1, 0, 1]).logits for draft in (lean, stock)]
    assert torch.equal(*tree)


def test_crop_drops_entries_fed_with_predicted_features(target_model):
    head = untrained_head(CausalLM(target_model))
    context = random_prompt(3)
    draft = primed(target_model, head, context)
    draft.forward(context + [5, 6])
    draft.crop(len(context) + 2)  # asked to keep the draft tokens too...
    assert draft.num_cached == len(context)  # ...but they were fed with guesses, so they will be fed again
    again = draft.forward([5]).logits
    fresh = primed(target_model, head, context)
    torch.testing.assert_close(again, fresh.forward(context + [5]).logits[-1:], rtol=1e-4, atol=1e-4)


def test_tree_rows_equal_each_branch_run_alone(target_model):
    head = untrained_head(CausalLM(target_model))
    context = random_prompt(5)
    tokens, parents = [7, 8, 9, 10, 11], [-1, -1, 0, 0, 1]
    draft = primed(target_model, head, context)
    draft.forward(context)
    tree = draft.forward(tokens, parents=parents).logits
    with pytest.raises(UnsupportedOptionError, match="cannot extend a tree"):
        draft.forward([3])
    for leaf, path in {2: [0, 2], 3: [0, 3], 4: [1, 4]}.items():
        branch = primed(target_model, head, context)
        branch.forward(context)
        rows = branch.forward([tokens[i] for i in path]).logits
        torch.testing.assert_close(tree[path], rows, rtol=1e-4, atol=1e-4)


def test_extend_tree_scores_new_nodes_as_a_fresh_feed_of_the_whole_tree(target_model):
    head = untrained_head(CausalLM(target_model))
    context = random_prompt(7)
    levels = [([7, 8], [-1, -1]), ([9, 10, 11], [0, 0, 1]), ([12, 13], [2, 4])]
    grown = primed(target_model, head, context)
    grown.forward(context)
    tokens, parents = list(levels[0][0]), list(levels[0][1])
    grown.forward(tokens, parents=parents)
    for new_tokens, new_parents in levels[1:]:
        tokens, parents = tokens + new_tokens, parents + new_parents
        extended = grown.extend_tree(tokens, parents, num_logits=len(new_tokens)).logits
        fresh = primed(target_model, head, context)
        fresh.forward(context)
        whole = fresh.forward(tokens, parents=parents, num_logits=len(new_tokens)).logits
        assert torch.equal(extended, whole)  # same nodes, same masks, same kernels: bit-identical
    with pytest.raises(ValueError, match="extend_tree needs the tree fed last"):
        grown.extend_tree([99] + tokens[1:] + [3], parents + [0], num_logits=1)  # not the tree fed last
    grown.crop(len(context))
    with pytest.raises(ValueError, match="extend_tree needs the tree fed last"):
        grown.extend_tree(tokens + [3], parents + [0], num_logits=1)  # the tree was cropped away
    # A one-node level is fed as a chain (no mask); growing it gives the tree's logits up to rounding.
    grown.forward([7])
    extended = grown.extend_tree([7, 8, 9], [-1, 0, 0], num_logits=2).logits
    fresh = primed(target_model, head, context)
    fresh.forward(context)
    torch.testing.assert_close(extended, fresh.forward([7, 8, 9], parents=[-1, 0, 0], num_logits=2).logits,
                               rtol=1e-4, atol=1e-4)


def test_beam_search_on_a_head_feeds_each_level_once_with_unchanged_results(target_model):
    class WithoutExtend:  # the head behind the plain interface: every level crops and feeds the whole tree again
        def __init__(self, draft):
            self.draft = draft

        def __getattr__(self, name):
            if name == "extend_tree":
                raise AttributeError(name)
            return getattr(self.draft, name)

    head = untrained_head(CausalLM(target_model))
    context = random_prompt(8)
    sampling = SamplingConfig(temperature=1.0)
    trees = []
    for wrap in (lambda d: d, WithoutExtend):
        draft = primed(target_model, head, context)
        fed = []
        draft._run = lambda ids, *args, _run=draft._run, _fed=fed: (_fed.append(len(ids)), _run(ids, *args))[1]
        cache = DraftTreeCache(wrap(draft))
        cache.start()
        tree = beam_search(cache, context, 3, 3, sampling, torch.Generator().manual_seed(1))
        trees.append((tree, fed))
    (extended, fed_once), (refed, fed_again) = trees
    assert extended.token_ids == refed.token_ids and extended.parents == refed.parents
    assert torch.equal(extended.beam_log_joint, refed.beam_log_joint)
    # Context, then levels of 3: 3 + 3 nodes once, against 3 + (3 + 3) with the whole tree fed again.
    assert sum(fed_once) == len(context) + 6 and sum(fed_again) == len(context) + 9


def test_vocab_trim_never_drafts_outside_the_draft_vocabulary(target_model):
    head = untrained_head(CausalLM(target_model), draft_vocab_size=20)
    context = random_prompt(6)
    logits = primed(target_model, head, context).forward(context).logits
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[head.draft_vocab] = True
    assert torch.isinf(logits[:, ~allowed]).all() and torch.isfinite(logits[:, allowed]).all()


@pytest.mark.parametrize("trained", [False, True])
@pytest.mark.parametrize("method,config", [("sps", {"num_draft_tokens": 4}), ("sps", {"num_draft_tokens": 7}),
                                           ("sps", {"cost_aware": True, "max_num_draft_tokens": 6}),
                                           ("hybrid", {"num_draft_tokens": 3}),
                                           ("hybrid", {"cost_aware": True, "min_ngram": 2}),
                                           ("hybrid-tree", {"tree": (3,)}),
                                           ("hybrid-tree", {"tree": (2, 2), "min_ngram": 2}),
                                           ("hybrid-tree", {"tree_budget": 4}),
                                           ("specinfer", {"tree": (3, 2, 1)}),
                                           ("mtad", {"num_draft_tokens": 4, "beam_width": 3})])
@pytest.mark.parametrize("prompt_seed", [0, 3])
def test_greedy_equivalence_with_a_head(target_model, trained_head_dir, tmp_path, trained, method, config,
                                        prompt_seed):
    """Untrained (drafts mostly rejected) and trained (mostly accepted) heads, chain, tree and beam drafters."""
    folder = trained_head_dir
    if not trained:
        folder = tmp_path / "untrained"
        untrained_head(CausalLM(target_model), draft_vocab_size=40).save(folder)
    assert_greedy_equivalent(target_model, decoder_for(target_model, method, folder, **config),
                             random_prompt(prompt_seed))


def test_training_raises_acceptance_well_above_the_untrained_head(target_model, trained_head_dir, tmp_path):
    untrained = tmp_path / "untrained"
    untrained_head(CausalLM(target_model)).save(untrained)
    rates = {name: sps_acceptance(target_model, folder)
             for name, folder in {"untrained": untrained, "trained": trained_head_dir}.items()}
    assert rates["trained"] > 0.3 and rates["trained"] > rates["untrained"] + 0.25, rates


def test_artifact_reloads_to_identical_outputs(target_model, trained_head_dir):
    head, training = load_head(trained_head_dir)
    assert training["best"]["agreement"][0] > 0.3
    assert_loads_to_the_same_decoding(target_model, trained_head_dir, random_prompt(0))
    # fp16 storage: the reloaded head drafts what the in-memory head drafts.
    target = CausalLM(target_model)
    reloaded = HeadDraftModel(head, target)
    assert reloaded.vocab_size == VOCAB


def test_head_refuses_another_target(trained_head_dir):
    other = CausalLM(tiny_llama(7), name="another-target")
    with pytest.raises(ModelLoadError, match="trained for target 'tiny-target'.*train-draft"):
        bind_head(trained_head_dir, other)


def test_unreadable_artifact_is_a_clear_error(tmp_path):
    (tmp_path / "draft.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable jointspec draft head"):
        load_head(tmp_path)


def test_cost_aware_wraps_chain_methods_only(target_model, trained_head_dir):
    from jointspec.drafters.costaware import CostAwareDrafter

    decoder = decoder_for(target_model, "sps", trained_head_dir, cost_aware=True, max_num_draft_tokens=6)
    assert isinstance(decoder.drafter, CostAwareDrafter)
    with pytest.raises(UnsupportedOptionError, match="'specinfer' cannot be made cost-aware.*pld, sps"):
        decoder_for(target_model, "specinfer", trained_head_dir, cost_aware=True)


def test_hybrid_uses_lookup_where_text_repeats_and_the_head_elsewhere(target_model, trained_head_dir):
    decoder = decoder_for(target_model, "hybrid", trained_head_dir, num_draft_tokens=4)
    prompt = random_prompt(0)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    # The tiny target's continuation falls into a loop: lookups match there, the head drafts before that.
    assert decoder.drafter.num_lookup_rounds > 0 and decoder.drafter.num_model_rounds > 0


def test_hybrid_tree_uses_lookup_where_text_repeats_and_the_tree_elsewhere(target_model, trained_head_dir):
    decoder = decoder_for(target_model, "hybrid-tree", trained_head_dir, tree=(3,))
    prompt = random_prompt(0)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    drafter = decoder.drafter
    # The tiny target's continuation falls into a loop: lookups pay there, the tree drafts before that.
    assert drafter.num_lookup_rounds > 0 and drafter.num_tree_rounds > 0
    assert drafter.num_lookup_rounds + drafter.num_tree_rounds <= decoder.stats.num_rounds
    assert 0 <= drafter.tree_tokens <= 1  # a width-only tree accepts at most one draft token a round


def test_hybrid_tree_holds_lookup_to_the_trees_rate():
    from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter, tree_round_cost

    curve = CostCurve({1: 1.0, 2: 1.0, 4: 1.1, 5: 1.6})
    assert tree_round_cost(curve, (3,), 0.1) == pytest.approx(1.1 + 0.1)
    assert tree_round_cost(curve, (2, 1), 0.1) == pytest.approx(1.6 + 0.2)  # 2 + 2 nodes (5-token forward), 2 calls

    class FakeTree:
        branching = (3,)

    drafter = LookupOrTreeDrafter(CostAwareDrafter(object(), curve), FakeTree(), curve, draft_cost_per_call=0.1,
                                  prior_tree_tokens=0.65)
    # (1 + 0.65) tokens for 1.2 units: the tree runs 37.5 % faster than plain decoding, so a lookup draft must too.
    assert drafter.tree_gain() == pytest.approx(1.65 / 1.2 - 1)
    weak = LookupOrTreeDrafter(CostAwareDrafter(object(), curve), FakeTree(), curve, draft_cost_per_call=0.1,
                               prior_tree_tokens=0.1)
    assert weak.tree_gain() == 0.0  # a tree slower than plain decoding sets no bar above plain decoding


@pytest.mark.parametrize("dear", [False, True])
def test_hybrid_tree_drafts_no_tree_where_trees_do_not_pay(target_model, tmp_path, dear):
    # On a target whose 4-token forward costs 3.4 steps (llama.cpp-like) a tree cannot pay (at most 2 tokens for 3.5
    # units): the drafter decodes plainly and only probes the tree now and then. Where a 4-token forward and the draft
    # cost nothing extra, any tree pays (1 + accepted > 1), so it drafts one in every round lookup leaves.
    from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.drafters.tree import TreeDrafter
    from jointspec.verifiers.tree import TreeRejectionVerifier

    folder = tmp_path / "untrained"
    untrained_head(CausalLM(target_model), draft_vocab_size=40).save(folder)
    target = CausalLM(target_model, name="tiny-target")
    curve = CostCurve({1: 1.0, 2: 1.8, 4: 3.4, 5: 4.0} if dear else {1: 1.0, 2: 1.0, 4: 1.0, 5: 1.5})
    lookup = CostAwareDrafter(PromptLookupDrafter(4, 3, 3, 4), curve, max_num_draft_tokens=4)  # 3-grams: rare
    drafter = LookupOrTreeDrafter(lookup, TreeDrafter(bind_head(folder, target), (3,)), curve,
                                  draft_cost_per_call=0.1 if dear else 0.0)
    decoder = SpeculativeDecoder(target, drafter, TreeRejectionVerifier(replacement=True))
    prompt = random_prompt(5)
    assert decoder.generate(prompt, greedy(40)) == hf_greedy(target_model, prompt, 40)
    non_lookup_rounds = decoder.stats.num_rounds - drafter.num_lookup_rounds
    if dear:
        assert drafter.tree_speedup() < 1 and drafter.num_tree_rounds <= 6 < non_lookup_rounds  # probes 1, 3, 7, ...
    else:
        assert drafter.num_tree_rounds == non_lookup_rounds


def test_default_method_uses_the_shipped_head_for_its_target(target_model, trained_head_dir, monkeypatch):
    from jointspec.methods import lossless
    from jointspec.methods import default as default_policy
    from jointspec.drafters.costaware import CostAwareDrafter
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.drafts import artifact

    shipped = trained_head_dir.parent / "shipped"
    shipped.mkdir(exist_ok=True)
    monkeypatch.setattr(artifact, "SHIPPED_HEADS", shipped)
    without = build_method(MethodContext(MethodConfig(name="default"), CausalLM(target_model), None, None))[0]
    assert isinstance(without, CostAwareDrafter) and isinstance(without.inner, PromptLookupDrafter)
    import shutil
    shutil.copytree(trained_head_dir, shipped / "tiny-head", ignore=shutil.ignore_patterns("checkpoint.pt"))
    monkeypatch.setattr(lossless, "default_tree_width", lambda curve, draft_cost, hit_rate: 2)  # see test_default_tree_width
    # Where the head's tree is expected to pay (the tiny model's own timings would decide otherwise at random):
    monkeypatch.setattr(default_policy, "expected_tree_gain", lambda curve, draft_cost, hit_rate: default_policy.MIN_TREE_GAIN)
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

    from jointspec.methods import default as default_policy
    from jointspec.drafters import corpus
    from jointspec.drafters.corpus import CorpusLookupDrafter, NgramTable, tokenizer_fingerprint
    from jointspec.drafters.lookup_tree import LookupOrTreeDrafter
    from jointspec.drafts import artifact

    shipped = tmp_path / "heads"
    shutil.copytree(trained_head_dir, shipped / "tiny-head", ignore=shutil.ignore_patterns("checkpoint.pt"))
    monkeypatch.setattr(artifact, "SHIPPED_HEADS", shipped)
    monkeypatch.setattr(default_policy, "expected_tree_gain", lambda curve, draft_cost, hit_rate: default_policy.MIN_TREE_GAIN)
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
    from jointspec.methods import tree_width
    from jointspec.methods import default as default_policy
    from jointspec.drafters.costaware import CostAwareDrafter, CostCurve
    from jointspec.drafters.ngram import PromptLookupDrafter
    from jointspec.drafts import artifact

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


def test_tree_methods_have_their_own_default_tree_and_honour_tree(target_model, trained_head_dir, monkeypatch):
    # hybrid-tree (and default, which builds it) drafts the head's top w (chosen from the target's measured cost
    # curve) unless --tree is given; specinfer 4,2,2.
    from jointspec.methods import costs, lossless

    seen = []
    monkeypatch.setattr(lossless, "default_tree_width", lambda curve, draft_cost, hit_rate: seen.append(curve) or 3)
    assert decoder_for(target_model, "hybrid-tree", trained_head_dir).drafter.tree.branching == (3,)
    assert seen == [costs.target_cost_curve(CausalLM(target_model))]  # the target's own curve, memoised
    assert decoder_for(target_model, "hybrid-tree", trained_head_dir, tree=(2, 1)).drafter.tree.branching == (2, 1)
    assert decoder_for(target_model, "default", trained_head_dir, tree=(2,)).drafter.tree.branching == (2,)
    assert decoder_for(target_model, "specinfer", trained_head_dir).drafter.branching == (4, 2, 2)
    assert decoder_for(target_model, "specinfer", trained_head_dir, tree=(3,)).drafter.branching == (3,)
    with pytest.raises(ValueError, match="tree must be"):
        MethodConfig(name="specinfer", tree=())


def test_train_draft_cli_end_to_end_and_resume(target_model, tmp_path, monkeypatch, capsys):
    """The command trains and saves a head, and a second run with the same options resumes instead of redoing."""
    import json

    from jointspec.cli import main as cli

    base = train_cli_argv(monkeypatch, target_model, tmp_path, "head")
    argv = base + ["--cls-weight", "1.5", "--cls-fraction", "1"]
    assert cli.main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["best"]["agreement"] and summary["size_bytes"] > 0
    head, training = load_head(tmp_path / "head")
    assert head.config.draft_vocab_size == 50 and head.config.target_name == "tiny-target"
    # The artifact says how it was made: the settings, and a command with every training option in it.
    assert training["settings"]["draft_vocab_size"] == 50 and training["settings"]["epochs"] == 3
    assert training["settings"]["cls_weight"] == 1.5 and training["settings"]["cls_fraction"] == 1.0
    assert training["command"].startswith("jointspec train-draft --target default --kind heads")
    assert "--draft-vocab 50" in training["command"] and "--no-progress" not in training["command"]
    assert "--cls-weight 1.5 --cls-fraction 1.0" in training["command"]
    shards = sorted((tmp_path / "head" / "data").glob("shard-*.pt"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    assert cli.main(argv) == 0  # resumes: the data is kept, the finished checkpoint is reused
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    # A head of one kind cannot start another kind: a clear one-line error, before any work.
    assert cli.main(base + ["--head", "hydra", "--init", str(tmp_path / "head")]) == 2
    assert "holds a 'eagle' draft, which cannot start a hydra draft" in capsys.readouterr().err
    for bad, message in (("0", "must be in (0, 1], got 0"), ("1.5", "must be in (0, 1], got 1.5"),
                         ("x", "expected a number, got 'x'")):
        with pytest.raises(SystemExit):
            cli.main(base + ["--cls-fraction", bad])
        assert message in capsys.readouterr().err


def test_feature_mirror_keep_after_growing_in_inference_mode():
    # The target grows its mirror inside a forward (inference mode); tree verification then calls keep() outside
    # it. That used to fail: torch refuses in-place updates of inference tensors outside inference mode.
    from jointspec.backends.hf import FeatureMirror

    mirror = FeatureMirror(4, torch.float32, torch.device("cpu"))
    rows = torch.arange(300 * 4, dtype=torch.float32).reshape(300, 4)
    with torch.inference_mode():
        mirror.append(rows)  # past the initial 256 rows: the buffer is reallocated here
    mirror.keep(torch.tensor([0, 1, 5, 299]))
    assert mirror.length == 4
    assert torch.equal(mirror.features, rows[[0, 1, 5, 299]])
    mirror.append(rows[:2])
    assert torch.equal(mirror.features[4:], rows[:2])


def test_target_argmax_is_kept_in_the_data_folder_and_reused(target_model, tmp_path_factory, tmp_path, monkeypatch):
    """The first from-scratch run keeps the target's argmax in the data folder; later runs (warm starts too) read it
    instead of recomputing, and get the same labels, so they train the same draft."""
    from jointspec.train import heads as heads_module

    data = tiny_training_data(tmp_path_factory, target_model)
    target = CausalLM(target_model, name="tiny-target")
    config = HeadTrainConfig(draft_vocab_size=40, epochs=1, batch_tokens=512, warmup_steps=2, eval_every=5,
                             eval_fraction=0.1)
    first, _ = HeadTrainer(target, config).train(data, tmp_path / "a", progress=False)
    assert (data / heads_module.ARGMAX_FILE).is_file()
    calls = []
    real = heads_module._target_argmax

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(heads_module, "_target_argmax", counted)
    second, _ = HeadTrainer(target, config).train(data, tmp_path / "b", progress=False)
    assert calls == []  # nothing recomputed
    assert torch.equal(first.draft_vocab, second.draft_vocab)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    # A kept file that does not fit the folder is ignored and computed again.
    torch.save([torch.zeros(3, dtype=torch.int32)], data / heads_module.ARGMAX_FILE)
    HeadTrainer(target, config).train(data, tmp_path / "c", progress=False)
    assert calls and len(torch.load(data / heads_module.ARGMAX_FILE)) > 1


def test_a_run_stopped_by_its_time_cap_resumes_under_a_longer_one(target_model, tmp_path_factory, tmp_path):
    """Stopping rules (--max-minutes, --patience) do not change what a step computes, so a run they stopped
    resumes from its checkpoint when given more room, and ends where an uncapped run ends."""
    data = tiny_training_data(tmp_path_factory, target_model)
    target = CausalLM(target_model, name="tiny-target")
    settings = dict(draft_vocab_size=40, epochs=2, batch_tokens=512, warmup_steps=2, eval_every=3, eval_fraction=0.1)
    _, capped = HeadTrainer(target, HeadTrainConfig(**settings, max_minutes=0.0)).train(data, tmp_path / "a",
                                                                                        progress=False)
    assert [h.step for h in capped.history] == [1]  # the cap stops it after its first step
    resumed, result = HeadTrainer(target, HeadTrainConfig(**settings, patience=100)).train(data, tmp_path / "a",
                                                                                           progress=False)
    uncapped, full = HeadTrainer(target, HeadTrainConfig(**settings, patience=100)).train(data, tmp_path / "b",
                                                                                          progress=False)
    assert result.history[0] == capped.history[0]  # kept from the first run: resumed, not restarted
    assert [h.step for h in result.history][-1] == [h.step for h in full.history][-1] > 1
    assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), uncapped.state_dict().values()))


def test_the_held_out_split_follows_content_not_the_pool():
    # A sequence held out of one pool is held out of any larger pool with it (what keeps a warm start on a grown
    # pool from being evaluated on its own training data), and about the asked fraction is held out. The tokens are
    # fixed, so the hash-based split is deterministic: no false failures.
    from jointspec.train.heads import held_out_split

    pool = [torch.arange(i, i + 5 + i % 7) for i in range(400)]
    more = [torch.arange(1000 + i, 1006 + i) for i in range(300)]
    held, kept = held_out_split(pool, 0.1)
    assert sorted(held + kept) == list(range(400)) and 20 <= len(held) <= 60
    grown_held, _ = held_out_split(more[:150] + pool + more[150:], 0.1)
    assert {150 + i for i in held} == {i for i in grown_held if 150 <= i < 550}
    duplicate = held_out_split(pool + [pool[held[0]].clone()], 0.1)[0]
    assert 400 in duplicate  # the same text in another folder: held out as well
    tiny_held, tiny_kept = held_out_split(pool[:2], 0.0)
    assert len(tiny_held) == 1 and len(tiny_kept) == 1  # at least one of each
    assert held_out_split(pool[:2], 1.0)[1]


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
