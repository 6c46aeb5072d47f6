"""All-to-all attention (DeepSpeed-Ulysses): trade the sequence split for a head split.

Before the attention core one all-to-all over cp turns this rank's queries, keys and values of
its two chunks and all its heads into the whole sequence for 1/cp of the heads; the core then
runs as in one process (causal, or with the document mask) and a second all-to-all turns its
output back. Needs this rank's query heads divisible by cp; kv heads that are fewer than cp are
repeated so each rank gets the one its query heads share (cp a multiple of the kv heads).

Bytes per call (each all-to-all sends (cp − 1)/cp of its tensor): q, k, v and the output
forward, and their gradients backward, counted as ``cp/all_to_all``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtron.parallel.context.core import attention_core
from meshtron.parallel.context.sequence import Sequence, attention_mask, rank_chunks
from meshtron.parallel.mesh.groups import Group


def _all_to_all(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Part ``i`` of dim 0 of ``x`` [cp, ...] goes to rank i; part ``i`` of the result came
    from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)
    group.stats.record(group.name, "all_to_all",
                       x.numel() * x.element_size() * (group.size - 1) // group.size)
    dist.all_to_all_single(out, x, group=group.pg)
    return out


def _to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, H, L, d] (all heads, this rank's chunks) -> [b, H/cp, S, d] (this rank's heads,
    the whole sequence in order)."""
    cp = group.size
    b, heads, length, d = x.shape
    received = _all_to_all(x.view(b, cp, heads // cp, length, d).transpose(0, 1), group)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for source in range(cp):
        first, second = received[source].chunk(2, dim=2)
        a, z = rank_chunks(source, cp)
        chunks[a], chunks[z] = first, second
    return torch.cat(chunks, dim=2)  # type: ignore[arg-type]


def _to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Inverse of :func:`_to_heads`."""
    cp = group.size
    b, heads, seq, d = x.shape
    chunks = x.chunk(2 * cp, dim=2)
    parts = torch.stack([torch.cat([chunks[i] for i in rank_chunks(r, cp)], dim=2)
                         for r in range(cp)])  # [cp (destination), b, H/cp, L, d]
    return _all_to_all(parts, group).transpose(0, 1).reshape(b, cp * heads, seq // cp, d)


class _Regroup(torch.autograd.Function):
    """:func:`_to_heads` (or :func:`_to_sequence`) forward, the other one backward."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_to_heads if to_heads else _to_sequence)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_to_sequence if ctx.to_heads else _to_heads)(grad, ctx.group), None, None


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                         sequence: Sequence) -> torch.Tensor:
    """Causal attention of this rank's q [b, heads, L, d] with k, v [b, kv_heads, L, d] over
    the whole sequence spread over ``group`` (cp) in chunks; the output is q-shaped."""
    cp, kv_heads = group.size, k.shape[1]
    if kv_heads % cp:  # fewer kv heads than ranks: each rank gets the one its queries use
        k = k.repeat_interleave(cp // kv_heads, dim=1)
        v = v.repeat_interleave(cp // kv_heads, dim=1)
    qh, kh, vh = (_Regroup.apply(t, group, True) for t in (q, k, v))
    seq = qh.shape[2]
    mask = None
    if sequence.documents is not None:
        index = torch.arange(seq, device=q.device)
        mask = attention_mask(index, index, sequence.documents, sequence.documents)
    return _Regroup.apply(attention_core(qh, kh, vh, mask), group, False)
