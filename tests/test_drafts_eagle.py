"""EAGLE heads (``jointspec.drafts.eagle``): the bound head's cache bookkeeping (chains, trees, crops, growing a tree),
its vocabulary trim, losslessness with every drafter that uses it, and artifacts that reload exactly and refuse the
wrong target. Training is tested in test_train_heads.py, ``hybrid`` in test_drafters_hybrid.py, ``default`` in
test_methods_default.py.

Greedy equivalence here is exact by construction (a draft token is kept only when it is the target's argmax), so
those tests have no false-failure odds; the rest compares logits of deterministic computations.
"""

from __future__ import annotations

import copy

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.draft import chain_parents
from jointspec.core.errors import ModelLoadError, UnsupportedOptionError
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.beam import beam_search
from jointspec.drafters.treecache import DraftTreeCache
from jointspec.drafts.eagle import EagleHead, HeadDraftModel, bind_head, load_head

from helpers import (
    VOCAB,
    assert_artifact_round_trip,
    assert_greedy_equivalent,
    assert_loads_to_the_same_decoding,
    fixed_length_decoder,
    fp16_rounded,
    random_prompt,
    steady_tree_costs,
    tiny_llama,
    untrained_head,
)


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
    for path in ([0, 2], [0, 3], [1, 4]):  # to leaves 2, 3 and 4
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
    # A level fed on its own and the whole tree fed again are products of other row counts, which some CPUs' BLAS
    # sum in other orders: equal up to rounding, as the logits in the test above.
    torch.testing.assert_close(extended.beam_log_joint, refed.beam_log_joint, rtol=1e-4, atol=1e-4)
    # Context, then levels of 3: 3 + 3 nodes once, against 3 + (3 + 3) with the whole tree fed again.
    assert sum(fed_once) == len(context) + 6 and sum(fed_again) == len(context) + 9


def test_vocab_trim_never_drafts_outside_the_draft_vocabulary(target_model):
    head = untrained_head(CausalLM(target_model), draft_vocab_size=20)
    context = random_prompt(6)
    logits = primed(target_model, head, context).forward(context).logits
    allowed = torch.zeros(VOCAB, dtype=torch.bool, device=logits.device)
    allowed[head.draft_vocab.to(logits.device)] = True
    assert torch.isinf(logits[:, ~allowed]).all() and torch.isfinite(logits[:, allowed]).all()


def window_reference(draft: HeadDraftModel, tokens: list[int], entries: list[int], rows: int = 1) -> torch.Tensor:
    """The bound head's logits after the last ``rows`` of ``entries`` (entry p holding ``tokens[p]``) fed without a
    cache as one unbroken sequence (positions 0, 1, ...): each with the target's true feature of the position before
    it where the target has scored that position, else this reference's own prediction at the entry before."""
    head, known = draft.head, draft.known_features()
    features, outputs = [], []
    with torch.inference_mode():
        for i, p in enumerate(entries):
            if p == 0:
                feature = torch.zeros(head.config.hidden_size, dtype=draft.dtype)
            elif p - 1 < known:
                feature = head.fuse(draft.mirror.features[p - 1].to(draft.dtype))
            else:
                assert i and entries[i - 1] == p - 1, "a predicted feature is the entry before's"
                feature = outputs[-1]
            features.append(feature)
            embeds = draft.embed(torch.tensor([tokens[q] for q in entries[:i + 1]]))[None].to(draft.dtype)
            outputs.append(head(torch.stack(features)[None], embeds, position_ids=torch.arange(i + 1)[None])[0, -1])
        return draft._logits(torch.stack(outputs[-rows:]))


def test_a_long_chain_keeps_the_sinks_and_the_window_as_one_sequence(target_model):
    """Deterministic (no false failures): the same operations up to the lean forward's float rounding."""
    from jointspec.drafts.eagle import HEAD_SINK_ENTRIES as S

    head = untrained_head(CausalLM(target_model))
    context = random_prompt(6, length=60)
    draft = primed(target_model, head, context[:40] + [0])  # the target has scored context[:40]
    draft.window = 8
    sinks = list(range(S))

    def check(logits, tokens, entries):
        torch.testing.assert_close(logits, window_reference(draft, tokens, entries, len(logits)), rtol=1e-4,
                                   atol=1e-4)

    check(draft.forward(context[:40], num_logits=1).logits, context, sinks + list(range(32, 40)))
    assert (draft.num_cached, draft.skipped, draft.cache.get_seq_length()) == (40, 40 - 8 - S, S + 8)
    with pytest.raises(ValueError, match="extend_tree needs the tree fed last"):  # (it was not fed whole)
        draft.extend_tree(context[:40] + [7], chain_parents(40) + [39], num_logits=1)
    # A tree after the window: each branch's rows as that branch fed alone as a chain.
    tree = draft.forward([7, 8, 9], parents=[-1, -1, 0]).logits
    branch = primed(target_model, head, context[:40] + [0])
    branch.window = 8
    branch.forward(context[:40], num_logits=1)
    torch.testing.assert_close(tree[[0, 2]], branch.forward([7, 9]).logits, rtol=1e-4, atol=1e-4)
    # Decoding on: a draft's second row reads the head's own prediction at its first.
    draft.crop(40)
    check(draft.forward([7, 9], num_logits=2).logits, context[:40] + [7, 9], sinks + list(range(32, 42)))
    assert draft.num_cached == 42 and draft.num_exact == 41
    # Back into the skipped entries: the sinks stay and the next chain follows them.
    draft.crop(20)
    assert (draft.num_cached, draft.skipped, draft.cache.get_seq_length()) == (20, 20 - S, S)
    check(draft.forward(context[20:23], num_logits=1).logits, context, sinks + [20, 21, 22])
    # A second long chain (the target read on): the window moves, the sinks stay.
    draft.target.forward(context[40:60], num_logits=0)
    check(draft.forward(context[23:60], num_logits=1).logits, context, sinks + list(range(52, 60)))
    assert (draft.skipped, draft.cache.get_seq_length()) == (60 - 8 - S, S + 8)
    # Into the skipped entries again, the target cut back too: the next drafts read the predictions made after it.
    draft.crop(30)
    draft.target.crop(32)
    check(draft.forward(context[30:34], num_logits=2).logits, context, sinks + [30, 31, 32, 33])
    # Into the sinks: an ordinary cache again.
    draft.crop(2)
    assert (draft.num_cached, draft.skipped, draft.cache.get_seq_length()) == (2, 0, 2)
    check(draft.forward(context[2:9], num_logits=1).logits, context, list(range(9)))
    # A chain whose rows are all read, whose window would start on a draft token, or whose sinks hold one: fed whole.
    whole = primed(target_model, head, context[:40] + [0])
    whole.window = 8
    assert whole.forward(context[:40]).logits.shape[0] == 40 and whole.skipped == 0
    guessed = primed(target_model, head, context[:10])  # the target has scored 9 tokens: the rest are drafts
    guessed.window = 8
    guessed.forward(context[:40], num_logits=1)
    assert guessed.skipped == 0 and guessed.cache.get_seq_length() == 40
    early = primed(target_model, head, context[:3])  # the fourth sink's input is a prediction
    early.window = 8
    early.forward(context[:4], num_logits=1)
    early.target.forward(context[2:40], num_logits=0)
    early.forward(context[4:40], num_logits=1)
    assert early.skipped == 0 and early.num_exact == 3 and early.cache.get_seq_length() == 40


@pytest.mark.parametrize("method,config", [("hybrid", {"num_draft_tokens": 3}), ("sps", {"num_draft_tokens": 4}),
                                           ("hybrid-tree", {"tree": (2, 2)}), ("specinfer", {"tree": (3, 2, 1)}),
                                           ("mtad", {"num_draft_tokens": 3, "beam_width": 2})])
def test_greedy_equivalence_with_a_head_windowed_on_a_long_prompt(target_model, trained_head_dir, monkeypatch,
                                                                  method, config):
    """A prompt past the head's window (shrunk to 8) is drafted from its sinks and window; exact by construction."""
    monkeypatch.setattr(HeadDraftModel, "window", 8)
    steady_tree_costs(monkeypatch)
    skips = []
    skip = HeadDraftModel._skip_to_window
    monkeypatch.setattr(HeadDraftModel, "_skip_to_window", lambda self, ids: skips.append(skip(self, ids)) or skips[-1])
    decoder = fixed_length_decoder(target_model, method, trained_head_dir, **config)
    assert_greedy_equivalent(target_model, decoder, random_prompt(3, length=30))
    assert any(skips)  # the window was used


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
def test_greedy_equivalence_with_a_head(target_model, trained_head_dir, tmp_path, monkeypatch, trained, method,
                                        config, prompt_seed):
    """Untrained (drafts mostly rejected) and trained (mostly accepted) heads, chain, tree and beam drafters."""
    if method == "hybrid-tree":
        steady_tree_costs(monkeypatch)
    folder = trained_head_dir
    if not trained:
        folder = tmp_path / "untrained"
        untrained_head(CausalLM(target_model), draft_vocab_size=40).save(folder)
    assert_greedy_equivalent(target_model, fixed_length_decoder(target_model, method, folder, **config),
                             random_prompt(prompt_seed), drafts_kept=None if trained else False)


def test_artifact_reloads_to_identical_outputs(target_model, trained_head_dir, tmp_path):
    head, training = load_head(trained_head_dir)
    assert training["best"]["agreement"][0] > 0.3
    assert_loads_to_the_same_decoding(target_model, trained_head_dir, random_prompt(0))
    # fp16 storage: the reloaded head holds the in-memory head's weights rounded to float16, bit for bit (its draft
    # vocabulary too), and bound to the target it drafts exactly what that rounded in-memory head drafts.
    original = untrained_head(CausalLM(target_model), seed=5, draft_vocab_size=40)
    assert_artifact_round_trip(original, tmp_path / "head", load_head)
    context = random_prompt(4)
    target = CausalLM(target_model, name="tiny-target")
    reloaded = bind_head(tmp_path / "head", target)
    target.reset()
    target.forward(context[:-1], num_logits=0)
    drafted = reloaded.forward(context + [5, 6]).logits
    rounded = primed(target_model, fp16_rounded(original), context).forward(context + [5, 6]).logits
    assert torch.equal(drafted, rounded)
    # The comparison sees float16 rounding: the unrounded head drafts other logits.
    assert not torch.equal(drafted, primed(target_model, original, context).forward(context + [5, 6]).logits)


def test_head_refuses_another_target(trained_head_dir):
    other = CausalLM(tiny_llama(7), name="another-target")
    with pytest.raises(ModelLoadError, match="trained for target 'tiny-target'.*train-draft"):
        bind_head(trained_head_dir, other)


def test_head_binds_to_the_bf16_copy_of_its_target_and_not_to_another(trained_head_dir, target_model):
    # CUDA runs targets in bf16 by default: their exact fingerprint differs from the fp32 model's the head was
    # trained for, the fingerprint of the weights rounded to bf16 does not.
    from jointspec.drafts.artifact import target_fingerprint

    half = CausalLM(copy.deepcopy(target_model).to(torch.bfloat16), name="tiny-target-bf16")
    assert target_fingerprint(half) != target_fingerprint(CausalLM(target_model))
    assert bind_head(trained_head_dir, half).head.fc.weight.device == half.device
    other = CausalLM(tiny_llama(7).to(torch.bfloat16), name="another-target-bf16")
    with pytest.raises(ModelLoadError, match="trained for target 'tiny-target'"):
        bind_head(trained_head_dir, other)


def test_unreadable_artifact_is_a_clear_error(tmp_path):
    (tmp_path / "draft.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable jointspec draft head"):
        load_head(tmp_path)
