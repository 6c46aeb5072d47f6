"""Loss scaling: overflow halves the scale and skips the step; clean stretches double it."""

import math

from meshtron.config import load_config
from meshtron.precision.policy import LossScaler
from meshtron.training.trainer import Trainer


def test_scale_halves_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1024.0


def test_an_overflowing_fp16_step_is_skipped_and_weights_do_not_change(tiny_overrides):
    trainer = Trainer(load_config(overrides=tiny_overrides + [
        "--precision.dtype=fp16", "--train.steps=1"]), log=lambda m: None)
    trainer.precision.scaler.scale = 2.0**120  # the scaled loss overflows fp32 gradients
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.run()
    assert not math.isfinite(result.grad_norms[0]) and math.isfinite(result.losses[0])
    assert trainer.precision.scaler.scale == 2.0**119
    for name, param in trainer.model.named_parameters():
        assert (param == before[name]).all(), f"{name} changed in a skipped step"
