"""Data layer: tokenizer, indexed datasets (Megatron format), sources, corpus, windows, pipeline."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from meshtron.config import DataConfig
from meshtron.data import (
    EOS_TOKEN,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    Tokenizer,
    build_training_data,
    open_source,
    prepare_dataset,
    preprocess,
    stdlib_corpus,
    train_tokenizer,
    train_valid_split,
    valid_windows,
)
from meshtron.data import corpus as corpus_module
from meshtron.data import tokenizer as tokenizer_module
from meshtron.data.preprocessing import split_document
from meshtron.errors import MeshtronError
from tests.test_data_indexed import random_docs

VOCAB = 400
# The module that defines `preprocess` (its internals are patched below).
preprocess_module = importlib.import_module("meshtron.data.preprocessing")


def make_text(num_words: int, seed: int) -> str:
    """Deterministic prose-like text with repeated words, punctuation and non-ASCII."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(150)]
    words += ["naïve", "café", "東京", "🙂", "def", "return", "(x)", "=="]
    out = []
    for i, w in enumerate(rng.choice(words, size=num_words)):
        out.append(w)
        out.append("\n" if i % 13 == 12 else " ")
    return "".join(out)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    cache = tmp_path_factory.mktemp("tok-cache")
    texts = [make_text(3000, seed) for seed in range(4)]
    return train_tokenizer(texts, VOCAB, cache, log=lambda _: None)


def quiet(_: str) -> None:
    pass


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tokenizer: Tokenizer) -> None:
    text = make_text(500, 99) + " unseen: Ωmega ∑ 🚀\n\tend"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, "ab"]) == [ids, tokenizer.encode("ab")]
    assert tokenizer.eos_id == tokenizer._hf.token_to_id(EOS_TOKEN)
    assert tokenizer.decode([tokenizer.eos_id]) == EOS_TOKEN
    assert 257 < tokenizer.vocab_size <= VOCAB
    assert max(ids) < tokenizer.vocab_size
    assert len(tokenizer.fingerprint) == 64


def test_train_tokenizer_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = [make_text(800, 1)]
    first = train_tokenizer(texts, 300, tmp_path, log=quiet)
    assert first.path.is_relative_to(tmp_path / "tokenizers")
    mtime = first.path.stat().st_mtime_ns

    def no_training(*args: object) -> None:
        raise AssertionError("retrained although the cache holds this tokenizer")

    monkeypatch.setattr(tokenizer_module, "_train_bpe", no_training)
    second = train_tokenizer(texts, 300, tmp_path, log=quiet)
    assert second.fingerprint == first.fingerprint and second.path == first.path
    assert first.path.stat().st_mtime_ns == mtime
    with pytest.raises(AssertionError):  # other text or another vocab size is another entry
        train_tokenizer(texts, 301, tmp_path, log=quiet)
    assert not list(first.path.parent.glob("*.tmp"))


def test_train_tokenizer_from_sources_matches_texts(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(make_text(500, 3))
    source = open_source(str(tmp_path / "a.txt"))
    from_files = train_tokenizer(source, 300, tmp_path / "c1", log=quiet)
    from_texts = train_tokenizer([make_text(500, 3)], 300, tmp_path / "c2", log=quiet)
    assert from_files.fingerprint == from_texts.fingerprint  # training is deterministic


def test_train_tokenizer_rejects_tiny_vocab(tmp_path: Path) -> None:
    with pytest.raises(MeshtronError, match="data.vocab_size=100"):
        train_tokenizer(["hello"], 100, tmp_path, log=quiet)


def _hf_tokenizer(special: list[str]) -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    hf.train_from_iterator([make_text(200, 5)], trainer=trainer)
    return hf


def test_tokenizer_load(tmp_path: Path, tokenizer: Tokenizer) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer.path.read_bytes())
    loaded = Tokenizer.load(folder)
    assert loaded.fingerprint == tokenizer.fingerprint
    assert loaded.path == folder / "tokenizer.json"

    with pytest.raises(MeshtronError, match="tokenizer not found: .*nope.json"):
        Tokenizer.load(tmp_path / "nope.json")
    with pytest.raises(MeshtronError, match="holds no tokenizer.json"):
        Tokenizer.load(tmp_path)
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(MeshtronError, match="bad.json is not a valid tokenizer.json"):
        Tokenizer.load(tmp_path / "bad.json")

    (tmp_path / "s.json").write_text(_hf_tokenizer(["<unk>", "</s>"]).to_str())
    llama_like = Tokenizer.load(tmp_path / "s.json")
    assert llama_like.eos_id == llama_like._hf.token_to_id("</s>")
    (tmp_path / "no_eos.json").write_text(_hf_tokenizer(["<pad>"]).to_str())
    with pytest.raises(MeshtronError, match="no_eos.json has no end-of-text token"):
        Tokenizer.load(tmp_path / "no_eos.json")


def test_split_document_encodes_like_the_whole(tokenizer: Tokenizer) -> None:
    text = make_text(6000, 7) + "\n  indented\n\nx\ny z\n"
    pieces = split_document(text, piece_chars=500)
    assert len(pieces) > 10 and "".join(pieces) == text
    joined = [i for ids in tokenizer.encode_batch(pieces) for i in ids]
    assert joined == tokenizer.encode(text)
    assert split_document("x" * 5000, piece_chars=100) == ["x" * 5000]  # no safe break


# ----------------------------------------------------------------------------- sources


def test_jsonl_documents(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"text": "first doc"}, {"text": ""}, {"text": "third", "id": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n" + '{"text": "ünï"}\n')
    assert list(open_source(str(path)).documents()) == ["first doc", "third", "ünï"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "ok"', r"bad\.jsonl line 2 is not valid JSON"),
        ('{"content": "x"}', r'bad\.jsonl line 2 has no "text" field'),
        ('["text"]', r'bad\.jsonl line 2 has no "text" field'),
        ('{"text": 5}', r'bad\.jsonl line 2 has a "text" field that is not a string'),
    ],
)
def test_jsonl_errors(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(MeshtronError, match=message):
        list(open_source(str(path)).documents())


def test_open_source(tmp_path: Path) -> None:
    with pytest.raises(MeshtronError, match="data path not found: .*nowhere"):
        open_source(str(tmp_path / "nowhere"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(MeshtronError, match="empty.txt holds no text"):
        open_source(str(tmp_path / "empty.txt"))
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / ".git").mkdir()
    (folder / "b.txt").write_text("bee")
    (folder / "a.md").write_text("ay")
    (folder / "sub" / "c.py").write_text("see")
    (folder / "sub" / "d.jsonl").write_text('{"text": "dee"}\n')
    (folder / "image.png").write_bytes(b"\x89PNG")
    (folder / ".git" / "x.txt").write_text("hidden")
    source = open_source(str(folder))
    assert [p.name for p in source.files] == ["a.md", "b.txt", "c.py", "d.jsonl"]
    assert list(source.documents()) == ["ay", "bee", "see", "dee"]
    before = source.fingerprint
    assert open_source(str(folder)).fingerprint == before
    (folder / "b.txt").write_text("bea")
    assert open_source(str(folder)).fingerprint != before
    (tmp_path / "nothing").mkdir()
    with pytest.raises(MeshtronError, match="nothing holds no text"):
        open_source(str(tmp_path / "nothing"))
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(MeshtronError, match="latin1.txt is not UTF-8 text"):
        list(open_source(str(tmp_path / "latin1.txt")).documents())


def test_stdlib_corpus_is_deterministic_and_capped() -> None:
    cap = 200_000
    first, second = stdlib_corpus(cap), stdlib_corpus(cap)
    assert first.files == second.files and first.fingerprint == second.fingerprint
    assert 0 < first.num_bytes <= cap
    relative = [p.relative_to(first.root).as_posix() for p in first.files]
    assert relative == sorted(relative)
    for parts in (Path(r).parts for r in relative):
        assert not set(parts) & corpus_module.EXCLUDED_DIRS
    assert all(p.suffix == ".py" for p in first.files)
    docs = list(first.documents())
    assert len(docs) == len(first.files) and all(docs)
    assert stdlib_corpus(2 * cap).files[: len(first.files)] == first.files
    with pytest.raises(MeshtronError, match="corpus_max_mb"):
        stdlib_corpus(1)


# ----------------------------------------------------------------------------- windows and splits


def _dataset(tmp_path: Path, docs: list[np.ndarray], name: str = "win") -> IndexedDataset:
    writer = IndexedDatasetWriter(tmp_path / name, np.uint16)
    for doc in docs:
        writer.add_document(doc)
    writer.finalize()
    return IndexedDataset(tmp_path / name)


@pytest.mark.parametrize("seq_len", [1, 7, 64])
def test_windows_are_slices_of_the_stream(tmp_path: Path, seq_len: int) -> None:
    docs = random_docs(30, 1000, seed=seq_len)
    ds = _dataset(tmp_path, docs)
    order = np.array([5, 6, 7, 0, 1, 29, 12, 13, 14, 15, 2])
    stream = np.concatenate([docs[i] for i in order])
    windows = GPTDataset(ds, seq_len, order)
    assert len(windows) == (len(stream) - 1) // seq_len
    for i in range(len(windows)):
        sample = windows[i]
        assert sample.dtype == np.int64 and sample.shape == (seq_len + 1,)
        np.testing.assert_array_equal(sample, stream[i * seq_len : i * seq_len + seq_len + 1])
    with pytest.raises(IndexError):
        windows[len(windows)]
    part = GPTDataset(ds, seq_len, order, token_range=(10, len(stream) - 3))
    assert part.num_tokens == len(stream) - 13
    np.testing.assert_array_equal(part[0], stream[10 : 11 + seq_len])


def test_valid_windows_rule() -> None:
    # round(valid_fraction * tokens / seq_len) whole windows, at least one, and at most what
    # leaves training one window ((tokens - 2) // seq_len - 1); 0 means "too small".
    assert valid_windows(1_000_000, 100, 0.02) == 200
    assert valid_windows(9_200, 256, 0.02) == 1  # 0.72 windows rounds up to the minimum one
    assert valid_windows(1000, 16, 0.1) == 6  # 6.25
    assert valid_windows(1000, 100, 0.9) == 8  # capped: training keeps 999 - 800 tokens
    assert valid_windows(2 * 17, 16, 0.1) == 1  # the smallest dataset: one window each side
    assert valid_windows(2 * 17 - 1, 16, 0.1) == 0


def test_train_valid_split_single_document(tmp_path: Path) -> None:
    doc = np.arange(1000) % 500
    ds = _dataset(tmp_path, [doc])
    # 6 validation windows = 6*16+1 = 97 tail tokens; training is the 903 before them
    train, valid = train_valid_split(ds, 16, 0.1, "one.txt")
    assert train.num_tokens == 903 and valid.num_tokens == 97
    np.testing.assert_array_equal(valid[0], doc[903:920])
    np.testing.assert_array_equal(valid[5], doc[983:1000])  # the whole tail, nothing wasted
    assert len(train) == 902 // 16 and len(valid) == 6
    # 2% of 1000 tokens is far below one window of 129: validation still gets one
    train, valid = train_valid_split(ds, 128, 0.02, "one.txt")
    assert (len(train), len(valid)) == (6, 1) and valid.num_tokens == 129
    with pytest.raises(MeshtronError, match=r"^one.txt holds 1,000 tokens, too few for one "
                       r"training and one validation window of train.seq_len\+1 = 501 tokens "
                       r"each \(at least 1,002 tokens\); lower train.seq_len or add text$"):
        train_valid_split(ds, 500, 0.1, "one.txt")


def test_train_valid_split_cuts_the_token_tail(tmp_path: Path) -> None:
    # 20 documents of 50 tokens: validation is round(0.1 * 1000 / 8) = 12 windows, the last
    # 12*8+1 = 97 tokens, which starts inside document 18
    docs = [np.full(50, i) for i in range(20)]
    ds = _dataset(tmp_path, docs)
    stream = np.concatenate(docs)
    train, valid = train_valid_split(ds, 8, 0.1, "many")
    assert len(valid) == 12 and valid.num_tokens == 97
    assert train.num_tokens + valid.num_tokens == 1000
    assert valid.document_ids.tolist() == [18, 19]  # only the documents it overlaps
    assert train.document_ids.tolist() == list(range(19))
    for i in range(len(valid)):
        np.testing.assert_array_equal(valid[i], stream[903 + 8 * i : 903 + 8 * i + 9])
    last = len(train) - 1
    assert last == (903 - 1) // 8 - 1
    np.testing.assert_array_equal(train[last], stream[8 * last : 8 * last + 9])
    # one huge document among tiny ones, and two whole files: both sides always get windows
    docs = [np.zeros(3000, dtype=np.int64), np.ones(5, dtype=np.int64)]
    uneven = _dataset(tmp_path, docs, "uneven")
    train, valid = train_valid_split(uneven, 32, 0.1, "uneven")
    assert (len(train), len(valid)) == (84, 9)
    two = _dataset(tmp_path, [np.zeros(900, dtype=np.int64), np.ones(1100, dtype=np.int64)], "2")
    train, valid = train_valid_split(two, 256, 0.02, "two files")
    assert (len(train), len(valid)) == (6, 1)  # not one whole file each
    assert train.document_ids.tolist() == [0, 1] and valid.document_ids.tolist() == [1]


# ----------------------------------------------------------------------------- preprocessing


def test_preprocess_and_cache(tmp_path: Path, tokenizer: Tokenizer,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    user = tmp_path / "user"
    user.mkdir()
    texts = [make_text(300, s) for s in range(3)]
    for i, text in enumerate(texts):
        (user / f"{i}.txt").write_text(text)
    stats = preprocess([str(user)], str(tmp_path / "out"), tokenizer, log=quiet)
    ds = IndexedDataset(tmp_path / "out")
    assert stats["documents"] == len(ds) == 3 and stats["tokens"] == ds.total_tokens
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tokenizer.encode(text) + [tokenizer.eos_id]

    cache = tmp_path / "cache"
    prefix = prepare_dataset(str(user), tokenizer, cache, log=quiet)
    assert Path(prefix).is_relative_to(cache / "datasets")
    assert sorted(p.name for p in user.iterdir()) == ["0.txt", "1.txt", "2.txt"]
    np.testing.assert_array_equal(IndexedDataset(prefix).tokens, ds.tokens)

    def no_preprocessing(*args: object, **kwargs: object) -> None:
        raise AssertionError("preprocessed again although the cache holds the dataset")

    monkeypatch.setattr(preprocess_module, "preprocess", no_preprocessing)
    assert prepare_dataset(str(user), tokenizer, cache, log=quiet) == prefix
    assert prepare_dataset(prefix, tokenizer, cache, log=quiet) == prefix  # indexed: as is
    (user / "0.txt").write_text("changed")
    with pytest.raises(AssertionError):
        prepare_dataset(str(user), tokenizer, cache, log=quiet)


def test_preprocess_of_blank_jsonl_holds_no_text(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(MeshtronError, match="blank.jsonl holds no text"):
        preprocess([str(tmp_path / "blank.jsonl")], str(tmp_path / "o"), tokenizer, log=quiet)
    assert not list(tmp_path.glob("o.*"))


# ----------------------------------------------------------------------------- pipeline


def _config(tmp_path: Path, paths: list[str] | None, **kw: object) -> DataConfig:
    return DataConfig(path=paths, cache_dir=str(tmp_path / "cache"), vocab_size=VOCAB,
                      valid_fraction=0.1, **kw)


def test_build_training_data_single_file(tmp_path: Path) -> None:
    (tmp_path / "book.txt").write_text(make_text(6000, 11))
    logs: list[str] = []
    data = build_training_data(_config(tmp_path, [str(tmp_path / "book.txt")]), 16, 7, logs.append)
    assert any(line.startswith("tokenizer: trained") for line in logs)
    assert any(re.fullmatch(r"dataset: [\d.]+K tokens: [\d.]+K train \([\d,]+ windows\), "
                            r"[\d.]+K? valid \([\d,]+ windows?\)", line) for line in logs), logs
    assert len(data.train) > 0 and len(data.valid) > 0
    batch = data.train_batch(3, 8)
    assert batch.shape == (8, 17) and str(batch.dtype) == "torch.int64"
    assert int(batch.max()) < data.tokenizer.vocab_size
    valid = data.valid_batch(0, 4)
    assert valid.shape == (4, 17)
    wrapped = data.valid_batch(len(data.valid), 4)  # wraps around to the start
    assert (wrapped == valid).all()

    again = build_training_data(_config(tmp_path, [str(tmp_path / "book.txt")]), 16, 7, quiet)
    assert (again.train_batch(3, 8) == batch).all()
    assert not (again.train_batch(4, 8) == batch).all()
    other_seed = build_training_data(_config(tmp_path, [str(tmp_path / "book.txt")]), 16, 8, quiet)
    assert not (other_seed.train_batch(3, 8) == batch).all()


def test_build_training_data_blend(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(make_text(4000, 1))
    rows = [json.dumps({"text": make_text(200, s)}) for s in range(10, 30)]
    (tmp_path / "b.jsonl").write_text("\n".join(rows))
    cfg = _config(tmp_path, [f"0.75:{tmp_path / 'a.txt'}", f"0.25:{tmp_path / 'b.jsonl'}"])
    data = build_training_data(cfg, 16, 0, quiet)
    assert len(data.train.datasets) == 2 and data.train.weights == [0.75, 0.25]
    datasets, _ = data.train.locate(np.arange(400))
    assert np.bincount(datasets).tolist() == [300, 100]
    assert data.train_batch(0, 8).shape == (8, 17)
    assert data.valid_batch(1, 3).shape == (3, 17)


def test_build_training_data_default_corpus(tmp_path: Path) -> None:
    data = build_training_data(_config(tmp_path, None, corpus_max_mb=0.2), 32, 0, quiet)
    assert len(data.train) > 100 and len(data.valid) > 0
    text = data.tokenizer.decode(data.train_batch(0, 2)[0].tolist())
    assert len(text) > 32


def test_build_training_data_indexed_path(tmp_path: Path, tokenizer: Tokenizer) -> None:
    (tmp_path / "t.txt").write_text(make_text(3000, 4))
    preprocess([str(tmp_path / "t.txt")], str(tmp_path / "ds"), tokenizer, log=quiet,
               write_tokenizer=False)  # as Megatron's preprocessing would leave it
    cfg = _config(tmp_path, [str(tmp_path / "ds")])
    with pytest.raises(MeshtronError, match="without ds.tokenizer.json beside it; set "
                       "data.tokenizer"):
        build_training_data(cfg, 16, 0, quiet)
    cfg.tokenizer = str(tokenizer.path)
    data = build_training_data(cfg, 16, 0, quiet)
    assert data.tokenizer.fingerprint == tokenizer.fingerprint
    assert not (tmp_path / "cache" / "datasets").exists()  # used in place, nothing cached
    small = tmp_path / "small.json"
    small.write_text(_hf_tokenizer(["<|endoftext|>"]).to_str())
    cfg.tokenizer = str(small)
    with pytest.raises(MeshtronError, match="beyond the .* tokens of .*small.json"):
        build_training_data(cfg, 16, 0, quiet)


def test_build_training_data_errors(tmp_path: Path) -> None:
    with pytest.raises(MeshtronError, match="data path not found: .*missing.txt"):
        build_training_data(_config(tmp_path, [str(tmp_path / "missing.txt")]), 16, 0, quiet)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(MeshtronError, match="empty.txt holds no text"):
        build_training_data(_config(tmp_path, [str(tmp_path / "empty.txt")]), 16, 0, quiet)
    (tmp_path / "short.txt").write_text("just a few words")
    with pytest.raises(MeshtronError, match="holds 5 tokens, too few for one training and one "
                       "validation window"):
        build_training_data(_config(tmp_path, [str(tmp_path / "short.txt")]), 16, 0, quiet)
    (tmp_path / "ok.txt").write_text(make_text(100, 0))
    with pytest.raises(MeshtronError, match="weight"):
        build_training_data(_config(tmp_path, [f"-1:{tmp_path / 'ok.txt'}"]), 16, 0, quiet)
