"""When a run writes a checkpoint: every ``checkpoint.every`` steps, at the last step, and once
``checkpoint.every_seconds`` have passed since the last save (timed saves)."""

from __future__ import annotations

import time

import torch

from meshtron.parallel.mesh.groups import ParallelMesh
from meshtron.training.observers import Observer, StepReport


class SaveSchedule(Observer):
    """Decides each step's :attr:`~StepReport.save` once its row is complete. The clock of a
    timed save is rank 0's (one tiny broadcast a step, asked only when no other rule saves),
    so every rank saves at the same step."""

    def __init__(self, every: int, every_seconds: float, mesh: ParallelMesh):
        self.every, self.every_seconds, self.mesh = every, every_seconds, mesh
        self.last_save = time.monotonic()

    def on_row(self, report: StepReport) -> None:
        report.save = (report.save or bool(self.every and report.step % self.every == 0)
                       or report.last or self._time_to_save())

    def on_save(self, report: StepReport) -> None:
        self.last_save = time.monotonic()

    def _time_to_save(self) -> bool:
        if self.every_seconds <= 0:
            return False
        due = torch.tensor([float(time.monotonic() - self.last_save >= self.every_seconds)])
        if self.mesh.world.pg is not None:
            torch.distributed.broadcast(due, src=0, group=self.mesh.world.pg)
        return bool(due.item())
