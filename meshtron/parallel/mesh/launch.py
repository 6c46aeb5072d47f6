"""``meshtron train --nproc N``: start N local ranks through PyTorch's elastic launcher.

The same agent as ``torchrun --standalone --nproc-per-node N -m meshtron train ...``: it sets
the rendezvous variables, watches the ranks, and stops the others when one fails. A failure is
reported as one line naming the rank (the rank's own error line is printed above it).

Ctrl-C and SIGTERM are left to meshtron's own handler (the agent handles only SIGHUP and
SIGQUIT): it raises :class:`~meshtron.signals.Stopped` inside the agent, whose cleanup sends
SIGTERM to the ranks and waits for them, and the CLI reports the stop as one line. A rank keeps
quiet when stopped, and SIGTERM (unlike the SIGINT the agent would forward) also ends a rank
silently before its handlers are installed, where SIGINT would print a KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator, Sequence

from meshtron.errors import MeshtronError
from meshtron.signals import Stopped

AGENT_SIGNALS = "SIGHUP,SIGQUIT"
"""The signals torch's agent turns into its SignalException; SIGINT and SIGTERM are meshtron's."""
AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api")
SHUTDOWN_NOTES = ("death signal", "closing signal")
"""The agent's log lines while it stops the ranks: the CLI's one line says it instead."""


class _DropShutdownNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(note in record.getMessage() for note in SHUTDOWN_NOTES)


@contextlib.contextmanager
def _quiet_shutdown() -> Iterator[None]:
    """Drop the agent's shutdown notes for the duration of the launch (and only then)."""
    drop = _DropShutdownNotes()
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def launch_local(nproc: int, train_args: Sequence[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args([  # what torchrun's --standalone means: a private rendezvous
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}",
        f"--nproc-per-node={nproc}", "--max-restarts=0", f"--signals-to-handle={AGENT_SIGNALS}",
        "--module", "meshtron", "train", *train_args,
    ])
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    try:
        with _quiet_shutdown():
            elastic_launch(config, entrypoint)(*entry_args)
    except SignalException as err:  # SIGHUP, SIGQUIT: the agent has stopped the ranks
        raise Stopped(int(err.sigval)) from None
    except ChildFailedError as err:
        rank, failure = min(err.failures.items())
        raise MeshtronError(
            f"rank {rank} exited with code {failure.exitcode}; the other ranks were stopped"
        ) from None
    return 0
