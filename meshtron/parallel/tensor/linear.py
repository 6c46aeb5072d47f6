"""The matrix product of every linear layer: plain, with a split backward, or in FP8.

A block's linear layers are built with one :class:`LinearMode`: zero-bubble pipelines give them
a shared :class:`WeightGradStore` (the weight gradient can be deferred), FP8 runs give each its
own :class:`FP8Options` (a scaling recipe object of its own: delayed scaling keeps per-layer
amax history). Embeddings, norms and the loss never take part; the output layer may defer its
weight gradient but stays in high precision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtron.parallel.tensor.weight_grad import LinearSplitBackward, WeightGradStore
from meshtron.precision.fp8 import ScalingRecipe, fp8_linear


@dataclass
class FP8Options:
    recipe: ScalingRecipe
    grad_format: str = "e5m2"


@dataclass(frozen=True)
class LinearMode:
    """How the linear layers of a model compute, fixed when they are built."""

    fp8: Callable[[], FP8Options] | None = None
    """Makes one layer's FP8 options (called once per layer); None: no FP8."""
    grad_store: WeightGradStore | None = None
    """Where weight gradients are put aside while the store is deferring (zero-bubble)."""

    def layer_fp8(self) -> FP8Options | None:
        return self.fp8() if self.fp8 is not None else None


PLAIN = LinearMode()
"""High precision, weight gradients in the same backward."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           store: WeightGradStore | None = None,
           fp8: FP8Options | None = None) -> torch.Tensor:
    """``x W^T + b``; FP8 when ``fp8`` is given; the weight gradient deferred to ``store``
    while it is deferring."""
    if fp8 is not None:
        defer = store.defer if store is not None else None
        return fp8_linear(x, weight, bias, fp8.recipe, fp8.grad_format, defer)
    if store is None:
        return F.linear(x, weight, bias)
    return LinearSplitBackward.apply(x, weight, bias, store)
