"""Low-rank adapters on the tensor-parallel linear layers, sharded the way their base is.

An adapter adds ``scale * (x A^T) B^T`` to ``x W^T`` (A: rank x in, B: out x rank). Its two
factors split over tp like the weight they adapt, so the adapter adds no collective of its
own to the forward pass:

* column-parallel base (W split by output rows, input replicated in the region): A is
  replicated, B split by rows exactly as W (fused parts and shared kv pieces included). Each
  rank's gradient of A comes from its own rows of B only, a partial sum, so A's gradient is
  summed over tp after backward (``grad_sync``), as the input gradient is by the region;
* row-parallel base (W split by input columns, the partial outputs summed as they leave the
  region): A is split by columns as W, B replicated; the adapter's partial output is added
  before the region's sum, so each rank's gradient of B is again partial and summed over tp.

Routed experts (``model.lora.targets=experts``) take the same pairs, one per expert and
projection (``experts.3.gate_up.lora.a``), so they live on the expert's ep rank like its
weights; their [gate | up] is column-parallel and their down row-parallel under expert tensor
parallelism (none of it with whole experts: ``tp`` None), and both factors are summed over the
experts' data-parallel group (the base layout's ``data_parallel``), never over dp x cp.

Parameters are named ``<layer>.lora.a`` / ``<layer>.lora.b`` and carry their
:class:`~meshtron.parallel.mesh.params.ParamLayout` like every other parameter, so
initialisation, the grad norm, ZeRO and checkpoints need nothing else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.mesh.params import ParamLayout, SliceSpec, layout_of, set_layout

ADAPTER = "meshtron_adapter"
"""Attribute set (True) on adapter parameters."""
FROZEN = "meshtron_lora_frozen"
"""Attribute set (True) on the parameters an adapted model freezes: never trained, reduced or
checkpointed with the adapters (they come from the base model)."""


class LoraAdapter(nn.Module):
    """The pair (A, B) of one linear layer; :meth:`add_to` adds this rank's share of
    ``scale * (dropout(x) A^T) B^T`` to the base layer's output."""

    def __init__(self, a: ParamLayout, b: ParamLayout, scale: float, dropout: float):
        super().__init__()
        self.a = _adapter_param(a)
        self.b = _adapter_param(b)
        self.scale = scale
        self.dropout = dropout

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y + scale * (dropout(x) A^T) B^T`` with the scale and the sum inside B's product
        (one ``addmm``), so neither makes a pass of its own over the layer's whole output,
        forward or backward: about a tenth of an adapted [512, 576] x [576, 3072] product's
        forward and backward on one CPU thread (benchmarks/chat_finetune.py)."""
        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        low = F.linear(x, self.a)
        out = torch.addmm(y.reshape(-1, y.shape[-1]), low.reshape(-1, self.rank),
                          self.b.t(), alpha=self.scale)
        return out.view(y.shape)

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's ``weight + scale * B A`` (differentiable in A and B): the adapted
        layer's weight for code that uses the weight itself rather than the layer (latent
        attention's absorbed decode and ring), exact where the adapter's dropout is off.
        B's rows and A's columns are split as the weight's, so the local product is the
        local slice of the global one."""
        return torch.addmm(weight, self.b, self.a, alpha=self.scale)


def _adapter_param(layout: ParamLayout) -> nn.Parameter:
    param = set_layout(nn.Parameter(torch.empty(layout.local_shape())), layout)
    setattr(param, ADAPTER, True)
    return param


def column_adapter(weight: torch.Tensor, rank: int, scale: float, dropout: float,
                   tp: Group | None) -> LoraAdapter:
    """The adapter of a column-parallel ``weight``: A replicated (gradient summed over
    ``tp``; None: a weight no tp rank splits or shares, such as a whole expert's), B split
    by rows as the weight; both reduced over the weight's data-parallel group."""
    base = layout_of(weight)
    out, inp = base.global_shape
    b_slice = None if base.tp_slice is None else SliceSpec(
        0, base.tp_slice.index, base.tp_slice.count, base.tp_slice.parts)
    a = ParamLayout((rank, inp), None, _size(tp), tp, base.data_parallel)
    b = ParamLayout((out, rank), b_slice, base.replicas, base.grad_sync, base.data_parallel)
    return LoraAdapter(a, b, scale, dropout)


def row_adapter(weight: torch.Tensor, rank: int, scale: float, dropout: float,
                tp: Group | None) -> LoraAdapter:
    """The adapter of a row-parallel ``weight``: A split by columns as the weight, B
    replicated (gradient summed over ``tp``; None as for :func:`column_adapter`)."""
    base = layout_of(weight)
    out, inp = base.global_shape
    a_slice = None if base.tp_slice is None else SliceSpec(
        1, base.tp_slice.index, base.tp_slice.count)
    a = ParamLayout((rank, inp), a_slice, base.replicas, None, base.data_parallel)
    b = ParamLayout((out, rank), None, _size(tp), tp, base.data_parallel)
    return LoraAdapter(a, b, scale, dropout)


def _size(group: Group | None) -> int:
    return 1 if group is None else group.size


def is_adapter(param: torch.Tensor) -> bool:
    return getattr(param, ADAPTER, False)


def is_frozen_base(param: torch.Tensor) -> bool:
    """A parameter an adapted model froze (see :data:`FROZEN`)."""
    return getattr(param, FROZEN, False)


def base_product_weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` in ``x``'s dtype: a frozen base held in a narrower dtype
    (``model.lora.base_dtype``) computes in the run's."""
    return weight if weight.dtype == x.dtype else weight.to(x.dtype)
