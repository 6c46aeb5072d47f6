"""ZeRO-3's parameter all-gather in FP8 (``precision.fp8_param_gather``).

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

Bytes one rank receives per gather, for a bucket of ``n`` elements over ``d`` ranks whose FP8
weights hold ``q`` of them: about ``q + (n - q) * itemsize`` (the longest pack times ``d``),
against ``n * itemsize`` in ``precision.dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from meshtron.optim.grad_buckets import Bucket
from meshtron.parallel.tensor.collectives import all_reduce
from meshtron.precision.param_gather import (
    WeightGather,
    dequantize_gathered,
    gather_scale,
    quantize_for_gather,
)


@dataclass(frozen=True)
class Segment:
    """Bucket elements ``start..end`` of one parameter inside one rank's shard."""

    start: int
    end: int
    weight: int | None
    """Index of the parameter among the bucket's FP8 weights; None: sent in its own dtype."""


class FP8Gather:
    """Packs this rank's shard of ``bucket`` for an FP8 all-gather and unpacks the gathered
    packs into the full buffer (``gathers``: the FP8 weights' :class:`WeightGather`, by
    ``id`` of the parameter)."""

    def __init__(self, bucket: Bucket, gathers: dict[int, WeightGather]):
        self.bucket = bucket
        self.group = bucket.group
        self.itemsize = bucket.params[0].element_size()
        self.weights = [i for i, p in enumerate(bucket.params) if id(p) in gathers]
        self.reduce = gathers[id(bucket.params[self.weights[0]])].reduce_amax
        size = bucket.padded // self.group.size
        self.segments = [self._segments(r * size, (r + 1) * size)
                         for r in range(self.group.size)]
        self.length = max(self._packed_bytes(segs) for segs in self.segments)
        """Bytes of each rank's pack (the longest rank's; the others are zero-padded)."""
        self._kept: tuple[int, Tensor, Tensor] | None = None
        """(the shard's version, its pack, the scales) of the last quantisation."""

    def _segments(self, lo: int, hi: int) -> list[Segment]:
        out = []
        slot = {i: j for j, i in enumerate(self.weights)}
        for i, (offset, shape) in enumerate(zip(self.bucket.offsets, self.bucket.shapes)):
            start, end = max(lo, offset), min(hi, offset + shape.numel())
            if start < end:
                out.append(Segment(start, end, slot.get(i)))
        return out

    def _packed_bytes(self, segments: list[Segment]) -> int:
        return sum((s.end - s.start) * (1 if s.weight is not None else self.itemsize)
                   for s in segments)

    def scales(self, shard: Tensor, start: int) -> Tensor:
        """Each FP8 weight's power-of-two scale from its whole amax (agreed over the shard
        group and tp x cp: one all-reduce of one number per weight over each)."""
        amax = torch.zeros(len(self.weights), dtype=torch.float32, device=shard.device)
        for seg in self.segments[self.group.rank]:
            if seg.weight is not None:
                part = shard[seg.start - start : seg.end - start]
                amax[seg.weight] = part.detach().abs().amax().float()
        amax = all_reduce(amax, self.group, op=torch.distributed.ReduceOp.MAX)
        if self.reduce is not None:
            amax = self.reduce(amax)
        return gather_scale(amax)

    def pack(self, shard: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """This rank's pack (uint8 [length]) and the scales, quantised once per version of
        ``shard`` (the bucket elements from ``start``)."""
        if self._kept is not None and self._kept[0] == shard._version:
            return self._kept[1], self._kept[2]
        scales = self.scales(shard, start)
        pack = torch.zeros(self.length, dtype=torch.uint8, device=shard.device)
        pos = 0
        for seg in self.segments[self.group.rank]:
            part = shard[seg.start - start : seg.end - start]
            data = part.view(torch.uint8) if seg.weight is None else \
                quantize_for_gather(part, scales[seg.weight])
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
        """Every rank's pack from ``gathered`` into the full buffer (``full``'s dtype)."""
        scales = self._kept[2]
        for rank, segments in enumerate(self.segments):
            pos = rank * self.length
            for seg in segments:
                n = seg.end - seg.start
                if seg.weight is None:
                    full[seg.start : seg.end] = gathered[pos : pos + n * self.itemsize].view(
                        full.dtype)
                    pos += n * self.itemsize
                else:
                    full[seg.start : seg.end] = dequantize_gathered(
                        gathered[pos : pos + n], scales[seg.weight], full.dtype)
                    pos += n
        end = self.bucket.offsets[-1] + self.bucket.shapes[-1].numel()
        full[end:].zero_()  # the padding no parameter views
