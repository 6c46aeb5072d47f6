"""Layout-independent weight initialisation.

Every parameter is drawn from its own generator, seeded by the run seed and the parameter's
*global* name, as the full global tensor. A sharded layer then keeps only its slice, so a model
split over any number of ranks starts from exactly the weights of the one-process model.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from meshtron.parallel.mesh.params import layout_of

RESIDUAL_OUTPUTS = ("attn.proj.weight", "down.weight")
"""Projections that write into the residual stream: their std is scaled by 1/sqrt(2 * layers)."""


def parameter_seed(seed: int, global_name: str) -> int:
    """A 63-bit seed derived from the run seed and a parameter's global name."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def initial_value(
    global_name: str,
    global_shape: tuple[int, ...],
    *,
    seed: int,
    std: float,
    num_layers: int,
) -> torch.Tensor:
    """The full fp32 initial value of one parameter, a function of (seed, name, shape) only."""
    if global_name.endswith("norm.weight"):
        return torch.ones(global_shape)
    if global_name.endswith((".bias", "expert_bias")):
        return torch.zeros(global_shape)
    if global_name.endswith(RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2 * num_layers)
    gen = torch.Generator().manual_seed(parameter_seed(seed, global_name))
    return torch.empty(global_shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def initialize(model: nn.Module, *, seed: int, std: float, num_layers: int) -> None:
    """Initialise every parameter of ``model`` from its global value.

    Parameter names are global; each parameter's layout gives the global shape and the slice
    it keeps (a pipeline's copy of a tied weight is named as what it copies).
    """
    for name, param in model.named_parameters():
        layout = layout_of(param)
        full = initial_value(layout.global_name or name, layout.global_shape, seed=seed,
                             std=std, num_layers=num_layers)
        param.copy_(layout.shard.take(full) if layout.shard is not None else full)
