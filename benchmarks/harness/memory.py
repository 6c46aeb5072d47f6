"""Memory: a process's resident set and its high-water mark from ``/proc``, an allocator setting
under which the high-water mark follows live memory, and the exact activation memory of a step.

``getrusage(RUSAGE_SELF).ru_maxrss`` is no substitute for ``VmHWM`` in a spawned child: Linux
carries the pre-``exec`` maximum over, so it starts from the parent's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtron.tune.calibrate_command import EXACT_HEAP

EXACT_ALLOCATOR = EXACT_HEAP
"""Give it to ``spawn(..., env=EXACT_ALLOCATOR)``: glibc reads it when the process starts."""


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


def _storage(t: Any) -> tuple[int, int]:
    """(address, bytes) of the storage behind tensor ``t``, through DTensor and
    pending-collective wrappers."""
    while hasattr(t, "_local_tensor") or hasattr(t, "elem"):  # DTensor, AsyncCollectiveTensor
        t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_activation_bytes(model: Any, step: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one ``step()`` of
    ``model`` (its weights excluded): the activation memory, free of allocator noise."""
    import torch  # here: importing the harness does not load torch

    weights = {_storage(p)[0] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr not in weights:
            saved[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(saved.values())
