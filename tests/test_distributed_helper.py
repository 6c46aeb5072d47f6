"""tests/distributed.py's workers: forked from a fork server that imported torch once, they
must still run as spawned ones did: in the test's environment and working directory of the
moment (not the server's from when it started), one thread each, and a rank that raises is
reported with its traceback."""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_distributed


def _what_a_rank_sees(rank: int, world_size: int) -> tuple:
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return os.environ.get("MESHTRON_HELPER_PROBE"), os.getcwd(), torch.get_num_threads(), \
        total.item()


def _rank_one_raises(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("planted by the test")
    return rank


def test_workers_run_in_the_tests_environment_and_directory(monkeypatch, tmp_path):
    run_distributed(_what_a_rank_sees, 2)  # the fork server is running from here on
    monkeypatch.setenv("MESHTRON_HELPER_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    expected = ("set after the server started", str(tmp_path), 1, 3.0)
    assert run_distributed(_what_a_rank_sees, 2) == [expected, expected]


def test_a_rank_that_raises_fails_the_call_with_its_traceback():
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed:\n(.|\n)*ValueError: planted"):
        run_distributed(_rank_one_raises, 2)
