"""Gemma-3 on the compiled int4 layers (backends/lean_gemma.py, the layer's extras in kernels/csrc).

The tiny Gemma-3 (tests/helpers.py) has every part the compiled layer adds for it: two sliding layers with a window
of 4 and their own rotary base, one full-attention layer, q/k norms, four (1 + weight) norms a layer, gelu_tanh and
scaled tied embeddings. Its prompts run past the window, so an extra computed wrongly or a window ignored moves the
logits far outside the float-rounding tolerance against transformers' own forward of the same quantised model.
Deterministic: no false-failure odds.
"""

from __future__ import annotations

import pytest
import torch

from jointspec.backends.hf import CausalLM
from jointspec.backends.lean_gemma import LeanGemmaForward
from jointspec.core.loop import SpeculativeDecoder
from jointspec.kernels.grouped import float_inputs
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method

from helpers import (
    assert_forward_many_runs_one_pass,
    assert_rows_computed_alone,
    assert_self_drafts_give_plain_greedy,
    greedy_by_methods,
    random_prompt,
    tiny_gemma3,
)


def int4_gemma(seed: int = 0, window: int = 4):
    return quantize_model(tiny_gemma3(seed, window=window), "int4")


def test_the_compiled_layers_compute_transformers_gemma3_forward_to_float_rounding():
    model = int4_gemma()
    compiled, stock = CausalLM(model, name="compiled"), CausalLM(model, name="transformers", lean=False)
    assert isinstance(compiled.lean, LeanGemmaForward) and compiled.lean.compiled is not None
    assert not compiled.reads_attention  # attention_mass() reads Llama layers only
    context = random_prompt(2, length=20)  # five times the window
    with float_inputs():  # (8-bit inputs would turn float rounding differences into flipped levels)
        ours = compiled.forward(context, output_hidden=True)
        theirs = stock.forward(context, output_hidden=True)
        # Another order of float32 sums over the same quantised weights: differences of float rounding only.
        assert torch.allclose(ours.logits, theirs.logits, rtol=1e-4, atol=1e-4)
        assert torch.allclose(ours.hidden, theirs.hidden, rtol=1e-4, atol=1e-4)
        # Past the window, one step and a tree (whose nodes' windows go by their positions, not their slots).
        for tokens, parents in (([7], None), ([7, 8, 9, 10], [-1, 0, 0, 1])):
            ours = compiled.forward(tokens, parents=parents).logits
            theirs = stock.forward(tokens, parents=parents).logits
            assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), tokens
            compiled.crop(len(context))
            stock.crop(len(context))
        # The same weights without a window give other logits: the comparison above tests the window.
        wide = CausalLM(int4_gemma(window=512), name="no window")
        assert not torch.allclose(wide.forward(context).logits[-1], ours[0], atol=1e-2)


def test_the_avx2_builds_read_its_prompts_by_gemm_past_128_rows():
    """The AVX2 builds read a prompt's first positions row by row for the prompt cache, which keeps no cache with
    sliding-window layers: a Gemma 3 reads its prompts the GEMM's way past 128 rows, as before."""
    from jointspec.kernels.grouped import runnable_isas, use_isa

    isas = [isa for isa in ("avx2", "avx2vnni") if isa in runnable_isas()]
    if not isas:
        pytest.skip("this CPU runs no AVX2 build")
    for isa in isas:
        with use_isa(isa):
            target = CausalLM(int4_gemma(), name=isa)
        assert target.lean.compiled is not None and target.lean.alone_prompt_tokens > 0
        assert target.alone_positions == 0
        assert target.prefill_chunk_end(0, 200) == min(200, target.prefill_chunk)


def test_each_row_is_computed_alone_past_the_window():
    """A chain, and every node of a tree, get bit for bit the logits of feeding their tokens one by one."""
    target = CausalLM(int4_gemma(1), name="compiled")
    context = random_prompt(3, length=16)
    assert_rows_computed_alone(target, context)


def test_forward_many_gives_each_sequence_its_own_forwards_bits(monkeypatch):
    """The batched server's pass: sequences in and past the window side by side (each layer kind its own view and
    rotary pair per sequence) get what their own forwards give, in one pass of the compiled layers."""
    assert_forward_many_runs_one_pass(monkeypatch, LeanGemmaForward, CausalLM(int4_gemma(1), name="compiled"))


@pytest.mark.parametrize("prompt_seed", [0, 3])
def test_speculative_methods_equal_plain_greedy_on_the_compiled_gemma3(prompt_seed):
    ar, sps, specinfer = greedy_by_methods(int4_gemma(), random_prompt(prompt_seed), 40)
    assert len(ar) == 40 and sps == ar and specinfer == ar


@pytest.mark.parametrize("method, tree", [("sps", None), ("specinfer", (2, 2))])
def test_eos_and_max_length_inside_a_draft_on_the_compiled_gemma3(method, tree):
    assert_self_drafts_give_plain_greedy(int4_gemma(), method, tree, random_prompt(0))


def test_greedy_rows_read_the_exact_head_not_the_screen():
    model = int4_gemma()
    target = CausalLM(model, name="compiled")
    assert hasattr(model.get_output_embeddings(), "argmax_logits")  # the quantiser gave the head a 4-bit screen
    assert not target.capabilities.argmax_screen
    context = random_prompt(2)
    target.forward(context, num_logits=0)
    exact = target.forward([7, 8]).logits
    target.crop(len(context))
    model.get_output_embeddings().argmax_logits = lambda *args: pytest.fail("a greedy row read the screen")
    assert torch.equal(target.forward([7, 8], argmax_only=True).logits, exact)


def test_a_float32_gemma3_keeps_transformers_forward():
    assert CausalLM(tiny_gemma3(0), name="float32").lean is None


@pytest.mark.parametrize("config", [MethodConfig("pld", num_draft_tokens=4),
                                    MethodConfig("specinfer", draft="self", tree=(2, 2))], ids=["pld", "specinfer"])
def test_the_lockstep_engine_gives_each_request_its_own_tokens(config, monkeypatch):
    """`serve` on the compiled Gemma-3: requests decoded together, joining as others finish, past the window, each
    get the tokens the single-sequence loop gives them alone, with their forwards run as one pass."""
    from jointspec.batch.engine import BatchRequest
    from jointspec.batch.lockstep import LockstepEngine, engine_for

    from helpers import BATCH_GREEDY, BATCH_PROMPTS

    passes = []
    original = LeanGemmaForward.forward_many
    monkeypatch.setattr(LeanGemmaForward, "forward_many",
                        lambda self, calls: passes.append(original(self, calls)) or passes[-1])

    target = CausalLM(int4_gemma(), name="int4 gemma3")
    engine = engine_for(target, method=config, max_batch_size=3)
    assert isinstance(engine, LockstepEngine)
    prompts = BATCH_PROMPTS[:5]
    out = engine.generate([BatchRequest(tuple(prompt), BATCH_GREEDY, config) for prompt in prompts])
    assert any(result is not None for result in passes)  # rounds that ran as one pass of the compiled layers
    expected = []
    for prompt in prompts:
        alone = target.fork("alone")
        drafter, verifier = build_method(MethodContext(config, alone, None, None))
        expected.append(SpeculativeDecoder(alone, drafter, verifier).generate(prompt, BATCH_GREEDY))
    assert out == expected and all(len(tokens) > 0 for tokens in out)
