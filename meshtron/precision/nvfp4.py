"""NVFP4: E2M1 elements, an E4M3 scale per 16 elements and one fp32 scale per tensor.

Quantising a tensor (torchao's ``nvfp4_quantize`` with a per-tensor scale, bit for bit; see
tests/test_mx_formats.py): the per-tensor scale is ``amax / (448 * 6)`` (1 for an all-zero
tensor); each block's scale is ``block_amax / 6 / per_tensor_scale`` rounded to E4M3 (clamped
to [2**-6, 448]); an element is ``x * ((1 / per_tensor_scale) / block_scale)`` clamped to +-6
and rounded to E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives). Dequantising multiplies
the E2M1 value by ``per_tensor_scale * block_scale``.

The training recipe of NVIDIA's NVFP4 pre-training report, as :func:`nvfp4_linear` runs it:

* activations and output gradients in 1 x 16 blocks along the reduction dimension; weights in
  16 x 16 blocks (2-D scaling), so the forward's quantised weight, transposed, is the input
  gradient's operand (one quantisation, both layouts);
* the weight-gradient product's operands (``x`` and ``grad_y``, reduced over tokens) pass a
  random Hadamard transform first: each run of 16 tokens times ``diag(signs) @ H16 / 4``, an
  orthogonal matrix, so ``(H dy)^T (H x) = dy^T x`` and the transform only spreads outliers
  over the blocks (tokens are zero-padded to a multiple of 16);
* output gradients are rounded stochastically (unbiased), activations and weights to nearest.

Stochastic rounding draws each element's uniform number from a hash of (the layer's seed, the
product, the element's token number in its micro-batch, its global output-feature number, the
top 12 bits of its value: sign, exponent and 3 mantissa bits), not from a generator's stream:
the draw is deterministic given the seed and the same however tensor parallelism splits the
features, context parallelism the tokens (a cp rank numbers its tokens by their places in the
whole sequence, ``token_index``) or pipeline and data parallelism the work (the parity
contract); the low bits that another summation order changes are left out, and a value that
changes (the next step) draws anew.
Per-tensor amaxes are agreed across the ranks holding parts of a tensor (``reduce_amax``).

A weight is quantised once (:func:`nvfp4_weight`): ZeRO-3's FP4 parameter gather delivers it
already quantised with its scales (:mod:`meshtron.optim.fp8_gather`), and the layer takes it
as is, since quantising ``deq(q(W))`` again need not give ``deq(q(W))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from meshtron.errors import MeshtronError
from meshtron.precision.fp8 import E4M3, WeightGradHook, expand_tiles, tile_amax
from meshtron.precision.mx import check_finite_amax
from meshtron.precision.param_gather import FP4WeightGather

FP4_MAX = 6.0
NVFP4_BLOCK = 16
WEIGHT_TILE = (NVFP4_BLOCK, NVFP4_BLOCK)
"""Weights are scaled in 16 x 16 tiles (2-D scaling)."""
E4M3_TINY = 2.0**-6
"""The smallest normal E4M3 value, the floor of a block scale."""

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROUND_DOWN_TIES = (0.25, 1.25, 2.5, 5.0)
"""Midpoints whose lower neighbour has the even code (round-to-nearest-even keeps it)."""
ROUND_UP_TIES = (0.75, 1.75, 3.5)
NAN_ROUNDING = (1 - 127 << 23) + (1 << 21) - 1
"""torchao's exponent rebias and rounding bias of E2M1's normal branch, which its NaNs also
take: their code comes from their fp32 bits (1.5, 2 or 3 for the usual payloads)."""

AmaxReduce = Callable[[Tensor], Tensor]
TokenIndex = Callable[[int], tuple[Tensor, int]]
"""A rank's ``L`` local positions -> (their indices in the whole sequence [L], its length):
context parallelism's split."""


def e2m1_codes(v: Tensor, uniform: Tensor | None = None) -> Tensor:
    """4-bit E2M1 codes (uint8, sign in bit 3) of fp32 ``v``, saturating at +-6: to nearest
    (ties to even), or stochastically when ``uniform`` (numbers in [0, 1), ``v``'s shape)
    is given: up with probability (|v| - lower) / (upper - lower)."""
    a = v.abs()
    if uniform is None:
        code = sum((a > t).to(torch.uint8) for t in ROUND_DOWN_TIES)
        code = code + sum((a >= t).to(torch.uint8) for t in ROUND_UP_TIES)
    else:
        grid = torch.tensor(E2M1_GRID + (FP4_MAX,), device=v.device)
        low = sum((a >= g).to(torch.uint8) for g in E2M1_GRID[1:])
        lo, hi = grid[low.long()], grid[low.long() + 1]
        frac = torch.where(hi > lo, (a - lo) / (hi - lo), 0.0)
        code = low + (uniform < frac).to(torch.uint8)
    bits = v.view(torch.int32)
    code = torch.where(torch.isnan(v), _nan_code(bits & 0x7FFFFFFF), code).to(torch.uint8)
    return code | ((bits < 0).to(torch.uint8) << 3)


def _nan_code(bits: Tensor) -> Tensor:
    """The code torchao's round-to-nearest bit arithmetic gives a NaN with these (sign-less)
    fp32 bits, so non-finite inputs quantise alike too."""
    return (bits + NAN_ROUNDING + (bits >> 22 & 1)) >> 22 & 0xFF


def e2m1_values(codes: Tensor) -> Tensor:
    """fp32 values of E2M1 ``codes`` (code 8 is -0.0)."""
    table = torch.tensor(E2M1_GRID + tuple(-g for g in E2M1_GRID), device=codes.device)
    return table[codes.long()]


VALUE_BITS = 12
"""The bits of a value that key its stochastic-rounding draw: sign, exponent, 3 mantissa bits.
With 20 (11 mantissa bits) about one gradient element in 500 drew anew under tp or cp, whose
summation order moves a gradient by ~1e-6 relative, and the first step's grad norm differed
from one process by 5e-4 to 1e-3; with 12 by under 1e-6 on an Intel Xeon and 9.5e-6 on an AMD
EPYC, where about one element in 590,000 a step still rounded the other way. Such a flip grows (the
backward carries it into whole token rows, Adam's next steps into the weights: 1.2e-2 in relative
norm after 3 steps), as any threshold crossing does, round-to-nearest's too: parity of the math is
shown in fp64 (:func:`product_dtype`; tests/test_low_precision_training)."""


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding [0, 2**32);
    the multipliers stay below 2**31 so no product leaves int64."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    return h ^ (h >> 16)


def hashed_uniform(v: Tensor, tokens: Tensor, features: Tensor, seed: int) -> Tensor:
    """A number in [0, 1) (24 random bits) per element of fp32 ``v`` from ``seed``, the
    element's token and global feature numbers (broadcast against ``v``) and its value's top
    :data:`VALUE_BITS` bits: the same element draws the same number in every layout, another
    summation order's rounding (relative 1e-6 in a gradient, many ulps) almost never changes
    the draw, a value that moves by more than an eighth of an octave draws anew."""
    coarse = (v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> (32 - VALUE_BITS)
    h = _mix32(torch.tensor(seed & 0xFFFFFFFF, dtype=torch.int64, device=v.device))
    h = _mix32(h ^ (tokens.to(torch.int64) & 0xFFFFFFFF))
    h = _mix32(h ^ (features.to(torch.int64) & 0xFFFFFFFF))
    h = _mix32(h ^ coarse)
    return (h >> 8).to(torch.float32) * 2.0**-24


def per_tensor_scale(amax: Tensor) -> Tensor:
    """``amax / (448 * 6)`` in fp32, so a block holding the tensor's amax gets the largest
    E4M3 block scale; 1 for an all-zero tensor (whose block scales then clamp to 2**-6)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / (E4M3.max * FP4_MAX), 1.0)


@dataclass
class NVFP4Tensor:
    """E2M1 codes (one uint8 per element, unpacked), E4M3 scales per ``tile`` and the fp32
    per-tensor scale."""

    codes: Tensor
    block_scale: Tensor
    tensor_scale: Tensor
    tile: tuple[int, int]

    def dequantize(self) -> Tensor:
        """The fp32 values this tensor stands for."""
        scale = self.tensor_scale * self.block_scale.float()
        return e2m1_values(self.codes) * expand_tiles(scale, self.tile, self.codes.shape)


def nvfp4_quantize(x: Tensor, tensor_scale: Tensor, tile: tuple[int, int] = (1, NVFP4_BLOCK),
                   uniform: Tensor | None = None) -> NVFP4Tensor:
    """The 2-D ``x`` in NVFP4 with per-tensor scale ``tensor_scale`` (:func:`per_tensor_scale`)
    and one E4M3 scale per ``tile`` (1 x 16, or 16 x 16 for weights); rounded to nearest, or
    stochastically with ``uniform``. ``x``'s dimensions must be whole tiles."""
    rows, cols = x.shape
    if rows % tile[0] or cols % tile[1]:
        raise MeshtronError(f"nvfp4 quantisation needs a [{rows}, {cols}] tensor to be whole "
                            f"{tile[0]} x {tile[1]} blocks; pad the model to multiples of 16")
    scale8 = nvfp4_block_scales(tile_amax(x.float(), tile), tensor_scale)
    return nvfp4_encode(x, scale8, tensor_scale, tile, uniform)


def nvfp4_block_scales(amax: Tensor, tensor_scale: Tensor) -> Tensor:
    """The E4M3 scales of blocks whose amaxes are ``amax`` under ``tensor_scale``: apart from
    :func:`nvfp4_encode` so that the FP4 parameter gather can form them from amaxes agreed
    over ranks that each hold part of a block."""
    block = amax / FP4_MAX
    return torch.clamp(block / tensor_scale, E4M3_TINY, E4M3.max).to(E4M3.dtype)


def nvfp4_encode(x: Tensor, scale8: Tensor, tensor_scale: Tensor,
                 tile: tuple[int, int] = (1, NVFP4_BLOCK),
                 uniform: Tensor | None = None) -> NVFP4Tensor:
    """``x`` as E2M1 codes at the given scales (``scale8``: one E4M3 scale per ``tile``):
    element by element, so a part of a tensor encodes as it would inside the whole."""
    reciprocal = (1.0 / tensor_scale) / scale8.float()
    v = torch.clamp(x.float() * expand_tiles(reciprocal, tile, x.shape), -FP4_MAX, FP4_MAX)
    return NVFP4Tensor(e2m1_codes(v, uniform), scale8, tensor_scale, tile)


def hadamard_signs(seed: int, device: torch.device | str = "cpu") -> Tensor:
    """16 random signs (+-1, fp32) from ``seed``: the random part of the Hadamard transform."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (NVFP4_BLOCK,), generator=g) * 2 - 1).float().to(device)


def hadamard16(signs: Tensor) -> Tensor:
    """``diag(signs) @ H16 / 4``: Sylvester's 16 x 16 Hadamard matrix, normalised to be
    orthogonal, with random row signs."""
    h = torch.ones(1, 1, device=signs.device)
    while h.shape[0] < NVFP4_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return signs.unsqueeze(1) * h / 4.0


def product_dtype(x: Tensor) -> torch.dtype:
    """The dtype a layer's products run in: fp32, or fp64 in an fp64 (verification) run,
    where the layouts' summation orders then differ by ~1e-16 and almost never move a value
    across a rounding threshold of the fp32 quantisation, which fp32's ~1e-7 does a few
    times a step (each such flip grows through the backward and Adam's steps)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rht_along_rows(x: Tensor, signs: Tensor) -> Tensor:
    """``x`` [tokens, k] -> [k, tokens'] : transposed, zero-padded to whole runs of 16 tokens,
    each run multiplied by :func:`hadamard16` (in :func:`product_dtype`)."""
    dtype = product_dtype(x)
    t = torch.nn.functional.pad(x.t().to(dtype), (0, -x.shape[0] % NVFP4_BLOCK))
    runs = t.reshape(t.shape[0], -1, NVFP4_BLOCK) @ hadamard16(signs).to(dtype)
    return runs.reshape(t.shape)


@dataclass
class NVFP4Options:
    """One linear layer's NVFP4 settings: its seed (Hadamard signs, stochastic rounding) and
    how per-tensor amaxes are agreed across ranks (None: one rank holds whole tensors)."""

    seed: int = 0
    reduce_amax: AmaxReduce | None = None
    hadamard: bool = True
    stochastic: bool = True
    gather: FP4WeightGather | None = None
    """``precision.fp8_param_gather``: ZeRO-3 gathers the weight in FP4 and hands the layer
    its scales (:class:`FP4WeightGather`)."""
    token_index: TokenIndex | None = None
    """Where a rank's tokens sit in their sequences under cp (None: the whole sequence)."""

    def apply(self, x: Tensor, weight: Tensor, bias: Tensor | None,
              defer: WeightGradHook | None = None, features: Tensor | None = None) -> Tensor:
        return nvfp4_linear(x, weight, bias, self, defer, features)

    def agreed_scale(self, x: Tensor, what: str) -> Tensor:
        """The per-tensor scale of ``x`` from its amax, agreed across ranks; a non-finite
        amax is refused."""
        amax = x.detach().abs().amax().float()
        if self.reduce_amax is not None:
            amax = self.reduce_amax(amax)
        check_finite_amax(amax, what)
        return per_tensor_scale(amax)

    def quantize(self, x: Tensor, what: str, tile: tuple[int, int] = (1, NVFP4_BLOCK),
                 salt: int | None = None, tokens: Tensor | None = None,
                 features: Tensor | None = None) -> NVFP4Tensor:
        """``x`` quantised with its agreed per-tensor scale; with ``salt``, stochastically
        rounded, each element's draw keyed by its ``tokens`` and global ``features`` numbers
        (broadcast against ``x``; by default its row and column)."""
        uniform = None
        if salt is not None and self.stochastic:
            rows, cols = x.shape
            tokens = torch.arange(rows, device=x.device)[:, None] if tokens is None else tokens
            features = torch.arange(cols, device=x.device) if features is None else features
            uniform = hashed_uniform(x.float().contiguous(), tokens, features,
                                     self.seed * 4 + salt)
        return nvfp4_quantize(x, self.agreed_scale(x, what), tile, uniform)


    def token_numbers(self, shape: torch.Size, device: torch.device) -> Tensor | None:
        """The numbers one process gives the rows of an input of ``shape`` [..., L, k]
        (sequence ``i``'s token ``t`` is ``i * S + t``) where cp holds parts of the sequences;
        None where the rows are numbered 0, 1, ... anyway."""
        if self.token_index is None or len(shape) < 3:
            return None
        index, length = self.token_index(shape[-2])
        sequences = torch.arange(shape[:-2].numel(), device=device)[:, None] * length
        return (sequences + index.to(device)).reshape(-1)


def _numbers(tokens: Tensor | None, count: int, device: torch.device) -> Tensor:
    """``count`` token numbers: ``tokens``' (then on past their largest, for the padding of
    the weight-gradient layout), or 0, 1, ..."""
    if tokens is None:
        return torch.arange(count, device=device)
    extra = torch.arange(count - len(tokens), device=device) + int(tokens.max()) + 1
    return torch.cat([tokens, extra])


def _wgrad_operand(x: Tensor, opts: NVFP4Options) -> Tensor:
    """``x`` [tokens, k] as the weight gradient's operand [k, tokens']: Hadamard-transformed
    along the tokens (or only transposed and padded)."""
    if opts.hadamard:
        return rht_along_rows(x, hadamard_signs(opts.seed, x.device))
    return torch.nn.functional.pad(x.t().to(product_dtype(x)), (0, -x.shape[0] % NVFP4_BLOCK))


class _NVFP4Linear(torch.autograd.Function):
    """y = q(x) q(W)^T + b from NVFP4 operands (the module docstring's recipe), the products
    in :func:`product_dtype`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, opts: NVFP4Options,
                defer: WeightGradHook | None, features: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        dtype = product_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            qw = nvfp4_weight(weight, opts)
            w = qw.dequantize().to(dtype)
            y = opts.quantize(x2.detach(), "input").dequantize().to(dtype) @ w.t()
            if bias is not None:
                y = y + bias.to(dtype)
            xt = _wgrad_operand(x2.detach(), opts)
            ctx.qx_w = opts.quantize(xt, "input (weight-gradient layout)")
        ctx.w_scale, ctx.opts, ctx.defer = qw.tensor_scale, opts, defer  # codes not kept
        ctx.features = torch.arange(weight.shape[0], device=weight.device) \
            if features is None else features
        ctx.tokens = opts.token_numbers(x.shape, x.device)
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(weight)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (weight,) = ctx.saved_tensors
        opts: NVFP4Options = ctx.opts
        gy2 = grad_y.reshape(-1, grad_y.shape[-1])
        dtype = product_dtype(gy2)
        grad_x = grad_w = grad_b = None
        with torch.autocast(gy2.device.type, enabled=False):
            features = ctx.features
            if ctx.needs_input_grad[0]:
                rows = None if ctx.tokens is None else ctx.tokens[:, None]
                qgy = opts.quantize(gy2, "output gradient", salt=1, tokens=rows,
                                    features=features)
                grad_x = (qgy.dequantize().to(dtype)
                          @ _weight_again(weight, ctx.w_scale, opts).to(dtype)).to(ctx.x_dtype)
                grad_x = grad_x.reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                gyt = _wgrad_operand(gy2, opts)
                tokens = _numbers(ctx.tokens, gyt.shape[1], gyt.device)
                gyt = opts.quantize(gyt, "output gradient", salt=2, tokens=tokens,
                                    features=features[:, None])
                gy_w, x_w = gyt.dequantize().to(dtype), ctx.qx_w.dequantize().to(dtype)
                deferred = ctx.defer is not None and ctx.defer(weight, x_w.t(), gy_w.t())
                if not deferred:
                    grad_w = (gy_w @ x_w.t()).to(weight.dtype)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = gy2.to(dtype).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def nvfp4_weight(weight: Tensor, opts: NVFP4Options) -> NVFP4Tensor:
    """The weight's one NVFP4 quantisation: at the scales the FP4 parameter gather delivered
    with it (the gathered weight taken as is: quantising it again would move it, as NVFP4's
    round trip is not idempotent), else at scales from the weight itself (one process, ZeRO
    0-2, or no gather), which are the same numbers."""
    given = None if opts.gather is None else opts.gather.scales_for(weight)
    if given is None:
        return opts.quantize(weight.detach(), "weight", WEIGHT_TILE)
    return nvfp4_encode(weight.detach(), given[0], given[1], WEIGHT_TILE)


def _weight_again(weight: Tensor, tensor_scale: Tensor, opts: NVFP4Options) -> Tensor:
    """The forward's quantised weight (dequantised), formed again from ``weight`` and its
    agreed per-tensor scale (or the gather's scales): the layer keeps no FP4 copy of its
    weight for backward."""
    given = None if opts.gather is None else opts.gather.scales_for(weight)
    if given is not None:
        return nvfp4_encode(weight.detach(), given[0], given[1], WEIGHT_TILE).dequantize()
    return nvfp4_quantize(weight.detach(), tensor_scale, WEIGHT_TILE).dequantize()


def nvfp4_linear(x: Tensor, weight: Tensor, bias: Tensor | None, opts: NVFP4Options,
                 defer: WeightGradHook | None = None, features: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias`` with all three products in NVFP4 (emulated: dequantised
    operands multiplied in fp32, or in fp64 in an fp64 run). ``weight`` [out, in] needs both
    dimensions multiples of 16 (its 16 x 16 blocks), ``x`` any leading shape. ``defer`` as in
    :func:`fp8_linear`; ``features``: the global numbers of ``weight``'s rows, which key
    stochastic rounding (default: 0, 1, ...; a tensor-parallel shard passes its slice of
    them)."""
    return _NVFP4Linear.apply(x, weight, bias, opts, defer, features)
