"""The matrix product of every linear layer: plain, with a split backward, or in low precision.

A block's linear layers are built with one :class:`LinearMode`: zero-bubble pipelines give them
a shared :class:`WeightGradStore` (the weight gradient can be deferred), FP8/FP4 runs give each
its own low-precision options (:mod:`meshtron.precision.recipes`: a scaling recipe object of
its own, since delayed scaling keeps per-layer amax history; the per-layer policy may keep a
block in high precision). Embeddings, norms and the loss never take part; the output layer may
defer its weight gradient but stays in high precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from meshtron.parallel.mesh.params import layout_of
from meshtron.parallel.tensor.weight_grad import LinearSplitBackward, WeightGradStore
from meshtron.precision.mx import MXExperts
from meshtron.precision.recipes import FP8Options, LayerPolicy, LowPrecision

__all__ = ["PLAIN", "FP8Options", "LinearMode", "linear"]


@dataclass(frozen=True)
class LinearMode:
    """How the linear layers of a model compute, fixed when they are built."""

    fp8: Callable[[], LowPrecision | None] | None = None
    """Makes one layer's low-precision options (called once per layer; a
    :class:`LayerPolicy` is asked by the block's index); None: high precision."""
    grad_store: WeightGradStore | None = None
    """Where weight gradients are put aside while the store is deferring (zero-bubble)."""
    layer: int | None = None
    """The global index of the block whose layers this mode builds (:meth:`for_layer`)."""

    def for_layer(self, layer: int) -> LinearMode:
        """This mode for the linear layers of block ``layer``."""
        return replace(self, layer=layer)

    def layer_experts(self) -> MXExperts | None:
        """The low precision of this block's MoE grouped expert products (None: high)."""
        if isinstance(self.fp8, LayerPolicy):
            return self.fp8.experts(self.layer)
        return None

    def layer_fp8(self) -> LowPrecision | None:
        if self.fp8 is None:
            return None
        if isinstance(self.fp8, LayerPolicy):
            return self.fp8.options(self.layer)
        return self.fp8()


PLAIN = LinearMode()
"""High precision, weight gradients in the same backward."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           store: WeightGradStore | None = None,
           fp8: LowPrecision | None = None) -> torch.Tensor:
    """``x W^T + b``; in FP8 or FP4 when ``fp8`` (a layer's low-precision options) is given;
    the weight gradient deferred to ``store`` while it is deferring."""
    if fp8 is not None:
        return fp8.apply(x, weight, bias, store.defer if store is not None else None,
                         output_features(weight))
    if store is None:
        return F.linear(x, weight, bias)
    return LinearSplitBackward.apply(x, weight, bias, store)


def output_features(weight: torch.Tensor) -> torch.Tensor | None:
    """The global numbers of ``weight``'s rows (its output features) where a tensor-parallel
    shard holds a slice of them (of each part, for fused projections); None where it holds
    them all. Stochastic rounding keys its draws by them, so every split draws alike."""
    spec = layout_of(weight).tp_slice
    if spec is None or spec.dim != 0:
        return None
    return spec.take(torch.arange(layout_of(weight).global_shape[0], device=weight.device))
