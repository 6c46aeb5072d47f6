"""``parallel.zb_v_measured_order`` as an observer: zb-v's order rebuilt after a few measured
steps (:class:`~meshtron.parallel.pipeline.measured_order.MeasuredOrder`)."""

from __future__ import annotations

from collections.abc import Callable

from meshtron.parallel.pipeline.measured_order import MeasuredOrder
from meshtron.training.observers import Observer, StepReport


class ZbvOrder(Observer):
    """Re-orders the rank's pipeline executor (the one it runs now: ``train.autotune`` may have
    replaced it, which starts the measurement afresh) and says so."""

    def __init__(self, after_steps: int, receives_ahead: int | None, log: Callable[[str], None]):
        self.order = MeasuredOrder(after_steps, receives_ahead)
        self.log = log

    def on_step(self, report: StepReport) -> None:
        pipeline = report.rank.pipeline
        if pipeline is not None and (line := self.order.after_step(pipeline, report.rank.mesh)):
            self.log(line)
