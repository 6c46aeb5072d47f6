"""MXFP8: OCP Microscaling FP8 with one power-of-two (E8M0) scale per 32 elements.

A block of 32 consecutive elements along the reduction dimension of a product shares one
8-bit exponent ``e`` (E8M0: the value ``2**(e - 127)``; 255 is NaN). An element is stored as
E4M3 (or E5M2) ``x / 2**(e - 127)``, so dequantising is a multiplication by a power of two:
exact. The scale rule follows torchao's ``to_mx`` bit for bit (tests/test_mx_formats.py checks
every element and exponent against it):

* ``rceil`` (the default; cuBLAS, Transformer Engine and torchao's training recipes):
  ``e = ceil(log2(amax / fmt.max)) + 127`` clamped to [0, 254], so the block's largest value
  lands at or below ``fmt.max``; an infinite amax gives 254, a NaN amax 255; a block whose
  exponent is 0 (amax below ``fmt.max * 2**-127``, zeros included) is stored unscaled;
* ``floor`` (the OCP spec's rule): ``e = floor(log2(amax)) - emax(fmt) + 127``, the block's
  largest value may exceed ``fmt.max`` and saturates.

:class:`MXScaling` is the recipe of a linear layer: every operand is quantised along the
dimension its product reduces, so each of the three products quantises its operands afresh in
their own layout (torchao's ``mx_mm`` does the same): the forward's ``x`` and ``W`` along
``in_features``, the input gradient's ``grad_y`` along ``out_features`` and ``W`` along
``out_features`` (32 x 1 blocks of ``W``), the weight gradient's ``grad_y`` and ``x`` along the
tokens. Products are emulated (dequantised operands multiplied in fp32) on every device here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from meshtron.errors import MeshtronError
from meshtron.precision.fp8 import (
    E4M3,
    E5M2,
    FP8Format,
    Quantized,
    Role,
    ScalingRecipe,
    Tile,
)

MX_BLOCK = 32
"""Elements per E8M0 scale (the OCP MX block size)."""

E8M0_BIAS = 127
E8M0_NAN = 255

ScaleRule = Literal["rceil", "floor"]
SCALE_RULES: tuple[ScaleRule, ...] = ("rceil", "floor")

EMAX = {E4M3.name: 8, E5M2.name: 15}
"""Exponent of the largest power of two each element format holds (256, 32768)."""

F32_MIN_NORMAL = 2.0**-126


def _rceil_exponents(amax: Tensor, fmt: FP8Format) -> Tensor:
    """``ceil(log2(amax / fmt.max)) + 127`` in [0, 254]; 254 for an infinite amax, 255 for
    NaN. ``log2`` is torch's, as torchao computes it."""
    descale = amax / fmt.max
    finite = torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS
    e = torch.where(torch.isinf(descale), 254.0, finite)
    return torch.where(torch.isnan(descale), float(E8M0_NAN), e).to(torch.uint8)


def _floor_exponents(amax: Tensor, fmt: FP8Format) -> Tensor:
    """``floor(log2(amax)) - emax(fmt) + 127`` from amax's fp32 exponent bits, in [0, 255];
    255 for a NaN amax."""
    pow2 = (amax.view(torch.int32) >> 23 & 0xFF) - E8M0_BIAS
    e = torch.clamp(pow2 - EMAX[fmt.name], -E8M0_BIAS, E8M0_BIAS + 1) + E8M0_BIAS
    return torch.where(torch.isnan(amax), E8M0_NAN, e).to(torch.uint8)


def _scaled(blocks: Tensor, e: Tensor, amax: Tensor, fmt: FP8Format,
            rule: ScaleRule) -> Tensor:
    """The blocks' elements divided by their scales, before saturation and the cast."""
    if rule == "rceil":
        factor = torch.exp2(E8M0_BIAS - e.float())
        factor = torch.where(e == 0, 1.0, torch.where(e == 254, 2.0**-127, factor))
        return blocks * torch.where(e == E8M0_NAN, amax / fmt.max, factor)  # NaN stays NaN
    scale = (e.to(torch.int32) << 23).view(torch.float32).clamp(min=F32_MIN_NORMAL)
    return blocks / scale


def mx_quantize(x: Tensor, fmt: FP8Format = E4M3, block: int = MX_BLOCK,
                rule: ScaleRule = "rceil") -> tuple[Tensor, Tensor]:
    """``x`` in blocks of ``block`` along its last dimension: ``(data, exponents)``, the fp8
    elements (``x``'s shape) and the biased E8M0 exponents as uint8 (``[..., K / block]``).

    Non-finite inputs follow torchao: a NaN spreads to its block's elements (rceil) or stays
    where it was (floor), an infinity saturates to ``fmt.max``.
    """
    if x.shape[-1] % block:
        raise MeshtronError(f"mx quantisation needs the reduction dimension divisible by the "
                            f"block of {block} elements, got {x.shape[-1]}")
    if rule not in SCALE_RULES:
        raise MeshtronError(f"unknown mx scale rule {rule!r}; use one of {list(SCALE_RULES)}")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    e = _rceil_exponents(amax, fmt) if rule == "rceil" else _floor_exponents(amax, fmt)
    v = _scaled(blocks, e, amax, fmt, rule)
    data = v.clamp(-fmt.max, fmt.max).to(fmt.dtype).reshape(x.shape)
    return data, e.squeeze(-1)


def e8m0_values(e: Tensor) -> Tensor:
    """The fp32 value ``2**(e - 127)`` of each biased exponent; NaN for 255."""
    value = torch.exp2(e.float() - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.nan, value)


def mx_dequantize(data: Tensor, e: Tensor, block: int = MX_BLOCK) -> Tensor:
    """The fp32 values of MX ``data`` (blocks along the last dimension) with exponents ``e``."""
    v = data.float().reshape(*data.shape[:-1], data.shape[-1] // block, block)
    return (v * e8m0_values(e).unsqueeze(-1)).reshape(data.shape)


def check_finite_amax(x: Tensor, what: str) -> None:
    """:class:`MeshtronError` when ``x`` holds an infinity or NaN: a block scale cannot be
    formed from a non-finite amax, and training that reaches one has diverged."""
    if not bool(torch.isfinite(x).all()):
        raise MeshtronError(f"non-finite amax (inf or nan) in the {what} of a low-precision "
                            "linear layer: the run diverged; lower train.lr or keep this "
                            "layer in high precision (precision.keep_layers)")


def mx_operand(x: Tensor, fmt: FP8Format, rule: ScaleRule, role: str) -> Quantized:
    """The 2-D ``x`` [rows, k] MX-quantised along k, as a :class:`Quantized` whose per-tile
    divisor ``2**(127 - e)`` dequantises it exactly (tiles 1 x 32)."""
    check_finite_amax(x, role)
    data, e = mx_quantize(x, fmt, MX_BLOCK, rule)
    return Quantized(data, 1.0 / e8m0_values(e), (1, MX_BLOCK))


def mx_operand_along_rows(x: Tensor, fmt: FP8Format, rule: ScaleRule, role: str) -> Quantized:
    """``x`` [rows, k] MX-quantised along its rows (32 x 1 tiles), as the weight gradient's
    reduction over tokens needs; a ragged last tile is quantised as if zero-padded."""
    rows = x.shape[0]
    padded = torch.nn.functional.pad(x.t().float(), (0, -rows % MX_BLOCK))
    q = mx_operand(padded.contiguous(), fmt, rule, role).t()
    return Quantized(q.data[:rows], q.scale, q.tile)


class MXScaling(ScalingRecipe):
    """MXFP8 scaling of one linear layer (see the module docstring); stateless.

    The reduction dimensions of the forward and input-gradient products (``in_features`` and
    ``out_features`` of this rank's shard) must be multiples of 32; the tokens need not be.
    A non-finite amax raises :class:`MeshtronError`.
    """

    gemm = "emulated"
    weight_scales_in_backward = False

    def __init__(self, rule: ScaleRule = "rceil"):
        if rule not in SCALE_RULES:
            raise MeshtronError(f"unknown mx scale rule {rule!r}; use one of "
                                f"{list(SCALE_RULES)}")
        self.rule = rule

    def scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, Tile]:
        q = self.quantize(x, role, fmt)
        return q.scale, (1, MX_BLOCK)

    def quantize(self, x: Tensor, role: Role, fmt: FP8Format) -> Quantized:
        check_mx_shape(x.shape[1], role)
        return mx_operand(x, fmt, self.rule, role)

    def quantize_wgrad(self, x: Tensor, role: Role, fmt: FP8Format,
                       reuse: Quantized) -> Quantized:
        if role == "weight":
            return reuse
        return mx_operand_along_rows(x, fmt, self.rule, role)

    def weight_for_grad_input(self, weight: Tensor, scale: Tensor | None,
                              tile: Tile | None) -> Quantized:
        check_mx_shape(weight.shape[0], "grad_output")
        return mx_operand(weight.detach().t().contiguous(), E4M3, self.rule, "weight")


def check_mx_shape(features: int, role: str) -> None:
    """:class:`MeshtronError` unless ``features`` (the reduction dimension of ``role``'s
    product on this rank) is a whole number of MX blocks."""
    if features % MX_BLOCK:
        name = "out_features" if role == "grad_output" else "in_features"
        raise MeshtronError(f"precision.fp8=mxfp8 needs {name} divisible by the MX block of "
                            f"{MX_BLOCK}, got {features}; pad the model or use tensorwise "
                            "scaling")


GroupedMatmul = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``(rows [R, k], weights [G, n, k], counts [G]) -> [R, n]``: each group of rows times its
own weight transposed (:func:`meshtron.parallel.experts.grouped.grouped_matmul`)."""


def _mx_weights(w: Tensor, rule: ScaleRule, role: str) -> Tensor:
    """Stacked weights [G, n, k] MX-quantised along k and dequantised (fp32)."""
    check_finite_amax(w, role)
    return mx_dequantize(*mx_quantize(w.detach(), E4M3, MX_BLOCK, rule))


def _segments_along_rows(x: Tensor, sizes: list[int], fmt: FP8Format, rule: ScaleRule,
                         role: str) -> list[Quantized]:
    """``x`` [rows, k] cut into segments of ``sizes`` rows, each MX-quantised along its rows
    on its own (its blocks of 32 start at its first row; empty segments left out)."""
    return [mx_operand_along_rows(part, fmt, rule, role)
            for part in x.split(sizes) if len(part)]


def _joined(parts: list[Quantized]) -> Tensor:
    """The dequantised segments of :func:`_segments_along_rows`, one below the other."""
    return torch.cat([q.dequantize() for q in parts])


class _MXGrouped(torch.autograd.Function):
    """The MoE experts' grouped product in MXFP8: each of its three products quantises its
    operands along its own reduction, as :class:`MXScaling` does for one layer. The weight
    gradient's token blocks run inside each expert's rows, and inside the rows of each source
    where ``sources`` [G, S] counts them (expert parallelism: a micro-batch's rows from each
    ep rank, quantised as that rank's one-process micro-batch is)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: Tensor, rule: ScaleRule,
                grad_fmt: FP8Format, matmul: GroupedMatmul, sources: Tensor | None) -> Tensor:
        check_mx_shape(w.shape[-1], "input")
        qx = mx_operand(x.detach(), E4M3, rule, "input").dequantize()
        y = matmul(qx, _mx_weights(w, rule, "weight"), counts)
        sizes = (counts[:, None] if sources is None else sources).tolist()
        # the weight gradient's operand, quantised now: x itself is not kept for backward
        ctx.qx_rows = [_segments_along_rows(xg, parts, E4M3, rule, "input")
                       for xg, parts in zip(x.detach().split(counts.tolist()), sizes)]
        ctx.save_for_backward(w, counts)
        ctx.rule, ctx.grad_fmt, ctx.matmul, ctx.x_dtype = rule, grad_fmt, matmul, x.dtype
        ctx.sizes = sizes
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        w, counts = ctx.saved_tensors
        check_mx_shape(w.shape[1], "grad_output")
        gy = mx_operand(grad_y, ctx.grad_fmt, ctx.rule, "output gradient")
        wt = _mx_weights(w.transpose(1, 2).contiguous(), ctx.rule, "weight")
        grad_x = ctx.matmul(gy.dequantize(), wt, counts).to(ctx.x_dtype)
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        groups = zip(ctx.qx_rows, grad_y.split(counts.tolist()), ctx.sizes)
        for g, (qx, gyg, parts) in enumerate(groups):
            if qx:
                qg = _segments_along_rows(gyg, parts, ctx.grad_fmt, ctx.rule, "output gradient")
                grad_w[g] = _joined(qg).t() @ _joined(qx)
        return grad_x, grad_w.to(w.dtype), None, None, None, None, None


@dataclass(frozen=True)
class MXExperts:
    """MXFP8 for a MoE layer's grouped expert products (the block's ``precision.fp8=mxfp8``)."""

    rule: ScaleRule = "rceil"
    grad_format: FP8Format = E5M2

    def matmul(self, x: Tensor, weights: Tensor, counts: Tensor, grouped: GroupedMatmul,
               sources: Tensor | None = None) -> Tensor:
        """``grouped(x, weights, counts)`` with every product's operands in MXFP8;
        ``sources`` [G, S]: each group's rows by the ep rank they came from (None: one)."""
        return _MXGrouped.apply(x, weights, counts, self.rule, self.grad_format, grouped,
                                sources)
