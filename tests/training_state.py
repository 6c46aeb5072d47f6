"""The whole training state of a trainer, copied, and compared exactly.

What a skipped step must leave untouched is more than the parameters a test can see: fp32
master weights (a wrong update smaller than half an fp16 ulp rounds away in the fp16
parameter but stays in its master), both Adam moments, the optimizer's step count (Adam's
bias correction) and the loss scale. :func:`snapshot` takes all of them, through the same
``held_tensors`` a checkpoint saves, so nothing the optimizer holds is left out.
"""

from __future__ import annotations

from typing import Any

import torch

from meshtron.checkpoint.held import held_tensors
from meshtron.training.trainer import Trainer


def snapshot(trainer: Trainer) -> dict[str, Any]:
    """Copies of every tensor this rank holds (parameters, masters, moments) by checkpoint
    name, the optimizer's step count and the loss scaler's (scale, clean steps)."""
    tensors = {h.name: h.flat.detach().clone()
               for h in held_tensors(trainer.model, trainer.optimizer, trainer.mesh)}
    scaler = trainer.precision.scaler
    return {"tensors": tensors, "optimizer_steps": trainer.optimizer.steps_taken,
            "loss_scale": None if scaler is None else (scaler.scale, scaler.clean_steps)}


def assert_same_state(expected: dict[str, Any], got: dict[str, Any], what: str) -> None:
    """Bit for bit: every tensor, the step count and the loss scale."""
    assert got["tensors"].keys() == expected["tensors"].keys(), what
    for name, tensor in expected["tensors"].items():
        other = got["tensors"][name]
        assert torch.equal(tensor, other), (
            f"{what}: {name} differs by up to "
            f"{float((tensor.double() - other.double()).abs().max()):.3g}")
    assert got["optimizer_steps"] == expected["optimizer_steps"], what
    assert got["loss_scale"] == expected["loss_scale"], what
