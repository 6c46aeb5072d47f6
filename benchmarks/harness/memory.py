"""A process's own memory from ``/proc``: resident set, its high-water mark, and an allocator
setting under which the high-water mark follows live memory.

``getrusage(RUSAGE_SELF).ru_maxrss`` is no substitute for ``VmHWM`` in a spawned child: Linux
carries the pre-``exec`` maximum over, so it starts from the parent's peak.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

EXACT_ALLOCATOR = MappingProxyType({"MALLOC_MMAP_THRESHOLD_": "65536"})
"""glibc: every allocation of 64 KiB or more is its own mapping, unmapped when freed (a fixed
threshold also stops glibc from raising it), so RSS follows the live tensors instead of the heap
glibc retains (with the default dynamic threshold, freed buffers below 32 MiB stay in the heap).
Give it to ``spawn(..., env=EXACT_ALLOCATOR)``: glibc reads it when the process starts."""


def vm_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (the peak RSS) of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> bool:
    """Set ``VmHWM`` back to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
