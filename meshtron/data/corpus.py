"""The embedded default corpus: the running interpreter's standard-library sources.

Every machine that runs meshtron has them, so the main job trains without downloading anything.
Test suites, third-party packages and bytecode are left out; files are taken in sorted path order
until the size cap, so the corpus (and every cache keyed by its fingerprint) is the same on every
run with the same Python.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from meshtron.data.sources import TextSource
from meshtron.errors import MeshtronError

EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(max_bytes: int) -> TextSource:
    """Standard-library ``.py`` files (one document each), at most ``max_bytes`` in total.

    Files that are empty or not UTF-8 are skipped; collection stops at the first file that
    would cross the cap.
    """
    root = stdlib_root()
    chosen: list[Path] = []
    total = 0
    for path in _python_files(root):
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data:
            continue
        if total + len(data) > max_bytes:
            break
        chosen.append(path)
        total += len(data)
    if not chosen:
        raise MeshtronError(
            f"the standard library at {root} holds no source file within the corpus cap of "
            f"{max_bytes} bytes; raise data.corpus_max_mb"
        )
    return TextSource(f"the standard-library corpus ({total / 1e6:.1f} MB)", root, chosen)


def _python_files(root: Path) -> Iterator[Path]:
    """Every eligible ``.py`` file under ``root``, sorted by relative path."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [name for name in dirs if name not in EXCLUDED_DIRS]
        base = Path(folder)
        for name in files:
            if name.endswith(".py"):
                path = base / name
                found.append((path.relative_to(root).as_posix(), path))
    return (path for _, path in sorted(found))
