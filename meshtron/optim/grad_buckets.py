"""Gradient buckets: filled during backward, reduced over data-parallel ranks as each completes.

Parameters are grouped into buckets of about ``bucket_bytes``, in the order backward produces
their gradients (the reverse of the forward order). A hook after each gradient's accumulation
hands it to its bucket (stage 0/1: added into the flat buffer at once; 2/3: see below); when a
bucket's last gradient arrives, its reduction is launched asynchronously, so communication
overlaps the rest of the backward pass.

What the reduction is depends on the ZeRO stage:

- stage 0: all-reduce (sum) of the whole bucket; every rank keeps every gradient.
- stage 1: reduce-scatter in place; each rank keeps the summed gradient of its 1/dp shard. The
  full buffer persists, so micro-batches accumulate locally and only the last one communicates.
- stage 2: as stage 1, but after every micro-batch, accumulating into a shard-sized buffer;
  the full bucket buffer exists only from its last gradient to its reduction's completion.
- stage 3: as stage 2, with buckets cut along the units whose parameters are gathered together
  (one transformer block each), so a unit can be freed as soon as its gradients are out.

Under stages 2 and 3 at most :data:`REDUCE_SCATTERS_IN_FLIGHT` reduce-scatters stay queued:
launching one more first completes the oldest and frees its full-size buffer, so the backward
does not hold every bucket's full gradient (and, on gloo, a copy of each queued input) until
its end, as FSDP2 does not.

Stages 2 and 3 also hold no gradient memory a step has not produced yet, as FSDP2 does not:
a bucket keeps the gradients autograd made until its last one arrives and only then copies
them into its flat buffer (a bucket full-size from its first gradient held, under ZeRO-3,
the embedding's slot of the root unit's bucket through the whole backward), and the rank's
reduced shard is made by the bucket's first reduce-scatter of the step and dropped by
:meth:`GradReducer.zero_grad` (it lives from the end of one backward to the start of the next
step, not through the forward and backward where the peak is).

Buckets never mix parameters with different weight decay, learning-rate multiplier (muP),
replication, gradient-sync group or data-parallel group, so the optimizer and the grad norm
can treat a bucket's shard as one flat tensor, and a tied embedding's two pipeline copies sit
alone in identically shaped buckets.
A parameter's data-parallel group is dp x cp, or its layout's ``data_parallel`` where it has one
(the expert-data-parallel group of MoE experts, which different ep ranks do not share); a bucket
is reduced and sharded over its own group.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.mesh.params import layout_of
from meshtron.parallel.tensor.collectives import (
    all_reduce,
    start_all_reduce,
    start_reduce_scatter,
)
from meshtron.precision.policy import at_least_fp32


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> None:
    """Sum ``tensors`` over ``group`` with one collective on a flat buffer."""
    if group.pg is None or not tensors:
        return
    flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, reduced in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(reduced.view_as(t))


REDUCE_SCATTERS_IN_FLIGHT = 2
"""Stage 2/3 reduce-scatters queued at once: the one just launched and the one before it, which
has had a bucket's worth of backward to complete."""

SQUARES_ROW = 4096
"""Elements per row of :func:`sum_of_squares` (each row's norm is accumulated in one go)."""


def sum_of_squares(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The sum of the squared elements of ``tensors``, in ``dtype``, in one pass and without a
    temporary of their size (``square().sum()`` makes one, which on CPU costs more than the sum,
    fresh pages included). Each tensor is cut into rows of :data:`SQUARES_ROW` elements whose
    norms are then summed: as accurate as ``square().sum()`` to ~1e-7 in fp32, where one
    ``vector_norm`` (or ``_foreach_norm``, as ``clip_grad_norm_`` uses) over millions of fp32
    elements drifts by 1e-5 to 1e-4."""
    rows, rest = [], []
    for t in tensors:
        flat = t.reshape(-1)
        whole = flat.numel() // SQUARES_ROW * SQUARES_ROW
        if whole:
            rows.append(torch.linalg.vector_norm(flat[:whole].view(-1, SQUARES_ROW), dim=1,
                                                 dtype=dtype))
        if whole < flat.numel():
            rest.append(flat[whole:].to(dtype))
    total = torch.cat(rows).square().sum() if rows else None
    if rest:
        tail = torch.cat(rest).square().sum()
        total = tail if total is None else total + tail
    if total is None:
        return torch.zeros((), dtype=dtype, device=tensors[0].device if tensors else None)
    return total


@dataclass
class Bucket:
    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    shapes: list[torch.Size]
    """Shapes of the parameters (kept: ZeRO-3 empties parameters between uses)."""
    numel: int
    """Elements of all its parameters."""
    padded: int
    """``numel`` rounded up so that it splits evenly over the data-parallel ranks."""
    decay: bool
    replicas: int
    group: Group
    """The data-parallel ranks that sum this bucket's gradients (and share its ZeRO shards)."""
    lr_mult: float = 1.0
    """The multiplier of the scheduled learning rate for this bucket's parameters (muP)."""
    grad: torch.Tensor | None = None
    """Flat gradient buffer [padded] while it exists."""
    shard_grad: torch.Tensor | None = None
    """Stage 2/3: the summed gradient of this rank's shard, from the step's first reduction of
    the bucket to the next ``zero_grad``."""
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list, repr=False)
    """Stage 2/3: gradients (parameter index, gradient) that arrived before the bucket's last."""
    arrived: int = 0
    work: dist.Work | None = None
    launched: bool = False
    scratch: torch.Tensor | None = field(default=None, repr=False)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slice of a flat [padded] tensor, shaped like the parameter."""
        shape = self.shapes[i]
        return flat[self.offsets[i] : self.offsets[i] + shape.numel()].view(shape)

    def shard_range(self) -> tuple[int, int]:
        """This rank's ZeRO shard of the flat buffer (one of the bucket group's)."""
        size = self.padded // self.group.size
        return self.group.rank * size, (self.group.rank + 1) * size


def assign_buckets(params: list[nn.Parameter], bucket_bytes: int, group: Group,
                   element_size: int, lr_mults: dict[int, float] | None = None) -> list[Bucket]:
    """Group ``params`` (given in gradient-ready order) into buckets of similar parameters;
    ``group`` is the data-parallel group of parameters without their own; ``lr_mults``: the
    learning-rate multipliers by parameter ``id`` (absent: 1)."""
    lr_mults = lr_mults or {}
    buckets: list[Bucket] = []
    open_: dict[tuple[bool, int, str, str, float], Bucket] = {}
    for param in params:
        layout = layout_of(param)
        sync = layout.grad_sync
        reduce_over = layout.data_parallel if layout.data_parallel is not None else group
        key = (param.dim() >= 2, layout.copies, sync.name if sync is not None else "",
               reduce_over.name, lr_mults.get(id(param), 1.0))
        bucket = open_.get(key)
        if bucket is None or bucket.numel * element_size >= bucket_bytes:
            bucket = Bucket(len(buckets), [], [], [], 0, 0, key[0], key[1], reduce_over,
                            lr_mult=key[4])
            buckets.append(bucket)
            open_[key] = bucket
        bucket.params.append(param)
        bucket.offsets.append(bucket.numel)
        bucket.shapes.append(param.shape)
        bucket.numel += param.numel()
    for bucket in buckets:
        shards = bucket.group.size
        bucket.padded = math.ceil(bucket.numel / shards) * shards
    return buckets


class GradReducer:
    """Owns the gradient buffers of ``params`` and their reduction over ``group`` (dp x cp), or
    each parameter's own ``data_parallel`` group."""

    def __init__(self, params: list[nn.Parameter], group: Group, *, zero_stage: int,
                 bucket_bytes: int, dtype: torch.dtype,
                 units: list[list[nn.Parameter]] | None = None,
                 on_event: Callable[[str, int], None] | None = None,
                 lr_mults: dict[int, float] | None = None):
        self.group = group
        self.zero_stage = zero_stage
        self.dtype = dtype
        self.on_event = on_event
        self.on_launch: Callable[[Bucket], None] | None = None
        element = torch.empty((), dtype=dtype).element_size()
        if units is None:
            self.buckets = assign_buckets(list(reversed(params)), bucket_bytes, group, element,
                                          lr_mults)
        else:  # one or more buckets per unit, never spanning two units
            self.buckets = []
            for unit in reversed(units):
                for bucket in assign_buckets(list(reversed(unit)), 2**62, group, element,
                                             lr_mults):
                    bucket.index = len(self.buckets)
                    self.buckets.append(bucket)
        self._where: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                self._where[id(param)] = (bucket, i)
                param.register_post_accumulate_grad_hook(self._on_grad)
            if zero_stage <= 1:
                bucket.grad = torch.zeros(bucket.padded, dtype=dtype,
                                          device=bucket.params[0].device)
        self.sync = True
        self._in_flight: deque[Bucket] = deque()
        """Stage 2/3: launched buckets whose full-size buffer is not yet summed and freed."""

    # ------------------------------------------------------------------ per micro-batch

    def begin_micro_batch(self, last: bool) -> None:
        """Stage 0/1 communicate only on the last micro-batch of a step; 2/3 on every one."""
        self.sync = last or self.zero_stage >= 2
        for bucket in self.buckets:
            bucket.arrived = 0
            bucket.launched = False

    def _on_grad(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a backward that deferred this weight's gradient (zb-h1)
            return
        bucket, i = self._where[id(param)]
        if self.zero_stage >= 2:
            bucket.pending.append((i, param.grad))  # into the flat buffer at launch
        else:
            bucket.view(bucket.grad, i).add_(param.grad)
        param.grad = None
        bucket.arrived += 1
        if self.on_event:
            self.on_event("grad", bucket.index)
        if self.sync and bucket.arrived == len(bucket.params):
            self._launch(bucket)

    def _flatten(self, bucket: Bucket) -> None:
        """Stage 2/3: the bucket's flat gradient from the gradients it kept, each dropped once
        added (zeros where none arrived: parameters without gradient, padding)."""
        bucket.grad = torch.zeros(bucket.padded, dtype=self.dtype,
                                  device=bucket.params[0].device)
        pending, bucket.pending = bucket.pending, []
        pending.reverse()
        while pending:
            i, grad = pending.pop()
            bucket.view(bucket.grad, i).add_(grad)
            del grad

    def _launch(self, bucket: Bucket) -> None:
        if self.zero_stage >= 2:
            self._flatten(bucket)
        bucket.launched = True
        if self.on_event:
            self.on_event("reduce", bucket.index)
        if self.on_launch:
            self.on_launch(bucket)
        if self.zero_stage >= 2:
            self._in_flight.append(bucket)
        if bucket.group.pg is not None:
            if self.zero_stage == 0:
                bucket.work = start_all_reduce(bucket.grad, bucket.group)
            elif self.zero_stage == 1:
                bucket.work = start_reduce_scatter(bucket.grad, bucket.group)
            else:
                bucket.scratch = torch.empty(bucket.padded // bucket.group.size,
                                             dtype=self.dtype, device=bucket.grad.device)
                bucket.work = start_reduce_scatter(bucket.grad, bucket.group, out=bucket.scratch)
        while len(self._in_flight) > REDUCE_SCATTERS_IN_FLIGHT:
            self._finish(self._in_flight.popleft())

    def _finish(self, bucket: Bucket) -> None:
        """Stage 2/3: wait for the bucket's reduce-scatter, add this rank's summed shard into
        its persistent gradient and free the full-size buffer."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        start, end = bucket.shard_range()
        summed = bucket.scratch if bucket.scratch is not None else bucket.grad[start:end]
        if bucket.shard_grad is None:  # the step's first reduction of this bucket
            bucket.shard_grad = summed
        else:
            bucket.shard_grad.add_(summed)
        bucket.grad = bucket.scratch = None

    def end_micro_batch(self) -> None:
        """Launch what did not complete (parameters without gradient) and wait for all."""
        if not self.sync:
            return
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    # ------------------------------------------------------------------ after the step's backward

    def zero_grad(self) -> None:
        """Stage 0/1 zero their persistent buffers; 2/3 drop every gradient (the next
        backward makes them again)."""
        for bucket in self.buckets:
            if self.zero_stage >= 2:
                bucket.grad = bucket.shard_grad = None
                bucket.pending = []
            elif bucket.grad is not None:
                bucket.grad.zero_()

    def local_grad(self, bucket: Bucket) -> torch.Tensor:
        """The reduced gradient this rank owns: the whole bucket (stage 0) or its shard."""
        if self.zero_stage == 0:
            return bucket.grad
        if self.zero_stage >= 2:
            if bucket.shard_grad is None:  # no reduction since zero_grad: a zero gradient
                bucket.shard_grad = torch.zeros(bucket.padded // bucket.group.size,
                                                dtype=self.dtype, device=bucket.params[0].device)
            return bucket.shard_grad
        start, end = bucket.shard_range()
        return bucket.grad[start:end]

    def sync_replicated(self) -> None:
        """Sum gradients of parameters with a ``grad_sync`` group over it (e.g. norm weights
        under sequence parallelism): the part of each that lies in this rank's gradient."""
        pieces: dict[int, tuple[Group, list[torch.Tensor]]] = {}
        for bucket in self.buckets:
            start, end = (0, bucket.padded) if self.zero_stage == 0 else bucket.shard_range()
            local = self.local_grad(bucket)
            for i, param in enumerate(bucket.params):
                group = layout_of(param).grad_sync
                lo = max(start, bucket.offsets[i])
                hi = min(end, bucket.offsets[i] + bucket.shapes[i].numel())
                if group is not None and lo < hi:
                    piece = local[lo - start : hi - start]
                    pieces.setdefault(id(group), (group, []))[1].append(piece)
        for group, tensors in pieces.values():
            all_reduce_coalesced(tensors, group)

    def grad_norm_squared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sums of squared gradients held here, each replicated copy counted once: of the
        parameters reduced over ``group``, and of those with their own data-parallel group."""
        device = self.buckets[0].params[0].device
        dtype = at_least_fp32(self.dtype)
        totals = [torch.zeros((), dtype=dtype, device=device) for _ in range(2)]
        for bucket in self.buckets:
            squares = sum_of_squares([self.local_grad(bucket)], dtype)
            totals[0 if bucket.group is self.group else 1] += squares / bucket.replicas
        return totals[0], totals[1]

    def scale_(self, factor: float) -> None:
        """Multiply every gradient by ``factor`` (a scalar of the norm's dtype: fp32, or fp64
        in fp64 runs)."""
        scalar = torch.tensor(factor, dtype=at_least_fp32(self.dtype))
        for bucket in self.buckets:
            self.local_grad(bucket).mul_(scalar)

    def point_param_grads(self) -> None:
        """Point every parameter's ``.grad`` at its slice of the reduced buffers (for torch's
        AdamW, which reads ``.grad``; a copy if the buckets are not in the parameters' dtype)."""
        for bucket in self.buckets:
            for i, param in enumerate(bucket.params):
                param.grad = bucket.view(bucket.grad, i).to(param.dtype)

    def grad_bytes(self) -> int:
        """Bytes of gradient storage kept between steps on this rank: the whole buckets
        (stage 0/1) or this rank's shards (2/3, which exist from the end of a backward to the
        next ``zero_grad``, so counted whether or not they exist now)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        if self.zero_stage >= 2:
            return sum(b.padded // b.group.size for b in self.buckets) * element
        return sum(b.grad.numel() for b in self.buckets if b.grad is not None) * element
