"""``meshtron tune --calibrate``: the measured profile loads back and holds what the cost model
reads; the curve and fit helpers give exact answers on exact data. No assertion on speed."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.costmodel.candidate import Candidate
from meshtron.costmodel.memory_model import MemoryEstimate
from meshtron.costmodel.priced import Estimate
from meshtron.costmodel.profiles import load_profile, save_profile
from meshtron.errors import MeshtronError
from meshtron.tune import calibrate, calibrate_command, copy_probe
from meshtron.tune.trials import Measurement, Trial

_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def test_quick_process_profile_loads_back_with_a_rising_curve(tmp_path):
    threads = torch.get_num_threads()
    profile = calibrate.measure_process(quick=True, device=torch.device("cpu"))
    assert torch.get_num_threads() == threads  # the one-thread measurement restores the count
    loaded = load_profile(str(save_profile(profile, tmp_path / "profile.json")))
    assert loaded == profile
    assert loaded.source.startswith("calibrated on ") and "1 rank, torch " in loaded.source
    assert set(loaded.peak_flops) == {"fp32", "bf16"} and loaded.peak("fp32") > 0
    flops = [f for f, _ in loaded.gemm_efficiency]
    fractions = [e for _, e in loaded.gemm_efficiency]
    assert len(flops) >= 3 and flops == sorted(set(flops))
    assert fractions == sorted(fractions) and fractions[0] > 0 and fractions[-1] == 1.0
    assert loaded.compute_units == os.cpu_count() and loaded.thread_speedup >= 1.0
    assert 0 < loaded.attention_efficiency <= 1 and loaded.memory_reserved_bytes > 0
    assert loaded.memory_bandwidth > 0 and loaded.collectives == {}
    assert loaded.gpus_per_node == calibrate.CPU_GPUS_PER_NODE and loaded.step_overhead_s == 0


def test_efficiency_curve_keeps_the_median_per_quarter_decade_and_never_falls():
    rates = [(1e6, 10.0), (1.1e6, 30.0), (1e8, 80.0), (1e9, 60.0), (1e10, 100.0)]
    assert calibrate.efficiency_curve(rates, peak=100.0) == (
        (1e6, 0.2), (1e8, 0.8), (1e9, 0.8), (1e10, 1.0))


def test_fit_line_recovers_a_line_and_clips_at_zero():
    sizes = (4096, 65536, 1 << 20, 8 << 20)
    a, b = calibrate.fit_line([(x, 2e-4 + 1e-9 * x) for x in sizes])
    assert math.isclose(a, 2e-4, rel_tol=1e-9) and math.isclose(b, 1e-9, rel_tol=1e-9)
    a, b = calibrate.fit_line([(x, 1e-9 * x - 1e-6) for x in sizes])  # negative intercept
    assert a == 0 and b > 0
    a, b = calibrate.fit_line([(x, 5e-3 - 1e-10 * x) for x in sizes])  # falling: no slope
    assert b == 0 and a > 0


def test_group_sizes_link_and_forwarded_arguments():
    assert calibrate.group_sizes(1) == [] and calibrate.group_sizes(2) == [2]
    assert calibrate.group_sizes(6) == [2, 4, 6] and calibrate.group_sizes(8) == [2, 4, 8]
    link = calibrate.ring_link((6e-4, 1e-9), 4)  # 2(n-1) = 6 steps, 6/4 of the buffer moved
    assert math.isclose(link.latency, 1e-4) and math.isclose(link.bandwidth, 1.5e9)
    assert calibrate.ring_link((1e-4, 0.0), 2) is None
    out = Path("p.json")
    assert calibrate_command.forwarded(out, True) == [
        "--calibrate", f"--output={out.resolve()}", "--quick", "--no-probe"]


@pytest.mark.parametrize("nproc, name, fragment", [
    (0, "p.json", "--nproc must be at least 1, got 0"),
    (2, "missing/p.json", "does not exist"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, nproc, name, fragment):
    output = tmp_path / name
    with pytest.raises(MeshtronError) as err:
        calibrate_command.run_calibrate(nproc, output, quick=True)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert not output.exists()


def test_two_ranks_fit_every_collective(tmp_path):
    """The command as a user runs it: it launches two ranks of itself."""
    output = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("SLURM_")}
    proc = subprocess.run(
        [sys.executable, "-m", "meshtron", "tune", "--calibrate", "--nproc", "2", "--output",
         str(output), "--quick"],
        cwd=tmp_path, env={**env, "GLOO_SOCKET_IFNAME": "lo"}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("calibrated on ") == 1 and "2 ranks" in proc.stdout
    raw = json.loads(output.read_text())
    assert set(raw["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter",
                                       "all_to_all", "send_recv"}
    a, b = raw["collectives"]["all_reduce"]["2"]
    assert a >= 0 and b > 0
    profile = load_profile(str(output))
    assert math.isclose(profile.intra_node.bandwidth, 1 / b) and profile.inter_node == \
        profile.intra_node
    # the probe trained on 1 and 2 ranks and priced what the kernels miss
    assert "probes on 1 rank" in proc.stdout and "probe on 2 ranks:" in proc.stdout
    assert profile.compute_correction != 1.0 and profile.memory_reserved_bytes > 0
    assert profile.memory_reserved_per_rank_bytes >= 0
    # gloo copies a queued reduce-scatter's whole input (NCCL would not): a measured 1.0
    assert 0.5 < profile.reduce_scatter_copy < 1.5
    assert profile.memory_step_slack >= 0 and "the heap keeps" in proc.stdout
    assert 1.0 <= profile.thread_speedup <= os.cpu_count()
    assert profile.time_correction == profile.memory_correction == 1.0  # trial feedback only


def test_the_probe_fit_prices_what_the_kernels_miss():
    """One rank: (measured - optimizer - overhead) / compute (over two probes, the slope
    through the origin), and the smaller probe's peak beyond the model;
    the N-rank probe's extra, per further rank."""
    profile = load_profile("h100-sxm")
    memory = MemoryEstimate(100.0, 100.0, 0.0, 200.0, 50.0, 50.0, reserved=1000.0)
    one = Trial(Estimate(Candidate(1, 1, 1, 1, "1f1b", 1, None, 1, 0, False, 4, "none"),
                         1.0, 0, 0, 0, memory, True, "compute",
                         {"compute": 0.8, "optimizer": 0.1, "overhead": 0.1}), Path("."),
                Measurement(1.4, 1800))
    many = dataclasses.replace(one, measured=Measurement(1.5, 2000))
    Probes = calibrate_command.Probes
    fit = calibrate_command.fitted(profile, Probes([one], many=many), nproc=3)
    assert fit.compute_correction == pytest.approx(1.5)  # (1.4 - 0.2) / 0.8
    # a second, four times larger probe: the slope through the origin over both points
    big = dataclasses.replace(one, estimate=dataclasses.replace(
        one.estimate, breakdown={"compute": 3.2, "optimizer": 0.1, "overhead": 0.1}),
        measured=Measurement(4.0, 2500))
    slope = (0.8 * 1.2 + 3.2 * 3.8) / (0.8**2 + 3.2**2)
    fit = calibrate_command.fitted(profile, Probes([one, big], many=many), nproc=3)
    assert fit.compute_correction == pytest.approx(round(slope, 4))
    assert fit.memory_reserved_bytes == 1800 - 500
    assert fit.memory_reserved_per_rank_bytes == (2000 - 500 - 1300) // 2
    assert (fit.time_correction, fit.memory_correction) == (1.0, 1.0)
    assert fit.thread_speedup == profile.thread_speedup  # a GPU profile: no thread probes


def test_on_a_cpu_the_one_thread_probes_fit_the_correction_and_the_threads_gain():
    """The correction comes from the one-thread probes (as every CPU rank of a layout
    computes); a process's gain from its cores is the larger probe's compute on one thread
    over the same on all of them, between 1 and the cores."""
    cores = dataclasses.replace(load_profile("h100-sxm"), compute_units=2, thread_speedup=2.1)
    memory = MemoryEstimate(100.0, 100.0, 0.0, 200.0, 50.0, 50.0, reserved=1000.0)
    est = Estimate(Candidate(1, 1, 1, 1, "1f1b", 1, None, 1, 0, False, 4, "none"),
                   1.0, 0, 0, 0, memory, True, "compute",
                   {"compute": 1.0, "optimizer": 0.1, "overhead": 0.1})
    threaded = Trial(est, Path("."), Measurement(1.0, 1800))  # 0.8 s of compute
    single = Trial(est, Path("."), Measurement(1.6, 1700))  # 1.4 s of compute
    fit = calibrate_command.fitted(cores, calibrate_command.Probes([threaded], [single]), 1)
    assert fit.compute_correction == pytest.approx(1.4)
    assert fit.thread_speedup == pytest.approx(1.75)  # 1.4 / 0.8
    slow = Trial(est, Path("."), Measurement(9.0, 1700))
    fit = calibrate_command.fitted(cores, calibrate_command.Probes([threaded], [slow]), 1)
    assert fit.thread_speedup == 2.0  # never more than the cores


def test_the_heap_slack_is_the_default_heaps_excess_per_byte_of_step_buffers():
    """The larger probe run twice: the default heap's extra peak over the exact heap's, per
    byte of the step's buffers; the reserved bytes are then what the model with that slack
    leaves of the smaller probe's peak."""
    profile = load_profile("h100-sxm")
    memory = MemoryEstimate(100.0, 100.0, 0.0, 200.0, 50.0, 50.0, reserved=1000.0)
    estimate = Estimate(Candidate(1, 1, 1, 1, "1f1b", 1, None, 1, 0, False, 4, "none"),
                        1.0, 0, 0, 0, memory, True, "compute",
                        {"compute": 0.8, "optimizer": 0.1, "overhead": 0.1})
    one = Trial(estimate, Path("."), Measurement(1.0, 1800))
    exact = dataclasses.replace(one, measured=Measurement(1.2, 1700))
    Probes = calibrate_command.Probes
    fit = calibrate_command.fitted(profile, Probes([one], exact=exact), nproc=1)
    assert fit.memory_step_slack == pytest.approx(1.0)  # (1800 - 1700) / (50 + 50)
    assert fit.memory_reserved_bytes == 1800 - (400 + 2 * 100)
    assert calibrate_command.fitted(profile, Probes([one]), nproc=1).memory_step_slack == 0.0


def test_a_launch_leaves_this_process_on_every_thread(monkeypatch):
    """torchrun's argument handling sets OMP_NUM_THREADS=1 in the launching process; after a
    launch the calibration's one-process probe (and a tuning trial) must not inherit it."""
    from torch.distributed import run as torchrun

    from meshtron.parallel.mesh.launch import launcher_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    args = torchrun.parse_args(["--nproc-per-node=2", "--module", "meshtron", "train"])
    with launcher_environment():
        torchrun.config_from_args(args)
        assert os.environ.get("OMP_NUM_THREADS") == "1"  # what the ranks get
    assert "OMP_NUM_THREADS" not in os.environ


def _copy_probe_on_a_heap_that_keeps_what_it_frees(rank: int, world_size: int) -> float:
    """The reduce-scatter copy probe after 96 MiB were freed into a heap that keeps them
    resident (glibc told to map nothing and trim nothing): the state in which the probe, which
    watched the resident peak on glibc's default heap, read 0.0 on every try."""
    import ctypes

    libc = ctypes.CDLL(None)
    assert libc.mallopt(-4, 0) == 1 and libc.mallopt(-1, 2**40) == 1  # M_MMAP_MAX, M_TRIM_...
    freed = torch.ones(96 * 2**20 // 4)  # resident in the heap from now on
    del freed
    return copy_probe.reduce_scatter_copy(world_size, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt, /proc")
def test_the_copy_probe_does_not_reuse_memory_the_process_freed():
    """gloo copies a queued reduce-scatter's whole input: the probe reads it as 1.0 whatever
    the process freed before (it hands freed pages back to the kernel first), deterministic
    where it was once 0.0 in a clean CI run."""
    from tests.distributed import run_distributed

    for copy in run_distributed(_copy_probe_on_a_heap_that_keeps_what_it_frees, 2):
        assert 0.5 < copy < 1.5, copy
