"""``meshtron sample-data``: stand-ins for a user's own text, in every form ``data.path`` takes.

The README's own-data examples name ``corpus.txt``, ``books/``, ``code.jsonl`` and ``corpus/``;
a fresh clone has none of them, so this writes them from the built-in corpus (the standard
library's sources, :mod:`.corpus`), nothing downloaded: a text file, two folders of text files
and a JSONL file with a ``text`` field. Existing files are never overwritten."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshtron.data.corpus import stdlib_corpus
from meshtron.errors import MeshtronError
from meshtron.files import check_writable

NAMES = ("corpus.txt", "books", "code.jsonl", "corpus")
"""What is written, in this order; document ``i`` of the corpus goes to ``NAMES[i % 4]``."""


def add_sample_data_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sample-data", help="write example text data (corpus.txt, books/, code.jsonl, corpus/)",
        description="Write corpus.txt, books/, code.jsonl and corpus/ into FOLDER from the "
        "built-in corpus (this Python's standard-library sources): example data in each form "
        "--data.path takes, for the README's examples. Existing files are not overwritten.")
    p.add_argument("folder", nargs="?", default=".", help="where to write them (default: .)")
    p.add_argument("--max-mb", type=float, default=4.0,
                   help="megabytes of sources in all, split over the four (default 4)")
    p.set_defaults(func=run_sample_data)
    return p


def run_sample_data(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise MeshtronError(f"sample-data takes no config overrides, got {' '.join(extra)}")
    if not 0 < args.max_mb <= 1024:
        raise MeshtronError(f"--max-mb must be above 0 and at most 1024, got {args.max_mb:g}")
    folder = Path(args.folder)
    taken = [name for name in NAMES if (folder / name).exists()]
    if taken:
        raise MeshtronError(f"{folder / taken[0]} already exists; sample-data writes only new "
                            "files (move it away or name another folder)")
    check_writable(folder, "sample-data's folder")
    try:
        source = stdlib_corpus(int(args.max_mb * 1e6))
    except MeshtronError:  # not one file fits: said below, in this command's words
        source = None
    files = source.files if source is not None else ()
    if source is None or len(files) < len(NAMES):
        raise MeshtronError(f"--max-mb {args.max_mb:g} holds {len(files)} of the standard "
                            f"library's source files; at least {len(NAMES)} are needed")
    groups = [files[i :: len(NAMES)] for i in range(len(NAMES))]
    folder.mkdir(parents=True, exist_ok=True)
    texts = [[path.read_text(encoding="utf-8") for path in group] for group in groups]
    (folder / NAMES[0]).write_text("\n".join(texts[0]), encoding="utf-8")
    for name, documents in ((NAMES[1], texts[1]), (NAMES[3], texts[3])):
        (folder / name).mkdir()
        for i, text in enumerate(documents):
            (folder / name / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    (folder / NAMES[2]).write_text(
        "".join(json.dumps({"text": text}) + "\n" for text in texts[2]), encoding="utf-8")
    sizes = [sum(len(t.encode()) for t in documents) / 1e6 for documents in texts]
    print(f"wrote into {folder}/ from {source.name}: corpus.txt ({sizes[0]:.1f} MB), books/ "
          f"({len(texts[1])} files, {sizes[1]:.1f} MB), code.jsonl ({len(texts[2])} documents, "
          f"{sizes[2]:.1f} MB), corpus/ ({len(texts[3])} files, {sizes[3]:.1f} MB)")
    return 0
