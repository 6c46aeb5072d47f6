"""Checks on the places a command will write, made before any work is spent.

A read-only directory, a path that is a file, or a full disk used to be found at the first
save, after training steps were spent. :func:`check_writable` creates and removes a probe file
where the output will go (permissions alone do not tell: root ignores them, and read-only
mounts are not visible in the mode bits) and turns the OS error into one readable line.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from meshtron.errors import MeshtronError

REASONS = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
           errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
           errno.EDQUOT: "disk quota exceeded", errno.ENOTDIR: "a parent is a file"}


def os_reason(err: OSError) -> str:
    """A short reason for an OS error, without errno numbers or a traceback."""
    return REASONS.get(err.errno, err.strerror or type(err).__name__)


def check_writable(directory: Path, what: str) -> None:
    """``directory`` exists (or can be created) and accepts a new file; else one line naming
    ``what`` (e.g. ``"run.dir"``) and the reason. Directories it had to create are kept."""
    if directory.exists() and not directory.is_dir():
        raise MeshtronError(f"{what} {directory} is a file, not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".meshtron-probe-{uuid.uuid4().hex[:8]}"
        with open(probe, "wb") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        raise MeshtronError(f"{what} {directory} is not writable ({os_reason(err)})") from None
