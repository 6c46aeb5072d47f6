"""Low precision: bf16/fp16 parameters and activations, fp32 master weights, loss scaling.

With ``precision.dtype`` bf16 or fp16 the model's parameters are stored in that dtype, so the
forward and backward run in it; norms, softmax and the loss compute in fp32 inside their ops.
The optimizer keeps fp32 master weights and moments (sharded under ZeRO) and writes rounded
copies back into the parameters; gradients are reduced in ``precision.reduce_dtype``.

fp64 is for verification: everything, gradient reductions and optimizer state included, stays
in fp64, so layouts that do the same math agree to ~1e-12 and a parity failure cannot hide in
fp32 rounding.

fp16 uses dynamic loss scaling. The scaler decides from the global grad norm, which every rank
computes identically after the reductions, so a step with an overflow is skipped on all ranks
together.
"""

from __future__ import annotations

import torch
from torch import nn

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "fp64": torch.float64}


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, softmax, losses and optimizer state compute in: fp32 for fp32 and the
    16-bit formats, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


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


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Precision:
    """The number formats of one run (``precision.*``) and its fp16 loss scaler."""

    def __init__(self, dtype: str, device: torch.device, loss_scaling: bool = True,
                 reduce_dtype: str = "fp32"):
        self.name = dtype
        self.device = device
        self.param_dtype = PARAM_DTYPES[dtype]
        self.reduce_dtype = torch.float64 if dtype == "fp64" else REDUCE_DTYPES[reduce_dtype]
        """What gradient buckets hold and are reduced in (fp64 runs keep fp64 throughout)."""
        self.scaler = LossScaler() if dtype == "fp16" and loss_scaling else None

    def cast_parameters(self, model: nn.Module) -> None:
        """Store ``model``'s trained parameters in the training dtype (buffers such as rotary
        tables, and untrained state such as the MoE routers' expert bias, stay fp32)."""
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(self.param_dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0
