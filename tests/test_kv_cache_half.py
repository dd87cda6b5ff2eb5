"""A KV cache kept in float16 (``--kv-cache float16``): the compiled attention reads half entries exactly as it reads
the same values widened to float32, and every lossless method still gives plain decoding's tokens, because every
forward (prompt chunks, decoding steps, verification rows, batched rounds) stores and reads the same halves."""

from __future__ import annotations

import itertools

import pytest
import torch

from jointspec.backends import hf, lean_forward
from jointspec.backends.hf import CausalLM
from jointspec.backends.loading import auto_kv_dtype, load_model, quantized_copy
from jointspec.batch.engine import BatchRequest
from jointspec.batch.lockstep import LockstepEngine
from jointspec.bench.specs import MethodSpecError, parse_spec
from jointspec.core.errors import UnsupportedOptionError
from jointspec.core.loop import DecodeConfig, SpeculativeDecoder
from jointspec.core.sampling import SamplingConfig
from jointspec.drafters.sparse_self import SparseSelfDrafter, SparseView
from jointspec.kernels.grouped import kernels, runnable_isas, widen_keys_setting
from jointspec.kernels.quantize import quantize_model
from jointspec.methods import MethodConfig, MethodContext, build_method
from jointspec.verifiers.rejection import RejectionSamplingVerifier

from helpers import BATCH_EOS as EOS
from helpers import BATCH_GREEDY as GREEDY
from helpers import BATCH_PROMPTS as PROMPTS
from helpers import VOCAB, attention_masks, grouped_llama, random_prompt, tiny_llama, word_tokenizer

TINY_VIEW = SparseView(sinks=2, window=6, chunk=5, chunks=2, lead=1, min_ngram=1, min_context=8)


@pytest.fixture(scope="module")
def int4_model():
    return quantize_model(grouped_llama(0), "int4")


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2vnni", "avx2", "portable"])
@pytest.mark.parametrize("heads, kv_heads, dim, keys, rows", [
    (9, 3, 64, 7000, 1),  # a long context's decode step (values two chunks a task, spans over threads)
    (9, 3, 64, 300, 6),  # a verification: shared cache, each row's own draft keys
    (6, 6, 48, 37, 3),  # an odd number of 16-value chunks: one chunk a task
    (9, 3, 64, 1500, 8),  # rows enough that each task widens a span of values once for its several passes
    (6, 2, 48, 500, 12),  # the same with one chunk a task, and tiles of a head size scored without a fixed form
    (16, 2, 256, 600, 1),  # one row whose 8 query heads a key head widen its tiles: the widest head, a full buffer
    (4, 1, 64, 2000, 13),  # more passes than one task takes: tasks that widen values beside one that does not
])
def test_half_keys_and_values_are_read_as_their_float32_values(isa, heads, kv_heads, dim, keys, rows):
    """Bit for bit: attention over float16 keys and values equals attention over the same values widened to float32
    (a half widens exactly), and equals the pair-by-pair definition, causal, tree-style and scattered."""
    if isa not in runnable_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    compiled = kernels(isa)
    generator = torch.Generator().manual_seed(keys + rows)
    query = torch.randn(heads, rows, dim, generator=generator)
    key, value = (torch.randn(kv_heads, keys, dim, generator=generator).half() for _ in range(2))
    key[0, 1, :4] = torch.tensor([6e-8, -3e-6, 0.0, -0.0]).half()  # subnormal halves and signed zeros
    # Both ways of reading a half cache's key tiles, whichever this CPU's vendor runs (kernels/grouped.py), and both
    # orders of scoring a shared prefix (key by key for many pairs, AVX2's default; pair by pair, the others').
    chosen, by_key = widen_keys_setting(), compiled.scores_by_key()
    try:
        for widen, by_key_now in itertools.product((True, False), repeat=2):
            compiled.use_widened_keys(widen)
            compiled.use_scores_by_key(by_key_now)
            for visible, lengths in attention_masks(rows, keys, generator):
                half = compiled.attention(query, key, value, visible, lengths, dim ** -0.5)
                assert torch.equal(half, compiled.attention(query, key.float(), value.float(), visible, lengths,
                                                            dim ** -0.5))
                assert torch.equal(half, compiled.attention_pairwise(query, key, value, visible, lengths,
                                                                     dim ** -0.5))
    finally:
        compiled.use_widened_keys(chosen)
        compiled.use_scores_by_key(by_key)


def test_mixed_or_other_cache_dtypes_are_refused():
    compiled = kernels()
    query, key = torch.randn(2, 1, 16), torch.randn(2, 4, 16)
    lengths = torch.tensor([4])
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        compiled.attention(query, key.half(), key, torch.empty(0, dtype=torch.bool), lengths, 0.25)
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        compiled.attention(query, key.bfloat16(), key.bfloat16(), torch.empty(0, dtype=torch.bool), lengths, 0.25)


def test_the_cache_stores_halves_and_gives_the_model_float32(int4_model):
    target = CausalLM(int4_model, name="half", kv_dtype=torch.float16)
    prompt = random_prompt(3, length=20)
    target.forward(prompt, num_logits=0)
    layer = target.cache.layers[0]
    assert layer._key_buffer.dtype == torch.float16 and layer._value_buffer.dtype == torch.float16
    assert layer.keys.dtype == torch.float32 and layer.keys.shape[-2] == 20
    assert torch.equal(layer.keys, layer._key_buffer[..., :20, :].float())
    # A fork keeps the cache type unless told otherwise; the float32 fork is the same model with a float32 cache.
    assert target.fork().kv_dtype == torch.float16
    full = target.fork(kv_dtype=torch.float32)
    full.forward(prompt, num_logits=0)
    assert full.cache.layers[0]._key_buffer.dtype == torch.float32
    # Rounding the cache is a change of the model's numbers: small, not nothing.
    step, reference = target.forward([7]).logits, full.forward([7]).logits
    assert not torch.equal(step, reference) and (step - reference).abs().max() < 0.1 * reference.abs().max()


def test_a_float16_cache_needs_the_compiled_layers():
    with pytest.raises(UnsupportedOptionError, match="compiled CPU layers"):
        CausalLM(tiny_llama(1), kv_dtype=torch.float16)
    with pytest.raises(UnsupportedOptionError, match="float32 or, for a float32 model, float16"):
        CausalLM(tiny_llama(1), kv_dtype=torch.bfloat16)
    with pytest.raises(UnsupportedOptionError, match="unknown kv cache 'half'"):
        load_model("unused", kv_cache="half")
    with pytest.raises(MethodSpecError, match="kv 'half'"):
        parse_spec("ar:kv=half")
    with pytest.raises(MethodSpecError, match="llama.cpp keeps its own cache"):
        parse_spec("pld:backend=llamacpp,kv=float16")
    assert parse_spec("default:kv=float16").kv == "float16"


def test_kv_cache_auto_keeps_halves_on_the_compiled_layers_and_the_models_dtype_elsewhere(tmp_path, int4_model):
    """--kv-cache auto (the default): float16 where a float32 model runs on the compiled layers, as llama.cpp keeps
    its cache; the model's dtype where transformers' forward or the Python path reads the cache."""
    assert auto_kv_dtype(CausalLM(int4_model, name="compiled")) == torch.float16
    assert auto_kv_dtype(CausalLM(int4_model, name="transformers", lean=False)) is None
    assert auto_kv_dtype(CausalLM(tiny_llama(1), name="float32")) is None
    folder = tmp_path / "model"
    grouped_llama(0).save_pretrained(folder)
    word_tokenizer(VOCAB).save_pretrained(folder)
    prompt = random_prompt(3, length=20)
    for kv_cache, expected in (("auto", torch.float16), ("float32", torch.float32), ("float16", torch.float16)):
        target, _ = load_model(str(folder), quantize="int4", kv_cache=kv_cache)
        assert target.lean.compiled is not None
        target.forward(prompt, num_logits=0)
        assert target.cache.layers[0]._key_buffer.dtype == expected, kv_cache
        assert ("float16 KV cache" in target.name) == (expected == torch.float16)
    plain, _ = load_model(str(folder))
    assert plain.kv_dtype is None and plain.lean.compiled is None
    copied = quantized_copy(plain, "int4")  # the bench's quantize=auto rows, under its --kv-cache
    assert copied.kv_dtype == torch.float16 and copied.lean.compiled is not None
    assert quantized_copy(plain, "int4", "float32").kv_dtype is None
    assert parse_spec("ar:kv=float32").kv == "float32"


def decode(target: CausalLM, config: MethodConfig, prompt: list[int], decode_config: DecodeConfig) -> list[int]:
    """``prompt`` decoded alone by ``config`` on a fork of ``target`` (its cache type kept)."""
    fork = target.fork(config.name)
    if config.name == "sparse-self":  # a view the tiny model's short context can draft from
        drafter, verifier = SparseSelfDrafter(fork, 4, TINY_VIEW), RejectionSamplingVerifier()
    else:
        drafter, verifier = build_method(MethodContext(config, fork, None, None))
    return SpeculativeDecoder(fork, drafter, verifier).generate(prompt, decode_config)


@pytest.mark.parametrize("config", [MethodConfig("sps", draft="self", num_draft_tokens=4, cost_aware=False),
                                    MethodConfig("specinfer", draft="self", tree=(2, 2)),
                                    MethodConfig("pld", num_draft_tokens=5), MethodConfig("lookahead"),
                                    MethodConfig("sparse-self")], ids=lambda c: c.name)
def test_lossless_methods_give_plain_greedy_tokens_with_a_float16_cache(int4_model, monkeypatch, config):
    """Prompts read in chunks (a chunk of more rows than the compiled layers take goes through transformers' path,
    which stores into the same halves), then decoding; max_new_tokens 41 ends inside a draft."""
    monkeypatch.setattr(hf, "PREFILL_CHUNK", 24)
    monkeypatch.setattr(lean_forward, "ROWWISE_PREFILL_CHUNK", 24)
    target = CausalLM(int4_model, name="half", kv_dtype=torch.float16)
    full = CausalLM(int4_model, name="full")
    greedy_41 = DecodeConfig(max_new_tokens=41, sampling=SamplingConfig(temperature=0.0))
    for seed in range(2):
        prompt = random_prompt(8 + seed, length=90)
        plain = decode(target, MethodConfig("ar"), prompt, greedy_41)
        assert decode(target, config, prompt, greedy_41) == plain
        assert len(plain) == 41
        # The float32 cache is another model's numbers: each cache type is held to its own plain decoding.
        assert decode(full, config, prompt, greedy_41) == decode(full, MethodConfig("ar"), prompt, greedy_41)


@pytest.mark.parametrize("method", ["ar", "pld", "specinfer-self"])
def test_batched_requests_with_a_float16_cache_get_their_own_tokens(int4_model, method):
    config = {"ar": MethodConfig("ar"), "pld": MethodConfig("pld", num_draft_tokens=4),
              "specinfer-self": MethodConfig("specinfer", draft="self", tree=(2, 2))}[method]
    target = CausalLM(int4_model, name="half", kv_dtype=torch.float16)
    engine = LockstepEngine(target, max_batch_size=3)
    out = engine.generate([BatchRequest(tuple(p), GREEDY, config) for p in PROMPTS])
    assert out == [decode(target, config, prompt, GREEDY) for prompt in PROMPTS]
    assert any(tokens and tokens[-1] in EOS for tokens in out), "some rows must end on an EOS"
