"""LoRA on a built model: adapters on the targeted projections of every decoder block, every
other parameter frozen (``model.lora.*``).

The blocks are built as always; :func:`attach_adapters` then gives each targeted
column- or row-parallel projection its adapter (``parallel/tensor/lora.py``: sharded as the
projection) and freezes the rest, all inside the :class:`~meshtron.models.transformer.
Transformer`'s constructor, so the optimizer, ZeRO and checkpoints see the model as it will
train. With ``experts`` among the targets every routed expert of an MoE block gets its own
pair on its [gate | up] and down products (``moe.ExpertWeight.lora``), on the expert's ep rank.
Latent attention's projections (``q_a``, ``q_b`` or ``q``, ``kv_a``, ``kv_b``, ``proj``) are
adapted like any other: the down projections every tp rank holds whole get whole adapters
whose gradients are summed over tp as the base's would be (``whole_linear``'s layout).
Multi-token-prediction modules, embeddings, norms and routers stay frozen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator

import torch
from torch import nn

from meshtron.config import ModelConfig
from meshtron.config.lora_section import EXPERT_TARGET, LoraConfig
from meshtron.models.moe import ExpertWeight, MoE
from meshtron.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, TPRegion
from meshtron.parallel.tensor.lora import (
    FROZEN,
    column_adapter,
    is_adapter,
    is_frozen_base,
    row_adapter,
)


def attach_adapters(model: nn.Module, blocks: Iterator[nn.Module], lora: LoraConfig,
                    region: TPRegion) -> None:
    """Adapters on ``blocks``' targeted projections, then every other parameter of
    ``model`` frozen (marked :data:`~meshtron.parallel.tensor.lora.FROZEN`)."""
    names = lora.target_names()
    for block in blocks:
        for name, layer in target_layers(block):
            if name not in names:
                continue
            make = column_adapter if isinstance(layer, ColumnParallelLinear) else row_adapter
            layer.lora = make(layer.weight, lora.rank, lora.scale, lora.dropout, region.group)
        if EXPERT_TARGET in names and isinstance(getattr(block, "mlp", None), MoE):
            attach_expert_adapters(block.mlp, lora)
    for param in model.parameters():
        if not is_adapter(param) and param.requires_grad:
            param.requires_grad_(False)
            setattr(param, FROZEN, True)


def attach_expert_adapters(moe: MoE, lora: LoraConfig) -> None:
    """An adapter on each local routed expert's [gate | up] (column-parallel) and down
    (row-parallel) weight, split over tp as the expert is (not at all when experts are
    whole) and reduced over the experts' data-parallel group, as their weights would be."""
    tp = None if moe.whole_experts else moe.region.group
    for expert in moe.experts.values():
        up, down = expert.up_holder, expert.down
        up.lora = column_adapter(up.weight, lora.rank, lora.scale, lora.dropout, tp)
        down.lora = row_adapter(down.weight, lora.rank, lora.scale, lora.dropout, tp)


def target_layers(block: nn.Module) -> Iterator[tuple[str, ColumnParallelLinear |
                                                      RowParallelLinear]]:
    """(attribute name, layer) of the projections of a block's attention and dense MLP (an
    MoE layer's shared experts included) that can take an adapter."""
    owners = [getattr(block, "attn", None), getattr(block, "mlp", None)]
    owners.append(getattr(owners[1], "shared", None))
    for owner in owners:
        if owner is None:
            continue
        for name, child in owner.named_children():
            if isinstance(child, ColumnParallelLinear | RowParallelLinear):
                yield name, child


@torch.no_grad()
def cast_base(model: nn.Module, dtype: torch.dtype, projections: torch.dtype) -> None:
    """An adapted model's frozen parameters stored in the run's ``dtype`` (the precision
    policy casts only what trains), the adapted projections' weights in ``projections``
    (``model.lora.base_dtype``; they compute in the run's dtype)."""
    for param in model.parameters():
        if is_frozen_base(param):
            param.data = param.data.to(dtype)
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | ExpertWeight) \
                and module.lora is not None:
            module.weight.data = module.weight.data.to(projections)


def seed_base(cfg: ModelConfig, seed: int) -> dict[str, str | None]:
    """The record of a base drawn from ``seed`` (no checkpoint): a digest of the seed and the
    model section (checkpoint/lora_state.py keeps it in adapter checkpoints)."""
    text = json.dumps({"seed": seed, "model": dataclasses.asdict(cfg)}, sort_keys=True,
                      default=str)
    return {"path": None, "digest": "sha256:" + hashlib.sha256(text.encode()).hexdigest()}
