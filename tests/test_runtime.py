"""Joining a job from torchrun or SLURM variables, and failing cleanly when a peer dies."""

import os
import select

import pytest

from meshtron.parallel.mesh.process import process_info
from tests.distributed import run_distributed


def test_torchrun_variables_win():
    env = {"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "1", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "0"}
    info = process_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.distributed) == (5, 8, 1, True)


def test_slurm_variables_without_torchrun():
    info = process_info({"SLURM_NTASKS": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1"})
    assert (info.rank, info.world_size, info.local_rank) == (9, 16, 1)


def test_plain_process_is_a_world_of_one():
    assert not process_info({}).distributed
    assert not process_info({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).distributed


def survive_a_dead_peer(rank: int, world_size: int) -> tuple[str | None, list]:
    import torch
    import torch.distributed as dist

    from meshtron.cli import _peer_failure

    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        return None, []  # leaves at once: its process group goes away
    # Errors of our own code that merely mention a timeout keep their traceback.
    own = [_peer_failure(RuntimeError("Timeout while reading the config")),
           _peer_failure(ValueError("Connection reset by peer"))]
    # gloo's wordings of a pair whose peer has gone (tcp/pair.cc) are peer failures
    for text in ("Socket closed [127.0.0.1]:4242", "Read error [127.0.0.1]:4242: Connection "
                 "reset by peer", "Application timeout caused pair closure"):
        assert _peer_failure(RuntimeError(f"[gloo/transport/tcp/pair.cc:1] {text}")), text
    gone = os.pidfd_open(pids[1])  # readable once rank 1 has exited, its sockets closed
    select.select([gone], [], [])
    os.close(gone)
    try:
        dist.all_reduce(torch.ones(4))
    except RuntimeError as err:
        return _peer_failure(err), own
    return "the collective did not fail", own


@pytest.mark.slow
def test_a_dead_peer_gives_one_clear_line():
    message, own = run_distributed(survive_a_dead_peer, 2)[0]
    assert message is not None and message.startswith("rank 0 lost contact with the other ranks")
    assert "\n" not in message
    assert own == [None, None]
