"""Ctrl-C and SIGTERM end a command with one line and the shell's exit code, not a traceback.

A user's Ctrl-C and a scheduler's SIGTERM (preemption, ``scancel``, the elastic agent stopping
its ranks) raise :class:`Stopped` in the main thread, so ``try/finally`` blocks still run and
metrics are closed. A save cut short leaves only a ``.tmp-*`` directory that resume skips (a
background save is still joined at exit by one process; the ranks of a job leave through
``os._exit`` and abandon it). The CLI prints one line and exits with ``128 + signal`` (130 for
SIGINT, 143 for SIGTERM), as a shell reports such a stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """A stop signal arrived. A BaseException, like KeyboardInterrupt, so that cleanup code
    catching ``Exception`` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self, training: bool) -> str:
        """The one line the user sees; for training, what is kept and how to go on."""
        name = signal.Signals(self.signum).name
        text = f"meshtron: stopped by {name}{' (Ctrl-C)' if self.signum == signal.SIGINT else ''}"
        if training:
            text += ("; complete checkpoints are kept (an unfinished save is discarded) and "
                     "rerunning the same command resumes from the newest one")
        return text


class Received:
    """The first stop signal seen while the handlers were installed (None until one comes).

    A rank stopped by a signal can fail in a collective because its peer left first; knowing
    the signal came lets the CLI report the stop instead of that failure.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = True

    def disarm(self) -> None:
        """From now on a stop signal is only recorded, not raised: once the command has its
        result or its error, a SIGTERM (the agent stopping the group after a peer died) must not
        land in the cleanup, e.g. in a weak-reference callback, where Python prints it as an
        ignored exception with a traceback."""
        self.armed = False


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Received]:
    """Within the block, SIGINT and SIGTERM raise :class:`Stopped` in the main thread until
    :meth:`Received.disarm`; the previous handlers come back after it (the CLI may run inside
    another program, e.g. pytest). A Stopped raised where it cannot propagate (a finalizer or a
    weak-reference callback run by the garbage collector) is dropped without a traceback; the
    signal stays recorded, so the collective that fails once the peers have stopped is reported
    as the stop. Off the main thread, where handlers cannot be set, it changes nothing."""
    received = Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if received.signum is None:
            received.signum = signum
        if received.armed:
            raise Stopped(signum)

    unraisable_hook = sys.unraisablehook

    def drop_lost_stops(unraisable: sys.UnraisableHookArgs) -> None:
        if not isinstance(unraisable.exc_value, Stopped):
            unraisable_hook(unraisable)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    sys.unraisablehook = drop_lost_stops
    try:
        yield received
    finally:
        sys.unraisablehook = unraisable_hook
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)


def reports_stop(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints the stop line: not a rank under an elastic agent (the agent,
    e.g. ``meshtron train --nproc``, got the signal first and reports it once) and, without an
    agent (SLURM), only the first rank."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return False
    rank = env.get("RANK", env.get("SLURM_PROCID", "0"))
    return not rank.isdigit() or int(rank) == 0


def report_stop(err: BaseException, training: bool) -> int:
    """Print the stop line (once per job, see :func:`reports_stop`) for a :class:`Stopped` or a
    KeyboardInterrupt (a Ctrl-C that came before the handlers); return the exit code."""
    stop = err if isinstance(err, Stopped) else Stopped(signal.SIGINT)
    sys.stdout.flush()
    if reports_stop():
        print(stop.line(training), file=sys.stderr)
    return stop.exit_code
