"""The matrix product of every linear layer: plain, with a split backward, or in FP8.

Layers that take part in zero-bubble pipelines carry a :class:`WeightGradStore`; layers that
run in FP8 carry an :class:`FP8Options` (a scaling recipe object of their own: delayed scaling
keeps per-layer amax history). Embeddings, the output layer, norms and the loss never do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtron.parallel.weight_grad import LinearSplitBackward, WeightGradStore
from meshtron.precision.fp8 import ScalingRecipe, fp8_linear


@dataclass
class FP8Options:
    recipe: ScalingRecipe
    grad_format: str = "e5m2"


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
