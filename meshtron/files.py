"""Checks on the places a command will write, made before any work is spent.

A read-only directory, a path that is a file, or a full disk used to be found at the first
save, after training steps were spent. :func:`check_writable` creates and removes a probe file
where the output will go, or where its directory will be created (permissions alone do not
tell: root ignores them, and a read-only mount does not show in the mode bits), and turns the
OS error into one readable line.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from pathlib import Path

from meshtron.errors import MeshtronError

REASONS = {errno.EACCES: "permission denied", errno.EPERM: "permission denied",
           errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
           errno.EDQUOT: "disk quota exceeded", errno.ENOTDIR: "a parent is a file",
           errno.EFBIG: "file size limit exceeded", errno.EIO: "input/output error",
           errno.ENAMETOOLONG: "a name in the path is longer than the file system allows",
           errno.ELOOP: "too many levels of symbolic links"}


def os_reason(err: OSError) -> str:
    """A short reason for an OS error, without errno numbers or a traceback."""
    return REASONS.get(err.errno, err.strerror or type(err).__name__)


_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def special_kind(path: Path) -> str | None:
    """What ``path`` is when it exists but is neither a regular file nor a folder (reading a
    FIFO with no writer blocks forever, a device never ends); None otherwise."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    return next((kind for test, kind in _KINDS if test(mode)), None)


def check_writable(directory: Path, what: str) -> None:
    """``directory`` accepts a new file, or can be created (probed in its nearest existing
    ancestor, so nothing is left behind); else one line naming ``what`` (e.g. ``"run.dir"``)
    and the reason."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise MeshtronError(f"{what} {directory} is a file, not a directory" if existing ==
                            directory else f"{what} {directory} cannot be created: {existing} "
                            "is a file")
    probe = existing / f".meshtron-probe-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        probe.unlink(missing_ok=True)
        raise MeshtronError(f"{what} {directory} is not writable ({os_reason(err)})") from None


def png_path(given: str, default_name: str) -> Path:
    """Where a PNG goes: inside ``given`` when it is a directory, with ``.png`` added when it
    names no extension (matplotlib would add it without saying so)."""
    path = Path(given)
    if (kind := special_kind(path)) is not None:  # /dev/full would become /dev/full.png
        raise MeshtronError(f"{given} is {kind}; name a PNG file or a folder")
    if path.is_dir():
        return path / default_name
    return path if path.suffix else path.with_name(path.name + ".png")


def check_output_file(path: Path, what: str) -> None:
    """``path`` can be written as a new or replaced file: its folder exists and is writable and
    it is not a folder itself (checked before the work whose result it holds, not after)."""
    if path.is_dir():
        raise MeshtronError(f"{what} {path} is a folder; name a file")
    folder = path.parent
    if not folder.exists():
        raise MeshtronError(f"{what} {path}: the folder {folder} does not exist")
    check_writable(folder, f"{what} {path}: the folder")


def write_failure_reason(err: BaseException) -> str:
    """A short reason for a failed write: an OS error's, or safetensors' (which reports the
    OS error only inside its message, as ``os error 28``)."""
    code = re.search(r"os error (\d+)", str(err))
    if isinstance(err, OSError) or code:
        number = err.errno if isinstance(err, OSError) else int(code.group(1))  # type: ignore
        return os_reason(OSError(number, os.strerror(number or 0)))
    return str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
