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
    """The rendezvous store, its keys prefixed by the elastic agent's restart count.

    A restarted group meets in the same agent store as the attempt before it; without a
    prefix of its own, the new ranks read the dead ranks' addresses and fail to connect
    ("connectFullMesh ... Connection refused")."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          info.world_size, is_master=not agent_store and info.rank == 0,
                          timeout=timeout, multi_tenant=not agent_store)
    return dist.PrefixStore(f"meshtron/attempt_{restart_count()}", store)


def restart_count(env: dict[str, str] | None = None) -> str:
    """Which restart of the elastic agent this process belongs to ("0" for the first start)."""
    return (os.environ if env is None else env).get("TORCHELASTIC_RESTART_COUNT", "0")


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
