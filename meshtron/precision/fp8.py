"""FP8 linear layers: formats, scaling recipes, and an FP8 ``linear`` with two GEMM paths.

A tensor is quantised by multiplying it by a scale, clamping to the format's range (saturation,
as Transformer Engine does) and casting to torch's float8 dtype; dequantising divides the fp8
values, read as fp32, by the same scale. :func:`fp8_linear` forms each product either with
``torch._scaled_mm`` on the fp8 data (a real FP8 GEMM on sm89+ GPUs; torch also runs it on CPU)
or by multiplying dequantised operands in fp32 (emulation). Both are the numerical model of an
FP8 GEMM with fp32 accumulation and agree up to fp32 rounding and accumulation order.
``_scaled_mm`` takes one scale per tensor here, so block-wise scaling is always emulated, and
the default ("auto") uses it only where it is a native GEMM (CUDA): torch's CPU kernel took
100-270x the emulation's CPU time for the test model's products (fwd + bwd, one thread).

Three recipes give the scales (see docs/precision.md, section "FP8"):

* :class:`TensorwiseScaling` - current scaling, one scale per tensor from its own amax;
* :class:`DelayedScaling` - one scale per tensor from an amax history of earlier steps;
* :class:`BlockwiseScaling` - DeepSeek-V3's fine-grained scaling: 1 x B tiles along the
  reduction dimension for activations and output gradients, B x B blocks for weights.

A recipe object belongs to one linear layer: the delayed one holds that layer's amax history.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from meshtron.errors import MeshtronError

Role = Literal["input", "weight", "grad_output"]
"""Which operand of a linear layer a tensor is."""

ROLES: tuple[Role, ...] = ("input", "weight", "grad_output")

Tile = tuple[int, int]
"""(rows, cols) of the tiles of a 2-D tensor that share one scale."""

AmaxReduce = Callable[[Tensor], Tensor]
"""Agrees an amax across ranks, e.g. an all-reduce-max over the tensor-parallel group."""

WeightGradHook = Callable[[Tensor, Tensor, Tensor], bool]
"""Called in backward with (weight, dequantised x, dequantised grad_y), both 2-D fp32; returns
True when it takes the weight gradient ``grad_y^T @ x`` to form later."""

Gemm = Literal["auto", "scaled_mm", "emulated"]
"""How FP8 products run: ``torch._scaled_mm`` where it is a native GEMM ("auto", see
:func:`scaled_mm_by_default`), always ("scaled_mm", an error where it cannot run, torch's slow
CPU kernel included), or never ("emulated": dequantise and multiply in fp32)."""

GEMMS: tuple[Gemm, ...] = ("auto", "scaled_mm", "emulated")

SCALED_MM_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first FP8 tensor cores (Ada; Hopper is 9.0)."""


def check_gemm(gemm: str) -> Gemm:
    """``gemm`` if it names a GEMM path, else :class:`MeshtronError`."""
    if gemm not in GEMMS:
        raise MeshtronError(f"unknown fp8 gemm {gemm!r}; use one of {list(GEMMS)}")
    return gemm  # type: ignore[return-value]


@dataclass(frozen=True)
class FP8Format:
    """An FP8 number format: its torch dtype and its largest finite value."""

    name: str
    dtype: torch.dtype
    max: float


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = FP8Format("e5m2", torch.float8_e5m2, 57344.0)
FORMATS = MappingProxyType({f.name: f for f in (E4M3, E5M2)})


def fp8_format(fmt: FP8Format | str) -> FP8Format:
    """The format named ``fmt`` ("e4m3" or "e5m2"); a format is returned as is."""
    if isinstance(fmt, FP8Format):
        return fmt
    if fmt not in FORMATS:
        raise MeshtronError(f"unknown fp8 format {fmt!r}; use one of {sorted(FORMATS)}")
    return FORMATS[fmt]


def quantize(x: Tensor, fmt: FP8Format | str, scale: Tensor | float) -> tuple[Tensor, Tensor]:
    """``x * scale`` clamped to the format's range and cast to fp8; returns ``(q, scale)``.

    ``scale`` is broadcast against ``x``. Non-finite values become NaN rather than saturating,
    so an overflow upstream stays visible (for example to the fp16 loss scaler).
    """
    fmt = fp8_format(fmt)
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    v = x.float() * scale
    v = torch.where(torch.isfinite(v), v.clamp(-fmt.max, fmt.max), torch.nan)
    return v.to(fmt.dtype), scale


def dequantize(q: Tensor, scale: Tensor | float) -> Tensor:
    """fp32 values of fp8 ``q`` quantised with ``scale``: ``q.float() / scale``."""
    return q.float() / scale


def scale_from_amax(amax: Tensor, fmt: FP8Format, margin: int = 0,
                    power_of_two: bool = False) -> Tensor:
    """``fmt.max / amax / 2**margin``; 1 where amax is 0 or not finite.

    With ``power_of_two`` the scale is rounded down to a power of two, which makes the scaling
    itself exact.
    """
    amax = amax.float()
    ok = (amax > 0) & torch.isfinite(amax)
    scale = fmt.max / torch.where(ok, amax, 1.0) / 2.0**margin
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return torch.where(ok, scale, 1.0)


def tile_amax(x: Tensor, tile: Tile) -> Tensor:
    """Max of ``|x|`` over each ``tile`` of the 2-D ``x``; a ragged last tile is allowed.

    Returns a tensor of shape ``[ceil(rows / tile[0]), ceil(cols / tile[1])]``.
    """
    r, c = tile
    rows, cols = x.shape
    a = torch.nn.functional.pad(x.detach().abs().float(), (0, -cols % c, 0, -rows % r))
    return a.reshape(a.shape[0] // r, r, a.shape[1] // c, c).amax(dim=(1, 3))


def expand_tiles(scale: Tensor, tile: Tile, shape: torch.Size | tuple[int, int]) -> Tensor:
    """Per-tile ``scale`` repeated to one value per element of a 2-D tensor of ``shape``."""
    full = scale.repeat_interleave(tile[0], dim=0).repeat_interleave(tile[1], dim=1)
    return full[: shape[0], : shape[1]]


@dataclass
class Quantized:
    """An fp8 tensor and its scales: one scalar, or one per ``tile`` of a 2-D tensor."""

    data: Tensor
    scale: Tensor
    tile: Tile | None = None

    def dequantize(self) -> Tensor:
        """The fp32 values this tensor stands for."""
        if self.tile is None:
            return dequantize(self.data, self.scale)
        return dequantize(self.data, expand_tiles(self.scale, self.tile, self.data.shape))

    def t(self) -> Quantized:
        """The transpose of a 2-D tensor: a view of the fp8 data, scales (and tiles) swapped."""
        if self.tile is None:
            return Quantized(self.data.t(), self.scale)
        return Quantized(self.data.t(), self.scale.t(), (self.tile[1], self.tile[0]))


def scaled_mm_supported(device: torch.device, a_dtype: torch.dtype, b_dtype: torch.dtype,
                        m: int, k: int, n: int) -> bool:
    """Whether ``torch._scaled_mm`` multiplies fp8 ``[m, k] @ [k, n]`` of these dtypes on
    ``device`` with per-tensor scales.

    Decided from the device and the shapes, nothing cached: torch's CPU kernel takes every
    E4M3/E5M2 combination and any shape; CUDA needs compute capability 8.9+ (not ROCm, whose
    fp8 types differ), k and n multiples of 16, and refuses two E5M2 operands.
    """
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if torch.cuda.get_device_capability(device) < SCALED_MM_MIN_CAPABILITY:
        return False
    if a_dtype == b_dtype == torch.float8_e5m2:
        return False
    return k % 16 == 0 and n % 16 == 0


def scaled_mm_by_default(device: torch.device, a_dtype: torch.dtype, b_dtype: torch.dtype,
                         m: int, k: int, n: int) -> bool:
    """Whether ``gemm="auto"`` runs this product through ``torch._scaled_mm``: only where it
    is a native FP8 GEMM, on CUDA (:func:`scaled_mm_supported`). On CPU the emulation gives
    the same numbers up to fp32 accumulation order at a hundredth of the kernel's time, so
    "auto" emulates there; ``gemm="scaled_mm"`` still runs the CPU kernel."""
    return device.type == "cuda" and scaled_mm_supported(device, a_dtype, b_dtype, m, k, n)


def fp8_matmul(a: Quantized, b: Quantized, gemm: Gemm = "auto") -> Tensor:
    """``a @ b^T`` in fp32 for 2-D quantised ``a`` [m, k] and ``b`` [n, k].

    With one scale per tensor and ``gemm`` "scaled_mm", or "auto" where that is a native GEMM
    (:func:`scaled_mm_by_default`), this is ``torch._scaled_mm`` on the fp8 data with the
    inverse scales (fp32 accumulation and output); its layouts (row-major ``a``, column-major
    second operand) come from contiguous copies where needed. Otherwise the dequantised
    operands are multiplied in fp32.
    """
    if gemm != "emulated":
        (m, k), n = a.data.shape, b.data.shape[0]
        per_tensor = a.tile is None and b.tile is None
        runs = scaled_mm_supported if gemm == "scaled_mm" else scaled_mm_by_default
        if per_tensor and runs(a.data.device, a.data.dtype, b.data.dtype, m, k, n):
            return torch._scaled_mm(a.data.contiguous(), b.data.contiguous().t(),
                                    scale_a=a.scale.reciprocal(), scale_b=b.scale.reciprocal(),
                                    out_dtype=torch.float32, use_fast_accum=False)
        if gemm == "scaled_mm":
            why = ("block-wise scales" if not per_tensor else
                   f"{a.data.dtype} x {b.data.dtype} operands of [{m}, {k}] @ [{k}, {n}] on "
                   f"{a.data.device} (CUDA needs compute capability 8.9+, dimensions k and n "
                   f"multiples of 16 and at most one e5m2 operand)")
            raise MeshtronError(f"fp8 gemm 'scaled_mm' cannot multiply {why}; use gemm='auto' "
                                f"to fall back to emulation")
    return a.dequantize() @ b.dequantize().t()


def quantize_tiles(x: Tensor, fmt: FP8Format, scale: Tensor, tile: Tile | None) -> Quantized:
    """Quantise ``x`` with a scalar ``scale`` (``tile`` None) or one scale per ``tile``."""
    full = scale if tile is None else expand_tiles(scale, tile, x.shape)
    return Quantized(quantize(x, fmt, full)[0], scale, tile)


class ScalingRecipe(ABC):
    """Gives the scales of a linear layer's fp8 operands; one object per layer.

    :meth:`scales` returns ``(scale, tile)`` for a 2-D operand: a scalar scale with tile None,
    or one scale per tile. :meth:`wgrad_scales` may return different scales for the operands of
    the weight-gradient product ``grad_y^T @ x`` (whose reduction runs over tokens); None means
    that product reuses the forward's ``x`` and the input-gradient's ``grad_y``. ``gemm``
    chooses how :func:`fp8_linear` forms the layer's products (see :data:`Gemm`).
    """

    gemm: Gemm = "auto"
    weight_scales_in_backward: bool = True
    """Whether :meth:`weight_for_grad_input` needs the forward's weight scales (kept from
    forward to backward; MX quantises the weight afresh along ``out`` and needs none)."""

    @abstractmethod
    def scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, Tile | None]:
        """``(scale, tile)`` for the 2-D operand ``x`` playing ``role``."""

    def wgrad_scales(self, x: Tensor, role: Role,
                     fmt: FP8Format) -> tuple[Tensor, Tile | None] | None:
        return None

    def quantize(self, x: Tensor, role: Role, fmt: FP8Format) -> Quantized:
        """The 2-D operand ``x`` quantised for ``role`` in the forward / input-gradient
        products (a recipe with its own rounding, such as MX, overrides this)."""
        scale, tile = self.scales(x, role, fmt)
        return quantize_tiles(x, fmt, scale, tile)

    def quantize_wgrad(self, x: Tensor, role: Role, fmt: FP8Format,
                       reuse: Quantized) -> Quantized:
        """``x`` quantised for the weight-gradient product: ``reuse`` unless the recipe scales
        that product's operands on their own (:meth:`wgrad_scales`)."""
        got = self.wgrad_scales(x, role, fmt)
        return reuse if got is None else quantize_tiles(x, fmt, *got)

    def weight_for_grad_input(self, weight: Tensor, scale: Tensor | None,
                              tile: Tile | None) -> Quantized:
        """The weight operand of ``grad_x = grad_y @ W`` as ``[in, out]``: the forward's
        quantised weight, transposed, quantised again from ``weight`` with the forward's
        ``scale`` and ``tile`` (the same fp8 values; the layer keeps no fp8 copy of its weight
        from forward to backward, only the scales). A recipe whose blocks run along the
        reduction dimension quantises ``W`` along ``out`` instead."""
        return quantize_tiles(weight.detach(), E4M3, scale, tile).t()


class TensorwiseScaling(ScalingRecipe):
    """Current scaling: ``scale = fmt.max / amax(x)`` over the whole tensor, amax agreed by
    ``reduce_amax`` when given."""

    def __init__(self, reduce_amax: AmaxReduce | None = None, power_of_two: bool = False,
                 gemm: Gemm = "auto"):
        self.reduce_amax = reduce_amax
        self.power_of_two = power_of_two
        self.gemm = check_gemm(gemm)

    def amax(self, x: Tensor) -> Tensor:
        """``max |x|`` in fp32, passed through ``reduce_amax``."""
        amax = x.detach().abs().amax().float()
        return self.reduce_amax(amax) if self.reduce_amax is not None else amax

    def scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, None]:
        return scale_from_amax(self.amax(x), fmt, power_of_two=self.power_of_two), None


class DelayedScaling(TensorwiseScaling):
    """Scale from the amax history of the previous ``history_len`` uses of each role.

    Each use takes ``reduction`` ("max" or "most_recent") over the role's history, computes
    ``fmt.max / amax / 2**margin``, then records the current (``reduce_amax``-agreed) amax. The
    first use of a role, with an empty history, falls back to current scaling. A value above
    the history's amax saturates. A "step" is one call: microbatches and recomputed forwards
    each record an amax.
    """

    def __init__(self, history_len: int = 1024,
                 reduction: Literal["max", "most_recent"] = "max", margin: int = 0,
                 reduce_amax: AmaxReduce | None = None, power_of_two: bool = False,
                 gemm: Gemm = "auto"):
        if history_len < 1:
            raise MeshtronError(f"fp8 amax history_len must be at least 1, got {history_len}")
        if reduction not in ("max", "most_recent"):
            raise MeshtronError(
                f"fp8 amax reduction must be 'max' or 'most_recent', got {reduction!r}")
        super().__init__(reduce_amax, power_of_two, gemm)
        self.history_len = history_len
        self.reduction = reduction
        self.margin = margin
        self.history: dict[str, Tensor] = {}
        """Per role, the amaxes of the last uses, most recent first."""
        self.seen: dict[str, int] = {}
        """Per role, how many amaxes have been recorded (capped at ``history_len``)."""

    def scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, None]:
        current = self.amax(x)
        seen = self.seen.get(role, 0)
        if seen == 0:
            amax = current
        else:
            history = self.history[role][:seen]
            amax = history.max() if self.reduction == "max" else history[0]
        self.record(role, current)
        return scale_from_amax(amax, fmt, self.margin, self.power_of_two), None

    def record(self, role: Role, amax: Tensor) -> None:
        """Push ``amax`` onto ``role``'s history, dropping the oldest beyond ``history_len``."""
        old = self.history.get(role)
        if old is None:
            old = torch.zeros(self.history_len, dtype=torch.float32, device=amax.device)
        self.history[role] = torch.cat([amax.reshape(1).to(old), old[:-1]])
        self.seen[role] = min(self.seen.get(role, 0) + 1, self.history_len)

    def state_dict(self) -> dict[str, dict]:
        """The amax histories, for a checkpoint that resumes with identical scales."""
        return {"history": {k: v.clone() for k, v in self.history.items()},
                "seen": dict(self.seen)}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        history, seen = state["history"], state["seen"]
        for role, h in history.items():
            if h.numel() != self.history_len:
                raise MeshtronError(f"fp8 amax history for {role} has {h.numel()} entries, "
                                    f"but history_len is {self.history_len}")
        self.history = {k: v.clone() for k, v in history.items()}
        self.seen = dict(seen)


class BlockwiseScaling(ScalingRecipe):
    """DeepSeek-V3 fine-grained scaling: a scale per tile, ``fmt.max / amax(tile)``.

    Activations and output gradients use 1 x ``block`` tiles along the last (reduction)
    dimension, weights ``block`` x ``block`` blocks. For the weight gradient, whose reduction
    runs over tokens, x and grad_y are quantised again from high precision in ``block`` x 1
    tiles along the token dimension (a ragged last tile is fine there). Feature dimensions must
    be multiples of ``block``. Stateless; ``reduce_amax`` is not used, since tiles never span
    ranks when shard sizes are multiples of ``block``. Products are always emulated ("auto"
    and "emulated" mean the same here): ``_scaled_mm``'s block-wise scales are CUDA-only and
    the ragged token tiles of the weight gradient do not fit them.
    """

    def __init__(self, block: int = 128, power_of_two: bool = False, gemm: Gemm = "auto"):
        if block < 1:
            raise MeshtronError(f"fp8 block size must be at least 1, got {block}")
        if check_gemm(gemm) == "scaled_mm":
            raise MeshtronError("fp8 blockwise scaling has no scaled_mm path; use gemm='auto' "
                                "or 'emulated'")
        self.block = block
        self.power_of_two = power_of_two
        self.gemm = gemm

    def scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, Tile]:
        b = self.block
        if role == "weight":
            check_blockwise_shapes(x.shape[1], x.shape[0], b)
            tile = (b, b)
        else:
            if x.shape[1] % b:
                features = "in_features" if role == "input" else "out_features"
                raise MeshtronError(
                    f"fp8 blockwise scaling needs {features} divisible by the block size {b}, "
                    f"got {x.shape[1]}; pad the model or use tensorwise scaling")
            tile = (1, b)
        return self._scale(x, tile, fmt), tile

    def wgrad_scales(self, x: Tensor, role: Role, fmt: FP8Format) -> tuple[Tensor, Tile] | None:
        if role == "weight":
            return None
        tile = (self.block, 1)
        return self._scale(x, tile, fmt), tile

    def _scale(self, x: Tensor, tile: Tile, fmt: FP8Format) -> Tensor:
        return scale_from_amax(tile_amax(x, tile), fmt, power_of_two=self.power_of_two)


def check_blockwise_shapes(in_features: int, out_features: int, block: int = 128) -> None:
    """Raise :class:`MeshtronError` unless both feature sizes are multiples of ``block``.

    Pass the per-rank sizes of a tensor-parallel layer (out/tp for column-parallel, in/tp for
    row-parallel), since each rank tiles its own shard.
    """
    if in_features % block or out_features % block:
        raise MeshtronError(
            f"fp8 blockwise scaling needs in_features and out_features divisible by the block "
            f"size {block}, got in_features={in_features}, out_features={out_features}; pad "
            f"the model or use tensorwise scaling")


def make_recipe(name: str, reduce_amax: AmaxReduce | None = None, **knobs: object
                ) -> ScalingRecipe:
    """A fresh recipe object by name: "tensorwise", "delayed" or "blockwise"."""
    if name == "tensorwise":
        return TensorwiseScaling(reduce_amax, **knobs)  # type: ignore[arg-type]
    if name == "delayed":
        return DelayedScaling(reduce_amax=reduce_amax, **knobs)  # type: ignore[arg-type]
    if name == "blockwise":
        return BlockwiseScaling(**knobs)  # type: ignore[arg-type]
    raise MeshtronError(
        f"unknown fp8 recipe {name!r}; use 'tensorwise', 'delayed' or 'blockwise'")


def quantize_operand(x: Tensor, role: Role, recipe: ScalingRecipe, fmt: FP8Format
                     ) -> Quantized:
    """Quantise the 2-D operand ``x`` as ``recipe`` does for ``role``."""
    return recipe.quantize(x, role, fmt)


class _FP8Linear(torch.autograd.Function):
    """y = q(x) q(W)^T + b in fp32; backward with q(grad_y) in ``grad_fmt``; products by
    :func:`fp8_matmul` along ``gemm``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, recipe: ScalingRecipe,
                grad_fmt: FP8Format, defer: WeightGradHook | None, gemm: Gemm) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            qx = quantize_operand(x2, "input", recipe, E4M3)
            qw = quantize_operand(weight, "weight", recipe, E4M3)
            y = fp8_matmul(qx, qw, gemm)
            if bias is not None:
                y = y + bias.float()
            qx_wgrad = recipe.quantize_wgrad(x2, "input", E4M3, qx)
        ctx.recipe, ctx.grad_fmt, ctx.defer, ctx.gemm = recipe, grad_fmt, defer, gemm
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # x's fp8 data + scales; of the weight (alive anyway) only its scales
        ctx.w_scale = qw.scale if recipe.weight_scales_in_backward else None
        ctx.w_tile, ctx.qx_wgrad = qw.tile, qx_wgrad
        ctx.save_for_backward(weight)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (weight,) = ctx.saved_tensors
        gy2 = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_b = None
        with torch.autocast(gy2.device.type, enabled=False):
            qgy = quantize_operand(gy2, "grad_output", ctx.recipe, ctx.grad_fmt)
            if ctx.needs_input_grad[0]:
                qw_t = ctx.recipe.weight_for_grad_input(weight, ctx.w_scale, ctx.w_tile)
                grad_x = fp8_matmul(qgy, qw_t, ctx.gemm).to(ctx.x_dtype)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                qgy_w = ctx.recipe.quantize_wgrad(gy2, "grad_output", ctx.grad_fmt, qgy)
                qx_w = ctx.qx_wgrad
                deferred = ctx.defer is not None and ctx.defer(
                    weight, qx_w.dequantize(), qgy_w.dequantize())
                if not deferred:
                    grad_w = fp8_matmul(qgy_w.t(), qx_w.t(), ctx.gemm).to(weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = gy2.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, recipe_state: ScalingRecipe,
               grad_format: Literal["e5m2", "e4m3"] = "e5m2",
               defer: WeightGradHook | None = None, gemm: Gemm | None = None) -> Tensor:
    """``x @ weight^T + bias`` with x and weight quantised to E4M3 by ``recipe_state``.

    Backward quantises grad_y to ``grad_format`` and forms ``grad_x = q(grad_y) @ q(W)`` and
    ``grad_W = q(grad_y)^T @ q(x)``. Each product runs through :func:`fp8_matmul` along
    ``gemm`` (None: the recipe's ``gemm``): ``torch._scaled_mm`` on the fp8 data, or fp32 on
    dequantised operands; both accumulate in fp32. The bias and its gradient stay in high
    precision, the output has x's dtype. ``x`` may have any leading shape ``[..., in_features]``.
    With ``defer``, the weight gradient may be taken for later (zero-bubble pipelines): the hook
    gets the dequantised operands and then owns forming and accumulating it into ``weight``.
    """
    gemm = recipe_state.gemm if gemm is None else check_gemm(gemm)
    return _FP8Linear.apply(x, weight, bias, recipe_state, fp8_format(grad_format), defer, gemm)
