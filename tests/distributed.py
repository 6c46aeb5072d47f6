"""Run a test function in N gloo processes and collect what each rank returns.

Workers are forked from a fork server that imported torch and meshtron once (one thread each,
as the 2-core machines need), join a process group over a file:// rendezvous in a fresh temp
dir (so tests can run side by side), and leave through ``os._exit`` after destroying the group,
avoiding gloo's occasional abort at interpreter exit. A spawned worker spent ~3 CPU-seconds
importing torch and meshtron before its first collective, hundreds of times per suite; a worker
forked from the server starts with them imported, and otherwise as a spawned one would: the
test's working directory and ``sys.path`` (multiprocessing's preparation data) and its
environment (passed along) are its own, and it runs no code the server ran beyond imports.
A rank that raises makes the whole call fail with that rank's traceback; a hang fails it after
``timeout`` seconds. Every rank's outcome is reported, the tracebacks first: a rank that timed
out waiting for one that raised must not hide why.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.utils.tensorboard",
           "meshtron.training.trainer", "tests.parity")
"""What the fork server imports once, before any worker forks from it. Imports only: no torch
operation runs there, so no thread pool or lock is copied into a worker half-way. ``torch._dynamo``
is there because ``torch.utils.checkpoint`` (recompute) and ``torch.compile`` import it on first
use: ~1.5 CPU-s (sympy with it) in each rank that recomputes; ``torch.utils.tensorboard``
because every rank 0 writes its metrics there (~180 modules)."""


def _worker(fn: Callable, rank: int, world_size: int, rendezvous: str, out_dir: str,
            args: tuple, environment: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment now, not the fork server's at its start
    os.environ.update(environment)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank,
                                world_size=world_size)
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        result = ("error", traceback.format_exc())
        code = 1
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    from meshtron.parallel.mesh.process import exit_process

    exit_process(code)


class Ranks:
    """A group of workers started by :func:`start_distributed`; :meth:`results` waits for
    them. Between the two the test's own process is free: a parity test trains its
    one-process references there while the ranks run (their collectives leave the cores idle
    much of the time), instead of after them."""

    def __init__(self, fn: Callable, world_size: int, args: tuple, timeout: float) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server first starts
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory()
        rendezvous = f"file://{self._tmp.name}/rendezvous"
        self._procs = [ctx.Process(target=_worker, args=(fn, r, world_size, rendezvous,
                                                         self._tmp.name, args, dict(os.environ)))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()
        self._deadline = time.monotonic() + timeout  # for the whole group, not for each rank

    def results(self) -> list:
        """Every rank's return value in rank order, once all have ended; raises with every
        rank's problem (tracebacks first) if any raised, died or outlived the timeout."""
        try:
            for p in self._procs:
                p.join(max(0.0, self._deadline - time.monotonic()))
            alive = [r for r, p in enumerate(self._procs) if p.is_alive()]
            self._kill()
            return _collect(Path(self._tmp.name), self.world_size, alive,
                            [p.exitcode for p in self._procs])
        finally:
            self._tmp.cleanup()

    def stop(self) -> None:
        """Kill the ranks still running and drop their folder (the test failed before it
        asked for the results)."""
        self._kill()
        self._tmp.cleanup()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()


def _collect(tmp: Path, world_size: int, alive: list[int], codes: list) -> list:
    results, problems = [], []
    for r in range(world_size):
        path = tmp / f"rank{r}.pkl"
        if not path.exists():
            reason = "timed out" if r in alive else f"exit code {codes[r]}"
            problems.append((1, f"rank {r} of {world_size} returned nothing ({reason})"))
            continue
        status, value = pickle.loads(path.read_bytes())
        if status == "error":
            problems.append((0, f"rank {r} of {world_size} failed:\n{value}"))
        results.append(value)
    if problems:
        raise AssertionError("\n".join(text for _, text in sorted(problems, key=lambda p: p[0])))
    return results


def start_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> Ranks:
    """``fn(rank, world_size, *args)`` started on every rank; ``.results()`` waits for them."""
    return Ranks(fn, world_size, args, timeout)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list:
    """``fn(rank, world_size, *args)`` on every rank; returns the results in rank order."""
    return start_distributed(fn, world_size, *args, timeout=timeout).results()


def _python(args: list[str], cwd: str, environment: dict[str, str], out: str, err: str) -> None:
    """``python ARGS`` (``-m MODULE ...`` or ``-c CODE ...``) as a fresh interpreter would run
    it, in a process forked from the server that imported torch and meshtron already."""
    import runpy
    import sys

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.path[0:0] = [cwd]  # as `python -m` / `python -c` put the working directory first
    flag, what, *rest = args
    try:
        if flag == "-m":
            sys.argv = [what, *rest]
            runpy.run_module(what, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *rest]
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_python(args: list[str], cwd: Path, environment: dict[str, str],
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` with ``environment``, like ``subprocess.run`` capturing text,
    but forked from the fork server: a command's own work without ~3 CPU-seconds of imports
    (a README run is about a hundred commands). Exit codes are the interpreter's (SystemExit's
    code; 1 for an exception, whose traceback goes to the captured stderr)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    with tempfile.TemporaryDirectory() as tmp:
        out, err = f"{tmp}/stdout", f"{tmp}/stderr"
        proc = ctx.Process(target=_python, args=(args, str(cwd), environment, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["python", *args], timeout)
        read = lambda p: Path(p).read_text(errors="replace") if Path(p).exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(["python", *args], proc.exitcode, read(out), read(err))
