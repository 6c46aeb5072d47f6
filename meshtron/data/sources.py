"""Raw text inputs: which files a data path names, the documents they hold, their fingerprint.

A path is a text file (one document), a ``.jsonl`` file (one document per line, from its
``text`` field) or a folder (its ``.txt``, ``.md``, ``.py`` and ``.jsonl`` files, recursively, in
sorted order, hidden entries skipped). Documents are read lazily, so a large corpus is streamed
rather than held in memory, and the fingerprint hashes the exact bytes so that caches keyed by it
follow every edit.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.files import special_kind

TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIX = ".jsonl"
_BLOCK = 1 << 20


class TextSource:
    """An ordered list of raw text files and how to read documents from each."""

    def __init__(self, name: str, root: Path, files: Sequence[Path]) -> None:
        self.name = name
        """How messages refer to this source (the user's path, or a description)."""
        self.root = root
        """Files are fingerprinted by their path relative to this folder."""
        self.files = tuple(files)

    @cached_property
    def num_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 over (relative path, size, content) of every file, in order."""
        digest = hashlib.sha256()
        for path in self.files:
            relative = path.relative_to(self.root).as_posix()
            digest.update(f"{relative}\0{path.stat().st_size}\0".encode())
            with open(path, "rb") as handle:
                while block := handle.read(_BLOCK):
                    digest.update(block)
        return digest.hexdigest()

    def documents(self) -> Iterator[str]:
        """Every non-empty document, file by file."""
        for path in self.files:
            if path.suffix == JSONL_SUFFIX:
                yield from _jsonl_documents(path)
            else:
                text = _decode(path.read_bytes(), path)
                if text:
                    yield text

    def __repr__(self) -> str:
        return f"TextSource({self.name!r}, files={len(self.files)})"


def open_source(path: str) -> TextSource:
    """The raw text a data path names; a missing path or one without text is an error."""
    location = Path(os.path.expanduser(path))
    if not location.exists():
        raise MeshtronError(f"data path not found: {path}")
    if (kind := special_kind(location)) is not None:
        raise MeshtronError(f"data path {path} is {kind}, not a file or folder of text")
    if location.is_dir():
        files = _text_files(location)
        if not files:
            raise MeshtronError(
                f"{path} holds no text (no .txt, .md, .py or .jsonl files inside)"
            )
        source = TextSource(path, location, files)
    else:
        source = TextSource(path, location.parent, [location])
    if source.num_bytes == 0:
        raise MeshtronError(f"{path} holds no text")
    return source


def _text_files(folder: Path) -> list[Path]:
    found = []
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if any(part.startswith(".") for part in relative.parts):
            continue
        if path.suffix in (*TEXT_SUFFIXES, JSONL_SUFFIX) and path.is_file():
            found.append((relative.as_posix(), path))
    return [path for _, path in sorted(found)]


def _decode(data: bytes, path: Path, line: int | None = None) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        offset = err.start
    where = f"{path} line {line}" if line is not None else str(path)
    raise MeshtronError(f"{where} is not UTF-8 text (invalid byte at offset {offset})")


def _jsonl_documents(path: Path) -> Iterator[str]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            line = _decode(raw, path, number).strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise MeshtronError(
                    f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(record, dict) or "text" not in record:
                raise MeshtronError(f'{path} line {number} has no "text" field')
            text = record["text"]
            if not isinstance(text, str):
                raise MeshtronError(f'{path} line {number} has a "text" field that is not a string')
            if text:
                yield text
