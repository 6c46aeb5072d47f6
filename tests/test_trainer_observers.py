"""The trainer's loop and its observers (meshtron/training/observers.py): every observer hears
each step's hooks in the protocol's order, an observer may ask for a save and re-plan the rank,
and every observer is closed when the run ends, also when the run fails."""

from __future__ import annotations

import pytest

from meshtron.config import load_config
from meshtron.errors import MeshtronError
from meshtron.training.observers import Observer, StepReport
from meshtron.training.trainer import Trainer


class Recorder(Observer):
    """Writes down what it hears; at ``save_at`` it asks for a checkpoint."""

    def __init__(self, save_at: int = 0, fail_at: int = 0):
        self.heard: list[tuple[str, int]] = []
        self.save_at, self.fail_at = save_at, fail_at

    def on_step(self, report: StepReport) -> None:
        self.heard.append(("step", report.step))
        report.save = report.save or report.step == self.save_at
        if report.step == self.fail_at:
            raise MeshtronError("stop here")

    def on_eval(self, report: StepReport) -> None:
        assert report.val_loss is not None and "val_loss" in report.row
        self.heard.append(("eval", report.step))

    def on_row(self, report: StepReport) -> None:
        self.heard.append(("row", report.step))

    def on_save(self, report: StepReport) -> None:
        assert report.checkpoint is not None and report.checkpoint.is_dir()
        self.heard.append(("save", report.step))

    def close(self) -> None:
        self.heard.append(("close", 0))


def trainer_with(recorder: Recorder, overrides: list[str], monkeypatch) -> Trainer:
    trainer = Trainer(load_config(overrides=overrides), log=lambda m: None)
    built = trainer._observers
    monkeypatch.setattr(trainer, "_observers", lambda: [*built(), recorder])
    return trainer


def test_observers_hear_step_eval_row_and_save_in_order(tiny_overrides, monkeypatch):
    recorder = Recorder(save_at=1)
    trainer = trainer_with(recorder, tiny_overrides + [
        "--train.steps=3", "--train.eval_every=2", "--train.eval_batches=1",
        "--checkpoint.every=0"], monkeypatch)
    result = trainer.run()
    assert recorder.heard == [("step", 1), ("row", 1), ("save", 1),
                              ("step", 2), ("eval", 2), ("row", 2),
                              ("step", 3), ("eval", 3), ("row", 3), ("save", 3),
                              ("close", 0)]
    assert result.checkpoint.name.endswith("3") and len(result.losses) == 3


def test_observers_are_closed_when_the_run_fails(tiny_overrides, monkeypatch):
    recorder = Recorder(fail_at=2)
    trainer = trainer_with(recorder, tiny_overrides + ["--train.steps=3"], monkeypatch)
    with pytest.raises(MeshtronError, match="stop here"):
        trainer.run()
    assert recorder.heard[-1] == ("close", 0) and ("step", 3) not in recorder.heard
