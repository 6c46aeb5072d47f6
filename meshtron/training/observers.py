"""What the training loop tells the rest of a run: the step/evaluation/save protocol.

:class:`~meshtron.training.trainer.Trainer.run` is the loop itself (step, evaluate, log,
save); everything a run does besides (straggler watch, online re-tuning, MoE and MTP
statistics, zb-v's measured order, evaluation samples, the metrics files and the console,
timed saves) is an :class:`Observer` of it, each in its own module. The loop calls, for every
step and on every rank, in the observers' order:

- ``on_step``: the optimizer step is done; observers add to the step's metrics row, warn,
  may change the rank's parts for the next step (:attr:`StepReport.rank`) or ask for a save;
- ``on_eval``: the validation loss of this step is known (evaluation steps only);
- ``on_row``: the step's row is complete (written, printed; the save decision is taken);
- ``on_save``: the checkpoint of this step is written (saving steps only).

Every rank calls the same observers in the same order at the same steps, so observers may
use collectives (the straggler gather, the MoE statistics); only rank 0 writes files.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from meshtron.rank import Rank
from meshtron.training.step import StepResult


@dataclass
class StepReport:
    """One optimizer step as the observers see it, filled in as the loop goes."""

    step: int
    """The step just taken (1-based: the number of optimizer steps done)."""
    out: StepResult
    lr: float
    elapsed_s: float
    rank: Rank
    """The rank's parts; an observer that re-plans (``train.autotune``) replaces them."""
    row: dict
    """The metrics row of this step (``metrics.jsonl``); observers add their figures."""
    last: bool
    """The run's last step (``train.steps``)."""
    evaluate: bool = False
    """A validation runs at this step (``train.eval_every``, and the last step)."""
    val_loss: float | None = None
    save: bool = False
    """A checkpoint is written at this step (``checkpoint.every``, timed, or asked for)."""
    checkpoint: Path | None = None
    restart: Path | None = None
    """The run stops here to restart into a new layout (this file holds it)."""


class Observer:
    """A part of a run that follows the loop; every hook is optional."""

    def on_step(self, report: StepReport) -> None:
        """After the optimizer step."""

    def on_eval(self, report: StepReport) -> None:
        """After the validation of an evaluation step."""

    def on_row(self, report: StepReport) -> None:
        """The step's metrics row is complete."""

    def on_save(self, report: StepReport) -> None:
        """After the checkpoint of a saving step."""

    def close(self) -> None:
        """The run ends (normally or not): release files, clear the console."""


class Observers:
    """The run's observers, called in order."""

    def __init__(self, observers: list[Observer]):
        self.observers = observers

    def on_step(self, report: StepReport) -> None:
        for observer in self.observers:
            observer.on_step(report)

    def on_eval(self, report: StepReport) -> None:
        for observer in self.observers:
            observer.on_eval(report)

    def on_row(self, report: StepReport) -> None:
        for observer in self.observers:
            observer.on_row(report)

    def on_save(self, report: StepReport) -> None:
        for observer in self.observers:
            observer.on_save(report)

    def close(self) -> None:
        """Close every observer, even when one fails (the first error is raised)."""
        with contextlib.ExitStack() as stack:
            for observer in reversed(self.observers):
                stack.callback(observer.close)
