"""Mixed precision for now: autocast over fp32 weights, with dynamic loss scaling for fp16.

The scaler decides from the global grad norm, which every rank computes identically after the
reductions, so a step with an overflow is skipped on all ranks together.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LossScaler:
    """Multiply the loss by ``scale``; halve it on overflow, double it after clean stretches."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = scale
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= 2


class Precision:
    def __init__(self, dtype: str, device: torch.device):
        self.device = device
        self.dtype = AUTOCAST_DTYPES.get(dtype)
        self.scaler = LossScaler() if dtype == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0
