"""``train.autotune`` as an observer of the loop: the online tuner sees every step's times and
memory; a new micro-batch size applies from the next step (the rank re-planned, a pipeline
with the schedule of its new micro-batch count); a chosen layout is written after a checkpoint
of the step, and the run stops to restart into it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshtron.training.autotune import LAYOUT_FILE, OnlineTuner, describe, write_chosen_layout
from meshtron.training.metrics import MetricsWriter
from meshtron.training.observers import Observer, StepReport


class Retune(Observer):
    """The window's decisions are logged and written as ``retune`` events (rank 0)."""

    def __init__(self, tuner: OnlineTuner, run_dir: Path, log: Callable[[str], None],
                 writer: MetricsWriter | None, writes: bool):
        self.tuner, self.run_dir, self.log, self.writer = tuner, run_dir, log, writer
        self.writes = writes

    def on_step(self, report: StepReport) -> None:
        out = report.out
        for event in self.tuner.after_step(report.step, report.elapsed_s, out.compute_s,
                                           report.row["mem_peak_bytes"]):
            self.log(describe(event))
            if self.writer:
                self.writer.write_event(event)
        plan = self.tuner.plan
        if plan.micro_batch != report.rank.micro_batch:
            report.rank = report.rank.replanned(plan)
        if self.tuner.retuner.restart is not None:
            report.save = True  # the new layout resumes from this step

    def on_save(self, report: StepReport) -> None:
        if self.tuner.retuner.restart is None:
            return
        if self.writes:
            write_chosen_layout(self.run_dir, report.step, self.tuner.retuner.restart)
        report.restart = self.run_dir / LAYOUT_FILE
