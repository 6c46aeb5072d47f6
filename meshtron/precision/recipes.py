"""Which number format each block's linear layers compute in: the per-layer precision policy.

``precision.fp8`` names the FP8 recipe of the blocks (tensorwise, delayed, blockwise, mxfp8),
``precision.fp4=nvfp4`` puts blocks in NVFP4 (``precision.fp4_layers``, by default every block),
and ``precision.keep_layers`` keeps chosen blocks in the run's own dtype whatever the others say
(NVIDIA's NVFP4 recipe keeps the last few blocks in bf16, Megatron-Core the first and the last:
``[0, -1]``). Embeddings, norms, attention cores, the router and the output layer are never
quantised. A block's layers each get their own options object (delayed scaling keeps one amax
history per layer).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

from meshtron.config.sections import PrecisionConfig
from meshtron.precision.fp8 import (
    AmaxReduce,
    ScalingRecipe,
    WeightGradHook,
    fp8_format,
    fp8_linear,
    make_recipe,
)
from meshtron.precision.mx import MXExperts, MXScaling
from meshtron.precision.nvfp4 import NVFP4Options, TokenIndex
from meshtron.precision.param_gather import FP4WeightGather, GatheredWeights, WeightGather

Format = Literal["fp4", "fp8", "high"]


class LowPrecision(Protocol):
    """One linear layer's low-precision product."""

    def apply(self, x: Tensor, weight: Tensor, bias: Tensor | None,
              defer: WeightGradHook | None = None, features: Tensor | None = None
              ) -> Tensor:
        """``x @ weight^T + bias``; ``features``: the global numbers of ``weight``'s rows."""


@dataclass
class FP8Options:
    """One linear layer's FP8 recipe object and the format of its output gradients."""

    recipe: ScalingRecipe
    grad_format: str = "e5m2"
    gather: WeightGather | None = None
    """``precision.fp8_param_gather``: how the weight is gathered (the recipe then quantises
    its FP8 round trip, :class:`GatheredWeights`)."""

    def apply(self, x: Tensor, weight: Tensor, bias: Tensor | None,
              defer: WeightGradHook | None = None, features: Tensor | None = None
              ) -> Tensor:
        return fp8_linear(x, weight, bias, self.recipe, self.grad_format, defer)


def uses_low_precision(pc: PrecisionConfig) -> bool:
    """Whether any block linear layer computes in FP8 or FP4."""
    return pc.fp8 != "none" or pc.fp4 != "none"


def resolve_layers(layers: list[int] | None, num_layers: int) -> frozenset[int]:
    """Block indices, negative ones counted from the end."""
    return frozenset(i % num_layers for i in layers or ())


def layer_format(pc: PrecisionConfig, num_layers: int, layer: int | None) -> Format:
    """The format of block ``layer``'s linear layers (None or an MTP block beyond the
    decoder: the default, as if not listed anywhere)."""
    inside = layer is not None and layer < num_layers
    if inside and layer in resolve_layers(pc.keep_layers, num_layers):
        return "high"
    if pc.fp4 != "none" and (pc.fp4_layers is None or (
            inside and layer in resolve_layers(pc.fp4_layers, num_layers))):
        return "fp4"
    return "fp8" if pc.fp8 != "none" else "high"


def fp8_recipe(pc: PrecisionConfig, reduce_amax: AmaxReduce | None) -> ScalingRecipe:
    """A fresh recipe object for one layer, as ``precision.fp8`` names it."""
    if pc.fp8 == "mxfp8":
        return MXScaling(pc.mx_scale)  # type: ignore[arg-type]
    knobs: dict = {"block": pc.fp8_block} if pc.fp8 == "blockwise" else {}
    if pc.fp8 == "delayed":
        knobs = {"history_len": pc.fp8_history, "reduction": pc.fp8_amax}
    return make_recipe(pc.fp8, reduce_amax, **knobs)


class LayerPolicy:
    """Makes each linear layer's low-precision options by its block (``options(layer)``);
    None keeps the layer in high precision. ``reduce_amax`` agrees an amax over the ranks
    holding parts of one tensor (tp and cp); ``token_index`` places a cp rank's tokens in their
    sequences (NVFP4's stochastic rounding keys its draws by token numbers)."""

    def __init__(self, pc: PrecisionConfig, num_layers: int, seed: int = 0,
                 reduce_amax: AmaxReduce | None = None, token_index: TokenIndex | None = None):
        self.pc = pc
        self.num_layers = num_layers
        self.seed = seed
        self.reduce_amax = reduce_amax
        self.token_index = token_index

    def options(self, layer: int | None) -> LowPrecision | None:
        fmt = layer_format(self.pc, self.num_layers, layer)
        if fmt == "high":
            return None
        gathered = self.pc.fp8_param_gather
        if fmt == "fp8":
            recipe = fp8_recipe(self.pc, self.reduce_amax)
            gather = WeightGather(self.reduce_amax) if gathered else None
            if gather is not None:
                recipe = GatheredWeights(recipe, gather)
            return FP8Options(recipe, self.pc.fp8_grad, gather)
        return NVFP4Options(layer_seed(self.seed, layer), self.reduce_amax,
                            self.pc.fp4_hadamard, self.pc.fp4_stochastic,
                            FP4WeightGather(self.reduce_amax) if gathered else None,
                            self.token_index)

    def experts(self, layer: int | None) -> MXExperts | None:
        """The MoE experts' grouped products of block ``layer``: MXFP8 where the block's
        format is ``precision.fp8=mxfp8``; other formats keep them in high precision."""
        if self.pc.fp8 != "mxfp8" or layer_format(self.pc, self.num_layers, layer) != "fp8":
            return None
        return MXExperts(self.pc.mx_scale, fp8_format(self.pc.fp8_grad))  # type: ignore

    def __call__(self) -> LowPrecision | None:
        """A layer outside the numbered blocks: the default format."""
        return self.options(None)


def layer_seed(seed: int, layer: int | None) -> int:
    """A 32-bit seed for block ``layer``'s Hadamard signs and stochastic rounding: a function
    of the run's seed and the global block index only, so every layout draws alike."""
    return zlib.crc32(f"{seed}/{layer}".encode())


def formats_said(pc: PrecisionConfig) -> str:
    """The start-up line's account of the blocks' formats, e.g. ``fp8: mxfp8 scaling in
    every block linear layer (gradients e5m2)``."""
    fp4_blocks = "every block" if pc.fp4_layers is None else \
        f"block{'s' * (len(pc.fp4_layers) > 1)} {', '.join(map(str, pc.fp4_layers))}"
    parts = []
    if pc.fp4 != "none":
        parts.append(f"fp4: {pc.fp4} in the linear layers of {fp4_blocks} (16x16 weight blocks"
                     f"{', Hadamard-transformed weight-gradient inputs' * pc.fp4_hadamard}"
                     f"{', stochastically rounded gradients' * pc.fp4_stochastic})")
    if pc.fp8 != "none":
        where = "every block linear layer" if pc.fp4 == "none" else \
            "the other blocks' linear layers"
        parts.append(f"fp8: {pc.fp8} scaling in {where} (gradients "
                     f"{pc.fp8_grad})")
    if pc.keep_layers:
        parts.append(f"blocks {', '.join(map(str, pc.keep_layers))} kept in {pc.dtype}")
    return "; ".join(parts)
