"""Skipped steps: a step whose loss or grad norm is not finite changes nothing (agreed by every
rank inside :func:`~meshtron.training.step.train_step`); here they are counted, said, and
``train.max_skipped`` of them in a row end the run with advice for its precision."""

from __future__ import annotations

import math
from collections.abc import Callable

from meshtron.config import Config
from meshtron.errors import MeshtronError
from meshtron.training.step import StepResult


class SkipCount:
    """The run's skipped steps (``skipped_steps`` of every metrics row) and the current streak.

    fp16 with loss scaling skips as part of finding its scale: said only when the limit is
    reached; other precisions say every skip."""

    def __init__(self, cfg: Config, scaling: bool, warn: Callable[[str], None]):
        self.cfg, self.scaling, self.warn = cfg, scaling, warn
        self.total = 0
        self.in_a_row = 0

    def add(self, step: int, out: StepResult) -> None:
        self.in_a_row = self.in_a_row + 1 if out.skipped else 0
        self.total += out.skipped
        if not out.skipped:
            return
        what = (f"loss {out.loss}" if not math.isfinite(out.loss)
                else f"grad norm {out.grad_norm}")
        if not self.scaling:
            self.warn(f"step {step} skipped on every rank: {what}; the weights and "
                      "optimizer state are unchanged")
        if self.in_a_row >= self.cfg.train.max_skipped:
            raise too_many_skips(self.cfg, self.scaling, self.in_a_row, step, what)


def too_many_skips(cfg: Config, scaling: bool, consecutive: int, step: int,
                   what: str) -> MeshtronError:
    """The error that ends a run after ``train.max_skipped`` non-finite steps in a row, with
    advice for its precision (loss scaling helps fp16 only)."""
    dtype = cfg.precision.dtype
    if dtype == "fp16" and not scaling:
        advice = "Enable precision.loss_scaling, lower train.lr, or use bf16/fp32"
    elif dtype == "fp16":
        advice = "Lower train.lr or train.grad_clip, use bf16/fp32, or check the data"
    else:
        advice = ("Lower train.lr or train.grad_clip, or check the data; loss scaling is for "
                  "fp16 and would not help here")
    unscaled = " without loss scaling" if dtype == "fp16" and not scaling else ""
    return MeshtronError(
        f"{consecutive} steps in a row up to step {step} were not finite ({what}) in "
        f"{dtype}{unscaled} (train.max_skipped={cfg.train.max_skipped}); they were skipped and "
        f"the weights are those of step {step - consecutive}. {advice}")
