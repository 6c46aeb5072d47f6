"""Small corpora (issue 24): the token split sized to the data, and preprocessed datasets that
carry their tokenizer.

The split rule under test (``valid_windows``): validation is the tail of each dataset's token
stream, ``max(1, round(valid_fraction * tokens / seq_len))`` whole windows (``k * seq_len + 1``
tokens), capped so training keeps at least one window; fewer than ``2 * (seq_len + 1)`` tokens
are refused.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from meshtron.config import DataConfig
from meshtron.data import (
    IndexedDataset,
    Tokenizer,
    build_training_data,
    preprocess,
    train_tokenizer,
    valid_windows,
)
from meshtron.errors import MeshtronError
from tests.test_data import make_text

SEQ_LEN = 256
VOCAB = 300
preprocess_module = importlib.import_module("meshtron.data.preprocessing")


def config(tmp_path: Path, paths: list[str], **kw: object) -> DataConfig:
    """The defaults (valid_fraction 0.02) but a small vocabulary and a private cache."""
    return DataConfig(path=paths, cache_dir=str(tmp_path / "cache"), vocab_size=VOCAB, **kw)


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    cache = tmp_path_factory.mktemp("small-tok")
    return train_tokenizer([make_text(2000, 7)], VOCAB, cache, log=lambda _: None)


def test_a_46_kb_text_file_trains(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(make_text(8300, 3))
    assert 40_000 < book.stat().st_size < 52_000
    logs: list[str] = []
    data = build_training_data(config(tmp_path, [str(book)]), SEQ_LEN, 0, logs.append)
    train, valid = data.train.datasets[0], data.valid.datasets[0]
    total = train.num_tokens + valid.num_tokens
    assert total == IndexedDataset(train.indexed.prefix).total_tokens
    k = valid_windows(total, SEQ_LEN, 0.02)
    assert k == max(1, round(0.02 * total / SEQ_LEN)) and len(valid) == k
    assert valid.num_tokens == k * SEQ_LEN + 1
    assert len(train) == (total - valid.num_tokens - 1) // SEQ_LEN
    line = logs[-1]
    assert line.startswith("dataset: ") and f"train ({len(train):,} windows)" in line
    assert f"valid ({k:,} window" in line and "blend" not in line
    assert data.train_batch(0, 8).shape == (8, SEQ_LEN + 1)
    assert data.valid_batch(0, 8).shape == (8, SEQ_LEN + 1)  # one window, repeated


def test_a_folder_of_two_files_keeps_both_in_training(tmp_path: Path) -> None:
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "a.txt").write_text(make_text(3500, 1))
    (folder / "b.txt").write_text(make_text(3500, 2))
    data = build_training_data(config(tmp_path, [str(folder)]), SEQ_LEN, 0, lambda _: None)
    train, valid = data.train.datasets[0], data.valid.datasets[0]
    assert train.document_ids.tolist() == [0, 1]  # both files train...
    assert valid.document_ids.tolist() == [1]  # ...and validation is the end of the last one
    b_tokens = int(train.indexed.sequence_lengths[1])
    assert valid.num_tokens < b_tokens / 10 and len(train) > 10 * len(valid)


def test_too_small_data_is_refused_in_one_line(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(make_text(60, 0))
    with pytest.raises(MeshtronError) as err:
        build_training_data(config(tmp_path, [str(tiny)]), SEQ_LEN, 0, lambda _: None)
    message = str(err.value)
    assert "\n" not in message
    assert "tiny.txt holds" in message and "at least 514 tokens" in message
    assert "train.seq_len+1 = 257" in message and "lower train.seq_len or add text" in message
    data = build_training_data(config(tmp_path, [str(tiny)]), 8, 0, lambda _: None)
    assert len(data.train) >= 1 and len(data.valid) == 1  # the same text, shorter windows


def test_blend_line_and_determinism(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(make_text(3000, 4))
    rows = [json.dumps({"text": make_text(150, s)}) for s in range(12)]
    (tmp_path / "b.jsonl").write_text("\n".join(rows))
    paths = [f"0.7:{tmp_path / 'a.txt'}", f"0.3:{tmp_path / 'b.jsonl'}"]
    logs: list[str] = []
    data = build_training_data(config(tmp_path, paths), 64, 5, logs.append)
    weights = f"; blend weights {tmp_path / 'a.txt'} 0.7, {tmp_path / 'b.jsonl'} 0.3"
    assert logs[-1].startswith("dataset: ") and logs[-1].endswith(weights)
    assert sum(line.startswith("dataset /") for line in logs) == 2  # one line per dataset
    resumed = build_training_data(config(tmp_path, paths), 64, 5, lambda _: None)
    for k in (7, 0, 3):  # any batch, in any order, from (seed, k) alone, as after a resume
        assert (resumed.train_batch(k, 4) == data.train_batch(k, 4)).all()


def test_preprocess_writes_the_tokenizer_beside_the_prefix(
    tmp_path: Path, small_tokenizer: Tokenizer
) -> None:
    (tmp_path / "t.txt").write_text(make_text(2000, 9))
    prefix = tmp_path / "data" / "corpus"
    prefix.parent.mkdir()
    stats = preprocess([str(tmp_path / "t.txt")], prefix, small_tokenizer, log=lambda _: None)
    beside = tmp_path / "data" / "corpus.tokenizer.json"
    assert stats["tokenizer"] == str(beside)
    assert beside.read_bytes() == small_tokenizer.path.read_bytes()
    logs: list[str] = []
    data = build_training_data(config(tmp_path, [str(prefix)]), 32, 0, logs.append)
    assert data.tokenizer.path == beside
    assert data.tokenizer.fingerprint == small_tokenizer.fingerprint
    assert any("found beside" in line for line in logs)
    assert not (tmp_path / "cache").exists()  # nothing trained, nothing cached
    # data.tokenizer still wins; one that differs from the dataset's own is pointed out
    other = train_tokenizer([make_text(900, 1)], VOCAB, tmp_path / "c2", log=lambda _: None)
    cfg = config(tmp_path, [str(prefix)], tokenizer=str(other.path))
    logs.clear()
    assert build_training_data(cfg, 32, 0, logs.append).tokenizer.path == other.path
    assert any(line.startswith("warning: data.tokenizer") for line in logs)


def test_blend_of_datasets_with_different_tokenizers_is_refused(
    tmp_path: Path, small_tokenizer: Tokenizer
) -> None:
    (tmp_path / "t.txt").write_text(make_text(2000, 9))
    other = train_tokenizer([make_text(900, 1)], VOCAB, tmp_path / "c2", log=lambda _: None)
    preprocess([str(tmp_path / "t.txt")], tmp_path / "a", small_tokenizer, log=lambda _: None)
    preprocess([str(tmp_path / "t.txt")], tmp_path / "b", other, log=lambda _: None)
    cfg = config(tmp_path, [str(tmp_path / "a"), str(tmp_path / "b")])
    with pytest.raises(MeshtronError, match=r"^data.path .*a and .*b were preprocessed with "
                       r"different tokenizers \(.*a.tokenizer.json, .*b.tokenizer.json\)"):
        build_training_data(cfg, 32, 0, lambda _: None)
    preprocess([str(tmp_path / "t.txt")], tmp_path / "b", small_tokenizer, log=lambda _: None)
    data = build_training_data(cfg, 32, 0, lambda _: None)  # the same tokenizer: fine
    assert len(data.train.datasets) == 2


def test_tiny_preprocess_output_warns(
    tmp_path: Path, small_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "t.txt").write_text(make_text(400, 2))
    logs: list[str] = []
    stats = preprocess([str(tmp_path / "t.txt")], tmp_path / "out", small_tokenizer, logs.append)
    tokens = stats["tokens"]
    expected = (f"warning: {tmp_path / 'out'} holds {tokens:,} tokens, fewer than 256,000 "
                "(1,000 windows at the default train.seq_len=256)")
    assert stats["warning"] is not None and stats["warning"].startswith(expected)
    assert logs[-1] == stats["warning"] and "\n" not in logs[-1]
    monkeypatch.setattr(preprocess_module, "USEFUL_WINDOWS", 1)
    logs.clear()
    stats = preprocess([str(tmp_path / "t.txt")], tmp_path / "out", small_tokenizer, logs.append)
    assert stats["warning"] is None and not any("warning" in line for line in logs)


def test_format_count() -> None:
    fmt = preprocess_module.format_count
    assert [fmt(n) for n in (184, 2270, 42_512, 999_999, 2_080_123, 2_100_000)] == [
        "184", "2.27K", "42.5K", "1M", "2.08M", "2.1M"
    ]
    assert np.isclose(float(fmt(16_250)[:-1]), 16.2, atol=0.1)
