"""GGUF blocks taken as they are onto jointspec's kernels (kernels/gguf_blocks.py).

Deterministic (seeded blocks and weights): no false-failure odds. The oracle for every block type is the gguf
package's own numpy dequantiser, which follows llama.cpp's dequantize_row_*.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers import LlamaConfig, LlamaForCausalLM

from jointspec.backends.hf import CausalLM
from jointspec.kernels.gguf_blocks import (
    SUPPORTED_TYPES,
    BlockEmbedding,
    _llama_permutation,
    decode,
    decode_tensor,
    file_layers,
    gguf_reader,
    shared_gguf_readers,
)
from jointspec.kernels.grouped import (
    GroupedInt4Linear,
    GroupedInt5Linear,
    GroupedInt6Linear,
    GroupedInt8Linear,
    ScreenedInt6Head,
    ScreenedInt8Head,
    float_inputs,
    kernels,
    runnable_isas,
    use_isa,
)
from jointspec.kernels.quantize import quantize_model

from helpers import VOCAB, greedy_by_methods, q8_reference, random_prompt

BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_blocks(type_name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Raw blocks [rows, bytes] of ``type_name``: quantised random weights where the gguf package quantises that
    type, else random bytes with finite half-precision scales (every level and scale pattern is a valid block)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name not in BLOCK_BYTES:
        return quants.quantize((rng.standard_normal((rows, columns)) * 0.05).astype(np.float32), qtype)
    raw = rng.integers(0, 256, (rows, columns // 256, BLOCK_BYTES[type_name]), dtype=np.uint8)
    scales = (rng.random((rows, columns // 256, 2)) * 1e-3 + 1e-4).astype(np.float16).view(np.uint8)
    if type_name in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = scales  # d, dmin
    else:
        raw[..., 208:210] = scales[..., :2]  # d
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_levels_are_the_files_weights_bit_for_bit(type_name):
    raw = random_blocks(type_name, rows=6, columns=512, seed=1)
    levels = decode(raw, type_name, 512)
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
    assert torch.equal(levels.weight(), expected)
    assert levels.bits == {"Q4": 4, "Q5": 5, "Q6": 6}.get(type_name[:2], 8)
    scale, minimum = levels.float_scales()
    assert scale.shape == (6, 512 // (16 if type_name == "Q6_K" else 32)) and scale.dtype == torch.float32
    assert (minimum is None) == (levels.bits in (6, 8))
    assert (levels.k_scales is not None) == type_name.endswith("_K")  # kept as the file keeps them
    if type_name[:2] in ("Q4", "Q5") and not type_name.endswith("_K"):  # the file's halves, never a float32 copy
        assert levels.scale.dtype == levels.minimum.dtype == torch.float16
        assert levels.minimum.shape == ((6, 1) if type_name.endswith("_0") else (6, 512 // 32))
    assert expected.abs().max() > 0 and expected.std() > 0  # the blocks hold weights, not zeros


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0", "Q5_K"])
def test_the_kernels_multiply_by_the_files_weights(type_name):
    raw = random_blocks(type_name, rows=48, columns=256, seed=2)
    levels = decode(raw, type_name, 256)
    layer = levels.layer()
    assert type(layer) is {4: GroupedInt4Linear, 5: GroupedInt5Linear, 6: GroupedInt6Linear,
                           8: GroupedInt8Linear}[levels.bits]
    expected = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
    assert torch.equal(layer.dequantized(), expected)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(5)])
    assert torch.equal(out, alone)  # rows computed alone, in groups of 16 as in groups of 32
    reference, magnitude = q8_reference(x, layer)  # inputs rounded to 8 bits (test_kernels_grouped.py)
    assert ((out.double() - reference).abs() <= 1e-5 * magnitude + 1e-7).all()
    with torch.no_grad(), float_inputs():
        out = layer(x)
        # The kernel's own weights, exactly: a one-hot input row reads one column of W (every other product is 0).
        columns = layer(torch.eye(256))  # 256 rows: the multi-row path
        single = torch.cat([layer(torch.eye(256)[i:i + 1]) for i in (0, 77, 255)])  # one row: the in-register path
    reference = x.double() @ levels.weight().double().T
    assert ((out.double() - reference).abs() <= 1e-5 * (x.abs().double() @ levels.weight().abs().double().T)
            + 1e-7).all()
    assert torch.equal(columns, levels.weight().T) and torch.equal(single, levels.weight().T[[0, 77, 255]])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_layers_keep_the_files_scales_and_compute_the_float_scales_bits(type_name):
    """A layer keeps the scales as the file stores them, halves (Q4_0, Q4_1, Q5_0) or K-quant sub-scales with a half
    (Q4_K, Q5_K: all in one stream a row) or a float (Q6_K) per 256 inputs: fewer bytes a step reads. The symmetric
    Q4_0 and Q5_0 keep no minima, only their offset (-8 and -16 scales). Every build and path gives the bits of the
    same layer with each group's float32 scale and minimum (the float a K-quant's dequantisation rounds, d * sc,
    formed the same way), and wrongly shaped K scales, K super-block scales that are not halves, or another offset
    are refused by what they should be."""

    raw = random_blocks(type_name, rows=40, columns=512, seed=4)
    levels = decode(raw, type_name, 512)
    layer = levels.layer()
    k_type = type_name.endswith("_K")
    assert layer.k_form == k_type
    if not k_type:
        assert layer.scale.dtype == torch.float16
    offset = {"Q4_0": -8.0, "Q5_0": -16.0}.get(type_name)
    if offset is not None:  # one half a row, every one the offset
        assert layer.minimum.shape == (40, 1) and layer.minimum.dtype == torch.float16
        assert (layer.minimum == offset).all()
    elif not k_type:
        assert layer.minimum.shape == layer.scale.shape
    if levels.bits == 6:  # Q6_K in 6 bits: the same as its levels in 8 bits with a float32 scale per 16 inputs
        floats = [layer.signed_levels(), layer.unit_scales()]
    else:
        floats = [layer.packed] + ([layer.fifth] if levels.bits == 5 else []) + list(layer.group_scales())
    assert all(t.dtype == torch.float32 for t in floats[-1 if levels.bits == 6 else -2:])
    stored = [getattr(layer, name) for name in layer.BUFFERS]
    generator = torch.Generator().manual_seed(5)
    for isa in runnable_isas():
        module = kernels(isa)
        for rows in (1, 2, 5, 9):
            x = torch.randn(rows, 512, generator=generator) * 2
            for gemm in (False, True):
                for q8 in (True, False):
                    assert torch.equal(module.linear(x, stored, gemm, q8), module.linear(x, floats, gemm, q8)), (
                        isa, rows, gemm, q8)
    if levels.bits == 6:
        wrong = [*stored[:-2], stored[-2][..., :1].contiguous(), stored[-1]]  # one super-block's scales a row
        with pytest.raises(RuntimeError, match="K-quant"):
            kernels().linear(torch.randn(1, 512), wrong, False, True)
    elif k_type:  # one stream a row, 40 bytes a block of 512 inputs: d and dmin as the file's halves
        assert layer.scale.dtype == torch.uint8 and layer.scale.shape == (40, 1, 40) and layer.minimum is None
        wrong = [*stored[:-1], stored[-1][..., :32].contiguous()]  # a block without its halves
        with pytest.raises(RuntimeError, match="K-quant"):
            kernels().linear(torch.randn(1, 512), wrong, False, True)
        d_dmin, sub = levels.k_scales
        with pytest.raises(ValueError, match="must be float16 values"):
            type(layer).from_levels(*stored[:-1], d_dmin * (1 + 2 ** -20), sub)
    if offset is not None:
        wrong = [*stored[:-1], torch.full_like(stored[-1], -7.0)]
        with pytest.raises(RuntimeError, match="must be -8 or -16"):
            kernels().linear(torch.randn(1, 512), wrong, False, True)


@pytest.mark.parametrize("bits", [6, 8])
def test_a_q6_k_head_is_screened_on_its_own_sub_scales(bits):
    """A Q6_K output head (what a Q4_K_M file holds) keeps the file's 6-bit levels and sub-scales under the screen
    (or, at 8 bits, the levels widened), sharing the layer's buffers rather than widening its scales to a float32
    per 16 inputs, and its exact logits are the layer's bits on every build: the same as a screen over 8-bit levels
    with float32 scales gives."""

    raw = random_blocks("Q6_K", rows=300, columns=512, seed=6)
    layer = decode(raw, "Q6_K", 512).layer()
    assert type(layer) is GroupedInt6Linear
    levels = layer.signed_levels()
    if bits == 8:
        layer = GroupedInt8Linear.from_levels(levels, layer.scale, sub=layer.sub)
        screened = ScreenedInt8Head.from_int8(layer)
        assert screened.BUFFERS == ("levels", "scale", "sub")
    else:
        screened = ScreenedInt6Head.from_int6(layer)
        assert screened.BUFFERS == ("packed", "plane", "scale", "sub")
    assert screened.k_form and screened.bits == bits
    assert all(getattr(screened, name).data_ptr() == getattr(layer, name).data_ptr() for name in layer.BUFFERS)
    assert screened.scale.shape == (300, 2)  # a float per 256 inputs, not per 16
    widened = ScreenedInt8Head.from_int8(GroupedInt8Linear.from_levels(levels, layer.unit_scales()))
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(7)) * 3
    with torch.no_grad(), float_inputs():
        exact = layer(x)
        assert torch.equal(screened(x), exact)  # forward: the exact head
        for head in (screened, widened):
            head.margin, head.max_exact = 1e9, 300  # every logit exact
        assert torch.equal(screened.argmax_logits(x), exact) and torch.equal(widened.argmax_logits(x), exact)
        screened.margin, screened.max_exact = 1.5, 8
        widened.margin, widened.max_exact = 1.5, 8
        near = screened.argmax_logits(x)
        assert torch.equal(near, widened.argmax_logits(x))
        assert torch.equal(near.argmax(1), exact.argmax(1))
        arguments = (screened.screen4, screened.screen_scale, screened.column,
                     [getattr(screened, name) for name in screened.BUFFERS], 1.5, 8)
        for isa in runnable_isas():
            assert torch.equal(kernels(isa).screened_head(x, *arguments), near), isa


@pytest.mark.parametrize("type_name", ["Q6_K", "Q4_K", "Q5_0"])
def test_a_files_tensor_decodes_block_by_block_to_the_whole_tensors_levels(tmp_path, type_name):
    """A load reads a large tensor from the file a block of rows at a time (never its whole bytes, and only one
    block's temporaries, at the load's peak of memory): the levels are those of decoding the whole tensor, whatever the
    blocks (one, several, a last partial one)."""
    import gguf

    raw = random_blocks(type_name, rows=23, columns=512, seed=8)
    writer = gguf.GGUFWriter(tmp_path / "one.gguf", "llama")
    writer.add_tensor("t", raw, raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf_reader(tmp_path / "one.gguf").tensors[0]
    whole = decode(raw, type_name, 512)
    for block in (23, 5, 8192):
        found = decode_tensor(tmp_path / "one.gguf", tensor, 512, block=block)
        for name in ("levels", "scale", "minimum", "fifth"):
            mine, theirs = getattr(found, name), getattr(whole, name)
            assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs)), (block, name)
        assert (found.k_scales is None) == (whole.k_scales is None)
        assert all(torch.equal(a, b) for a, b in zip(found.k_scales or (), whole.k_scales or ()))
        assert torch.equal(found.weight(), whole.weight())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("isa", runnable_isas())
def test_compiled_block_rearrangement_equals_the_numpy_reference(type_name, isa):
    """A load rearranges K-quant blocks in the compiled kernels (on every build), byte for byte what the numpy
    reference of decode() gives, whatever the bytes (random ones: every level, scale and minimum pattern)."""
    rng = np.random.default_rng(3)
    size = BLOCK_BYTES[type_name]
    for rows, blocks in ((1, 1), (5, 3), (33, 2)):
        raw = rng.integers(0, 256, (rows, blocks * size), dtype=np.uint8)
        halves = (rng.random((rows, blocks, 2)) * 2 - 1).astype(np.float16).view(np.uint8).reshape(rows, blocks, 4)
        where = (208, 210) if type_name == "Q6_K" else (0, 4)
        raw.reshape(rows, blocks, size)[..., where[0]:where[1]] = halves[..., :where[1] - where[0]]
        kernels(isa)
        with use_isa(isa):
            mine = decode(raw, type_name, blocks * 256)
        reference = decode(raw, type_name, blocks * 256, compiled=False)
        assert torch.equal(mine.levels, reference.levels)
        for name in ("plane", "fifth"):
            a, b = getattr(mine, name), getattr(reference, name)
            assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b))), name
        for a, b in zip(mine.k_scales, reference.k_scales, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (type_name, rows, blocks)
        assert torch.equal(mine.weight(), reference.weight())


def test_a_type_the_kernels_do_not_take_is_refused_by_name():
    raw = np.zeros((2, 84), np.uint8)  # one Q2_K block a row
    with pytest.raises(ValueError, match="GGUF type Q2_K is not one jointspec's kernels take; they take: Q4_0, "
                                         "Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, Q6_K"):
        decode(raw, "Q2_K", 256)


# A tiny Llama stored as a GGUF would store it: a Q4_K_M-like mix (q/k Q4_K, v Q6_K, o Q5_0, gate Q4_0, up Q5_K,
# down Q6_K, head Q8_0), q and k rows in llama.cpp's rotary order. The model's float weights are the file's
# dequantised weights, as transformers' GGUF loader gives them.
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_0",
         "ffn_up": "Q5_K", "ffn_down": "Q6_K"}
MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}


def gguf_llama(path, head_type: str = "Q8_0", v_type: str = "Q6_K") -> LlamaForCausalLM:
    import gguf

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    writer = gguf.GGUFWriter(str(path), "llama")
    seed = 10
    for index, layer in enumerate(model.model.layers):
        for name, module_name in MODULES.items():
            owner, attribute = module_name.split(".")
            linear = getattr(getattr(layer, owner), attribute)
            type_name = v_type if name == "attn_v" else TYPES[name]
            raw = random_blocks(type_name, linear.out_features, linear.in_features, seed)
            seed += 1
            weight = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
            if name in ("attn_q", "attn_k"):  # the file's rows are in llama.cpp's order; the model's in HF's
                heads = config.num_attention_heads if name == "attn_q" else config.num_key_value_heads
                weight = weight[torch.argsort(_llama_permutation(linear.out_features, heads))]
            with torch.no_grad():
                linear.weight.copy_(weight)
            writer.add_tensor(f"blk.{index}.{name}.weight", raw, raw_dtype=GGMLQuantizationType[type_name])
    raw = random_blocks(head_type, VOCAB, 256, seed)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(
            quants.dequantize(raw, GGMLQuantizationType[head_type]).astype(np.float32)))
    writer.add_tensor("output.weight", raw, raw_dtype=GGMLQuantizationType[head_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def test_a_files_reader_is_made_once_within_a_load_while_the_file_is_unchanged(tmp_path):
    """A load reads the file's tensors several times; inside shared_gguf_readers (load_model's) the metadata is
    parsed once (a real vocabulary takes seconds), a file written again gets a new reader, and outside it every call
    makes its own (nothing of a file is held after its load)."""
    import os

    path = tmp_path / "mix.gguf"
    gguf_llama(path)
    with shared_gguf_readers():
        first = gguf_reader(path)
        assert gguf_reader(str(path)) is first and {t.name for t in first.tensors} >= {"blk.0.attn_q.weight"}
        gguf_llama(path, head_type="Q4_0")
        stat = path.stat()
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new time even on a coarse clock
        second = gguf_reader(path)
        assert second is not first
        assert {t.name: t.tensor_type.name for t in second.tensors}["output.weight"] == "Q4_0"
    assert gguf_reader(path) is not second and gguf_reader(path) is not gguf_reader(path)


def test_transformers_reads_a_files_metadata_through_the_loads_reader(tmp_path, monkeypatch):
    """transformers parses a GGUF file's metadata for the config (gguf.GGUFReader in load_gguf_checkpoint): inside
    shared_gguf_readers that is the load's own (fast) reader, so the file is parsed once; the config is the same, and
    gguf.GGUFReader is gguf's own class again afterwards."""
    import gguf
    from transformers import AutoConfig

    from jointspec.kernels import gguf_reader as fast

    path = tmp_path / "mix.gguf"
    gguf_llama(path)
    made = []

    def counting(base):
        class Counting(base):
            def __init__(self, *args, **kwargs):
                made.append(base.__name__)
                super().__init__(*args, **kwargs)

        return Counting

    monkeypatch.setattr(gguf, "GGUFReader", counting(gguf.GGUFReader))
    monkeypatch.setattr(fast, "FastGGUFReader", counting(fast.FastGGUFReader))
    alone = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert made == ["GGUFReader"]
    made.clear()
    patched = gguf.GGUFReader
    with shared_gguf_readers():
        reader = gguf_reader(path)
        config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
        assert gguf.GGUFReader(str(path)) is reader
    assert made == ["FastGGUFReader"] and gguf.GGUFReader is patched
    assert config.to_dict() == alone.to_dict()


def test_a_gguf_models_layers_come_from_its_blocks_and_decode_exactly(tmp_path):
    model = gguf_llama(tmp_path / "mix.gguf")
    found = file_layers(model, tmp_path / "mix.gguf")
    assert found.left == [] and len(found.layers) == 15  # 2 x 7 projections and the head
    float_model = LlamaForCausalLM(model.config).eval()
    float_model.load_state_dict(model.state_dict())
    names = list(found.layers)
    quantize_model(model, "int4", file_levels=found.layers)
    assert found.layers == {}  # handed over: emptied once the layers hold the levels, so stacking can free them
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is GroupedInt4Linear and type(attn.v_proj) is GroupedInt6Linear
    assert attn.v_proj.group_size == 16 and type(attn.o_proj) is GroupedInt5Linear
    assert type(model.model.layers[0].mlp.up_proj) is GroupedInt5Linear
    assert type(model.lm_head) is ScreenedInt8Head
    for name in names:  # every projection and the head: the file's weight, bit for bit
        assert torch.equal(model.get_submodule(name).dequantized(), float_model.get_submodule(name).weight), name
    target = CausalLM(model, name="gguf mix")
    assert target.lean.compiled is not None  # mixed formats, q/k/v not fused: still the compiled layers
    context = random_prompt(1)
    with float_inputs():  # (on 8-bit inputs the model is llama.cpp's, not the float one)
        ours = target.forward(context).logits
    target.crop(0)
    theirs = CausalLM(float_model, name="float", lean=False).forward(context).logits
    # The same weights; only the order of float32 sums differs.
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
    outputs = greedy_by_methods(model, random_prompt(3), 30)
    assert len(outputs[0]) == 30 and outputs[1] == outputs[0] and outputs[2] == outputs[0]


def test_a_layer_whose_blocks_are_not_its_weight_is_left_to_rounding_by_name(tmp_path):
    model = gguf_llama(tmp_path / "mix.gguf")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] += 1.0
    found = file_layers(model, tmp_path / "mix.gguf")
    assert found.left == ["model.layers.1.mlp.up_proj (blk.1.ffn_up.weight: its blocks do not give the loaded weight)"]
    assert len(found.layers) == 14

def loadable_gguf(path, *, tied: bool, down_type: str = "Q6_K", arch: str = "llama") -> None:
    """A tiny Llama (or Qwen2: q/k/v biases; or Qwen3: q/k norms, heads 128 wide) GGUF that transformers loads: the
    embedded SmolLM2's tokenizer and chat template, the projections in TYPES' mix of blocks (random levels: the row
    order does not matter), float norms, a Q8_0 embedding, and a Q8_0 output head or none (tied)."""
    import gguf

    from jointspec.backends.embedded import default_gguf_path

    source = gguf.GGUFReader(str(default_gguf_path()))
    writer = gguf.GGUFWriter(str(path), arch)
    for key, field in source.fields.items():
        if key.startswith(("GGUF.", "llama.")) or key == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(key, field.contents(), vtype,
                             sub_type=field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None)
    hidden, intermediate, layers, vocab = 256, 512, 2, int(source.fields["llama.vocab_size"].contents())
    writer.add_vocab_size(vocab)
    writer.add_context_length(256)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    # Qwen3's heads are 128 wide whatever the width (transformers' GGUF reader takes no head size from the file).
    head_dim = 128 if arch == "qwen3" else hidden // 4
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rng = np.random.default_rng(0)
    embedding = random_blocks("Q8_0", vocab, hidden, 1)
    writer.add_tensor("token_embd.weight", embedding, raw_dtype=GGMLQuantizationType.Q8_0)
    seed = 10
    for index in range(layers):
        for name in TYPES:
            rows = {"attn_q": 4 * head_dim, "attn_k": 2 * head_dim, "attn_v": 2 * head_dim, "attn_output": hidden,
                    "ffn_gate": intermediate, "ffn_up": intermediate, "ffn_down": hidden}[name]
            columns = {"ffn_down": intermediate, "attn_output": 4 * head_dim}.get(name, hidden)
            type_name = down_type if name == "ffn_down" else TYPES[name]
            raw = random_blocks(type_name, rows, columns, seed)
            seed += 1
            writer.add_tensor(f"blk.{index}.{name}.weight", raw, raw_dtype=GGMLQuantizationType[type_name])
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{index}.{name}.bias", (0.1 * rng.standard_normal(rows)).astype(np.float32))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{index}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if arch == "qwen3":
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{index}.{norm}.weight", rng.uniform(0.25, 2.0, head_dim).astype(np.float32))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    if not tied:
        head = random_blocks("Q8_0", vocab, hidden, 2)
        writer.add_tensor("output.weight", head, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", True)])
def test_a_gguf_file_loads_from_its_blocks_as_the_dequantising_load_quantises_it(tmp_path, monkeypatch, arch, tied):
    """load_model(file.gguf, quantize=int4) builds the model from the file's blocks (no float copy of its
    weights); it is, bit for bit and module for module, what loading through transformers and taking the blocks back
    (file_layers) gives, and decodes the same tokens."""
    from jointspec.backends import loading

    path = tmp_path / "tiny.gguf"
    loadable_gguf(path, tied=tied, arch=arch)
    direct, tokenizer, _ = loading._load_gguf_blocks(str(path))
    via, _, _ = loading._load_transformers(str(path), "cpu", None)
    quantize_model(via, "int4", file_levels=loading._file_levels(via, str(path), "int4"),
                   screen_head=loading.screens_head(via.config))
    # The input embedding stays as blocks (BlockEmbedding): the same floats, looked up.
    embedding = direct.model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and type(via.model.embed_tokens) is torch.nn.Embedding
    assert torch.equal(embedding.weight, via.model.embed_tokens.weight)
    ids = torch.tensor([[0, 5, 17], [VOCAB - 1, 3, 3]])
    assert torch.equal(embedding(ids), via.model.embed_tokens(ids))
    none = torch.zeros(0, dtype=torch.long)
    assert embedding(none).shape == via.model.embed_tokens(none).shape  # (0, hidden): no rows looked up
    if tied:  # the head's own storage, not a copy
        assert embedding.levels.data_ptr() == direct.lm_head.levels.data_ptr()
    # The 4-bit screen is built only where the model's forward reads it (Qwen3's greedy rows read the exact head).
    assert hasattr(direct.lm_head, "argmax_logits") == (arch != "qwen3")
    ours = {k: v for k, v in direct.state_dict().items() if not k.startswith("model.embed_tokens.")}
    theirs = {k: v for k, v in via.state_dict().items() if not k.startswith("model.embed_tokens.")}
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    assert ([type(m) for m in direct.modules() if m is not embedding]
            == [type(m) for m in via.modules() if m is not via.model.embed_tokens])
    assert direct.config._attn_implementation == via.config._attn_implementation
    assert direct.generation_config.eos_token_id == via.generation_config.eos_token_id is not None
    assert torch.equal(direct.model.rotary_emb.inv_freq, via.model.rotary_emb.inv_freq)
    prompt = tokenizer("The sea is", return_tensors=None)["input_ids"]
    a, b = CausalLM(direct, name="blocks"), CausalLM(via, name="transformers")
    outputs = [greedy_by_methods(model, prompt, 12)[0] for model in (direct, via)]
    assert len(outputs[0]) == 12 and outputs[0] == outputs[1]
    assert torch.equal(a.forward(prompt).logits, b.forward(prompt).logits)
    # load_model takes this path: transformers' dequantising load is not called
    monkeypatch.setattr(loading, "_load_transformers", lambda *args: pytest.fail("loaded through transformers"))
    loaded, _ = loading.load_model(str(path), quantize="int4", kv_cache="float32")  # (auto: float16, another model)
    assert torch.equal(loaded.forward(prompt).logits, CausalLM(direct, name="again").forward(prompt).logits)


def test_the_embedded_default_in_int4_loads_from_its_gguf_blocks_with_its_folders_tokenizer(tmp_path, monkeypatch):
    """The embedded default on the int4 kernels is built from its GGUF's blocks, as a GGUF file given by path is: its
    float copy (the converted folder's weights), which stayed resident beside the int4 model, is never read. Its
    tokenizer, config and name stay the converted folder's, and it decodes what the file's own int4 load decodes. A
    tiny GGUF and its converted folder stand in for the embedded model's."""
    from jointspec.backends import embedded, loading

    path = tmp_path / "tiny.gguf"
    loadable_gguf(path, tied=True)
    folder = tmp_path / "converted"
    embedded._convert(path, folder)  # as a first run converts the embedded GGUF
    calls = []
    monkeypatch.setattr(embedded, "prepare_default_model", lambda: calls.append("prepare") or folder)
    monkeypatch.setattr(embedded, "default_gguf_path", lambda: calls.append("gguf") or path)
    monkeypatch.setattr(loading, "resolve_quantize", lambda quantize, *args, **kwargs: calls.append(quantize) or "int4")
    monkeypatch.setattr(loading, "_load_transformers", lambda *args: pytest.fail("read the float copy"))
    target, tokenizer = loading.load_model("default", quantize="auto", kv_cache="float32")
    assert calls[:2] == ["prepare", "auto"] and "gguf" in calls  # prepared while the kernels build, then decided
    assert isinstance(target.model.model.embed_tokens, BlockEmbedding)
    assert tokenizer.name_or_path == str(folder)
    assert target.name.startswith(loading.DEFAULT_LABEL)
    prompt = tokenizer("The sea is", return_tensors=None)["input_ids"]
    by_path, _ = loading.load_model(str(path), quantize="int4", kv_cache="float32")
    assert torch.equal(target.forward(prompt).logits, by_path.forward(prompt).logits)


def test_a_head_binds_to_a_block_embedding_by_the_rows_it_reads(tmp_path, monkeypatch):
    """A draft head binds to a target loaded from its blocks as to its float load: the same fingerprint (exact and
    bf16) and the same LM head rows for its draft vocabulary, each read off only the rows it needs (the whole float
    matrix is several times the blocks' bytes, and a server binds a head per request)."""
    from jointspec.backends import loading
    from jointspec.drafts.artifact import float_lm_rows, float_lm_weight, target_fingerprint

    path = tmp_path / "tiny.gguf"
    loadable_gguf(path, tied=True)
    blocks, _ = loading.load_model(str(path), quantize="int4")
    float_target, _ = loading.load_model(str(path), quantize="none")
    assert isinstance(blocks.model.model.embed_tokens, BlockEmbedding)
    ids = torch.tensor([3, 0, VOCAB - 1, 3])
    expected = float_lm_weight(float_target.model)[ids]
    monkeypatch.setattr(BlockEmbedding, "weight", property(lambda self: pytest.fail("dequantised every row")))
    assert target_fingerprint(blocks) == target_fingerprint(float_target)
    assert target_fingerprint(blocks, torch.bfloat16) == target_fingerprint(float_target, torch.bfloat16)
    assert torch.equal(float_lm_rows(blocks.model, ids), expected)


def test_a_gguf_with_a_type_the_kernels_do_not_take_loads_through_transformers_and_says_why(tmp_path, caplog):
    from jointspec.backends import loading

    path = tmp_path / "f16.gguf"
    loadable_gguf(path, tied=True, down_type="F16")
    with caplog.at_level("INFO", logger="jointspec.backends.loading"):
        assert loading._load_gguf_blocks(str(path)) is None
    assert "blk.0.ffn_down.weight is F16" in caplog.text
    target, _ = loading.load_model(str(path), quantize="int4")  # through transformers, the F16 layer rounded
    assert type(target.model.model.layers[0].mlp.down_proj) is GroupedInt4Linear


def test_a_quantised_copy_of_a_float_loaded_gguf_is_the_int4_load(tmp_path):
    """The bench's ``quantize=int4`` rows (and ``train-draft --answer-quantize int4``) copy the float target loaded
    from a GGUF: the copy takes the file's own blocks, as ``load_model(..., quantize="int4")`` does. It re-rounded
    the dequantised weights, another model on a K-quant file (logits up to 0.16 apart on a synthetic Q4_K_M)."""
    from jointspec.backends import loading

    path = tmp_path / "tiny.gguf"
    loadable_gguf(path, tied=False)
    float_target, tokenizer = loading.load_model(str(path), quantize="none")
    copied = loading.quantized_copy(float_target, "int4", kv_cache="float32")
    loaded, _ = loading.load_model(str(path), quantize="int4", kv_cache="float32")
    prompt = tokenizer("The sea is", return_tensors=None)["input_ids"]
    assert torch.equal(copied.forward(prompt).logits, loaded.forward(prompt).logits)
