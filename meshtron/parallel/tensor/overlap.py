"""Sequence-parallel communication overlapped with the matrix products beside it.

Under sequence parallelism the column-parallel products of a block need the whole sequence (an
all-gather before them) and the row-parallel product leaves partial sums to be added and split
by sequence again (a reduce-scatter after it). Done whole, each collective and its product wait
for one another. Here, as in Megatron's tp-comm-overlap, each rank's share of the sequence is
cut into ``chunks`` pieces and piece j of every rank travels as one asynchronous collective
while the products of the pieces already there run, in forward and in backward: only the first
piece's gather (or the last piece's reduce-scatter) is left exposed. The bytes sent are those
of the unchunked collectives, exactly.

Row order. The gathered sequence is rank-major: position (r, j, i) is rank r's piece j, row i.
The collective of piece j carries rows (0, j, .), (1, j, .), ... as a [tp, b, c, .] block; its
products are written back in place, so every output row is the unchunked one's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.parallel.mesh.groups import Group
from meshtron.parallel.tensor.collectives import start_all_gather, start_reduce_scatter


def _by_piece(full: torch.Tensor, tp: int, chunks: int) -> torch.Tensor:
    """A whole-sequence [b, s, n] tensor as [b, tp, chunks, c, n]: [:, :, j] is piece j of
    every rank."""
    b, s, n = full.shape
    return full.reshape(b, tp, chunks, s // (tp * chunks), n)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dimension's rows."""
    return t.reshape(-1, t.shape[-1])


def _start_gathers(x: torch.Tensor, group: Group, chunks: int
                   ) -> list[tuple[torch.Tensor, dist.Work | None]]:
    """Begin gathering each piece of this rank's [b, s/tp, n] share: per piece a [tp, b, c, n]
    buffer and its pending all-gather."""
    started = []
    for piece in x.chunk(chunks, dim=1):
        buffer = x.new_empty((group.size, *piece.shape))
        buffer[group.rank].copy_(piece)
        started.append((buffer, start_all_gather(buffer.view(-1), group)))
    return started


def _start_reduce_scatter(block: torch.Tensor, group: Group
                          ) -> tuple[torch.Tensor, torch.Tensor, dist.Work | None]:
    """Begin summing a [tp, b, c, n] block of partial rows over ``group``, this rank keeping
    its own [b, c, n]; the block is returned too, to live until the work is done."""
    block = block.contiguous()
    out = block.new_empty(block.shape[1:])
    return block, out, start_reduce_scatter(block.view(-1), group, out.view(-1))


def _finish(started: list[tuple[torch.Tensor, torch.Tensor, dist.Work | None]]) -> torch.Tensor:
    """Wait for the reduce-scatters of every piece; this rank's rows in sequence order."""
    for _, _, work in started:
        if work is not None:
            work.wait()
    return torch.cat([out for _, out, _ in started], dim=1)


class _GatherThenLinear(torch.autograd.Function):
    """``F.linear(all_gather(x), w_m, b_m)`` for every product m, the gather chunked."""

    @staticmethod
    def forward(ctx, x, group, chunks, count, *params):
        weights, biases = params[:count], params[count:]
        b, share, _ = x.shape
        outs = [x.new_empty((b, group.size, chunks, share // chunks, w.shape[0]))
                for w in weights]
        started = _start_gathers(x, group, chunks)
        for j, (rows, work) in enumerate(started):
            if work is not None:
                work.wait()
            for out, weight, bias in zip(outs, weights, biases):
                out[:, :, j] = F.linear(rows, weight, bias).transpose(0, 1)
        ctx.save_for_backward(*(rows for rows, _ in started), *weights)
        ctx.group, ctx.chunks, ctx.biased = group, chunks, [bias is not None for bias in biases]
        return tuple(out.view(b, share * group.size, -1) for out in outs)

    @staticmethod
    def backward(ctx, *grads):
        group, chunks = ctx.group, ctx.chunks
        saved = ctx.saved_tensors  # read once (a recomputed forward's unpack is one-shot)
        gathered, weights = saved[:chunks], saved[chunks:]
        pieces = [_by_piece(g, group.size, chunks) for g in grads]
        started = []
        if ctx.needs_input_grad[0]:
            for j in range(chunks):
                block = sum(p[:, :, j].transpose(0, 1) @ w.to(p.dtype)
                            for p, w in zip(pieces, weights))
                started.append(_start_reduce_scatter(block, group))
        grad_weights: list[torch.Tensor | None] = []
        for m, (piece, weight) in enumerate(zip(pieces, weights)):
            grad_w = None
            if ctx.needs_input_grad[4 + m]:
                for j, rows in enumerate(gathered):
                    part = _rows(piece[:, :, j].transpose(0, 1)).t() @ _rows(rows).to(piece.dtype)
                    grad_w = part if grad_w is None else grad_w.add_(part)
                grad_w = grad_w.to(weight.dtype)
            grad_weights.append(grad_w)
        grad_biases = [_rows(g).sum(0) if biased else None for g, biased in zip(grads, ctx.biased)]
        grad_x = _finish(started) if started else None
        return (grad_x, None, None, None, *grad_weights, *grad_biases)


class _LinearThenReduceScatter(torch.autograd.Function):
    """``reduce_scatter(F.linear(x, w))`` along the sequence, the products chunked against the
    reduce-scatters."""

    @staticmethod
    def forward(ctx, x, weight, group, chunks):
        pieces = _by_piece(x, group.size, chunks)
        started = [_start_reduce_scatter(F.linear(pieces[:, :, j].transpose(0, 1), weight),
                                         group) for j in range(chunks)]
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.chunks = group, chunks
        return _finish(started)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        group, chunks = ctx.group, ctx.chunks
        pieces = _by_piece(x, group.size, chunks)
        grad_x = torch.empty_like(pieces, dtype=grad_y.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        for j, (rows, work) in enumerate(_start_gathers(grad_y.contiguous(), group, chunks)):
            if work is not None:
                work.wait()
            if grad_x is not None:
                grad_x[:, :, j] = (rows @ weight.to(rows.dtype)).transpose(0, 1)
            if ctx.needs_input_grad[1]:
                part = _rows(rows).t() @ _rows(pieces[:, :, j].transpose(0, 1)).to(rows.dtype)
                grad_w = part if grad_w is None else grad_w.add_(part)
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return grad_x, None if grad_w is None else grad_w.to(weight.dtype), None, None


def gather_then_linear(x: torch.Tensor, group: Group, chunks: int,
                       weights: Sequence[torch.Tensor],
                       biases: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """``F.linear(gather(x), w, b)`` for each weight and bias, ``x`` being this rank's
    [b, s/tp, h] share of the sequence: the all-gather in ``chunks`` pieces per rank, each
    product starting on the pieces already gathered; backward reduce-scatters the input
    gradient piece by piece while the weight gradients are formed."""
    return list(_GatherThenLinear.apply(x, group, chunks, len(weights), *weights, *biases))


def linear_then_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group,
                               chunks: int) -> torch.Tensor:
    """This rank's [b, s/tp, h] share of ``sum over tp of F.linear(x, weight)``, ``x`` being
    the whole sequence of this rank's input features: the reduce-scatter of each piece starts
    while the next piece's product runs; backward gathers the output gradient piece by piece
    against the input- and weight-gradient products."""
    return _LinearThenReduceScatter.apply(x, weight, group, chunks)
