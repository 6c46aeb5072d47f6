"""Tensor- and sequence-parallel layers (Megatron-LM's column/row split, Korthikanti's SP).

Every parameter gets a :class:`~meshtron.parallel.mesh.params.ParamLayout` where it is made,
saying how it relates to its global tensor, so that initialisation, checkpoints and the grad
norm never depend on the layout.

Communication is explicit: a block enters the region once for all its column-parallel
projections (:func:`column_products`) and row-parallel layers leave the region themselves.
With ``overlap_chunks`` set under sequence parallelism, both do so through the chunked
collectives of :mod:`~meshtron.parallel.tensor.overlap`, overlapped with their products.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.mesh.params import ParamLayout, SliceSpec, set_layout
from meshtron.parallel.tensor.collectives import (
    all_gather,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_sp,
)
from meshtron.parallel.tensor.linear import PLAIN, LinearMode, linear
from meshtron.parallel.tensor.lora import LoraAdapter, base_product_weight
from meshtron.parallel.tensor.overlap import gather_then_linear, linear_then_reduce_scatter


@dataclass(frozen=True)
class TPRegion:
    """How activations enter and leave the tensor-parallel region of a block."""

    group: Group
    sequence_parallel: bool = False
    overlap_chunks: int = 0
    """Under sequence parallelism: pieces of each rank's sequence share whose all-gathers and
    reduce-scatters overlap the products beside them (0: whole collectives, not overlapped).
    Only plain (not FP8, not split-backward) linear layers take part; the plan refuses others."""

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def overlapped(self) -> bool:
        return self.sequence_parallel and self.overlap_chunks > 0

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Full-sequence input replicated on every tp rank (gathered under SP)."""
        if self.sequence_parallel:
            return gather_from_sp(x, self.group)
        return copy_to_tp(x, self.group)

    def exit(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum partial outputs over tp (and keep this rank's sequence chunk under SP)."""
        if self.sequence_parallel:
            return reduce_scatter_sp(partial, self.group)
        return reduce_from_tp(partial, self.group)


def sliced(param: nn.Parameter, global_shape: tuple[int, ...], tp_slice: SliceSpec | None,
           replicas: int = 1, grad_sync: Group | None = None,
           data_parallel: Group | None = None) -> nn.Parameter:
    """Give ``param`` (the tensor-parallel slice ``tp_slice`` of a ``global_shape`` tensor)
    its layout."""
    return set_layout(param, ParamLayout(tuple(global_shape), tp_slice, replicas, grad_sync,
                                         data_parallel))


def replicated(param: nn.Parameter, region: TPRegion) -> nn.Parameter:
    """A parameter every tp rank holds whole; under SP each rank sees only part of the
    sequence, so its gradient must be summed over tp."""
    return sliced(param, tuple(param.shape), None, region.size,
                  region.group if region.sequence_parallel else None)


def _split(n: int, count: int, what: str) -> int:
    if n % count:
        raise ValueError(f"{what}={n} is not divisible by {count}")
    return n // count


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows; the input must already be in the region.

    ``pieces`` is how many ways the output is split (default: tp). When it is smaller than tp
    (kv heads fewer than tp ranks), groups of tp/pieces ranks share a piece and sum its
    gradient over ``share_group``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, region: TPRegion,
                 parts: int = 1, pieces: int | None = None, share_group: Group | None = None,
                 mode: LinearMode = PLAIN):
        super().__init__()
        pieces = pieces or region.size
        index = region.group.rank * pieces // region.size
        spec = SliceSpec(dim=0, index=index, count=pieces, parts=parts) if pieces > 1 else None
        local_out = _split(out_features, pieces, "output features")
        replicas = region.size // pieces
        self.weight = sliced(nn.Parameter(torch.empty(local_out, in_features)),
                             (out_features, in_features), spec, replicas, share_group)
        self.bias = None
        if bias:
            self.bias = sliced(nn.Parameter(torch.empty(local_out)), (out_features,), spec,
                               replicas, share_group)
        self.grad_store = mode.grad_store
        self.fp8 = mode.layer_fp8()
        self.lora: LoraAdapter | None = None
        """A low-rank adapter (models/adapters.py attaches it; its B split as this weight)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = base_product(self, x)
        return y if self.lora is None else self.lora.add_to(y, x)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; the output leaves the region (sum over tp),
    then the replicated bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, region: TPRegion,
                 mode: LinearMode = PLAIN):
        super().__init__()
        self.region = region
        spec = SliceSpec(1, region.group.rank, region.size) if region.size > 1 else None
        local_in = _split(in_features, region.size, "input features")
        self.weight = sliced(nn.Parameter(torch.empty(out_features, local_in)),
                             (out_features, in_features), spec)
        self.bias = replicated(nn.Parameter(torch.empty(out_features)), region) if bias else None
        self.grad_store = mode.grad_store
        self.fp8 = mode.layer_fp8()
        self.lora: LoraAdapter | None = None
        """A low-rank adapter (its A split as this weight), added before the sum over tp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        region = self.region
        if region.overlapped:  # the plan refuses adapters with overlap
            y = linear_then_reduce_scatter(x, self.weight, region.group, region.overlap_chunks)
        else:
            partial = base_product(self, x, with_bias=False)
            if self.lora is not None:
                partial = self.lora.add_to(partial, x)
            y = region.exit(partial)
        return y if self.bias is None else y + self.bias


def base_product(layer: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor,
                 with_bias: bool = True) -> torch.Tensor:
    """The layer's own product; a frozen weight (adapted model) defers no weight gradient and
    computes in ``x``'s dtype whatever dtype it is held in."""
    weight, store = layer.weight, layer.grad_store
    if not weight.requires_grad:
        weight, store = base_product_weight(weight, x), None
    return linear(x, weight, layer.bias if with_bias else None, store, layer.fp8)


def entered_products(region: TPRegion, x: torch.Tensor, weights: Sequence[torch.Tensor],
                     biases: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """``F.linear(region.enter(x), w, b)`` for each weight and bias: one gather for all of
    them, chunked against the products when the region overlaps."""
    if region.overlapped:
        return gather_then_linear(x, region.group, region.overlap_chunks, weights, biases)
    x = region.enter(x)
    return [F.linear(x, w, b) for w, b in zip(weights, biases)]


def column_products(region: TPRegion, x: torch.Tensor,
                    layers: Sequence[ColumnParallelLinear]) -> list[torch.Tensor]:
    """Each column-parallel layer applied to ``x`` entered into the region once."""
    if region.overlapped:
        return entered_products(region, x, [la.weight for la in layers],
                                [la.bias for la in layers])
    x = region.enter(x)
    return [layer(x) for layer in layers]


class VocabParallelEmbedding(nn.Module):
    """Embedding with its rows (the padded vocabulary) split over tp."""

    def __init__(self, padded_vocab: int, dim: int, region: TPRegion):
        super().__init__()
        self.region = region
        local = _split(padded_vocab, region.size, "padded vocabulary")
        self.start = region.group.rank * local
        spec = SliceSpec(0, region.group.rank, region.size) if region.size > 1 else None
        self.weight = sliced(nn.Parameter(torch.empty(local, dim)), (padded_vocab, dim), spec)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.region.size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.region.exit(out)


@torch.no_grad()
def gather_full(local: torch.Tensor, spec: SliceSpec | None, group: Group) -> torch.Tensor:
    """Rebuild the global tensor from every tp rank's slice (inverse of ``spec.take``)."""
    if spec is None:
        return local
    gathered = all_gather(local.unsqueeze(0), group, dim=0)
    size = group.size
    pieces = [gathered[i * size // spec.count] for i in range(spec.count)]
    blocks = [piece.chunk(spec.parts, dim=spec.dim) for piece in pieces]
    return torch.cat([torch.cat([b[k] for b in blocks], dim=spec.dim)
                      for k in range(spec.parts)], dim=spec.dim)
