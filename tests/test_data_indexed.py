"""Indexed datasets: the Megatron .bin/.idx format written and read, and corrupt files refused
with one line."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshtron.config import DataConfig
from meshtron.data import (
    IndexedDataset,
    IndexedDatasetWriter,
    build_training_data,
    dtype_for_vocab,
    indexed_prefix,
)
from meshtron.errors import MeshtronError
from tests.test_cli import assert_user_error, meshtron


def random_docs(count: int, high: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=rng.integers(1, 40)) for _ in range(count)]


@pytest.mark.parametrize("vocab", [1000, 100_000])
def test_indexed_round_trip(tmp_path: Path, vocab: int) -> None:
    dtype = dtype_for_vocab(vocab)
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    docs = random_docs(25, vocab)
    prefix = str(tmp_path / "ds")
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in docs:
        writer.add_document(doc)
    assert not os.path.exists(prefix + ".idx")  # nothing visible before finalize
    writer.finalize()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == 25
    assert ds.total_tokens == sum(len(d) for d in docs)
    assert ds.document_indices.tolist() == list(range(26))
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.get(3, offset=1, length=2), docs[3][1:3])
    assert IndexedDataset(prefix + ".bin").total_tokens == ds.total_tokens


def test_writer_abort_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError), IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
        w.add_document([70000])  # does not fit uint16
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(MeshtronError, match="cannot write .*no/such/dir/ds.bin.tmp"):
        IndexedDatasetWriter(tmp_path / "no" / "such" / "dir" / "ds", np.uint16)


def _megatron_bytes(lengths: list[int], docs: list[int], code: int, itemsize: int) -> bytes:
    """An .idx built by hand from the format description, independent of the writer."""
    pointers, offset = [], 0
    for n in lengths:
        pointers.append(offset)
        offset += n * itemsize
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(docs))
        + struct.pack(f"<{len(lengths)}i", *lengths)
        + struct.pack(f"<{len(lengths)}q", *pointers)
        + struct.pack(f"<{len(docs)}q", *docs)
    )


def test_reads_hand_built_megatron_files(tmp_path: Path) -> None:
    seqs = [[5, 6, 7], [100000, 1], [42, 43, 44, 45]]
    (tmp_path / "m.idx").write_bytes(_megatron_bytes([3, 2, 4], [0, 2, 3], code=4, itemsize=4))
    (tmp_path / "m.bin").write_bytes(struct.pack("<9i", *[t for s in seqs for t in s]))
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.total_tokens == 9
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == seqs

    (tmp_path / "u.idx").write_bytes(_megatron_bytes([2, 1], [0, 1, 2], code=8, itemsize=2))
    (tmp_path / "u.bin").write_bytes(struct.pack("<3H", 65000, 3, 9))
    ds = IndexedDataset(tmp_path / "u")
    assert ds.dtype == np.uint16 and ds[0].tolist() == [65000, 3] and ds[1].tolist() == [9]


def test_writer_output_matches_megatron_layout(tmp_path: Path) -> None:
    writer = IndexedDatasetWriter(tmp_path / "w", np.uint16)
    for doc in ([1, 2, 3], [4], [5, 6]):
        writer.add_document(doc)
    writer.finalize()
    expected = _megatron_bytes([3, 1, 2], [0, 1, 2, 3], code=8, itemsize=2)
    assert (tmp_path / "w.idx").read_bytes() == expected
    assert (tmp_path / "w.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)


@pytest.fixture
def good_dataset(tmp_path: Path) -> str:
    prefix = str(tmp_path / "good")
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for doc in random_docs(5, 500):
        writer.add_document(doc)
    writer.finalize()
    return prefix


def test_truncated_bin(good_dataset: str) -> None:
    data = Path(good_dataset + ".bin").read_bytes()
    Path(good_dataset + ".bin").write_bytes(data[:-2])
    with pytest.raises(MeshtronError, match=r"good\.bin holds .* truncated"):
        IndexedDataset(good_dataset)


def test_bad_magic(good_dataset: str) -> None:
    idx = Path(good_dataset + ".idx")
    idx.write_bytes(b"NOTMAGIC!" + idx.read_bytes()[9:])
    with pytest.raises(MeshtronError, match=r"good\.idx is not a Megatron indexed dataset"):
        IndexedDataset(good_dataset)


def test_missing_idx(good_dataset: str) -> None:
    os.remove(good_dataset + ".idx")
    with pytest.raises(MeshtronError, match=r"not found: .*good\.idx"):
        IndexedDataset(good_dataset)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (lambda b: b[:20], "shorter than the 34-byte header"),
        (lambda b: b[:-3], "truncated or corrupt"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "index version 2"),
        (lambda b: b[:17] + bytes([9]) + b[18:], "unknown token dtype code 9"),
        (lambda b: b[:34 + 5 * 4 + 8] + struct.pack("<q", 3) + b[34 + 5 * 4 + 16:],
         "sequence pointers disagree"),
        (lambda b: b[:-8] + struct.pack("<q", 4), "document indices"),
    ],
)
def test_corrupt_index(good_dataset: str, patch: Callable[[bytes], bytes], message: str) -> None:
    idx = Path(good_dataset + ".idx")
    idx.write_bytes(patch(idx.read_bytes()))
    with pytest.raises(MeshtronError, match=message) as err:
        IndexedDataset(good_dataset)
    assert "good.idx" in str(err.value)


def test_indexed_prefix_detection(tmp_path: Path, good_dataset: str) -> None:
    assert indexed_prefix(good_dataset) == good_dataset
    assert indexed_prefix(good_dataset + ".bin") == good_dataset
    assert indexed_prefix(str(tmp_path / "other.idx")) == str(tmp_path / "other")
    (tmp_path / "a.txt").write_text("hello")
    assert indexed_prefix(str(tmp_path / "a.txt")) is None
    assert indexed_prefix(str(tmp_path / "missing")) is None




def _multimodal(tmp_path: Path) -> Path:
    """Megatron's multimodal layout: the plain index, then one int8 mode per sequence."""
    plain = _megatron_bytes([3, 2, 4], [0, 3], code=8, itemsize=2)
    (tmp_path / "mm.idx").write_bytes(plain + np.array([0, 1, 0], dtype=np.int8).tobytes())
    (tmp_path / "mm.bin").write_bytes(np.arange(9, dtype=np.uint16).tobytes())
    return tmp_path / "mm"


def test_multimodal_index_is_refused_as_unsupported(tmp_path: Path) -> None:
    prefix = _multimodal(tmp_path)
    with pytest.raises(MeshtronError, match="multimodal") as err:
        IndexedDataset(prefix)
    assert str(err.value) == (
        f"{prefix}.idx is a multimodal index (it ends with 3 sequence modes, as Megatron's "
        "builder writes with multimodal=True), and meshtron does not support multimodal "
        "indexed datasets"
    )
    idx = Path(f"{prefix}.idx")
    for size in (idx.stat().st_size - 1, idx.stat().st_size + 1):  # not modes: corrupt
        idx.write_bytes(_megatron_bytes([3, 2, 4], [0, 3], code=8, itemsize=2).ljust(size, b"\0"))
        with pytest.raises(MeshtronError, match=r"mm\.idx is truncated or corrupt"):
            IndexedDataset(prefix)


def test_prefix_without_tokenizer_says_how_to_pass_one(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "meg", np.uint16) as writer:  # as Megatron leaves it
        writer.add_document(np.arange(100))
        writer.finalize()
    cfg = DataConfig(path=[str(tmp_path / "meg")], cache_dir=str(tmp_path / "cache"))
    with pytest.raises(MeshtronError) as err:
        build_training_data(cfg, 16, 0, lambda _: None)
    message = str(err.value)
    assert "without meg.tokenizer.json beside it" in message and "\n" not in message
    assert "--data.tokenizer=PATH/tokenizer.json" in message


def test_cli_refuses_multimodal_and_tokenizerless_prefixes(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("".join(f"line {i} of some text to train on.\n"
                                            for i in range(800)))
    made = meshtron("preprocess", "t.txt", "--output", "ds", "--vocab-size=512",
                    "--cache-dir=cache", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    idx = tmp_path / "ds.idx"
    plain = idx.read_bytes()
    idx.write_bytes(plain + bytes(len(IndexedDataset(tmp_path / "ds"))))
    train = ("train", "--data.path=ds", "--data.cache_dir=cache", "--run.dir=run",
             "--train.steps=1")
    assert_user_error(meshtron(*train, cwd=tmp_path), "meshtron does not support multimodal")
    idx.write_bytes(plain)
    (tmp_path / "ds.tokenizer.json").unlink()
    assert_user_error(meshtron(*train, cwd=tmp_path), "--data.tokenizer=PATH/tokenizer.json")
