"""Collectives that count their bytes, and the autograd functions of tensor/sequence parallelism.

Byte accounting (recorded in the group's :class:`CommStats`) counts what one rank sends over
the wire with ring algorithms (the "bus bytes" of nccl-tests): for a group of n ranks and a full
buffer of X bytes, an all-reduce sends 2(n-1)/n X, an all-gather or a reduce-scatter (n-1)/n X.
So a sequence-parallel layer (all-gather + reduce-scatter) moves exactly the bytes of its
all-reduce twin.

The four region functions of Megatron's tensor parallelism (sequence dim = 1, [b, s, h]):

==================  ==========================  ==========================
function            forward                     backward
==================  ==========================  ==========================
copy_to_tp          identity                    all-reduce
reduce_from_tp      all-reduce                  identity
gather_from_sp      all-gather along sequence   reduce-scatter
reduce_scatter_sp   reduce-scatter along seq.   all-gather
==================  ==========================  ==========================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.tensor import exchange

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wire_bytes(full: torch.Tensor, group: Group, passes: int = 1) -> int:
    """Bytes one rank sends in ``passes`` ring passes over a buffer the size of ``full``."""
    return passes * full.numel() * full.element_size() * (group.size - 1) // group.size


def all_reduce(t: torch.Tensor, group: Group,
               op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (a no-op on a group of one)."""
    if group.pg is not None:
        group.stats.record(group.name, "all_reduce", _wire_bytes(t, group, passes=2))
        if exchange.can_all_reduce(t, group, op):
            exchange.all_reduce(t, group, op)
        else:
            dist.all_reduce(t, op=op, group=group.pg)
    return t


def all_gather(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim``."""
    if group.pg is None:
        return t
    t = t.contiguous()
    out = torch.empty((group.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    group.stats.record(group.name, "all_gather", _wire_bytes(out, group))
    if exchange.one_round(group, out.numel() * out.element_size(), out.device):
        exchange.all_gather(out, t, group)
    else:
        _all_gather(out, t, group=group.pg)
    if dim == 0:
        return out
    return out.unflatten(0, (group.size, t.shape[0])).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum over ranks, each keeping its 1/size chunk of ``dim``."""
    if group.pg is None:
        return t
    chunks = t.unflatten(dim, (group.size, t.shape[dim] // group.size)).movedim(dim, 0)
    out = torch.empty(chunks.shape[1:], dtype=t.dtype, device=t.device)
    group.stats.record(group.name, "reduce_scatter", _wire_bytes(chunks, group))
    if exchange.one_round(group, t.numel() * t.element_size(), t.device):
        exchange.reduce_scatter(out, chunks.contiguous().flatten(0, 1), group)
    else:
        _reduce_scatter(out, chunks.contiguous().flatten(0, 1), group=group.pg)
    return out


def start_all_reduce(flat: torch.Tensor, group: Group
                     ) -> dist.Work | exchange.Exchange | None:
    """Begin an in-place sum of ``flat`` over ``group``; wait on the returned handle."""
    if group.pg is None:
        return None
    group.stats.record(group.name, "all_reduce", _wire_bytes(flat, group, passes=2))
    if exchange.can_all_reduce(flat, group, dist.ReduceOp.SUM):
        return exchange.all_reduce(flat, group, async_op=True)
    return dist.all_reduce(flat, group=group.pg, async_op=True)


def start_reduce_scatter(flat: torch.Tensor, group: Group, out: torch.Tensor | None = None
                         ) -> dist.Work | exchange.Exchange | None:
    """Begin summing ``flat`` over ``group`` into this rank's 1/size chunk.

    The result goes to ``out``, by default the rank's own chunk of ``flat`` (in place).
    """
    if group.pg is None:
        return None
    chunk = flat.numel() // group.size
    out = flat[group.rank * chunk : (group.rank + 1) * chunk] if out is None else out
    group.stats.record(group.name, "reduce_scatter", _wire_bytes(flat, group))
    if exchange.one_round(group, flat.numel() * flat.element_size(), flat.device):
        return exchange.reduce_scatter(out, flat, group, async_op=True)
    return _reduce_scatter(out, flat, group=group.pg, async_op=True)


def start_all_gather(flat: torch.Tensor, group: Group) -> dist.Work | None:
    """Begin filling ``flat`` with every rank's chunk, in place from this rank's own chunk."""
    if group.pg is None:
        return None
    chunk = flat.numel() // group.size
    group.stats.record(group.name, "all_gather", _wire_bytes(flat, group))
    mine = flat[group.rank * chunk : (group.rank + 1) * chunk]
    if exchange.one_round(group, flat.numel() * flat.element_size(), flat.device):
        return exchange.all_gather(flat, mine, group, async_op=True)
    return _all_gather(flat, mine, group=group.pg, async_op=True)


def local_chunk(t: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's 1/size slice of ``dim`` (no communication)."""
    if group.pg is None:
        return t
    return t.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group, dim=1), None


class _ReduceScatterSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=1), None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return local_chunk(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group, dim=1), None


class _GatherToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return local_chunk(grad, ctx.group, dim=1), None


def split_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.pg is None else _SplitToTP.apply(x, group)


def gather_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.pg is None else _GatherToTP.apply(x, group)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.pg is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.pg is None else _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.pg is None else _GatherFromSP.apply(x, group)


def reduce_scatter_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.pg is None else _ReduceScatterSP.apply(x, group)
