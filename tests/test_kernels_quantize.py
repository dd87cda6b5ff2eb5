"""Quantised targets (``--quantize int8|int4``, kernels/quantize.py): the layers, ``quantize_model``, and lossless
speculation on the quantised model. The ``--quantize`` / ``--backend`` plumbing is tested in test_backends_loading.py.

Quantisation changes the model, so exactness is defined against the *quantised* model: every method must emit what
plain greedy decoding (transformers' own ``generate``) emits on the same quantised model. That holds only if a token's
logits do not depend on how many tokens are verified with it, which the kernels are chosen for (per-token activation
scales, exact int32 sums; see ``jointspec.kernels.quantize``) and which is tested here row by row.

The tiny model (helpers.quant_llama) is conftest's recipe at sizes the int4 kernel accepts (out_features multiples of
16, in_features
multiples of the group size 32): hidden 64, intermediate 96, 4 heads (head size 16), 2 KV heads, vocab 99. Its
logits are sharpened as conftest does, so argmax near-ties are vanishingly rare and the equivalence tests are
deterministic. A variant with the head *tied* to the input embedding, as in SmolLM2, checks the untying.
"""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from jointspec.backends.hf import CausalLM
from jointspec.kernels.grouped import GroupedInt4Linear, GroupedInt8Linear, kernels
from jointspec.kernels.quantize import ROWWISE_ATTENTION, Int4Linear, Int8Linear, quantization_mode, quantize_model

from helpers import (
    BATCH_GREEDY,
    BATCH_METHODS,
    BATCH_PROMPTS,
    VOCAB,
    first_occurrences,
    greedy,
    hf_greedy,
    make_decoder,
    quant_llama,
    random_prompt,
    tiny_llama,
)

MODES = ["int8", "int4"]
MAX_NEW_TOKENS = 40  # with 4-token drafts: at least 8 rounds, as in test_core_loop_equivalence
NUM_DRAFT_TOKENS = 4
BF16_EPS = 2.0 ** -8  # bfloat16 rounding: relative error at most half of 2^-7


@pytest.fixture(scope="module", params=MODES)
def quantized(request) -> LlamaForCausalLM:
    return quantize_model(quant_llama(0), request.param)


# -- the layers ---------------------------------------------------------------------------------------------------


def linear(out_features: int, in_features: int, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        layer.weight[:, 5] *= 20  # an outlier input channel, as real models have: scales must cope with it
    return layer


def int8_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - y_int8| <= sum_j |x_j| s_w / 2 + s_x / 2 sum_j |w_hat_j|, with s_w = max|w_row| / 127 per output row
    and s_x = max|x_row| / 127 per token (round to nearest: each value moves by at most half a step), plus float
    slack for the final scaling."""
    s_w = w.abs().amax(dim=1) / 127  # [out]
    s_x = x.abs().amax(dim=1, keepdim=True) / 127  # [m, 1]
    w_hat_abs = w.abs() + s_w[:, None] / 2
    return (x.abs().sum(1, keepdim=True) * s_w / 2 + s_x / 2 * w_hat_abs.sum(1)
            + 1e-5 * (x.abs() @ w.abs().t()))


def int4_error_bound(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group of ``group_size`` inputs, step s = (max - min) / 15 and zero z = min + 8 s, both stored in bfloat16:
    a weight moves by at most s / 2 + 8 |s - bf16(s)| + |z - bf16(z)|; bfloat16 activations move by |x| 2^-8 at
    most. Plus 1e-3 relative slack for the kernel's float accumulation."""
    out_features, in_features = w.shape
    groups = w.reshape(out_features, -1, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    zero = low + 8 * step
    dw = (step / 2 + 8 * step * BF16_EPS + zero.abs() * BF16_EPS).expand_as(groups).reshape(out_features, in_features)
    return x.abs() @ dw.t() + (x.abs() * BF16_EPS) @ (w.abs() + dw).t() + 1e-3 * (x.abs() @ w.abs().t())


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_is_within_its_error_bound(mode):
    # A worst-case bound derived from the quantisation grid (docstrings above), not a tolerance tuned to pass. With
    # outlier channels the grid is coarse and so is the bound (0.4x to 1.4x the mean output here), but it still
    # has teeth: outputs in the wrong order (a transposed or misaligned weight) or no output at all break it.
    layer = linear(96, 64)
    x = torch.randn(7, 64) * torch.linspace(0.1, 3, 7)[:, None]  # tokens of different sizes: per-token scales
    x[:, 9] *= 30  # an activation outlier channel too
    quantized = Int8Linear(layer) if mode == "int8" else Int4Linear(layer, 32)
    with torch.no_grad():
        exact = layer(x)
        out = quantized(x)
    w = layer.weight.detach()
    bound = int8_error_bound(x, w) if mode == "int8" else int4_error_bound(x, w, 32)
    assert ((out - exact).abs() <= bound).all(), f"worst error/bound {((out - exact).abs() / bound).max():.3f}"
    assert ((out.roll(1, dims=1) - exact).abs() > bound).float().mean() > 0.2
    assert (exact.abs() > bound).float().mean() > 0.2


@pytest.mark.parametrize("mode", MODES)
def test_rows_do_not_depend_on_the_batch(mode):
    # Verifying k tokens must give each token exactly the logits it gets alone: bit for bit, for every batch size a
    # verification can have (up to 33 rows here, longer than any draft the methods make).
    layer = linear(96, 64, seed=1)
    quantized = Int8Linear(layer) if mode == "int8" else Int4Linear(layer, 32)
    x = torch.randn(33, 64) * 3
    with torch.no_grad():
        alone = torch.cat([quantized(x[i:i + 1]) for i in range(len(x))])
        for size in (2, 5, 17, 33):
            batched = torch.cat([quantized(x[i:i + size]) for i in range(0, len(x), size)])
            assert torch.equal(batched, alone), f"batches of {size}"
        assert torch.equal(quantized(x.reshape(3, 11, 64)).reshape(33, -1), alone)  # [batch, seq, in] inputs too


@pytest.mark.parametrize("compiled", [True, False])
def test_rowwise_attention_gives_each_sequence_of_a_padded_batch_its_own_bits(monkeypatch, compiled):
    """The server's ragged engine attends over a batch whose sequences sit at different slots (left padding, holes
    where drafts were rejected, masked): each sequence must get the bits it gets alone over its own keys, or 8-bit
    inputs turn the rounding into whole quantisation steps and a batched greedy answer differs from `generate`'s.
    (transformers' one-call SDPA over the padded batch fails this.)"""
    from jointspec.kernels import quantize

    if not compiled:
        monkeypatch.setattr(quantize, "_compiled_attention", lambda *tensors: None)
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim, slots, rows = 3, 4, 2, 32, 30, 5
    query = torch.randn(batch, heads, rows, dim, generator=generator)
    key, value = (torch.randn(batch, kv_heads, slots, dim, generator=generator) for _ in range(2))
    valid = torch.rand(batch, slots - rows, generator=generator) > 0.3  # padding and holes before the new rows
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    mask = torch.cat([valid[:, None, :].expand(batch, rows, -1), causal.expand(batch, rows, rows)], dim=-1)
    out, _ = quantize.rowwise_sdpa(None, query, key, value, mask[:, None], scaling=dim ** -0.5)
    for b in range(batch):
        index = mask[b, -1].nonzero()[:, 0]  # the sequence's own keys, contiguous as it holds them alone
        alone, _ = quantize.rowwise_sdpa(None, query[b:b + 1], key[b:b + 1, :, index], value[b:b + 1, :, index],
                                         None, scaling=dim ** -0.5)
        assert torch.equal(out[b], alone[0]), b
    padded = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None],
                                                              scale=dim ** -0.5, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out, padded, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_verified_logits_are_bitwise_those_of_one_token_at_a_time(mode):
    # The whole model, not just its linears: attention too must give a row the same bits whatever else shares the
    # forward (quantize_model switches it to rowwise_sdpa; with plain sdpa this fails on most of these trials, as
    # torch's CPU kernel rounds a lone row, or a longer key span, differently). Contexts and draft lengths are
    # random, 1 to 17 new tokens (pld's longest verification) after 1 to 60 cached ones.
    model = quantize_model(quant_llama(0), mode)
    assert model.config._attn_implementation == ROWWISE_ATTENTION
    rng = random.Random(0)
    for _ in range(12):
        context = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 61))]
        new = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 18))]
        together, alone = CausalLM(model), CausalLM(model)
        together.forward(context, num_logits=0)
        alone.forward(context, num_logits=0)
        assert torch.equal(together.forward(new).logits, torch.cat([alone.forward([t]).logits for t in new]))


@pytest.mark.parametrize("mode", MODES)
def test_tree_logits_are_bitwise_those_of_each_branch_decoded_alone(mode):
    # A token tree (rows whose visible keys are not a prefix: the gather path) against each root-to-node path fed
    # one token at a time after the same context.
    model = quantize_model(quant_llama(0), mode)
    context, tokens, parents = random_prompt(5), [11, 12, 13, 14, 15, 16, 17], [-1, 0, 0, 1, 2, 3, 3]
    tree = CausalLM(model)
    tree.forward(context, num_logits=0)
    logits = tree.forward(tokens, parents=parents).logits
    for node in range(len(tokens)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        chain = CausalLM(model)
        chain.forward(context, num_logits=0)
        for index in reversed(path):
            last = chain.forward([tokens[index]]).logits
        assert torch.equal(logits[node:node + 1], last), f"node {node}"


# -- quantize_model ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_replaces_every_linear_and_unties_the_head(mode):
    model = quant_llama(0, tied=True)
    embedding = model.model.embed_tokens.weight.detach().clone()
    quantize_model(model, mode)
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    body = Int8Linear if mode == "int8" else Int4Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, body)  # in_features 96: no grouped kernel (models/grouped)
    # int8 in both modes (module docstring: int4 hurts the head); int4 mode puts it on the grouped kernel where it runs
    grouped = mode == "int4" and kernels() is not None
    assert isinstance(model.lm_head, GroupedInt8Linear if grouped else Int8Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, GroupedInt4Linear if grouped else body)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # the lookup stays float and untouched
    assert quantization_mode(model) == mode
    target = CausalLM(model)
    assert target.vocab_size == VOCAB
    assert target.forward([5, 6, 7]).logits.shape == (3, VOCAB)


def test_head_can_stay_float():
    model = quantize_model(quant_llama(0, tied=True), "int4", quantize_head=False)
    assert type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert isinstance(model.model.layers[1].self_attn.q_proj, GroupedInt4Linear if kernels() else Int4Linear)


def test_layers_the_int4_kernel_cannot_take_stay_float_and_are_logged(caplog):
    # conftest's tiny Llama: intermediate 37 is neither a multiple of 16 (gate/up outputs) nor of 32 (down inputs).
    model = tiny_llama(0, device="cpu")
    with caplog.at_level(logging.WARNING, logger="jointspec.kernels.quantize"):
        quantize_model(model, "int4")
    mlp = model.model.layers[0].mlp
    assert type(mlp.gate_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
    message = caplog.text
    assert "model.layers.0.mlp.gate_proj (out_features 37 is not a multiple of 16)" in message
    assert "model.layers.1.mlp.down_proj (in_features 37 is not a multiple of the group size 32)" in message


def test_a_model_mostly_outside_torch_linears_says_it_stays_float(caplog):
    """GPT-2 keeps its layers in Conv1D and Falcon in a Linear subclass: quantising them reached the head alone while
    the run said int4. Now a warning names the share left in float; a Llama (norms aside, all Linear) gets none."""
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=99))
    with caplog.at_level(logging.WARNING, logger="jointspec.kernels.quantize"):
        quantize_model(gpt2.eval(), "int4")
    assert re.search(r"int4: 9\d% of the model's weights are in layers other than torch's Linear \(Conv1D\)",
                     caplog.text)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jointspec.kernels.quantize"):
        quantize_model(quant_llama(0), "int4")
    assert "other than torch's Linear" not in caplog.text


def test_mode_none_changes_nothing():
    model = quant_llama(0)
    assert quantize_model(model, "none") is model
    assert quantization_mode(model) == "none" and type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("mode, options, needle", [
    ("int3", {}, "unknown quantisation mode 'int3'"),
    ("INT8", {}, "unknown quantisation mode 'INT8'"),
    ("int4", {"group_size": 48}, "got 48"),
])
def test_bad_quantize_arguments(mode, options, needle):
    with pytest.raises(ValueError, match=needle):
        quantize_model(quant_llama(0), mode, **options)


def test_quantizing_twice_is_refused():
    model = quantize_model(quant_llama(0), "int8")
    with pytest.raises(ValueError, match=r"already quantised \(int8\)"):
        quantize_model(model, "int4")


# -- greedy equivalence on the quantised model ----------------------------------------------------------------


@pytest.mark.parametrize("method", ["ar", "pld", "sps-self"])
@pytest.mark.parametrize("prompt_seed", [0, 6])  # 9 to 14 distinct tokens in 40, for fp32, int8 and int4 alike
def test_methods_match_plain_greedy_on_the_quantized_model(quantized, method, prompt_seed):
    prompt = random_prompt(prompt_seed)
    decoder = make_decoder(method, quantized)
    out = decoder.generate(prompt, greedy(MAX_NEW_TOKENS))
    assert out == hf_greedy(quantized, prompt, MAX_NEW_TOKENS)
    assert len(set(out)) >= 8, "the continuation must not collapse into a tiny loop, or it hides position errors"


def test_self_draft_accepts_everything_on_the_quantized_model(quantized):
    # The draft (the quantised target, one token per forward) and the verifier (the same model, 5 tokens per
    # forward) agree on every token only if a row's logits do not depend on the batch. 40 = 8 rounds of 4 + 1.
    decoder = make_decoder("sps-self", quantized)
    decoder.generate(random_prompt(0), greedy(MAX_NEW_TOKENS))
    stats = decoder.stats
    assert stats.num_rounds == MAX_NEW_TOKENS // (NUM_DRAFT_TOKENS + 1)
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_prompt_lookup_accepts_and_stays_exact_on_the_quantized_model(quantized):
    # As in test_core_loop_equivalence: a prompt that repeats the model's own continuation makes n-gram drafts get
    # accepted,
    # so multi-token verification (and roll-back after partial accepts) really runs.
    seed_prompt = random_prompt(1)
    prompt = seed_prompt + hf_greedy(quantized, seed_prompt, 24) + seed_prompt
    decoder = make_decoder("pld", quantized)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == hf_greedy(quantized, prompt, MAX_NEW_TOKENS)
    assert decoder.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["pld", "sps-self"])
def test_eos_inside_a_draft_on_the_quantized_model(quantized, method):
    # Declare as EOS a token first produced inside a draft (not round one, not a bonus position): the output must
    # stop right after it, as plain greedy with that EOS does.
    prompt = random_prompt(3)
    reference = hf_greedy(quantized, prompt, MAX_NEW_TOKENS)
    candidates = [(pos, tok) for tok, pos in first_occurrences(reference).items()
                  if pos > NUM_DRAFT_TOKENS + 1 and pos % (NUM_DRAFT_TOKENS + 1) != NUM_DRAFT_TOKENS]
    assert candidates, "the continuation must offer tokens to declare as EOS"
    for pos, eos in (candidates[0], candidates[-1]):
        expected = reference[:pos + 1]
        assert hf_greedy(quantized, prompt, MAX_NEW_TOKENS, eos_token_id=eos) == expected
        out = make_decoder(method, quantized).generate(prompt, greedy(MAX_NEW_TOKENS, frozenset({eos})))
        assert out == expected, f"EOS {eos} first produced at new token {pos}"


@pytest.mark.parametrize("method", ["pld", "sps-self"])
@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
def test_max_new_tokens_inside_a_draft_on_the_quantized_model(quantized, method, max_new_tokens):
    # 5-token drafts (rounds of 6): 3 and 11 end inside a draft, 7 one token into round two, 1 leaves no room.
    prompt = random_prompt(3)
    decoder = make_decoder(method, quantized, num_draft_tokens=5)
    out = decoder.generate(prompt, greedy(max_new_tokens))
    assert out == hf_greedy(quantized, prompt, max_new_tokens)
    assert len(out) == max_new_tokens


@pytest.mark.parametrize("method", ["pld", "sps-self"])
def test_batched_decoding_equals_single_on_the_quantized_model(quantized, method):
    # The server's batched engine pads and masks rows of different lengths into one forward: with per-row
    # quantisation each row still gets the logits it gets alone (test_batch explains the prompts and settings).
    from jointspec.batch.engine import BatchEngine, BatchRequest

    engine = BatchEngine(CausalLM(quantized), max_batch_size=8)
    outs = engine.generate([BatchRequest(prompt, BATCH_GREEDY, BATCH_METHODS[method], seed=i)
                            for i, prompt in enumerate(BATCH_PROMPTS)])
    for prompt, out in zip(BATCH_PROMPTS, outs):
        assert out == make_decoder("ar", quantized).generate(prompt, BATCH_GREEDY)
