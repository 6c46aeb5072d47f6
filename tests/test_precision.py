"""Loss scaling: overflow halves the scale and skips the step; clean stretches double it. The
start-up note for 16-bit formats on CPUs without hardware 16-bit matmuls."""

import math

import pytest
import torch

from meshtron.config import load_config
from meshtron.precision.policy import (
    NATIVE_CPU_FLAGS,
    LossScaler,
    cpu_flags,
    cpu_low_precision_note,
)
from meshtron.training.trainer import Trainer
from tests.training_state import assert_same_state, snapshot


def test_scale_halves_on_overflow_and_grows_after_clean_steps():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    scaler.update(overflow=True)
    assert scaler.scale == 512.0
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1024.0


def test_an_overflowing_fp16_step_is_skipped_and_weights_do_not_change(tiny_overrides):
    """The scaled loss overflows at the first step: the fp16 parameters, their fp32 masters,
    both moments and the step count stay exactly as they were; the scale halves."""
    trainer = Trainer(load_config(overrides=tiny_overrides + [
        "--precision.dtype=fp16", "--train.steps=1"]), log=lambda m: None)
    trainer.precision.scaler.scale = 2.0**120  # the scaled loss overflows fp32 gradients
    before = snapshot(trainer)
    result = trainer.run()
    assert not math.isfinite(result.grad_norms[0]) and math.isfinite(result.losses[0])
    assert trainer.precision.scaler.scale == 2.0**119
    assert before["optimizer_steps"] == 0 and before["loss_scale"] == (2.0**120, 0)
    before["loss_scale"] = (2.0**119, 0)
    assert_same_state(before, snapshot(trainer), "after an overflowing step")


def test_an_fp16_overflow_after_a_clean_step_leaves_that_steps_state(tiny_overrides):
    """Step 1 is clean (moments and masters move); step 2's gradient overflows fp16: the whole
    state after step 2 is the state after step 1, the scale halved, one step taken. A wrong
    update far below an fp16 ulp would show in the masters or the moments."""
    trainer = Trainer(load_config(overrides=tiny_overrides + [
        "--precision.dtype=fp16", "--train.steps=2"]), log=lambda m: None)
    after_first: list[dict] = []

    def overflow_second(grad):
        if trainer.step == 1 and not after_first:
            after_first.append(snapshot(trainer))  # step 2's backward: nothing updated yet
            return grad * math.inf
        return grad

    next(trainer.model.parameters()).register_hook(overflow_second)
    scale = trainer.precision.scaler.scale
    result = trainer.run()
    assert math.isfinite(result.grad_norms[0]) and not math.isfinite(result.grad_norms[1])
    expected = after_first[0]
    assert expected["optimizer_steps"] == 1 and expected["loss_scale"] == (scale, 1)
    assert any(k.endswith("/exp_avg") for k in expected["tensors"])
    assert any(k.endswith("/master") for k in expected["tensors"])
    expected["loss_scale"] = (scale / 2, 0)
    assert_same_state(expected, snapshot(trainer), "after the overflowing step 2")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_formats_on_a_cpu_without_hardware_matmuls_get_one_warning_line(dtype):
    note = cpu_low_precision_note(dtype, torch.device("cpu"), native=False)
    assert note is not None and "\n" not in note
    assert f"precision.dtype={dtype}" in note and "fp32 is faster" in note and "x slower" in note
    assert cpu_low_precision_note(dtype, "cpu", native=True) is None
    assert cpu_low_precision_note(dtype, torch.device("cuda", 0), native=False) is None
    on_this_cpu = cpu_low_precision_note(dtype, "cpu")  # from this machine's flags
    assert (on_this_cpu is None) == (not cpu_flags().isdisjoint(NATIVE_CPU_FLAGS[dtype]))


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_full_precision_gets_no_note(dtype):
    assert cpu_low_precision_note(dtype, "cpu", native=False) is None
