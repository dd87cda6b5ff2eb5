"""Online adaptation (drafters/memory.py): the memory of earlier answers, the lookup drafters that copy from it, and
greedy equivalence with plain decoding while they do.

The equivalence tests follow tests/test_core_loop_equivalence.py: plain greedy is transformers' own ``generate`` on
the same tiny fp32 model, and greedy speculative decoding is exact by construction, so any difference is a bug, not
bad luck (no false-failure odds). What the memory adds to those tests: drafts that come from *another request's*
answer, including the whole answer of the same prompt asked again, so that drafts run into the end of the budget and
into an end-of-sequence token. Everything else here is exact arithmetic on fixed inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from jointspec.api import GenerationConfig, Pipeline
from jointspec.backends.hf import CausalLM
from jointspec.bench.specs import MethodSpecError, parse_spec
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.costaware import CostCurve
from jointspec.drafters.memory import OutputMemory, longest_source, memory_for, most_common_path
from jointspec.drafters.ngram import PromptLookupDrafter
from jointspec.drafters.trie import TrieLookupDrafter
from jointspec.methods import MethodConfig, MethodContext, build_method, online_methods

from helpers import corpus_folder, first_occurrences, greedy, hf_greedy, random_prompt

GREEDY = SamplingConfig()
FLAT = CostCurve({1: 1.0, 64: 1.0 + 1e-9})  # extra rows cost nothing: every node pays


# -- the memory ------------------------------------------------------------------------------------------------------

def test_the_longest_final_ngram_wins_and_recent_answers_come_first():
    memory = OutputMemory(max_ngram=3, prompt_tail=0)
    memory.add([], [5, 6, 7, 8, 9])
    memory.add([], [1, 6, 7, 4, 4])
    # "6 7" ends the context: both answers hold it; the later answer's continuation first.
    assert memory.continuations([3, 6, 7], 2) == (2, [[4, 4], [8, 9]])
    # "5 6 7" is only in the first answer, and a 3-gram beats the 2-gram.
    assert memory.continuations([5, 6, 7], 3) == (3, [[8, 9]])
    # Nothing follows the final "9", and "2" was never seen: no continuation, not an empty one.
    assert memory.continuations([9], 3) == (0, [])
    assert memory.continuations([2], 3) == (0, [])
    assert memory.continuations([5, 6, 7], 0) == (0, [])
    # The caller may narrow the n-gram range: at most unigrams, or at least 3-grams.
    assert memory.continuations([5, 6, 7], 1, max_ngram=1) == (1, [[4], [8]])
    assert memory.continuations([3, 6, 7], 1, min_ngram=3) == (0, [])


def test_the_prompt_tail_lets_an_answer_opening_match():
    memory = OutputMemory(prompt_tail=2)
    memory.add([40, 41, 42, 43], [10, 11, 12])
    # A new prompt ending like the last one (a chat template's assistant header) drafts the answer's opening.
    assert memory.continuations([99, 42, 43], 3) == (2, [[10, 11, 12]])
    assert memory.continuations([99, 41], 3) == (0, [])  # outside the tail: never stored
    memory.add([1, 2], [])  # an empty answer adds nothing
    assert memory.num_answers == 1 and memory.num_tokens == 5


def test_old_answers_leave_first_and_are_never_drafted_again():
    memory = OutputMemory(max_tokens=8, prompt_tail=0, max_ngram=2)
    memory.add([], [1, 2, 3, 4])
    memory.add([], [5, 6, 7, 8])
    assert memory.continuations([1], 2) == (1, [[2, 3]])
    memory.add([], [9, 10, 11])  # 11 tokens > 8: the oldest answer goes
    assert memory.num_tokens == 7 and memory.num_answers == 3
    assert memory.continuations([1], 2) == (0, [])
    assert memory.continuations([5], 2) == (1, [[6, 7]])
    for start in range(20):  # many evictions: the index is rebuilt, and still finds only what is kept
        memory.add([], [100 + start, 200 + start])
    assert memory.num_tokens <= 8
    assert memory.continuations([119], 1) == (1, [[219]])
    assert memory.continuations([100], 1) == (0, [])
    assert sum(len(entries) for entries in memory._index.values()) <= 8 * 2 * 2


def test_each_ngram_keeps_its_most_recent_occurrences():
    memory = OutputMemory(max_matches=2, prompt_tail=0)
    for follower in (10, 11, 12):
        memory.add([], [7, follower])
    assert memory.continuations([7], 1) == (1, [[12], [11]])


def test_memories_are_kept_per_model_and_scope():
    model_a, model_b = CausalLM.__new__(CausalLM), CausalLM.__new__(CausalLM)  # any weakly referable objects
    assert memory_for(model_a, "alice") is memory_for(model_a, "alice")
    assert memory_for(model_a, "alice") is not memory_for(model_a, "bob")
    assert memory_for(model_a, "alice") is not memory_for(model_b, "alice")


def test_settings_are_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        OutputMemory(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="max_tokens"):
        OutputMemory(max_tokens=0)


def test_chains_follow_the_path_most_answers_agree_on():
    continuations = [[1, 2, 3], [4, 5], [1, 2, 6], [1, 7]]  # most recent first
    assert most_common_path(continuations, 3) == [1, 2, 3]  # 3 of 4 start with 1; 2 of those go on with 2; a tie
    assert most_common_path(continuations, 1) == [1]
    assert most_common_path([[9], [8]], 2) == [9]  # a tie: the most recent; nothing follows it
    assert most_common_path([], 3) == [] and most_common_path([[]], 3) == []


def test_the_memory_answers_like_an_ngram_table():
    memory = OutputMemory(prompt_tail=0)
    for answer in ([5, 6, 7], [5, 6, 8], [1, 6, 7]):
        memory.add([], answer)
    assert memory.max_order == 3
    # After "5 6": two answers, one each way; the most recent wins the tie. After "6" alone, 7 twice out of three.
    assert memory.continuation([9, 5, 6]) == (8, 0.5, 2)
    assert memory.continuation([9, 6]) == (7, 2 / 3, 1)
    assert memory.continuation([9, 5, 6], min_order=3) is None and memory.continuation([4]) is None


def test_aded_counts_the_memory_beside_its_own_store():
    from jointspec.drafters.aded import TrigramStore

    memory = OutputMemory(prompt_tail=0)
    memory.add([], [5, 6, 7])
    alone, remembering = TrigramStore(), TrigramStore(answers=memory)
    for store in (alone, remembering):
        store.observe_all([1, 5, 6, 9])  # the request itself saw "5 6 -> 9" once
    assert 7 not in alone.chances([5, 6])
    chances = remembering.chances([5, 6])
    assert chances[7] > 0.3 and chances[9] > 0.2  # two pseudo-observations of 7 beside one real 9


def test_the_longer_source_leads_and_ties_keep_both():
    assert longest_source((2, [7]), (3, [[1]])) == (3, [], [[1]])
    assert longest_source((3, [7]), (2, [[1]])) == (3, [7], [])
    assert longest_source((2, [7]), (2, [[1]])) == (2, [7], [[1]])


# -- the drafters ----------------------------------------------------------------------------------------------------

def test_prompt_lookup_copies_from_memory_where_the_context_matches_shorter():
    memory = OutputMemory(prompt_tail=0)
    memory.add([], [20, 21, 22, 23, 24])
    drafter = PromptLookupDrafter(4, max_ngram=3, output_memory=memory)
    # The context has no earlier "21 22": the memory's 2-gram continuation is drafted.
    assert drafter.propose([9, 21, 22], 8, GREEDY, None).token_ids == [23, 24]
    # The context's own 2-gram match ties with the memory's: the context wins.
    assert drafter.propose([21, 22, 5, 21, 22], 8, GREEDY, None).token_ids == [5, 21, 22]
    # Without the memory the first context has nothing to copy.
    assert PromptLookupDrafter(4, max_ngram=3).propose([9, 21, 22], 8, GREEDY, None).num_nodes == 0


def test_the_trie_merges_remembered_continuations():
    memory = OutputMemory(prompt_tail=0)
    memory.add([], [5, 6, 7, 1])
    memory.add([], [5, 6, 7, 2])
    context = [5, 6, 7, 1, 0, 5, 6]  # the context holds "5 6 -> 7 1" once; the memory twice more
    drafter = TrieLookupDrafter(FLAT, max_depth=2, max_ngram=2, output_memory=memory)
    tokens, parents, chances = drafter.trie(context, 2)
    assert tokens == [7, 1, 2] and parents == [-1, 0, 0]
    assert chances == pytest.approx([1.0, 2 / 3, 1 / 3])
    alone = TrieLookupDrafter(FLAT, max_depth=2, max_ngram=2).trie(context, 2)
    assert alone == ([7, 1], [-1, 0], [1.0, 1.0])


def test_a_method_that_cannot_learn_online_refuses_a_memory(target_model):
    context = MethodContext(MethodConfig(name="sps", draft="self"), CausalLM(target_model), None, None,
                            OutputMemory())
    with pytest.raises(UnsupportedOptionError, match="does not draft from earlier answers"):
        build_method(context)
    assert {"pld", "corpus", "lookahead", "default", "hybrid", "hybrid-tree"} <= set(online_methods())
    assert "sps" not in online_methods()
    assert parse_spec("pld:memory=online").memory == "online"
    with pytest.raises(MethodSpecError, match="memory=online is for"):
        parse_spec("sps:memory=online")
    with pytest.raises(MethodSpecError, match="must be one of"):
        parse_spec("pld:memory=always")


# -- greedy equivalence while drafting from memory -------------------------------------------------------------------

MAX_NEW_TOKENS = 40
METHODS = ["pld", "corpus", "lookahead", "default", "aded"]


def decoder_with_memory(method: str, target_model, memory: OutputMemory) -> SpeculativeDecoder:
    target = CausalLM(target_model, name="tiny-target")
    config = MethodConfig(name=method, draft=corpus_folder(target_model) if method == "corpus" else None)
    drafter, verifier = build_method(MethodContext(config, target, None, None, memory))
    return SpeculativeDecoder(target, drafter, verifier)


def remembered(target_model, seeds) -> OutputMemory:
    memory = OutputMemory()
    for seed in seeds:
        prompt = random_prompt(seed)
        memory.add(prompt, hf_greedy(target_model, prompt, MAX_NEW_TOKENS))
    return memory


@pytest.mark.parametrize("method", METHODS)
def test_drafting_from_other_answers_matches_plain_greedy(target_model, method):
    memory = remembered(target_model, [0, 5, 6])
    prompt = random_prompt(3)
    decoder = decoder_with_memory(method, target_model, memory)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == hf_greedy(target_model, prompt, MAX_NEW_TOKENS)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
def test_the_same_prompt_again_drafts_its_whole_answer_and_stops_at_the_budget(target_model, method,
                                                                                 max_new_tokens, monkeypatch):
    # A tiny model's curve, pinned: a timed one, measured while other tests load the cores, has said that no draft
    # pays (then nothing is drafted, and the check that drafts were kept fails though the tokens are right).
    from jointspec.methods import costs

    monkeypatch.setattr(costs, "measure_cost_curve",
                        lambda target, sizes, **options: CostCurve({n: 1.0 + 0.02 * (n - 1) for n in sizes}))
    prompt = random_prompt(3)
    memory = remembered(target_model, [3])  # the very answer: drafts run into the budget
    decoder = decoder_with_memory(method, target_model, memory)
    out = decoder.generate(prompt, greedy(max_new_tokens))
    assert out == hf_greedy(target_model, prompt, max_new_tokens)
    assert len(out) == decoder.stats.num_new_tokens == max_new_tokens
    if max_new_tokens > 1:
        assert decoder.stats.num_accepted_tokens > 0  # the remembered answer was drafted and kept


@pytest.mark.parametrize("method", METHODS)
def test_an_end_of_sequence_inside_a_remembered_draft_stops_like_plain_greedy(target_model, method):
    prompt = random_prompt(6)
    reference = hf_greedy(target_model, prompt, MAX_NEW_TOKENS)
    memory = remembered(target_model, [6])
    candidates = sorted((pos, token) for token, pos in first_occurrences(reference).items() if pos >= 3)
    assert len(candidates) >= 2
    for pos, eos in (candidates[0], candidates[-1]):
        expected = reference[:pos + 1]
        decoder = decoder_with_memory(method, target_model, memory)
        assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS, frozenset({eos}))) == expected
        assert decoder.stats.num_accepted_tokens > 0


def test_a_pipeline_remembers_whole_answers_and_drafts_from_them(target_model):
    memory = OutputMemory()
    pipeline = Pipeline(CausalLM(target_model, name="tiny-target"), None, MethodConfig(name="lookahead"),
                        memory=memory)
    prompt = random_prompt(5)
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    first = pipeline.generate_ids(prompt, config)
    assert memory.num_answers == 1
    first_calls = first.stats.num_rounds
    second = pipeline.generate_ids(prompt, config)
    assert second.token_ids == first.token_ids == hf_greedy(target_model, prompt, MAX_NEW_TOKENS)
    assert second.stats.num_rounds < first_calls  # the second answer was drafted from the first
    stream = pipeline.stream_ids(prompt, config)
    next(stream)
    stream.close()  # a stream its caller stopped is not remembered
    assert memory.num_answers == 2
    assert np.asarray(memory.continuations(prompt, 4)[1][0]).size == 4
