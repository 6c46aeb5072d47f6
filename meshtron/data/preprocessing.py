"""Raw text to indexed dataset, and the cache that makes it happen once per (text, tokenizer).

Documents are encoded in batches by the multithreaded Rust encoder and written with EOS after
each. A very large document (a whole book in one ``.txt``) is cut into pieces at line breaks
between two visible ASCII characters before encoding; the byte-level pre-tokenizer never joins
characters across such a break, so the pieces encode to exactly the ids of the whole while
spreading over all cores and keeping memory bounded.

A dataset written for the user (``meshtron preprocess``) carries its tokenizer beside it as
``PREFIX.tokenizer.json``, so ``data.path=PREFIX`` trains without naming the tokenizer: the
ids in a ``.bin`` mean nothing without the exact tokenizer that made them.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import TypedDict

import numpy as np

from meshtron.config import TrainConfig
from meshtron.data import cache
from meshtron.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    indexed_prefix,
)
from meshtron.data.sources import TextSource, open_source
from meshtron.data.tokenizer import Log, Tokenizer
from meshtron.errors import MeshtronError

FORMAT_VERSION = 1
"""Bump when the preprocessed layout changes, so old cache entries are not reused."""
PIECE_CHARS = 1 << 20
BATCH_CHARS = 8 << 20
_PROGRESS_S = 10.0
_LINE_BREAK = re.compile(r"[!-~]\n(?=[!-~])")
TOKENIZER_SUFFIX = ".tokenizer.json"
"""``PREFIX.tokenizer.json`` is the tokenizer a preprocessed ``PREFIX`` was made with."""
USEFUL_WINDOWS = 1000
"""Below this many windows at the default ``train.seq_len`` a dataset is mostly repeated by a
default run (200 steps x 8 windows), so ``preprocess`` warns."""


class PreprocessStats(TypedDict):
    """What :func:`preprocess` did; ``tokenizer`` is the copy beside the dataset (None when
    not written), ``warning`` the too-small warning it logged (None when it did not)."""

    documents: int
    tokens: int
    input_bytes: int
    seconds: float
    mb_per_s: float
    tokenizer: str | None
    warning: str | None


def tokenizer_beside(prefix: str | Path) -> Path:
    """Where the tokenizer of the preprocessed dataset ``prefix`` lives."""
    return Path(str(prefix) + TOKENIZER_SUFFIX)


def format_count(n: int) -> str:
    """Three significant digits with K/M/B: 184, 2.27K, 42.5K, 2.08M."""
    value = float(f"{n:.3g}")
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:g}{unit}"
    return f"{value:g}"


def small_output_warning(name: str, tokens: int) -> str | None:
    """A one-line warning when ``tokens`` is too few to be worth training on, else None."""
    seq_len = TrainConfig().seq_len
    useful = USEFUL_WINDOWS * seq_len
    if tokens >= useful:
        return None
    return (
        f"warning: {name} holds {tokens:,} tokens, fewer than {useful:,} ({USEFUL_WINDOWS:,} "
        f"windows at the default train.seq_len={seq_len}); a model trained on it mostly "
        "memorises it, so add text if you can"
    )


def split_document(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut ``text`` into pieces of about ``piece_chars`` that encode exactly like the whole."""
    pieces = []
    start = 0
    while len(text) - start > piece_chars:
        match = _LINE_BREAK.search(text, start + piece_chars)
        if match is None:
            break
        pieces.append(text[start : match.end()])
        start = match.end()
    pieces.append(text[start:])
    return pieces


def _batches(documents: Iterator[str]) -> Iterator[list[list[str]]]:
    """Batches of documents (each a list of pieces) of about BATCH_CHARS characters."""
    batch: list[list[str]] = []
    size = 0
    for document in documents:
        batch.append(split_document(document))
        size += len(document)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def preprocess(
    inputs: Sequence[str | TextSource],
    output_prefix: str | Path,
    tokenizer: Tokenizer,
    log: Log = print,
    *,
    write_tokenizer: bool = True,
    warn_small: bool = True,
) -> PreprocessStats:
    """Tokenise raw text into ``output_prefix.bin``/``.idx`` (EOS after every document).

    With ``write_tokenizer`` the tokenizer is copied to ``output_prefix.tokenizer.json``
    (:func:`tokenizer_beside`) before the index appears; with ``warn_small`` a too small
    output is logged (:func:`small_output_warning`). The cache turns both off: its entries are
    keyed by the tokenizer and the trainer reports their sizes.
    """
    sources = [open_source(x) if isinstance(x, str) else x for x in inputs]
    name = " + ".join(s.name for s in sources)
    num_bytes = sum(s.num_bytes for s in sources)
    start = last_report = time.perf_counter()
    documents = tokens = 0
    eos = [tokenizer.eos_id]
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    with IndexedDatasetWriter(output_prefix, dtype) as writer:
        stream = chain.from_iterable(s.documents() for s in sources)
        for batch in _batches(stream):
            encoded = iter(tokenizer.encode_batch([p for pieces in batch for p in pieces]))
            for pieces in batch:
                ids = np.fromiter(
                    chain.from_iterable([next(encoded) for _ in pieces] + [eos]), dtype=np.int64
                )
                writer.add_document(ids)
                tokens += len(ids)
            documents += len(batch)
            if time.perf_counter() - last_report > _PROGRESS_S:
                last_report = time.perf_counter()
                log(f"preprocess: {documents} documents, {tokens / 1e6:.1f}M tokens so far")
        if documents == 0:
            raise MeshtronError(f"{name} holds no text")
        written = _write_tokenizer(tokenizer, output_prefix) if write_tokenizer else None
        writer.finalize()
    seconds = time.perf_counter() - start
    rate = num_bytes / 1e6 / max(seconds, 1e-9)
    log(
        f"preprocess: {documents:,} documents, {format_count(tokens)} tokens from "
        f"{format_count(num_bytes)}B in {seconds:.1f} s ({rate:.1f} MB/s)"
    )
    warning = small_output_warning(str(output_prefix), tokens) if warn_small else None
    if warning:
        log(warning)
    return {
        "documents": documents,
        "tokens": tokens,
        "input_bytes": num_bytes,
        "seconds": seconds,
        "mb_per_s": rate,
        "tokenizer": str(written) if written else None,
        "warning": warning,
    }


def _write_tokenizer(tokenizer: Tokenizer, prefix: str | Path) -> Path:
    """Copy the tokenizer to ``prefix.tokenizer.json`` (atomically; a no-op onto itself)."""
    target = tokenizer_beside(prefix)
    try:
        if target.exists() and target.samefile(tokenizer.path):
            return target
        cache.atomic_write_bytes(target, tokenizer.path.read_bytes())
    except OSError as err:
        raise MeshtronError(f"cannot write the tokenizer to {target} ({err.strerror})") from None
    return target


def prepare_dataset(
    path: str | TextSource, tokenizer: Tokenizer, cache_dir: str | Path, log: Log = print
) -> str:
    """The indexed-dataset prefix for a data path, preprocessing it into the cache if needed.

    An indexed prefix is returned as is. Raw text goes to
    ``<cache_dir>/datasets/<key>/data`` with key = sha256(text fingerprint, tokenizer
    fingerprint, format version); nothing is ever written next to the user's files.
    """
    if isinstance(path, str):
        prefix = indexed_prefix(path)
        if prefix is not None:
            return prefix
        source = open_source(path)
    else:
        source = path
    key = cache.content_key("dataset", str(FORMAT_VERSION), source.fingerprint,
                            tokenizer.fingerprint)
    entry = cache.entry_dir(cache_dir, "datasets", key)
    prefix = str(entry / "data")
    with cache.locked(entry):
        try:
            IndexedDataset(prefix)
        except MeshtronError:
            log(f"preprocess: tokenising {source.name} into {prefix}")
            preprocess([source], prefix, tokenizer, log, write_tokenizer=False, warn_small=False)
        else:
            log(f"dataset: cached {source.name} at {prefix}")
    return prefix
