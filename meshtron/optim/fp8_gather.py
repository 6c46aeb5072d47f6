"""ZeRO-3's parameter all-gather in FP8 and FP4 (``precision.fp8_param_gather``).

A gradient bucket mixes weights of low-precision linear layers with parameters that stay in
``precision.dtype`` (norm weights, biases, the weights of kept blocks). Each rank packs its
shard as bytes, parameter by parameter in bucket order: an FP8 weight's elements as E4M3 (one
byte each), anything else as its own bytes. Every rank knows every rank's packing from the
bucket's layout alone, so the packs are gathered with one all-gather (each padded to the
longest) and unpacked on arrival into the full buffer, the E4M3 bytes dequantised.

An FP8 weight's scale is a power of two from the amax of the whole weight
(:mod:`meshtron.precision.param_gather`): each rank takes the amax of its part of each weight,
and one all-reduce (max) of these few numbers over the shard group, then over tp x cp, agrees
them. The shard is quantised once per change (after each optimizer step, or a checkpoint load):
the pack is kept and reused by every gather until the shard's version changes.

NVFP4 layers' weights travel in FP4 (:mod:`meshtron.precision.fp4_gather`): E2M1 codes, two to
a byte, at the scales of the whole weight's NVFP4 quantisation. Each rank takes the amax of
each 16 x 16 tile over the elements it holds (a shard may cut through tiles), the same
all-reduce (max) agrees every tile's amax (the per-tensor amax is their max, then agreed over
tp x cp like an FP8 weight's), and every rank forms the scales from the agreed amaxes, so no
scale travels. On arrival the codes are dequantised into the full buffer and the scales handed
to the layer (:class:`~meshtron.precision.param_gather.FP4WeightGather`), which takes the
gathered weight as is.

Bytes one rank receives per gather, for a bucket of ``n`` elements over ``d`` ranks whose FP8
weights hold ``q`` of them and NVFP4 weights ``f``: about ``q + f / 2 + (n - q - f) *
itemsize`` (the longest pack times ``d``), against ``n * itemsize`` in ``precision.dtype``. The
amax all-reduce carries one fp32 number per FP8 weight and one per NVFP4 weight tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from meshtron.optim.grad_buckets import Bucket
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.precision.fp4_gather import (
    encode_run,
    pack_nibbles,
    packed_size,
    run_tile_amax,
    unpack_nibbles,
)
from meshtron.precision.mx import check_finite_amax
from meshtron.precision.nvfp4 import (
    NVFP4_BLOCK,
    WEIGHT_TILE,
    NVFP4Tensor,
    nvfp4_block_scales,
    per_tensor_scale,
)
from meshtron.precision.param_gather import (
    FP4WeightGather,
    WeightGather,
    dequantize_gathered,
    gather_scale,
    quantize_for_gather,
)

Gathers = dict[int, WeightGather | FP4WeightGather]


@dataclass(frozen=True)
class Segment:
    """Bucket elements ``start..end`` of one parameter inside one rank's shard."""

    start: int
    end: int
    weight: int | None
    """Index of the parameter among the bucket's gathered weights; None: sent in its own
    dtype."""
    fp4: bool = False
    """An NVFP4 weight's elements (E2M1, two to a byte); else E4M3 (one byte each)."""


@dataclass(frozen=True)
class Scales:
    """One gathered weight's scales: ``scale`` (E4M3's power of two, or NVFP4's per-tensor
    scale) and, for NVFP4, the E4M3 tile scales."""

    scale: Tensor
    tiles: Tensor | None = None


class FP8Gather:
    """Packs this rank's shard of ``bucket`` for a low-precision all-gather and unpacks the
    gathered packs into the full buffer (``gathers``: the weights' :class:`WeightGather`
    (E4M3) or :class:`FP4WeightGather` (NVFP4), by ``id`` of the parameter)."""

    def __init__(self, bucket: Bucket, gathers: Gathers):
        self.bucket = bucket
        self.group = bucket.group
        self.itemsize = bucket.params[0].element_size()
        self.weights = [i for i, p in enumerate(bucket.params) if id(p) in gathers]
        self.gathers = [gathers[id(bucket.params[i])] for i in self.weights]
        self.fp4 = [isinstance(g, FP4WeightGather) for g in self.gathers]
        self.reduce = self.gathers[0].reduce_amax
        self.slots = self._slots()
        """Each gathered weight's entries in the amax all-reduce: 1, or one per tile."""
        size = bucket.padded // self.group.size
        self.segments = [self._segments(r * size, (r + 1) * size)
                         for r in range(self.group.size)]
        self.length = max(self._packed_bytes(segs) for segs in self.segments)
        """Bytes of each rank's pack (the longest rank's; the others are zero-padded)."""
        self._kept: tuple[int, Tensor, list[Scales]] | None = None
        """(the shard's version, its pack, the scales) of the last quantisation."""

    def _slots(self) -> list[tuple[int, int]]:
        out, at = [], 0
        for i, fp4 in zip(self.weights, self.fp4):
            shape = self.bucket.shapes[i]
            n = shape[0] * shape[1] // NVFP4_BLOCK**2 if fp4 else 1
            out.append((at, at + n))
            at += n
        return out

    def _segments(self, lo: int, hi: int) -> list[Segment]:
        out = []
        slot = {i: j for j, i in enumerate(self.weights)}
        for i, (offset, shape) in enumerate(zip(self.bucket.offsets, self.bucket.shapes)):
            start, end = max(lo, offset), min(hi, offset + shape.numel())
            if start < end:
                j = slot.get(i)
                out.append(Segment(start, end, j, j is not None and self.fp4[j]))
        return out

    def _packed_bytes(self, segments: list[Segment]) -> int:
        return sum(packed_size(s.end - s.start) if s.fp4 else
                   (s.end - s.start) * (1 if s.weight is not None else self.itemsize)
                   for s in segments)

    def _first(self, seg: Segment) -> tuple[int, torch.Size]:
        """Where ``seg`` starts inside its weight, and the weight's shape."""
        i = self.weights[seg.weight]
        return seg.start - self.bucket.offsets[i], self.bucket.shapes[i]

    def amaxes(self, shard: Tensor, start: int) -> Tensor:
        """Every gathered weight's amax slots over this rank's part (an E4M3 weight's amax,
        an NVFP4 weight's tile amaxes; 0 where it holds none), agreed over the shard group
        with one all-reduce (max). A NaN counts as infinite, so every rank sees it."""
        amax = torch.zeros(self.slots[-1][1], dtype=torch.float32, device=shard.device)
        for seg in self.segments[self.group.rank]:
            if seg.weight is None:
                continue
            part = shard[seg.start - start : seg.end - start].detach()
            lo, hi = self.slots[seg.weight]
            if seg.fp4:
                amax[lo:hi] = run_tile_amax(part, *self._first(seg)).reshape(-1)
            else:
                amax[lo] = part.abs().amax().float()
        amax = torch.where(torch.isnan(amax), torch.inf, amax)
        return all_reduce(amax, self.group, op=torch.distributed.ReduceOp.MAX)

    def scales(self, shard: Tensor, start: int) -> list[Scales]:
        """Each gathered weight's scales from the amaxes of the whole weight: the per-weight
        amaxes (an NVFP4 weight's is its tiles' max) agreed over tp x cp too."""
        amax = self.amaxes(shard, start)
        whole = torch.stack([amax[lo:hi].max() for lo, hi in self.slots])
        if self.reduce is not None:
            whole = self.reduce(whole)
        out = []
        for j, (lo, hi) in enumerate(self.slots):
            if not self.fp4[j]:
                out.append(Scales(gather_scale(whole[j])))
                continue
            check_finite_amax(whole[j], "weight")
            rows, cols = self.bucket.shapes[self.weights[j]]
            tensor = per_tensor_scale(whole[j])
            tiles = amax[lo:hi].view(rows // NVFP4_BLOCK, cols // NVFP4_BLOCK)
            out.append(Scales(tensor, nvfp4_block_scales(tiles, tensor)))
        return out

    def pack(self, shard: Tensor, start: int) -> tuple[Tensor, list[Scales]]:
        """This rank's pack (uint8 [length]) and the scales, quantised once per version of
        ``shard`` (the bucket elements from ``start``)."""
        if self._kept is not None and self._kept[0] == shard._version:
            return self._kept[1], self._kept[2]
        scales = self.scales(shard, start)
        pack = torch.zeros(self.length, dtype=torch.uint8, device=shard.device)
        pos = 0
        for seg in self.segments[self.group.rank]:
            part = shard[seg.start - start : seg.end - start]
            if seg.weight is None:
                data = part.view(torch.uint8)
            elif seg.fp4:
                s = scales[seg.weight]
                data = pack_nibbles(encode_run(part, *self._first(seg), s.tiles, s.scale))
            else:
                data = quantize_for_gather(part, scales[seg.weight].scale)
            pack[pos : pos + data.numel()] = data
            pos += data.numel()
        self._kept = (shard._version, pack, scales)
        return pack, scales

    def gather_buffer(self, shard: Tensor, start: int) -> Tensor:
        """The all-gather's buffer (uint8 [group size x length]) with this rank's pack in
        its place."""
        pack, _ = self.pack(shard, start)
        out = torch.empty(self.group.size * self.length, dtype=torch.uint8, device=pack.device)
        rank = self.group.rank
        out[rank * self.length : (rank + 1) * self.length] = pack
        return out

    def unpack(self, gathered: Tensor, full: Tensor) -> None:
        """Every rank's pack from ``gathered`` into the full buffer (``full``'s dtype); the
        NVFP4 weights' codes are collected whole, dequantised, and their scales delivered."""
        scales = self._kept[2]
        codes = {j: torch.empty(self.bucket.shapes[i].numel(), dtype=torch.uint8,
                                device=full.device)
                 for j, i in enumerate(self.weights) if self.fp4[j]}
        for rank, segments in enumerate(self.segments):
            pos = rank * self.length
            for seg in segments:
                n = seg.end - seg.start
                if seg.weight is None:
                    full[seg.start : seg.end] = gathered[pos : pos + n * self.itemsize].view(
                        full.dtype)
                    pos += n * self.itemsize
                elif seg.fp4:
                    first = self._first(seg)[0]
                    codes[seg.weight][first : first + n] = unpack_nibbles(
                        gathered[pos : pos + packed_size(n)], n)
                    pos += packed_size(n)
                else:
                    full[seg.start : seg.end] = dequantize_gathered(
                        gathered[pos : pos + n], scales[seg.weight].scale, full.dtype)
                    pos += n
        for j, whole in codes.items():
            self._deliver(j, whole, scales[j], full)
        end = self.bucket.offsets[-1] + self.bucket.shapes[-1].numel()
        full[end:].zero_()  # the padding no parameter views

    def _deliver(self, j: int, codes: Tensor, scales: Scales, full: Tensor) -> None:
        """NVFP4 weight ``j`` dequantised into ``full`` and its scales handed to its layer."""
        i = self.weights[j]
        view = self.bucket.view(full, i)
        q = NVFP4Tensor(codes.view(view.shape), scales.tiles, scales.scale, WEIGHT_TILE)
        view.copy_(q.dequantize())
        self.gathers[j].deliver(view, scales.tiles, scales.scale)
