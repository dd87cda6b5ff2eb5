"""Log-probabilities of committed tokens (core/logprobs.py): what the server's ``logprobs`` return.

What is proved: every method's committed tokens get the target's own log-probabilities, the ``log_softmax`` of the
raw logits at the token's position, as a teacher-forced forward over the prompt and answer gives them, whatever the
method drafted and verified (chains, a tree whose accepted path skips rows, MTAD's joint test, an end-of-sequence
token or the length limit inside a draft) and however the rows were read (the screened head of greedy decoding, of
top-k sampling and of draws, or whole rows); asking for them changes no token; the lockstep and ragged engines give
each request what the loop gives it. Fixed models, prompts and seeds: no false-failure odds beyond the float
tolerance stated (a teacher-forced prefill runs other kernels than a decode's rows).
"""

from __future__ import annotations

import math

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.batch.engine import BatchEngine, BatchRequest
from jointspec.batch.lockstep import LockstepEngine
from jointspec.core.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, check_top_logprobs, json_logprob, token_logprobs
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import BATCH_EOS as EOS
from helpers import BATCH_PROMPTS as PROMPTS
from helpers import ROUND_KINDS, grouped_llama, random_prompt

METHODS = ROUND_KINDS
SAMPLINGS = {
    "greedy": SamplingConfig(0.0),  # the screened argmax
    "top-k": SamplingConfig(0.8, top_k=50),  # the screened top k
    "temperature": SamplingConfig(0.9),  # draws through the screen (drafts without probabilities)
    "top-p": SamplingConfig(1.0, top_p=0.9),  # whole rows
}
TOLERANCE = 1e-4  # a teacher-forced prefill against a decode's rows: float rounding of other kernels


@pytest.fixture(scope="module")
def int4_target():
    target = CausalLM(quantize_model(grouped_llama(0), "int4"), name="int4")
    assert target.capabilities.argmax_screen and target.capabilities.top_k_screen and target.capabilities.draw_screen
    return target


def decode(target, method: MethodConfig, prompt: list[int], config: DecodeConfig, seed: int = 0):
    """The loop's tokens, and each round's log-probabilities and forward calls."""
    fork = target.fork("decode")
    drafter, verifier = build_method(MethodContext(method, fork, None, None))
    decoder = SpeculativeDecoder(fork, drafter, verifier)
    state = decoder.start(prompt, config, torch.Generator().manual_seed(seed))
    tokens, figures, calls = [], [], []
    while not state.done:
        call = decoder.begin_round(state)
        calls.append(call)
        new = decoder.finish_round(state, call.run(fork))
        tokens += new
        if config.logprobs is not None:
            assert len(state.logprobs) == len(new)
            figures += state.logprobs
    return tokens, figures, calls


def teacher_forced(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of the target's whole logits at each answer token's position, from one forward."""
    fork = target.fork("reference")
    logits = fork.forward(prompt + tokens[:-1]).logits[len(prompt) - 1:]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_logprobs_are_the_targets(target, prompt, tokens, figures, top: int) -> None:
    assert [f.token_id for f in figures] == tokens
    expected = teacher_forced(target, prompt, tokens)
    for i, (token, figure) in enumerate(zip(tokens, figures)):
        assert figure.logprob == pytest.approx(float(expected[i, token]), abs=TOLERANCE), i
        assert len(figure.top) == top
        values = [value for _, value in figure.top]
        assert values == sorted(values, reverse=True)
        best = expected[i].topk(top)
        assert values == pytest.approx(best.values.tolist(), abs=TOLERANCE)
        # The listed tokens are the row's most likely (ties aside, which random rows do not have).
        assert [token_id for token_id, _ in figure.top] == best.indices.tolist()


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("method", METHODS)
def test_every_methods_tokens_get_the_targets_log_probabilities(int4_target, method, sampling):
    prompt = random_prompt(3)
    config = DecodeConfig(24, SAMPLINGS[sampling], EOS, logprobs=3)
    tokens, figures, calls = decode(int4_target, METHODS[method], prompt, config, seed=5)
    assert_logprobs_are_the_targets(int4_target, prompt, tokens, figures, 3)
    # Asking for them changes nothing the loop commits.
    plain, _, plain_calls = decode(int4_target, METHODS[method], prompt, DecodeConfig(24, SAMPLINGS[sampling], EOS),
                                   seed=5)
    assert plain == tokens
    # Rows read through a screen come with their hidden states (for the exact head's rows); whole rows need none,
    # and a decode that asks for no log-probabilities never pays for them.
    screened = [bool(call.argmax_only or call.top_k_only or call.draws is not None) for call in calls]
    assert [call.output_hidden for call in calls] == screened
    if sampling in ("greedy", "top-k") or (sampling == "temperature" and method in ("ar", "pld")):
        assert all(screened)  # (temperature alone: drafts without probabilities are drawn through the screen)
    if sampling == "top-p":
        assert not any(screened)
    assert not any(call.output_hidden for call in plain_calls)


@pytest.fixture
def narrowed_screen(int4_target):
    """The screened head narrowed until its rows are surely not whole (one exact logit a row, no margin): what the
    figures must then take from the exact head."""
    screen = int4_target.model.lm_head
    narrowed = {"margin": 0.0, "max_exact": 1, "exact_per_rank": 1}
    kept = {name: getattr(screen, name) for name in narrowed}
    for name, value in narrowed.items():
        setattr(screen, name, value)
    yield
    for name, value in kept.items():
        setattr(screen, name, value)


@pytest.mark.parametrize("sampling", ["greedy", "top-k"])
@pytest.mark.parametrize("method", ["ar", "specinfer-self"])
def test_rows_read_through_a_narrowed_screen_get_the_exact_heads_figures(int4_target, narrowed_screen, method,
                                                                        sampling):
    prompt = random_prompt(6)
    tokens, figures, calls = decode(int4_target, METHODS[method], prompt,
                                    DecodeConfig(16, SAMPLINGS[sampling], EOS, logprobs=4), seed=2)
    assert all(call.output_hidden for call in calls)
    assert_logprobs_are_the_targets(int4_target, prompt, tokens, figures, 4)


def test_the_tree_test_reads_an_accepted_path_that_skips_rows(int4_target):
    # What makes the tree case above a test of the row mapping: some round accepts a node that is not row 1, 2, ...
    fork = int4_target.fork("tree")
    drafter, verifier = build_method(MethodContext(METHODS["specinfer-self"], fork, None, None))
    decoder = SpeculativeDecoder(fork, drafter, verifier)
    seen = []
    original = verifier.verify

    def verify(draft, *args, **kwargs):
        verdict = original(draft, *args, **kwargs)
        seen.append(verdict.accepted)
        return verdict
    verifier.verify = verify
    decoder.generate(random_prompt(3), DecodeConfig(24, SAMPLINGS["top-k"], EOS), torch.Generator().manual_seed(5))
    assert any(accepted != list(range(len(accepted))) for accepted in seen), seen


def test_an_end_of_sequence_token_and_the_length_limit_inside_a_draft_cut_the_figures_with_the_tokens(int4_target):
    # Self-drafts are always accepted greedily, three tokens a round: drafts run past an end-of-sequence token set
    # at the answer's sixth token, and past the length limit of 9 (not a whole number of rounds).
    for prompt in PROMPTS[:4]:
        free, _, _ = decode(int4_target, METHODS["sps-self"], prompt, DecodeConfig(14, SamplingConfig(0.0)))
        first = {token: i for i, token in reversed(list(enumerate(free)))}
        eos = next(token for token in free[3:] if first[token] >= 3)  # its first place is inside a round's draft
        tokens, figures, _ = decode(int4_target, METHODS["sps-self"], prompt,
                                    DecodeConfig(14, SamplingConfig(0.0), frozenset({eos}), logprobs=0))
        assert tokens == free[:first[eos] + 1] and len(figures) == len(tokens)
        assert_logprobs_are_the_targets(int4_target, prompt, tokens, figures, 0)
        tokens, figures, _ = decode(int4_target, METHODS["sps-self"], prompt,
                                    DecodeConfig(9, SamplingConfig(0.0), logprobs=1))
        assert tokens == free[:9] and len(figures) == 9
        assert_logprobs_are_the_targets(int4_target, prompt, tokens, figures, 1)


@pytest.mark.parametrize("method", ["ar", "sps-self", "specinfer-self"])
def test_whole_rows_of_a_float32_target_give_the_same_figures(target, method):
    """A target with no screen (conftest's float32 model, transformers' own forward): the rows are read as given."""
    assert not target.capabilities.argmax_screen
    prompt = random_prompt(5)
    for sampling in ("greedy", "top-k"):
        tokens, figures, calls = decode(target, METHODS[method], prompt,
                                        DecodeConfig(20, SAMPLINGS[sampling], EOS, logprobs=2))
        assert not any(call.output_hidden for call in calls)
        assert_logprobs_are_the_targets(target, prompt, tokens, figures, 2)


def test_the_lockstep_engine_gives_each_request_the_loops_figures(int4_target, monkeypatch):
    # The rows of every request that asks read the exact head in one call a round (each row computed alone there,
    # so each request still gets its own call's bits).
    calls = {"logits_of": 0, "steps": 0}
    own_logits_of = CausalLM.logits_of

    def counted(self, hidden):
        calls["logits_of"] += 1
        return own_logits_of(self, hidden)
    monkeypatch.setattr(CausalLM, "logits_of", counted)
    engine = LockstepEngine(int4_target, max_batch_size=4)
    requests = []
    for i, prompt in enumerate(PROMPTS[:6]):
        method = list(METHODS.values())[i % len(METHODS)]
        sampling = list(SAMPLINGS.values())[i % len(SAMPLINGS)]
        requests.append(BatchRequest(tuple(prompt), DecodeConfig(16, sampling, EOS, logprobs=2 if i % 3 else None),
                                     method, seed=i))
    ids = [engine.submit(request) for request in requests]
    figures: dict[int, list[TokenLogprob]] = {seq_id: [] for seq_id in ids}
    tokens: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_work:
        calls["steps"] += 1
        for event in engine.step():
            assert event.error is None
            tokens[event.seq_id] += event.token_ids
            assert (event.logprobs is None) == (requests[ids.index(event.seq_id)].config.logprobs is None)
            figures[event.seq_id] += event.logprobs or []
    assert 0 < calls["logits_of"] <= calls["steps"]  # (alone, each asking request would call once a round)
    for seq_id, request in zip(ids, requests):
        alone, alone_figures, _ = decode(int4_target, request.method, list(request.prompt_ids), request.config,
                                         seed=request.seed)
        assert tokens[seq_id] == alone
        assert figures[seq_id] == alone_figures  # the same bits: every row computed alone


def test_the_ragged_engine_gives_its_rows_the_targets_figures(target):
    engine = BatchEngine(target, max_batch_size=4)
    prompts = [random_prompt(seed) for seed in (0, 3, 5, 6)]
    ids = [engine.submit(BatchRequest(tuple(p), DecodeConfig(16, SamplingConfig(0.0), EOS, logprobs=1),
                                      MethodConfig("pld", num_draft_tokens=3))) for p in prompts]
    figures: dict[int, list[TokenLogprob]] = {seq_id: [] for seq_id in ids}
    tokens: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    while engine.has_work:
        for event in engine.step():
            tokens[event.seq_id] += event.token_ids
            figures[event.seq_id] += event.logprobs
    for seq_id, prompt in zip(ids, prompts):
        assert len(figures[seq_id]) == len(tokens[seq_id]) > 0
        assert_logprobs_are_the_targets(target, prompt, tokens[seq_id], figures[seq_id], 1)


def test_the_figures_are_checked_and_written_as_json_can_hold_them():
    rows = torch.tensor([[0.0, 1.0, 2.0], [5.0, -math.inf, 0.0]])
    figures = token_logprobs(rows, [1, 1], 2)
    assert figures[0].logprob == pytest.approx(1.0 - math.log(1 + math.e + math.e ** 2))
    assert [token for token, _ in figures[0].top] == [2, 1] and [token for token, _ in figures[1].top] == [0, 2]
    assert figures[1].logprob == -math.inf and json_logprob(figures[1].logprob) == -9999.0
    assert json_logprob(float("nan")) == -9999.0 and json_logprob(-0.5) == -0.5
    with pytest.raises(ValueError, match="2 rows of logits for 1 tokens"):
        token_logprobs(rows, [1], 0)
    for bad in (-1, MAX_TOP_LOGPROBS + 1, True, 2.0):
        with pytest.raises(ValueError, match=f"from 0 to {MAX_TOP_LOGPROBS}"):
            check_top_logprobs(bad)
        with pytest.raises(ValueError, match="logprobs must be"):
            DecodeConfig(4, logprobs=bad)
    check_top_logprobs(None)
    check_top_logprobs(MAX_TOP_LOGPROBS)
