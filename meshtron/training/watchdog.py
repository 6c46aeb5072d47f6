"""Hang detection: a watchdog thread per rank, heartbeats through the rendezvous store.

A rank stuck in a collective (a peer was stopped, hung or is unreachable) can wait far longer
than ``run.timeout_s``: a pending ``Work.wait()`` has no deadline of its own. Each rank's
watchdog thread writes a heartbeat (time, the phase its main thread is in) to the job's store
every few seconds over its own store connection, and when its main thread has not changed
phase for ``run.timeout_s`` it reads the others' heartbeats and ends the process with one line
that names the phase it waited in and the ranks that went silent, or, when every rank still
answers in the same phase, that the phase outlasts the timeout (a step slower than
``run.timeout_s``). Silent ranks on its own host are SIGKILLed on the way out: a hung or
stopped process ignores the elastic agent's SIGTERM, and the agent would hold the whole job
for its 30 s shutdown grace before killing it. The process group's own timeout is set beyond
the watchdog's (``GROUP_TIMEOUT_MARGIN_S`` in :mod:`meshtron.parallel.mesh.process`), so the
watchdog speaks first.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from meshtron.parallel.mesh.launch import STALL_EXIT_CODE
from meshtron.parallel.mesh.process import round_key


def heartbeat_interval(timeout_s: float) -> float:
    return min(5.0, max(0.2, timeout_s / 10))


class Watchdog:
    """Start with :meth:`start`, name what the main thread does with :meth:`phase`, end with
    :meth:`stop`. ``store`` is a client of the job's store of its own (None: no peers)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, store: dist.Store,
                 exit_process: Callable[[int], object] = os._exit,
                 kill_process: Callable[[int], object] = lambda pid: os.kill(pid,
                                                                             signal.SIGKILL)):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval = heartbeat_interval(timeout_s)
        self.store = store
        self.exit_process = exit_process
        self.kill_process = kill_process
        self.host = socket.gethostname()
        self.current = "start-up"
        self.since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshtron-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def phase(self, text: str) -> None:
        self.current, self.since = text, time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval)

    def _run(self) -> None:
        while not self._stop.is_set():
            beat = json.dumps({"time": time.time(), "phase": self.current, "host": self.host,
                               "pid": os.getpid()})
            with contextlib.suppress(Exception):  # the store's host may be the stalled one:
                self.store.set(f"heartbeat/{self.rank}", beat)  # then every beat reads stale
            waited = time.monotonic() - self.since
            if waited > self.timeout_s and not self._stop.is_set():
                self._give_up(waited)
            self._stop.wait(self.interval)

    def _give_up(self, waited: float) -> None:
        silent, elsewhere, stuck_here = [], [], []
        now = time.time()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"heartbeat/{rank}"
            try:
                beat = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # noqa: BLE001 - the store's host is gone or stalled
                beat = None
            if beat is None:
                silent.append(f"rank {rank} (no heartbeat)")
                continue
            age = now - beat["time"]
            if age > 3 * self.interval:
                silent.append(f"rank {rank} (silent for {age:.0f} s, last in {beat['phase']})")
                if beat.get("host") == self.host and "pid" in beat:
                    stuck_here.append(beat["pid"])
            elif beat["phase"] != self.current:
                elsewhere.append(f"rank {rank} is in {beat['phase']}")
        where = f"rank {self.rank} waited {waited:.0f} s in {self.current}"
        if silent:
            cause = "unresponsive: " + ", ".join(silent)
        elif elsewhere:
            cause = "a collective is stuck: " + ", ".join(elsewhere)
        else:
            cause = ("every rank answers and is in the same phase, which outlasts "
                     f"run.timeout_s={self.timeout_s:g}: raise run.timeout_s above it")
        print(f"meshtron: error: {where} (run.timeout_s={self.timeout_s:g}); {cause}",
              file=sys.stderr, flush=True)
        for pid in stuck_here:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self.kill_process(pid)
        self.exit_process(STALL_EXIT_CODE)


def job_watchdog(rank: int, world_size: int, timeout_s: float) -> Watchdog | None:
    """A watchdog over its own client of the job's store (None for one process)."""
    if world_size <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    interval = heartbeat_interval(timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=2 * interval),
                          wait_for_workers=False)
    return Watchdog(rank, world_size, timeout_s,
                    dist.PrefixStore(f"meshtron/watchdog/{round_key(world_size)}", store))
