"""``meshtron train --nproc N``: start N local ranks through PyTorch's elastic launcher.

The same agent as ``torchrun --standalone --nproc-per-node N -m meshtron train ...``: it sets
the rendezvous variables, watches the ranks, and stops the others when one fails. A failure is
reported as one line naming the rank that failed first and how (its exit code or signal; the
others' SIGTERM from the agent does not count). With ``--max-restarts R`` the launcher starts the
whole group again (a fresh agent and rendezvous) up to R times, each start resuming from the
newest complete checkpoint (the restarted ranks meet under a store prefix of their own: see
``process.py``), and each restart is one line saying which rank failed.

Ctrl-C and SIGTERM are left to meshtron's own handler (the agent handles only SIGHUP and
SIGQUIT): it raises :class:`~meshtron.signals.Stopped` inside the agent, whose cleanup sends
SIGTERM to the ranks and waits for them, and the CLI reports the stop as one line. A rank keeps
quiet when stopped, and SIGTERM (unlike the SIGINT the agent would forward) also ends a rank
silently before its handlers are installed, where SIGINT would print a KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence

from meshtron.errors import MeshtronError
from meshtron.parallel.mesh.process import ATTEMPT_ENV, LAUNCHER_ENV
from meshtron.signals import Stopped

AGENT_SIGNALS = "SIGHUP,SIGQUIT"
"""The signals torch's agent turns into its SignalException; SIGINT and SIGTERM are meshtron's."""
AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api")
SHUTDOWN_NOTES = ("death signal", "closing signal", "Unable to shutdown process")
"""The agent's log lines while it stops the ranks: the CLI's one line says it instead."""


STALL_EXIT_CODE = 75
"""How a rank's watchdog ends it when its peers stall (``training/watchdog.py``)."""
RELAYOUT_EXIT_CODE = 76
"""How every rank ends when ``train.autotune=layout`` has checkpointed and chosen a new
layout: the launcher starts them again (not counted as a restart)."""
MAX_RELAYOUTS = 4
"""Starts into a new layout one launch allows (a guard against a cost model that flips)."""


def describe_exit(code: int) -> str:
    """``"was killed by SIGKILL"`` or ``"exited with code 1"``: how a rank ended."""
    if code == STALL_EXIT_CODE:
        return "gave up waiting for stalled ranks (named in its line above)"
    if code == RELAYOUT_EXIT_CODE:
        return "asked for a restart into a new layout (train.autotune=layout)"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class _AgentLog(logging.Filter):
    """Drops the agent's shutdown notes and its "failed (exitcode ...) local_rank ..." error:
    that names the first rank its poll found dead, often a survivor that lost contact, so the
    launcher names the culprit itself from every rank's failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (any(note in message for note in SHUTDOWN_NOTES)
                    or message.startswith("failed (exitcode: "))


@contextlib.contextmanager
def _agent_log() -> Iterator[None]:
    """Filter the agent's log for the duration of the launch (and only then)."""
    log = _AgentLog()
    loggers = [logging.getLogger(name) for name in AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(log)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(log)


CONSEQUENCES = (1, STALL_EXIT_CODE, -signal.SIGTERM)
"""Exits that follow another rank's failure: a lost peer (1), a stalled one (the watchdog), the
agent's SIGTERM to the survivors."""


def _culprit_first(item: tuple[int, object]) -> tuple[int, float, int]:
    """Order failures so the one that caused the others comes first: killed by a signal (not
    the agent's SIGTERM), then any exit that is not a consequence, then by time and rank
    (the agent notices several deaths in one poll, with equal timestamps)."""
    rank, failure = item
    code = failure.exitcode
    kind = 0 if code < 0 and code != -signal.SIGTERM else 1 if code not in CONSEQUENCES else 2
    return kind, failure.timestamp, rank


class RankFailed(MeshtronError):
    """A rank of the group failed (the first to fail, and how)."""

    def __init__(self, rank: int, how: str, restarts: int = 0, code: int | None = None):
        used = f" (after {restarts} restarts)" if restarts else ""
        super().__init__(f"rank {rank} {how}{used}; the other ranks were stopped")
        self.rank, self.how, self.code = rank, how, code


def launch_local(nproc: int, train_args: Sequence[str], max_restarts: int = 0,
                 min_nproc: int | None = None, fits: Callable[[int], bool] | None = None,
                 command: str = "train") -> int:
    """Run ``meshtron train`` on ``nproc`` local ranks, starting the whole group again after a
    failure up to ``max_restarts`` times (each start resumes from the newest checkpoint and
    meets under a store prefix of its own). With ``min_nproc``, each restart continues on the
    largest world size below the failed one, down to ``min_nproc``, that ``fits`` (the plan
    accepts it); the checkpoint reshards on resume and the global batch is kept by more
    accumulation. Ranks that all exit with :data:`RELAYOUT_EXIT_CODE` are started again at
    once, uncounted. ``command`` names another subcommand for the ranks (``generate``)."""
    world, relayouts, attempt = nproc, 0, 0
    while True:
        os.environ[ATTEMPT_ENV] = str(attempt + relayouts)
        try:
            return _launch(world, train_args, command)
        except RankFailed as failure:
            if failure.code == RELAYOUT_EXIT_CODE and relayouts < MAX_RELAYOUTS:
                relayouts += 1
                print("meshtron: starting every rank again in the layout train.autotune chose, "
                      "from its checkpoint", file=sys.stderr, flush=True)
                continue
            if attempt == max_restarts:
                raise RankFailed(failure.rank, failure.how, max_restarts) from None
            attempt += 1
            count = f"restart {attempt} of {max_restarts}"
            if min_nproc is None:
                print(f"meshtron: rank {failure.rank} {failure.how}; restarting every rank from "
                      f"the newest checkpoint ({count})", file=sys.stderr, flush=True)
                continue
            smaller = next((n for n in range(world - 1, min_nproc - 1, -1)
                            if fits is None or fits(n)), None)
            if smaller is None:
                raise MeshtronError(f"{failure}; no world size from {world - 1} down to "
                                    f"--min-nproc {min_nproc} holds this layout") from None
            print(f"meshtron: rank {failure.rank} {failure.how}; continuing on {smaller} ranks "
                  f"(was {world}) from the newest checkpoint ({count})",
                  file=sys.stderr, flush=True)
            world = smaller


@contextlib.contextmanager
def launcher_environment() -> Iterator[None]:
    """This process's environment as it was once the ranks have finished: torchrun's argument
    handling sets ``OMP_NUM_THREADS=1`` in the launching process itself (for its ranks), and
    a one-process run this process starts later (a tuning trial, the calibration's probe)
    would inherit it and train on one thread instead of every core."""
    before = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def _launch(nproc: int, train_args: Sequence[str], command: str = "train") -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args([  # what torchrun's --standalone means: a private rendezvous
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", f"--rdzv-id={uuid.uuid4()}",
        f"--nproc-per-node={nproc}", "--max-restarts=0",
        f"--signals-to-handle={AGENT_SIGNALS}",
        "--module", "meshtron", command, *train_args,
    ])
    try:
        with launcher_environment():
            config, entrypoint, entry_args = torchrun.config_from_args(args)
            os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks die with this process
            with _agent_log():
                elastic_launch(config, entrypoint)(*entry_args)
    except SignalException as err:  # SIGHUP, SIGQUIT: the agent has stopped the ranks
        raise Stopped(int(err.sigval)) from None
    except ChildFailedError as err:
        rank, failure = min(err.failures.items(), key=_culprit_first)
        raise RankFailed(rank, describe_exit(failure.exitcode), code=failure.exitcode) from None
    return 0
