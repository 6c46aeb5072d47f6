"""Checkpoint shards in the safetensors format, written and read without a second pass.

The ``safetensors`` library writes a file and reads slices of it, but a checkpoint also needs
each file's checksum (:mod:`meshtron.checkpoint.digests`), and computing it afterwards re-reads
every byte. So a shard is written here: the header, then each tensor's bytes straight from its
memory, each buffer handed to a hashing thread as it is written, so the checksum costs no
extra read and runs beside the write. Reading maps the file and hashes the mapping in a
background thread while the caller copies slices out of it straight into its own tensors (one
copy, no staging buffer); :meth:`TensorFile.verify` joins the hash. The files are plain
safetensors: the library reads them, and this reader reads the library's.

The header is trusted no more than any other input: its size, its JSON, every dtype, shape
and byte range are checked against the file before anything is read.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from meshtron.checkpoint.digests import Digest
from meshtron.errors import MeshtronError

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
          "F64": torch.float64, "I64": torch.int64, "U8": torch.uint8}
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20
"""The safetensors library's own limit on the header (100 MB)."""
HASH_CHUNK = 8 << 20


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy for a contiguous CPU tensor."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _header(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    """The length-prefixed JSON header, padded with spaces to 8 bytes as the library does.
    Tensors are laid out in the order given."""
    entries: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in CODES:
            raise MeshtronError(f"cannot store {name}: dtype {tensor.dtype} is not supported")
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": CODES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_all(f: BinaryIO, view: memoryview) -> None:
    written = 0
    while written < len(view):  # an unbuffered write may be partial
        written += f.write(view[written:])


def write_tensor_file(path: Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (CPU) as a safetensors file, fsync it, and return its checksum."""
    views = [_raw_bytes(t) for t in tensors.values()]
    digest = Digest()
    header = _header(tensors, metadata)
    with ThreadPoolExecutor(1, "checkpoint-hash") as hasher:
        hashed = [hasher.submit(digest.update, header)]
        with open(path, "wb", buffering=0) as f:
            _write_all(f, memoryview(header))
            for view in views:
                hashed.append(hasher.submit(digest.update, view))
                _write_all(f, view)
            os.fsync(f.fileno())
        for future in hashed:
            future.result()
    return digest.text()


def _hash_mapping(data: mmap.mmap, like: str) -> str:
    digest = Digest(like)
    view = memoryview(data)
    try:
        for start in range(0, len(view), HASH_CHUNK):
            digest.update(view[start : start + HASH_CHUNK])
    finally:
        view.release()
    return digest.text()


class TensorFile:
    """One safetensors file, mapped: its tensors as views of the mapping, its checksum
    computed in the background from the moment it is opened."""

    def __init__(self, path: Path, expected: str | None = None):
        self.path = path
        self.expected = expected
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        except OSError as err:
            raise MeshtronError(f"checkpoint file {path} cannot be read: {err.strerror}") from None
        self._hash: Future | None = None
        if expected is not None:
            self._hash = Future()
            threading.Thread(target=self._run_hash, name="checkpoint-verify", daemon=True).start()
        try:
            self.entries, self.start = self._parse_header(size)
        except MeshtronError:
            self.verify()  # a damaged header is reported as corruption when it is one
            raise

    def _run_hash(self) -> None:
        assert self._hash is not None and self.expected is not None
        try:
            self._hash.set_result(_hash_mapping(self.data, self.expected)
                                  if self.data is not None else Digest(self.expected).text())
        except BaseException as err:  # noqa: BLE001 - handed to verify()
            self._hash.set_exception(err)

    def _unreadable(self, why: str) -> MeshtronError:
        return MeshtronError(f"checkpoint file {self.path} cannot be read: {why}")

    def _parse_header(self, size: int) -> tuple[dict[str, tuple[torch.dtype, tuple, int, int]],
                                                int]:
        if size < 8 or self.data is None:
            raise self._unreadable("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", self.data[:8])
        if length > MAX_HEADER or 8 + length > size:
            raise self._unreadable(f"its header claims {length} bytes")
        try:
            header = json.loads(bytes(self.data[8 : 8 + length]))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._unreadable("its header is not JSON") from None
        if not isinstance(header, dict):
            raise self._unreadable("its header is not a mapping")
        header.pop("__metadata__", None)
        entries, end = {}, 0
        for name, entry in header.items():
            entries[name] = self._entry(name, entry)
        spans = sorted((e[2], e[3]) for e in entries.values())
        for begin, stop in spans:
            if begin != end:
                raise self._unreadable("its tensors do not tile the data section")
            end = stop
        if 8 + length + end != size:
            raise self._unreadable(f"its data section is {size - 8 - length} bytes, the header "
                                   f"says {end}")
        return entries, 8 + length

    def _entry(self, name: str, entry: object) -> tuple[torch.dtype, tuple, int, int]:
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            raise self._unreadable(f"tensor {name!r} has no known dtype")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
            raise self._unreadable(f"tensor {name!r} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(n) is int for n in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise self._unreadable(f"tensor {name!r} has no valid byte range")
        dtype = DTYPES[entry["dtype"]]
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise self._unreadable(f"tensor {name!r}: its byte range does not fit its shape")
        return dtype, tuple(shape), offsets[0], offsets[1]

    def keys(self) -> list[str]:
        return list(self.entries)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key][0]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def tensor(self, key: str) -> torch.Tensor:
        """The stored tensor as a view of the mapping (read-only by contract: the mapping is
        private, so a write would change only this process's copy)."""
        dtype, shape, begin, end = self.entries[key]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        count = (end - begin) // dtype.itemsize
        return torch.frombuffer(self.data, dtype=dtype, count=count,
                                offset=self.start + begin).view(shape)

    def verify(self) -> None:
        """Wait for the checksum; a mismatch is a :class:`MeshtronError` naming the file."""
        if self._hash is None:
            return
        if self._hash.result() != self.expected:
            raise MeshtronError(f"checkpoint file {self.path} is corrupt (checksum mismatch)")
