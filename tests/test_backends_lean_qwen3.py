"""Qwen3 on the compiled int4 layers (backends/lean_qwen3.py: Llama's layer plus per-head q/k norms).

The tiny Qwen3 (tests/helpers.py) has q/k norm weights drawn far from one and a head size (32) other than hidden /
heads (16), so a norm skipped, applied after the rotation or over the wrong span moves the logits far outside the
float-rounding tolerance against transformers' own forward of the same quantised model. Deterministic: no
false-failure odds.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.backends.lean_qwen3 import LeanQwen3Forward, qwen3_unsupported_reason
from jointspec.kernels.grouped import float_inputs
from jointspec.kernels.quantize import quantize_model

from helpers import (
    assert_forward_many_runs_one_pass,
    assert_rows_computed_alone,
    assert_self_drafts_give_plain_greedy,
    greedy_by_methods,
    random_prompt,
    tiny_gemma3,
    tiny_qwen3,
)


def int4_qwen3(seed: int = 0, **config):
    return quantize_model(tiny_qwen3(seed, **config), "int4")


def test_the_compiled_layers_compute_transformers_qwen3_forward_to_float_rounding():
    model = int4_qwen3()
    compiled, stock = CausalLM(model, name="compiled"), CausalLM(model, name="transformers", lean=False)
    assert isinstance(compiled.lean, LeanQwen3Forward) and compiled.lean.compiled is not None
    assert not compiled.reads_attention and not compiled.capabilities.argmax_screen
    context = random_prompt(2, length=20)
    with float_inputs():  # (8-bit inputs would turn float rounding differences into flipped levels)
        ours = compiled.forward(context, output_hidden=True)
        theirs = stock.forward(context, output_hidden=True)
        # Another order of float32 sums over the same quantised weights: differences of float rounding only.
        assert torch.allclose(ours.logits, theirs.logits, rtol=1e-4, atol=1e-4)
        assert torch.allclose(ours.hidden, theirs.hidden, rtol=1e-4, atol=1e-4)
        for tokens, parents in (([7], None), ([7, 8, 9, 10], [-1, 0, 0, 1])):
            ours = compiled.forward(tokens, parents=parents).logits
            theirs = stock.forward(tokens, parents=parents).logits
            assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), tokens
            compiled.crop(len(context))
            stock.crop(len(context))
        # The same model with its q/k norms set to one gives other logits: the comparison above tests the norms.
        plain = int4_qwen3()
        for layer in plain.model.layers:
            layer.self_attn.q_norm.weight.data.fill_(1.0)
            layer.self_attn.k_norm.weight.data.fill_(1.0)
        other = CausalLM(plain, name="unit norms").forward(context).logits
        assert not torch.allclose(other, compiled.forward(context).logits, atol=1e-2)


def test_a_forward_the_compiled_layers_do_not_take_runs_transformers_own(monkeypatch):
    """Longer forwards than the compiled attention reads (here: more than 2 rows) run transformers' Qwen3 forward,
    not the Llama operations, which have no q/k norms."""
    from jointspec.kernels import grouped

    model = int4_qwen3()
    lean, stock = CausalLM(model, name="lean"), CausalLM(model, name="transformers", lean=False)
    monkeypatch.setattr(grouped, "ROWWISE_MAX_ROWS", 2)
    context = random_prompt(2, length=20)
    assert torch.equal(lean.forward(context).logits, stock.forward(context).logits)


def test_each_row_is_computed_alone():
    """A chain, and every node of a tree, get bit for bit the logits of feeding their tokens one by one."""
    target = CausalLM(int4_qwen3(1), name="compiled")
    context = random_prompt(3, length=16)
    assert_rows_computed_alone(target, context)


def test_forward_many_gives_each_sequence_its_own_forwards_bits(monkeypatch):
    """The batched server's pass: several sequences' forwards in one pass of the compiled layers, each getting what
    its own forward gives."""
    assert_forward_many_runs_one_pass(monkeypatch, LeanQwen3Forward, CausalLM(int4_qwen3(1), name="compiled"))


@pytest.mark.parametrize("prompt_seed", [0, 3])
def test_speculative_methods_equal_plain_greedy_on_the_compiled_qwen3(prompt_seed):
    ar, sps, specinfer = greedy_by_methods(int4_qwen3(), random_prompt(prompt_seed), 40)
    assert len(ar) == 40 and sps == ar and specinfer == ar


@pytest.mark.parametrize("method, tree", [("sps", None), ("specinfer", (2, 2))])
def test_eos_and_max_length_inside_a_draft_on_the_compiled_qwen3(method, tree):
    assert_self_drafts_give_plain_greedy(int4_qwen3(), method, tree, random_prompt(0))


def test_the_exact_head_model_types_are_those_whose_forward_never_reads_a_screen():
    """Their loads skip building the 4-bit screen (backends/loading.py, screens_head); the GGUF tests see it done."""
    from jointspec.backends.hf import EXACT_HEAD_MODEL_TYPES
    from jointspec.backends.lean_gemma import LeanGemmaForward

    for kind, model in ((LeanQwen3Forward, tiny_qwen3(0)), (LeanGemmaForward, tiny_gemma3(0))):
        assert not kind.screens_head and model.config.model_type in EXACT_HEAD_MODEL_TYPES


def test_what_keeps_transformers_forward_is_named():
    assert CausalLM(tiny_qwen3(0), name="float32").lean is None  # not on the grouped kernels
    windowed = quantize_model(tiny_qwen3(0, use_sliding_window=True, sliding_window=8, max_window_layers=1), "int4")
    assert qwen3_unsupported_reason(windowed) == "sliding-window attention layers"
    assert CausalLM(windowed, name="windowed").lean is None
    model = int4_qwen3()
    model.model.layers[1].self_attn.k_norm = torch.nn.Identity()
    assert qwen3_unsupported_reason(model) == "Identity replaces transformers' Qwen3RMSNorm"
    assert CausalLM(model, name="replaced").lean is None
