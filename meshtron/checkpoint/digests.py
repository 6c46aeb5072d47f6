"""File checksums of a checkpoint: XXH3-128 for what is written now, sha256 still read.

A checksum here detects corruption (bit rot, a torn or truncated write, a copy gone wrong), not
tampering: whoever can rewrite a shard can rewrite the manifest that records its checksum. So
the checksum need not be cryptographic, and it must be cheap, since every save computes it and
every load checks it. sha256 runs at about 1.5 GB/s on one core here (with the SHA
instructions), which made it half of a checkpoint load; XXH3-128 (the ``xxhash`` package) runs
at about 14 GB/s and releases the GIL, so it hides behind the copies. A digest is written as
``xxh3-128:<32 hex digits>``; a bare 64-digit one is a sha256 from an older checkpoint, and is
verified as such.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import xxhash

XXH3_PREFIX = "xxh3-128:"
DIGEST = re.compile(r"^(xxh3-128:[0-9a-f]{32}|[0-9a-f]{64})$")
READ_BLOCK = 8 << 20


class Digest:
    """A running checksum of one file, in the algorithm a recorded digest names."""

    def __init__(self, like: str | None = None):
        self.sha256 = like is not None and not like.startswith(XXH3_PREFIX)
        self._state: Any = hashlib.sha256() if self.sha256 else xxhash.xxh3_128()

    def update(self, data: bytes | memoryview) -> None:
        self._state.update(data)

    def text(self) -> str:
        hexdigest = self._state.hexdigest()
        return hexdigest if self.sha256 else XXH3_PREFIX + hexdigest


def file_digest(path: Path, like: str | None = None) -> str:
    """The checksum of the file at ``path``, in ``like``'s algorithm (default XXH3-128)."""
    digest = Digest(like)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BLOCK), b""):
            digest.update(block)
    return digest.text()
