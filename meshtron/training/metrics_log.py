"""The step rows a user reads: ``metrics.jsonl`` / TensorBoard / W&B (rank 0's
:class:`~meshtron.training.metrics.MetricsWriter`), the console line every
``train.log_every`` steps, and the live progress bar."""

from __future__ import annotations

import resource
from collections.abc import Callable

import torch

from meshtron.training.metrics import MetricsWriter, format_row
from meshtron.training.observers import Observer, StepReport
from meshtron.training.progress import ProgressBar


def peak_memory_bytes(device: torch.device) -> int:
    """The process's peak memory: the CUDA allocator's, or the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLog(Observer):
    """Writes and prints the rows of logged steps (every ``log_every``, the last, and every
    evaluation); ``compiled``: the first step's time (``train.compile``) is said."""

    def __init__(self, writer: MetricsWriter | None, log: Callable[[str], None],
                 progress: ProgressBar, steps: int, log_every: int, compiled: bool):
        self.writer, self.log, self.progress = writer, log, progress
        self.steps, self.log_every = steps, log_every
        self.first = compiled

    def on_step(self, report: StepReport) -> None:
        if self.first:
            self.first = False
            self.log(f"train.compile: the first step took {report.elapsed_s:.1f} s, compile "
                     "included")

    def on_row(self, report: StepReport) -> None:
        row = report.row
        if self.writer and (report.step % self.log_every == 0 or report.last
                            or "val_loss" in row):
            self.writer.write(row)
            self.progress.clear()
            self.log(format_row(row, self.steps))
        self.progress.update(report.step, report.out.loss, row["tokens_per_s"])

    def close(self) -> None:
        self.progress.clear()
        if self.writer:
            self.writer.close()
