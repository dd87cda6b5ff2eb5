"""jointspec's grouped int4 / int8 CPU kernels (kernels/grouped.py; csrc/: simd.h, rows.h, products.cpp,
grouped_linear.cpp).

Deterministic (seeded random weights and inputs): no false-failure odds. The kernels build on every CPU with a C++
compiler (a build failure fails these tests, it is not skipped): the tests run on the fastest build this CPU runs,
and the tests at the end hold every build it can run against the portable one, bit for bit.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from jointspec.backends.hf import CausalLM
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.kernels.cpu import cpu_flags, usable_cores
from jointspec.kernels.grouped import (
    GROUP_SIZE,
    ISA_ENV,
    ISA_FLAGS,
    ISA_MACHINES,
    SCREEN_MARGIN,
    SCREEN_TOP_K_MAX,
    GroupedInt4Linear,
    GroupedInt6Linear,
    GroupedInt8Linear,
    ScreenedInt8Head,
    float_inputs,
    kernels,
    runnable_isas,
    selected_isa,
    unavailable_reason,
    use_isa,
)
from jointspec.kernels.quantize import Int4Linear, quantization_mode, quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import (
    assert_greedy_equivalent,
    attention_masks,
    decode_greedy,
    greedy,
    greedy_by_methods,
    grouped_llama,
    q8_reference,
    random_prompt,
    tiny_gemma3,
    tiny_llama,
    tiny_qwen2,
    tiny_qwen3,
    untrained_head,
)


def test_the_kernels_build_for_the_fastest_instruction_set_this_cpu_has(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)  # a build chosen by hand is not the one this CPU's flags choose
    assert kernels() is not None, unavailable_reason()
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}
    avx2 = {"avx2", "fma", "f16c"}
    expected = ("avx512vnni" if avx512 | {"avx512_vnni"} <= flags else "avx512" if avx512 <= flags
                else "avx2vnni" if avx2 | {"avx_vnni"} <= flags else "avx2" if avx2 <= flags else "portable")
    assert kernels().isa() == selected_isa() == expected


def linear(out_features: int, in_features: int, seed: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight[:, 5] *= 20  # an outlier input channel, as real models have
    return layer


@pytest.mark.parametrize("kind", [GroupedInt4Linear, GroupedInt8Linear])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_multiplies_by_the_dequantized_weight(kind, bias):
    layer = linear(80, 192, seed=0, bias=bias)
    quantized = kind(layer)
    x = torch.randn(5, 192)
    with torch.no_grad(), float_inputs():  # 4 bits: the float-input kernel (8-bit inputs: the test below)
        reference = x.double() @ quantized.dequantized().double().T + (0 if not bias else layer.bias.double())
        out = quantized(x)
    assert out.dtype == torch.float32 and out.shape == (5, 80)
    # float32 sums of 192 products: a relative error of a few 1e-6 of the products' magnitude
    scale = x.abs().double() @ quantized.dequantized().abs().double().T
    assert ((out.double() - reference).abs() <= 1e-5 * scale + 1e-6).all()
    # and the dequantized weight is the layer's to the quantisation step
    step = (layer.weight.detach().reshape(80, -1, GROUP_SIZE).abs().amax(-1) / (7 if kind is GroupedInt4Linear
                                                                                else 127))
    error = (quantized.dequantized() - layer.weight.detach()).reshape(80, -1, GROUP_SIZE).abs().amax(-1)
    assert (error <= step * 1.01).all()
    assert not torch.allclose(out, x @ layer.weight.detach().roll(1, 0).T, atol=1e-2)  # not any matrix will do


@pytest.mark.parametrize("width", [320, 576])
@pytest.mark.parametrize("bits", [4, 5, 8, "8/16"])
def test_quantised_layers_round_their_inputs_to_8_bits_per_group_as_llamacpp_does(bits, width):
    """The kernel's definition (helpers.q8_reference): each group of 32 inputs on signed 8-bit levels, an exact
    integer dot product per group (per 16 inputs where Q6_K's scales are), scaled once. Close to the float product:
    within half an input step per weight. 320 inputs: 10 groups, 5 pairs, a partial block of 16 for the minimum's
    term; 576 (SmolLM2's width): a whole block of 16 groups, then a row's last pair alone."""
    from jointspec.kernels.grouped import GroupedInt5Linear

    groups = width // 32
    layer = linear(80, width, seed=0)
    quantized = GroupedInt4Linear(layer) if bits in (4, 5) else GroupedInt8Linear(layer)
    if bits == 5:
        fifth = torch.randint(-2 ** 31, 2 ** 31 - 1, (80, groups), generator=torch.Generator().manual_seed(1),
                              dtype=torch.int32)
        quantized = GroupedInt5Linear.from_levels(quantized.packed, fifth, quantized.scale, quantized.minimum)
    if bits == "8/16":  # scales per 16 inputs, as GGUF's Q6_K
        scale16 = torch.rand(80, 2 * groups, generator=torch.Generator().manual_seed(1)) * 0.01 + 1e-3
        quantized = GroupedInt8Linear.from_levels(quantized.levels, scale16)
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(2)) * 3
    x[1] = 0.0  # a row of zeros: step 0, no division by it
    x[2, 40:72] = 0.0  # and a group of zeros in a live row
    with torch.no_grad():
        out = quantized(x)
        with float_inputs():
            floats = quantized(x)
    reference, magnitude = q8_reference(x, quantized)
    assert ((out.double() - reference).abs() <= 1e-5 * magnitude + 1e-6).all()
    assert torch.equal(out[1], torch.zeros(80))
    # Against float inputs: each input off by at most half its group's step, so each output by at most that times
    # the weights' magnitudes; and off by more than float rounding (the rounding happens).
    step = x.reshape(6, groups, 32).abs().amax(-1) / 127
    bound = (quantized.dequantized().abs().double().reshape(80, groups, 32).sum(-1) @ (step.double().T / 2)).T
    difference = (out.double() - floats.double()).abs()
    assert (difference <= bound * 1.001 + 1e-5).all()
    assert difference.max() > 1e-3


@pytest.mark.parametrize("bits", [4, 5])
def test_8_bit_inputs_give_the_dequantised_weights_times_the_rounded_inputs(bits):
    """The minimum's (or the offset's) term takes the rounded inputs too, as llama.cpp's Q8_1 sum does, so a 4- or
    5-bit layer on 8-bit inputs is exactly its dequantised weights times the rounded inputs: the rounding errors are
    then weighted by the whole weights, which centre on zero. With the inputs' exact sum in that term they were
    weighted by the levels' part alone (all of one sign), and the output was further from the float product
    (docs/kernels.md, "The minimum's term"). Deterministic: no false failures."""
    from jointspec.kernels.grouped import GroupedInt5Linear

    layer = linear(64, 320, seed=4)
    quantized = GroupedInt4Linear(layer)
    if bits == 5:
        fifth = torch.randint(-2 ** 31, 2 ** 31 - 1, (64, 10), generator=torch.Generator().manual_seed(5),
                              dtype=torch.int32)
        quantized = GroupedInt5Linear.from_levels(quantized.packed, fifth, quantized.scale, quantized.minimum)
    x = torch.randn(7, 320, generator=torch.Generator().manual_seed(6)) * 3
    groups = x.reshape(7, 10, 32)
    top = groups.abs().amax(-1, keepdim=True)
    rounded = (torch.round(groups * (127.0 / top)) * (top / 127.0)).reshape(7, 320).double()
    weights = quantized.dequantized().double()
    with torch.no_grad():
        out = quantized(x).double()
    reference, magnitude = rounded @ weights.T, rounded.abs() @ weights.abs().T
    assert ((out - reference).abs() <= 1e-5 * magnitude + 1e-6).all()
    # and the rounding moved the product (the check above is not of the float product)
    assert (reference - x.double() @ weights.T).abs().max() > 1e-2


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_input_gives_a_nonfinite_row_on_every_build(isa, bad):
    """An 8-bit-input product of a row holding NaN or infinity (activations already broken) is NaN, as the float
    path's is not finite, and leaves the other rows' bits alone. The rounding to 8 bits turned NaN into an integer
    (INT_MIN on x86, undefined in C++), so the row came out finite, and differently by build. Deterministic."""
    layer = GroupedInt4Linear(linear(64, 320, seed=4))
    tensors = [getattr(layer, name) for name in layer.BUFFERS]
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(6))
    broken = x.clone()
    broken[1, 37] = bad
    built = kernels(isa)
    out, clean = built.linear(broken, tensors, False, True), built.linear(x, tensors, False, True)
    assert torch.isnan(out[1]).all()
    assert torch.equal(out[[0, 2]], clean[[0, 2]]) and torch.isfinite(clean).all()


@pytest.mark.parametrize("isa", runnable_isas())
def test_a_group_of_inputs_too_small_to_scale_rounds_to_zero(isa):
    """Inputs whose largest is under about 3.7e-37: 127 / top overflowed, and infinity times the inputs rounded
    every one to -128 whatever its sign. Such a group now gives levels 0 (a product of 0, the float product being
    about 1e-39). Deterministic."""
    layer = GroupedInt4Linear(linear(64, 320, seed=4))
    tensors = [getattr(layer, name) for name in layer.BUFFERS]
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(6))
    x[1] = 0.0
    x[1, :32] = torch.linspace(-1, 1, 32) * 1e-38  # row 1: one group, too small to scale, and zeros
    out = kernels(isa).linear(x, tensors, False, True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # (-128 levels gave about -2e-38 a column)
    assert torch.equal(out[0], kernels(isa).linear(x[:1], tensors, False, True)[0])


def test_degenerate_kernel_calls_are_refused_not_crashes():
    """Calls no Python caller makes, which crashed the process (a division by zero, null reads) until each had its
    check; a sanitizer sweep found them. Deterministic."""
    built, k = kernels(), 64
    x = torch.randn(1, k)
    with pytest.raises(RuntimeError, match="positive multiple of kv_heads"):  # no query heads
        built.attention(torch.randn(0, 2, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 16),
                        torch.empty(0, dtype=torch.bool), torch.tensor([4, 4]), 0.25)
    screen = (torch.zeros(8, k // 2, dtype=torch.uint8), torch.rand(8), torch.ones(k))
    four_bit = [torch.zeros(8, k // 2, dtype=torch.uint8), torch.rand(8, k // 32), torch.rand(8, k // 32),
                torch.zeros(1)]
    with pytest.raises(RuntimeError, match="must be 8-bit or 6-bit, got 4 bits"):
        built.screened_head(x, *screen, four_bit, 6.0, 4, 1, None)
    with pytest.raises(RuntimeError, match="an empty vocabulary"):
        built.screened_head(x, torch.zeros(0, k // 2, dtype=torch.uint8), torch.zeros(0), torch.ones(k),
                            [torch.zeros(0, k, dtype=torch.int8), torch.zeros(0, k // 32)], 6.0, 4, 1, None)
    with pytest.raises(RuntimeError, match="a layer with no output rows"):  # (the offset form, Q4_0's)
        built.linear(x, [torch.zeros(0, k // 2, dtype=torch.uint8), torch.zeros(0, k // 32, dtype=torch.float16),
                         torch.zeros(0, 1, dtype=torch.float16)], False, True)
    layers = built.CompiledLayers()
    part = GroupedInt8Linear(nn.Linear(k, k, bias=False))
    parts = [part.levels, part.scale]
    layers.add_layer(torch.ones(k), torch.ones(k), 1e-6, [parts], parts, [parts], parts, 1, 0.125)
    with pytest.raises(RuntimeError, match="one sequence or more"):
        layers.forward_many(torch.zeros(0, k), [], [], [], [], [], [], [torch.zeros(0, 16)], [torch.zeros(0, 16)], [])


@pytest.mark.parametrize("isa", runnable_isas())
def test_scales_kept_as_halves_give_the_float32_scales_bits(isa):
    """A file's float16 scales and minima (Q4_0/Q4_1/Q5_0/Q5_1) are kept as halves, a sixth fewer bytes to read; the
    kernels widen them exactly, so every path gives the bits of the same values held as float32. Scales that are not
    halves (a K-quant's d times a 6-bit sub-scale) stay float32; mixed types are refused by name."""
    from jointspec.kernels.grouped import GroupedInt5Linear

    module = kernels(isa)
    generator = torch.Generator().manual_seed(3)
    q4 = GroupedInt4Linear(linear(40, 320, seed=2))  # 10 groups: a partial block of 16 minima
    assert q4.scale.dtype == q4.minimum.dtype == torch.float16
    scale32, minimum32 = q4.scale.float(), q4.minimum.float()
    fifth = torch.randint(-2 ** 31, 2 ** 31 - 1, (40, 10), generator=generator, dtype=torch.int32)
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 320, generator=generator) * 3
        for gemm in (False, True):
            for q8 in (True, False):
                module.use_q8_inputs(q8)
                try:
                    assert torch.equal(module.int4_linear(x, q4.packed, q4.scale, q4.minimum, gemm),
                                       module.int4_linear(x, q4.packed, scale32, minimum32, gemm)), (rows, gemm, q8)
                    assert torch.equal(module.int5_linear(x, q4.packed, fifth, q4.scale, q4.minimum, gemm),
                                       module.int5_linear(x, q4.packed, fifth, scale32, minimum32, gemm))
                finally:
                    module.use_q8_inputs(True)
    k_scale = scale32 * 37  # 6 more significant bits than a half holds, for most values
    kept = GroupedInt4Linear.from_levels(q4.packed, k_scale, minimum32)
    assert kept.scale.dtype == kept.minimum.dtype == torch.float32 and torch.equal(kept.scale, k_scale)
    five = GroupedInt5Linear.from_levels(q4.packed, fifth, q4.scale.float(), q4.minimum.float())
    assert five.scale.dtype == torch.float16
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        module.int4_linear(torch.randn(1, 320), q4.packed, q4.scale, minimum32, False)


@pytest.mark.parametrize("kind", [GroupedInt4Linear, GroupedInt8Linear])
def test_rows_are_bitwise_independent_of_the_batch(kind):
    quantized = kind(linear(48, 128, seed=1))
    x = torch.randn(17, 128) * 3
    with torch.no_grad():
        alone = torch.cat([quantized(x[i:i + 1]) for i in range(len(x))])
        for size in (2, 3, 4, 5, 7, 8, 9, 17):  # row tiles of 1-8 (8-bit inputs) and the buffered
            batched = torch.cat([quantized(x[i:i + size]) for i in range(0, len(x), size)])
            assert torch.equal(batched, alone), f"batches of {size}"
        assert torch.equal(quantized(x[None]).reshape(17, -1), alone)



@pytest.mark.parametrize("kind", [GroupedInt4Linear, GroupedInt8Linear])
def test_a_padded_batch_past_the_row_wise_limit_gives_each_sequence_its_own_bits(kind):
    # The ragged engine's rounds feed [sequences, rows, in]: 16 x 20 rows pass ROWWISE_MAX_ROWS together, which
    # took the prompt GEMM (other bits, 1e-2 apart) where each sequence alone is row-wise. A sequence longer than
    # the limit is a prompt, as row-wise attention counts it.
    from jointspec.kernels.grouped import ROWWISE_MAX_ROWS

    quantized = kind(linear(48, 128, seed=1))
    x = torch.randn(16, 20, 128) * 3
    assert x.shape[0] * x.shape[1] > ROWWISE_MAX_ROWS
    with torch.no_grad():
        assert torch.equal(quantized(x), torch.cat([quantized(x[i:i + 1]) for i in range(len(x))]))
        long = torch.randn(2, ROWWISE_MAX_ROWS + 1, 128)
        row_wise = torch.cat([quantized(long[:, i:i + 1]) for i in range(long.shape[1])], dim=1)
        assert not torch.equal(quantized(long), row_wise)  # the GEMM: what a prompt of its length takes

def test_weights_already_on_the_grids_come_back_unchanged():
    """A Q4_1- or Q8_0-style weight (levels times a per-32 scale, plus a minimum for 4 bits, each level range used in
    full, as those formats' quantisers make it; Q4_1 keeps its scale and minimum as float16) is recovered: the int4
    model of a GGUF-born float model is that float model, not a second rounding of it."""
    generator = torch.Generator().manual_seed(0)
    out_features, groups = 64, 6
    levels = torch.randint(0, 16, (out_features, groups, GROUP_SIZE), generator=generator)
    levels[..., 0], levels[..., 1] = 0, 15  # the block's minimum and maximum map to the extreme levels
    scale = torch.rand(out_features, groups, 1, generator=generator) * 0.1 + 1e-3
    minimum = -torch.rand(out_features, groups, 1, generator=generator)
    q4 = nn.Linear(groups * GROUP_SIZE, out_features, bias=False)
    with torch.no_grad():
        q4.weight.copy_((levels * scale.half().float() + minimum.half().float()).reshape(out_features, -1))
    recovered = GroupedInt4Linear(q4)
    assert recovered.scale.dtype == torch.float16 and torch.equal(recovered.dequantized(), q4.weight)
    signed = torch.randint(-127, 128, (out_features, groups, GROUP_SIZE), generator=generator)
    signed[..., 0] = 127
    q8 = nn.Linear(groups * GROUP_SIZE, out_features, bias=False)
    with torch.no_grad():
        q8.weight.copy_((signed * scale).reshape(out_features, -1))
    assert torch.allclose(GroupedInt8Linear(q8).dequantized(), q8.weight, rtol=0, atol=1e-6)


def test_int4_mode_takes_the_grouped_kernel_where_it_runs():
    model = quantize_model(grouped_llama(0), "int4")
    assert quantization_mode(model) == "int4"
    kinds = {type(m) for m in model.modules()} & {GroupedInt4Linear, GroupedInt8Linear, Int4Linear, nn.Linear}
    kinds |= {type(m) for m in model.modules()} & {ScreenedInt8Head}
    assert kinds == {GroupedInt4Linear, ScreenedInt8Head}  # the head: int8, with its greedy screen
    assert type(quantize_model(grouped_llama(0), "int4", screen_head=False).lm_head) is GroupedInt8Linear


def head(out_features: int = 512, in_features: int = 128, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        layer.weight.mul_(torch.rand(1, in_features) * 4)  # columns of unequal sizes, as a real head's
    return layer


def test_a_six_bit_layer_is_its_eight_bit_k_form_bit_for_bit():
    """GGUF's Q6_K kept in 6 bits a level (GroupedInt6Linear) gives the bits of the same levels and K-quant scales in
    8 bits, on every build this CPU runs, for every path (one row, a few, many; 8-bit or float inputs; the GEMM),
    and its storage round-trips; levels that do not fit in 6 bits are refused by their range."""
    generator = torch.Generator().manual_seed(11)
    levels = torch.randint(-32, 32, (40, 512), generator=generator, dtype=torch.int8)
    levels[0, :64] = torch.arange(-32, 32, dtype=torch.int8)  # every level
    scale = torch.rand(40, 2, generator=generator) * 0.01
    sub = torch.randint(-128, 128, (40, 32), generator=generator, dtype=torch.int8)
    eight = GroupedInt8Linear.from_levels(levels, scale, sub=sub)
    six = GroupedInt6Linear.from_int8(eight)
    assert six.packed.shape == (40, 256) and six.plane.shape == (40, 128)  # 6 bits a level
    assert torch.equal(six.signed_levels(), levels) and torch.equal(six.dequantized(), eight.dequantized())
    for isa in runnable_isas():
        module = kernels(isa)
        for rows in (1, 2, 3, 4, 5, 8, 9, 70):
            x = torch.randn(rows, 512, generator=generator) * 3
            for gemm in (False, True):
                for q8 in (True, False):
                    ours = module.linear(x, [getattr(six, name) for name in six.BUFFERS], gemm, q8)
                    assert torch.equal(ours, module.linear(x, [levels, scale, sub], gemm, q8)), (isa, rows, gemm, q8)
    with pytest.raises(ValueError, match="-32..31"):
        GroupedInt6Linear.from_int8(GroupedInt8Linear.from_levels(levels.clamp(max=31) + 1, scale, sub=sub))
    with pytest.raises(RuntimeError, match="6-bit levels come as"):
        kernels().linear(torch.randn(1, 512), [six.packed, six.plane[:, :64].contiguous(), scale, sub], False, True)


def test_the_screened_head_computes_the_int8_heads_logits():
    layer = head()
    screened, plain = ScreenedInt8Head(layer), GroupedInt8Linear(layer)
    x = torch.randn(7, 128) * 3
    with torch.no_grad(), float_inputs():  # (the screened head's logits are on float inputs; a projection's are not)
        assert torch.equal(screened(x), plain(x))  # forward: the exact head, bit for bit
        # With a margin and a cap that take every token, the screen's result is the exact head's too.
        screened.margin, screened.max_exact = 1e9, 512
        assert torch.equal(screened.argmax_logits(x), plain(x))


def test_the_screen_gives_exact_logits_exactly_near_each_rows_best_score():
    """Tokens whose 4-bit score is within the margin of the best get the int8 head's logit (the same bits), the
    rest keep their score; and the argmax is the exact head's on every one of 2,000 seeded rows."""
    layer = head(seed=1)
    screened = ScreenedInt8Head(layer, margin=1.5)
    torch.manual_seed(2)
    x = torch.randn(2000, 128) * 2
    with torch.no_grad():
        plain = GroupedInt8Linear(layer)
        with float_inputs():  # the head's exact logits are on float inputs
            exact = torch.cat([plain(x[i:i + 4]) for i in range(0, len(x), 4)])  # row by row, as decoding runs it
        screened.margin = -1.0
        scores = screened.argmax_logits(x)  # a negative margin: the 4-bit scores alone, none exact
        screened.margin = 1.5
        out = screened.argmax_logits(x)
    near = scores >= scores.max(dim=1, keepdim=True).values - 1.5
    assert torch.equal(out[near], exact[near])
    assert torch.equal(out[~near], scores[~near])
    assert not torch.equal(scores, exact)  # the scores are approximate: the test compares two different things
    assert 1.0 < near.sum(1).float().mean() < 100  # the margin picks a few tokens, not none and not all
    # The screen's error: about a tenth of these logits' spread. So the exact argmax is always within the margin.
    assert torch.equal(out.argmax(1), exact.argmax(1))
    # At most max_exact a row: the best scores within the margin (ties to the lower id).
    screened.margin, screened.max_exact = 1e9, 5
    with torch.no_grad():
        capped = screened.argmax_logits(x[:50])
    best = torch.sort(-scores[:50], dim=1, stable=True).indices[:, :5]
    took = torch.zeros_like(capped, dtype=torch.bool).scatter_(1, best, True)
    assert torch.equal(capped[took], exact[:50][took]) and torch.equal(capped[~took], scores[:50][~took])


@pytest.mark.parametrize("k", [2, 5, 16])
def test_the_top_k_screen_gives_exact_logits_exactly_near_each_rows_kth_best_score(k):
    """Sampling with top-k reads a row's k largest logits: tokens whose 4-bit score is within the margin of the
    row's k-th best score get the int8 head's logit (the same bits), the rest keep their score, and the k largest
    entries are the exact head's k largest, tokens and values, on every one of 2,000 seeded rows."""
    layer = head(seed=1)
    screened = ScreenedInt8Head(layer, margin=1.5)
    torch.manual_seed(2)
    x = torch.randn(2000, 128) * 2
    with torch.no_grad():
        with float_inputs():  # the head's exact logits are on float inputs
            exact = torch.cat([GroupedInt8Linear(layer)(x[i:i + 4]) for i in range(0, len(x), 4)])
        screened.margin = -1.0
        scores = screened.argmax_logits(x)  # the 4-bit scores alone
        screened.margin = 1.5
        out = screened.top_k_logits(x, k)
    near = scores >= scores.topk(k, dim=1).values[:, -1:] - 1.5
    assert (near.sum(1) < screened.exact_per_rank * k).all()  # the margin decides here, not the cap
    assert torch.equal(out[near], exact[near]) and torch.equal(out[~near], scores[~near])
    assert near.sum(1).float().mean() > k + 1  # more than the k: the test compares more than it keeps
    top, top_exact = out.topk(k, dim=1), exact.topk(k, dim=1)
    assert torch.equal(top.values, top_exact.values) and torch.equal(top.indices, top_exact.indices)
    # Past the margin, the cap: exact_per_rank * k exact logits at most, the best scores.
    screened.margin, screened.exact_per_rank = 1e9, 2
    with torch.no_grad():
        capped = screened.top_k_logits(x[:50], k)
    best = torch.sort(-scores[:50], dim=1, stable=True).indices[:, :2 * k]
    took = torch.zeros_like(capped, dtype=torch.bool).scatter_(1, best, True)
    assert torch.equal(capped[took], exact[:50][took]) and torch.equal(capped[~took], scores[:50][~took])
    with pytest.raises(ValueError, match="k in"):
        screened.top_k_logits(x[:1], 65)


@pytest.mark.parametrize("k", [1, 3])
def test_the_screen_under_a_grammar_completes_the_allowed_tokens_near_their_best(k):
    """Structured output reads the screen with each row's allowed tokens: the others are minus infinity, and the
    allowed tokens within the margin of the best allowed score (its k-th best, for a top k) get the int8 head's
    logit, the rest of the allowed keep their score. Each row's allowed set leaves out its 8 best-scoring tokens,
    so a screen that searched every token and masked afterwards would complete none of them (tested: it fails)."""
    layer = head(seed=5)
    screened = ScreenedInt8Head(layer, margin=1.5)
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(300, 128, generator=generator) * 2
    with torch.no_grad():
        with float_inputs():
            exact = torch.cat([GroupedInt8Linear(layer)(x[i:i + 4]) for i in range(0, len(x), 4)])
        screened.margin = -1.0
        scores = screened.argmax_logits(x)
        screened.margin = 1.5
        allowed = torch.rand(scores.shape, generator=generator) < 0.5
        allowed.scatter_(1, scores.topk(8, dim=1).indices, False)
        allowed[0] = False  # a row with nothing allowed: every entry minus infinity, nothing completed
        allowed[1] = False
        allowed[1, 7] = True  # one allowed token: it is the row's best, whatever its score
        out = screened.argmax_logits(x, allowed) if k == 1 else screened.top_k_logits(x, k, allowed)
    assert (out[~allowed] == float("-inf")).all()
    masked = scores.masked_fill(~allowed, float("-inf"))
    bar = masked.topk(k, dim=1).values[:, -1:] - 1.5
    near = allowed & (masked >= bar)
    assert torch.equal(out[near], exact[near])
    far = allowed & ~near
    assert torch.equal(out[far], scores[far]) and far.any()
    assert near[2:].sum(1).min() >= k and out[1, 7] == exact[1, 7]
    top, top_exact = out[2:].topk(k, dim=1), exact[2:].masked_fill(~allowed[2:], float("-inf")).topk(k, dim=1)
    assert torch.equal(top.indices, top_exact.indices) and torch.equal(top.values, top_exact.values)
    arguments = [screened.screen4, screened.screen_scale, screened.column,
                 [getattr(screened, name) for name in screened.BUFFERS]]
    max_exact = screened.max_exact if k == 1 else max(k, screened.exact_per_rank * k)
    for isa in runnable_isas():  # every build this CPU runs gives the same bits
        assert torch.equal(kernels(isa).screened_head(x, *arguments, 1.5, max_exact, k, allowed), out), isa
    with pytest.raises(RuntimeError, match="allowed must be"):
        kernels().screened_head(x[:2], screened.screen4, screened.screen_scale, screened.column,
                                [getattr(screened, name) for name in screened.BUFFERS], 1.5, 64, 1,
                                allowed[:2, :100].contiguous())


def test_screened_rows_are_bitwise_independent_of_the_batch():
    screened = ScreenedInt8Head(head(seed=3))
    x = torch.randn(17, 128) * 3
    with torch.no_grad():
        for read in (screened.argmax_logits, lambda rows: screened.top_k_logits(rows, 7)):
            alone = torch.cat([read(x[i:i + 1]) for i in range(len(x))])
            for size in (2, 4, 5, 17):
                batched = torch.cat([read(x[i:i + size]) for i in range(0, len(x), size)])
                assert torch.equal(batched, alone), f"batches of {size}"


def test_greedy_decoding_reads_the_screen_and_sampling_the_exact_head(monkeypatch):
    model = quantize_model(grouped_llama(0), "int4")
    assert model.lm_head.margin == SCREEN_MARGIN
    calls, exact_calls = [], []
    original, exact = ScreenedInt8Head.argmax_logits, ScreenedInt8Head.forward
    monkeypatch.setattr(ScreenedInt8Head, "argmax_logits",
                        lambda self, x, *rest: calls.append(x.shape) or original(self, x, *rest))
    monkeypatch.setattr(ScreenedInt8Head, "forward", lambda self, x: exact_calls.append(x.shape) or exact(self, x))
    target = CausalLM(model, name="int4")
    assert target.capabilities.argmax_screen
    drafter, verifier = build_method(MethodContext(MethodConfig(name="pld"), target, None, load_draft=None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    decoder.generate(random_prompt(0), greedy(20))
    assert len(calls) == decoder.stats.num_rounds  # every verification forward, not the prefill
    assert exact_calls == []
    calls.clear()
    # Sampling with a top-p alone, or a top-k past the screen's, reads every logit of the exact head.
    for sampling in (SamplingConfig(temperature=1.0, top_k=target.capabilities.top_k_screen + 1),
                     SamplingConfig(temperature=1.0, top_p=0.9)):
        decoder.generate(random_prompt(0), DecodeConfig(max_new_tokens=20, sampling=sampling),
                         torch.Generator().manual_seed(0))
        assert calls == [] and len(exact_calls) == decoder.stats.num_rounds
        exact_calls.clear()
    # Temperature alone: lookup drafts' rows are drawn through the screen (ScreenedInt8Head.draw_tokens).
    draws, original_draws = [], ScreenedInt8Head.draw_tokens
    def counted(self, x, *args, **kwargs):
        draws.append(x.shape)
        return original_draws(self, x, *args, **kwargs)
    monkeypatch.setattr(ScreenedInt8Head, "draw_tokens", counted)
    decoder.generate(random_prompt(0), DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1.0)),
                     torch.Generator().manual_seed(0))
    assert calls == [] and exact_calls == [] and len(draws) == decoder.stats.num_rounds


SAMPLED_TOP_K = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)


def sample_with(model, method: str, prompt: list[int], seed: int, *, screen: bool = True) -> list[int]:
    target = CausalLM(model, name="int4")
    if not screen:
        target.lean.screens_head = False  # this adapter reads the exact head: what the screen must give
    assert target.capabilities.top_k_screen == (SCREEN_TOP_K_MAX if screen else 0)
    drafter, verifier = build_method(MethodContext(MethodConfig(name=method), target, None, load_draft=None))
    decoder = SpeculativeDecoder(target, drafter, verifier)
    config = DecodeConfig(max_new_tokens=40, sampling=SAMPLED_TOP_K)
    return decoder.generate(prompt, config, torch.Generator().manual_seed(seed))


def test_sampling_with_a_top_k_reads_the_screens_top_k_and_samples_the_exact_heads_tokens(monkeypatch):
    # A sampled row with a top-k reads the screen's top k (exact logits for every token near the k-th best score),
    # and its k largest are the exact head's: seeded, plain sampling through the screen samples the tokens it samples
    # from the exact head.
    model = quantize_model(grouped_llama(0), "int4")
    calls = []
    original = ScreenedInt8Head.top_k_logits
    monkeypatch.setattr(ScreenedInt8Head, "top_k_logits",
                        lambda self, x, k, *rest: calls.append(k) or original(self, x, k, *rest))
    for seed in range(3):
        prompt = random_prompt(seed, length=12)
        calls.clear()
        screened = sample_with(model, "ar", prompt, seed)
        assert calls == [SAMPLED_TOP_K.top_k] * 40  # every token's row, not the prefill
        assert screened == sample_with(model, "ar", prompt, seed, screen=False), seed


@pytest.mark.parametrize("method", ["pld", "lookahead"])
def test_lookup_drafts_sample_what_plain_sampling_samples_through_a_screen_that_misses(method):
    # Plain sampling reads the screen's top k; a verifier that read other logits (the exact head's) would draw other
    # tokens wherever the screen missed one of the exact top k (not guaranteed). A screen narrowed to k exact logits
    # and no margin misses often, and lookup drafts must still sample plain sampling's tokens.
    model = quantize_model(grouped_llama(0), "int4")
    model.lm_head.margin, model.lm_head.exact_per_rank = 0.0, 1
    misses = 0
    for seed in range(4):
        prompt = random_prompt(seed, length=6) * 3  # repeats itself: lookup drafts from the first round
        expected = sample_with(model, "ar", prompt, seed)
        assert sample_with(model, method, prompt, seed) == expected, seed
        misses += expected != sample_with(model, "ar", prompt, seed, screen=False)
    assert misses > 0  # the narrowed screen did change what plain sampling reads: the test tells the two apart


@pytest.mark.parametrize("method, options", [("sps", {}), ("specinfer", {"tree": (2, 2)}), ("mtad", {}),
                                             ("mtad-tree", {"beam_width": 2, "num_draft_tokens": 3})])
def test_greedy_verifiers_read_the_argmax_plain_greedy_reads(method, options):
    # Plain greedy decoding reads the screened head; a verifier that read the exact logits instead would commit other
    # tokens wherever the screen missed the exact argmax (not guaranteed). A screen narrowed to nothing (margin 0,
    # one exact logit a row) misses often: every greedy verifier must still give ar's tokens. MTAD read the exact
    # head here and differed on most prompts.
    model = quantize_model(grouped_llama(0), "int4")
    model.lm_head.margin, model.lm_head.max_exact = 0.0, 1
    for seed in range(4):
        prompt = random_prompt(seed, length=12)
        expected = decode_greedy(CausalLM(model, name="ar"), prompt, "ar", 40)
        config = MethodConfig(name=method, draft="self", cost_aware=False, **options)
        target = CausalLM(model, name="int4")
        drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
        assert SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(40)) == expected, seed

@pytest.mark.parametrize("method, draft, tree", [("pld", None, None), ("sps", "self", None),
                                                 ("specinfer", "self", (2, 2))])
@pytest.mark.parametrize("prompt_seed", [0, 3])
def test_speculative_methods_equal_plain_greedy_on_the_grouped_int4_model(method, draft, tree, prompt_seed):
    model = quantize_model(grouped_llama(0), "int4")
    prompt = random_prompt(prompt_seed)
    outputs = []
    for name in ("ar", method):
        target = CausalLM(model, name="int4")
        config = MethodConfig(name=name, draft=draft if name != "ar" else None, tree=tree if name != "ar" else None,
                              cost_aware=False if draft == "self" else None)  # a self-draft never pays: every round
        drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
        decoder = SpeculativeDecoder(target, drafter, verifier)
        outputs.append(decoder.generate(prompt, greedy(40)))
        if name != "ar" and draft == "self":
            assert decoder.stats.num_accepted_tokens > 0  # the drafts were verified, not skipped
    assert len(outputs[0]) == 40 and outputs[1] == outputs[0]


def test_fused_calls_give_the_separate_layers_bits_and_step_aside_when_a_layer_changes():
    model = quantize_model(grouped_llama(1), "int4")
    lean, stock = CausalLM(model, name="fused"), CausalLM(model, name="separate", lean=False)
    assert all(qkv is not None and gate_up is not None for qkv, gate_up in lean.lean.fused)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.packed.untyped_storage().data_ptr() == attn.v_proj.packed.untyped_storage().data_ptr()
    lean.lean.compiled = None  # the fused calls inside the operation-by-operation forward, not the compiled layer
    context, new = random_prompt(2), [7, 8, 9]
    for adapter in (lean, stock):
        adapter.forward(context, num_logits=0)
    assert torch.equal(lean.forward(new).logits, stock.forward(new).logits)
    # A layer replaced after the adapter was built: the stale fused call must not run.
    attn.k_proj = GroupedInt4Linear(linear(attn.k_proj.out_features, attn.k_proj.in_features, seed=3))
    qkv, _ = lean.lean.fused[0]
    assert not qkv.valid([attn.q_proj, attn.k_proj, attn.v_proj])
    for adapter in (lean, stock):
        adapter.crop(len(context))
    assert torch.equal(lean.forward(new).logits, stock.forward(new).logits)


def test_compiled_layers_compute_the_int4_model_one_row_at_a_time():
    """The compiled decoder layer (csrc decoder_layer): close to the operation-by-operation forward, and each row
    alone: a chain of tokens, and every node of a tree, get bit for bit the logits of feeding them one by one."""
    model = quantize_model(grouped_llama(1), "int4")
    compiled, python = CausalLM(model, name="compiled"), CausalLM(model, name="python")
    python.lean.compiled = None
    assert compiled.lean.compiled is not None
    context = random_prompt(2)
    with float_inputs():  # (8-bit inputs would turn float rounding differences into flipped levels)
        ours, theirs = compiled.forward(context, output_hidden=True), python.forward(context, output_hidden=True)
        compiled.crop(0)
        python.crop(0)
    # Another order of float32 sums over the same quantised weights: differences of float rounding only.
    assert torch.allclose(ours.logits, theirs.logits, rtol=1e-4, atol=1e-4)
    assert torch.allclose(ours.hidden, theirs.hidden, rtol=1e-4, atol=1e-4)
    compiled.forward(context)
    new = [7, 8, 9, 10, 11, 12]  # more rows than the kernel's in-register path takes: both paths, same bits
    chain = compiled.forward(new).logits
    compiled.crop(len(context))
    steps = torch.cat([compiled.forward([token]).logits for token in new])
    compiled.crop(len(context))
    assert torch.equal(chain, steps)
    tree = compiled.forward(new[:4], parents=[-1, 0, 0, 1]).logits  # 7 -> (8 -> 10, 9)
    compiled.crop(len(context))
    assert torch.equal(tree[[0, 1, 3]], compiled.forward([7, 8, 10]).logits)
    compiled.crop(len(context))
    assert torch.equal(tree[[0, 2]], compiled.forward([7, 9]).logits)


def test_a_replaced_layer_takes_the_model_off_the_compiled_layers():
    model = quantize_model(grouped_llama(1), "int4")
    lean, stock = CausalLM(model, name="lean"), CausalLM(model, name="transformers", lean=False)
    mlp = model.model.layers[1].mlp
    mlp.down_proj = GroupedInt4Linear(linear(mlp.down_proj.out_features, mlp.down_proj.in_features, seed=4))
    context = random_prompt(2)
    # Off the compiled layers the lean forward is transformers' operations, bit for bit.
    assert torch.equal(lean.forward(context).logits, stock.forward(context).logits)


def test_a_layer_replaced_after_forwards_takes_the_model_off_the_compiled_layers():
    """The full identity check runs again only after a registration anywhere (torch's global hooks); a module set
    through the module API mid-model, a buffer replaced the way Module._apply does it (past the hooks) in the first
    layer, are both seen at the next forward."""
    model = quantize_model(grouped_llama(1), "int4")
    lean, stock = CausalLM(model, name="lean"), CausalLM(model, name="transformers", lean=False)
    forward = lean.lean
    assert forward.compiled is not None and forward._compiled_model_ready()
    # Nothing registered since the last full check: it is not run again (a check list that would fail is not read).
    owners, names, expected = forward._compiled_checks
    forward._compiled_checks = (owners, names, [object()] * len(expected))
    assert forward._compiled_model_ready()
    torch.nn.Module().register_buffer("unrelated", torch.zeros(1))  # any registration: the next call checks in full
    assert not forward._compiled_model_ready()
    forward._compiled_checks = (owners, names, expected)
    assert forward._compiled_model_ready()

    context = random_prompt(2)
    attn = model.model.layers[1].self_attn  # outside the sample every forward tests (the ends' 12 entries each)
    assert all(module is not attn.o_proj for module in forward._compiled_sample[2])
    attn.o_proj = GroupedInt4Linear(linear(attn.o_proj.out_features, attn.o_proj.in_features, seed=4))
    assert not forward._compiled_model_ready()
    assert torch.equal(lean.forward(context).logits, stock.forward(context).logits)

    model = quantize_model(grouped_llama(1), "int4")
    lean = CausalLM(model, name="lean")
    assert lean.lean._compiled_model_ready()
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj._buffers["scale"] = q_proj._buffers["scale"].clone()  # what Module._apply does: no hook runs
    assert not lean.lean._compiled_model_ready()


def test_compiled_attention_is_attention():
    """The compiled attention (what quantised models' row-wise attention calls) against PyTorch's, causal and with
    a tree-style mask, with grouped key/value heads."""
    compiled = kernels()
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, keys = 6, 2, 32, 40
    query = torch.randn(heads, 3, dim, generator=generator)
    key, value = (torch.randn(kv_heads, keys, dim, generator=generator) for _ in range(2))
    visible = torch.rand(3, keys, generator=generator) > 0.4
    visible[:, 0] = True
    out = compiled.attention(query, key, value, visible, torch.empty(0, dtype=torch.long), dim ** -0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(query[None], key[None], value[None],
                                                                 attn_mask=visible[None, None], enable_gqa=True)
    assert torch.allclose(out, reference[0].transpose(0, 1), atol=1e-5)
    lengths = torch.tensor([38, 39, 40])
    out = compiled.attention(query, key, value, torch.empty(0, dtype=torch.bool), lengths, dim ** -0.5)
    causal = torch.arange(keys)[None] < lengths[:, None]
    reference = torch.nn.functional.scaled_dot_product_attention(query[None], key[None], value[None],
                                                                 attn_mask=causal[None, None], enable_gqa=True)
    assert torch.allclose(out, reference[0].transpose(0, 1), atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, dim, keys, rows", [
    (9, 3, 64, 7000, 1),  # a long context's decode step: the prefix scored in spans over the threads
    (9, 3, 64, 300, 6),  # a verification: shared cache, each row's own draft keys
    (9, 3, 64, 2000, 40),  # many rows at a long context: values in spans, passes in more than one task
    (4, 2, 16, 1100, 500),  # more rows than one block of scores holds
    (6, 6, 32, 37, 3),  # no grouped heads, a partial tile of sixteen keys
    (8, 2, 128, 20, 2),
])
def test_compiled_attention_is_its_pairwise_definition_bit_for_bit(heads, kv_heads, dim, keys, rows):
    """attend_all shares keys and values among the (row, head) pairs that see them; each pair must still get exactly
    the bits of the definition computed one pair at a time (which is what makes a row verified among others equal
    the row decoded alone): causal rows, tree-style rows (shared cache plus a few of the draft keys) and rows that
    share nothing."""
    compiled = kernels()
    generator = torch.Generator().manual_seed(keys + rows)
    query = torch.randn(heads, rows, dim, generator=generator)
    key, value = (torch.randn(kv_heads, keys, dim, generator=generator) for _ in range(2))
    chosen = compiled.scores_by_key()
    try:
        for by_key in (True, False):  # a shared prefix scored key by key for many pairs (AVX2's way), or pair by pair
            compiled.use_scores_by_key(by_key)
            for visible, lengths in attention_masks(rows, keys, generator):
                assert torch.equal(compiled.attention(query, key, value, visible, lengths, dim ** -0.5),
                                   compiled.attention_pairwise(query, key, value, visible, lengths, dim ** -0.5))
    finally:
        compiled.use_scores_by_key(chosen)


def test_portable_prompt_prefills_take_the_gemm_and_decoding_stays_exact(monkeypatch):
    """On the portable build, a forward that wants no logits (the loop's prompt prefill) runs the compiled layers'
    projections as one GEMM (rows not computed alone); plain and speculative decoding prefill alike, so they still
    agree exactly. (The vector builds read prompts row-wise: test_backends_hf.py.)"""
    from jointspec.kernels import grouped

    monkeypatch.setenv(grouped.ISA_ENV, "portable")
    model = quantize_model(grouped_llama(0), "int4")
    real, flags = grouped.kernels(), []

    class RecordingStack:  # the compiled layers, recording each forward's `gemm` flag
        def __init__(self):
            self.stack = real.CompiledLayers()

        def __getattr__(self, name):
            return getattr(self.stack, name)

        def forward(self, hidden, start, visible, lengths, cos, sin, gemm, keep):
            flags.append(gemm)
            return self.stack.forward(hidden, start, visible, lengths, cos, sin, gemm, keep)

    class Recording:
        CompiledLayers = RecordingStack

        def __getattr__(self, name):
            return getattr(real, name)
    monkeypatch.setattr(grouped, "kernels", lambda isa=None: Recording())
    prompt = random_prompt(5, length=40)
    gemm, rows = CausalLM(model, name="gemm"), CausalLM(model, name="rows")
    with float_inputs():  # the row path on float inputs, as the GEMM's
        gemm.forward(prompt, num_logits=0)
        rows.forward(prompt, num_logits=1)
        assert flags == [True, False]
        # The GEMM sums in another order: the next step differs from the row path's by float rounding only.
        assert torch.allclose(gemm.forward([7]).logits, rows.forward([7]).logits, rtol=1e-4, atol=1e-4)
    outputs = []
    for name, draft, tree in [("ar", None, None), ("pld", None, None), ("sps", "self", None),
                              ("specinfer", "self", (2, 2))]:
        target = CausalLM(model, name="int4")
        config = MethodConfig(name=name, draft=draft, tree=tree, cost_aware=False if draft == "self" else None)
        drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
        outputs.append(SpeculativeDecoder(target, drafter, verifier).generate(prompt, greedy(40)))
    assert len(outputs[0]) == 40 and all(output == outputs[0] for output in outputs)


# Int8 draft heads (drafts/eagle.py, HEAD_WEIGHT_CHOICES): a bound EAGLE head's fc, body and LM-head rows on the int8
# kernel. Deterministic (seeded weights and prompts): no false-failure odds.

def int8_and_float_heads(seed: int = 0):
    """The same untrained head for the 64-wide tiny target, bound once with int8 weights and once float32."""
    import copy

    from jointspec.drafts.eagle import HeadDraftModel

    target = CausalLM(grouped_llama(seed), name="tiny-64")
    head = untrained_head(target, seed=seed, draft_vocab_size=40)
    return (HeadDraftModel(copy.deepcopy(head), target, weights="int8"),
            HeadDraftModel(head, target, weights="float32"), target)


def test_an_int8_head_drafts_from_int8_weights_close_to_its_float_self():
    int8_head, float_head, target = int8_and_float_heads()
    assert int8_head.weights == "int8" and float_head.weights == "float32"
    body_linears = [type(m) for m in int8_head.head.body.modules() if isinstance(m, (nn.Linear, GroupedInt8Linear))]
    assert body_linears and set(body_linears) == {GroupedInt8Linear}
    assert type(int8_head.head.fc) is GroupedInt8Linear and type(float_head.head.fc) is nn.Linear
    assert int8_head.dtype == torch.float32 and int8_head.device.type == "cpu"  # its activations', not fc's levels'
    prompt = random_prompt(4)
    target.reset()
    target.forward(prompt[:-1], num_logits=0)
    rows = [draft.forward(prompt + [5, 6]).logits for draft in (int8_head, float_head)]
    drafted = torch.isfinite(rows[1])  # the draft vocabulary; -inf elsewhere in both
    assert torch.equal(torch.isfinite(rows[0]), drafted)
    difference = (rows[0][drafted] - rows[1][drafted]).abs().max()
    assert 0 < difference < 0.05 * rows[1][drafted].abs().max()  # int8 rounding: present, and small


def test_a_head_bound_twice_keeps_its_int8_weights_and_float_activations():
    """Binding converts the head's linears in place, so a second binding of the same head object finds them int8
    already: it must still bind as int8, compute in float32 and draft what the first binding drafts."""
    from jointspec.drafts.eagle import HeadDraftModel

    int8_head, _, target = int8_and_float_heads()
    again = HeadDraftModel(int8_head.head, target, weights="auto")
    assert again.weights == "int8" and again.dtype == torch.float32 and again.lm_weight.dtype == torch.float32
    assert HeadDraftModel(int8_head.head, target, weights="int8").weights == "int8"
    prompt = random_prompt(4)
    target.reset()
    target.forward(prompt[:-1], num_logits=0)
    first = int8_head.forward(prompt + [5, 6]).logits
    int8_head.reset()
    assert torch.equal(again.forward(prompt + [5, 6]).logits, first)


@pytest.mark.skipif(selected_isa() == "portable", reason="the compiled decoder layers run on the vector builds only")
def test_an_int8_heads_body_runs_as_one_compiled_call_close_to_its_operations():
    """An int8 head's one-layer body runs as one call of the compiled decoder layers (lean_forward.CompiledBody): the
    operations' results to float rounding, for a chain fed in one call and for a tree's masked levels. Deterministic:
    no false-failure odds."""
    import copy

    from jointspec.backends.lean_forward import CompiledBody
    from jointspec.drafts.eagle import HeadDraftModel

    target = CausalLM(grouped_llama(2), name="tiny-64")
    head = untrained_head(target, seed=2, draft_vocab_size=40)
    compiled, stepwise = (HeadDraftModel(copy.deepcopy(head), target, weights="int8") for _ in range(2))
    assert isinstance(compiled._lean, CompiledBody)
    stepwise._lean = True  # the same body through lean_body_forward's separate operations
    prompt = random_prompt(6)
    target.reset()
    target.forward(prompt[:-1], num_logits=0)
    for call in ({"token_ids": prompt + [5, 6]}, {"token_ids": [7, 8, 9, 10], "parents": [-1, -1, 0, 1]}):
        rows = [draft.forward(**call).logits for draft in (compiled, stepwise)]
        drafted = torch.isfinite(rows[1])
        assert torch.equal(torch.isfinite(rows[0]), drafted)
        torch.testing.assert_close(rows[0][drafted], rows[1][drafted], rtol=1e-4, atol=1e-4)
        for draft in (compiled, stepwise):
            draft.crop(len(prompt))


@pytest.mark.skipif(selected_isa() == "portable", reason="the compiled decoder layers run on the vector builds only")
def test_int8_heads_context_calls_in_one_pass_give_each_calls_own_bits():
    """A batched server's round feeds several requests' heads (one template, each bound to its own fork) their
    committed tokens in one pass of the head's weights (drafts/eagle.py, context_logits_many): the logits and the
    state afterwards (entries, exact count, predicted features, cache rows) are each call's alone, bit for bit, over
    two rounds. Deterministic: no false-failure odds."""
    from jointspec.backends.lean_forward import CompiledBody
    from jointspec.drafts.eagle import HeadDraftModel, context_logits_many

    target = CausalLM(grouped_llama(2), name="tiny-64")
    template = HeadDraftModel(untrained_head(target, seed=2, draft_vocab_size=40), target, weights="int8").template()
    assert isinstance(template._lean, CompiledBody)
    prompts = [random_prompt(seed, length=5 + 4 * seed) for seed in range(3)]
    sides = {}
    for side in ("together", "alone"):
        forks = [target.fork(f"{side} {i}") for i in range(len(prompts))]
        drafts = [template.bound_to(fork) for fork in forks]
        for fork, prompt in zip(forks, prompts):
            fork.forward(prompt[:-1], num_logits=0)
        sides[side] = forks, drafts
    (forks, together), (alone_forks, alone) = sides["together"], sides["alone"]
    pending = [list(prompt) for prompt in prompts]  # round 1: every prompt token; round 2: the token after it
    for round_ in range(2):
        batched = context_logits_many(together, pending)
        assert batched is not None
        for draft, tokens, logits in zip(alone, pending, batched):
            assert torch.equal(draft.forward(tokens, num_logits=1).logits[-1], logits)
        for mine, theirs in zip(together, alone):
            assert (mine.num_cached, mine.num_exact, mine._tree_tail) == (theirs.num_cached, theirs.num_exact,
                                                                          theirs._tree_tail)
            assert torch.equal(mine.predicted, theirs.predicted) and torch.equal(mine._fed_out, theirs._fed_out)
            assert (mine._fed_tokens, mine._fed_parents) == (theirs._fed_tokens, theirs._fed_parents)
            for a, b in zip(mine.cache.layers, theirs.cache.layers):
                assert torch.equal(a.keys[..., :mine.num_cached, :], b.keys[..., :theirs.num_cached, :])
                assert torch.equal(a.values[..., :mine.num_cached, :], b.values[..., :theirs.num_cached, :])
        if round_ == 0:  # the target commits one more token: its last prompt token's feature, and 7 after it
            for fork_list in (forks, alone_forks):
                for fork, prompt in zip(fork_list, prompts):
                    fork.forward([prompt[-1]], num_logits=0)
            pending = [[7 + i] for i in range(len(prompts))]
    # Refused, touching nothing: a token whose input feature the target has not scored (a draft token's), one call.
    entries = [draft.num_cached for draft in together]
    assert context_logits_many(together, [[1, 2], [3], [4]]) is None
    assert context_logits_many(together[:1], [[1]]) is None
    assert [draft.num_cached for draft in together] == entries


@pytest.mark.skipif(selected_isa() == "portable", reason="the compiled decoder layers run on the vector builds only")
def test_int8_heads_context_calls_in_one_pass_after_a_long_prompts_window(monkeypatch):
    """After a long prompt left each head its sinks and window (drafts/eagle.py), the one-pass context call numbers
    the next entries as each call alone does. Deterministic: no false-failure odds."""
    from jointspec.drafts.eagle import HeadDraftModel, context_logits_many

    monkeypatch.setattr(HeadDraftModel, "window", 8)
    target = CausalLM(grouped_llama(2), name="tiny-64")
    template = HeadDraftModel(untrained_head(target, seed=2, draft_vocab_size=40), target, weights="int8").template()
    prompts = [random_prompt(seed, length=16 + 4 * seed) for seed in range(3)]
    sides = []
    for side in ("together", "alone"):
        forks = [target.fork(f"{side} {i}") for i in range(len(prompts))]
        drafts = [template.bound_to(fork) for fork in forks]
        for fork, draft, prompt in zip(forks, drafts, prompts):
            fork.forward(prompt + [7], num_logits=0)
            draft.forward(prompt, num_logits=1)
            assert draft.skipped == len(prompt) - 8 - 4
        sides.append(drafts)
    together, alone = sides
    # A chain a call alone would window is left to it: nothing fed.
    forks = [target.fork(f"long {i}") for i in range(2)]
    fresh = [template.bound_to(fork) for fork in forks]
    for fork in forks:
        fork.forward(prompts[0] + [7], num_logits=0)
    assert context_logits_many(fresh, [prompts[0], prompts[0][:4]]) is None
    assert [draft.num_cached for draft in fresh] == [0, 0]
    batched = context_logits_many(together, [[7], [8], [9]])
    assert batched is not None
    for draft, token, logits in zip(alone, (7, 8, 9), batched):
        assert torch.equal(draft.forward([token], num_logits=1).logits[-1], logits)


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_decoding_with_an_int8_head_is_plain_greedy_decoding(tree):
    """The head's precision changes only what is drafted: chains (sps) and trees (default's static tree) verified
    against the target give its plain greedy output, with max length and EOS inside a draft."""
    from jointspec.drafters.model import ModelDrafter
    from jointspec.drafters.tree import TreeDrafter
    from jointspec.verifiers.rejection import RejectionSamplingVerifier
    from jointspec.verifiers.tree import TreeRejectionVerifier

    int8_head, _, target = int8_and_float_heads(seed=1)
    if tree:
        decoder = SpeculativeDecoder(target, TreeDrafter(int8_head, (2, 2), replacement=True),
                                     TreeRejectionVerifier(replacement=True))
    else:
        decoder = SpeculativeDecoder(target, ModelDrafter(int8_head, 4), RejectionSamplingVerifier())
    for prompt_seed in (0, 3):
        assert_greedy_equivalent(target.model, decoder, random_prompt(prompt_seed))
    assert decoder.stats.num_draft_tokens > 0


def test_int8_head_weights_run_on_the_portable_build_when_asked_and_auto_keeps_float32_there():
    """The portable build (every CPU that is not x86 with AVX2: ARM) is exact but unmeasured against float32 heads:
    ``auto`` keeps float32 there, as ``--quantize auto`` keeps the float32 model, and ``int8`` asked for runs it, as
    ``--quantize int4`` does (it was refused, so this file's int8-head tests failed on a machine that runs only the
    portable build). Deterministic."""
    from jointspec.drafters.model import ModelDrafter
    from jointspec.drafts.eagle import HeadDraftModel
    from jointspec.kernels import grouped as grouped_module
    from jointspec.verifiers.rejection import RejectionSamplingVerifier

    with use_isa("portable"):
        int8_head, _, target = int8_and_float_heads(seed=1)
        assert int8_head.weights == "int8"
        with pytest.MonkeyPatch.context() as patch:  # auto decides without the kernels (a build where none is made)
            patch.setattr(grouped_module, "unavailable_reason", lambda *a: pytest.fail("auto asked for the kernels"))
            assert HeadDraftModel(untrained_head(target, seed=1, draft_vocab_size=40), target).weights == "float32"
        assert HeadDraftModel(int8_head.head, target).weights == "int8"  # bound as int8 before: converted in place
        decoder = SpeculativeDecoder(target, ModelDrafter(int8_head, 4), RejectionSamplingVerifier())
        assert_greedy_equivalent(target.model, decoder, random_prompt(0))
        assert decoder.stats.num_draft_tokens > 0
    assert HeadDraftModel(untrained_head(target, seed=1, draft_vocab_size=40), target).weights == (
        "float32" if selected_isa() == "portable" else "int8")
    # A head int8 cannot take (here half precision; a GPU's) keeps float32 without asking which build runs, so a bad
    # $JOINTSPEC_KERNEL_ISA, which only the kernels read, does not stop it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ISA_ENV, "bogus")
        half = untrained_head(target, seed=1, draft_vocab_size=40).half()
        assert HeadDraftModel(half, target).weights == "float32"


def test_int8_head_weights_refused_where_the_kernel_cannot_take_them():
    # conftest's tiny target is 32 wide: no multiple of 64, so int8 is refused by name and auto keeps float32.
    from jointspec.core.errors import UnsupportedOptionError
    from jointspec.drafts.eagle import HeadDraftModel

    target = CausalLM(tiny_llama(0, device="cpu"), name="tiny-target")
    with pytest.raises(UnsupportedOptionError, match="multiple of 64"):
        HeadDraftModel(untrained_head(target), target, weights="int8")
    assert HeadDraftModel(untrained_head(target), target).weights == "float32"
    with pytest.raises(UnsupportedOptionError, match="unknown head weights"):
        HeadDraftModel(untrained_head(target), target, weights="fp8")
    with pytest.raises(ValueError, match="head_weights"):
        MethodConfig(name="sps", head_weights="half")


# Every instruction set: the avx512vnni, avx512, avx2vnni, avx2 and portable builds (csrc/simd.h) are written to give
# the same bits, so a model decodes the same tokens on every CPU. Each build this CPU can run is held against the
# portable one, which every CPU runs (on x86 without -mfma its fused multiply-adds are library calls: slow, so the
# sizes are small).

OTHER_ISAS = [isa for isa in runnable_isas() if isa != "portable"]


def test_every_cpu_runs_the_portable_build_and_x86_with_avx2_the_avx2_one(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert "portable" in runnable_isas() and kernels("portable").isa() == "portable"
    if {"avx2", "fma", "f16c"} <= cpu_flags():
        assert "avx2" in runnable_isas() and kernels("avx2").isa() == "avx2"
    assert runnable_isas()[0] == selected_isa()


@pytest.mark.parametrize("isa", OTHER_ISAS or [pytest.param("none", marks=pytest.mark.skip(
    reason="this CPU runs only the portable build"))])
def test_each_build_gives_the_portable_builds_bits(isa):
    fast, portable = kernels(isa), kernels("portable")
    generator = torch.Generator().manual_seed(0)
    layer = linear(72, 192, seed=5)
    q4, q8 = GroupedInt4Linear(layer), GroupedInt8Linear(layer)
    fifth = torch.randint(-2 ** 31, 2 ** 31 - 1, (72, 6), generator=generator, dtype=torch.int32)  # 5-bit levels
    scale16 = torch.rand(72, 12, generator=generator) * 0.01 + 1e-3
    for rows in (1, 2, 3, 4, 5, 8, 9, 12):  # one row, tiles of 2-8 rows and their remainders, the long path
        x = torch.randn(rows, 192, generator=generator) * 3
        for gemm in (False, True):
            assert torch.equal(fast.int5_linear(x, q4.packed, fifth, q4.scale, q4.minimum, gemm),
                               portable.int5_linear(x, q4.packed, fifth, q4.scale, q4.minimum, gemm)), (rows, gemm)
            for scale, minimum in ((q4.scale, q4.minimum), (q4.scale.float() * 37, q4.minimum.float())):  # halves
                assert torch.equal(fast.int4_linear(x, q4.packed, scale, minimum, gemm),  # and float32
                                   portable.int4_linear(x, q4.packed, scale, minimum, gemm)), (rows, gemm)
            assert torch.equal(fast.int8_linear(x, q8.levels, q8.scale, gemm),
                               portable.int8_linear(x, q8.levels, q8.scale, gemm)), (rows, gemm)
            assert torch.equal(fast.int8_linear(x, q8.levels, scale16, gemm),  # groups of 16 (GGUF's Q6_K)
                               portable.int8_linear(x, q8.levels, scale16, gemm)), (rows, gemm)
    # Rows of 576 inputs (18 groups): a whole block of eight pairs, then a last half quad, in tiles of 1, 3 and 4 rows.
    wide = GroupedInt4Linear(linear(8, 576, seed=6))
    wide_fifth = torch.randint(-2 ** 31, 2 ** 31 - 1, (8, 18), generator=generator, dtype=torch.int32)
    for rows in (1, 3, 4, 7):
        x = torch.randn(rows, 576, generator=generator) * 3
        assert torch.equal(fast.int4_linear(x, wide.packed, wide.scale, wide.minimum, False),
                           portable.int4_linear(x, wide.packed, wide.scale, wide.minimum, False)), rows
        assert torch.equal(fast.int5_linear(x, wide.packed, wide_fifth, wide.scale, wide.minimum, False),
                           portable.int5_linear(x, wide.packed, wide_fifth, wide.scale, wide.minimum, False)), rows
    # Key counts with and without a partial block of 16, and one that takes the values in several spans.
    for dim, keys in ((32, 40), (64, 17), (16, 3), (64, 300)):
        query = torch.randn(4, 3, dim, generator=generator) * 2
        key, value = (torch.randn(2, keys, dim, generator=generator) * 2 for _ in range(2))
        visible = torch.rand(3, keys, generator=generator) > 0.3
        visible[:, 0] = True
        lengths = torch.tensor([keys - 2, keys - 1, keys])
        none_bool, none_long = torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.long)
        for mask, length in ((visible, none_long), (none_bool, lengths)):
            assert torch.equal(fast.attention(query, key, value, mask, length, dim ** -0.5),
                               portable.attention(query, key, value, mask, length, dim ** -0.5)), (dim, keys)
    screened = ScreenedInt8Head(head(seed=4))
    x = torch.randn(5, 128, generator=generator) * 3
    arguments = (screened.screen4, screened.screen_scale, screened.column, [screened.levels, screened.scale])
    has_vnni = fast.use_vnni(True)
    try:
        for vnni in {has_vnni, False}:  # VNNI's dot product where the CPU has it, and the two-step one
            assert fast.use_vnni(vnni) == vnni
            for margin in (-1.0, 1.5, 1e9):  # the scores alone, a few exact logits, every logit exact
                for rank in (1, 3, 40):  # greedy's best score; a top-k's k-th best
                    assert torch.equal(fast.screened_head(x, *arguments, margin, 512, rank),
                                       portable.screened_head(x, *arguments, margin, 512, rank)), (vnni, margin, rank)
    finally:
        fast.use_vnni(True)
    # Broken inputs and weights: a row with an infinite input scores NaN everywhere, and NaN screen scales make NaN
    # scores among finite ones: as the first score (then it is the best), inside a vector and in the scalar tail
    # (509 rows: a part-vector at the end). Every build picks the same best and the same tokens near it as the
    # portable build's scalar search.
    odd = ScreenedInt8Head(head(out_features=509, seed=4))
    broken = x.clone()
    broken[1, 5] = float("inf")
    for nan_rows in ([], [37, 496, 504, 508], [0]):  # 496: the last whole vector of 16; 504, 508: the tail
        scale = odd.screen_scale.clone()
        scale[nan_rows] = float("nan")
        for margin, rank in ((-1.0, 1), (1.5, 1), (1.5, 5), (1.5, 509)):
            given = (broken, odd.screen4, scale, odd.column, [odd.levels, odd.scale], margin, 512, rank)
            ours, theirs = fast.screened_head(*given), portable.screened_head(*given)
            assert torch.equal(ours.isnan(), theirs.isnan()), (nan_rows, margin, rank)
            assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0)), (nan_rows, margin, rank)
            assert theirs[1].isnan().all() and theirs[0].isnan().sum() == len(nan_rows)  # the cases are there



def test_a_qwen2_model_with_qkv_biases_runs_the_compiled_layers_one_row_at_a_time():
    model = quantize_model(tiny_qwen2(1), "int4")
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    compiled, python = CausalLM(model, name="compiled"), CausalLM(model, name="python")
    python.lean.compiled = None
    assert compiled.lean.compiled is not None
    context = random_prompt(2)
    with float_inputs():
        ours, theirs = compiled.forward(context), python.forward(context)
        assert torch.allclose(ours.logits, theirs.logits, rtol=1e-4, atol=1e-4)
        without = CausalLM(quantize_model(tiny_qwen2(1), "int4"), name="no biases")
        for layer in without.model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.zero_()
        assert not torch.allclose(without.forward(context).logits, ours.logits, atol=1e-2)  # the biases are applied
    compiled.crop(0)
    compiled.forward(context)
    new = [7, 8, 9, 10]
    chain = compiled.forward(new).logits
    compiled.crop(len(context))
    assert torch.equal(chain, torch.cat([compiled.forward([token]).logits for token in new]))
    outputs = greedy_by_methods(model, random_prompt(3), 30)
    assert len(outputs[0]) == 30 and outputs[1] == outputs[0] and outputs[2] == outputs[0]

@pytest.mark.parametrize("make", [grouped_llama, tiny_gemma3, tiny_qwen3], ids=["llama", "gemma3", "qwen3"])
@pytest.mark.parametrize("isa", OTHER_ISAS or [pytest.param("none", marks=pytest.mark.skip(
    reason="this CPU runs only the portable build"))])
def test_a_model_decodes_the_same_tokens_with_the_same_logits_on_each_build(isa, make):
    """The compiled decoder layers (norms, rotary, attention, the gated MLP's exponentials; Gemma-3's and Qwen3's
    extras) and the screened head: the same logits bit for bit on each build, so greedy decoding, plain and
    speculative, gives the same tokens."""
    results = {}
    for build in (isa, "portable"):
        with use_isa(build):
            model = quantize_model(make(2), "int4")
            target = CausalLM(model, name=f"int4 {build}")
            assert target.lean.compiled is not None
            logits = target.forward(random_prompt(1), num_logits=3).logits
            tokens = []
            for name, draft in (("ar", None), ("sps", "self")):
                config = MethodConfig(name=name, draft=draft, cost_aware=False if draft else None)  # every round
                drafter, verifier = build_method(MethodContext(config, target, None, load_draft=None))
                tokens.append(SpeculativeDecoder(target, drafter, verifier).generate(random_prompt(4), greedy(24)))
        results[build] = logits, tokens
    assert torch.equal(results[isa][0], results["portable"][0])
    assert len(results[isa][1][0]) == 24 and results[isa][1][0] == results[isa][1][1] == results["portable"][1][0]


def test_a_kernel_build_is_chosen_by_name_and_refused_by_name(monkeypatch):
    from jointspec.kernels import grouped

    monkeypatch.setenv(grouped.ISA_ENV, "portable")
    assert selected_isa() == "portable" and kernels().isa() == "portable"
    monkeypatch.setenv(grouped.ISA_ENV, "avx9")
    with pytest.raises(UnsupportedOptionError, match="unknown instruction set 'avx9'; choose one of: avx512vnni, "
                                                     "avx512, avx2vnni, avx2, neondot, portable"):
        selected_isa()
    monkeypatch.delenv(grouped.ISA_ENV)
    monkeypatch.setattr(grouped.platform, "machine", lambda: "x86_64")  # (the flags below are x86's on any machine)
    monkeypatch.setattr(grouped, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "sse4_2"}))
    lacks = (r"cannot run the 'avx512' kernels \(it lacks avx512bw, avx512dq, avx512f, avx512vl\); "
             r"it runs: avx2, portable")
    with pytest.raises(UnsupportedOptionError, match=lacks):
        with use_isa("avx512"):
            pass
    monkeypatch.setattr(grouped, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"}))
    assert runnable_isas() == ("avx2vnni", "avx2", "portable")  # AVX-VNNI without AVX-512 (Alder Lake and later)
    with pytest.raises(UnsupportedOptionError, match=r"cannot run the 'neondot' kernels \(they are for aarch64 or "
                                                     r"arm64 CPUs, this one is x86_64\); it runs: avx2vnni, avx2"):
        with use_isa("neondot"):
            pass


def test_arm_cpus_run_the_neondot_build_where_they_have_the_dot_product_instructions(monkeypatch):
    """An ARM CPU's /proc/cpuinfo "Features" decide the ARM build (x86 flags on ARM never do). (What --quantize auto
    makes of it: tests/test_kernels_probe.py.)"""
    from jointspec.kernels import grouped

    monkeypatch.setattr(grouped.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(grouped, "cpu_flags", lambda: frozenset({"fp", "asimd", "asimddp", "atomics", "asimdhp"}))
    assert runnable_isas() == ("neondot", "portable")
    monkeypatch.setattr(grouped, "cpu_flags", lambda: frozenset({"fp", "asimd", "avx2", "fma", "f16c"}))  # Cortex-A72
    assert runnable_isas() == ("portable",)
    with pytest.raises(UnsupportedOptionError, match=r"cannot run the 'neondot' kernels \(it lacks asimddp, "
                                                     r"atomics\)"):
        with use_isa("neondot"):
            pass
    monkeypatch.setattr(grouped.platform, "machine", lambda: "arm64")  # macOS: no /proc/cpuinfo, no features read
    monkeypatch.setattr(grouped, "cpu_flags", lambda: frozenset())
    assert runnable_isas() == ("portable",)
    with pytest.raises(UnsupportedOptionError, match=r"\(its features cannot be read here: no /proc/cpuinfo"):
        with use_isa("neondot"):
            pass


# The builds this CPU cannot run are still compiled by every x86 CI machine, as far as their integer products: a build
# whose flags did not select its own instructions, or whose VNNI code did not compile, fails here, not first on a
# user's CPU. (Whether they give the portable build's bits is tested where the CPU runs them, above.)
_PRODUCTS_PROBE = """
#include "simd.h"
extern "C" const char* probe_isa() { return JOINTSPEC_ISA_NAME; }
#if !defined(JOINTSPEC_ISA_PORTABLE)
extern "C" void probe_dot8(const simd::L64* low, const simd::L64* high, const int8_t* q, simd::V16* out) {
  *out = simd::dot8(*low, *high, q);
}
extern "C" void probe_dot4(const simd::L64* w, const simd::L64* q, simd::V16* out) { *out = simd::dot4_signed(*w, *q); }
#endif
"""


@pytest.mark.skipif(platform.machine().lower() not in {"x86_64", "amd64"}, reason="the x86 builds' flags need x86")
@pytest.mark.parametrize("isa", [isa for isa in ISA_FLAGS if "x86_64" in ISA_MACHINES.get(isa, ())])
def test_every_x86_build_compiles_its_own_integer_products(isa, tmp_path):
    from jointspec.kernels import grouped

    compiler = shutil.which(os.environ.get("CXX", "g++"))
    assert compiler is not None, "no C++ compiler: the kernels cannot build either"
    source = tmp_path / "probe.cpp"
    source.write_text(_PRODUCTS_PROBE)
    csrc = Path(grouped.__file__).with_name("csrc")
    done = subprocess.run([compiler, "-std=c++17", "-O2", "-ffp-contract=off", *ISA_FLAGS[isa][1], f"-I{csrc}", "-S",
                           "-o", "-", str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f'"{isa}"' in done.stdout  # the build names itself as _build() expects
    assert ("vpdpbusd" in done.stdout) == ("vnni" in isa)
    assert ("vpmaddubsw" in done.stdout) == ("vnni" not in isa)


def test_kernel_inputs_are_chosen_by_the_environment_and_refused_by_name(monkeypatch):
    """$JOINTSPEC_KERNEL_INPUTS=float keeps float inputs (applied when a build loads, and restored after
    float_inputs()); q8 is the default; anything else is refused by name."""
    from jointspec.kernels import grouped

    layer = GroupedInt4Linear(linear(48, 128, seed=3))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    monkeypatch.delenv(grouped.INPUTS_ENV, raising=False)
    assert grouped.inputs_setting() == "q8"
    with torch.no_grad():
        q8 = layer(x)
        with float_inputs():
            floats = layer(x)
        assert not torch.equal(q8, floats)
        monkeypatch.setenv(grouped.INPUTS_ENV, "float")
        with float_inputs():
            pass
        assert torch.equal(layer(x), floats)  # the environment's choice holds after the block
        monkeypatch.setenv(grouped.INPUTS_ENV, "q8")
        with float_inputs():
            pass
        assert torch.equal(layer(x), q8)
    monkeypatch.setenv(grouped.INPUTS_ENV, "int4")
    with pytest.raises(UnsupportedOptionError, match="JOINTSPEC_KERNEL_INPUTS='int4' is not one of: q8, float"):
        grouped.inputs_setting()
    monkeypatch.delenv(grouped.INPUTS_ENV)


def test_the_builds_that_score_keys_for_many_pairs_are_the_ones_python_names():
    """attention.cpp compiles in which builds score a shared prefix key by key (the AVX2 ones); `jointspec info`
    reports it from grouped.SCORES_BY_KEY_ISAS, which must name the same builds."""
    from jointspec.kernels import grouped

    for isa in grouped.runnable_isas():
        assert kernels(isa).scores_by_key() is (isa in grouped.SCORES_BY_KEY_ISAS), isa


def test_widened_key_tiles_are_chosen_by_the_vendor_or_the_environment_and_refused_by_name(monkeypatch):
    """On where measured faster (Intel), off elsewhere (a Zen 4 ran slower: docs/kernels.md); the environment
    overrides either; a build applies the choice when it loads (test_kv_cache_half.py holds both ways to the same
    bits)."""
    from jointspec.kernels import grouped

    monkeypatch.delenv(grouped.WIDEN_KEYS_ENV, raising=False)
    for vendor, widened in (("GenuineIntel", True), ("AuthenticAMD", False), ("", False)):
        monkeypatch.setattr(grouped, "cpu_vendor", lambda vendor=vendor: vendor)
        assert grouped.widen_keys_setting() is widened
        for value, forced in (("on", True), (" OFF ", False)):
            monkeypatch.setenv(grouped.WIDEN_KEYS_ENV, value)
            assert grouped.widen_keys_setting() is forced
        monkeypatch.delenv(grouped.WIDEN_KEYS_ENV)
    monkeypatch.setenv(grouped.WIDEN_KEYS_ENV, "yes")
    with pytest.raises(UnsupportedOptionError, match="JOINTSPEC_KERNEL_WIDEN_KEYS='yes' is not one of: on, off"):
        grouped.widen_keys_setting()


def test_a_build_that_cannot_be_made_says_why_and_names_what_to_install(monkeypatch, tmp_path):
    """(A cache without a finished build: one that has it imports it and needs no ninja.)"""
    from torch.utils import cpp_extension

    from jointspec.kernels import grouped

    def no_ninja():
        raise RuntimeError("Ninja is required to load C++ extensions")
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", no_ninja)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    module, reason = grouped._build("portable")
    assert module is None and "cannot be built (Ninja is required" in reason and "pip install ninja" in reason


def test_a_build_runs_a_compiler_job_a_core_longest_units_first_and_keeps_the_users_max_jobs(monkeypatch, tmp_path):
    """ninja's default starts every unit at once, so on two cores the longest shares them from its start (a first run
    waits for it): the build asks for a job a core through torch's MAX_JOBS, the two units that are the longest on some
    build first, and leaves a MAX_JOBS the user set (and the environment) as it was. The compiler is a stand-in that
    records what it was given."""
    import os

    from torch.utils import cpp_extension

    from jointspec.kernels import grouped

    calls = []

    class Built:
        def isa(self):
            return "portable"

    def fake_load(*, name, sources, build_directory, **options):
        calls.append((os.environ.get("MAX_JOBS"), [os.path.basename(source) for source in sources]))
        return Built()
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MAX_JOBS", raising=False)
    module, reason = grouped._build("portable")
    assert reason is None and isinstance(module, Built) and "MAX_JOBS" not in os.environ
    assert calls[-1] == (str(usable_cores()), ["grouped_linear.cpp", "attention.cpp", "products.cpp"])
    monkeypatch.setenv("MAX_JOBS", "7")
    grouped._build("portable")
    assert calls[-1][0] == "7" and os.environ["MAX_JOBS"] == "7"


def test_a_build_runs_this_pythons_own_ninja_whatever_path_says(monkeypatch, tmp_path):
    """Two ninja versions keep the build log in formats each reads as stale, so a build run by the system's ninja
    after one run by the environment's (a script calling .venv/bin/python, then an activated shell) compiled
    everything again. A build puts this Python's own ninja first on PATH for torch, and leaves PATH as it was. The
    compiler is a stand-in that records the PATH it saw."""
    import os

    from torch.utils import cpp_extension

    from jointspec.kernels import grouped

    own = grouped.own_ninja_directory()
    assert own is not None and os.access(os.path.join(own, "ninja"), os.X_OK)  # the ninja package is a dependency
    seen = []

    class Built:
        def isa(self):
            return "portable"

    def fake_load(*, name, sources, build_directory, **options):
        seen.append(os.environ["PATH"])
        return Built()
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: seen.append(os.environ["PATH"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the system's ninja first, as without an activated environment
    module, reason = grouped._build("portable")
    assert reason is None and isinstance(module, Built)
    assert seen == [own + os.pathsep + "/usr/bin:/bin"] * 2 and os.environ["PATH"] == "/usr/bin:/bin"


def test_builds_of_other_sources_are_kept_so_checkouts_used_in_turn_do_not_rebuild(monkeypatch, tmp_path):
    """Two checkouts (or versions) sharing one kernel cache each removed the other's build when they compiled, so
    using them in turn rebuilt at every switch. Now the KEPT_BUILDS most recently used builds of an ISA stay, and
    the least recently used beyond them go. The compiler is a stand-in that writes a library file; the sources'
    digest is switched to stand for each checkout; each use is marked one second after the last (the clock's grain
    cannot order them)."""
    import itertools

    from torch.utils import cpp_extension

    from jointspec.kernels import grouped

    compiled = []

    class Built:
        def isa(self):
            return "portable"

    def fake_load(*, name, sources, build_directory, **options):
        library = Path(build_directory) / f"{name}.so"
        if not library.exists():  # torch's load compiles only then (ninja finds the rest up to date)
            compiled.append(name)
            library.write_bytes(b"")
        return Built()
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seconds, mark = itertools.count(1_000_000), grouped._mark_used

    def mark_in_order(directory):
        mark(directory)
        when = next(seconds)
        os.utime(directory / grouped._USED, (when, when))
    monkeypatch.setattr(grouped, "_mark_used", mark_in_order)

    def use(checkout: str) -> None:
        monkeypatch.setattr(grouped, "source_digest", lambda: checkout)
        assert grouped._build("portable")[1] is None

    for checkout in "ababa":
        use(checkout)
    assert len(compiled) == 2  # each compiled once, then found again
    for checkout in "cde":  # five sources: the least recently used, b, goes
        use(checkout)
    assert len(compiled) == 5 and len(list((tmp_path / "jointspec" / "kernels").iterdir())) == grouped.KEPT_BUILDS
    use("a")  # kept: found again
    assert len(compiled) == 5
    use("b")  # removed: compiled again
    assert len(compiled) == 6


def test_prebuild_builds_on_its_own_thread_and_a_kernels_call_meanwhile_waits_for_that_build(monkeypatch, capsys):
    """A first run starts the build ahead (prebuild) and asks for the kernels later, maybe while the build still runs:
    the later call must get that build's module, and the build must run once. The build here is a stand-in that
    runs until the test lets it end (no timing decides the outcome: a main thread stalled past the timer that ends
    it only makes the later call find the build done)."""
    import threading

    from jointspec.kernels import grouped

    started, release, builds = threading.Event(), threading.Event(), []

    class Built:
        def use_q8_inputs(self, on):
            return on

        def use_widened_keys(self, on):
            return on

    def slow_build(isa):
        builds.append((isa, threading.current_thread().name))
        grouped._COMPILING.set()  # as _build does while the compiler runs
        started.set()
        assert release.wait(10)
        grouped._COMPILING.clear()
        return Built(), None
    monkeypatch.setattr(grouped, "_build", slow_build)
    monkeypatch.setattr(grouped, "_RESULTS", {})
    from jointspec.cli import main as cli

    thread = grouped.prebuild("portable")
    assert thread is not None and started.wait(10)
    cli._say_if_still_building()  # a run stopping on an error now waits for the compiler: it says why
    assert "finishing the CPU kernel build" in capsys.readouterr().err
    threading.Timer(0.2, release.set).start()  # the build ends while the call below waits for it
    module = grouped.kernels("portable")
    thread.join(10)
    cli._say_if_still_building()
    assert capsys.readouterr().err == ""
    assert isinstance(module, Built) and grouped.kernels("portable") is module
    assert builds == [("portable", "jointspec kernels (portable)")]
    assert grouped.prebuild("portable") is None  # loaded: nothing more to start
    monkeypatch.setenv(grouped.ISA_ENV, "no-such-isa")
    assert grouped.prebuild() is None  # the caller's own kernels() call will name the bad value
    # An error on the thread is not printed there: the caller's own kernels() call raises it, by name.
    monkeypatch.delenv(grouped.ISA_ENV)
    monkeypatch.setattr(grouped, "_RESULTS", {})
    monkeypatch.setenv(grouped.INPUTS_ENV, "bad-value")
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    grouped.prebuild("portable").join(10)
    assert errors == [] and "portable" not in grouped._RESULTS
    with pytest.raises(UnsupportedOptionError, match="bad-value"):
        grouped.kernels("portable")


def test_a_build_waits_for_another_process_build_and_clears_a_dead_ones_lock(tmp_path, capsys, caplog):
    """torch waits for ever on a build folder's lock; a process killed while building leaves one behind. A fresh lock
    is waited on (said once), one older than the longest build is removed with a warning."""
    import os
    import threading
    import time

    from jointspec.kernels import grouped

    grouped._wait_for_other_build(tmp_path)  # no lock: no wait
    assert capsys.readouterr().err == ""
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(1.5, lock.unlink).start()  # the other build finishing
    start = time.monotonic()
    grouped._wait_for_other_build(tmp_path)
    assert 1.4 < time.monotonic() - start < 30
    assert capsys.readouterr().err.count("waiting for another process building the CPU kernels") == 1
    lock.touch()
    old = time.time() - grouped.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING", logger="jointspec.kernels.grouped"):
        grouped._wait_for_other_build(tmp_path)
    assert not lock.exists() and "did not finish" in caplog.text


def test_a_lock_whose_builder_has_ended_goes_at_once_and_a_stopped_wait_ends(monkeypatch, tmp_path, caplog):
    """A build killed midway (a CI cancel, `timeout`, the OOM killer) left torch's lock, which the next run waited out
    for ten minutes. The process that builds writes who it is beside the lock: a lock whose builder has ended goes at
    once. A lock whose builder runs is waited on, and an interrupted command's wait ends (stop_builds): it lingered
    until the other build finished."""
    import subprocess
    import sys
    import threading
    import time

    from jointspec.kernels import grouped

    monkeypatch.setattr(grouped, "STALE_LOCK_SECONDS", 20)  # (the age rule, which a test must not wait out at 600 s)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    lock = tmp_path / "lock"
    lock.touch()
    (tmp_path / grouped._OWNER).write_text(f"{platform.node()} {ended.pid} 1")
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="jointspec.kernels.grouped"):
        assert grouped._wait_for_other_build(tmp_path)
    assert time.monotonic() - start < 5 and not lock.exists() and "whose process has ended" in caplog.text
    lock.touch()
    (tmp_path / grouped._OWNER).write_text(grouped._owner_line())  # this process: alive
    monkeypatch.setattr(grouped, "_STOP", threading.Event())
    threading.Timer(1.0, grouped.stop_builds).start()
    assert not grouped._wait_for_other_build(tmp_path) and lock.exists()
    assert not grouped._STOP.is_set()  # later waits (a library that goes on, the next test) wait as before


def test_a_build_ctrl_c_stopped_is_no_build_failure(monkeypatch, tmp_path, caplog):
    """Ctrl-C reaches the compiler too (the terminal's process group): after "interrupted" the command then warned
    that the kernels "failed to build" and the float32 model was kept. A build ninja reports interrupted is no
    failure: no warning, and nothing kept that would stop a later call (a library that goes on) from building."""
    from torch.utils import cpp_extension

    from jointspec.kernels import grouped

    def interrupted(**options):
        raise RuntimeError("Error building extension 'x': ninja: build stopped: interrupted by user.")
    monkeypatch.setattr(cpp_extension, "load", interrupted)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(grouped, "_RESULTS", {})
    with caplog.at_level("WARNING", logger="jointspec.kernels.grouped"):
        module, reason = grouped._load("portable")
    assert module is None and reason == grouped._INTERRUPTED and "failed to build" not in caplog.text
    assert "portable" not in grouped._RESULTS


def test_a_damaged_library_is_built_again_and_a_finished_one_imported_without_torchs_build(monkeypatch, tmp_path):
    """A build records the library it finished (size and hash). A library that no longer matches (truncated: mapping
    it crashed every command with no message) is removed and built again, never imported; a matching one is
    imported directly, without torch's build, its lock or ninja (a read-only cache could not take the lock). The
    compiler is a stand-in that writes a library file."""
    from torch.utils import cpp_extension

    from jointspec.kernels import grouped

    class Built:
        def isa(self):
            return "portable"

    built, imported = [], []

    def fake_load(*, name, sources, build_directory, **options):
        library = Path(build_directory) / f"{name}.so"
        if not library.exists():
            built.append(name)
            library.write_bytes(b"a finished library")
        return Built()

    def fake_import(name, library):
        imported.append(library.read_bytes())
        return Built()
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    monkeypatch.setattr(grouped, "_import_library", fake_import)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert grouped._build("portable")[1] is None and len(built) == 1 and imported == []
    [library] = tmp_path.glob("jointspec/kernels/*/*.so")
    assert (library.parent / grouped._FINISHED).read_text().split()[0] == str(len(b"a finished library"))
    monkeypatch.setattr(cpp_extension, "load", None)  # a finished build needs none of it
    assert grouped._build("portable")[1] is None and imported == [b"a finished library"]
    library.write_bytes(b"a damaged library!")  # the same size, other bytes
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert grouped._build("portable")[1] is None and len(built) == 2 and imported == [b"a finished library"]
    assert library.read_bytes() == b"a finished library"


def test_a_forced_build_serves_every_kernels_call_inside_its_block():
    """benchmarks/kernel_builds_ab.py --model times two builds on whole models in one process: a model loaded inside
    forced_build() must run that build's compiled layers, and everything after the block the selected build again."""
    from jointspec.kernels.grouped import forced_build, loaded_kernels

    selected, portable = kernels(), kernels("portable")
    with forced_build(portable):
        assert kernels() is portable and kernels(selected_isa()) is portable and loaded_kernels() is portable
        target = CausalLM(quantize_model(grouped_llama(2), "int4"), name="int4, forced portable")
        logits = target.forward(random_prompt(1), num_logits=3).logits
        assert type(target.lean._compiled_stack).__module__ == portable.__name__
    assert kernels() is selected
    with use_isa("portable"):
        expected = CausalLM(quantize_model(grouped_llama(2), "int4"), name="int4 portable").forward(
            random_prompt(1), num_logits=3).logits
    assert torch.equal(logits, expected)


def test_pruning_builds_survives_another_process_removing_one_meanwhile(monkeypatch, tmp_path):
    """Two processes compiling other sources of one ISA prune at once: a folder the other removed between this one's
    listing and its sort by last use raised FileNotFoundError out of kernels(). Simulated by removing it on its first
    look. Deterministic: no false failures."""
    import shutil

    from jointspec.kernels import grouped

    builds = [tmp_path / f"jointspec_kernels_avx2_{name}" for name in ("a", "b", "c", "d", "e")]
    for build in builds:
        build.mkdir()
        (build / "x.so").write_bytes(b"")
    real = grouped._last_used

    def racing(directory):
        if directory == builds[1] and directory.exists():
            shutil.rmtree(directory)
        return real(directory)
    monkeypatch.setattr(grouped, "_last_used", racing)
    grouped._prune_builds(tmp_path / "jointspec_kernels_avx2_new", "avx2")
    assert len([build for build in builds if build.exists()]) == grouped.KEPT_BUILDS - 1
