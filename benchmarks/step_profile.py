"""Where one training step's time goes, by kind of work, from ``torch.profiler``.

``benchmarks/gpu.py --profile`` profiles one extra step of each mode after its timed steps:
on a GPU the kernels' device time, on a CPU the operators' self time (neither counts a child
twice). Each kernel or operator is put in one category by its name: matrix products (GEMMs,
FP8's scaled products included), attention, the optimizer, casts and copies (FP8's
quantisation among them), communication, and everything else (elementwise work, norms, the
loss). The answer says which part of the step a faster GEMM can shrink. The step's own
ranges (``meshtron.training.step.PHASES``: forward and backward, the reduction and grad norm,
the optimizer) give its time by phase as well, each range with everything inside it.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from meshtron.training.step import PHASES

CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient_attn", re.I)),
    ("gemm", re.compile(r"gemm|scaled_mm|\bmm\b|aten::mm|addmm|bmm|matmul|cutlass|xmma|"
                        r"sm\d+_|cublas|triton_tem", re.I)),
    ("optimizer", re.compile(r"adam|foreach|multi_tensor", re.I)),
    ("communication", re.compile(r"nccl|gloo|all_reduce|all_gather|reduce_scatter", re.I)),
    ("cast/copy", re.compile(r"copy|cast|convert|to_copy|float8|fp8|e4m3|e5m2|amax|clamp",
                             re.I)),
)
TOP = 12


def category(name: str) -> str:
    """The first category whose pattern the kernel or operator name matches, else "other"."""
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def profile_step(step: Callable[[], Any], device: torch.device,
                 synchronize: Callable[[], None]) -> dict[str, Any]:
    """Run ``step`` once under the profiler: seconds per category, their shares, and the
    ``TOP`` kernels (GPU) or operators (CPU) by time."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize()
    with profile(activities=activities) as prof:
        step()
        synchronize()
    rows: list[tuple[str, float, int]] = []
    events = prof.key_averages()
    phases = {e.key.removeprefix("meshtron."): (e.device_time_total if cuda else e.cpu_time_total)
              / 1e6 for e in events if e.key in PHASES}
    for event in events:
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue  # CPU-side operators: their kernels are listed on their own
            micros = event.self_device_time_total
        else:
            micros = event.self_cpu_time_total
        if micros > 0:
            rows.append((event.key, micros / 1e6, event.count))
    total = sum(seconds for _, seconds, _ in rows) or 1.0
    by_category: dict[str, float] = {}
    for name, seconds, _ in rows:
        by_category[category(name)] = by_category.get(category(name), 0.0) + seconds
    rows.sort(key=lambda row: -row[1])
    return {
        "basis": "kernel device time" if cuda else "operator self CPU time",
        "total_s": round(total, 6),
        "seconds": {k: round(v, 6) for k, v in sorted(by_category.items())},
        "shares": {k: round(v / total, 4) for k, v in sorted(by_category.items())},
        "phases_s": {k: round(v, 6) for k, v in phases.items()},
        "top": [{"name": name[:120], "s": round(seconds, 6), "calls": calls,
                 "category": category(name)} for name, seconds, calls in rows[:TOP]],
    }


def gemm_rates(step: Callable[[], Any]) -> list[dict[str, Any]]:
    """Each matrix-product shape of one CPU ``step``: calls, seconds and GFLOP/s (2·m·k·n per
    ``aten::mm``/``addmm``), slowest total first. Set against :func:`peak_gemm_gflops`, it says
    how much of the step a faster implementation of the same products could still save."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key not in ("aten::mm", "aten::addmm"):
            continue
        shapes = [s for s in event.input_shapes if len(s) == 2]
        if len(shapes) < 2 or event.self_cpu_time_total <= 0:
            continue
        (m, k), (_, n) = shapes[-2], shapes[-1]
        seconds = event.self_cpu_time_total / 1e6
        rows.append({"shape": f"[{m}x{k}] @ [{k}x{n}]", "calls": event.count,
                     "s": round(seconds, 6),
                     "gflops": round(2 * m * k * n * event.count / seconds / 1e9, 1)})
    return sorted(rows, key=lambda row: -row["s"])


def peak_gemm_gflops(size: int = 2048, repeats: int = 5) -> float:
    """This process's fp32 matrix-product rate on a large square product (median of
    ``repeats``): the ceiling the step's products are measured against."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        a @ b
        times.append(time.thread_time() - start)
    return 2 * size**3 / statistics.median(times) / 1e9
