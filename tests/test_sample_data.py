"""``meshtron sample-data``: the README's example data (corpus.txt, books/, code.jsonl, corpus/),
written from the built-in corpus, each a data path that training accepts."""

from __future__ import annotations

import json

import pytest

from meshtron.cli import main
from meshtron.data.corpus import stdlib_corpus
from meshtron.data.sources import open_source


def test_sample_data_writes_every_form_data_path_takes(tmp_path, capsys):
    assert main(["sample-data", str(tmp_path), "--max-mb", "0.3"]) == 0
    assert "corpus.txt" in capsys.readouterr().out
    sources = {name: open_source(str(tmp_path / name))
               for name in ("corpus.txt", "books", "code.jsonl", "corpus")}
    documents = {name: list(source.documents()) for name, source in sources.items()}
    assert all(documents.values())
    assert len(documents["books"]) == len(sources["books"].files) > 1
    expected = [path.read_text(encoding="utf-8") for path in stdlib_corpus(300_000).files]
    assert documents["code.jsonl"] == expected[2::4]  # one JSON document per source file
    assert documents["books"] == expected[1::4]
    assert documents["corpus.txt"] == ["\n".join(expected[0::4])]
    first = (tmp_path / "code.jsonl").read_text().splitlines()[0]
    assert json.loads(first) == {"text": expected[2]}


@pytest.mark.parametrize("argv, message", [
    (["--max-mb", "0"], "--max-mb must be above 0"),
    (["--max-mb", "0.000001"], "holds 0 of the standard library's source files"),
    (["--max-mb", "ONE FILE"], "holds 1 of the standard library's source files"),
])
def test_sample_data_bad_input_is_one_line(tmp_path, capsys, argv, message):
    one_file = (stdlib_corpus(10**6).files[0].stat().st_size + 0.5) / 1e6  # fewer than 4
    argv = [str(one_file) if word == "ONE FILE" else word for word in argv]
    assert main(["sample-data", str(tmp_path / "new"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "new").exists()


def test_sample_data_never_overwrites(tmp_path, capsys):
    (tmp_path / "code.jsonl").write_text("mine\n")
    assert main(["sample-data", str(tmp_path), "--max-mb", "0.3"]) == 2
    assert "code.jsonl already exists" in capsys.readouterr().err
    assert (tmp_path / "code.jsonl").read_text() == "mine\n"
    assert not (tmp_path / "corpus.txt").exists()
