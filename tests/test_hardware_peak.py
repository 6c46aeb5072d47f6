"""A CPU's peak FLOP/s for MFU: measured once per machine and thread count, kept in the cache,
read by every later run and by every rank of a job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from meshtron.training import hardware
from tests.distributed import run_distributed


@pytest.fixture
def probes(monkeypatch) -> list[int]:
    """The thread counts the (replaced) probe was run at, in order."""
    seen: list[int] = []

    def probe() -> float:
        seen.append(torch.get_num_threads())
        return 1.5e11 * len(seen)

    monkeypatch.setattr(hardware, "measure_matmul_flops", probe)
    hardware._measured_cpu_peak.cache_clear()
    yield seen
    hardware._measured_cpu_peak.cache_clear()


def test_the_probe_runs_once_and_later_runs_read_its_figure(probes, tmp_path):
    cpu = torch.device("cpu")
    first, source = hardware.peak_source(cpu, None, str(tmp_path))
    hardware._measured_cpu_peak.cache_clear()  # a later process
    again, source_again = hardware.peak_source(cpu, None, str(tmp_path))
    assert first == again == 1.5e11 and len(probes) == 1
    [path] = tmp_path.glob("hardware/*/peak.json")
    assert json.loads(path.read_text())["flops"] == first
    assert str(path) in source == source_again and "delete it to measure again" in source
    threads = torch.get_num_threads()
    try:  # another thread count is another figure, measured and kept beside the first
        torch.set_num_threads(1 if threads > 1 else 2)
        assert hardware.peak_source(cpu, None, str(tmp_path))[0] == 3.0e11
    finally:
        torch.set_num_threads(threads)
    assert len(list(tmp_path.glob("hardware/*/peak.json"))) == 2


def test_a_damaged_kept_figure_is_measured_and_written_again(probes, tmp_path):
    cpu = torch.device("cpu")
    hardware.peak_source(cpu, None, str(tmp_path))
    [path] = tmp_path.glob("hardware/*/peak.json")
    path.write_text('{"flops": ')  # cut short
    hardware._measured_cpu_peak.cache_clear()
    assert hardware.peak_source(cpu, None, str(tmp_path))[0] == 3.0e11 and len(probes) == 2
    assert json.loads(path.read_text())["flops"] == 3.0e11


def test_a_configured_peak_or_no_cache_measures_nothing_kept(probes, tmp_path):
    cpu = torch.device("cpu")
    assert hardware.peak_source(cpu, 2e12, str(tmp_path)) == (2e12, "train.peak_flops")
    assert not probes and not (tmp_path / "hardware").exists()
    flops, source = hardware.peak_source(cpu, None, None)
    assert flops == 1.5e11 and "measured at start-up" in source


def test_a_cache_that_cannot_be_written_falls_back_to_this_process(probes, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    flops, source = hardware.peak_source(torch.device("cpu"), None, str(blocked))
    assert flops == 1.5e11 and "measured at start-up" in source and len(probes) == 1


def _rank_reads_the_peak(rank: int, world_size: int, cache_dir: str, log: str) -> float:
    def probe() -> float:  # each measurement leaves a line: the ranks must leave one in all
        with open(log, "a") as f:
            f.write(f"{rank}\n")
        return 4.0e11

    hardware.measure_matmul_flops = probe  # this rank's process only
    return hardware.peak_source(torch.device("cpu"), None, cache_dir)[0]


@pytest.mark.slow  # a process group
def test_the_ranks_of_a_job_measure_once(tmp_path):
    log = tmp_path / "probes.txt"
    peaks = run_distributed(_rank_reads_the_peak, 3, str(tmp_path / "cache"), str(log))
    assert peaks == [4.0e11] * 3
    assert len(Path(log).read_text().splitlines()) == 1
