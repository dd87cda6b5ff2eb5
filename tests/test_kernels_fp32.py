"""oneDNN linear layers (``--kernels``): same function as ``nn.Linear`` up to float rounding, lossless speculation on
them, and the plumbing (load, quantise, copy, switch back, bench placement).

The tiny models are conftest's (sharpened logits, so greedy near-ties are vanishingly rare and the equivalence tests
are deterministic: a float-rounding difference between kernels cannot flip an argmax whose margin is far larger).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from jointspec.backends.hf import CausalLM
from jointspec.backends.loading import load_model, quantized_copy, stock_copy
from jointspec.bench.specs import MethodSpecError, parse_spec
from jointspec.core.errors import UnsupportedOptionError
from jointspec.drafters.costaware import measure_cost_curve
from jointspec.kernels import fp32 as cpukernels
from jointspec.kernels.fp32 import (
    GQA_ATTENTION,
    OneDNNLinear,
    attention_in_use,
    kernels_in_use,
    resolve_kernels,
    stock_kernels,
    use_gqa_attention,
    use_onednn_linears,
    use_stock_linears,
)
from jointspec.kernels.quantize import ROWWISE_ATTENTION, quantization_mode

from helpers import (
    assert_clean_error,
    greedy,
    hf_greedy,
    make_decoder,
    random_prompt,
    run_cli,
    save_model,
    tiny_llama,
    untrained_head,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")

MAX_NEW_TOKENS = 40


@pytest.fixture()
def onednn_pair():
    """(target, other) tiny models with every linear layer on oneDNN and grouped-query attention in SDPA, as
    load_model sets them up; fresh per test (they are changed in place)."""
    target, other = tiny_llama(0, device="cpu"), tiny_llama(1, device="cpu")
    assert use_onednn_linears(target) == 2 * 7 + 1  # 7 per decoder layer (q, k, v, o, gate, up, down) + LM head
    use_onednn_linears(other)
    assert use_gqa_attention(target) and use_gqa_attention(other)  # 4 query heads, 2 key/value heads
    return target, other


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_onednn_linear_matches_nn_linear(rows):
    torch.manual_seed(rows)
    linear = nn.Linear(64, 96)
    fast = OneDNNLinear(linear)
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        expected, got = linear(x), fast(x)
    assert got.shape == expected.shape
    # Float rounding only: the products are the same, summed in another order (|x.w| ~ 10 here).
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-5)
    assert fast.weight is linear.weight and fast.bias is linear.bias  # shared, not copied


@pytest.mark.parametrize("rows, weight_major", [(1, False), (2, True), (3, True), (4, True), (5, False)])
def test_small_row_counts_take_the_weight_major_path(monkeypatch, rows, weight_major):
    # 2-4 rows (short verifications) run as W @ x.T; 1 row and 5+ stay on oneDNN's packed kernel.
    calls, original = [], cpukernels.weight_major_linear

    def spy(x, weight, bias):
        calls.append(x.shape)
        return original(x, weight, bias)

    monkeypatch.setattr(cpukernels, "weight_major_linear", spy)
    fast = OneDNNLinear(nn.Linear(64, 96, bias=False))
    with torch.inference_mode():
        fast(torch.randn(1, rows, 64))
    assert calls == ([torch.Size([1, rows, 64])] if weight_major else [])


def test_weight_major_linear_pads_odd_rows_without_changing_them():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(2, 3, 64)
    got = cpukernels.weight_major_linear(x, weight, bias)  # 6 rows: even
    assert got.shape == (2, 3, 96) and got.is_contiguous()
    assert torch.allclose(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    odd = cpukernels.weight_major_linear(x[0], weight, None)  # 3 rows: padded to 4 inside, 3 come back
    assert odd.shape == (3, 96)
    assert torch.allclose(odd, x[0] @ weight.T, atol=1e-4, rtol=1e-5)


def test_swapped_model_keeps_tied_weights_and_state_dict():
    model = tiny_llama(0, device="cpu")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in SmolLM2
    keys = set(model.state_dict())
    use_onednn_linears(model)
    assert isinstance(model.lm_head, OneDNNLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == keys  # the packed copy is never saved
    assert kernels_in_use(model) == "onednn"
    assert use_stock_linears(model) == 15 and kernels_in_use(model) == "stock"
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("method", ["ar", "pld", "sps-self", "sps-other"])
@pytest.mark.parametrize("prompt_seed", [3, 6])
def test_methods_on_onednn_match_plain_greedy(onednn_pair, method, prompt_seed):
    # Exactness is against the target as it runs: transformers' generate on the same oneDNN model.
    target, other = onednn_pair
    prompt = random_prompt(prompt_seed)
    decoder = make_decoder(method, target, other)
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == hf_greedy(target, prompt, MAX_NEW_TOKENS)


def test_onednn_and_stock_give_the_same_greedy_text(onednn_pair):
    # The kernels change float rounding, not the model: on sharpened tiny models the outputs agree exactly.
    target, _ = onednn_pair
    prompt = random_prompt(3)
    fast = hf_greedy(target, prompt, MAX_NEW_TOKENS)
    with stock_kernels(target):
        assert kernels_in_use(target) == "stock" and attention_in_use(target) == "sdpa"
        slow = hf_greedy(target, prompt, MAX_NEW_TOKENS)
    assert kernels_in_use(target) == "onednn" and attention_in_use(target) == GQA_ATTENTION
    assert fast == slow


def test_deepcopy_quantize_and_stock_copy_of_an_onednn_target(onednn_pair):
    target_model, _ = onednn_pair
    target = CausalLM(target_model, name="tiny")
    clone = copy.deepcopy(target_model)  # the packed oneDNN tensor has no storage: copied by repacking
    assert kernels_in_use(clone) == "onednn" and clone.lm_head.weight is not target_model.lm_head.weight
    int8 = quantized_copy(target, "int8")  # quantises the plain layers underneath
    assert quantization_mode(int8.model) == "int8" and kernels_in_use(target_model) == "onednn"
    # The copy's attention is the quantised models' batch-independent one, not the float model's GQA attention.
    assert attention_in_use(int8.model) == ROWWISE_ATTENTION and attention_in_use(target_model) == GQA_ATTENTION
    stock = stock_copy(target)
    assert kernels_in_use(stock.model) == "stock" and kernels_in_use(target_model) == "onednn"
    assert attention_in_use(stock.model) == "sdpa" and attention_in_use(target_model) == GQA_ATTENTION
    prompt = random_prompt(6)
    assert hf_greedy(stock.model, prompt, 20) == hf_greedy(target_model, prompt, 20)


@pytest.mark.parametrize("parents", [None, [-1, -1, 0, 1, 1]], ids=["chain", "tree"])
def test_gqa_attention_is_sdpa_without_copying_heads(monkeypatch, parents):
    # A masked multi-token forward (a verification) gives bit-identical logits with the key/value heads grouped in
    # SDPA, and no longer copies them per query head (repeat_kv).
    import transformers.integrations.sdpa_attention as sdpa_module

    copies = []
    original = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda states, n: copies.append(n) or original(states, n))
    model = tiny_llama(0, device="cpu")
    adapter = CausalLM(model)
    prompt, new = random_prompt(3)[:20], [7, 8, 9, 10, 11]
    logits = {}
    for name in ("sdpa", GQA_ATTENTION):
        if name == GQA_ATTENTION:
            assert use_gqa_attention(model)
        copies.clear()
        adapter.reset()
        adapter.forward(prompt, num_logits=0)
        logits[name] = adapter.forward(new, parents=parents).logits
        assert bool(copies) == (name == "sdpa")
    assert torch.equal(logits["sdpa"], logits[GQA_ATTENTION])


def test_cost_curve_memo_tells_the_kernels_apart(onednn_pair):
    target_model, _ = onednn_pair
    target = CausalLM(target_model, name="tiny")
    fast = measure_cost_curve(target, sizes=(1, 2), repeats=1, context_tokens=4)
    with stock_kernels(target_model):
        slow = measure_cost_curve(target, sizes=(1, 2), repeats=1, context_tokens=4)
    assert slow is not fast  # measured again, not the oneDNN curve from the memo
    assert measure_cost_curve(target, sizes=(1, 2), repeats=1, context_tokens=4) is fast


def test_resolve_kernels(monkeypatch):
    from jointspec.kernels import fp32 as cpukernels

    model = tiny_llama(0, device="cpu")
    monkeypatch.setattr(cpukernels, "cpu_vendor", lambda: "AuthenticAMD")
    assert resolve_kernels("auto", model) == "onednn"
    # Where PyTorch's own kernels were measured faster (docs/kernels.md), auto keeps them, and on unmeasured CPUs.
    for vendor in ("GenuineIntel", ""):
        monkeypatch.setattr(cpukernels, "cpu_vendor", lambda vendor=vendor: vendor)
        assert resolve_kernels("auto", model) == "stock"
        assert resolve_kernels("onednn", model) == "onednn"  # still available on request
    monkeypatch.setattr(cpukernels, "cpu_vendor", lambda: "AuthenticAMD")
    assert resolve_kernels("stock", model) == "stock"
    half = tiny_llama(0, device="cpu").to(torch.bfloat16)
    assert resolve_kernels("auto", half) == "stock"  # auto falls back where oneDNN linears do not apply
    with pytest.raises(ValueError, match="float32"):
        resolve_kernels("onednn", half)
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        resolve_kernels("fast", model)


def test_load_model_kernels(tmp_path, monkeypatch):
    from jointspec.kernels import fp32 as cpukernels

    monkeypatch.setattr(cpukernels, "cpu_vendor", lambda: "AuthenticAMD")  # where auto picks oneDNN
    folder = save_model(tmp_path / "tiny", 0)
    fast, stock = load_model(folder)[0].model, load_model(folder, kernels="stock")[0].model
    assert kernels_in_use(fast) == "onednn" and attention_in_use(fast) == GQA_ATTENTION  # auto: float32 on CPU
    assert kernels_in_use(stock) == "stock" and attention_in_use(stock) == "sdpa"
    # Where auto keeps PyTorch's linears it still groups attention heads (bit-identical, cheaper to verify with).
    monkeypatch.setattr(cpukernels, "cpu_vendor", lambda: "GenuineIntel")
    intel = load_model(folder)[0].model
    assert kernels_in_use(intel) == "stock" and attention_in_use(intel) == GQA_ATTENTION
    with pytest.raises(UnsupportedOptionError, match="unknown kernels 'fast'"):
        load_model(folder, kernels="fast")
    with pytest.raises(UnsupportedOptionError, match="float32"):
        load_model(folder, dtype="bfloat16", kernels="onednn")


def test_bench_spec_kernels_option():
    assert parse_spec("ar:kernels=stock").kernels == "stock"
    assert parse_spec("pld").kernels == "loaded"
    with pytest.raises(MethodSpecError, match="must be one of: loaded, stock"):
        parse_spec("ar:kernels=fast")
    with pytest.raises(MethodSpecError, match="kernels=stock is for the float torch target"):
        parse_spec("ar:kernels=stock,quantize=int8")


def test_head_on_an_onednn_target(onednn_pair):
    # A draft head bound to a oneDNN target runs on oneDNN too (layers and its VocabTrim LM head), drafts the same
    # logits as on stock kernels up to rounding, and sps with it still emits plain greedy output.
    from jointspec.core.loop import SpeculativeDecoder
    from jointspec.drafters.model import ModelDrafter
    from jointspec.drafts.eagle import HeadDraftModel
    from jointspec.verifiers.rejection import RejectionSamplingVerifier

    target_model, _ = onednn_pair
    target = CausalLM(target_model, name="tiny")
    head = untrained_head(target, draft_vocab_size=40)
    plain = copy.deepcopy(head)
    draft = HeadDraftModel(head, target)
    assert kernels_in_use(draft.head) == "onednn" and draft._lm_onednn is not None
    prompt = random_prompt(3)
    target.reset()
    target.forward(prompt[:-1], num_logits=0)
    fast = draft.forward(prompt + [5, 6]).logits
    with stock_kernels(target_model):
        stock_target = CausalLM(target_model, name="tiny-stock")
        stock_draft = HeadDraftModel(plain, stock_target)
        assert kernels_in_use(stock_draft.head) == "stock"
        stock_target.reset()
        stock_target.forward(prompt[:-1], num_logits=0)
        slow = stock_draft.forward(prompt + [5, 6]).logits
    assert torch.equal(torch.isinf(fast), torch.isinf(slow))  # the same tokens are outside the draft vocabulary
    torch.testing.assert_close(fast[~torch.isinf(fast)], slow[~torch.isinf(slow)], rtol=1e-4, atol=1e-4)

    target.reset()
    decoder = SpeculativeDecoder(target, ModelDrafter(HeadDraftModel(copy.deepcopy(plain), target), 3),
                                 RejectionSamplingVerifier())
    assert decoder.generate(prompt, greedy(MAX_NEW_TOKENS)) == hf_greedy(target_model, prompt, MAX_NEW_TOKENS)


def test_generate_and_serve_pass_kernels_to_the_loader(tmp_path, capsys):
    # The CLI's --kernels reaches load_model for `generate` (a bfloat16 model cannot be put on oneDNN linears: a clean
    # error naming why) and for the shared loader used by `serve` and `bench`.
    from jointspec.cli import main as cli
    from jointspec.cli.options import model_loader

    folder = save_model(tmp_path / "tiny", 0)
    code, _, err = run_cli(capsys, "generate", "hi", "--model", folder, "--max-new-tokens", "2",
                           "--dtype", "bfloat16", "--kernels", "onednn")
    assert_clean_error(code, err, "float32")
    args = cli.build_parser().parse_args(["serve", "--kernels", "stock", "--model", folder])
    assert kernels_in_use(model_loader(args)(folder)[0].model) == "stock"
