"""A GGUF file's quantised blocks, taken as they are onto jointspec's grouped CPU kernels.

transformers loads a GGUF by dequantising every tensor to float. Quantising that float model again
(``--quantize int4``) would round it a second time, except where the blocks happen to be recoverable from the floats
(Q4_1 with a Q8_0 head: :func:`jointspec.backends.loading.on_int4_grid`). This module reads the blocks themselves and
gives each projection its levels and scales in a kernel layer's own format:

    GGUF type   kernel layer (kernels/grouped.py)    levels              scale per group      minimum
    Q4_0        4-bit, groups of 32                 q (0..15)           d                    -8 d
    Q4_1        4-bit, groups of 32                 q                   d                    m
    Q4_K        4-bit, groups of 32                 q                   d * sc (sub-block)   -(dmin * m)
    Q5_0        5-bit, groups of 32                 q (0..31)           d                    -16 d
    Q5_1        5-bit, groups of 32                 q                   d                    m
    Q5_K        5-bit, groups of 32                 q                   d * sc (sub-block)   -(dmin * m)
    Q8_0        8-bit, groups of 32                 q                   d
    Q6_K        6-bit, groups of 16                 q - 32              d * sc (sub-block)

Every product there is exact in float32 (a half-precision scale times integers of at most 13 bits together), and the
kernel forms each weight as level * scale (+ minimum) with one rounding, as llama.cpp's ``dequantize_row_*`` does, so a
layer's weight is bit for bit the file's dequantised weight (tests hold it against ``gguf.quants.dequantize``). Where
every scale and minimum of a layer is a half (Q4_0, Q4_1, Q5_0, Q5_1), the layer keeps them as halves (the symmetric
Q4_0 and Q5_0 keep no minima at all, only their offset), and the K-quants keep their sub-scales with a float per 256
weights (``Levels.k_scales``): fewer bytes a step reads, the same values (kernels/grouped.py). The model the kernels
run is then the file's model (its inputs rounded to 8 bits, as llama.cpp rounds them: kernels/grouped.py).

Other types (Q2_K, Q3_K, the IQ types, F16) are not taken: :func:`file_layers` names them and their
tensors, and the caller rounds those layers itself (:func:`jointspec.kernels.quantize.quantize_model`).

Where every projection and the head are in types taken, :func:`model_from_blocks` builds the whole int4 model from the
file without transformers' float copy of every weight (the same model, bit for bit): what keeps a 1B model's peak
memory near its int4 size rather than its float32 one.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from jointspec.kernels.heap import release_freed_memory

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K")
# GGUF tensor names of a Llama-family layer's projections, by the Hugging Face module that holds them.
PROJECTIONS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


@dataclass
class Levels:
    """One tensor's weights as a kernel layer holds them (the same storage, so a model's layers cost no second
    copy): W = levels * scale (+ minimum), [out, in]."""

    bits: int  # 4, 5, 6 or 8
    levels: torch.Tensor  # 4, 5 and 6 bits: uint8 [out, in / 2], byte i of a group of 32 = the low four bits of
    #                       level i | those of level i + 16 << 4 (6 bits: of the level plus 32); 8 bits: int8 [out, in]
    # The scales and minima: float32 [out, in / group]; for Q4_0, Q4_1, Q5_0 and Q5_1 the file's halves (float16),
    # and for the symmetric Q4_0 and Q5_0 the minimum only as the offset, [out, 1] (kernels/grouped.py): no float32
    # copy of them is ever made while a model loads. None where k_scales holds them; float_scales() gives float32.
    scale: torch.Tensor | None
    minimum: torch.Tensor | None  # (4 and 5 bits), None (8 bits; or k_scales)
    fifth: torch.Tensor | None = None  # 5 bits: int32 [out, in / 32], bit i = the fifth bit of the group's level i
    # K-quants (Q4_K, Q5_K, Q6_K): the scales as the file keeps them, (super, sub) in the kernels' K form
    # (kernels/grouped.py): 4 and 5 bits float32 [out, 2, in / 256] (d, dmin) and uint8 [out, 2, in / 32] (sc, m);
    # 6 and 8 bits float32 [out, in / 256] (d) and int8 [out, in / 16] (sc). The same floats as scale and minimum
    # would hold, in a fifth of the bytes; those are then None.
    k_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    plane: torch.Tensor | None = None  # 6 bits: uint8 [out, in / 4], the top two bits (kernels/grouped.py, pack_six)

    def layer(self, bias: torch.Tensor | None = None) -> nn.Module:
        """The grouped kernel layer holding these levels (their storage, not a copy), with ``bias``."""
        from jointspec.kernels.grouped import GroupedInt4Linear, GroupedInt5Linear, GroupedInt6Linear, GroupedInt8Linear

        scale, minimum = self.k_scales if self.k_scales is not None else (self.scale, self.minimum)
        if self.bits == 4:
            return GroupedInt4Linear.from_levels(self.levels, scale, minimum, bias)
        if self.bits == 5:
            return GroupedInt5Linear.from_levels(self.levels, self.fifth, scale, minimum, bias)
        if self.bits == 6:
            return GroupedInt6Linear.from_levels(self.levels, self.plane, scale, minimum, bias)
        if self.k_scales is not None:
            return GroupedInt8Linear.from_levels(self.levels, scale, bias, sub=minimum)
        return GroupedInt8Linear.from_levels(self.levels, self.scale, bias)

    def weight(self) -> torch.Tensor:
        """The float32 weight these levels stand for (what the kernels multiply by)."""
        # 6 and 8 bits without building a layer: an embedding looks up a few rows of Q6_K or Q8_0 every step
        if self.bits == 6:
            from jointspec.kernels.grouped import six_weight

            return six_weight(self.levels, self.plane, *self.k_scales)
        if self.bits == 8:
            from jointspec.kernels.grouped import eight_weight

            return eight_weight(self.levels, *(self.k_scales or (self.scale,)))
        return self.layer().dequantized()

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's float32 scale, [out, in / group], and minimum (4 and 5 bits; else None), in any form."""
        if self.k_scales is None and self.scale.dtype == torch.float32:
            return self.scale, self.minimum
        layer = self.layer()
        return (layer.unit_scales(), None) if self.bits in (6, 8) else layer.group_scales()

    def rows(self, order: torch.Tensor | slice) -> Levels:
        """These levels' rows ``order`` (indices or a slice)."""
        def take(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[order]

        return Levels(self.bits, self.levels[order], take(self.scale), take(self.minimum), take(self.fifth),
                      None if self.k_scales is None else (self.k_scales[0][order], self.k_scales[1][order]),
                      take(self.plane))


def _half(raw: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian float16 at ``offset`` of every block, as float32: [rows, blocks]."""
    return _halves(raw, offset).astype(np.float32)


def _halves(raw: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian float16 at ``offset`` of every block, as float16: [rows, blocks]."""
    return np.ascontiguousarray(raw[..., offset:offset + 2]).view(np.float16)[..., 0].copy()


def _offset(rows: int, offset: float) -> torch.Tensor:
    """A symmetric type's minima as the kernels' offset form: [rows, 1] float16, every one ``offset`` (its scale's
    multiple)."""
    return torch.full((rows, 1), offset, dtype=torch.float16)


def _pack(levels: np.ndarray) -> np.ndarray:
    """[..., 32] levels (their low four bits) -> [..., 16] bytes in the kernel's (and Q4_0's) order."""
    return (levels[..., :16] & 15) | ((levels[..., 16:] & 15) << 4)


def _fifth_words(levels: np.ndarray) -> np.ndarray:
    """[..., 32] levels (0..31) -> [...] int32 words, bit i = level i's fifth bit."""
    bits = (levels.astype(np.uint32) >> 4) & 1
    return (bits << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32).view(np.int32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's twelve bytes -> eight 6-bit scales and eight 6-bit minima (llama.cpp's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(sc)
    sc[..., :4], m[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, m


def _k_form(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K scales ([rows, blocks] d and dmin, [rows, blocks, 8] sc and m) in the kernels' K form."""
    rows = d.shape[0]
    return (torch.from_numpy(np.stack([d, dmin], axis=1).astype(np.float32)),
            torch.from_numpy(np.stack([sc.reshape(rows, -1), m.reshape(rows, -1)], axis=1).astype(np.uint8)))


def decode(raw: np.ndarray, type_name: str, columns: int, compiled: bool = True) -> Levels:
    """A tensor's raw blocks ([rows, bytes per row] uint8, as ``gguf.GGUFReader`` gives them) as :class:`Levels`.

    The K-quants (Q4_K, Q5_K, Q6_K: the bulk of a Q4_K_M or Q5_K_M file) are rearranged by the compiled kernels
    where they are loaded (``compiled``), else by the numpy code below, which is their reference (the same bytes;
    tested)."""
    rows = raw.shape[0]
    if type_name not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF type {type_name} is not one jointspec's kernels take; they take: "
                         f"{', '.join(SUPPORTED_TYPES)}")
    size = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176, "Q8_0": 34,
            "Q6_K": 210}[type_name]
    per_block = 256 if type_name.endswith("_K") else 32
    if columns % per_block or raw.shape[1] != columns // per_block * size:
        raise ValueError(f"a {type_name} row of {columns} weights takes {columns // per_block * size} bytes, "
                         f"got {raw.shape[1]}")
    blocks = np.ascontiguousarray(raw).reshape(rows, columns // per_block, size)
    as_tensor = torch.from_numpy
    if type_name in ("Q4_0", "Q4_1"):
        d = as_tensor(_halves(blocks, 0))
        minimum = _offset(rows, -8.0) if type_name == "Q4_0" else as_tensor(_halves(blocks, 2))
        packed = np.ascontiguousarray(blocks[..., 2 if type_name == "Q4_0" else 4:])  # already the kernel's order
        return Levels(4, as_tensor(packed.reshape(rows, columns // 2)), d, minimum)
    # The kernels as loaded (a load onto them has built them); never a build here.
    from jointspec.kernels.grouped import loaded_kernels

    module = loaded_kernels() if compiled and type_name in ("Q4_K", "Q5_K", "Q6_K") else None
    if module is not None:
        with warnings.catch_warnings():  # a mapped file is read-only; the kernels only read it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = as_tensor(blocks.reshape(rows, -1))
        if type_name == "Q4_K":
            packed, scales, subs = module.k_quant_blocks(flat, False)
            return Levels(4, packed, None, None, k_scales=(scales, subs))
        if type_name == "Q5_K":
            packed, scales, subs, fifth = module.k_quant_blocks(flat, True)
            return Levels(5, packed, None, None, fifth, (scales, subs))
        packed, plane, scale, sub = module.q6_k_blocks(flat)
        return Levels(6, packed, None, None, k_scales=(scale, sub), plane=plane)
    if type_name == "Q4_K":
        d, dmin = _half(blocks, 0), _half(blocks, 2)
        sc, m = _k_scales(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # four chunks of 64 elements, 32 bytes each
        levels = np.stack([qs & 15, qs >> 4], axis=3)  # chunk c: low nibbles sub-block 2c, high ones 2c + 1
        return Levels(4, as_tensor(_pack(levels).reshape(rows, columns // 2)), None, None,
                      k_scales=_k_form(d, dmin, sc, m))
    if type_name in ("Q5_0", "Q5_1"):  # the nibbles in Q4_0's order, and bit i of a 32-bit word: element i's fifth bit
        d = as_tensor(_halves(blocks, 0))
        minimum = _offset(rows, -16.0) if type_name == "Q5_0" else as_tensor(_halves(blocks, 2))
        start = 2 if type_name == "Q5_0" else 4
        fifth = blocks[..., start:start + 4].copy().view("<i4")[..., 0]
        packed = np.ascontiguousarray(blocks[..., start + 4:])
        return Levels(5, as_tensor(packed.reshape(rows, columns // 2)), d, minimum, as_tensor(fifth.astype(np.int32)))
    # Q5_K: Q4_K's layout, plus qh[32]: element 64c + l takes bit 2c of qh[l], 64c + 32 + l bit 2c + 1
    if type_name == "Q5_K":
        d, dmin = _half(blocks, 0), _half(blocks, 2)
        sc, m = _k_scales(blocks[..., 4:16])
        qh = blocks[..., 16:48]  # [rows, blocks, 32]
        qs = blocks[..., 48:].reshape(rows, -1, 4, 32)
        shifts = np.arange(8, dtype=np.uint8).reshape(4, 2)  # chunk c: bits 2c (low nibbles) and 2c + 1 (high)
        high = (qh[:, :, None, None, :] >> shifts[None, None, :, :, None]) & 1  # [rows, blocks, 4, 2, 32]
        levels = np.stack([qs & 15, qs >> 4], axis=3) | (high << 4)
        return Levels(5, as_tensor(_pack(levels).reshape(rows, columns // 2)), None, None,
                      as_tensor(_fifth_words(levels).reshape(rows, -1)), _k_form(d, dmin, sc, m))
    if type_name == "Q8_0":
        d = _half(blocks, 0)
        levels = blocks[..., 2:].copy().view(np.int8)
        return Levels(8, as_tensor(levels.reshape(rows, columns)), as_tensor(d), None)
    # Q6_K: two halves of 128 elements; for l < 32 the four elements l, l + 32, l + 64, l + 96 of a half take the
    # low or high nibble of ql[l] / ql[l + 32] and two bits of qh[l]; sixteen signed scales, one per 16 elements.
    # Kept in 6 bits a level (kernels/grouped.py, pack_six): the same levels in the kernel's order.
    ql = blocks[..., :128].reshape(rows, -1, 2, 2, 32)  # [half, l or l + 32, l]
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 32)
    d = _half(blocks, 208)
    # In place, in bytes: an embedding-sized tensor's temporaries set a load's peak. The level (0..63) minus 32
    # wraps in uint8 to the signed level's byte.
    levels = np.concatenate([ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], axis=-1)
    top = np.tile(qh, (1, 1, 1, 4))
    top >>= np.repeat(np.array([0, 2, 4, 6], dtype=np.uint8), 32)
    top &= 3
    top <<= 4
    levels |= top
    del top
    levels -= np.uint8(32)
    from jointspec.kernels.grouped import pack_six

    packed, plane = pack_six(as_tensor(levels.view(np.int8).reshape(rows, columns)))
    del levels
    # Scale of sub-block j: d * sc[j] (llama.cpp's dequantize_row_q6_K), kept as d and sc (the kernels' K form).
    return Levels(6, packed, None, None,
                  k_scales=(as_tensor(np.ascontiguousarray(d)),
                            as_tensor(blocks[..., 192:208].copy().view(np.int8).reshape(rows, -1))),
                  plane=plane)


def decode_tensor(path: Path, tensor, columns: int, block: int = 8192) -> Levels:
    """:func:`decode` of a file's tensor, a block of rows at a time into the result, each block read from the file as
    it is decoded: a large tensor (a vocabulary's embedding) whole would hold its bytes and several times its size in
    temporaries, at a load's peak."""
    type_name = tensor.tensor_type.name
    rows = int(tensor.data.shape[0])
    if rows <= block:
        return decode(_read(path, tensor), type_name, columns)
    first = decode(_read(path, tensor, 0, block), type_name, columns)

    def full(part: torch.Tensor | None) -> torch.Tensor | None:
        return None if part is None else torch.empty((rows, *part.shape[1:]), dtype=part.dtype)

    out = Levels(first.bits, full(first.levels), full(first.scale), full(first.minimum), full(first.fifth),
                 None if first.k_scales is None else (full(first.k_scales[0]), full(first.k_scales[1])),
                 full(first.plane))
    for start in range(0, rows, block):
        part = first if start == 0 else decode(_read(path, tensor, start, start + block), type_name, columns)
        for name in ("levels", "scale", "minimum", "fifth", "plane"):
            if getattr(part, name) is not None:
                getattr(out, name)[start:start + block] = getattr(part, name)
        for mine, theirs in zip(out.k_scales or (), part.k_scales or ()):
            mine[start:start + block] = theirs
    return out


# The readers a load shares, by (path, modification time, size), while shared_gguf_readers() is open; None outside.
_SHARED_READERS: dict[tuple, object] | None = None


@contextlib.contextmanager
def shared_gguf_readers():
    """Within this block (``load_model`` runs in one), :func:`gguf_reader` gives every caller the same reader of an
    unchanged file; afterwards they are dropped (a large vocabulary's parsed keys hold over 0.1 GB).

    transformers parses the file again for the config and for the tokenizer's class (``gguf.GGUFReader`` inside
    ``load_gguf_checkpoint``): within the block ``gguf.GGUFReader`` opens for reading give the shared reader too, which
    takes two of a load's four parses of the metadata away and gives transformers the fast parse. The module
    attribute is restored when the block ends."""
    global _SHARED_READERS
    if _SHARED_READERS is not None:
        yield
        return
    import gguf

    original = gguf.GGUFReader

    def shared(path, mode="r"):
        return gguf_reader(path) if mode == "r" else original(path, mode)

    _SHARED_READERS = {}
    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original
        _SHARED_READERS = None


def gguf_reader(path: str | Path):
    """A reader of ``path`` (:class:`~jointspec.kernels.gguf_reader.FastGGUFReader`, what ``gguf.GGUFReader`` gives):
    a reader parses every metadata key when made, and one load asks for the file's tensors more than once, so inside
    :func:`shared_gguf_readers` the reader of an unchanged file (its size and modification time) is made once."""
    from jointspec.kernels.gguf_reader import FastGGUFReader as reader_class

    resolved = Path(path).expanduser().resolve()
    if _SHARED_READERS is None:
        return reader_class(str(resolved))
    stat = resolved.stat()
    key = (str(resolved), stat.st_mtime_ns, stat.st_size)
    if key not in _SHARED_READERS:
        _SHARED_READERS[key] = reader_class(str(resolved))
    return _SHARED_READERS[key]


def _llama_permutation(rows: int, heads: int) -> torch.Tensor:
    """The order llama.cpp's converter gives a Llama q or k projection's rows (rotary halves interleaved):
    GGUF row i is Hugging Face row ``order[i]``."""
    return torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)


@dataclass
class FileLayers:
    """The layers :func:`file_layers` could take from the file, by module name, and what it left to rounding."""

    layers: dict[str, Levels]
    left: list[str]  # "module (reason)"


def file_layers(model: nn.Module, path: str | Path) -> FileLayers:
    """The exact :class:`Levels` of ``model``'s projections and output head, read from the GGUF ``path`` it was
    loaded from. Each is checked against the float weight transformers dequantised from the same file (bit for
    bit), which also settles the row order of q and k (llama.cpp's converter permutes them for Llama models)."""
    reader = gguf_reader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = model.config
    wanted: dict[str, tuple[str, nn.Linear]] = {}
    for index, layer in enumerate(model.model.layers):
        for module_name, tensor_name in PROJECTIONS.items():
            owner, attribute = module_name.split(".")
            linear = getattr(getattr(layer, owner, None), attribute, None)
            if type(linear) is nn.Linear:
                wanted[f"model.layers.{index}.{module_name}"] = (f"blk.{index}.{tensor_name}.weight", linear)
    head = model.get_output_embeddings()
    if type(head) is nn.Linear:
        wanted["lm_head"] = ("output.weight" if "output.weight" in tensors else "token_embd.weight", head)
    layers, left = {}, []
    for module_name, (tensor_name, linear) in wanted.items():
        tensor = tensors.get(tensor_name)
        if tensor is None:
            left.append(f"{module_name} (no tensor {tensor_name} in the file)")
            continue
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            left.append(f"{module_name} ({tensor_name} is {type_name}; taken: {', '.join(SUPPORTED_TYPES)})")
            continue
        levels = decode(np.asarray(tensor.data), type_name, linear.in_features)
        found = _matching_order(levels, linear.weight.detach(), module_name, config)
        if found is None:
            left.append(f"{module_name} ({tensor_name}: its blocks do not give the loaded weight)")
            continue
        layers[module_name] = found
    return FileLayers(layers, left)


def _matching_order(levels: Levels, weight: torch.Tensor, module_name: str, config) -> Levels | None:
    """``levels`` in the module's row order, if their weight is the loaded one bit for bit (else None)."""
    candidates = [None]
    if module_name.endswith(("q_proj", "k_proj")):
        heads = config.num_attention_heads if module_name.endswith("q_proj") else config.num_key_value_heads
        if levels.levels.shape[0] % (2 * heads) == 0:
            candidates.append(torch.argsort(_llama_permutation(levels.levels.shape[0], heads)))
    for order in candidates:
        ordered = levels if order is None else levels.rows(order)
        dequantized = ordered.weight()
        if dequantized.shape == weight.shape and torch.equal(dequantized, weight.float()):
            return ordered
    return None


def _read(path: Path, tensor, start: int = 0, stop: int | None = None) -> np.ndarray:
    """A tensor's bytes (its rows ``start`` .. ``stop`` - 1) read from the file, shaped as the reader's mapped view,
    without touching that view: mapped pages, once read, count towards the process's memory until the file is
    unmapped."""
    shape = tuple(tensor.data.shape)
    stop = shape[0] if stop is None else min(stop, shape[0])
    row_bytes = tensor.n_bytes // shape[0]
    raw = np.empty((stop - start) * row_bytes, dtype=np.uint8)  # writable, so torch may view it without a copy
    with open(path, "rb") as file:
        file.seek(tensor.data_offset + start * row_bytes)
        if file.readinto(memoryview(raw)) != raw.size:
            raise ValueError(f"{path} ends inside tensor {tensor.name}: the file is cut short")
    return raw.view(tensor.data.dtype).reshape(stop - start, *shape[1:])


def _dequantized_in_blocks(levels: Levels, block: int = 4096) -> torch.Tensor:
    """``levels.weight()``, a block of rows at a time (the float temporaries of one block only)."""
    rows, stored = levels.levels.shape
    out = torch.empty(rows, stored if levels.bits == 8 else 2 * stored)  # 4 and 5 bits: two levels a byte
    for start in range(0, rows, block):
        part = slice(start, start + block)
        out[part] = levels.rows(part).weight()
    return out


class BlockEmbedding(nn.Module):
    """An input embedding that keeps a file's blocks (:class:`Levels`) and dequantises the rows it looks up: the same
    floats as the float32 embedding of those blocks, at the blocks' size (for a tied model, the head's own storage).
    ``weight`` gives the whole float matrix, for the rare callers that want it."""

    def __init__(self, levels: Levels) -> None:
        super().__init__()
        self.bits = levels.bits
        for name in ("levels", "scale", "minimum", "fifth", "plane"):
            self.register_buffer(name, getattr(levels, name))
        for name, tensor in zip(("k_super", "k_sub"), levels.k_scales or (None, None)):
            self.register_buffer(name, tensor)
        self.num_embeddings = levels.levels.shape[0]
        self.embedding_dim = levels.levels.shape[1] * (1 if levels.bits == 8 else 2)
        self.padding_idx = None

    def _levels(self) -> Levels:
        return Levels(self.bits, self.levels, self.scale, self.minimum, self.fifth,
                      None if self.k_super is None else (self.k_super, self.k_sub), self.plane)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight_rows(ids.reshape(-1)).reshape(*ids.shape, self.embedding_dim)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (1-D) of :attr:`weight`, dequantising those rows alone."""
        return self._levels().rows(ids).weight()

    @property
    def weight(self) -> torch.Tensor:
        return _dequantized_in_blocks(self._levels())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.bits}-bit blocks from the file"


# The float tensors of a Llama-family model besides its projections and head: Hugging Face name -> GGUF name, with
# a layer's under its module. Biases of q/k/v are Qwen2's, the per-head q/k norms Qwen3's.
_FLOAT_TENSORS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_LAYER_FLOAT_TENSORS = {"input_layernorm.weight": "attn_norm.weight",
                        "post_attention_layernorm.weight": "ffn_norm.weight",
                        "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                        "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
                        "self_attn.k_norm.weight": "attn_k_norm.weight"}
# The architectures whose every tensor the mappings above name (anything else loads through transformers).
BLOCK_LOADED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def model_from_blocks(path: str | Path, config, screen_head: bool = True) -> tuple[nn.Module | None, str | None]:
    """(model, None): the GGUF model at ``path`` built on jointspec's kernels straight from its blocks, without the
    float copy of every weight that transformers' loader makes first; or (None, why not) where that cannot be done
    (the caller then loads through transformers). ``config``: the model's transformers config (read from the file).

    The model is what loading through transformers and :func:`jointspec.kernels.quantize.quantize_model` with
    :func:`file_layers` gives, bit for bit (tested): the projections and head from the file's blocks, q and k rows in
    Hugging Face's order (llama.cpp's converter permutes them for ``llama`` files), the input embedding kept as blocks
    (:class:`BlockEmbedding`: the same floats, looked up), norms and biases dequantised to float32. What it saves is the
    float32 copy of the weights: about 4 bytes per weight of peak memory (6 GB for a 1.5B model), and the time
    transformers takes to make it. ``screen_head``: as :func:`~jointspec.kernels.quantize.quantize_model`'s."""
    import gguf
    from transformers import AutoModelForCausalLM

    from jointspec.kernels.grouped import kernels
    from jointspec.kernels.quantize import quantize_model

    if config.model_type not in BLOCK_LOADED_MODEL_TYPES:
        return None, f"model type {config.model_type} (taken from blocks: {', '.join(BLOCK_LOADED_MODEL_TYPES)})"
    if kernels() is None:
        return None, "the grouped kernels do not run here"
    reader = gguf_reader(path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    architecture = reader.fields["general.architecture"].contents()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    levels: dict[str, Levels] = {}
    wanted = {f"model.layers.{i}.{module}": f"blk.{i}.{name}.weight"
              for i in range(len(model.model.layers)) for module, name in PROJECTIONS.items()}
    wanted["lm_head"] = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    for module_name, tensor_name in wanted.items():
        linear = model.get_submodule(module_name)
        tensor = tensors.get(tensor_name)
        if type(linear) is not nn.Linear or tensor is None:
            return None, f"{module_name} has no {tensor_name} in the file"
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            return None, f"{tensor_name} is {tensor.tensor_type.name}"
        found = decode_tensor(path, tensor, linear.in_features)
        if architecture == "llama" and module_name.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if module_name.endswith("q_proj") else config.num_key_value_heads
            found = found.rows(torch.argsort(_llama_permutation(linear.out_features, heads)))
        levels[module_name] = found
        release_freed_memory()  # each tensor's temporaries, before the next one's: the load's peak
    floats = dict(_FLOAT_TENSORS)
    for i in range(len(model.model.layers)):
        floats.update({f"model.layers.{i}.{name}": f"blk.{i}.{gguf_name}"
                       for name, gguf_name in _LAYER_FLOAT_TENSORS.items()})
    embedding: Levels | None = None
    for module_name, module in model.named_modules():
        for name, parameter in list(module._parameters.items()):
            full_name = f"{module_name}.{name}" if module_name else name
            if parameter is None or (full_name.endswith(".weight") and full_name[:-len(".weight")] in levels):
                continue
            tensor = tensors.get(floats.get(full_name, ""))
            if tensor is None:
                return None, f"no tensor in the file for {full_name}"
            if full_name == "model.embed_tokens.weight" and tensor.tensor_type.name in SUPPORTED_TYPES:
                # Kept as blocks (BlockEmbedding, below): the head's own levels if it is tied.
                embedding = (levels["lm_head"] if tensor.name == wanted["lm_head"]
                             else decode_tensor(path, tensor, parameter.shape[1]))
                continue
            # The rest are norms and biases: small, any type.
            values = torch.from_numpy(np.array(gguf.quants.dequantize(_read(path, tensor), tensor.tensor_type),
                                               dtype=np.float32))
            if architecture == "llama" and full_name.endswith(("q_proj.bias", "k_proj.bias")):
                heads = config.num_attention_heads if "q_proj" in full_name else config.num_key_value_heads
                values = values.reshape(-1)[torch.argsort(_llama_permutation(values.numel(), heads))]
            module._parameters[name] = nn.Parameter(values.reshape(parameter.shape), requires_grad=False)
    if embedding is not None:
        model.model.embed_tokens = BlockEmbedding(embedding)
    rotary = model.model.rotary_emb  # its buffers are computed from the config, not stored
    model.model.rotary_emb = type(rotary)(config=config)
    del reader, tensors, tensor, found
    quantize_model(model, "int4", file_levels=levels, screen_head=screen_head)  # empties the dict (levels handed over)
    release_freed_memory()
    left = [name for name, value in [*model.named_parameters(), *model.named_buffers()] if value.is_meta]
    if left:
        return None, f"tensors not in the file: {', '.join(left[:4])}"
    return model.eval(), None
