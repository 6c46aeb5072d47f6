"""Layout-independent weight initialisation.

Every parameter is drawn from its own generator, seeded by the run seed and the parameter's
*global* name, as the full global tensor. A sharded layer then keeps only its slice, so a model
split over any number of ranks starts from exactly the weights of the one-process model.

With ``model.mup`` (the maximal-update parameterisation, Yang et al. 2022, Tensor Programs V,
Table 3, Adam) the hidden matrices -- every weight of two or more dimensions except the token
and position embeddings, the output layer and the MoE routers, whose fan-out does not grow
with width -- start with their std divided by sqrt(m), m = hidden_size / mup_base_width, and
learn at lr / m (:func:`lr_multipliers`, applied by the optimizers). The output's 1/m
multiplier and the attention scale live in the model. At m = 1 nothing changes.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.parallel.mesh.params import layout_of

RESIDUAL_OUTPUTS = ("attn.proj.weight", "down.weight")
"""Projections that write into the residual stream: their std is scaled by 1/sqrt(2 * layers)."""


VECTOR_LIKE = ("embed.weight", "pos_embed.weight", "output.weight", "router.weight")
"""Matrices that muP treats like vectors (one dimension does not grow with width): they keep
init_std and the base learning rate."""


def width_multiplier(cfg: ModelConfig) -> float:
    """muP's m = hidden_size / mup_base_width (1.0 without ``model.mup``)."""
    return cfg.hidden_size / cfg.mup_base_width if cfg.mup else 1.0


def is_hidden_matrix(global_name: str, global_shape: tuple[int, ...]) -> bool:
    """A weight whose fan-in and fan-out both grow with width (attention and MLP projections,
    experts, the multi-token-prediction merge): muP scales its init and learning rate."""
    return len(global_shape) >= 2 and not global_name.endswith(VECTOR_LIKE)


def lr_multipliers(model: nn.Module) -> dict[int, float]:
    """muP's per-parameter learning-rate multipliers, by ``id`` of the parameter: 1 / m for
    the hidden matrices of a model built with ``model.mup`` (read from ``model.cfg``); empty
    (every multiplier 1) otherwise."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, ModelConfig) or width_multiplier(cfg) == 1.0:
        return {}
    mult = 1.0 / width_multiplier(cfg)
    out = {}
    for name, param in model.named_parameters():
        layout = layout_of(param)
        if is_hidden_matrix(layout.global_name or name, tuple(layout.global_shape)):
            out[id(param)] = mult
    return out


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
    width_mult: float = 1.0,
) -> torch.Tensor:
    """The full fp32 initial value of one parameter, a function of (seed, name, shape) only;
    ``width_mult``: muP's m, dividing the std of hidden matrices by sqrt(m)."""
    if global_name.endswith("norm.weight"):
        return torch.ones(global_shape)
    if global_name.endswith((".bias", "expert_bias", "norm.offset", "lora.b")):
        return torch.zeros(global_shape)  # norm.offset: of 1 + it; lora.b: adapters start at 0
    gen = torch.Generator().manual_seed(parameter_seed(seed, global_name))
    if global_name.endswith("lora.a"):  # PEFT's kaiming_uniform_(a=sqrt(5)): U(+-1/sqrt(in))
        bound = 1.0 / math.sqrt(global_shape[1])
        return torch.empty(global_shape).uniform_(-bound, bound, generator=gen)
    if global_name == "vision.pos_embed.weight":
        return grid_positions(*global_shape)
    if global_name == "vision.patch_embed.weight":  # LeCun normal, as ViTs draw it: at
        std = 1.0 / math.sqrt(math.prod(global_shape[1:]))  # 0.02 pixels barely showed
    if global_name.endswith(RESIDUAL_OUTPUTS):
        std = std / math.sqrt(2 * num_layers)
    if width_mult != 1.0 and is_hidden_matrix(global_name, tuple(global_shape)):
        std = std / math.sqrt(width_mult)
    return torch.empty(global_shape).normal_(0.0, std, generator=gen)


def grid_positions(patches: int, width: int) -> torch.Tensor:
    """Fixed 2-D sine-cosine embeddings of a square grid of patches (MAE's), [patches,
    width]: the vision encoder's positions start out saying where each patch is, which a
    policy reading positions off the image needs from the first step (learned positions
    drawn at random took thousands of steps to); they keep learning from there."""
    side = math.isqrt(patches)
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / max(quarter, 1))
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float64),
                                torch.arange(side, dtype=torch.float64), indexing="ij")
    parts = [f(axis.reshape(-1, 1) * omega) for axis in (rows, cols)
             for f in (torch.sin, torch.cos)]
    table = torch.cat(parts, dim=1)
    return torch.nn.functional.pad(table, (0, width - table.shape[1])).float()


@torch.no_grad()
def initialize(model: nn.Module, *, seed: int, std: float, num_layers: int) -> None:
    """Initialise every parameter of ``model`` from its global value.

    Parameter names are global; each parameter's layout gives the global shape and the slice
    it keeps (a pipeline's copy of a tied weight is named as what it copies). A model built
    with ``model.mup`` (its ``cfg``) gets muP's initial scales.
    """
    cfg = getattr(model, "cfg", None)
    width_mult = width_multiplier(cfg) if isinstance(cfg, ModelConfig) else 1.0
    for name, param in model.named_parameters():
        layout = layout_of(param)
        full = initial_value(layout.global_name or name, layout.global_shape, seed=seed,
                             std=std, num_layers=num_layers, width_mult=width_mult)
        param.copy_(layout.tp_slice.take(full) if layout.tp_slice is not None else full)
