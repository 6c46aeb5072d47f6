"""The calibration's copy probe: how many bytes the collective backend holds per byte of an
in-place reduce-scatter's input while it runs (gloo copies it; NCCL reduces in place), measured
as the growth of this process's resident peak on a heap that holds no freed pages. The cost
model's memory estimate reads it as ``ClusterProfile.reduce_scatter_copy``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.tune.calibrate import ELEMENT_BYTES

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

COPY_PROBE_BYTES = 32 * 2**20
"""The buffer whose reduce-scatter shows how much the backend copies: far above the
allocator's page granularity, small enough for any machine."""
COPY_PROBE_TRIES = 3
"""Tries of the probe where the C library cannot be told to return freed memory (not glibc):
the largest growth is kept, as freed memory left in the heap can make room for one try's
copy."""

EXACT_MMAP_THRESHOLD = 65536
"""glibc's mmap threshold for the probe (``M_MMAP_THRESHOLD``, as the calibration's exact
heap sets it for its probe runs): every allocation of 64 KiB or more is mapped afresh."""

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (malloc.h)."""


def resident_peak_kib() -> int:
    """This process's resident peak (``VmHWM``), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise OSError("/proc/self/status has no VmHWM")


def exact_heap() -> Callable[[], object] | None:
    """Fix glibc's mmap threshold at :data:`EXACT_MMAP_THRESHOLD` for the rest of this process
    (glibc no longer raises it as it frees large buffers) and return ``malloc_trim(0)``, which
    hands every freed page of the heap back to the kernel; None where the C library has
    neither (not glibc).

    Why: memory the process freed earlier (a collective's buffers, a caller's tensors) stays
    resident in the heap, and a copy the allocator places there does not grow the resident
    peak: the probe then reads 0.0 on every try. Trimmed, any page the copy touches is a
    fresh one; with the threshold fixed, what is freed later is unmapped at once."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    if mallopt(M_MMAP_THRESHOLD, EXACT_MMAP_THRESHOLD) != 1:
        return None
    return functools.partial(trim, 0)


def reduce_scatter_copy(world: int, device: torch.device) -> float:
    """Bytes the backend holds per byte of an in-place reduce-scatter's input while it runs,
    over the whole world (every rank calls it): the growth of this process's resident peak,
    reset first (``/proc/self/clear_refs``), on a heap that holds no freed pages
    (:func:`exact_heap`; called last in a calibration rank, which then exits). 0 on a GPU
    (NCCL reduces in place) and where the kernel cannot reset the peak."""
    if device.type == "cuda" or world == 1:
        return 0.0
    trim = exact_heap()
    flat = torch.ones(COPY_PROBE_BYTES // ELEMENT_BYTES, device=device)
    chunk = flat.numel() // world
    mine = flat[dist.get_rank() * chunk:(dist.get_rank() + 1) * chunk]
    grown = 0.0
    for _ in range(1 if trim else COPY_PROBE_TRIES):
        dist.barrier()
        if trim:
            trim()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # the peak is now the current size
            before = resident_peak_kib()
        except OSError:
            return 0.0
        _reduce_scatter(mine, flat[:chunk * world], async_op=True).wait()
        grown = max(grown, (resident_peak_kib() - before) * 1024)
    return round(grown / flat.nbytes, 3)
