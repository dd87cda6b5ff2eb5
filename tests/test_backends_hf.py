"""``CausalLM``: tree-masked forwards, gathering an accepted path out of a tree (``keep``), and ``crop``.

The reference for every check is the same model run on a plain chain from an empty cache, through the model's
ordinary causal path. A tree node must get the logits of its own branch run alone: any leak between siblings, any
wrong position (a node sits at ``num_cached + depth``, not at its index in the input) or any wrong cache entry kept
after a gather shows up as a difference far above the tolerance.

Tolerance: fp32, ``atol=1e-5, rtol=1e-5``. Tree and chain do the same arithmetic up to the attention mask form
(additive float mask vs the causal path) and the order of reductions, which move these fp32 logits (of magnitude
~2.5) by under 1e-6; a sibling leak or an off-by-one position moves them by 0.2 to 0.4. Deterministic tests: no
randomness beyond fixed seeds, so no false-failure odds.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends import hf, lean_forward
from jointspec.backends.hf import CausalLM, tree_ancestor_mask
from jointspec.core.draft import chain_parents, tree_depths
from jointspec.kernels.quantize import quantize_model

from helpers import VOCAB, greedy_by_methods, grouped_llama, random_prompt, tiny_llama

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}

# A tree over 8 nodes with two roots, uneven depths and siblings interleaved with their cousins:
#   -1 -> 0 -> 1 -> 3 -> 6
#         0 -> 2 -> 7
#   -1 -> 4 -> 5
TREE_PARENTS = [-1, 0, 0, 1, -1, 4, 3, 2]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    # Both attention paths receive the adapter's additive tree mask and must honour it.
    return tiny_llama(0, attn=request.param)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def path_to(node: int, parents: list[int]) -> list[int]:
    """Nodes from the root down to ``node``."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def chain_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``token_ids`` run as a chain from an empty cache. [len, vocab]"""
    return CausalLM(model).forward(token_ids).logits


@pytest.mark.parametrize("context_length", [0, 1, 6])
def test_tree_forward_matches_each_branch_run_alone(model, context_length):
    # Context 0: the tree is the first input (the loop's prompt-of-one-token case); 1 and 6: after a cache.
    context = tokens(0, context_length)
    tree_tokens = tokens(1, len(TREE_PARENTS))
    lm = CausalLM(model)
    if context:
        lm.forward(context, num_logits=0)
    tree = lm.forward(tree_tokens, parents=TREE_PARENTS).logits  # [num_nodes, vocab]
    assert tree.shape == (len(TREE_PARENTS), VOCAB)
    assert lm.num_cached == context_length + len(TREE_PARENTS)
    for node in range(len(TREE_PARENTS)):
        branch = [tree_tokens[i] for i in path_to(node, TREE_PARENTS)]
        expected = chain_logits(model, context + branch)[-1]
        torch.testing.assert_close(tree[node], expected, **TOLERANCE, msg=f"node {node}")


def test_siblings_do_not_see_each_other(model):
    # Guard against a check that cannot fail: two siblings with different tokens do get different children logits,
    # so equality with their own branch above is informative.
    context = tokens(0, 4)
    lm = CausalLM(model)
    lm.forward(context, num_logits=0)
    logits = lm.forward([10, 20, 30, 30], parents=[-1, -1, 0, 1]).logits
    assert (logits[2] - logits[3]).abs().max() > 1e-2


@pytest.mark.parametrize("accepted_leaf", [6, 7, 5])
def test_keep_accepted_path_then_continue(model, accepted_leaf):
    # After verifying a tree the loop keeps the context plus one root-to-node path, scattered among rejected
    # siblings in the cache. Continuing from the gathered cache must equal having run that path as a chain:
    # leaf 6 is the deepest path (nodes 0, 1, 3, 6), 7 takes a later sibling (0, 2, 7), 5 the second root (4, 5).
    context = tokens(2, 5)
    tree_tokens = tokens(3, len(TREE_PARENTS))
    path = path_to(accepted_leaf, TREE_PARENTS)
    lm = CausalLM(model)
    lm.forward(context, num_logits=0)
    lm.forward(tree_tokens, parents=TREE_PARENTS, num_logits=0)
    lm.keep(list(range(len(context))) + [len(context) + i for i in path])
    assert lm.num_cached == len(context) + len(path)

    continuation = tokens(4, 3)
    after_keep = lm.forward(continuation).logits  # [3, vocab]
    expected = chain_logits(model, context + [tree_tokens[i] for i in path] + continuation)[-3:]
    torch.testing.assert_close(after_keep, expected, **TOLERANCE)


def test_second_tree_after_keep(model):
    # Rounds chain: a tree, a gather, then another tree on top of the gathered cache.
    context = tokens(5, 4)
    first = tokens(6, len(TREE_PARENTS))
    second = tokens(7, len(TREE_PARENTS))
    path = path_to(7, TREE_PARENTS)
    lm = CausalLM(model)
    lm.forward(context, num_logits=0)
    lm.forward(first, parents=TREE_PARENTS, num_logits=0)
    lm.keep(list(range(len(context))) + [len(context) + i for i in path])
    logits = lm.forward(second, parents=TREE_PARENTS).logits
    prefix = context + [first[i] for i in path]
    for node in range(len(TREE_PARENTS)):
        branch = [second[i] for i in path_to(node, TREE_PARENTS)]
        torch.testing.assert_close(logits[node], chain_logits(model, prefix + branch)[-1], **TOLERANCE,
                                   msg=f"node {node}")


def test_keep_of_a_prefix_is_a_crop(model):
    lm = CausalLM(model)
    ids = tokens(8, 9)
    lm.forward(ids, num_logits=0)
    lm.keep(list(range(6)))
    assert lm.num_cached == 6
    torch.testing.assert_close(lm.forward([42]).logits, chain_logits(model, ids[:6] + [42])[-1:], **TOLERANCE)


@pytest.mark.parametrize("length", [0, 1, 5, 9])
def test_crop_then_continue(model, length):
    # crop(length) keeps exactly the first ``length`` cached tokens: continuing must match the shorter chain.
    # 0 empties the cache, 9 (everything) is a no-op.
    ids = tokens(9, 9)
    lm = CausalLM(model)
    lm.forward(ids, num_logits=0)
    lm.crop(length)
    assert lm.num_cached == length
    continuation = tokens(10, 2)
    torch.testing.assert_close(lm.forward(continuation).logits, chain_logits(model, ids[:length] + continuation)[-2:],
                               **TOLERANCE)


def test_crop_refuses_impossible_lengths(model):
    lm = CausalLM(model)
    lm.forward(tokens(11, 4), num_logits=0)
    for bad in (-1, 5):
        with pytest.raises(ValueError):
            lm.crop(bad)
    assert lm.num_cached == 4


def test_num_logits_returns_the_last_rows(model):
    ids = tokens(12, 6)
    full = chain_logits(model, ids)
    lm = CausalLM(model)
    torch.testing.assert_close(lm.forward(ids, num_logits=2).logits, full[-2:], **TOLERANCE)
    lm.reset()
    assert lm.forward(ids, num_logits=0).logits.shape == (0, VOCAB)
    assert lm.num_cached == 6


def test_tree_helpers_by_hand():
    assert tree_depths(TREE_PARENTS) == [0, 1, 1, 2, 0, 1, 3, 2]
    assert chain_parents(3) == [-1, 0, 1]
    mask = tree_ancestor_mask([-1, 0, 0, -1])
    expected = torch.tensor([[1, 0, 0, 0],
                             [1, 1, 0, 0],
                             [1, 0, 1, 0],  # node 2 sees its parent 0, not its sibling 1
                             [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    for bad in ([0], [-1, 1], [-1, -2]):  # a parent must be -1 or an earlier node
        with pytest.raises(ValueError):
            tree_depths(bad)


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


def test_a_long_prefill_runs_in_chunks_and_reports_progress(monkeypatch):
    """A prompt longer than PREFILL_CHUNK is read chunk by chunk: the cache ends the same (the next token's logits
    agree with one forward over the whole prompt, to float rounding), and the progress hook hears of each chunk."""
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 16)
    model = tiny_llama(3)
    chunked, whole = CausalLM(model), CausalLM(model)
    prompt = random_prompt(5, length=100)
    seen = []
    chunked.prefill_progress = lambda done, total: seen.append((done, total))
    assert chunked.forward(prompt, num_logits=0).logits.shape[0] == 0
    assert seen == [(done, 100) for done in (16, 32, 48, 64, 80, 96, 100)]
    assert chunked.num_cached == 100 and chunked.cache.get_seq_length() == 100
    expected = whole.forward(prompt + [7], num_logits=1).logits  # num_logits=1: one forward, no chunks
    assert torch.allclose(chunked.forward([7]).logits, expected, atol=1e-5)


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2vnni", "avx2"])
def test_the_vector_builds_read_a_prompt_row_by_row(isa):
    """The AVX-512 builds read a prompt in chunks of ROWWISE_PREFILL_CHUNK rows, the AVX2 builds read forwards of up
    to that many rows, and a prompt's first ROWWISE_PROMPT_TOKENS positions in such chunks, each row alone: the cache
    then holds the bits that feeding the prompt one token at a time gives, so the next logits are equal, not merely
    close. (A GEMM prefill fails this: the portable build's, and the AVX2 builds' past those positions, checked here
    with that limit lowered: the GEMM's float sums equal the rows' alone with odds far below 1e-9.)"""
    from jointspec.kernels.grouped import runnable_isas, use_isa

    if isa not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    model = quantize_model(grouped_llama(2), "int4")
    with use_isa(isa):
        chunked, stepped = CausalLM(model), CausalLM(model)
    assert chunked.lean.compiled is not None
    chunk = lean_forward.ROWWISE_PREFILL_CHUNK
    if isa.startswith("avx512"):
        assert chunked.prefill_chunk == chunk
        length = chunk + 40  # two chunks, both past the portable build's 16 GEMM rows
    else:
        assert chunked.lean.prefill_gemm_rows == chunk + 1
        assert chunked.prefill_chunk == min(hf.PREFILL_CHUNK,
                                            lean_forward.gemm_prefill_chunk(model.config.intermediate_size))
        assert chunked.lean.alone_prompt_tokens == lean_forward.ROWWISE_PROMPT_TOKENS
        length = chunk + 40  # two forwards of up to ROWWISE_PREFILL_CHUNK rows
    prompt = random_prompt(6, length=length)
    chunked.forward(prompt, num_logits=0)
    for token in prompt:
        stepped.forward([token], num_logits=0)
    expected = stepped.forward([7]).logits
    assert torch.equal(chunked.forward([7]).logits, expected)
    if isa.startswith("avx2"):  # past the limit the prompt goes to the GEMM, whose rows are not the same bits
        chunked.reset()
        chunked.lean.alone_prompt_tokens = 16
        try:
            chunked.forward(prompt, num_logits=0)
            cold = chunked.forward([7]).logits
            assert not torch.equal(cold, expected)
            # Read in two calls, the second from position 40 across the limit of 100 positions: the same forwards,
            # so the same bits as reading it in one call.
            chunked.lean.alone_prompt_tokens = 100
            chunked.reset()
            chunked.forward(prompt, num_logits=0)
            cold = chunked.forward([7]).logits
            chunked.reset()
            chunked.forward(prompt[:40], num_logits=0)
            chunked.forward(prompt[40:], num_logits=0)
            assert torch.equal(chunked.forward([7]).logits, cold)
        finally:
            chunked.lean.alone_prompt_tokens = lean_forward.ROWWISE_PROMPT_TOKENS


def test_a_gemm_prefill_chunk_bounds_its_mlp_activations():
    """Prompt chunks read through the GEMM shrink as the MLP widens (their activations are what a long prompt's
    peak memory holds), in powers of two, never below GEMM_PREFILL_MIN_ROWS, and a reader takes at most its own
    chunk."""
    widths_and_rows = {1536: 1024, 2560: 512, 8192: 256, 14336: 256, 64: 32768}  # 135M, 360M, 1B, 8B, tiny
    for intermediate, rows in widths_and_rows.items():
        assert lean_forward.gemm_prefill_chunk(intermediate) == rows
        assert rows * intermediate <= lean_forward.GEMM_PREFILL_ELEMENTS or rows == lean_forward.GEMM_PREFILL_MIN_ROWS
    model = quantize_model(grouped_llama(2), "int4")
    reader = CausalLM(model)
    assert reader.lean is not None
    reader.lean.prefill_chunk = 10 * hf.PREFILL_CHUNK
    assert reader.prefill_chunk == hf.PREFILL_CHUNK
    reader.lean.prefill_chunk = 40
    assert reader.prefill_chunk == 40


@pytest.mark.parametrize("method, draft, tree", [("sps", "self", None), ("specinfer", "self", (2, 2)),
                                                  ("pld", None, None), ("lookahead", None, None)])
def test_methods_match_plain_greedy_after_a_chunked_prefill(monkeypatch, method, draft, tree):
    """Every method prefills the same way, chunked or not, so a chunked prompt changes nothing in their agreement:
    on int4's compiled layers (a chunk of up to 256 rows takes them) and on transformers' float32 path."""
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 24)
    monkeypatch.setattr(lean_forward, "ROWWISE_PREFILL_CHUNK", 24)
    for model in (quantize_model(grouped_llama(2), "int4"), tiny_llama(4)):
        prompt = random_prompt(8, length=90)
        plain, other = greedy_by_methods(model, prompt, 40, methods=(("ar", None, None), (method, draft, tree)))
        assert other == plain
