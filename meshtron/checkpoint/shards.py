"""Per-rank shard files and the index that says which box of which tensor each one holds.

Each rank writes ``shard-RRRRR.safetensors`` (its pieces, keys ``p0, p1, ...``, plus its RNG
state under ``rng``) and ``shard-RRRRR.json`` (for each piece: global name, global shape,
dtype, offset and size in the global tensor; the file's checksum). The first rank merges the
``.json`` files into the checkpoint's manifest (see :mod:`meshtron.checkpoint.store`).

Reading trusts nothing: names are plain file names of the checkpoint, dtypes come from a fixed
list, every box lies inside its tensor's shape, and each piece's stored shape and dtype are
checked against the index before a byte of data is read. safetensors files hold raw tensors
only, so nothing is ever unpickled. Files are written and read by
:mod:`meshtron.checkpoint.tensor_file`, which computes each file's checksum beside the write and,
when reading, beside the copies out of it: :meth:`ShardReader.read_into` fills tensors before
their file's checksum is known, and :meth:`ShardReader.verify` (which :meth:`ShardReader.read`
and :meth:`ShardReader.read_rng` call themselves) says whether they can be trusted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from meshtron.checkpoint.boxes import Box, intersect, slices
from meshtron.checkpoint.tensor_file import TensorFile, write_tensor_file
from meshtron.errors import MeshtronError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64, "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def shard_name(rank: int) -> str:
    return f"shard-{rank:05d}"


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (``os.umask``
    sets as it reads, which a background checkpoint thread must not race with)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                     metadata: dict[str, str] | None = None) -> None:
    """``save_file``, then the mode every other file gets (0o666 less the umask): safetensors
    writes through a private temporary file, which leaves the result 0o600."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())


@dataclass
class Piece:
    """One box of one global tensor, with this rank's data for it."""

    name: str
    shape: tuple[int, ...]
    box: Box
    data: torch.Tensor


def write_shard(directory: Path, rank: int, pieces: list[Piece], rng: torch.Tensor) -> None:
    """Write this rank's safetensors file (hashed as it is written, then fsynced) and, last
    (atomically), its index ``.json``."""
    base = shard_name(rank)
    tensors = {f"p{i}": p.data for i, p in enumerate(pieces)}
    tensors["rng"] = rng
    path = directory / f"{base}.safetensors"
    digest = write_tensor_file(path, tensors)  # created 0o666 less the umask, as any file
    index = {
        "file": path.name, "checksum": digest, "rng": "rng",
        "pieces": [{"name": p.name, "shape": list(p.shape), "dtype": DTYPE_NAMES[p.data.dtype],
                    "key": f"p{i}", "offset": list(p.box[0]), "size": list(p.box[1])}
                   for i, p in enumerate(pieces)],
    }
    tmp = directory / f".{base}.json.tmp"
    tmp.write_text(json.dumps(index))
    fsync_file(tmp)
    os.replace(tmp, directory / f"{base}.json")


def merge_shard_indexes(indexes: list[dict[str, Any]]) -> tuple[dict, dict, dict]:
    """(tensors, files, rng) sections of the manifest from every rank's shard index."""
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, str] = {}
    rng: dict[str, dict[str, str]] = {}
    for rank, index in enumerate(indexes):
        files[index["file"]] = index["checksum"]
        rng[str(rank)] = {"file": index["file"], "key": index["rng"]}
        for piece in index["pieces"]:
            entry = tensors.setdefault(piece["name"], {"shape": piece["shape"],
                                                       "dtype": piece["dtype"], "pieces": []})
            entry["pieces"].append({"file": index["file"], "key": piece["key"],
                                    "offset": piece["offset"], "size": piece["size"]})
    return tensors, files, rng


# ---------------------------------------------------------------------- reading


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise MeshtronError(f"{what} must be a list of non-negative integers")
    return tuple(value)


def check_tensor_index(path: Path, tensors: Any, files: dict[str, str]) -> None:
    """Reject an index that names foreign files, unknown dtypes or boxes outside shapes."""
    if not isinstance(tensors, dict):
        raise MeshtronError(f"checkpoint {path}: 'tensors' must be a mapping")
    for name, entry in tensors.items():
        where = f"checkpoint {path}: tensor {name!r}"
        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES:
            raise MeshtronError(f"{where} has no valid dtype (allowed: {', '.join(DTYPES)})")
        shape = _int_list(entry.get("shape"), f"{where}: shape")
        pieces = entry.get("pieces", [])
        if not isinstance(pieces, list):
            raise MeshtronError(f"{where}: pieces must be a list")
        for piece in pieces:
            if not isinstance(piece, dict) or piece.get("file") not in files \
                    or not isinstance(piece.get("key"), str):
                raise MeshtronError(f"{where} points into a file the index does not list")
            offset = _int_list(piece.get("offset"), f"{where}: offset")
            size = _int_list(piece.get("size"), f"{where}: size")
            if len(offset) != len(shape) or len(size) != len(shape) or any(
                    o + s > n for o, s, n in zip(offset, size, shape)):
                raise MeshtronError(f"{where}: piece {offset}+{size} lies outside shape {shape}")


def check_finite(path: Path, name: str, tensor: torch.Tensor) -> None:
    """Weights that are NaN or infinite are refused: a model from them computes nothing.
    A sum is finite only if every element is, and costs a fraction of an elementwise test (no
    boolean tensor); only a sum that is not finite (a bad value, or an overflow) runs that."""
    if not tensor.is_floating_point():
        return
    total = tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32)
    if not bool(torch.isfinite(total)) and not bool(torch.isfinite(tensor).all()):
        raise MeshtronError(f"checkpoint {path}: {name} holds NaN or infinite values; "
                            "refusing to use it (use an earlier checkpoint)")


class ShardReader:
    """Reads boxes of global tensors out of one checkpoint's shard files; each file's
    checksum is computed in the background from its first use, and checked by :meth:`verify`."""

    def __init__(self, path: Path, manifest: dict[str, Any]):
        self.path = path
        self.tensors: dict[str, dict[str, Any]] = manifest.get("tensors", {})
        self.files: dict[str, str] = manifest.get("files", {})
        check_tensor_index(path, self.tensors, self.files)
        self._open: dict[str, TensorFile] = {}

    def _handle(self, filename: str) -> TensorFile:
        if filename not in self._open:
            file = self.path / filename
            if not file.is_file():
                raise MeshtronError(f"checkpoint file {file} is missing")
            self._open[filename] = TensorFile(file, self.files[filename])
        return self._open[filename]

    def verify(self) -> None:
        """Wait for the checksums of every file read so far; raise on a mismatch. Data from
        :meth:`read_into` is trustworthy only after this returns."""
        for handle in self._open.values():
            handle.verify()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def read_into(self, name: str, box: Box, out: torch.Tensor) -> None:
        """Fill ``out`` (shaped like ``box``) with the global tensor ``name``'s elements,
        copied straight from the mapped files (see :meth:`verify`)."""
        entry = self.tensors.get(name)
        if entry is None:
            raise MeshtronError(f"checkpoint {self.path} has no tensor {name}")
        covered = 0
        for piece in entry["pieces"]:
            stored: Box = (tuple(piece["offset"]), tuple(piece["size"]))
            common = intersect(stored, box)
            if common is None:
                continue
            handle = self._handle(piece["file"])
            part = self._checked_slice(handle, piece, entry)
            out[slices(common, box[0])].copy_(part[slices(common, stored[0])])
            covered += math.prod(common[1])
        if covered != math.prod(box[1]):
            raise MeshtronError(
                f"checkpoint {self.path}: tensor {name} has no data for part of "
                f"{list(box[0])}+{list(box[1])} (the pieces cover {covered} of "
                f"{math.prod(box[1])} elements)")

    def _checked_slice(self, handle: TensorFile, piece: dict[str, Any],
                       entry: dict[str, Any]) -> torch.Tensor:
        where = f"checkpoint file {self.path / piece['file']}, key {piece['key']!r}"
        key = piece["key"]
        if key not in handle.entries:
            raise MeshtronError(f"{where} is missing")
        if DTYPE_NAMES[handle.dtype(key)] != entry["dtype"]:
            raise MeshtronError(f"{where} holds {DTYPE_NAMES[handle.dtype(key)]}, the index "
                                f"says {entry['dtype']}")
        if list(handle.shape(key)) != list(piece["size"]):
            raise MeshtronError(f"{where} has shape {list(handle.shape(key))}, the index says "
                                f"{piece['size']}")
        return handle.tensor(key)

    def read(self, name: str) -> torch.Tensor:
        """A whole global tensor, verified."""
        shape = self.shape(name)
        out = torch.empty(shape, dtype=DTYPES[self.tensors[name]["dtype"]])
        self.read_into(name, ((0,) * len(shape), shape), out)
        self.verify()
        return out

    def read_rng(self, key: dict[str, str]) -> torch.Tensor:
        if key.get("file") not in self.files:
            raise MeshtronError(f"checkpoint {self.path}: RNG state points outside the index")
        where = f"checkpoint file {self.path / key['file']}, key {key.get('key')!r}"
        handle = self._handle(key["file"])
        handle.verify()
        if key.get("key") not in handle.entries:
            raise MeshtronError(f"{where} (an RNG state) is missing")
        state = handle.tensor(key["key"]).clone()
        if state.dtype != torch.uint8 or state.dim() != 1:
            raise MeshtronError(f"{where} is not an RNG state (a 1-D uint8 tensor)")
        return state
