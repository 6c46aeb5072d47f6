"""Checkpoint shards written and read in one pass: plain safetensors both ways, the checksum
computed beside the write equal to the file's (XXH3-128; an older sha256 still verified), damage
named as corruption, bad headers refused."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from meshtron.checkpoint.tensor_file import TensorFile, write_tensor_file
from meshtron.errors import MeshtronError


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"p0": torch.randn(3, 5, generator=g),
            "p1": torch.randn(7, generator=g).to(torch.bfloat16),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "rng": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
            "strided": torch.arange(12, dtype=torch.int64).view(3, 4).t()}


def test_written_files_are_safetensors_and_their_checksum_is_the_files(tmp_path):
    path = tmp_path / "a.safetensors"
    digest = write_tensor_file(path, tensors(), metadata={"format": "pt"})
    assert digest == "xxh3-128:" + xxhash.xxh3_128(path.read_bytes()).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in tensors().items():
            assert torch.equal(f.get_tensor(name), t), name
    mine = TensorFile(path, digest)
    for name, t in tensors().items():
        assert mine.dtype(name) == t.dtype and mine.shape(name) == tuple(t.shape)
        assert torch.equal(mine.tensor(name), t), name
    mine.verify()


def test_the_librarys_files_are_read_and_a_sha256_is_still_verified(tmp_path):
    path = tmp_path / "lib.safetensors"
    data = {k: v.contiguous() for k, v in tensors().items()}
    save_file(data, str(path))
    f = TensorFile(path, hashlib.sha256(path.read_bytes()).hexdigest())
    assert sorted(f.keys()) == sorted(data)
    for name, t in data.items():
        assert torch.equal(f.tensor(name), t), name
    f.verify()
    with pytest.raises(MeshtronError, match="corrupt"):
        TensorFile(path, hashlib.sha256(b"other").hexdigest()).verify()


def test_a_flipped_bit_is_corruption_wherever_it_lands(tmp_path):
    path = tmp_path / "a.safetensors"
    digest = write_tensor_file(path, tensors())
    clean = path.read_bytes()
    for where in (len(clean) - 3, 20):  # in the data, in the header's JSON
        damaged = bytearray(clean)
        damaged[where] ^= 0x04
        path.write_bytes(bytes(damaged))
        with pytest.raises(MeshtronError, match="corrupt"):
            TensorFile(path, digest).verify()


def header_file(tmp_path, header: object, data: bytes = b"\0" * 8):
    text = json.dumps(header).encode()
    path = tmp_path / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


@pytest.mark.parametrize("header, why", [
    ({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 8]}}, "dtype"),
    ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "shape"),
    ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "does not fit its shape"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "tile"),
    ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "data section"),
    ([1, 2], "mapping"),
])
def test_bad_headers_are_refused_in_one_line(tmp_path, header, why):
    with pytest.raises(MeshtronError, match=why):
        TensorFile(header_file(tmp_path, header))


def test_a_header_longer_than_the_file_is_refused(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(MeshtronError, match="header claims"):
        TensorFile(path)
