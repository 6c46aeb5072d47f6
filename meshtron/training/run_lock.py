"""One training at a time per run directory and checkpoint directory.

Two trainings pointed at the same ``run.dir`` (or ``checkpoint.dir``) would interleave their
metrics and save one run's checkpoints under the other's steps. The process that starts a
run (the ``--nproc`` launcher, or global rank 0 under torchrun) holds an advisory ``flock`` on
``.meshtron.lock`` in each directory for as long as it lives; the kernel releases it when the
process ends however it ends, so a crashed run never leaves a stale lock. The file names the
holder (pid, host, start time) so that the second run's refusal can say who holds it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from meshtron.errors import MeshtronError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks, so no protection (said in docs/training.md)
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".meshtron.lock"
HELD_ENV = "MESHTRON_RUN_LOCK_HELD"
"""Set by the process holding the locks, so the workers it launches do not take them again."""


def _remove_if_untouched(created: list[Path]) -> None:
    """Remove the directories the lock made (deepest first) when they hold nothing but the
    lock file: a run refused before its first write leaves no trace."""
    for directory in reversed(created):
        try:
            if {entry.name for entry in directory.iterdir()} <= {LOCK_FILE}:
                (directory / LOCK_FILE).unlink(missing_ok=True)
                directory.rmdir()
        except OSError:
            return  # someone else wrote there meanwhile: keep it


def _lock(directory: Path, what: str, stack: contextlib.ExitStack) -> None:
    created = [p for p in (*reversed(directory.parents), directory) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    stack.callback(_remove_if_untouched, created)
    handle = stack.enter_context(open(directory / LOCK_FILE, "a+"))  # noqa: SIM115
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "an unknown process"
        raise MeshtronError(f"{what} {directory} is in use by another training ({holder}); "
                            f"wait for it to end, or use another {what}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}, since "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()


@contextlib.contextmanager
def run_lock(run_dir: Path, checkpoint_dir: Path) -> Iterator[None]:
    """Hold the run's locks for the body's duration (nothing when an ancestor holds them)."""
    if fcntl is None or os.environ.get(HELD_ENV) == "1":
        yield
        return
    with contextlib.ExitStack() as stack:
        _lock(run_dir, "run.dir", stack)
        if checkpoint_dir.resolve() != run_dir.resolve():
            _lock(checkpoint_dir, "checkpoint.dir", stack)
        os.environ[HELD_ENV] = "1"
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)
