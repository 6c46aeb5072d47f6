"""Small collectives on gloo as one all-to-all round instead of a ring.

gloo runs all-reduce and reduce-scatter as rings: an all-reduce over n ranks is 2(n - 1)
steps in sequence, each a message that the next rank must wait for and wake up to. For the
small tensors of tensor-parallel activations, losses, norms and small gradient buckets the
steps' latency, not the bytes, is the cost: on a 2-core CPU machine with 4 ranks a 4-16 KB
all-reduce took 4.4-7.0 ms, the same bytes sent to every peer at once in one all-to-all and
summed locally 0.5-1.7 ms (``benchmarks/small_collectives.py``; docs/performance.md).
Two ranks gain nothing (a ring of two is already one exchange), and large buffers keep the
ring, which sends each rank's bytes once rather than to every peer.

The exchanged rows are summed (or maxed) in rank order on every rank, so every rank gets the
same bits, as with the ring. A reduce-scatter or all-gather sends exactly the ring's bytes in
one round. The byte accounting of :mod:`meshtron.parallel.tensor.collectives` stays the
ring's (the "bus bytes" of nccl-tests), whichever way the bytes go.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from meshtron.parallel.mesh.groups import Group

MAX_EXCHANGE_BYTES = 1 << 20
"""The largest buffer (every rank's rows together) exchanged in one round; larger ones go
through gloo's own algorithms. At 4 ranks the one round stopped paying between 256 KB and
1 MB per rank for an all-reduce (which sends n - 1 copies where the ring sends 2(n - 1)/n)."""

_REDUCIBLE = (dist.ReduceOp.SUM, dist.ReduceOp.MAX)


def one_round(group: Group, exchanged_bytes: int, device: torch.device) -> bool:
    """Whether a collective over ``group`` whose rows total ``exchanged_bytes`` goes as one
    all-to-all round: gloo, more than two ranks, CPU tensors, a small buffer."""
    return (group.size > 2 and device.type == "cpu" and exchanged_bytes <= MAX_EXCHANGE_BYTES
            and group.backend == "gloo")


def can_all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp) -> bool:
    return (op in _REDUCIBLE and t.dtype != torch.bool
            and one_round(group, group.size * t.numel() * t.element_size(), t.device))


class Exchange:
    """An all-to-all in flight and what to do once it has arrived: a ``dist.Work`` to the
    callers, who only ``wait()``."""

    def __init__(self, work: dist.Work, finish: Callable[[], None] | None = None) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> bool:
        self.work.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True


def _fold(rows: torch.Tensor, out: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """``out`` = rows[0] op rows[1] op ... in rank order (the same bits on every rank)."""
    acc = rows[0].clone()
    for row in rows[1:]:
        if op == dist.ReduceOp.SUM:
            acc.add_(row)
        else:
            torch.maximum(acc, row, out=acc)
    out.copy_(acc.view_as(out))


def all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM,
               async_op: bool = False) -> Exchange | None:
    """``t`` reduced over ``group`` in place: every rank sends all of ``t`` to every peer."""
    flat = t.reshape(-1)
    rows = flat.new_empty((group.size, flat.numel()))
    work = dist.all_to_all_single(rows, flat.repeat(group.size), group=group.pg,
                                  async_op=async_op)
    if not async_op:
        _fold(rows, t, op)
        return None
    return Exchange(work, lambda: _fold(rows, t, op))


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group: Group,
                   async_op: bool = False) -> Exchange | None:
    """``out`` = the sum over ranks of their ``flat``'s chunk of this rank (``flat``: the
    n chunks in rank order, as for ``reduce_scatter_tensor``)."""
    rows = flat.new_empty((group.size, flat.numel() // group.size))
    work = dist.all_to_all_single(rows, flat, group=group.pg, async_op=async_op)
    if not async_op:
        _fold(rows, out)
        return None
    return Exchange(work, lambda: _fold(rows, out))


def all_gather(out: torch.Tensor, mine: torch.Tensor, group: Group,
               async_op: bool = False) -> dist.Work | None:
    """``out`` = every rank's ``mine`` in rank order (``mine`` may be a view into ``out``)."""
    return dist.all_to_all_single(out, mine.reshape(-1).repeat(group.size), group=group.pg,
                                  async_op=async_op)
