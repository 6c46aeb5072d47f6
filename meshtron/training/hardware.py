"""Peak FLOP/s of the device, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

import functools
import time

import torch

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


def peak_flops(device: torch.device, configured: float | None) -> float:
    """The configured figure, else the GPU's data-sheet peak, else a measured CPU matmul rate."""
    return peak_source(device, configured)[0]


def peak_source(device: torch.device, configured: float | None) -> tuple[float, str]:
    """:func:`peak_flops` and where it comes from, for the start-up line."""
    if configured:
        return configured, "train.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peak_flops(name)
        if found:
            return found, f"the {name} data sheet's dense bf16 peak"
    return (_measured_cpu_peak(torch.get_num_threads()),
            f"an fp32 matmul measured at start-up on {torch.get_num_threads()} threads; it reads "
            "low when other processes share the cores, so set train.peak_flops for a stable MFU")


@functools.cache
def _measured_cpu_peak(threads: int) -> float:
    """One probe per process and thread count (it takes about half a second)."""
    return measure_matmul_flops()
