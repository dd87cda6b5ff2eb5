"""The fast GGUF metadata reader gives what ``gguf.GGUFReader`` gives: every field's parts, data indices and types,
and every tensor, on files of either byte order holding every metadata type a writer emits."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from gguf import GGUFEndian, GGUFValueType

from jointspec.kernels.gguf_blocks import gguf_reader, shared_gguf_readers
from jointspec.kernels.gguf_reader import FastGGUFReader


def write_file(path, endian: GGUFEndian) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    words = ["".join(chr(int(c)) for c in rng.integers(33, 0x2FF, size=rng.integers(0, 12))) for _ in range(3000)]
    writer.add_array("tokenizer.ggml.tokens", words)  # lengths 0..11, multi-byte UTF-8 included
    writer.add_array("tokenizer.ggml.scores", [float(x) for x in rng.normal(size=3000)])
    writer.add_array("tokenizer.ggml.token_type", [int(x) for x in rng.integers(1, 6, size=3000)])
    writer.add_array("flags", [True, False, True])
    writer.add_key_value("u8", 7, GGUFValueType.UINT8)
    writer.add_key_value("i16", -300, GGUFValueType.INT16)
    writer.add_key_value("u64", 2**40 + 3, GGUFValueType.UINT64)
    writer.add_key_value("f64", 0.125, GGUFValueType.FLOAT64)
    writer.add_key_value("b", True, GGUFValueType.BOOL)
    writer.add_key_value("i8s", [-1, 2, -3], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT8)
    writer.add_key_value("u64s", [1, 2**50], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
    writer.add_string("general.name", "tiny ünïcode")
    for index, shape in enumerate([(3, 5), (16,), (2, 3, 4)]):
        values = rng.normal(size=shape).astype(np.float32)
        writer.add_tensor(f"t{index}", values if endian == GGUFEndian.LITTLE else values.byteswap(),
                          tensor_endianess=endian)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_fields_and_tensors_are_gguf_readers(tmp_path, endian):
    path = tmp_path / "meta.gguf"
    write_file(path, endian)
    theirs, mine = gguf.GGUFReader(str(path)), FastGGUFReader(str(path))
    assert mine.byte_order == theirs.byte_order == ("I" if endian == GGUFEndian.LITTLE else "S")
    assert list(mine.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        other = mine.fields[name]
        assert (other.offset, other.name, other.data, other.types) == (field.offset, field.name, field.data,
                                                                        field.types), name
        assert len(other.parts) == len(field.parts), name
        for a, b in zip(other.parts, field.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
        assert other.contents() == field.contents(), name
    assert mine.data_offset == theirs.data_offset and mine.alignment == theirs.alignment
    assert len(mine.tensors) == len(theirs.tensors) == 3
    for a, b in zip(mine.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_empty_arrays_and_arrays_of_arrays_are_gguf_readers(tmp_path):
    """What gguf's writer refuses to write but a file may hold: an empty array, and arrays of arrays (read by the
    base class's own parse)."""

    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    def array(item_type: GGUFValueType, items: list[bytes]) -> bytes:
        return struct.pack("<IQ", item_type, len(items)) + b"".join(items)

    strings = [struct.pack("<Q", len(w)) + w for w in (b"ab", b"", b"cde")]
    kvs = [key("empty") + struct.pack("<I", GGUFValueType.ARRAY) + array(GGUFValueType.INT32, []),
           key("empty.strings") + struct.pack("<I", GGUFValueType.ARRAY) + array(GGUFValueType.STRING, []),
           key("nested") + struct.pack("<I", GGUFValueType.ARRAY) + array(GGUFValueType.ARRAY, [
               array(GGUFValueType.STRING, strings), array(GGUFValueType.UINT16, [struct.pack("<H", 9)] * 2)]),
           key("after") + struct.pack("<I", GGUFValueType.UINT32) + struct.pack("<I", 5)]
    path = tmp_path / "raw.gguf"
    path.write_bytes(struct.pack("<IIQQ", gguf.GGUF_MAGIC, 3, 0, len(kvs)) + b"".join(kvs))
    theirs, mine = gguf.GGUFReader(str(path)), FastGGUFReader(str(path))
    assert list(mine.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        other = mine.fields[name]
        assert (other.offset, other.data, other.types) == (field.offset, field.data, field.types), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(other.parts, field.parts)), name
    assert mine.fields["after"].contents() == 5


def test_a_load_and_transformers_read_through_the_fast_reader(tmp_path):
    path = tmp_path / "meta.gguf"
    write_file(path, GGUFEndian.LITTLE)
    assert type(gguf_reader(path)) is FastGGUFReader
    with shared_gguf_readers():
        opened = gguf.GGUFReader(str(path))  # how transformers opens a file inside a load
        assert type(opened) is FastGGUFReader and opened is gguf_reader(path)
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # restored after the block
