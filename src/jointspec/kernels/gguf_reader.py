"""A GGUF metadata reader that gives what ``gguf.GGUFReader`` gives, in a fraction of its time.

``gguf.GGUFReader`` makes a numpy slice of the memory-mapped file for every scalar of every metadata array (a
49,152-token vocabulary with its 48,900 merges is about 250,000 slices), and every slice of an ``np.memmap`` runs
Python code in numpy's ``memmap.__getitem__`` and ``__array_finalize__``. That parse was the largest single step of
loading the embedded model. :class:`FastGGUFReader` keeps the reader's layout (``fields`` with the same ``parts``,
``data`` and ``types``; ``tensors``), because transformers reads the config and tokenizer from exactly that layout:

- slices come from a plain ``ndarray`` view of the same mapping, so each is made in C;
- an array of strings is walked with ``int.from_bytes`` over the mapping, not one numpy read per length;
- an array of scalars is read as one block and split into its one-element parts in one call.

Arrays of arrays (no writer in use emits them) fall back to the base class's own parse.
"""

from __future__ import annotations

import sys

import numpy as np
from gguf.constants import GGUFValueType
from gguf.gguf_reader import GGUFReader  # the class itself, even while shared_gguf_readers() patches gguf's name

_LENGTH = np.dtype(np.uint64)


class FastGGUFReader(GGUFReader):
    """``gguf.GGUFReader`` with a faster parse of the metadata; the same fields, parts and tensors."""

    def _get(self, offset, dtype, count=1, override_order=None):
        count = int(count)
        plain = self._plain_view()
        dtype = np.dtype(dtype)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _plain_view(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            # memmap slices pay numpy's Python-level hooks; a plain view of the same mapping does not.
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get_field_parts(self, orig_offs, raw_type):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        item_type = GGUFValueType(raw_itype[0])
        count = int(alen[0])
        offs = orig_offs + 12
        if item_type == GGUFValueType.STRING:
            parts, offs = self._string_parts(offs, count)
        elif item_type in self.gguf_scalar_to_np:
            block = self._get(offs, self.gguf_scalar_to_np[item_type], count)
            parts = list(block.reshape(count, 1))
            offs += int(block.nbytes)
        else:
            return super()._get_field_parts(orig_offs, raw_type)
        # Element i's value is part 2 + i for scalars and 3 + 2 i for strings (its length is the part before it).
        first, step = (3, 2) if item_type == GGUFValueType.STRING else (2, 1)
        types = [GGUFValueType.ARRAY, item_type] if count else [GGUFValueType.ARRAY]  # as the base class types them
        return offs - orig_offs, [raw_itype, alen, *parts], list(range(first, first + step * count, step)), types

    def _string_parts(self, offs: int, count: int) -> tuple[list[np.ndarray], int]:
        """``count`` strings from ``offs``: [length, bytes] parts each, as the base class's ``_get_str`` makes them."""
        plain = self._plain_view()
        raw = memoryview(plain)
        host_little = sys.byteorder == "little"
        order = "little" if (self.byte_order == "I") == host_little else "big"
        length_type = _LENGTH.newbyteorder(self.byte_order)
        parts: list[np.ndarray] = []
        for _ in range(count):
            size = int.from_bytes(raw[offs:offs + 8], order)
            parts.append(plain[offs:offs + 8].view(length_type))
            parts.append(plain[offs + 8:offs + 8 + size])
            offs += 8 + size
        return parts, offs


class _ExtentReader(FastGGUFReader):
    """Reads a GGUF's header only, for where its tensor data must end (no tensor views: a file cut inside its
    tensor data cannot give them)."""

    def _build_tensors(self, start_offs, fields) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        end = start_offs
        for field in fields:
            _name_length, _name, _num_dims, dims, raw_type, offset = field.parts
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            end = max(end, start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block_size)
        self.data_end = end
        self.tensors = []


def gguf_shortfall(path) -> tuple[int, int] | None:
    """(bytes a GGUF's header says the file holds, bytes it holds) where the file is shorter than its tensors need;
    None where it is whole, or where its header cannot be read (then the reader's own error says what is wrong)."""
    from pathlib import Path

    try:
        have = Path(path).stat().st_size
        need = _ExtentReader(path).data_end
    except Exception:  # a header cut short or damaged: not this question's to answer
        return None
    return (need, have) if have < need else None


def shortfall_message(path) -> str | None:
    """What to tell a user whose GGUF file ``path`` is cut short inside its tensor data; None where it is not."""
    short = gguf_shortfall(path)
    if short is None:
        return None
    need, have = short
    return (f"'{path}' is cut short: its header describes {need:,} bytes and the file holds {have:,} "
            f"({100 * have / need:.0f} %); copy or download it again (an interrupted download leaves such a file)")
