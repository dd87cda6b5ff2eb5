"""The method registry (``jointspec.methods``): the joint methods build from a ``MethodConfig`` and stay greedy-exact,
cost-aware wrapping applies to chain methods only, and tree methods have their own default trees.

The registered methods are decoded against transformers' own greedy decoding (helpers.hf_greedy). Deterministic
(greedy, fixed seeds): no false-failure odds.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import decoder_for, hf_greedy, random_prompt, tiny_llama

GREEDY = SamplingConfig(0.0)
PROMPT = [1, 17, 42, 5, 88]


def test_methods_are_registered_and_run(target, target_model):
    """The four methods build from MethodConfig (draft = self), stay greedy-exact, and sample without errors."""
    expected = hf_greedy(target_model, PROMPT, 12)
    for name in ("mtad", "mtad-tree", "specinfer", "spectr"):
        # spectr's chains every round (its default drafts them only while they pay on the measured curve)
        config = MethodConfig(name=name, draft="self", num_draft_tokens=3, beam_width=2, tree=(2, 2),
                              cost_aware=False if name == "spectr" else None)
        drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
        decoder = SpeculativeDecoder(CausalLM(target_model), drafter, verifier)
        assert decoder.generate(PROMPT, DecodeConfig(12, GREEDY)) == expected, name
        sampled = decoder.generate(PROMPT, DecodeConfig(12, SamplingConfig(1.0, top_k=10, top_p=0.9)),
                                   torch.Generator().manual_seed(1))
        assert len(sampled) == 12, name
        if name in ("specinfer", "spectr"):  # lossless with draft = target: the first child always passes
            assert decoder.stats.acceptance_per_position[0] == 1.0, name


def test_a_self_draft_costs_a_target_step_and_is_never_drafted_by_cost_aware_sps(target, target_model):
    """A draft over the target's own weights costs what the target's forward does, read from the target's curve (not
    measured apart, where a quieter moment made it look cheaper). Then no chain can beat plain decoding at any
    acceptance, and cost-aware sps drafts nothing, not even probes (each accepted in full, they would double), while
    staying greedy-exact. Deterministic: the draft cost is the curve's own number, whatever the timings."""
    from jointspec.methods.costs import target_cost_curve

    config = MethodConfig(name="sps", draft="self", cost_aware=True, max_num_draft_tokens=8)
    drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
    curve = target_cost_curve(target)
    assert drafter.curve.draft_cost_per_token == curve.cost(1)
    assert drafter.curve.best_gain(8) <= 0
    decoder = SpeculativeDecoder(target, drafter, verifier)
    assert decoder.generate(PROMPT, DecodeConfig(24, GREEDY)) == hf_greedy(target_model, PROMPT, 24)
    assert decoder.stats.num_draft_tokens == 0


def near_target(target_model, scale: float = 2.0):
    """The target with seeded noise (``scale`` times each weight's spread) on its last MLP: a draft that agrees with
    the target often but not always (with 3 candidates, depth 1 passed in 63 to 93 % of the rounds when written)."""
    draft = tiny_llama(0)
    assert torch.equal(draft.lm_head.weight, target_model.lm_head.weight)  # the target's own weights, then noise
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for weight in draft.model.layers[-1].mlp.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator).to(weight.device) * scale * weight.std())
    return draft


@pytest.mark.parametrize("name", ["specinfer", "spectr"])
def test_tree_methods_stay_greedy_exact_with_a_draft_that_is_often_wrong(target_model, name):
    """The self-drafts above never reject, so a verifier that kept the first candidate unchecked would pass them.
    With a draft that differs from the target, some rounds reject every candidate at some depth and others accept:
    the output must still be plain greedy decoding's, token for token."""
    draft_model = near_target(target_model)
    config = MethodConfig(name=name, draft="near", num_draft_tokens=3, beam_width=3, tree=(3, 2),
                          cost_aware=False if name == "spectr" else None)  # every round: see above
    target = CausalLM(target_model, name="tiny-target")
    drafter, verifier = build_method(MethodContext(config, target, None,
                                                   lambda source: (CausalLM(draft_model, name=source), None)))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    for seed in (0, 3, 6):
        prompt = random_prompt(seed)
        assert decoder.generate(prompt, DecodeConfig(40, GREEDY)) == hf_greedy(target_model, prompt, 40), seed
        acceptance = decoder.stats.acceptance_per_position
        assert min(acceptance) < 1.0 and decoder.stats.num_accepted_tokens > 0, acceptance  # rejections and accepts


def test_cost_aware_wraps_chain_methods_only(target_model, trained_head_dir):
    from jointspec.drafters.costaware import CostAwareDrafter

    decoder = decoder_for(target_model, "sps", trained_head_dir, cost_aware=True, max_num_draft_tokens=6)
    assert isinstance(decoder.drafter, CostAwareDrafter)
    with pytest.raises(UnsupportedOptionError, match="'mtad-tree' cannot be made cost-aware.*pld, specinfer"):
        decoder_for(target_model, "mtad-tree", trained_head_dir, cost_aware=True)


def test_tree_methods_have_their_own_default_tree_and_honour_tree(target_model, trained_head_dir, monkeypatch):
    # hybrid-tree (and default, which builds it) and specinfer draft the head's top w (chosen from the target's
    # measured cost curve) unless --tree is given; specinfer with --no-cost-aware 4,2,2 every round.
    from jointspec.drafters.tree import TreeDrafter
    from jointspec.drafters.tree_gate import GatedTreeDrafter
    from jointspec.methods import costs, tree_width

    seen = []
    monkeypatch.setattr(tree_width, "default_tree_width", lambda curve, draft_cost, hit_rate: seen.append(curve) or 3)
    assert decoder_for(target_model, "hybrid-tree", trained_head_dir).drafter.tree.branching == (3,)
    assert seen == [costs.target_cost_curve(CausalLM(target_model))]  # the target's own curve, memoised
    assert decoder_for(target_model, "hybrid-tree", trained_head_dir, tree=(2, 1)).drafter.tree.branching == (2, 1)
    assert decoder_for(target_model, "default", trained_head_dir, tree=(2,)).drafter.tree.branching == (2,)
    chosen = decoder_for(target_model, "specinfer", trained_head_dir).drafter
    assert type(chosen) is GatedTreeDrafter and chosen.tree.branching == (3,) and not chosen.every_round
    assert seen[-1] == seen[0]
    given = decoder_for(target_model, "specinfer", trained_head_dir, tree=(2,)).drafter
    assert type(given) is GatedTreeDrafter and given.tree.branching == (2,) and given.every_round
    fixed = decoder_for(target_model, "specinfer", trained_head_dir, cost_aware=False).drafter
    assert type(fixed) is TreeDrafter and fixed.branching == (4, 2, 2)
    with pytest.raises(ValueError, match="tree must be"):
        MethodConfig(name="specinfer", tree=())


@pytest.mark.parametrize("name", ["sps", "mtad", "specinfer", "hybrid"])
def test_methods_that_need_a_draft_take_the_head_shipped_for_the_target(name, target_model, trained_head_dir,
                                                                        monkeypatch, tmp_path):
    """With no --draft, a method that needs one drafts with the head shipped for its target (matched by
    fingerprint); where none ships it still asks for --draft. Greedy output stays plain decoding's."""
    import shutil

    from jointspec.drafts import artifact

    monkeypatch.setattr(artifact, "SHIPPED_HEADS", tmp_path)
    with pytest.raises(UnsupportedOptionError, match="needs a draft model and no draft head ships"):
        build_method(MethodContext(MethodConfig(name=name), CausalLM(target_model), None, None))
    shutil.copytree(trained_head_dir, tmp_path / "tiny-head", ignore=shutil.ignore_patterns("checkpoint.pt"))
    target = CausalLM(target_model)
    # Every round drafted (cost_aware=False): whether the tiny head pays against the tiny target is a timing, and on a
    # busy machine the cost-aware wrapper rightly drafted nothing, which said nothing of the head being taken.
    drafter, verifier = build_method(MethodContext(MethodConfig(name=name, cost_aware=False), target, None, None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    assert decoder.generate(PROMPT, DecodeConfig(max_new_tokens=16)) == hf_greedy(target_model, PROMPT, 16)
    assert decoder.stats.num_draft_tokens > 0


def test_a_system_of_the_family_that_is_not_built_says_so_and_why_wherever_it_is_asked_for(target, capsys,
                                                                                            monkeypatch):
    """A system listed as not built (none is now; PEARL was until it was): build_method, the CLI and the bench's specs
    answer with the reason, not with "unknown method"; an unknown name still lists the choices."""
    from jointspec.bench.specs import MethodSpecError, parse_spec
    from jointspec.cli.main import main
    from jointspec.methods import registry

    monkeypatch.setitem(registry.NOT_BUILT, "medusa-2", "Medusa-2 is not built: it trains the target too")
    with pytest.raises(UnsupportedOptionError, match=r"method 'medusa-2': Medusa-2 is not built: it trains"):
        build_method(MethodContext(MethodConfig(name="medusa-2"), target, None, load_draft=None))
    with pytest.raises(MethodSpecError, match=r"'medusa-2:k=2': method 'medusa-2': Medusa-2 is not built"):
        parse_spec("medusa-2:k=2")
    assert main(["generate", "--method", "medusa-2", "--model", "default", "hi"]) == 2
    assert "method 'medusa-2': Medusa-2 is not built" in capsys.readouterr().err
    with pytest.raises(UnsupportedOptionError, match=r"unknown method 'nope'; choose one of: .*ar"):
        build_method(MethodContext(MethodConfig(name="nope"), target, None, load_draft=None))


@pytest.mark.parametrize("field,value", [("num_draft_tokens", 2.5), ("max_ngram", "3"), ("beam_width", True),
                                         ("accept_threshold", "0.5"), ("cost_aware", 1), ("tree", (2, 1.5)),
                                         ("tree_budget", None)])
def test_method_config_refuses_values_of_the_wrong_type_by_name(field, value):
    """A 2.5-token draft used to build a Pipeline and fail at generate time inside a drafter."""
    with pytest.raises(TypeError, match=field):
        MethodConfig(name="pld", **{field: value})
    assert MethodConfig(name="pld", num_draft_tokens=__import__("numpy").int64(3)).num_draft_tokens == 3


def recorded_reads(config_class, name: str, context_for) -> set[str]:
    """The settings method ``name``'s builder reads: a config whose field reads from jointspec's own code are
    recorded (not MethodConfig's own checks, nor build_method's generic ones, which every method passes through)."""
    import sys

    import jointspec

    source = str(Path(jointspec.__file__).parent)
    names = {field.name for field in dataclasses.fields(config_class)} - {"name"}
    seen: set[str] = set()

    class Recording(config_class):
        def __getattribute__(self, field):
            if field in names:
                caller = sys._getframe(1).f_code
                if caller.co_filename.startswith(source) and caller.co_name not in ("__post_init__", "build_method"):
                    seen.add(field)
            return object.__getattribute__(self, field)

    build_method(context_for(Recording(name=name)))
    return seen


def test_each_method_declares_exactly_the_settings_it_reads(target_model, trained_head_dir, bench_tokenizer,
                                                            tmp_path):
    """The settings a method reads are declared (register_method's ``reads``): generate, serve, a request and a bench
    spec refuse the others instead of ignoring them. Recorded here by building every method twice, with the target
    as its draft and with a trained head where it takes one (an n-gram table for corpus and aded): what a builder
    reads must be declared (else a user's setting would be refused though it counts), and what is declared must be
    read, but for what build_method reads for every method (cost_aware: the cost-aware wrapper; verify: which
    verifier) and head_weights, read where a head binds."""
    from jointspec.bench.specs import config_class
    from jointspec.drafters.corpus import NgramTable
    from jointspec.methods import method_names
    from jointspec.methods.registry import _METHODS

    NgramTable.build([[5, 6, 7, 8]] * 2, vocab_size=target_model.config.vocab_size).save(tmp_path, {"kind": "corpus"})
    for name in method_names():
        declared = _METHODS[name].reads
        seen: set[str] = set()
        for draft in ("self", trained_head_dir):
            if "draft" not in declared:
                draft = None
            elif name in ("corpus", "aded"):
                draft = str(tmp_path)
            elif name == "cross" and draft != "self":
                continue  # a head drafts in the target's vocabulary: cross refuses it
            seen |= recorded_reads(config_class(name), name, lambda config, draft=draft: MethodContext(
                dataclasses.replace(config, draft=draft), CausalLM(target_model), bench_tokenizer, None))
        assert seen <= declared, (name, seen - declared)
        assert declared - seen <= {"cost_aware", "verify", "head_weights"}, (name, declared - seen)
        if "draft" in declared and name not in ("corpus", "aded", "cross"):
            assert "head_weights" in declared, name  # it binds heads


def test_tree_methods_are_refused_up_front_on_a_target_that_scores_chains_only():
    """On llama.cpp's backend (chains only) a tree method ran until its first branching draft and then failed
    mid-answer; each method that may branch now says so before it starts, and chain methods still build."""
    from jointspec.core.target import TargetCapabilities
    from jointspec.methods.registry import _METHODS

    class ChainsOnly:
        name = "chains only"
        capabilities = TargetCapabilities(fork=True)

    trees = sorted(name for name, entry in _METHODS.items() if entry.drafts_trees)
    assert trees == ["aded", "hybrid-tree", "lade", "lookahead", "mtad-tree", "specinfer", "spectr"]
    for name in trees:
        with pytest.raises(UnsupportedOptionError, match=f"method '{name}' drafts token trees.*scores chains only"):
            build_method(MethodContext(MethodConfig(name, draft="self"), ChainsOnly(), None, None))
    target = CausalLM(tiny_llama(0))
    assert target.capabilities.trees
    for name in trees:  # where trees are scored, every one builds
        draft = "self" if name in ("hybrid-tree", "mtad-tree", "specinfer", "spectr") else None
        build_method(MethodContext(MethodConfig(name, draft=draft), target, None, None))


def test_lade_refuses_one_token_ngrams_rather_than_lengthening_them(target_model):
    # --max-ngram 1 was raised to 2 without a word.
    target = CausalLM(target_model)
    with pytest.raises(UnsupportedOptionError, match="--max-ngram .* must be >= 2 for lade, got 1"):
        build_method(MethodContext(MethodConfig(name="lade", max_ngram=1), target, None, None))
    drafter, _ = build_method(MethodContext(MethodConfig(name="lade", max_ngram=2), target, None, None))
    assert drafter.ngram == 2


def test_jointspec_methods_tags_as_lossless_exactly_the_methods_registered_so():
    """`jointspec methods` prints each hand-written summary, whose '(lossless)' tag had drifted from the registry for
    `oracle`; `ar` is plain decoding itself, the baseline the claim is made against."""
    from jointspec.methods import method_summaries
    from jointspec.methods.registry import method_is_lossless

    tagged = {name for name, summary in method_summaries().items() if "(lossless" in summary}
    assert tagged == {name for name in method_summaries() if method_is_lossless(name)} - {"ar"}
