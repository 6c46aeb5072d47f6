"""Straggler detection: every rank's compute time, gathered every few steps, set against the
median of the other ranks.

In a synchronous job the slowest rank sets everyone's step time, so step times alone do not
say who is slow: each rank measures its own compute (forward and backward up to the wait for
the gradient reduction, see :class:`~meshtron.training.step.StepResult`), and every
``run.straggler_every`` steps the window's means are gathered (one small all-gather). A rank
above ``run.straggler_factor`` times the median of the others is named (the others', so that
on two ranks a slow one is not half of its own yardstick). Inside tensor- or pipeline-parallel
groups a rank's compute includes waits for its peers, which blurs who is slow among them.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.training.metrics import MetricsWriter
from meshtron.training.observers import Observer, StepReport


@dataclass(frozen=True)
class Straggler:
    rank: int
    compute_s: float
    median_s: float

    def line(self, step: int) -> str:
        return (f"straggler: rank {self.rank} computed {self.compute_s:.3f} s per step over the "
                f"last steps up to step {step}, {self.compute_s / self.median_s:.2f}x the "
                f"other ranks' median of {self.median_s:.3f} s")

    def row(self, step: int) -> dict:
        return {"event": "straggler", "step": step, "rank": self.rank,
                "compute_s": self.compute_s, "median_s": self.median_s}


class StragglerWatch:
    def __init__(self, mesh: ParallelMesh, every: int, factor: float,
                 device: torch.device | None = None):
        self.mesh = mesh
        self.device = device
        self.every = every
        self.factor = factor
        self.window: list[float] = []

    def add(self, step: int, compute_s: float) -> list[Straggler]:
        """Record this step's compute time; on a window boundary (every rank reaches it at the
        same step), gather and return the stragglers (empty on one process)."""
        if self.every <= 0 or self.mesh.world.pg is None:
            return []
        self.window.append(compute_s)
        if step % self.every:
            return []
        mine = torch.tensor([sum(self.window) / len(self.window)], dtype=torch.float64,
                            device=self.device)
        self.window.clear()
        gathered = torch.zeros(self.mesh.layout.world_size, dtype=torch.float64,
                               device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, mine, group=self.mesh.world.pg)  # uncounted: not model traffic
        times = gathered.tolist()
        stragglers = []
        for rank, t in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:])
            if others > 0 and t > self.factor * others:
                stragglers.append(Straggler(rank, t, others))
        return stragglers


class Stragglers(Observer):
    """``run.straggler_every``: names the stragglers of each window as a warning and as a
    ``straggler`` event in ``metrics.jsonl``."""

    def __init__(self, watch: StragglerWatch, warn: Callable[[str], None],
                 writer: MetricsWriter | None):
        self.watch, self.warn, self.writer = watch, warn, writer

    def on_step(self, report: StepReport) -> None:
        for straggler in self.watch.add(report.step, report.out.compute_s):
            self.warn(straggler.line(report.step))
            if self.writer:
                self.writer.write_event(straggler.row(report.step))
