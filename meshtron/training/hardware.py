"""Peak FLOP/s of the device, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

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


def measure_matmul_flops(size: int = 1024, repeats: int = 5,
                         dtype: torch.dtype = torch.float32) -> float:
    """Best achieved FLOP/s of a square matmul on the CPU with the current thread count."""
    generator = torch.Generator().manual_seed(0)  # never disturb the training run's RNG
    a = torch.randn(size, size, dtype=dtype, generator=generator)
    b = torch.randn(size, size, dtype=dtype, generator=generator)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device, configured: float | None) -> float:
    """The configured figure, else the GPU's data-sheet peak, else a measured CPU matmul rate."""
    if configured:
        return configured
    if device.type == "cuda":
        found = gpu_peak_flops(torch.cuda.get_device_name(device))
        if found:
            return found
    return measure_matmul_flops()
