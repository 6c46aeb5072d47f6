"""Cache entries under ``data.cache_dir``: content keys, atomic writes, one builder at a time.

Everything derived from user data (trained tokenizers, preprocessed datasets) is stored under a
key hashed from its inputs, so a second run reuses it and a changed input never meets a stale
entry. Files are written under a temporary name and renamed into place, so a crash never leaves
a half-written entry that looks complete; an exclusive lock per entry makes the N ranks of a job
that start together build it once while the others wait and then read it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshtron.errors import MeshtronError
from meshtron.files import os_reason

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; atomic renames still keep entries whole.
    fcntl = None  # type: ignore[assignment]


def content_key(*parts: str) -> str:
    """A stable hex key for the given strings (separated, so ("ab", "c") != ("a", "bc"))."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def make_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise MeshtronError(
            f"cannot create cache directory {path} ({err.strerror}); "
            "set data.cache_dir to a writable folder"
        ) from None
    return path


def entry_dir(cache_dir: str | Path, kind: str, key: str) -> Path:
    """The folder of one cache entry, e.g. ``<cache_dir>/datasets/<key>``."""
    return Path(cache_dir) / kind / key[:32]


@contextmanager
def locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on a cache entry while checking or building it."""
    make_dir(directory)
    if fcntl is None:
        yield
        return
    with open(directory / ".lock", "wb") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as err:
        raise MeshtronError(f"cannot write the cache entry {path} ({os_reason(err)}); free "
                            "space or set data.cache_dir to another folder") from None
    finally:
        tmp.unlink(missing_ok=True)


def scratch(cache_dir: str | Path, prefix: str) -> tempfile.TemporaryDirectory:
    """A temporary folder for runs a command starts and removes (archsearch's proxies,
    hpsearch's and tune's trials), under ``<cache_dir>/scratch`` rather than /tmp: the
    cache's disk is the one the user chose (data.cache_dir, else $XDG_CACHE_HOME), and /tmp is
    often a small in-memory file system."""
    root = make_dir(Path(os.path.expanduser(cache_dir)) / "scratch")
    return tempfile.TemporaryDirectory(prefix=prefix, dir=root)
