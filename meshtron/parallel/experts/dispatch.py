"""Expert parallelism: token dispatch over the ep group.

A rank holds ``num_experts / ep`` consecutive experts (rank r: experts r*El .. (r+1)*El - 1).
Each MoE layer sends every routed token copy to the rank holding its expert and brings the
expert's output back, with two ``all_to_all_single`` calls with uneven split sizes (gloo's list
form of all-to-all rejects uneven sizes). The per-expert counts are exchanged first, so every
rank knows how many rows it receives from whom.

Rows on the wire are ordered by expert (the sender sorts them), so what a rank receives is
[source 0: its experts in order | source 1: ... ]; :class:`Dispatch` regroups that by local
expert for one grouped matmul, and undoes it before the return trip.

Bytes are counted as what this rank sends to the others (rows to itself never leave it):
``ep/all_to_all`` for token rows (both directions, forward and backward) and ``ep/counts`` for
the count exchange.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from meshtron.parallel.mesh.groups import Group


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: Group, kind: str) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    sent = sum(n for peer, n in enumerate(in_splits) if peer != group.rank)
    group.stats.record(group.name, kind, sent * row_bytes)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group.pg)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``in_splits`` go to the group's ranks in order; the result holds
    ``out_splits`` rows from each. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group, "all_to_all")

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group, "all_to_all"), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
               group: Group) -> torch.Tensor:
    if group.pg is None:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group)


class Dispatch:
    """Where the rows a rank sends (``send_counts`` per global expert, ordered by expert) end
    up, and how many rows each local expert receives."""

    def __init__(self, send_counts: torch.Tensor, group: Group):
        self.group = group
        ep = group.size
        local = send_counts.numel() // ep
        if group.pg is None:
            received = send_counts.view(1, local)
        else:
            received = torch.empty_like(send_counts)
            group.stats.record(group.name, "counts",
                               (ep - 1) * local * send_counts.element_size())
            dist.all_to_all_single(received, send_counts, group=group.pg)
            received = received.view(ep, local)
        self.send_splits = send_counts.view(ep, local).sum(1).tolist()
        self.recv_splits = received.sum(1).tolist()
        self.expert_counts = received.sum(0)
        """Rows per local expert after regrouping."""
        self.source_counts = received.t()
        """Rows per local expert from each source rank [local, ep], in the order regrouping
        leaves them (a micro-batch of each rank, one after the other)."""
        self.regroup: torch.Tensor | None = None
        if ep > 1 and local > 1:
            # received rows are (source, expert)-major; order them (expert, source)-major
            flat = received.reshape(-1)
            source_start = torch.cumsum(flat, 0) - flat
            lengths = received.t().reshape(-1)
            owner = torch.arange(ep * local).view(ep, local).t().reshape(-1)
            target_start = torch.cumsum(lengths, 0) - lengths
            shift = torch.repeat_interleave(source_start[owner] - target_start, lengths)
            self.regroup = torch.arange(len(shift)) + shift

    def send(self, rows: torch.Tensor) -> torch.Tensor:
        """Sender-ordered rows -> this rank's rows grouped by local expert."""
        received = all_to_all(rows, self.recv_splits, self.send_splits, self.group)
        return received if self.regroup is None else received[self.regroup]

    def back(self, rows: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`send`: expert outputs back to the ranks (and order) they came
        from."""
        if self.regroup is not None:
            rows = torch.zeros_like(rows).index_copy(0, self.regroup, rows)
        return all_to_all(rows, self.send_splits, self.recv_splits, self.group)
