"""FP8 parameter all-gather: the low-precision layers' weights as E4M3 with one power-of-two
scale per weight (``precision.fp8_param_gather``).

Under ZeRO-3 a weight exists in full only after an all-gather of every rank's shard. Gathering
it in E4M3 (1 byte an element) instead of ``precision.dtype`` (2 or 4) halves or quarters
those bytes, as Megatron-Core's FP8 parameter gather does. For the numbers to stay the same in
every layout, the weight a layer computes with is defined as :func:`round_trip` of the whole
weight, whatever the layout: ``deq(q(W))`` with ``q`` E4M3 at the scale
``2**floor(log2(448 / amax(W)))`` (the amax of the whole global tensor). A run that gathers in
FP8 quantises each shard with that scale (the amax agreed over the shard group and tp x cp);
one that does not (one process, ZeRO 0-2) applies the round trip in the layer. Because the
scale is a power of two, the round trip is idempotent bit for bit (E4M3 values times a power of
two that stays in range are E4M3 values), so the layer applying it again to a gathered weight
changes nothing: one quantisation, one set of numbers.

The layer's own FP8 recipe (tensor-wise, block-wise or MXFP8) then quantises that weight as it
would any other.

NVFP4 layers' weights travel in FP4 instead (:class:`FP4WeightGather`): E2M1 codes at the
scales of the whole weight's single NVFP4 quantisation. NVFP4's round trip is not idempotent
(the block scales of a quantised block are not its old ones), so the layer must not quantise
the gathered weight again: the gather hands it the scales, and it encodes the gathered values
at those scales, which gives back the gathered codes exactly. Without a gather the layer
quantises its weight once itself: the same numbers in every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from meshtron.precision.fp8 import (
    E4M3,
    AmaxReduce,
    FP8Format,
    Quantized,
    Role,
    ScalingRecipe,
    Tile,
    dequantize,
    quantize,
    scale_from_amax,
)

GATHER_FORMAT: FP8Format = E4M3


def gather_scale(amax: Tensor) -> Tensor:
    """The power-of-two E4M3 scale of a weight (or of each weight, for a vector of amaxes)
    whose whole-tensor amax is ``amax``; 1 where amax is 0 or not finite."""
    return scale_from_amax(amax, GATHER_FORMAT, power_of_two=True)


def quantize_for_gather(x: Tensor, scale: Tensor) -> Tensor:
    """The E4M3 bytes of ``x`` (any shape) at ``scale``, as uint8."""
    return quantize(x, GATHER_FORMAT, scale)[0].view(torch.uint8)


def dequantize_gathered(data: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """E4M3 bytes (uint8) back to ``dtype`` values; exact, since the scale is a power of two
    and E4M3 values fit bf16 and fp32."""
    return dequantize(data.view(GATHER_FORMAT.dtype), scale).to(dtype)


@dataclass(frozen=True)
class WeightGather:
    """How a layer's weight is gathered in FP8: ``reduce_amax`` agrees an amax over the ranks
    holding parts of the same weight (tp x cp; None on one such rank)."""

    reduce_amax: AmaxReduce | None = None

    def amax(self, x: Tensor) -> Tensor:
        """The whole weight's amax from this rank's part (agreed over tp x cp)."""
        amax = x.detach().abs().amax().float()
        return amax if self.reduce_amax is None else self.reduce_amax(amax)

    def round_trip(self, weight: Tensor) -> Tensor:
        """``deq(q(weight))`` in ``weight``'s dtype: the weight the layer computes with."""
        scale = gather_scale(self.amax(weight))
        w = weight.detach()
        return dequantize_gathered(quantize_for_gather(w, scale), scale, w.dtype)


class GatheredWeights(ScalingRecipe):
    """A layer's FP8 recipe whose weight operands are first :meth:`WeightGather.round_trip`-ed
    (the weight as the FP8 gather delivers it); everything else is ``inner``'s."""

    def __init__(self, inner: ScalingRecipe, gather: WeightGather):
        self.inner = inner
        self.gather = gather
        self.gemm = inner.gemm
        self.weight_scales_in_backward = inner.weight_scales_in_backward

    def scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, Tile | None]:
        return self.inner.scales(x, role, fmt)

    def quantize(self, x: Tensor, role: Role, fmt: FP8Format) -> Quantized:
        if role == "weight":
            x = self.gather.round_trip(x)
        return self.inner.quantize(x, role, fmt)

    def quantize_wgrad(self, x: Tensor, role: Role, fmt: FP8Format,
                       reuse: Quantized) -> Quantized:
        return self.inner.quantize_wgrad(x, role, fmt, reuse)

    def weight_for_grad_input(self, weight: Tensor, scale: Tensor | None,
                              tile: Tile | None) -> Quantized:
        return self.inner.weight_for_grad_input(self.gather.round_trip(weight), scale, tile)


@dataclass
class FP4WeightGather:
    """How an NVFP4 layer's weight is gathered in FP4 (``reduce_amax`` as for
    :class:`WeightGather`). The gather :meth:`deliver`-s the scales it quantised the whole
    weight with; the layer takes them (:meth:`scales_for`) for the buffer they came with."""

    reduce_amax: AmaxReduce | None = None
    _delivered: tuple[int, Tensor, Tensor] | None = field(default=None, repr=False)
    """(the gathered weight's address, its E4M3 tile scales, its fp32 per-tensor scale)."""

    def deliver(self, weight: Tensor, block_scale: Tensor, tensor_scale: Tensor) -> None:
        """``weight`` (the gathered buffer's view) holds values quantised at these scales."""
        self._delivered = (weight.data_ptr(), block_scale, tensor_scale)

    def scales_for(self, weight: Tensor) -> tuple[Tensor, Tensor] | None:
        """The delivered (tile scales, per-tensor scale) if ``weight`` is the buffer they came
        with (ZeRO-3 refills the same storage at each gather, delivering again); None where
        nothing was gathered (one process, ZeRO 0-2)."""
        if self._delivered is None or weight.numel() == 0:
            return None
        address, block, tensor = self._delivered
        if address != weight.data_ptr():
            return None
        return block, tensor
