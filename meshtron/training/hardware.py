"""Peak FLOP/s of the device, for model FLOPs utilisation (MFU).

A GPU's is its data sheet's; a CPU's is measured, once per machine: the probe's result is kept
in ``data.cache_dir`` under a key of the CPU's name, its core count, the thread count and the
torch version, so every later run there (and every rank of a job, which wait on the entry's
lock while the first measures alone) reads the same figure: MFU compares across runs, and a
4-rank job on a laptop does not spend four probes (~1 CPU-s each) before its first step.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import platform
import time
from pathlib import Path

import torch

from meshtron.data import cache
from meshtron.errors import MeshtronError

# Dense bf16/fp16 tensor-core peaks (FLOP/s) from the vendors' data sheets.
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
}


def gpu_peak_flops(name: str) -> float | None:
    for key in sorted(GPU_PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return GPU_PEAK_FLOPS[key]
    return None


def measure_matmul_flops(sizes: tuple[int, ...] = (1024, 2048), repeats: int = 3,
                         dtype: torch.dtype = torch.float32) -> float:
    """Best achieved FLOP/s of square matmuls on the CPU with the current thread count.

    The best over sizes and repeats: a 1024^3 product alone reads low (up to ~40% below a
    2048^3 one on this 2-core machine), and a peak that reads low makes MFU exceed 100%."""
    generator = torch.Generator().manual_seed(0)  # never disturb the training run's RNG
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, dtype=dtype, generator=generator)
        b = torch.randn(size, size, dtype=dtype, generator=generator)
        torch.mm(a, b)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2.0 * size**3 / (time.perf_counter() - t0))
    return best


PROBE_VERSION = 1
"""Part of the cached figure's key: a change to :func:`measure_matmul_flops` measures again."""


def peak_flops(device: torch.device, configured: float | None,
               cache_dir: str | None = None) -> float:
    """The configured figure, else the GPU's data-sheet peak, else a measured CPU matmul rate."""
    return peak_source(device, configured, cache_dir)[0]


def peak_source(device: torch.device, configured: float | None,
                cache_dir: str | None = None) -> tuple[float, str]:
    """:func:`peak_flops` and where it comes from, for the start-up line; a CPU's measured
    figure is kept in ``cache_dir`` (None: measured in this process only)."""
    if configured:
        return configured, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peak_flops(name)
        if found:
            return found, f"the {name} data sheet's dense bf16 peak"
    threads = torch.get_num_threads()
    note = ("it reads low when other processes share the cores, so set train.peak_flops for a "
            "stable MFU")
    if cache_dir is not None:
        kept = cached_cpu_peak(cache_dir, threads)
        if kept is not None:
            flops, path, day = kept
            return flops, (f"an fp32 matmul measured on {threads} threads on {day}, kept at "
                           f"{path} (delete it to measure again); {note}")
    return (_measured_cpu_peak(threads),
            f"an fp32 matmul measured at start-up on {threads} threads; {note}")


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "an unknown CPU"


def cached_cpu_peak(cache_dir: str, threads: int) -> tuple[float, Path, str] | None:
    """(FLOP/s, its file, the day it was measured) for this machine and thread count,
    measured now if the cache holds none; None where the cache cannot be written (the
    caller measures in this process)."""
    key = cache.content_key("matmul-peak", str(PROBE_VERSION), cpu_name(), str(os.cpu_count()),
                            str(threads), torch.__version__)
    entry = cache.entry_dir(os.path.expanduser(cache_dir), "hardware", key)
    path = entry / "peak.json"
    try:
        with cache.locked(entry):
            kept = _read_kept(path)
            if kept is not None:
                return kept[0], path, kept[1]
            flops, day = _measured_cpu_peak(threads), datetime.date.today().isoformat()
            cache.atomic_write_bytes(path, json.dumps({
                "flops": flops, "measured": day, "cpu": cpu_name(), "threads": threads,
                "torch": torch.__version__}).encode())
            return flops, path, day
    except (OSError, MeshtronError):
        return None


def _read_kept(path: Path) -> tuple[float, str] | None:
    """(FLOP/s, the day measured) from a kept figure's file; None when there is none yet or it
    cannot be read (it is then measured and written again)."""
    try:
        kept = json.loads(path.read_text())
        return float(kept["flops"]), str(kept["measured"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@functools.cache
def _measured_cpu_peak(threads: int) -> float:
    """One probe per process and thread count (it takes about half a second)."""
    return measure_matmul_flops()
