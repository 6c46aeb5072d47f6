"""One hpsearch trial: a ``meshtron train`` process watched while it trains.

A trial is a separate process (the same code path a user runs, and a crash or a hang of one
trial cannot take the search down). While it runs, its ``metrics.jsonl`` is read as it grows;
at each whole unit of the token budget (steps of the config's batch) the mean of the latest
training losses is reported to Optuna, and when the pruner says the trial is behind, its
process group is killed then and there: a pruned trial costs only the steps it ran. A finished
trial is scored by its final validation loss, which every trial measures on the same
sequences (the training loss of one batch is too noisy to rank short runs by).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshtron.tune.trials import last_line, stop, trial_environment

POLL_S = 0.2
"""How often a running trial's metrics are read."""
WINDOW = 3
"""Training losses averaged into one intermediate value (one batch's loss is noisy)."""


@dataclass(frozen=True)
class Outcome:
    """How a trial ended: ``complete`` (scored by ``loss``, the final validation loss),
    ``pruned`` (``loss`` is the last value reported) or ``failed`` (``error`` says why)."""

    status: str
    loss: float | None
    steps: int
    """Optimizer steps the run completed."""
    error: str | None = None


class MetricsTail:
    """The rows appended to a ``metrics.jsonl`` since the last read (whole lines only: the
    trainer may be half-way through writing one)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        rows = []
        for line in data[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "event" not in row and isinstance(row.get("step"), int):
                rows.append(row)
        return rows


class Reporter:
    """Feeds a trial's losses to Optuna at whole budget units; says when to prune."""

    def __init__(self, trial: Any, units: Callable[[int], int]):
        self.trial, self.units = trial, units
        self.losses: list[float] = []
        self.reported = 0
        self.last_value: float | None = None

    def add(self, row: Mapping[str, Any]) -> bool:
        """Take one step's row; True when the trial should stop here."""
        loss = row.get("loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            self.losses.append(float(loss))
        unit = self.units(int(row["step"]))
        if unit <= self.reported or not self.losses:
            return False
        self.reported = unit
        self.last_value = sum(self.losses[-WINDOW:]) / len(self.losses[-WINDOW:])
        self.trial.report(self.last_value, unit)
        return bool(self.trial.should_prune())


def run_watched(config_path: Path, run_dir: Path, log_path: Path, nproc: int,
                reporter: Reporter, timeout_s: float, env: Mapping[str, str] | None = None
                ) -> Outcome:
    """Train the config as ``meshtron train --config`` in a session of its own, feeding each
    new metrics row to ``reporter``; kill the session when it prunes, times out, or this
    process is interrupted (the trial is then left unfinished in the study)."""
    command = [sys.executable, "-m", "meshtron", "train", "--config", str(config_path),
               "--nproc", str(nproc)]
    tail = MetricsTail(run_dir / "metrics.jsonl")
    last: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env=trial_environment(env), start_new_session=True)
        try:
            while True:
                code = proc.poll()
                for row in tail.read():
                    last = row
                    if reporter.add(row) and code is None:  # a finished run stays finished
                        stop(proc)
                        return Outcome("pruned", reporter.last_value, row["step"])
                if code is not None:
                    break
                if time.monotonic() > deadline:
                    stop(proc)
                    return Outcome("failed", None, last.get("step", 0),
                                   f"stopped after {timeout_s:.0f} s (see {log_path})")
                time.sleep(POLL_S)
        except BaseException:
            stop(proc)
            raise
    steps = last.get("step", 0)
    if code != 0:
        return Outcome("failed", None, steps,
                       f"exit {code}: {last_line(log_path.read_text(errors='replace'))}")
    loss = last.get("val_loss")
    if not isinstance(loss, (int, float)):
        return Outcome("failed", None, steps, f"no validation loss in {tail.path}")
    if not math.isfinite(loss):
        return Outcome("failed", None, steps, f"diverged: validation loss {loss}")
    return Outcome("complete", float(loss), steps)

