"""Joining and leaving the process group: torchrun and SLURM environments, clean shutdown.

Ranks come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) or, when
those are absent, from SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) with MASTER_ADDR
set by the job script. NCCL when CUDA is present, gloo otherwise; one device per local rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.errors import MeshtronError


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def process_info(env: dict[str, str] | None = None) -> ProcessInfo:
    """This process's place in the job, from torchrun's or SLURM's environment variables."""
    env = dict(os.environ if env is None else env)
    if "WORLD_SIZE" in env:
        return ProcessInfo(int(env.get("RANK", 0)), int(env["WORLD_SIZE"]),
                           int(env.get("LOCAL_RANK", 0)))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and int(env["SLURM_NTASKS"]) > 1:
        return ProcessInfo(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                           int(env.get("SLURM_LOCALID", 0)))
    return ProcessInfo(0, 1, 0)


def device_for(info: ProcessInfo) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


GROUP_TIMEOUT_MARGIN_S = 30.0
"""The process group waits this much beyond ``run.timeout_s``: the trainer's watchdog (see
``training/watchdog.py``) speaks first, naming the stalled phase and the silent ranks."""


def init_process_group(info: ProcessInfo, timeout_s: float) -> None:
    """Join the job's default process group (no-op for a single process)."""
    if not info.distributed or dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        raise MeshtronError("MASTER_ADDR is not set: launch with torchrun or `meshtron train "
                            "--nproc N`, or export MASTER_ADDR/MASTER_PORT in the SLURM script")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(info.rank))
    os.environ.setdefault("WORLD_SIZE", str(info.world_size))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo" and torch.get_num_threads() > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # several processes share the cores
    timeout = datetime.timedelta(seconds=timeout_s + GROUP_TIMEOUT_MARGIN_S)
    dist.init_process_group(backend, store=_attempt_store(info, timeout), rank=info.rank,
                            world_size=info.world_size, timeout=timeout)


def _attempt_store(info: ProcessInfo, timeout: datetime.timedelta) -> dist.Store:
    """The job's store (the agent's, or one rank 0 hosts), its keys prefixed by the rendezvous
    round (:func:`round_key`)."""
    agent_store = _shares_agent_store(os.environ)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          info.world_size, is_master=not agent_store and info.rank == 0,
                          timeout=timeout, multi_tenant=not agent_store)
    return dist.PrefixStore(f"meshtron/{round_key(info.world_size)}", store)


def restart_count(env: dict[str, str] | None = None) -> str:
    """Which restart of the elastic agent this process belongs to ("0" for the first start)."""
    return (os.environ if env is None else env).get("TORCHELASTIC_RESTART_COUNT", "0")


def round_key(world_size: int, env: Mapping[str, str] | None = None) -> str:
    """The name of this group's rendezvous round: the prefix of its keys in the job's store,
    for the process group and the watchdog's heartbeats alike.

    In torch's shared agent store (``TORCHELASTIC_USE_AGENT_STORE=True``, the default) every
    round of an elastic job meets in the same store, so each needs keys of its own, or the new
    ranks read the dead ranks' addresses ("connectFullMesh ... Connection refused", or a
    hang). A failure bumps TORCHELASTIC_RESTART_COUNT, but a node joining under ``--nnodes
    MIN:MAX`` restarts the group on a larger world without bumping it. Within one restart
    count membership only grows (a node that leaves is a failure, which bumps the count), so
    the count and the world size together name one round: ``attempt_1_world_4``.

    Without the agent store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which growing needs in
    torch 2.13: see docs/reliability.md) rank 0 hosts a new store each round, so there is
    nothing to tell apart, and the count is left out (``world_4``): each agent counts its own
    restarts, so a node that joins after the others restarted has count 0 where they have 1,
    and the two halves would wait for each other under different prefixes."""
    env = os.environ if env is None else env
    world = f"world_{world_size}"
    return f"attempt_{restart_count(env)}_{world}" if _shares_agent_store(env) else world


def _shares_agent_store(env: Mapping[str, str]) -> bool:
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


LAUNCHER_ENV = "MESHTRON_LAUNCHER_PID"
ATTEMPT_ENV = "MESHTRON_LAUNCH_ATTEMPT"
"""Which start of the group this is when `meshtron train --nproc` restarts it itself."""
PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """A rank started by ``meshtron train --nproc`` gets SIGTERM when its launcher dies (even
    by SIGKILL), instead of training on unsupervised (Linux; elsewhere nothing changes)."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(launcher):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def exit_process(code: int) -> None:
    """Leave the process group and exit without running interpreter teardown.

    gloo's worker threads can abort the process while the interpreter shuts down after a
    successful run; flushing and ``os._exit`` after destroying the group avoids it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # already exiting; the exit code tells the story
            dist.destroy_process_group()
    os._exit(code)
