"""Memory-mapped indexed datasets in Megatron-LM's exact ``.bin``/``.idx`` format.

Keeping Megatron's byte layout means datasets preprocessed by Megatron train here unchanged and
ours train there. ``prefix.bin`` holds the token ids of every sequence back to back; ``prefix.idx``
holds, little-endian::

    magic b"MMIDIDX\\x00\\x00" | uint64 version (1) | uint8 dtype code
    uint64 sequence count N | uint64 document-index count D
    int32 sequence lengths[N] | int64 sequence byte pointers[N] | int64 document indices[D]

Document indices start at 0 and end at N (each entry is a document boundary in sequences). Our
writer stores one sequence per document. Megatron's builder with ``multimodal=True`` appends
int8 sequence modes[N]; such an index is recognised by its size and refused as unsupported.
Both files are opened with numpy memory maps, so a dataset of any size opens instantly and is
paged in on demand; every inconsistency is reported as a :class:`MeshtronError` naming the file
instead of surfacing later as a numpy error.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from meshtron.errors import MeshtronError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
DTYPE_CODES: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype[Any]:
    """The token dtype Megatron picks: uint16 below 65500 tokens, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def indexed_prefix(path: str) -> str | None:
    """The dataset prefix ``path`` names, or None when it names raw text instead.

    ``x.bin``/``x.idx`` always mean the dataset ``x`` (a missing partner file is reported when
    it is opened); a bare ``x`` is a dataset when ``x`` itself does not exist but one of its
    files does.
    """
    expanded = os.path.expanduser(path)
    if expanded.endswith((".bin", ".idx")):
        return expanded[:-4]
    if os.path.exists(expanded):
        return None
    if os.path.exists(expanded + ".bin") or os.path.exists(expanded + ".idx"):
        return expanded
    return None


class IndexedDatasetWriter:
    """Appends documents to ``prefix.bin``/``prefix.idx``; files appear only on finalize.

    Data goes to ``.bin.tmp``/``.idx.tmp`` first and is renamed into place, ``.idx`` last, so a
    reader never sees a half-written dataset. Use as a context manager to remove the temporary
    files when writing fails.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype[Any] | type) -> None:
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self._bin_tmp = Path(self.prefix + ".bin.tmp")
        self._idx_tmp = Path(self.prefix + ".idx.tmp")
        try:
            self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize/abort
        except OSError as err:
            raise MeshtronError(f"cannot write {self._bin_tmp} ({err.strerror})") from None
        self._lengths: list[int] = []
        self._limits = (
            np.iinfo(self.dtype) if self.dtype.kind in "iu" else np.finfo(self.dtype)
        )

    def add_document(self, ids: Any) -> None:
        """Append one document (one sequence) of token ids."""
        array = np.asarray(ids)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-D sequence of ids, got shape {array.shape}")
        if array.size and (array.min() < self._limits.min or array.max() > self._limits.max):
            raise ValueError(f"token ids outside the range of {self.dtype}")
        if array.size > np.iinfo(np.int32).max:
            raise ValueError("a document may hold at most 2**31-1 tokens")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(array.size))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as idx:
            idx.write(HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(lengths),
                                  len(documents)))
            idx.write(lengths.tobytes())
            idx.write(pointers.tobytes())
            idx.write(documents.tobytes())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")

    def abort(self) -> None:
        """Drop everything written so far."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()


class IndexedDataset:
    """Read-only view of ``prefix.bin``/``prefix.idx``, validated on open."""

    def __init__(self, prefix: str | Path) -> None:
        prefix = str(prefix)
        if prefix.endswith((".bin", ".idx")):
            prefix = prefix[:-4]
        self.prefix = prefix
        self.idx_path = Path(prefix + ".idx")
        self.bin_path = Path(prefix + ".bin")
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise MeshtronError(f"indexed dataset file not found: {path}")
        try:
            self._open()
        except OSError as err:
            raise MeshtronError(f"cannot read indexed dataset {prefix} ({err.strerror})") from None

    def _open(self) -> None:
        idx = self.idx_path
        size = idx.stat().st_size
        if size < HEADER.size:
            raise MeshtronError(
                f"{idx} is truncated: {size} bytes, shorter than the {HEADER.size}-byte header"
            )
        with open(idx, "rb") as handle:
            magic, version, code, count, num_docs = HEADER.unpack(handle.read(HEADER.size))
        if magic != MAGIC:
            raise MeshtronError(f"{idx} is not a Megatron indexed dataset index (bad magic bytes)")
        if version != VERSION:
            raise MeshtronError(f"{idx} has index version {version}; meshtron reads version 1")
        if code not in DTYPE_CODES:
            raise MeshtronError(f"{idx} has unknown token dtype code {code}")
        self.dtype = DTYPE_CODES[code]
        expected = HEADER.size + 12 * count + 8 * num_docs
        if count and size == expected + count:
            raise MeshtronError(
                f"{idx} is a multimodal index (it ends with {count} sequence modes, as Megatron's "
                "builder writes with multimodal=True), and meshtron does not support multimodal "
                "indexed datasets"
            )
        if size != expected:
            raise MeshtronError(
                f"{idx} is truncated or corrupt: {count} sequences and {num_docs} document "
                f"indices need {expected} bytes, the file has {size}"
            )
        index = np.memmap(idx, dtype=np.uint8, mode="r")
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(index, np.int32, count, offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(index, np.int64, count, offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(index, np.int64, num_docs, offset)
        self._validate_index(count)
        self.total_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        self._validate_bin()
        if self.total_tokens:
            self.tokens: np.ndarray = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        else:
            self.tokens = np.empty(0, dtype=self.dtype)
        self.sequence_offsets = self.sequence_pointers // self.dtype.itemsize
        """Element offset of each sequence in :attr:`tokens`."""

    def _validate_index(self, count: int) -> None:
        idx, lengths, pointers = self.idx_path, self.sequence_lengths, self.sequence_pointers
        if count and lengths.min() < 0:
            raise MeshtronError(f"{idx} is corrupt: it holds negative sequence lengths")
        expected = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        if not np.array_equal(pointers, expected * self.dtype.itemsize):
            raise MeshtronError(
                f"{idx} is corrupt: its sequence pointers disagree with its sequence lengths"
            )
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != count or np.any(np.diff(docs) < 0):
            raise MeshtronError(
                f"{idx} is corrupt: its document indices must rise from 0 to {count}"
            )

    def _validate_bin(self) -> None:
        size = self.bin_path.stat().st_size
        expected = self.total_tokens * self.dtype.itemsize
        if size != expected:
            raise MeshtronError(
                f"{self.bin_path} holds {size} bytes but {self.idx_path.name} describes "
                f"{expected} ({self.total_tokens} tokens of {self.dtype}); the file is truncated "
                "or belongs to another index"
            )

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``i`` (a view into the memory map)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        size = int(self.sequence_lengths[i])
        stop = size if length is None else min(size, offset + length)
        start = int(self.sequence_offsets[i])
        return self.tokens[start + min(offset, size) : start + stop]

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.prefix!r}, sequences={len(self)}, "
                f"tokens={self.total_tokens}, dtype={self.dtype})")
