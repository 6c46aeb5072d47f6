"""Run a task on every rank of a fresh gloo group.

``spawn(task, world, *args, timeout=...)`` starts ``world`` processes with the ``spawn`` start
method. Each sets ``GLOO_SOCKET_IFNAME=lo`` and one torch thread, joins a gloo group through a
``file://`` rendezvous in a temporary directory, runs ``task(rank, world, *args)``, pickles the
result (or its traceback) to that directory and leaves through
:func:`meshtron.parallel.mesh.process.exit_process`, which avoids gloo's abort at interpreter
shutdown. The parent returns the results in rank order, or raises :class:`RuntimeError` naming
every rank that failed or returned nothing (killed at the timeout), with its traceback.

``task`` is pickled by reference, so it must be a module-level function; a benchmark run as a
script (``python benchmarks/X.py``) is imported by the children as ``__mp_main__``, which is
why every script keeps its entry point under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def _worker(task: Callable[..., Any], rank: int, world: int, out_dir: str,
            args: tuple[Any, ...]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo collective names
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                                world_size=world)
        result: Any = ("ok", task(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
        code = 1
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    from meshtron.parallel.mesh.process import exit_process

    exit_process(code)  # destroy the group and os._exit: avoids gloo's abort at shutdown


def spawn(task: Callable[..., Any], world: int, *args: Any, timeout: float,
          env: Mapping[str, str] | None = None) -> list[Any]:
    """``task(rank, world, *args)`` in ``world`` fresh processes, with ``env`` added to their
    environment (set before they start: glibc reads ``MALLOC_*`` at start); the results in
    rank order. The whole group gets ``timeout`` seconds, then what is left is killed."""
    name = getattr(task, "__qualname__", repr(task))
    ctx = mp.get_context("spawn")
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_worker, args=(task, r, world, tmp, args))
                     for r in range(world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(1.0, deadline - time.monotonic()))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            results, errors = [], []
            for r, p in enumerate(procs):
                path = Path(tmp) / f"rank{r}.pkl"
                if not path.exists():
                    errors.append(f"{name}: rank {r} returned nothing (exit code {p.exitcode}; "
                                  f"killed after the {timeout:.0f} s timeout if -9)")
                    continue
                status, value = pickle.loads(path.read_bytes())
                if status == "error":
                    errors.append(f"{name}: rank {r} failed:\n{value}")
                results.append(value)
            if errors:
                raise RuntimeError("\n".join(errors))
            return results
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
