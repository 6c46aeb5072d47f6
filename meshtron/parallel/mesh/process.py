"""Joining and leaving the process group: torchrun and SLURM environments, clean shutdown.

Ranks come from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) or, when
those are absent, from SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) with MASTER_ADDR
set by the job script. NCCL when CUDA is present, gloo otherwise; one device per local rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
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
    dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


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
