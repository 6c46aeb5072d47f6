"""``gguf.GGUFReader`` with its metadata arrays read a block at a time.

The ``gguf`` package reads every element of a metadata array on its own: a numpy view of the
mapped file per number and two per string, each through ``np.memmap``'s Python-level
``__getitem__`` and ``__array_finalize__``. A model's tokenizer is such arrays (SmolLM2's
49,152 tokens, their types and 48,900 merges), so opening its 90 MB file took 6-10 CPU-s, far
more than dequantising every tensor. :class:`FastReader` changes only how an array field's
elements are located: numbers as one view of the whole array, strings by walking their
little-endian lengths over the raw bytes; everything else (the header, scalar fields,
tensor descriptions, alignment, the checks on tensor bytes against the file's end) is the
package's own. Its fields answer ``contents()`` as the package's do (tests/test_gguf.py
compares the two on a file holding every value type), and an array reaching past the end of
the file is refused where the package would quietly read a short one.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

ARRAY = gguf.GGUFValueType.ARRAY
STRING = gguf.GGUFValueType.STRING
HEAD = 12
"""Bytes before an array's first element: its element type (uint32) and length (uint64)."""


class FastReader(gguf.GGUFReader):
    """A ``GGUFReader`` whose array fields hold one part for a numeric array's values, or one
    per string of a string array (the package holds one per number and two per string);
    ``contents()`` reads them the same way."""

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[Any], list[int], list[gguf.GGUFValueType]]:
        if raw_type != ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        count = int(length[0]) if len(length) else 0
        if len(raw_itype) == 0 or count == 0:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = gguf.GGUFValueType(int(raw_itype[0]))
        head = [raw_itype, length]
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(orig_offs + HEAD, nptype, count)
            if len(values) != count:
                raise ValueError(f"a metadata array at byte {orig_offs} runs past the end")
            return HEAD + int(values.nbytes), [*head, values], [2], [ARRAY, itype]
        if itype != STRING:  # arrays of arrays: the package's own element-by-element walk
            return super()._get_field_parts(orig_offs, raw_type)
        strings, end = self._strings(orig_offs + HEAD, count)
        return end - orig_offs, head + strings, list(range(2, 2 + count)), [ARRAY, STRING]

    def _strings(self, offs: int, count: int) -> tuple[list[np.ndarray], int]:
        """``count`` length-prefixed strings from byte ``offs``: a uint8 view of each one's
        bytes, and the offset after the last."""
        plain = self.data.view(np.ndarray)  # slices of a plain array skip memmap's hooks
        raw, size = memoryview(plain), len(plain)
        out = []
        for _ in range(count):
            start = offs + 8
            if start > size:
                raise ValueError(f"a metadata string at byte {offs} runs past the end")
            end = start + int.from_bytes(raw[offs:start], "little")
            if end > size:
                raise ValueError(f"a metadata string at byte {offs} runs past the end")
            out.append(plain[start:end])
            offs = end
        return out, offs
